"""ExecuTorch artifact folders are checked against their program before use (see test_hostile_artifacts.py for ONNX Runtime).

The program states its ``forward`` signature (inputs and target: dtypes, per-sample shapes, the
batch bound; outputs: loss and logits) and its parameters; the manifest's ``io`` and a saved
``params.npz`` must agree with it. Every hostile folder is re-signed, so only these checks can
refuse it; each refusal is an :class:`ArtifactError` naming the problem and leaves a live learner
and the folder exactly as they were. Exporting takes most of a minute per model: slow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash
from torch import nn

pytest.importorskip("executorch.extension.training")

from taste_cl import InvalidBatchError, OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.executorch.build import export_model
from taste_cl.adapters.executorch.learner import EtOnlineLearner

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _mlp(classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, classes))


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-class MLP learner with a buffer (learner.export), a 5-class MLP and a CNN (export_model),
    and the 3-class folder saved by the device learner after training (so it holds params.npz)."""
    root = tmp_path_factory.mktemp("et")
    torch.manual_seed(0)
    model = _mlp(3)
    learner = OnlineLearner(model, optimizer=_sgd(model), replay=ReservoirReplay(capacity=40, seed=1), replay_batch_size=4)
    for _ in range(3):
        learner.observe((torch.randn(8, 6), torch.randint(0, 3, (8,))))
    folders = {"mlp3": learner.export(root / "mlp3", backend="executorch")}
    for name, build, shape, classes in (("mlp5", lambda: _mlp(5), (6,), 5), ("cnn3", lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), (3, 6, 6), 3)):  # fmt: skip
        torch.manual_seed(0)
        other = build()
        example = (torch.randn(16, *shape), torch.randint(0, classes, (16,)))
        folders[name] = export_model(other, nn.CrossEntropyLoss(), _sgd(other), example, root / name, num_classes=classes)
    device = EtOnlineLearner.from_artifacts(folders["mlp3"])
    device.observe((np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32), np.array([0, 1, 2, 0, 1])))
    folders["saved3"] = device.save(root / "saved3")
    return folders



def _snapshot(device: EtOnlineLearner) -> dict[str, Any]:
    assert device.replay is not None
    state = device.replay.state_dict()
    return {
        "parameters": device.parameters(),
        "replay": (state["storage"]["x"].clone(), state["storage"]["y"].clone(), state["seen"], state["generator"].clone()),
        "counters": (device.samples_seen, device.steps, device.lr),
        "predict": device.predict(np.zeros((2, 6), np.float32)),
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for name, value in before["parameters"].items():
        np.testing.assert_array_equal(after["parameters"][name], value)
    assert before["parameters"].keys() == after["parameters"].keys()
    for old, new in zip(before["replay"], after["replay"]):
        assert torch.equal(old, new) if isinstance(old, torch.Tensor) else old == new
    assert before["counters"] == after["counters"]
    np.testing.assert_array_equal(after["predict"], before["predict"])


@pytest.fixture(scope="module")
def live(exports: dict[str, Path]) -> EtOnlineLearner:
    device = EtOnlineLearner.from_artifacts(exports["mlp3"])
    device.observe((np.ones((4, 6), np.float32), np.array([2, 1, 0, 2])))
    return device


def _refused(folder: Path, match: str, live: EtOnlineLearner) -> None:
    before = _snapshot(live)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ArtifactError, match=match):
        EtOnlineLearner.from_artifacts(folder)
    _assert_same(before, _snapshot(live))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


def _copy(exports: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(exports[name], tmp_path / "copy"))


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ("mlp5", r"model.pte: forward's logits are \[batch, 5\]: 5 classes; the manifest's io.num_classes is 3"),
        ("cnn3", r"model.pte: forward input 0 is float32 \[batch, 3, 6, 6\]; the manifest's io.inputs\[0\] is float32 \[batch, 6\]"),
    ],
)
def test_a_program_of_another_export_is_refused(exports, tmp_path, live, other, match) -> None:
    folder = _copy(exports, "mlp3", tmp_path)
    (folder / "replay.npz").unlink()  # so the buffer's own check is not what refuses it
    for name in ("model.pte", "model.ptd"):
        shutil.copy(exports[other] / name, folder / name)
    rehash(folder, lambda m: m.update(replay=None))
    _refused(folder, match, live)


