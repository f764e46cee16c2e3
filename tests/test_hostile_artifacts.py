"""Device artifacts are checked against each other before use: the manifest against the graphs,
the graphs against the checkpoint, the optimizer state against the parameters.

Every hostile folder here is self-consistent as far as hashes go (the manifest is re-signed after
each change, as an attacker would), so only the cross-checks can refuse it. Each refusal must be a
:class:`ArtifactError` naming the problem, raised before anything is loaded, and must leave a live
learner and the folder exactly as they were.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash
from hostile_npz import edit_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn


from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.build import ReplayRows, export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import CheckpointError, InvalidBatchError

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _cnn(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, classes))


# name -> (model builder, feature shape, classes, optimizer builder)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, str]] = {
    "mlp3": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), (6,), 3, "sgd"),
    "mlp5": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), (6,), 5, "sgd"),
    "narrow3": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), (6,), 3, "sgd"),
    "cnn3": (lambda: _cnn(3), (3, 6, 6), 3, "sgd"),
    "adamw3": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), (6,), 3, "adamw"),
    "adamw5": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), (6,), 5, "adamw"),
    "adamw3_betas": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), (6,), 3, "adamw_betas"),
    "bn3": (lambda: nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)), (6,), 3, "sgd"),
}
BATCH_STATISTICS = {"bn3"}  # exported with batchnorm="batch": the graph outputs running statistics


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    betas = (0.8, 0.99) if kind == "adamw_betas" else (0.9, 0.999)
    return torch.optim.AdamW(model.parameters(), lr=0.01, betas=betas)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model trained 2 steps in torch (so optimizer state travels), exported with a 20-row buffer."""
    root = tmp_path_factory.mktemp("exports")
    folders = {}
    for name, (build, shape, classes, kind) in MODELS.items():
        torch.manual_seed(0)
        model = build()
        optimizer = _optimizer(kind, model)
        x, y = torch.randn(20, *shape), torch.randint(0, classes, (20,))
        for _ in range(2):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
            optimizer.step()
        folders[name] = export_model(
            model, nn.CrossEntropyLoss(), optimizer, (x[:8], y[:8]), root / name,
            replay=ReplayRows(x, y, capacity=50, seen=20), replay_batch_size=4,
            batchnorm="batch" if name in BATCH_STATISTICS else "frozen",
        )  # fmt: skip
    return folders


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _snapshot(device: OrtOnlineLearner) -> dict[str, Any]:
    """Everything a learner holds that training or a load could change."""
    replay = device.replay
    assert replay is not None
    return {
        "parameters": device.parameters(),
        "sgd": {name: value.copy() for name, value in device.session.sgd_state.items()},
        "replay": (replay.to_bytes(), replay.info()),
        "counters": (device.samples_seen, device.steps, device.lr),
        "manifest": copy.deepcopy(device.manifest),
        "predict": device.predict(np.zeros((2, *device.spec.inputs[0].shape), np.float32)),
    }


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if key in ("parameters", "sgd"):
            assert before[key].keys() == after[key].keys()
            for name in before[key]:
                np.testing.assert_array_equal(after[key][name], before[key][name])
        elif key == "predict":
            np.testing.assert_array_equal(after[key], before[key])
        else:
            assert after[key] == before[key], key


@pytest.fixture
def live(exports: dict[str, Path]) -> OrtOnlineLearner:
    """A learner that has trained a little, whose state every refused load must leave alone."""
    device = OrtOnlineLearner.from_artifacts(exports["mlp3"])
    rng = np.random.default_rng(1)
    device.observe((rng.standard_normal((5, 6)).astype(np.float32), rng.integers(0, 3, 5)))
    return device


def _refused(folder: Path, match: str, live: OrtOnlineLearner) -> ArtifactError:
    """Loading ``folder`` raises ArtifactError matching ``match``; the live learner and the folder are unchanged."""
    before, files = _snapshot(live), _folder_bytes(folder)
    with pytest.raises(ArtifactError, match=match) as caught:
        OrtOnlineLearner.from_artifacts(folder)
    _assert_same(before, _snapshot(live))
    assert _folder_bytes(folder) == files
    assert isinstance(caught.value, CheckpointError)
    return caught.value


def _mixed(exports: dict[str, Path], base: str, other: str, names: tuple[str, ...], tmp_path: Path) -> Path:
    """``base``'s folder with the files ``names`` taken from ``other``'s export, re-signed."""
    folder = Path(shutil.copytree(exports[base], tmp_path / "mixed"))
    for name in names:
        if name == "*":
            for path in exports[other].iterdir():
                if path.name != "manifest.json":
                    shutil.copy(path, folder / path.name)
        else:
            shutil.copy(exports[other] / name, folder / name)
    rehash(folder)
    return folder


