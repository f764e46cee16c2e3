"""The ExecuTorch device learner guards itself as the ONNX Runtime one does (tests/test_device_guard.py):
a poisoned step is undone, parameters and SGD momentum bit for bit, and the learner keeps learning;
predict never returns NaN silently; damaged parameters are refused at load."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("executorch.extension.training")

from taste_cl import OnlineLearner
from taste_cl.adapters.executorch.learner import EtOnlineLearner
from taste_cl.exceptions import ArtifactError, NonFiniteOutputError

pytestmark = pytest.mark.usefixtures("one_thread")


def _stream(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((3, 6)).astype(np.float32) * 2
    return [((centres[y] + rng.standard_normal((8, 6))).astype(np.float32), y) for y in (rng.integers(0, 3, 8) for _ in range(n))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in _stream(6, seed=0):
        learner.observe((torch.from_numpy(x), torch.from_numpy(y)))
    return learner.export(tmp_path_factory.mktemp("et") / "art", backend="executorch", example=tuple(map(torch.from_numpy, _stream(1, 9)[0])))


def _state(device: EtOnlineLearner) -> dict[str, np.ndarray]:
    state = device.parameters()
    trainer = device.trainer
    for name, p in trainer.params.items():
        if p in trainer.optimizer.state:
            state[f"momentum:{name}"] = trainer.optimizer.state[p]["momentum_buffer"].numpy().copy()
    return state


def test_a_poisoned_step_is_undone_bit_for_bit_with_the_momentum(folder: Path) -> None:
    poisoned, twin = EtOnlineLearner.from_artifacts(folder), EtOnlineLearner.from_artifacts(folder)
    healthy = _stream(8, seed=1)
    for batch in healthy[:4]:
        poisoned.observe(batch)
        twin.observe(batch)
    before = _state(poisoned)
    assert any(key.startswith("momentum:") for key in before)
    lr = poisoned.lr
    poisoned.lr = lr * 1e4
    stats = poisoned.observe(_stream(1, seed=5)[0])
    poisoned.lr = lr
    assert stats.skipped and "times their norm" in str(poisoned.guard.last_cause)
    after = _state(poisoned)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    for batch in healthy[4:]:
        assert not poisoned.observe(batch).skipped
        twin.observe(batch)
    theirs = _state(twin)
    assert all(np.array_equal(value, theirs[key]) for key, value in _state(poisoned).items())


def test_weights_that_overflow_give_an_error_from_predict_and_no_score(folder: Path) -> None:
    device = EtOnlineLearner.from_artifacts(folder)
    device.trainer.load_parameters({name: np.full_like(value, 1e30) for name, value in device.parameters().items()})
    x, y = _stream(1, seed=3)[0]
    with pytest.raises(NonFiniteOutputError, match=r"NaN or infinite outputs for [1-8] of 8 rows"):
        device.predict(x)
    assert math.isnan(device.observe((x, y)).accuracy)


def test_a_folder_with_damaged_parameters_is_refused_at_load(folder: Path, tmp_path: Path) -> None:
    device = EtOnlineLearner.from_artifacts(folder)
    name, parameter = next(iter(device.trainer.params.items()))
    with torch.no_grad():
        parameter.view(-1)[0] = math.nan  # what a corrupted write leaves (load_parameters refuses NaN)
    saved = device.save(tmp_path / "damaged")
    with pytest.raises(ArtifactError, match=rf"'{name}'\]? holds? NaN or infinite values"):
        EtOnlineLearner.from_artifacts(saved)


def test_the_guard_history_resumes_from_a_saved_folder(folder: Path, tmp_path: Path) -> None:
    device = EtOnlineLearner.from_artifacts(folder)
    for batch in _stream(4, seed=4):
        device.observe(batch)
    assert EtOnlineLearner.from_artifacts(device.save(tmp_path / "saved")).guard.state_dict() == device.guard.state_dict()


def test_a_gate_on_generated_rows_says_so_and_the_device_measures_its_first_steps(tmp_path: Path) -> None:
    import json

    from taste_cl.exceptions import GeneratedRowsWarning

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), input_shape=(6,), num_classes=3)
    with pytest.warns(GeneratedRowsWarning, match=r"exporting for executorch: the parity gate trained on generated rows"):
        folder = learner.export(tmp_path / "art", backend="executorch")
    assert json.loads((folder / "manifest.json").read_text())["parity"]["rows"] == "generated"
    device = EtOnlineLearner.from_artifacts(folder)
    for batch in _stream(20, seed=7):
        device.observe(batch)
    assert device.guard.protect_first == 20 and device.guard.protected_steps == 20