def _io(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(manifest: dict) -> None:
        edit(manifest["io"])
        manifest["replay"] = None

    return apply


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # the red team's case: more classes than the logits have (label 5 would reach the loss)
        (_io(lambda io: io.update(num_classes=7)), r"logits are \[batch, 3\]: 3 classes; the manifest's io.num_classes is 7"),
        (
            _io(lambda io: io["inputs"][0].update(shape=["batch", 7])),
            r"forward input 0 is float32 \[batch, 6\]; the manifest's io.inputs\[0\] is float32 \[batch, 7\]",
        ),
        (
            _io(lambda io: io["inputs"][0].update(dtype="float64")),
            r"forward input 0 is float32 \[batch, 6\]; the manifest's io.inputs\[0\] is float64",
        ),
        (_io(lambda io: io["target"].update(dtype="int32")), r"forward input 1 is int64 \[batch\]; the manifest's io.target is int32 \[batch\]"),
        (
            _io(lambda io: io.update(num_classes=None, target={"dtype": "float32", "shape": ["batch", 3]})),
            r"forward input 1 is int64 \[batch\]; the manifest's io.target is float32 \[batch, 3\]",
        ),
        (
            _io(lambda io: io.update(keys=["a", "b"], inputs=io["inputs"] * 2)),
            r"model.pte: forward takes 2 inputs and has 10 outputs; the manifest's io describes 3",
        ),
    ],
)
def test_manifest_io_is_checked_against_the_program(exports, tmp_path, live, edit, match) -> None:
    folder = _copy(exports, "mlp3", tmp_path)
    (folder / "replay.npz").unlink()
    rehash(folder, edit)
    _refused(folder, match, live)


def _params(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        with np.load(folder / "params.npz") as saved:
            arrays = {key: saved[key] for key in saved.files}
        change(arrays)
        np.savez(folder / "params.npz", **arrays)

    return damage


def _set(key: str, value: Callable[[np.ndarray], np.ndarray]) -> Callable[[dict[str, np.ndarray]], None]:
    return lambda arrays: arrays.update({key: value(arrays[key])})


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_params(_set("2.weight", lambda a: a.astype(np.float64))), r"saved parameter '2.weight' is float64; the program's is float32"),
        (_params(_set("0.bias", lambda a: a.astype(np.int64))), r"saved parameter '0.bias' is int64; the program's is float32"),
        (_params(_set("0.bias", lambda a: np.full_like(a, np.nan))), r"saved parameter '0.bias' holds NaN or infinite values"),
        (_params(_set("2.weight", lambda a: a.T.copy())), r"saved parameter '2.weight' has shape \(16, 3\)"),
        (_params(lambda arrays: arrays.pop("2.bias")), r"saved parameters .* do not match the program's"),
    ],
)
def test_saved_parameters_are_checked_against_the_program(exports, tmp_path, live, damage, match) -> None:
    folder = _copy(exports, "saved3", tmp_path)
    damage(folder)
    rehash(folder)
    _refused(folder, match, live)


@pytest.mark.parametrize(("name", "match"), [("params.npz", "params.npz: File is not a zip file"), ("replay.npz", "not a valid replay buffer")])
def test_truncated_archives_are_refused(exports, tmp_path, live, name, match) -> None:
    """A cut zip raised zipfile.BadZipFile, which no caller expects."""
    folder = _copy(exports, "saved3", tmp_path)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    rehash(folder)
    _refused(folder, match, live)


def test_batches_over_the_programs_bound_are_refused_before_they_run(exports, live) -> None:
    """The program's inputs have an upper batch bound (128): a larger batch is an InvalidBatchError, not a runtime error."""
    device = EtOnlineLearner.from_artifacts(exports["mlp3"])
    before = _snapshot(device)
    with pytest.raises(InvalidBatchError, match="at most 128 samples"):
        device.observe((np.zeros((126, 6), np.float32), np.zeros(126, np.int64)))  # 126 + 4 replayed
    with pytest.raises(InvalidBatchError, match="at most 128 samples"):
        device.predict(np.zeros((129, 6), np.float32))
    _assert_same(before, _snapshot(device))