# --------------------------------------------------------------- mixed folders
@pytest.mark.parametrize(
    ("base", "other", "names", "match"),
    [
        # a checkpoint of another architecture, brought with its own momentum buffers
        (
            "mlp3",
            "mlp5",
            ("checkpoint", "sgd_state.npz"),
            r"parameter 'model.2.weight' is float32 \(5, 16\); training_model.onnx takes float32 \(3, 16\)",
        ),
        (
            "mlp3",
            "narrow3",
            ("checkpoint", "sgd_state.npz"),
            r"parameter 'model.0.weight' is float32 \(8, 6\); training_model.onnx takes float32 \(16, 6\)",
        ),
        (
            "mlp3",
            "cnn3",
            ("checkpoint", "sgd_state.npz"),
            r"holds parameters \[.model.3.bias., .model.3.weight.\] that training_model.onnx does not take, and lacks \[.model.2.b",
        ),
        ("adamw3", "adamw5", ("checkpoint",), r"checkpoint parameter 'model.2.weight' is float32 \(5, 16\)"),
        # graphs of another architecture beside this checkpoint
        (
            "mlp3",
            "mlp5",
            ("training_model.onnx",),
            r"training_model.onnx: output 'logits' is float32 \[batch, 5\]; the manifest says float32 \[batch, 3\]",
        ),
        ("mlp3", "narrow3", ("training_model.onnx",), r"parameter 'model.0.weight' is float32 \(16, 6\); training_model.onnx takes float32 \(8, 6\)"),
        ("mlp3", "mlp5", ("eval_model.onnx",), r"eval_model.onnx: output 'logits' is float32 \[batch, 5\]"),
        ("mlp3", "narrow3", ("eval_model.onnx",), r"eval_model.onnx takes float32 \(8, 6\)"),
        (
            "mlp3",
            "cnn3",
            ("eval_model.onnx",),
            r"eval_model.onnx: input 'input' is float32 \[batch, 3, 6, 6\]; the manifest says float32 \[batch, 6\]",
        ),
        ("mlp3", "mlp5", ("inference_model.onnx",), r"inference_model.onnx: output 'logits' is float32 \[batch, 5\]"),
        ("mlp3", "narrow3", ("inference_model.onnx",), r"inference_model.onnx holds 'model.0.weight' as float32 \(8, 6\)"),
        # every file of another export under this manifest: the manifest's facts are checked against the graphs
        ("mlp3", "mlp5", ("*",), r"training_model.onnx: output 'logits' is float32 \[batch, 5\]; the manifest says float32 \[batch, 3\]"),
        ("mlp3", "cnn3", ("*",), r"training_model.onnx: input 'input' is float32 \[batch, 3, 6, 6\]; the manifest says float32 \[batch, 6\]"),
        ("adamw3", "adamw5", ("*",), r"training_model.onnx: output 'logits' is float32 \[batch, 5\]"),
        # the optimizer graph states the AdamW hyper-parameters the manifest repeats
        ("adamw3", "adamw3_betas", ("optimizer_model.onnx",), r"optimizer_model.onnx: AdamW alpha is 0.8.*manifest.*0.9"),
    ],
)
def test_files_mixed_from_two_exports_are_refused(exports, tmp_path, live, base, other, names, match) -> None:
    _refused(_mixed(exports, base, other, names, tmp_path), match, live)


