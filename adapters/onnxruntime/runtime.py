"""The on-device learner for ONNX Runtime artifacts: numpy and ``onnxruntime-training-cpu`` only, no torch.

:class:`OrtOnlineLearner` loads a folder written by :func:`taste_cl.adapters.onnxruntime.learner_export.export`
(or by its own :meth:`~OrtOnlineLearner.save`), checking everything before use: the
manifest (plain file names, every file listed and hashed, bounded JSON) and every value
in it, the ONNX models (no external data), and the replay buffer (dtypes, shapes, label
range, finiteness). It then keeps personalising the model: ``observe`` (test-then-train
with replay), ``predict``, ``save``/``from_artifacts`` (resume, optimizer state included)
and ``export_inference_model``.

It uses ONNX Runtime's own bindings (``onnxruntime.capi._pybind_state``: ``Module``,
``CheckpointState``, ``Optimizer``), because ``onnxruntime.training.api`` imports torch.
Install on a device (about 270 MB)::

    pip install numpy onnxruntime-training-cpu==1.19.2 && pip install --no-deps taste-cl

>>> from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
>>> device = OrtOnlineLearner.from_artifacts("artifacts")  # doctest: +SKIP
>>> stats = device.observe((x, y))  # numpy arrays  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.abc
import io
import math
import os
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import (
    ArtifactError,
    check_plain_name,
    read_manifest,
    read_verified,
    staged_folder,
    write_manifest,
)
from taste_cl.adapters.device.class_slots import ClassSlots, parse_active_classes
from taste_cl.adapters.onnxruntime.ort_checkpoint import CheckpointInfo, read_checkpoint
from taste_cl.adapters.onnxruntime.proto import Signature, ValueInfo, check_no_external_data, read_signature
from taste_cl.adapters.web.compat import REPLAY_BINARY, WEB_MANIFEST, WEB_OPTIMIZER_MODEL, add_web_artifacts
from taste_cl.exceptions import InvalidBatchError, MissingDependencyError
from taste_cl.learner.stats import ObserveStats

__all__ = [
    "ARTIFACT_FORMAT",
    "CHECKPOINT",
    "EVAL_MODEL",
    "INFERENCE_MODEL",
    "LABEL_NAME",
    "LOSS_NAME",
    "OPTIMIZER_MODEL",
    "OUTPUT_NAME",
    "REPLAY_FILE",
    "SGD_STATE_FILE",
    "TRAINING_MODEL",
    "DeviceObserveStats",
    "DeviceSpec",
    "NumpyReplay",
    "OrtOnlineLearner",
    "OrtSession",
    "parse_manifest",
]

ARTIFACT_FORMAT = 2
TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL = "training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"
CHECKPOINT, INFERENCE_MODEL = "checkpoint", "inference_model.onnx"
REPLAY_FILE, SGD_STATE_FILE = "replay.npz", "sgd_state.npz"
WEB_FILES = (WEB_MANIFEST, WEB_OPTIMIZER_MODEL, REPLAY_BINARY)  # what the browser learner reads; unused here
LABEL_NAME, LOSS_NAME, OUTPUT_NAME = "labels", "loss", "logits"
STRUCTURES = ("tensor", "dict", "sequence")
INPUT_DTYPES = ("float32", "int64", "int32", "bool")
LABEL_DTYPES = ("int64", "float32")
# bounds on manifest values: far above any sensible setting, low enough that nothing explodes
MAX_CLASSES, MAX_ITERATIONS, MAX_REPLAY_BATCH, MAX_CAPACITY = 100_000, 1_000, 100_000, 10_000_000
MAX_INPUTS, MAX_DIM, MAX_ROW_ELEMENTS = 64, 1_000_000, 50_000_000


class _WithoutTorchFrontend(importlib.abc.MetaPathFinder):
    """Refuses ``onnxruntime.training`` while ``onnxruntime`` first loads.

    Its import-time build check imports ORTModule, the PyTorch frontend, and with it torch
    (~600 MB) wherever torch is installed; the runtime uses neither, and the check treats
    the refusal as "no ORTModule".
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError("the device runtime loads ONNX Runtime without its PyTorch frontend")


def _ort() -> Any:
    """ONNX Runtime's training bindings (no torch), logging warnings and errors only."""
    guard = _WithoutTorchFrontend() if "onnxruntime" not in sys.modules and "torch" not in sys.modules else None
    if guard is not None:
        sys.meta_path.insert(0, guard)
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError as error:
        raise MissingDependencyError("onnxruntime-training-cpu", "onnx") from error
    finally:
        if guard is not None:
            sys.meta_path.remove(guard)
    if not hasattr(C, "CheckpointState"):
        raise MissingDependencyError("onnxruntime-training-cpu", "onnx")
    C.set_default_logger_severity(3)
    return C


