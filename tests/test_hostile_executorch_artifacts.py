"""ExecuTorch artifact folders are checked against their program before use (see test_hostile_artifacts.py for ONNX Runtime).

The program states its ``forward`` signature (inputs and target: dtypes, per-sample shapes, the
batch bound; outputs: loss and logits) and its parameters; the manifest's ``io`` and a saved
``params.npz`` must agree with it. Every hostile folder is re-signed, so only these checks can
refuse it; each refusal is an :class:`ArtifactError` naming the problem and leaves a live learner
and the folder exactly as they were. Exporting takes most of a minute per model: slow.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash
from hostile_npz import edit_npz
from torch import nn

pytest.importorskip("executorch.extension.training")

from taste_cl import InvalidBatchError, OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.executorch import learner as learner_module
from taste_cl.adapters.executorch.build import export_model
from taste_cl.adapters.executorch.learner import EtOnlineLearner
from taste_cl.adapters.executorch.runtime import MAX_FILE_BYTES

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
        # a header claiming 24 GB over 384 bytes of data: refused before np.load allocates it
        (
            lambda folder: edit_npz(folder / "params.npz", claims={"0.weight": (10**9, 6)}),
            r"params.npz: saved parameter '0.weight' has shape \(1000000000, 6\), the program's is \(16, 6\)",
        ),
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


# ------------------------------------------------------ bounds before allocation
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        # SGD settings that make every step non-finite: the ONNX Runtime manifest's bounds
        (lambda m: m["optimizer"].update(momentum=1e300), r"invalid manifest: manifest `optimizer.momentum == 1e\+300`, must be in \[0.0, 1.0\]"),
        (lambda m: m["optimizer"].update(weight_decay=1e30), r"manifest `optimizer.weight_decay == 1e\+30`, must be in \[0.0, 1000000.0\]"),
        (lambda m: m["optimizer"].update(dampening=2), r"manifest `optimizer.dampening == 2`, must be in \[0.0, 1.0\]"),
        (lambda m: m["optimizer"].update(lr=1e9), r"manifest `optimizer.lr == 1000000000.0`, must be in \(0.0, 1000000.0\]"),
        (lambda m: m["optimizer"].update(nesterov=1), r"manifest `optimizer.nesterov == 1`, must be true or false"),  # was a bare TypeError
        # observe would run 10**9 steps per batch: a hang, not an error
        (lambda m: m.update(train_iterations=10**9), r"manifest `train_iterations == 1000000000`, must be an int in \[1, 1000\]"),
        (lambda m: m.update(train_iterations=1e9), r"manifest `train_iterations == 1000000000.0`, must be an int in \[1, 1000\]"),
        (lambda m: m.update(replay_batch_size=10**9), r"manifest `replay_batch_size == 1000000000`, must be an int in \[0, 100000\]"),
        (lambda m: m["counters"].update(steps=-1), r"manifest `counters.steps == -1`, must be an int in \[0, "),
        # the buffer is allocated at load: its capacity was refused only by the failing allocation
        (lambda m: m["replay"].update(capacity=2**40), r"manifest `replay.capacity == 1099511627776`, must be an int in \[1, 10000000\]"),
        (lambda m: m["replay"].update(size=41), r"manifest `replay.size == 41`, must be an int in \[0, 40\]"),
    ],
)
def test_manifest_values_are_bounded_before_any_file_is_read(exports, tmp_path, live, monkeypatch, edit, match) -> None:
    folder = _copy(exports, "mlp3", tmp_path)
    rehash(folder, edit)
    monkeypatch.setattr(learner_module, "read_verified", _never_read())
    _refused(folder, match, live)


def _never_read(name: str | None = None) -> Callable[..., bytes]:
    """A ``read_verified`` that fails the test when it reads ``name`` (None: any file)."""
    real = learner_module.read_verified

    def read(folder: Path, manifest: dict, file: str, **bounds: Any) -> bytes:
        assert name is not None, f"{file} was read"
        data = real(folder, manifest, file, **bounds)  # a bound refuses ``name`` in there, before reading it
        assert file != name, f"{file} was read"
        return data

    return read


def _replay(**options: Any) -> Callable[[Path], None]:
    return lambda folder: edit_npz(folder / "replay.npz", **options)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        # headers claiming terabytes over a few hundred bytes of data: np.load would allocate them first
        (_replay(claims={"x": (10**9, 6)}), r"array 'x' is float32 \(1000000000, 6\), must be numbers for \d+ samples of float32 \[6\]"),
        (_replay(claims={"y": (2**40,)}), r"array 'y' holds 1099511627776 samples; the manifest's replay.size is \d+"),
        (_replay(claims={"generator": (2**40,)}), r"array 'generator' is uint8 \(1099511627776,\), must be a generator state, uint8 of a shape in"),
        (_replay(change=lambda a: a.update(capacity=np.int64(2**40))), r"array 'capacity' is 1099511627776; the manifest's replay.capacity is 40"),
        # a deflated member may expand far beyond the file: np.savez stores them
        (_replay(compressed=True), r"member '\w+.npy' is not an uncompressed .npy array"),
        (_replay(change=lambda a: a.update(extra=np.zeros(3))), r"the archive holds arrays \[.*'extra'.*\], expected"),
    ],
    ids=["x-rows", "y-rows", "generator", "capacity", "compressed", "extra-array"],
)
def test_replay_arrays_are_bounded_by_their_headers_before_they_are_read(exports, tmp_path, live, damage, match) -> None:
    folder = _copy(exports, "mlp3", tmp_path)
    damage(folder)
    rehash(folder)
    _refused(folder, rf"replay.npz is not a valid replay buffer for this program: {match}", live)


@pytest.mark.parametrize("name", ["model.pte", "model.ptd", "params.npz", "replay.npz"])
def test_a_file_over_its_bound_is_refused_unread(exports, tmp_path, live, monkeypatch, name) -> None:
    """Each file's size on disk is checked against MAX_FILE_BYTES (lowered here to just below it) before it is read."""
    folder = _copy(exports, "saved3", tmp_path)
    size = (folder / name).stat().st_size
    monkeypatch.setitem(MAX_FILE_BYTES, name, size - 1)
    monkeypatch.setattr(learner_module, "read_verified", _never_read(name))
    _refused(folder, rf"{name} in .* is {size} bytes, over the {size - 1}-byte bound for this file", live)


def test_a_weights_file_over_a_gibibyte_is_refused_before_it_is_read(exports, tmp_path, live) -> None:
    """The red team's case at the real bound: a listed model.ptd past 1 GiB (sparse here) raised a raw
    MemoryError under a 2 GiB address-space cap when it was read whole."""
    folder = _copy(exports, "mlp3", tmp_path)
    path = folder / "model.ptd"
    os.truncate(path, MAX_FILE_BYTES["model.ptd"] + 1)
    manifest = json.loads((folder / "manifest.json").read_text())
    digest = hashlib.sha256()
    with path.open("rb") as file:  # re-signed without holding the file in memory
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    manifest["files"]["model.ptd"] = digest.hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(live)
    with pytest.raises(ArtifactError, match=r"model.ptd in .* is 1073741825 bytes, over the 1073741824-byte bound for this file"):
        EtOnlineLearner.from_artifacts(folder)
    _assert_same(before, _snapshot(live))