def test_every_mixed_file_is_refused_before_onnx_runtime_sees_it(exports, tmp_path, live, monkeypatch) -> None:
    """The checks read bytes only: ONNX Runtime never loads a refused folder (no C++ error can surface)."""
    from taste_cl.adapters.onnxruntime import runtime

    def no_ort(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("ONNX Runtime was asked to load a folder the checks should refuse")

    monkeypatch.setattr(runtime, "OrtSession", no_ort)
    for name in ("checkpoint", "training_model.onnx", "eval_model.onnx", "inference_model.onnx"):
        folder = _mixed(exports, "mlp3", "mlp5", (name, "sgd_state.npz") if name == "checkpoint" else (name,), tmp_path / name)
        _refused(folder, "float32", live)


# ------------------------------------------------------------ manifest facts
def _edit(path: str, value: Any) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        *parents, last = path.split(".")
        target = manifest
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return edit


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        for one in edits:
            one(manifest)

    return edit


def _no_replay(manifest: dict) -> None:
    """Drop the buffer, so the replay rows' own shape check cannot be what refuses an input edit."""
    manifest["replay"] = None


@pytest.mark.parametrize(
    ("base", "edit", "match"),
    [
        # the red team's case: 7 classes claimed for a 3-class graph (then label 5 would train silently)
        ("mlp3", _edit("num_classes", 7), r"num_classes == 7`, must be the output width 3"),
        (
            "mlp3",
            _both(_edit("num_classes", 7), _edit("output.shape", ["batch", 7])),
            r"output 'logits' is float32 \[batch, 3\]; the manifest says float32 \[batch, 7\]",
        ),
        ("mlp3", _both(_edit("num_classes", 2), _edit("output.shape", ["batch", 2])), r"\[batch, 3\]; the manifest says float32 \[batch, 2\]"),
        (
            "mlp3",
            _both(_no_replay, _edit("inputs.0.shape", ["batch", 7])),
            r"input 'input' is float32 \[batch, 6\]; the manifest says float32 \[batch, 7\]",
        ),
        (
            "mlp3",
            _both(_no_replay, _edit("inputs.0.shape", ["batch", 2, 3])),
            r"input 'input' is float32 \[batch, 6\]; the manifest says float32 \[batch, 2, 3\]",
        ),
        ("mlp3", _edit("inputs.0.name", "features"), r"input 'input' is float32 \[batch, 6\]; the manifest says 'features'"),
        ("mlp3", _both(_no_replay, _edit("inputs.0.dtype", "int64")), r"input 'input' is float32 \[batch, 6\]; the manifest says int64"),
        (
            "mlp3",
            _both(_no_replay, _edit("labels.dtype", "float32"), _edit("num_classes", None)),
            r"input 'labels' is int64 \[batch\]; the manifest says float32",
        ),
        ("mlp3", _both(_no_replay, _edit("labels.shape", ["batch", 3])), r"input 'labels' is int64 \[batch\]; the manifest says int64 \[batch, 3\]"),
        ("mlp3", _edit("labels.name", "targets"), r"input 'labels' .*the manifest says 'targets'"),
        ("cnn3", _both(_no_replay, _edit("inputs.0.shape", ["batch", 3, 6, 7])), r"\[batch, 3, 6, 6\]; the manifest says float32 \[batch, 3, 6, 7\]"),
        # ORT's loss ignores the label -100 only: another ignore_index would let out-of-range labels through
        ("mlp3", _edit("ignore_index", 5), r"ignore_index -100.*manifest says 5"),
        # the parameters the graph trains and the names the manifest gives them
        (
            "mlp3",
            _both(_edit("trainable", ["model.0.weight", "model.0.bias"]), _edit("sgd_state", ["model.0.weight", "model.0.bias"])),
            r"training_model.onnx trains \['model.0.bias', 'model.0.weight', 'model.2.bias', 'model.2.weight'\]; the manifest's",
        ),
        ("mlp3", lambda m: m["param_names"].update({"model.9.weight": "9.weight"}), r"param_names.*'model.9.weight'.*not in the checkpoint"),
        # optimizer facts: the AdamW graph's attributes, the checkpoint's moments
        ("adamw3", _edit("optimizer.betas", [0.5, 0.999]), r"optimizer_model.onnx: AdamW alpha is 0.9.*manifest.*0.5"),
        ("adamw3", _edit("optimizer.eps", 1e-6), r"optimizer_model.onnx: AdamW epsilon"),
        ("adamw3", _edit("optimizer.weight_decay", 0.5), r"optimizer_model.onnx: AdamW weight_decay"),
        ("mlp3", _edit("optimizer.momentum", 0.0), r"sgd_state.npz.*momentum"),
        # BatchNorm running statistics: written back into the parameter they name after every step
        ("bn3", _edit("running_stats.0.parameter", "model.0.bias"), r"would overwrite 'model.0.bias', not a frozen parameter"),
        (
            "bn3",
            _edit("running_stats.1.parameter", "model.1.running_mean"),
            r"_output_2' is the running var of 'model.1.running_var'.*the running var of 'model.1.running_mean'",
        ),
        (
            "bn3",
            _both(_edit("running_stats.0.stat", "var"), _edit("running_stats.1.stat", "mean")),
            r"_output_1' is the running mean of 'model.1.running_mean' .*says the running var",
        ),
        ("bn3", _edit("running_stats.0.momentum", 0.5), r"running mean of 'model.1.running_mean' with momentum 0.1; .* momentum 0.5"),
        ("bn3", _edit("running_stats", []), r"training_model.onnx outputs \['loss', 'logits', '/model/model.1/BatchNormalization_output_1'"),
    ],
)
def test_manifest_facts_the_graphs_state_are_checked(exports, tmp_path, live, base, edit, match) -> None:
    _refused(_edited(exports[base], edit, tmp_path), match, live)


def _edited(export: Path, edit: Callable[[dict], None], tmp_path: Path) -> Path:
    """A copy of ``export`` with ``edit`` applied to its manifest (and no replay.npz when it drops the buffer), re-signed."""
    folder = Path(shutil.copytree(export, tmp_path / "edited"))
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    if manifest.get("replay") is None:
        (folder / "replay.npz").unlink()
    rehash(folder, lambda m: (m.clear(), m.update(manifest)))
    return folder


# ------------------------------------------------------ bounds before allocation
@pytest.mark.parametrize(
    ("base", "edit", "match"),
    [
        # observe would run 10**9 steps per batch: a hang, not an error
        ("mlp3", _edit("train_iterations", 10**9), r"manifest `train_iterations == 1000000000`, must be an int in \[1, 1000\]"),
        ("mlp3", _edit("train_iterations", 1e9), r"manifest `train_iterations == 1000000000.0`, must be an int in \[1, 1000\]"),
        # SGD settings that make every step non-finite
        ("mlp3", _edit("optimizer.momentum", 1e300), r"manifest `optimizer.momentum == 1e\+300`, must be in \[0.0, 1.0\]"),
        ("mlp3", _edit("optimizer.weight_decay", 1e30), r"manifest `optimizer.weight_decay == 1e\+30`, must be in \[0.0, 1000000.0\]"),
        # a buffer allocated at load: its capacity, and its memory (capacity x 440-byte rows of the CNN's inputs and labels)
        ("mlp3", _edit("replay.capacity", 2**40), r"manifest `replay.capacity == 1099511627776`, must be an int in \[1, 10000000\]"),
        ("cnn3", _edit("replay.capacity", 10**7), r"manifest `replay.capacity == 10000000`, must be at most 2440322: rows of 440 bytes"),
    ],
)
def test_manifest_values_out_of_bounds_are_refused(exports, tmp_path, live, base, edit, match) -> None:
    _refused(_edited(exports[base], edit, tmp_path), match, live)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # a header is all np.load reads before it allocates: these files are a few hundred bytes
        ({"claims": {"x0": (10**9, 6)}}, r"replay.npz: array 'x0' is float32 \(1000000000, 6\), must be float32 \(20, 6\)"),
        ({"claims": {"y": (2**40,)}}, r"replay.npz: array 'y' is int64 \(1099511627776,\), must be int64 \(20,\)"),
        ({"claims": {"x0": (20, 6, 10**6)}}, r"array 'x0' is float32 \(20, 6, 1000000\), must be float32 \(20, 6\)"),
        # a deflated member may expand far beyond the file: np.savez stores them
        ({"compressed": True}, r"replay.npz is not a valid replay archive: member '\w+.npy' is not an uncompressed .npy array"),
        ({"change": lambda arrays: arrays.update(extra=np.zeros(3))}, r"replay.npz holds arrays \['extra', 'x0', 'y'\], expected \['x0', 'y'\]"),
    ],
    ids=["x-rows", "y-rows", "x-row-shape", "compressed", "extra-array"],
)
def test_replay_arrays_are_bounded_by_their_headers_before_they_are_read(exports, tmp_path, live, options, match) -> None:
    folder = Path(shutil.copytree(exports["mlp3"], tmp_path / "replay"))
    edit_npz(folder / "replay.npz", **options)
    rehash(folder)
    _refused(folder, match, live)


