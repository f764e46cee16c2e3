"""The device runtime: runs without torch, refuses hostile artifacts and bad batches, resumes exactly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rehash, run_without_torch
from torch import nn

pytestmark = pytest.mark.training_build

import onnx

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.build import ReplayRows, export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import InvalidBatchError


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small classifier (SGD with momentum) with a 20-row buffer, exported after 2 torch steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
        optimizer.step()
    replay = ReplayRows(x.double(), y, capacity=50, seen=20)  # float64 rows: exported as float32
    return export_model(
        model, nn.CrossEntropyLoss(), optimizer, (x[:8], y[:8]), tmp_path_factory.mktemp("a") / "art",
        replay=replay, replay_batch_size=4,
    )  # fmt: skip


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))



def _batch(n: int = 5, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


# -------------------------------------------------------------- without torch
def test_device_runtime_runs_with_torch_unimportable(artifacts: Path, tmp_path: Path) -> None:
    """Import hook: any ``import torch`` fails in the subprocess; the runtime must never need it."""
    result = run_without_torch(
        f"""
        import numpy as np
        from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
        device = OrtOnlineLearner.from_artifacts({str(artifacts)!r})
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((5, 6)).astype(np.float32), rng.integers(0, 3, 5)
        stats = device.observe((x, y))
        assert stats.replay_samples == 4 and not stats.skipped, stats
        from taste_cl import ObserveStats  # the PyTorch learner's stats type, importable (and printable) without torch
        assert type(stats) is ObserveStats and str(stats).startswith("observe: loss "), stats
        device.save({str(tmp_path / "saved")!r})
        resumed = OrtOnlineLearner.from_artifacts({str(tmp_path / "saved")!r})
        assert np.array_equal(resumed.predict(x), device.predict(x))
        device.export_inference_model({str(tmp_path / "model.onnx")!r})
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("OK", len(device.replay))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "OK 25"
    assert "[I:onnxruntime" not in result.stderr  # INFO logs silenced


def test_replay_rows_are_exported_in_the_graph_dtype(artifacts: Path) -> None:
    with np.load(artifacts / "replay.npz") as data:
        assert data["x0"].dtype == np.float32 and data["y"].dtype == np.int64 and data["x0"].shape == (20, 6)
    manifest = json.loads((artifacts / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["batch", 6]}]
    assert manifest["replay"]["size"] == 20 and manifest["sgd_state"]  # momentum buffers travel


def test_save_and_resume_continue_identically(artifacts: Path, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(artifacts)
    device.observe(_batch(5, 1))
    resumed = OrtOnlineLearner.from_artifacts(device.save(tmp_path / "saved"))
    assert (resumed.samples_seen, resumed.steps, len(resumed.replay)) == (device.samples_seen, device.steps, 25)
    for seed in (2, 3):  # replay draws, momentum and weights all continue the same way
        assert resumed.observe(_batch(5, seed)).loss == device.observe(_batch(5, seed)).loss
    for name, value in device.parameters().items():
        np.testing.assert_array_equal(resumed.parameters()[name], value)


# -------------------------------------------------------------- confinement
def _external(folder: Path) -> None:
    model = onnx.load(str(folder / "training_model.onnx"))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "/etc/passwd"
    onnx.save(model, str(folder / "training_model.onnx"))


def _external_in_constant(folder: Path) -> None:
    model = onnx.load(str(folder / "eval_model.onnx"))
    value = onnx.helper.make_tensor("c", onnx.TensorProto.FLOAT, [1], [0.0])
    value.data_location = onnx.TensorProto.EXTERNAL
    model.graph.node.append(onnx.helper.make_node("Constant", [], ["unused_c"], value=value))
    onnx.save(model, str(folder / "eval_model.onnx"))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_external, "external data"),
        (_external_in_constant, "data_location=EXTERNAL"),
        (lambda f: (f / "notes.txt").write_text("x"), "format does not have: \\['notes.txt'\\]"),
        (lambda f: (f / "replay.npz").rename(f / "other.npz"), "format does not have"),
    ],
)
def test_hostile_files_are_refused_even_with_valid_hashes(artifacts: Path, tmp_path: Path, damage, match: str) -> None:
    folder = _copy(artifacts, tmp_path)
    damage(folder)
    rehash(folder)
    with pytest.raises(ArtifactError, match=match):
        OrtOnlineLearner.from_artifacts(folder)


def test_every_file_read_is_checked_including_replay(artifacts: Path, tmp_path: Path) -> None:
    folder = _copy(artifacts, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]["replay.npz"]  # left out of the checked set
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="does not list: \\['replay.npz'\\]"):
        OrtOnlineLearner.from_artifacts(folder)