# ------------------------------------------------------------------ manifest
@dataclass(frozen=True)
class TensorSpec:
    """One graph input or target: its name, dtype and shape without the batch axis.

    ``bound``: an integer input of embedding ids takes values in ``[0, bound)`` (the table size).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    bound: int | None = None

    def as_json(self) -> dict[str, Any]:
        bound = {} if self.bound is None else {"bound": self.bound}
        return {"name": self.name, "dtype": self.dtype, "shape": ["batch", *self.shape], **bound}


@dataclass(frozen=True)
class RunningStat:
    """A BatchNorm running statistic the training graph outputs and the device writes back.

    ``momentum`` is PyTorch's; ``per_sample`` the elements per channel of one sample (the
    variance is made unbiased over ``batch * per_sample`` elements, as PyTorch does).
    """

    output: str
    parameter: str
    stat: str
    momentum: float
    per_sample: int


@dataclass(frozen=True)
class DeviceSpec:
    """The validated contents of a manifest (see :func:`parse_manifest`)."""

    inputs: tuple[TensorSpec, ...]
    structure: str
    labels: TensorSpec
    output: TensorSpec
    num_classes: int | None
    ignore_index: int | None
    optimizer: dict[str, Any]
    param_names: dict[str, str]
    trainable: tuple[str, ...]
    running_stats: tuple[RunningStat, ...]
    replay: dict[str, Any] | None
    replay_batch_size: int
    train_iterations: int
    samples_seen: int
    steps: int
    active_classes: tuple[int, ...] | None = None  # classes in use when slots are reserved (see adapters/device/class_slots.py)


def _fail(what: str, value: Any, rule: str) -> ArtifactError:
    return ArtifactError(f"manifest `{what} == {value!r}`, must be {rule}")


def _int(manifest: Mapping[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(where + key, value, f"an int in [{low}, {high}]")
    return value


def _number(manifest: Mapping[str, Any], key: str, low: float, high: float, *, open_low: bool, where: str) -> float:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(where + key, value, "a finite number")
    if value > high or value < low or (open_low and value == low):
        raise _fail(where + key, value, f"in {'(' if open_low else '['}{low}, {high}]")
    return float(value)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise _fail(what, value, "a non-empty string of at most 200 characters")
    return value


def _tensor(value: Any, what: str, dtypes: Sequence[str]) -> TensorSpec:
    if not isinstance(value, Mapping):
        raise _fail(what, value, "an object with name, dtype and shape")
    shape = value.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 9 or shape[0] != "batch":
        raise _fail(f"{what}.shape", shape, 'a list ["batch", d1, ...] of at most 9 axes')
    dims = shape[1:]
    if any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIM for d in dims):
        raise _fail(f"{what}.shape", shape, f"dimensions that are ints in [1, {MAX_DIM}]")
    if math.prod(dims) > MAX_ROW_ELEMENTS:
        raise _fail(f"{what}.shape", shape, f"at most {MAX_ROW_ELEMENTS} elements per sample")
    dtype = value.get("dtype")
    if dtype not in dtypes:
        raise _fail(f"{what}.dtype", dtype, f"one of {tuple(dtypes)}")
    bound = value.get("bound")
    if bound is not None and dtype not in ("int64", "int32"):
        raise _fail(f"{what}.bound", bound, "absent for a non-integer input")
    if bound is not None:
        bound = _int(value, "bound", 1, 2**62, f"{what}.")
    return TensorSpec(_name(value.get("name"), f"{what}.name"), str(dtype), tuple(dims), bound)


def _optimizer(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.get("type") not in ("sgd", "adamw"):
        raise _fail("optimizer.type", value.get("type") if isinstance(value, Mapping) else value, "'sgd' or 'adamw'")
    where = "optimizer."
    config: dict[str, Any] = {"type": value["type"], "lr": _number(value, "lr", 0.0, 1e6, open_low=True, where=where)}
    config["weight_decay"] = _number(value, "weight_decay", 0.0, 1e6, open_low=False, where=where)
    if config["type"] == "adamw":
        betas = value.get("betas")
        if not isinstance(betas, list) or len(betas) != 2:
            raise _fail("optimizer.betas", betas, "a list of two numbers in [0, 1)")
        config["betas"] = [_number({"b": b}, "b", 0.0, 1.0, open_low=False, where="optimizer.betas.") for b in betas]
        if max(config["betas"]) >= 1.0:
            raise _fail("optimizer.betas", betas, "two numbers in [0, 1)")
        config["eps"] = _number(value, "eps", 0.0, 1.0, open_low=True, where=where)
    else:
        config["momentum"] = _number(value, "momentum", 0.0, 1.0, open_low=False, where=where)
        config["dampening"] = _number(value, "dampening", 0.0, 1.0, open_low=False, where=where)
        nesterov = value.get("nesterov")
        if not isinstance(nesterov, bool):
            raise _fail("optimizer.nesterov", nesterov, "true or false")
        config["nesterov"] = nesterov
    return config


def _replay_info(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("file") != REPLAY_FILE:
        raise _fail("replay.file", value.get("file") if isinstance(value, Mapping) else value, repr(REPLAY_FILE))
    where = "replay."
    capacity = _int(value, "capacity", 1, MAX_CAPACITY, where)
    size = _int(value, "size", 0, capacity, where)
    seen = _int(value, "seen", size, 2**62, where)
    rng = value.get("rng")
    if rng is not None:
        if not isinstance(rng, Mapping) or set(rng) != {"state", "inc", "has_uint32", "uinteger"}:
            raise _fail("replay.rng", rng, "null or {state, inc, has_uint32, uinteger}")
        _int(rng, "has_uint32", 0, 1, "replay.rng.")
        _int(rng, "uinteger", 0, 2**32 - 1, "replay.rng.")
        for key in ("state", "inc"):
            text = rng[key]
            if not isinstance(text, str) or not text.isdigit() or len(text) > 40 or int(text) >= 2**128:
                raise _fail(f"replay.rng.{key}", text, "a decimal string below 2**128")
    return {"file": REPLAY_FILE, "capacity": capacity, "size": size, "seen": seen,
            "seed": _int(value, "seed", 0, 2**63 - 1, where), "rng": rng}  # fmt: skip


def _running_stat(entry: Mapping[str, Any], i: int, param_names: Mapping[str, str]) -> RunningStat:
    where = f"running_stats[{i}]."
    parameter = entry.get("parameter")
    if parameter not in param_names:
        raise _fail(where + "parameter", parameter, "a name from param_names")
    if entry.get("stat") not in ("mean", "var"):
        raise _fail(where + "stat", entry.get("stat"), "'mean' or 'var'")
    return RunningStat(
        _name(entry.get("output"), where + "output"),
        str(parameter),
        entry["stat"],
        _number(entry, "momentum", 0.0, 1.0, open_low=True, where=where),
        _int(entry, "per_sample", 1, MAX_ROW_ELEMENTS, where),
    )


def parse_manifest(manifest: Mapping[str, Any]) -> DeviceSpec:
    """Validate every value the device uses; :class:`ArtifactError` names the first bad one."""
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"manifest format {manifest.get('format')!r}; this taste_cl reads format {ARTIFACT_FORMAT}")
    raw_inputs = manifest.get("inputs")
    if not isinstance(raw_inputs, list) or not 1 <= len(raw_inputs) <= MAX_INPUTS:
        raise _fail("inputs", raw_inputs, f"a list of 1 to {MAX_INPUTS} inputs")
    inputs = tuple(_tensor(item, f"inputs[{i}]", INPUT_DTYPES) for i, item in enumerate(raw_inputs))
    structure = manifest.get("structure")
    if structure not in STRUCTURES or (structure == "tensor" and len(inputs) != 1):
        raise _fail("structure", structure, f"one of {STRUCTURES} ('tensor' with exactly one input)")
    labels = _tensor(manifest.get("labels"), "labels", LABEL_DTYPES)
    output = _tensor(manifest.get("output"), "output", ("float32",))
    names = [spec.name for spec in inputs]
    if len({*names, labels.name, output.name}) != len(names) + 2:
        raise _fail("inputs", names, "distinct names, different from the labels and output names")
    num_classes = manifest.get("num_classes")
    if num_classes is not None:
        num_classes = _int(manifest, "num_classes", 1, MAX_CLASSES)
    if (labels.dtype == "int64") != (num_classes is not None):
        raise _fail("num_classes", num_classes, "an int exactly when the labels are int64 class indices")
    if num_classes is not None and output.shape[:1] != (num_classes,):
        width = output.shape[0] if output.shape else None
        raise _fail("num_classes", num_classes, f"the output width {width} (the output is {output.as_json()['shape']})")
    ignore_index = manifest.get("ignore_index")
    if ignore_index is not None:
        ignore_index = _int(manifest, "ignore_index", -(2**31), 2**31 - 1)
    param_names = manifest.get("param_names")
    if not isinstance(param_names, Mapping) or not param_names:
        raise _fail("param_names", param_names, "a non-empty object mapping graph names to PyTorch names")
    for key, value in param_names.items():
        _name(key, "param_names key")
        _name(value, f"param_names[{key!r}]")
    trainable = manifest.get("trainable")
    if not isinstance(trainable, list) or not trainable or any(name not in param_names for name in trainable):
        raise _fail("trainable", trainable, "a non-empty list of names from param_names")
    stats = manifest.get("running_stats", [])
    if not isinstance(stats, list) or any(not isinstance(entry, Mapping) for entry in stats):
        raise _fail("running_stats", stats, "a list of {output, parameter, stat, momentum, per_sample} objects")
    running_stats = tuple(_running_stat(entry, i, param_names) for i, entry in enumerate(stats))
    batch_size = manifest.get("batch_size")
    if batch_size is not None:
        _int(manifest, "batch_size", 1, MAX_REPLAY_BATCH)
    counters = manifest.get("counters")
    if not isinstance(counters, Mapping):
        raise _fail("counters", counters, "an object with samples_seen and steps")
    return DeviceSpec(
        inputs=inputs,
        structure=structure,
        labels=labels,
        output=output,
        num_classes=num_classes,
        ignore_index=ignore_index,
        optimizer=_optimizer(manifest.get("optimizer")),
        param_names=dict(param_names),
        trainable=tuple(trainable),
        running_stats=running_stats,
        replay=_replay_info(manifest.get("replay")),
        replay_batch_size=_int(manifest, "replay_batch_size", 0, MAX_REPLAY_BATCH),
        train_iterations=_int(manifest, "train_iterations", 1, MAX_ITERATIONS),
        samples_seen=_int(counters, "samples_seen", 0, 2**62, "counters."),
        steps=_int(counters, "steps", 0, 2**62, "counters."),
        active_classes=parse_active_classes(manifest.get("active_classes"), num_classes),
    )


# ------------------------------------------------------------------- batches
_KINDS = {"float32": "fiu", "int64": "iu", "int32": "iu", "bool": "b"}


def _array(value: Any, spec: TensorSpec, what: str, n: int | None) -> np.ndarray:
    """``value`` as a C-contiguous array of ``spec``'s dtype and shape; :class:`InvalidBatchError` otherwise."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. a tensor on an accelerator, ragged lists
        raise InvalidBatchError(f"{what} could not be read as an array: {error}") from None
    kinds = _KINDS.get(spec.dtype, "fiu")
    if array.dtype.kind not in kinds or (array.dtype.kind == "f" and array.dtype.itemsize > 8):
        raise InvalidBatchError(f"{what} has dtype {array.dtype}, must be convertible to {spec.dtype} (kinds {kinds!r})")
    if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
        raise InvalidBatchError(f"{what} has shape {tuple(array.shape)}, must be (n, {', '.join(map(str, spec.shape))})")
    if array.shape[0] < 1 or (n is not None and array.shape[0] != n):
        raise InvalidBatchError(f"{what} has {array.shape[0]} rows, must have {n if n is not None else 'at least 1'}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidBatchError(f"{what} holds NaN or infinite values")
    problem = _bad_ids(array, spec)
    if problem:
        raise InvalidBatchError(f"{what} holds {problem}")
    return np.ascontiguousarray(array, dtype=spec.dtype)


def _bad_ids(array: np.ndarray, spec: TensorSpec) -> str | None:
    """Why embedding ids are outside their table (ONNX Runtime's Gather wraps negative ids), or None."""
    if spec.bound is None or not array.size or 0 <= array.min() <= array.max() < spec.bound:
        return None
    return f"ids in [{array.min()}, {array.max()}], must be in [0, {spec.bound - 1}] (the embedding table's rows)"


def _leaves(x: Any, spec: DeviceSpec) -> list[Any]:
    if spec.structure == "tensor":
        return [x]
    if spec.structure == "dict":
        names = [item.name for item in spec.inputs]
        if not isinstance(x, Mapping) or set(x) != set(names):
            got = sorted(map(str, x)) if isinstance(x, Mapping) else type(x).__name__
            raise InvalidBatchError(f"x must be a dict with keys {sorted(names)}; got {got}")
        return [x[name] for name in names]
    if not isinstance(x, (list, tuple)) or len(x) != len(spec.inputs):
        raise InvalidBatchError(f"x must be a list or tuple of {len(spec.inputs)} arrays; got {type(x).__name__}")
    return list(x)


def _features(x: Any, spec: DeviceSpec) -> list[np.ndarray]:
    arrays: list[np.ndarray] = []
    for leaf, item in zip(_leaves(x, spec), spec.inputs):
        arrays.append(_array(leaf, item, f"x[{item.name!r}]", arrays[0].shape[0] if arrays else None))
    return arrays


def _bad_labels(labels: np.ndarray, spec: DeviceSpec) -> str | None:
    """Why class labels are out of range (the loss's ``ignore_index`` is allowed), or None."""
    if spec.num_classes is None:
        return None
    kept = labels[labels != spec.ignore_index] if spec.ignore_index is not None else labels
    if kept.size and (kept.min() < 0 or kept.max() >= spec.num_classes):
        ignored = f" (or {spec.ignore_index}, ignored)" if spec.ignore_index is not None else ""
        return f"labels in [{kept.min()}, {kept.max()}], must be in [0, {spec.num_classes - 1}]{ignored}"
    return None


def _targets(y: Any, spec: DeviceSpec, n: int) -> np.ndarray:
    if spec.labels.dtype == "float32" and spec.labels.shape == (1,) and np.ndim(y) == 1:
        y = np.reshape(y, (-1, 1))  # like the learner: a regression target (n,) for an (n, 1) output
    labels = _array(y, spec.labels, "y", n)
    problem = _bad_labels(labels, spec)
    if problem:
        raise InvalidBatchError(f"y holds {problem}")
    return labels


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping) and set(batch) == {"x", "y"}:
        return batch["x"], batch["y"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise InvalidBatchError(f"batch must be (x, y) or {{'x': x, 'y': y}}; got {type(batch).__name__}")


# -------------------------------------------------------------------- replay
class NumpyReplay:
    """A reservoir buffer of numpy rows (one array per graph input, plus targets), seeded."""

    def __init__(self, capacity: int, spec: DeviceSpec, *, seed: int = 0) -> None:
        self.capacity, self.seed, self.seen, self.size = capacity, seed, 0, 0
        self._spec = spec
        self._x = [np.zeros((capacity, *item.shape), item.dtype) for item in spec.inputs]
        self._y = np.zeros((capacity, *spec.labels.shape), spec.labels.dtype)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def __len__(self) -> int:
        return self.size

    def add(self, x: list[np.ndarray], y: np.ndarray) -> None:
        """Offer every row of a validated batch to the reservoir."""
        for i in range(y.shape[0]):
            self.seen += 1
            if self.size < self.capacity:
                slot = self.size
                self.size += 1
            else:
                slot = int(self._rng.integers(0, self.seen))
                if slot >= self.capacity:
                    continue
            for store, leaf in zip(self._x, x):
                store[slot] = leaf[i]
            self._y[slot] = y[i]

    def sample(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """``n`` distinct stored rows, drawn at random."""
        idx = np.sort(self._rng.choice(self.size, size=min(n, self.size), replace=False))
        return [store[idx] for store in self._x], self._y[idx]

    def rows(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Copies of the first ``n`` stored rows, without a random draw (the tuner's probes)."""
        n = min(n, self.size)
        return [store[:n].copy() for store in self._x], self._y[:n].copy()

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        arrays = {f"x{i}": store[: self.size] for i, store in enumerate(self._x)}
        np.savez(buffer, y=self._y[: self.size], **arrays)  # type: ignore[arg-type]
        return buffer.getvalue()

    def info(self) -> dict[str, Any]:
        state = self._rng.bit_generator.state
        rng = {"state": str(state["state"]["state"]), "inc": str(state["state"]["inc"]),
               "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}  # fmt: skip
        return {"file": REPLAY_FILE, "capacity": self.capacity, "size": self.size, "seen": self.seen, "seed": self.seed,
                "rng": rng}  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes, info: dict[str, Any], spec: DeviceSpec) -> NumpyReplay:
        """Rebuild a buffer from ``replay.npz`` bytes, checking keys, dtypes, shapes, finiteness and labels."""
        replay = cls(info["capacity"], spec, seed=info["seed"])
        size = info["size"]
        expected = {f"x{i}": (item.dtype, item.shape) for i, item in enumerate(spec.inputs)}
        expected["y"] = (spec.labels.dtype, spec.labels.shape)
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                if sorted(archive.files) != sorted(expected):
                    raise ArtifactError(f"{REPLAY_FILE} holds arrays {sorted(archive.files)}, expected {sorted(expected)}")
                for key, (dtype, shape) in expected.items():  # bound every array before reading it
                    declared = archive.zip.getinfo(f"{key}.npy").file_size
                    if declared > size * np.dtype(dtype).itemsize * max(1, math.prod(shape)) + 4096:
                        raise ArtifactError(f"{REPLAY_FILE}: array {key!r} is larger than {size} rows of {shape}")
                arrays = {key: archive[key] for key in expected}
        except (ValueError, OSError, KeyError, zipfile.BadZipFile) as error:
            if isinstance(error, ArtifactError):
                raise
            raise ArtifactError(f"{REPLAY_FILE} is not a valid replay archive: {error}") from None
        for key, (dtype, shape) in expected.items():
            array = arrays[key]
            if array.dtype != np.dtype(dtype) or array.shape != (size, *shape):
                raise ArtifactError(f"{REPLAY_FILE}: array {key!r} is {array.dtype} {array.shape}, must be {dtype} {(size, *shape)}")
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ArtifactError(f"{REPLAY_FILE}: array {key!r} holds NaN or infinite values")
        bad_ids = [f"{key!r} holds {problem}" for key, item in zip(expected, spec.inputs) if (problem := _bad_ids(arrays[key], item))]
        if bad_ids:
            raise ArtifactError(f"{REPLAY_FILE}: array {bad_ids[0]}")
        y = arrays["y"]
        problem = _bad_labels(y, spec)
        if problem:
            raise ArtifactError(f"{REPLAY_FILE}: {problem}")
        for i in range(len(spec.inputs)):
            replay._x[i][:size] = arrays[f"x{i}"]
        replay._y[:size] = y
        replay.size, replay.seen = size, info["seen"]
        if info.get("rng") is not None:
            replay._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(info["rng"]["state"]), "inc": int(info["rng"]["inc"])},
                "has_uint32": info["rng"]["has_uint32"],
                "uinteger": info["rng"]["uinteger"],
            }
        return replay


# ------------------------------------------------------------------- session
class OrtSession:
    """The ONNX Runtime objects of one artifact folder and the optimizer step; no replay, no counters.

    ``training_model`` replaces the folder's training graph (the parity gate passes a copy
    with dropout off). SGD runs in numpy on the gradients ORT computes (ORT's own SGD has no
    momentum, dampening, Nesterov or weight decay); AdamW runs in ORT's optimizer graph.
    """

    def __init__(
        self,
        folder: Path,
        spec: DeviceSpec,
        sgd_state: dict[str, np.ndarray] | None = None,
        *,
        training_model: Path | None = None,
        session_options: Any | None = None,
    ) -> None:
        C = _ort()
        self.folder, self.spec = folder, spec
        try:
            self.state = C.load_checkpoint(str(folder / CHECKPOINT))
            self._device = device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
            options = session_options
            if options is None:
                options = C.SessionOptions()
                options.log_severity_level = 3  # errors only: sessions log every graph pass at INFO
            self.module = C.Module(str(training_model or folder / TRAINING_MODEL), self.state, str(folder / EVAL_MODEL), device, options)
            self.optimizer = C.Optimizer(str(folder / OPTIMIZER_MODEL), self.state, device, options) if spec.optimizer["type"] == "adamw" else None
        except RuntimeError as error:
            raise ArtifactError(f"ONNX Runtime could not load the artifacts in {str(folder)!r}: {error}") from error
        missing = [name for name in spec.param_names if not self.state.has_parameter(name)]
        if missing:
            raise ArtifactError(f"the checkpoint lacks the parameters {missing[:5]} named in the manifest")
        outputs = list(self.module.output_names(True))
        if outputs[:2] != [LOSS_NAME, OUTPUT_NAME] or [stat.output for stat in spec.running_stats] != outputs[2:]:
            raise ArtifactError(f"the training graph's outputs are {outputs}, not what the manifest describes")
        self.lr = spec.optimizer["lr"]
        # own copies: the in-place update must not write into the caller's arrays (an exporter's torch buffers)
        self.sgd_state = {name: np.array(value, np.float32) for name, value in (sgd_state or {}).items()}
        self._scratch_buffer = np.empty(0, np.float32)
        self._C = C

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
        if self.optimizer is not None:
            self.optimizer.set_learning_rate(self._lr)

    def _run(self, inputs: list[np.ndarray], labels: np.ndarray, training: bool) -> list[np.ndarray]:
        fetches = self._C.OrtValueVector()
        step = self.module.train_step if training else self.module.eval_step
        step([*inputs, labels], fetches)
        return [value.numpy() for value in fetches]

    def train_step(self, inputs: list[np.ndarray], labels: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """One optimizer step; returns (outputs, loss, skipped). A non-finite loss or gradient skips the update."""
        self.module.lazy_reset_grad()
        fetched = self._run(inputs, labels, True)
        loss = float(fetched[0])
        # views of ORT's own buffers (no copies): the update below writes the weights in place
        params = [self.state.get_parameter(name) for name in self.spec.trainable]
        grads = {name: param.grad.numpy() for name, param in zip(self.spec.trainable, params)}
        skipped = not math.isfinite(loss) or not all(_finite(g) for g in grads.values())
        if not skipped:
            if self.optimizer is not None:
                self.optimizer.optimizer_step()
            else:
                self._sgd_step(grads, [param.data.numpy() for param in params])
            self._write_running_stats(fetched[2:], labels.shape[0])
        return fetched[1], loss, skipped

    def accumulated_step(self, parts: Sequence[tuple[list[np.ndarray], np.ndarray]]) -> tuple[np.ndarray, float, bool]:
        """One optimizer step on micro-batches' gradients, each weighted by its share of the rows: the
        step :meth:`train_step` takes on them concatenated, up to float rounding (the device batch-size
        tuner's gradient accumulation). BatchNorm statistics follow each micro-batch with a finite
        loss, as in PyTorch. Returns (outputs of all rows, loss, skipped)."""
        total = sum(labels.shape[0] for _, labels in parts)
        outputs: list[np.ndarray] = []
        summed: dict[str, np.ndarray] = {}
        loss = 0.0
        for inputs, labels in parts:
            self.module.lazy_reset_grad()
            fetched = self._run(inputs, labels, True)
            weight = labels.shape[0] / total
            loss += weight * float(fetched[0])
            for name in self.spec.trainable:  # .numpy() is a view of ORT's buffer: the product is a copy
                grad = weight * self.state.get_parameter(name).grad.numpy()
                summed[name] = grad if name not in summed else summed[name] + grad
            outputs.append(fetched[1])
            if math.isfinite(float(fetched[0])):
                self._write_running_stats(fetched[2:], labels.shape[0])
        skipped = not math.isfinite(loss) or not all(np.isfinite(g).all() for g in summed.values())
        if not skipped:
            if self.optimizer is not None:
                for name, grad in summed.items():
                    self.state.get_parameter(name).grad.update_inplace(np.ascontiguousarray(grad, np.float32))
                self.optimizer.optimizer_step()
            else:
                self._sgd_step(summed, [self.state.get_parameter(name).data.numpy() for name in summed])
        return np.concatenate(outputs), loss, skipped

    def _write_running_stats(self, values: list[np.ndarray], batch: int) -> None:
        """Store the graph's new running statistics; ONNX's variance is biased, PyTorch's unbiased."""
        for value, stat in zip(values, self.spec.running_stats):
            n = batch * stat.per_sample
            if stat.stat == "var" and n > 1:
                kept = (1.0 - stat.momentum) * self.state.get_parameter(stat.parameter).data.numpy()
                value = kept + (value - kept) * (n / (n - 1))
            self._write(stat.parameter, value.astype(np.float32))

    def _write(self, name: str, value: np.ndarray) -> None:
        self.state.copy_parameter_from(name, self._C.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self._device))

    def _sgd_step(self, grads: dict[str, np.ndarray], weights: list[np.ndarray]) -> None:
        """PyTorch's SGD update (weight decay, momentum, dampening, Nesterov) in numpy, in place.

        ``grads`` and ``weights`` are views of ONNX Runtime's gradient and parameter buffers:
        the gradients are scratch (the next step's ``lazy_reset_grad`` overwrites them) and the
        weights are updated where ORT reads them, so a step copies no parameter. The operations
        and their rounding are PyTorch's: ``buf = momentum * buf + (1 - dampening) * grad``,
        then ``weight -= lr * step``.
        """
        config = self.spec.optimizer
        momentum, dampening, decay = config["momentum"], config["dampening"], config["weight_decay"]
        for (name, grad), weight in zip(grads.items(), weights):
            if decay:
                grad += np.multiply(weight, decay, out=self._scratch(weight))
            step = grad
            if momentum:
                buffer = self.sgd_state.get(name)
                if buffer is None:
                    buffer = self.sgd_state[name] = grad.copy()
                else:
                    buffer *= momentum
                    buffer += grad if dampening == 0 else np.multiply(grad, 1 - dampening, out=self._scratch(grad))
                step = buffer
                if config["nesterov"]:
                    step = np.multiply(buffer, momentum, out=self._scratch(grad))
                    step += grad
            weight -= np.multiply(step, self._lr, out=self._scratch(weight))

    def _scratch(self, like: np.ndarray) -> np.ndarray:
        """A reused float32 buffer shaped like ``like`` (one allocation, the largest parameter's size)."""
        if self._scratch_buffer.size < like.size:
            self._scratch_buffer = np.empty(like.size, np.float32)
        return self._scratch_buffer[: like.size].reshape(like.shape)

    def predict(self, inputs: list[np.ndarray]) -> np.ndarray:
        labels = np.zeros((inputs[0].shape[0], *self.spec.labels.shape), self.spec.labels.dtype)
        return self._run(inputs, labels, False)[1]

    def parameters(self, *, trainable_only: bool = False) -> dict[str, np.ndarray]:
        """Copies of the parameters by their PyTorch names."""
        names = self.spec.trainable if trainable_only else self.spec.param_names
        return {self.spec.param_names[n]: self.state.get_parameter(n).data.numpy().copy() for n in names}

    def save(self, folder: Path) -> None:
        """Write the checkpoint (optimizer state included), the SGD buffers and the inference model."""
        self._C.save_checkpoint(self.state, str(folder / CHECKPOINT), True)
        if self.sgd_state:
            arrays = {f"m{i}": self.sgd_state[name] for i, name in enumerate(self.sgd_order())}
            np.savez(folder / SGD_STATE_FILE, **arrays)  # type: ignore[arg-type]
        self.module.export_model_for_inferencing(str(folder / INFERENCE_MODEL), [OUTPUT_NAME])

    def sgd_order(self) -> list[str]:
        """The trainable parameters that have an SGD momentum buffer, in a fixed order."""
        return [name for name in self.spec.trainable if name in self.sgd_state]


def _finite(values: np.ndarray) -> bool:
    """Whether every element is finite: one summing pass, the element-wise check only when the sum is not finite."""
    return math.isfinite(float(values.sum())) or bool(np.isfinite(values).all())


def _load_sgd_state(data: bytes, spec: DeviceSpec, manifest: Mapping[str, Any], shapes: dict[str, tuple]) -> dict:
    names = manifest.get("sgd_state")
    if not isinstance(names, list) or any(name not in spec.trainable for name in names):
        raise _fail("sgd_state", names, "a list of trainable parameter names")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            if sorted(archive.files) != sorted(f"m{i}" for i in range(len(names))):
                raise ArtifactError(f"{SGD_STATE_FILE} holds {sorted(archive.files)}, expected one array per name")
            state = {name: archive[f"m{i}"] for i, name in enumerate(names)}
    except (ValueError, OSError, zipfile.BadZipFile) as error:
        if isinstance(error, ArtifactError):
            raise
        raise ArtifactError(f"{SGD_STATE_FILE} is not a valid archive: {error}") from None
    for name, value in state.items():
        if value.dtype != np.float32 or value.shape != shapes[name] or not np.isfinite(value).all():
            raise ArtifactError(f"{SGD_STATE_FILE}: momentum of {name!r} is not a finite float32 {shapes[name]} array")
    return state


# --------------------------------------------------------------- cross-checks
_GRAD_BUFFER, _GRAD_OUTPUT, _RESET_GRAD = "_grad.accumulation.buffer", "_grad.accumulation.out", "lazy_reset_grad"
_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad")
_NORM_OPS = ("BatchNormalization", "BatchNormInternal")  # inputs (x, scale, bias, mean, var), outputs (y, mean, var, ...)
_TRAINING_OPS = (*_LOSS_OPS, *_NORM_OPS)
_ADAMW_OP = "AdamWOptimizer"
_MOMENTS = {"adamw": ["momentum0", "momentum1"], "sgd": ["momentum0"]}  # ORT's optimizer state per parameter


def _dims(dims: Sequence[int | None] | None) -> str:
    if dims is None:
        return "[no shape]"
    return "[" + ", ".join("batch" if d is None and i == 0 else "?" if d is None else str(d) for i, d in enumerate(dims)) + "]"


def _check_tensor(value: ValueInfo, spec: TensorSpec, file: str, role: str) -> None:
    """The graph's tensor is the manifest's: same name and dtype, a free batch axis, every other axis equal or free."""
    dims = value.dims
    if (
        value.name != spec.name
        or value.dtype != spec.dtype
        or dims is None
        or len(dims) != len(spec.shape) + 1
        or dims[0] is not None
        or any(d is not None and d != s for d, s in zip(dims[1:], spec.shape))
    ):
        renamed = f"{spec.name!r} " if spec.name != value.name else ""
        raise ArtifactError(
            f"{file}: {role} {value.name!r} is {value.dtype} {_dims(dims)}; the manifest says {renamed}{spec.dtype} {_dims((None, *spec.shape))}"
        )


def _check_inputs(graph: Signature, file: str, expected: Sequence[TensorSpec]) -> tuple[ValueInfo, ...]:
    """The graph's first inputs are ``expected``; returns the inputs after them (parameters and buffers)."""
    if len(graph.inputs) < len(expected):
        raise ArtifactError(f"{file} takes {len(graph.inputs)} inputs; the manifest describes {len(expected)} before the parameters")
    for value, spec in zip(graph.inputs, expected):
        _check_tensor(value, spec, file, "input")
    return graph.inputs[len(expected) :]


def _check_outputs(graph: Signature, file: str, spec: DeviceSpec, info: CheckpointInfo, *, training: bool, loss: bool = True) -> None:
    """Loss (scalar), the model output, then (training) each running statistic, shaped like its parameter."""
    outputs = [value for value in graph.outputs if not value.name.endswith(_GRAD_OUTPUT)]
    stats = spec.running_stats if training else ()
    expected = [*([LOSS_NAME] if loss else []), spec.output.name, *(stat.output for stat in stats)]
    if [value.name for value in outputs] != expected:
        raise ArtifactError(f"{file} outputs {[value.name for value in outputs]}; the manifest describes {expected}")
    if loss and (outputs[0].dtype != "float32" or outputs[0].dims != ()):
        raise ArtifactError(f"{file}: the loss is {outputs[0].dtype} {_dims(outputs[0].dims)}, must be a float32 scalar")
    _check_tensor(outputs[int(loss)], spec.output, file, "output")
    for value, stat in zip(outputs[int(loss) + 1 :], stats):
        held = info.frozen.get(stat.parameter)
        if held is None:  # the device overwrites it after each step: a trained parameter would lose its update
            raise ArtifactError(
                f"{file}: running statistic {value.name!r} would overwrite {stat.parameter!r}, not a frozen parameter of the checkpoint"
            )
        dims = value.dims
        if value.dtype != held.dtype or dims is None or len(dims) != len(held.dims) or any(d not in (None, h) for d, h in zip(dims, held.dims)):
            raise ArtifactError(f"{file}: running statistic {value.name!r} is {value.dtype} {dims}; {stat.parameter!r} is {held.describe()}")


def _check_parameters(file: str, params: Sequence[ValueInfo], info: CheckpointInfo) -> None:
    """The graph takes exactly the checkpoint's parameters, each with its dtype and dims."""
    held = info.parameters
    taken = {value.name: value for value in params}
    if taken.keys() != held.keys():
        raise ArtifactError(
            f"the checkpoint holds parameters {sorted(held.keys() - taken.keys())} that {file} does not take, "
            f"and lacks {sorted(taken.keys() - held.keys())} that it takes"
        )
    for value in params:
        tensor = held[value.name]
        if value.dtype != tensor.dtype or value.dims != tensor.dims:
            raise ArtifactError(f"checkpoint parameter {value.name!r} is {tensor.describe()}; {file} takes {value.dtype} {value.dims}")


def _check_running_stats(graph: Signature, spec: DeviceSpec) -> None:
    """Each running statistic is the BatchNorm output the manifest says: of that parameter, kind and momentum."""
    writers = {node.outputs[i]: (node, i) for node in graph.nodes if node.op_type in _NORM_OPS for i in (1, 2) if len(node.outputs) > i}
    for stat in spec.running_stats:
        if stat.output not in writers or len(writers[stat.output][0].inputs) < 5:
            raise ArtifactError(f"{TRAINING_MODEL}: no BatchNormalization outputs the running statistic {stat.output!r}")
        node, index = writers[stat.output]
        kind, parameter = ("mean", "var")[index - 1], node.inputs[index + 2]
        momentum = 1.0 - float(node.attributes.get("momentum", 0.9))  # ONNX keeps the old value's share: 1 - PyTorch's
        if (kind, parameter) != (stat.stat, stat.parameter) or abs(momentum - stat.momentum) > 1e-6:
            raise ArtifactError(
                f"{TRAINING_MODEL}: {stat.output!r} is the running {kind} of {parameter!r} with momentum {momentum:.6g}; "
                f"the manifest says the running {stat.stat} of {stat.parameter!r} with momentum {stat.momentum:.6g}"
            )


def _check_training_graph(graph: Signature, spec: DeviceSpec, info: CheckpointInfo) -> None:
    rest = _check_inputs(graph, TRAINING_MODEL, [*spec.inputs, spec.labels])
    _check_outputs(graph, TRAINING_MODEL, spec, info, training=True)
    _check_running_stats(graph, spec)
    if spec.ignore_index is not None:  # the device lets ignore_index labels through: the loss must ignore them
        losses = [node for node in graph.nodes if node.op_type in _LOSS_OPS]
        if not losses:
            raise ArtifactError(f"{TRAINING_MODEL} has no {_LOSS_OPS[0]}, so the manifest's ignore_index {spec.ignore_index} cannot hold")
        for node in losses:
            ignored = node.attributes.get("ignore_index")
            if ignored != spec.ignore_index:
                raise ArtifactError(f"{TRAINING_MODEL}: {node.op_type} has ignore_index {ignored}; the manifest says {spec.ignore_index}")
    trained = sorted(value.name.removesuffix(_GRAD_BUFFER) for value in rest if value.name.endswith(_GRAD_BUFFER))
    if trained != sorted(spec.trainable):
        raise ArtifactError(f"{TRAINING_MODEL} trains {trained}; the manifest's trainable lists {sorted(spec.trainable)}")
    _check_parameters(TRAINING_MODEL, [v for v in rest if not v.name.endswith(_GRAD_BUFFER) and v.name != _RESET_GRAD], info)


def _check_inference_graph(graph: Signature, spec: DeviceSpec, info: CheckpointInfo) -> None:
    extra = _check_inputs(graph, INFERENCE_MODEL, spec.inputs)
    if len(extra) > 1:
        raise ArtifactError(f"{INFERENCE_MODEL} takes inputs {[value.name for value in extra]} the manifest does not describe")
    if extra:  # a regression export's logits are broadcast to the labels' shape (the loss's expand), so it keeps them
        _check_tensor(extra[0], spec.labels, INFERENCE_MODEL, "input")
    _check_outputs(graph, INFERENCE_MODEL, spec, info, training=False, loss=False)
    held = info.parameters
    for value in graph.initializers:
        tensor = held.get(value.name)
        if tensor is not None and (value.dtype, value.dims) != (tensor.dtype, tensor.dims):
            raise ArtifactError(f"{INFERENCE_MODEL} holds {value.name!r} as {value.dtype} {value.dims}; the checkpoint's is {tensor.describe()}")


def _check_adamw_graph(graph: Signature, config: Mapping[str, Any]) -> None:
    """The AdamW node's attributes are the manifest's hyper-parameters (in float32) and PyTorch's update rule."""
    nodes = [node for node in graph.nodes if node.op_type == _ADAMW_OP]
    if len(nodes) != 1:
        raise ArtifactError(f"{OPTIMIZER_MODEL} has {len(nodes)} {_ADAMW_OP} nodes, must have one")
    expected = {"alpha": config["betas"][0], "beta": config["betas"][1], "epsilon": config["eps"],
                "weight_decay": config["weight_decay"], "adam_mode": 0, "correct_bias": 1}  # fmt: skip
    for key, want in expected.items():
        got = nodes[0].attributes.get(key)
        if got is None or np.float32(got) != np.float32(want):
            shown = "absent" if got is None else f"{got:.7g}"
            raise ArtifactError(f"{OPTIMIZER_MODEL}: AdamW {key} is {shown}; the manifest's optimizer gives {want:.7g}")


def _check_checkpoint(spec: DeviceSpec, info: CheckpointInfo) -> None:
    """The checkpoint trains the manifest's parameters and holds optimizer state shaped like them."""
    if sorted(info.trainable) != sorted(spec.trainable):
        raise ArtifactError(f"the checkpoint trains {sorted(info.trainable)}; the manifest's trainable lists {sorted(spec.trainable)}")
    unknown = sorted(set(spec.param_names) - set(info.parameters))
    if unknown:
        raise ArtifactError(f"the manifest's param_names name {unknown[:5]}, not in the checkpoint")
    kind = spec.optimizer["type"]
    for param in sorted(info.optimizer):
        moments = info.optimizer[param]
        if param not in info.trainable:
            raise ArtifactError(f"{CHECKPOINT}: optimizer state of {param!r}, which it does not train")
        if sorted(moments) != _MOMENTS[kind]:
            raise ArtifactError(f"{CHECKPOINT}: optimizer state of {param!r} holds {sorted(moments)}; {kind} keeps {_MOMENTS[kind]}")
        held = info.trainable[param]
        for moment, tensor in sorted(moments.items()):
            if (tensor.dtype, tensor.dims) != (held.dtype, held.dims):
                label = "AdamW" if kind == "adamw" else "SGD"
                raise ArtifactError(f"{CHECKPOINT}: {label} {moment} of {param!r} is {tensor.describe()}; the parameter is {held.describe()}")
    missing = sorted(set(spec.trainable) - set(info.optimizer))
    if kind == "adamw" and missing:  # ORT would start these moments at zero, silently
        raise ArtifactError(f"{CHECKPOINT} has no AdamW state for {missing[:5]}")


def _check_agreement(spec: DeviceSpec, graphs: Mapping[str, Signature], info: CheckpointInfo) -> None:
    """Every fact stated twice agrees: the manifest against the graphs, the graphs against the
    checkpoint, the optimizer state against the parameters. :class:`ArtifactError` names the first
    disagreement; nothing here needs ONNX Runtime."""
    _check_training_graph(graphs[TRAINING_MODEL], spec, info)
    evaluation = graphs[EVAL_MODEL]
    params = _check_inputs(evaluation, EVAL_MODEL, [*spec.inputs, spec.labels])
    _check_outputs(evaluation, EVAL_MODEL, spec, info, training=False)
    _check_parameters(EVAL_MODEL, params, info)
    if INFERENCE_MODEL in graphs:
        _check_inference_graph(graphs[INFERENCE_MODEL], spec, info)
    if OPTIMIZER_MODEL in graphs:
        _check_adamw_graph(graphs[OPTIMIZER_MODEL], spec.optimizer)
    _check_checkpoint(spec, info)


# -------------------------------------------------------------------- learner
DeviceObserveStats = ObserveStats
"""What one device ``observe`` did: the PyTorch learner's :class:`~taste_cl.learner.stats.ObserveStats` (this name is kept)."""


@dataclass
class _Loaded:
    folder: Path
    manifest: dict[str, Any]
    spec: DeviceSpec
    session: OrtSession
    replay: NumpyReplay | None = field(default=None)


def load(directory: str | os.PathLike[str], *, training_model: Path | None = None, session_options: Any | None = None) -> _Loaded:
    """Check an artifact folder completely, then load it (see :meth:`OrtOnlineLearner.from_artifacts`)."""
    _ort()  # the install hint comes before any file is read
    folder = Path(directory)
    manifest = read_manifest(folder, required=(TRAINING_MODEL, EVAL_MODEL, CHECKPOINT))
    spec = parse_manifest(manifest)
    allowed = {TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT, INFERENCE_MODEL, REPLAY_FILE, SGD_STATE_FILE,
               *WEB_FILES}  # fmt: skip
    unknown = sorted(set(manifest["files"]) - allowed)
    if unknown:
        raise ArtifactError(f"the manifest lists files this format does not have: {unknown}")
    if (spec.optimizer["type"] == "adamw") != (OPTIMIZER_MODEL in manifest["files"]):
        raise ArtifactError(f"{OPTIMIZER_MODEL} must be present exactly for the adamw optimizer")
    if (spec.replay is None) == (REPLAY_FILE in manifest["files"]):
        raise ArtifactError(f"the manifest's replay entry and the presence of {REPLAY_FILE} disagree")
    if (SGD_STATE_FILE in manifest["files"]) != ("sgd_state" in manifest):
        raise ArtifactError(f"the manifest's sgd_state entry and the presence of {SGD_STATE_FILE} disagree")
    if SGD_STATE_FILE in manifest["files"] and not spec.optimizer.get("momentum"):
        raise ArtifactError(f"the manifest lists {SGD_STATE_FILE} (SGD momentum buffers), but its optimizer keeps no momentum")
    graphs: dict[str, Signature] = {}
    for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, INFERENCE_MODEL):
        if name in manifest["files"]:
            data = read_verified(folder, manifest, name)
            check_no_external_data(data, name=name)
            graphs[name] = read_signature(data, name=name, ops={TRAINING_MODEL: _TRAINING_OPS, OPTIMIZER_MODEL: (_ADAMW_OP,)}.get(name, ()))
    if training_model is not None:
        data = training_model.read_bytes()
        check_no_external_data(data, name=str(training_model))
        graphs[TRAINING_MODEL] = read_signature(data, name=str(training_model), ops=_TRAINING_OPS)
    info = read_checkpoint(read_verified(folder, manifest, CHECKPOINT), name=CHECKPOINT)
    _check_agreement(spec, graphs, info)
    sgd_state = None
    if SGD_STATE_FILE in manifest["files"]:
        shapes = {name: info.trainable[name].dims for name in spec.trainable}
        sgd_state = _load_sgd_state(read_verified(folder, manifest, SGD_STATE_FILE), spec, manifest, shapes)
    replay = None
    if spec.replay is not None:
        replay = NumpyReplay.from_bytes(read_verified(folder, manifest, REPLAY_FILE), spec.replay, spec)
    # everything is checked: only now does ONNX Runtime load the files
    session = OrtSession(folder, spec, sgd_state, training_model=training_model, session_options=session_options)
    return _Loaded(folder, manifest, spec, session, replay)


class OrtOnlineLearner:
    """Keep personalising an exported model with ONNX Runtime training and replay; no torch.

    Build it with :meth:`from_artifacts`. Like :class:`~taste_cl.OnlineLearner`,
    :meth:`observe` trains ``train_iterations`` steps on the batch mixed with
    ``replay_batch_size`` buffered samples, then offers the batch to the reservoir. Inputs
    are numpy arrays (a dict of arrays for dict-input models); :meth:`predict` returns
    numpy outputs. Calls are serialised by a lock.
    """

    def __init__(self, loaded: _Loaded) -> None:
        self.directory = loaded.folder
        self.manifest = loaded.manifest
        self.spec = loaded.spec
        self.session = loaded.session
        self.replay = loaded.replay
        self.replay_batch_size = loaded.spec.replay_batch_size
        self.train_iterations = loaded.spec.train_iterations
        self.num_classes = loaded.spec.num_classes
        self.classes = ClassSlots(loaded.spec.active_classes, loaded.spec.num_classes)  # reserved slots activate on first use
        self.samples_seen = loaded.spec.samples_seen
        self.steps = loaded.spec.steps
        self.tuner: Any = None  # a DeviceBatchTuner (adapters/device/tuning.py) once attached
        self._lock = threading.RLock()

    @classmethod
    def from_artifacts(cls, directory: str | os.PathLike[str], *, session_options: Any | None = None, tuner: Any | None = None) -> OrtOnlineLearner:
        """Load a folder written by ``export`` or :meth:`save`; everything is checked first (:class:`ArtifactError`).

        ``tuner``: a :class:`~taste_cl.adapters.device.tuning.DeviceBatchTuner` that tunes the training
        micro-batch (and threads) from the first ``observe`` on, resuming the folder's saved tuner state.
        """
        learner = cls(load(directory, session_options=session_options))
        if tuner is not None:
            tuner.attach(learner, learner.manifest.get("tuner"))
        return learner

    @property
    def lr(self) -> float:
        """The learning rate; set it to change it."""
        return self.session.lr

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`lr == {value!r}`, must be a finite number > 0")
        with self._lock:
            self.session.lr = float(value)

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, by their PyTorch names."""
        with self._lock:
            return self.session.parameters()

    def load_parameters(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by their PyTorch names (a fleet's aggregate, say); frozen ones too.

        Every array is checked first (a known name, the parameter's shape and dtype, finite
        values), so a bad one raises ``ValueError`` and changes nothing. Optimizer state and
        the buffer are kept.
        """
        with self._lock:
            current = self.session.parameters()
            by_torch_name = {torch_name: name for name, torch_name in self.spec.param_names.items()}
            for name, value in arrays.items():
                if name not in current:
                    raise ValueError(f"`{name}` is not a parameter of this model; its parameters are {sorted(current)}")
                value = np.asarray(value)
                want = current[name]
                if value.shape != want.shape or value.dtype != want.dtype:
                    raise ValueError(f"`{name}` must be {want.dtype} of shape {want.shape}; got {value.dtype} of shape {value.shape}")
                if not np.isfinite(value).all():
                    raise ValueError(f"`{name}` holds NaN or infinite values")
            for name, value in arrays.items():
                self.session._write(by_torch_name[name], np.asarray(value))

    def observe(self, batch: Any) -> ObserveStats:
        """Train on one batch ``(x, y)`` (or ``{"x": x, "y": y}``) mixed with replay, then buffer it."""
        with self._lock:
            raw_x, raw_y = _split(batch)
            x = _features(raw_x, self.spec)
            y = _targets(raw_y, self.spec, x[0].shape[0])
            self.classes.activate(y, self.spec.ignore_index)
            if self.tuner is not None:
                self.tuner.before_observe(x, y)
            start = time.perf_counter()
            n = y.shape[0]
            n_replay = min(self.replay_batch_size, len(self.replay)) if self.replay is not None else 0
            losses, steps, stream_outputs = [], 0, None
            for _ in range(self.train_iterations):
                train_x, train_y = x, y
                if n_replay:
                    assert self.replay is not None
                    replay_x, replay_y = self.replay.sample(n_replay)
                    train_x = [np.concatenate([a, b]) for a, b in zip(x, replay_x)]
                    train_y = np.concatenate([y, replay_y])
                step = self.session.train_step if self.tuner is None else self.tuner.step
                outputs, loss, skipped = step(train_x, train_y)
                stream_outputs = outputs[:n] if stream_outputs is None else stream_outputs
                steps += not skipped
                losses.append(loss)
            elapsed = time.perf_counter() - start
            if self.replay is not None:
                self.replay.add(x, y)
            self.samples_seen += n
            self.steps += 1
            if self.tuner is not None:
                self.tuner.after_observe((n + n_replay) * self.train_iterations, elapsed)
            accuracy = math.nan
            if self.num_classes is not None and stream_outputs is not None and not self.spec.labels.shape:
                accuracy = float((self.classes.mask(stream_outputs).argmax(axis=1) == y).mean())
            return ObserveStats(
                loss=sum(losses) / len(losses),
                accuracy=accuracy,
                samples=n,
                replay_samples=n_replay * self.train_iterations,
                batch_size=n + n_replay,
                steps=steps,
                step_time_s=elapsed,
                skipped=steps < self.train_iterations,
                micro_batches=self.train_iterations * (1 if self.tuner is None else self.tuner.micro_batches(n + n_replay)),
            )

    def train_step(self, x: Any, y: Any) -> tuple[np.ndarray, float, bool]:
        """One optimizer step on ``(x, y)`` without replay or counters; returns (outputs, loss, skipped)."""
        with self._lock:
            inputs = _features(x, self.spec)
            return self.session.train_step(inputs, _targets(y, self.spec, inputs[0].shape[0]))

    def predict(self, x: Any) -> np.ndarray:
        """Outputs for ``x`` from the eval graph (reserved slots not yet in use: ``-inf``); changes no state."""
        with self._lock:
            return self.classes.mask(self.session.predict(_features(x, self.spec)))

    def export_inference_model(self, path: str | os.PathLike[str]) -> Path:
        """Atomically write an inference-only ONNX model with the current weights."""
        target = Path(path).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            try:
                self.session.module.export_model_for_inferencing(tmp_name, [OUTPUT_NAME])
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        return target

    def save(self, directory: str | os.PathLike[str], *, web: bool = True) -> Path:
        """Write weights, optimizer state and buffer as a new artifact folder that :meth:`from_artifacts` resumes.

        The folder is complete or absent (staged, then swapped into place); like an export it
        is made loadable by the browser learner where the model allows (the manifest's
        ``"web"``). ``web=False`` leaves the browser files out: faster, and it needs no
        ``onnx`` and no ONNX Runtime training API (which imports torch where it is installed).
        """
        with self._lock, staged_folder(directory) as stage:
            for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL):
                if name in self.manifest["files"]:
                    (stage / check_plain_name(name)).write_bytes(read_verified(self.directory, self.manifest, name))
            self.session.save(stage)
            manifest = {key: value for key, value in self.manifest.items() if key not in ("files", "sgd_state")}
            if self.session.sgd_state:
                manifest["sgd_state"] = self.session.sgd_order()
            if self.replay is not None:
                (stage / REPLAY_FILE).write_bytes(self.replay.to_bytes())
            manifest.update(
                optimizer={**self.manifest["optimizer"], "lr": self.lr},
                replay=self.replay.info() if self.replay is not None else None,
                counters={"samples_seen": self.samples_seen, "steps": self.steps},
                **self.classes.manifest(),
            )
            if self.tuner is not None:
                manifest["tuner"] = self.tuner.state_dict()
            if not web:
                manifest["web"] = {"skipped": "saved with web=False"}
            write_manifest(stage, manifest)
            if web:
                add_web_artifacts(stage)
        return Path(directory).absolute()