def test_adamw_folder_claiming_sgd_is_refused_by_its_moments(exports, tmp_path, live) -> None:
    """Drop the AdamW graph and claim plain SGD: the checkpoint's two moments per parameter give it away."""
    folder = Path(shutil.copytree(exports["adamw3"], tmp_path / "sgd"))
    for name in ("optimizer_model.onnx", "optimizer_model.web.onnx", "web.json", "replay.bin"):
        (folder / name).unlink(missing_ok=True)
    sgd = {"type": "sgd", "lr": 0.01, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}
    rehash(folder, lambda m: (m.update(optimizer=sgd), m.pop("web", None)))
    _refused(folder, r"checkpoint: optimizer state of 'model.0.bias' holds \['momentum0', 'momentum1'\]; sgd keeps", live)


def test_sgd_checkpoint_in_an_adamw_folder_is_refused(exports, tmp_path, live) -> None:
    """Same architecture, but the checkpoint has no AdamW moments: resuming would silently restart them."""
    folder = _mixed(exports, "adamw3", "mlp3", ("checkpoint",), tmp_path)
    _refused(folder, r"checkpoint has no AdamW state for \['model.0.bias', 'model.0.weight', 'model.2.bias', 'model.2.weight'\]", live)


# -------------------------------------------------------- checkpoint surgery
def _checkpoint_moment(data: bytearray, param: str, moment: int) -> tuple[int, int]:
    """(dims vector offset, name string offset) of one AdamW moment in an ORT checkpoint FlatBuffer."""

    def u32(pos: int) -> int:
        return struct.unpack_from("<I", data, pos)[0]

    def field(table: int, index: int) -> int:
        vtable = table - struct.unpack_from("<i", data, table)[0]
        offset = struct.unpack_from("<H", data, vtable + 4 + 2 * index)[0]
        assert offset, (table, index)
        return table + offset

    def vector(table: int, index: int) -> list[int]:
        start = field(table, index)
        start += u32(start)
        return [start + 4 + 4 * i + u32(start + 4 + 4 * i) for i in range(u32(start))]

    def string(table: int, index: int) -> tuple[int, bytes]:
        start = field(table, index)
        start += u32(start)
        return start + 4, bytes(data[start + 4 : start + 4 + u32(start)])

    root = u32(0)
    (group,) = vector(root, 2)
    for state in vector(group, 3):
        if string(state, 0)[1] == param.encode():
            tensor = vector(state, 1)[moment]
            dims = field(tensor, 2)
            return dims + u32(dims) + 4, string(tensor, 0)[0]
    raise AssertionError(param)


