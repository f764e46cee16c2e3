"""The device learner guards itself like the torch learner: a step that would blow the model up is
undone bit for bit and the learner keeps learning; damaged weights are refused at load; ``predict``
never returns NaN silently; nothing is scored from non-finite outputs; the guard's history resumes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rehash
from torch import nn

pytestmark = pytest.mark.training_build

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import ArtifactError, ExportError, GeneratedRowsWarning, NonFiniteOutputError
from taste_cl.guards.device import DeviceUpdateGuard

POISON_LR = 1e4  # under any max_lr: only the size of the step it makes can refuse it


def _stream(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((3, 6)).astype(np.float32) * 2
    batches = []
    for _ in range(n):
        y = rng.integers(0, 3, 8)
        batches.append(((centres[y] + rng.standard_normal((8, 6))).astype(np.float32), y))
    return batches


def _learner(optimizer: str, replay: bool) -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    make = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=0.01)
    learner = OnlineLearner(model, optimizer=make, replay=ReservoirReplay(40, seed=0) if replay else None, replay_batch_size=4 if replay else 0)
    for x, y in _stream(6, seed=0):
        learner.observe((torch.from_numpy(x), torch.from_numpy(y)))
    return learner


@pytest.fixture(scope="module", params=["sgd", "adamw"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained MLP without replay (so twin device learners draw nothing that could differ), exported."""
    learner = _learner(request.param, replay=False)
    return learner.export(tmp_path_factory.mktemp(request.param) / "art", backend="onnxruntime", example=tuple(map(torch.from_numpy, _stream(1, 9)[0])))


def _state(device: OrtOnlineLearner) -> dict[str, np.ndarray]:
    state = device.parameters()
    state.update({f"momentum:{name}": value.copy() for name, value in device.session.sgd_state.items()})
    return state


def _equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_poisoned_step_is_undone_bit_for_bit_and_the_optimizer_state_with_it(folder: Path) -> None:
    """Two device learners from one folder: one meets a step at 1e4x the learning rate between the same
    healthy steps. It is refused and undone, and the next healthy steps are bit-identical to the twin's:
    parameters and optimizer state (SGD momentum; AdamW's moments and step count) were restored exactly."""
    poisoned, twin = OrtOnlineLearner.from_artifacts(folder), OrtOnlineLearner.from_artifacts(folder)
    healthy = _stream(8, seed=1)
    for batch in healthy[:4]:
        poisoned.observe(batch)
        twin.observe(batch)
    before = _state(poisoned)
    lr = poisoned.lr
    poisoned.lr = lr * POISON_LR
    stats = poisoned.observe(_stream(1, seed=5)[0])
    poisoned.lr = lr
    assert stats.skipped and stats.steps == 0
    assert poisoned.guard.refused_steps == 1 and "times their norm" in str(poisoned.guard.last_cause)
    assert _equal(_state(poisoned), before)
    for batch in healthy[4:]:
        assert not poisoned.observe(batch).skipped
        twin.observe(batch)
    assert _equal(_state(poisoned), _state(twin))
    assert np.isfinite(poisoned.predict(healthy[0][0])).all()


def test_the_torch_learner_refuses_the_same_poisoned_step() -> None:
    """The rule is one (taste_cl.guards.size_rule): torch's guard refuses the step the device guard refuses."""
    learner = _learner("sgd", replay=False)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    for group in learner.optimizer.param_groups:
        group["lr"] *= POISON_LR
    x, y = _stream(1, seed=5)[0]
    assert learner.observe((torch.from_numpy(x), torch.from_numpy(y))).skipped
    assert all(torch.equal(p, before[name]) for name, p in learner.model.named_parameters())


def test_healthy_steps_are_measured_rarely(folder: Path) -> None:
    """Copy protection stays off most of the healthy path: the first step, 1 in 50 to keep the typical size
    current, and steps whose LR x gradient norm jumps 10x over its running mean (a hard batch after easy ones)."""
    device = OrtOnlineLearner.from_artifacts(folder)
    for batch in _stream(60, seed=2) * 2:
        device.observe(batch)
    assert device.guard.refused_steps == 0
    assert 1 <= device.guard.protected_steps <= 120 // 8


def test_weights_that_overflow_give_an_error_from_predict_and_no_score(folder: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folder)
    huge = {name: np.full_like(value, 1e30) for name, value in device.parameters().items()}
    device.load_parameters(huge)  # finite, so accepted; the outputs overflow
    x, y = _stream(1, seed=3)[0]
    with pytest.raises(NonFiniteOutputError, match=r"NaN or infinite outputs for [1-8] of 8 rows"):
        device.predict(x)
    stats = device.observe((x, y))
    assert math.isnan(stats.accuracy) and stats.skipped