def _set(path: str, value: object) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        *parents, last = path.split(".")
        target = manifest
        for key in parents:
            target = target[key]
        target[last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set("num_classes", 10**6), "num_classes == 1000000"),
        (_set("train_iterations", 0), "train_iterations == 0"),
        (_set("replay_batch_size", -1), "replay_batch_size == -1"),
        (_set("optimizer.lr", -0.1), "optimizer.lr == -0.1"),
        (_set("optimizer.lr", "0.1"), "optimizer.lr == '0.1'.*finite number"),
        (_set("optimizer.momentum", 2.0), "optimizer.momentum == 2.0"),
        (_set("optimizer.type", "lion"), "optimizer.type == 'lion'"),
        (_set("replay.capacity", 0), "replay.capacity == 0"),
        (_set("replay.size", 51), "replay.size == 51"),
        (_set("inputs", [{"name": "input", "dtype": "object", "shape": ["batch", 6]}]), "inputs\\[0\\].dtype"),
        (_set("inputs", [{"name": "input", "dtype": "float32", "shape": ["batch", 10**7]}]), "inputs\\[0\\].shape"),
        (_set("labels.dtype", "float32"), "num_classes"),
        (_set("structure", "graph"), "structure == 'graph'"),
        (_set("counters.steps", -3), "counters.steps == -3"),
        (_set("trainable", ["/etc/passwd"]), "trainable"),
        (_set("format", 1), "format 1"),
        (_set("nested", [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), "nests 20 levels"),
    ],
)
def test_manifest_values_are_validated(artifacts: Path, tmp_path: Path, edit, match: str) -> None:
    folder = _copy(artifacts, tmp_path)
    rehash(folder, edit)
    with pytest.raises(ArtifactError, match=match):
        OrtOnlineLearner.from_artifacts(folder)


def _replay(**changes: np.ndarray) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        with np.load(folder / "replay.npz") as data:
            arrays = {key: data[key] for key in data.files}
        arrays.update(changes)
        np.savez(folder / "replay.npz", **arrays)

    return damage


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_replay(y=np.full(20, 7)), "labels in \\[7, 7\\]"),
        (_replay(x0=np.zeros((20, 6))), "float64"),
        (_replay(x0=np.full((20, 6), np.nan, np.float32)), "NaN"),
        (_replay(extra=np.zeros(3)), "holds arrays"),
        (lambda f: (f / "replay.npz").write_bytes(b"not a zip"), "not a valid replay archive"),
    ],
)
def test_replay_contents_are_validated(artifacts: Path, tmp_path: Path, damage, match: str) -> None:
    folder = _copy(artifacts, tmp_path)
    damage(folder)
    rehash(folder)
    with pytest.raises(ArtifactError, match=match):
        OrtOnlineLearner.from_artifacts(folder)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ((np.zeros((4, 5), np.float32), np.zeros(4, np.int64)), "shape \\(4, 5\\)"),
        ((np.array([["a"] * 6] * 4), np.zeros(4, np.int64)), "dtype <U1"),
        ((np.zeros((4, 6), "datetime64[s]"), np.zeros(4, np.int64)), "dtype datetime64"),
        ((np.zeros((4, 6), np.longdouble), np.zeros(4, np.int64)), "float128|longdouble"),
        ((np.zeros((4, 6), np.complex64), np.zeros(4, np.int64)), "complex64"),
        ((np.full((4, 6), np.nan, np.float32), np.zeros(4, np.int64)), "NaN"),
        ((np.zeros((4, 6), np.float32), np.full(4, 3)), "must be in \\[0, 2\\]"),
        ((np.zeros((4, 6), np.float32), np.zeros(4, np.float32)), "dtype float32, must be convertible to int64"),
        ((np.zeros((4, 6), np.float32), np.zeros(3, np.int64)), "3 rows, must have 4"),
        ((np.zeros((0, 6), np.float32), np.zeros(0, np.int64)), "0 rows"),
        ((np.zeros((4, 6), ">f4"), np.zeros(4, np.int64)), None),  # non-native byte order is converted
        ("not a batch", "batch must be"),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(artifacts: Path, batch, match: str | None) -> None:
    device = OrtOnlineLearner.from_artifacts(artifacts)
    before = device.parameters()
    if match is None:
        device.observe(batch)
        return
    with pytest.raises(InvalidBatchError, match=match):
        device.observe(batch)
    assert (device.samples_seen, len(device.replay)) == (0, 20)
    for name, value in device.parameters().items():
        np.testing.assert_array_equal(value, before[name])