def _surgery(exports: dict[str, Path], tmp_path: Path, change: Callable[[bytearray], None]) -> Path:
    folder = Path(shutil.copytree(exports["adamw3"], tmp_path / "surgery"))
    data = bytearray((folder / "checkpoint").read_bytes())
    change(data)
    (folder / "checkpoint").write_bytes(bytes(data))
    rehash(folder)
    return folder


def _transpose_moment(data: bytearray) -> None:
    dims, _ = _checkpoint_moment(data, "model.2.weight", 0)
    assert struct.unpack_from("<2q", data, dims) == (3, 16)
    struct.pack_into("<2q", data, dims, 16, 3)  # same size, other shape: ORT loads it, then fails in the step


def _rename_moment(data: bytearray) -> None:
    _, name = _checkpoint_moment(data, "model.0.bias", 1)
    assert bytes(data[name : name + 9]) == b"momentum1"
    data[name + 8] = ord("7")  # ORT raised a bare IndexError on this one


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_transpose_moment, r"checkpoint: AdamW momentum0 of 'model.2.weight' is float32 \(16, 3\); the parameter is float32 \(3, 16\)"),
        (
            _rename_moment,
            r"checkpoint: optimizer state of 'model.0.bias' holds \['momentum0', 'momentum7'\]; adamw keeps \['momentum0', 'momentum1'\]",
        ),
        (lambda data: data.__setitem__(slice(0, 4), b"\xff\xff\xff\x7f"), r"checkpoint: malformed"),
        (lambda data: data.__delitem__(slice(len(data) // 2, None)), r"checkpoint: malformed"),
    ],
)
def test_checkpoint_optimizer_state_is_checked_against_the_parameters(exports, tmp_path, live, change, match) -> None:
    _refused(_surgery(exports, tmp_path, change), match, live)


@pytest.mark.parametrize(("name", "match"), [("replay.npz", "not a valid replay archive"), ("sgd_state.npz", "not a valid archive")])
def test_truncated_archives_are_refused(exports, tmp_path, live, name, match) -> None:
    """A cut zip raised zipfile.BadZipFile, which no caller expects."""
    folder = Path(shutil.copytree(exports["mlp3"], tmp_path / "cut"))
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    rehash(folder)
    _refused(folder, f"{name} is {match}: File is not a zip file", live)


# ------------------------------------------------------------- hypothesis
_NAMES = ["input", "labels", "logits", "model.0.weight", "model.2.bias", "x", ""]
_PARAMS = ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias", "model.9.weight"]
_SHAPES = st.lists(st.integers(1, 8), max_size=3).map(lambda dims: ["batch", *dims])
# manifest path -> values near the valid ones (so most mutations get past the value checks)
_MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "num_classes": st.none() | st.integers(0, 8),
    "ignore_index": st.none() | st.integers(-101, 8),
    "structure": st.sampled_from(["tensor", "dict", "sequence"]),
    "output.shape": _SHAPES,
    "inputs.0.shape": _SHAPES,
    "labels.shape": _SHAPES,
    "output.name": st.sampled_from(_NAMES),
    "inputs.0.name": st.sampled_from(_NAMES),
    "labels.name": st.sampled_from(_NAMES),
    "output.dtype": st.sampled_from(["float32", "int64"]),
    "inputs.0.dtype": st.sampled_from(["float32", "int64", "int32", "bool"]),
    "labels.dtype": st.sampled_from(["float32", "int64"]),
    "trainable": st.lists(st.sampled_from(_PARAMS), min_size=1, max_size=4, unique=True),
    "sgd_state": st.lists(st.sampled_from(_PARAMS), max_size=4, unique=True),
    "param_names": st.dictionaries(st.sampled_from(_PARAMS), st.sampled_from(["0.weight", "2.bias"]), min_size=1, max_size=5),
    "optimizer.momentum": st.floats(0.0, 1.0),
    "replay": st.none(),
}
_MUTATION = st.sampled_from(sorted(_MUTATIONS)).flatmap(lambda path: st.tuples(st.just(path), _MUTATIONS[path]))