def test_a_folder_with_damaged_weights_is_refused_at_load(folder: Path, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folder)
    name = next(iter(device.session.spec.trainable))
    value = device.session.state.get_parameter(name).data.numpy().copy()
    value.flat[0] = np.nan
    device.session.write_parameter(name, value)  # what a corrupted write leaves (load_parameters refuses NaN)
    saved = device.save(tmp_path / "damaged", web=False)
    with pytest.raises(ArtifactError, match=r"hold NaN or infinite values: the model is damaged"):
        OrtOnlineLearner.from_artifacts(saved)


def test_the_guard_history_resumes_from_a_saved_folder(folder: Path, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folder)
    for batch in _stream(5, seed=4):
        device.observe(batch)
    resumed = OrtOnlineLearner.from_artifacts(device.save(tmp_path / "saved", web=False))
    assert resumed.guard.state_dict() == device.guard.state_dict()
    assert resumed.guard.sizes.log_size is not None


@pytest.mark.parametrize(
    ("guard", "message"),
    [
        ({"sizes": {"log_proxy": 0.0, "log_size": 1e9, "since_measure": 0}, "steps_seen": 1}, r"`log_size == 1000000000.0`, must be None or a number"),
        ({"sizes": {"log_proxy": 0.0, "log_size": 0.0, "since_measure": -1}, "steps_seen": 1}, r"`since_measure == -1`"),
        ({"sizes": {"log_proxy": 0.0, "log_size": 0.0, "since_measure": 0}, "steps_seen": 2**80}, r"`steps_seen == \d+`"),
        ({"sizes": {}, "steps_seen": 0}, r"must be an object with keys"),
        ([], r"must be an object with keys \['sizes', 'steps_seen'\]"),
    ],
)
def test_a_hostile_guard_state_is_refused(folder: Path, tmp_path: Path, guard: object, message: str) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    rehash(copy, lambda manifest: manifest.update(guard=guard))
    with pytest.raises(ArtifactError, match=message):
        OrtOnlineLearner.from_artifacts(copy)


def test_a_hostile_parity_rows_value_is_refused(folder: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    rehash(copy, lambda manifest: manifest["parity"].update(rows="made up"))
    with pytest.raises(ArtifactError, match=r"parity.rows"):
        OrtOnlineLearner.from_artifacts(copy)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "sometimes"}, r"`mode == 'sometimes'`"),
        ({"max_lr": math.nan}, r"`max_lr == nan`"),
        ({"update_jump": 0}, r"`update_jump == 0`"),
        ({"protect_first": -1}, r"`protect_first == -1`"),
    ],
)
def test_guard_arguments_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeviceUpdateGuard(**options)


def test_the_manifest_of_a_saved_folder_carries_the_guard(folder: Path, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folder)
    device.observe(_stream(1, seed=6)[0])
    manifest = json.loads((device.save(tmp_path / "s", web=False) / "manifest.json").read_text())
    assert manifest["guard"] == device.guard.state_dict()


# ------------------------------------------------------------------ the gate says which rows it checked
def _fresh(lr: float = 0.05) -> OnlineLearner:
    """A learner exported before its first observe: the gate has no rows of the user's unless given some."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(40, seed=0), replay_batch_size=4, input_shape=(6,), num_classes=3)


def test_a_gate_on_generated_rows_says_so_and_the_device_measures_its_first_steps(tmp_path: Path) -> None:
    with pytest.warns(GeneratedRowsWarning, match=r"generated rows .* pass example=\(x, y\) with real rows"):
        folder = _fresh().export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parity"]["rows"] == "generated"
    device = OrtOnlineLearner.from_artifacts(folder)
    assert device.guard.protect_first == 20
    for batch in _stream(20, seed=7):
        device.observe(batch)
    assert device.guard.protected_steps == 20  # every one of the first steps measured


@pytest.mark.parametrize(("rows", "expected"), [("example", "example"), ("replay", "replay")])
def test_real_rows_are_recorded_as_such(tmp_path: Path, rows: str, expected: str) -> None:
    learner, example = _fresh(), None
    if rows == "example":  # given before the first observe
        example = tuple(map(torch.from_numpy, _stream(1, 8)[0]))
    else:  # observed: the buffer holds the user's rows
        for x, y in _stream(4, seed=8):
            learner.observe((torch.from_numpy(x), torch.from_numpy(y)))
    folder = learner.export(tmp_path / "art", backend="onnxruntime", example=example)
    assert json.loads((folder / "manifest.json").read_text())["parity"]["rows"] == expected
    assert OrtOnlineLearner.from_artifacts(folder).guard.protect_first == 0


def test_a_refusal_on_generated_rows_says_the_rows_were_generated(tmp_path: Path) -> None:
    with pytest.warns(GeneratedRowsWarning), pytest.raises(ExportError, match=r"generated rows \(uniform in \[0, 1\), random labels\)"):
        _fresh(lr=1e4).export(tmp_path / "art", backend="onnxruntime")
    assert not (tmp_path / "art").exists()