def _lenient(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    """``edit``, skipped where an earlier mutation removed the place it edits."""

    def apply(manifest: dict) -> None:
        try:
            edit(manifest)
        except (TypeError, KeyError, IndexError, ValueError):
            pass

    return apply


def _batch_of(spec: Any) -> tuple[Any, np.ndarray]:
    """A batch for whatever spec was loaded: zero inputs, and the highest class it allows as every label."""
    arrays = [np.zeros((3, *item.shape), item.dtype) for item in spec.inputs]
    x: Any = arrays[0] if spec.structure == "tensor" else arrays
    if spec.structure == "dict":
        x = {item.name: array for item, array in zip(spec.inputs, arrays)}
    top = spec.num_classes - 1 if spec.num_classes is not None else 0
    return x, np.full((3, *spec.labels.shape), top, spec.labels.dtype)


def _graph_facts(spec: Any) -> tuple[Any, ...]:
    """What the graphs and the checkpoint state, as the loaded spec describes it."""
    return spec.inputs, spec.labels, spec.output, spec.num_classes, sorted(spec.trainable)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_any_manifest_mutation_is_refused_or_harmless(exports, live, mutations) -> None:
    """Whatever a re-signed manifest says, loading raises ArtifactError, or the learner it gives agrees
    with the graphs on every fact they state, and training on a batch of its own spec (labels at its
    highest class) raises nothing but InvalidBatchError."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(shutil.copytree(exports["mlp3"], Path(scratch) / "m"))
        rehash(folder, _both(*(_lenient(_edit(path, copy.deepcopy(value))) for path, value in mutations)))
        before, files = _snapshot(live), _folder_bytes(folder)
        try:
            device = OrtOnlineLearner.from_artifacts(folder)
        except ArtifactError:
            _assert_same(before, _snapshot(live))
            assert _folder_bytes(folder) == files
            return
        assert _graph_facts(device.spec) == _graph_facts(live.spec)
        assert device.spec.ignore_index in (None, live.spec.ignore_index)  # None only refuses more labels
        x, y = _batch_of(device.spec)
        try:
            device.observe((x, y))
            device.predict(x)
        except InvalidBatchError:
            pass
        _assert_same(before, _snapshot(live))


@pytest.mark.parametrize(("name", "file"), [("mlp3", "replay.npz"), ("mlp3", "sgd_state.npz")])
def test_a_file_over_its_bound_is_refused_unread(exports, tmp_path, live, name, file) -> None:
    """A sparse file far beyond what its kind can hold, re-hashed as an attacker would (the manifest's hashing
    reads in chunks): refused from its size before it is read into memory."""
    folder = Path(shutil.copytree(exports[name], tmp_path / "big"))
    with open(folder / file, "r+b") as handle:
        handle.truncate(3 << 30)  # 3 GiB, no disk used
    rehash(folder)
    _refused(folder, rf"{file} in .* is 3221225472 bytes, over the \d+-byte bound for this file", live)
