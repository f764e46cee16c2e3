"""The device artifact folder's manifest, validated: file names, bounds and :func:`parse_manifest`.

Every value the device runtime uses from ``manifest.json`` is checked here, before any
graph is read; :class:`~taste_cl.adapters.device.artifacts.ArtifactError` names the first bad one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.device.class_slots import parse_active_classes
from taste_cl.adapters.web.compat import REPLAY_BINARY, WEB_MANIFEST, WEB_OPTIMIZER_MODEL

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
    "DeviceSpec",
    "RunningStat",
    "TensorSpec",
    "manifest_error",
    "manifest_int",
    "parse_manifest",
    "parse_sgd",
    "replay_size",
]


ARTIFACT_FORMAT = 2
TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL = "training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"
CHECKPOINT, INFERENCE_MODEL = "checkpoint", "inference_model.onnx"
REPLAY_FILE, SGD_STATE_FILE = "replay.npz", "sgd_state.npz"
WEB_FILES = (WEB_MANIFEST, WEB_OPTIMIZER_MODEL, REPLAY_BINARY)  # what the browser learner reads; the device runtime only allows them
LABEL_NAME, LOSS_NAME, OUTPUT_NAME = "labels", "loss", "logits"
STRUCTURES = ("tensor", "dict", "sequence")
INPUT_DTYPES = ("float32", "int64", "int32", "bool")
LABEL_DTYPES = ("int64", "float32")
# bounds on manifest values: far above any sensible setting, low enough that nothing explodes
MAX_CLASSES, MAX_ITERATIONS, MAX_REPLAY_BATCH, MAX_CAPACITY = 100_000, 1_000, 100_000, 10_000_000
MAX_INPUTS, MAX_DIM, MAX_ROW_ELEMENTS = 64, 1_000_000, 50_000_000


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
    active_classes: tuple[int, ...] | None = None  # classes in use when slots are reserved (see taste_cl/adapters/device/class_slots.py)


def manifest_error(what: str, value: Any, rule: str) -> ArtifactError:
    """The error for manifest value ``what``, which breaks ``rule``."""
    return ArtifactError(f"manifest `{what} == {value!r}`, must be {rule}")


def manifest_int(manifest: Mapping[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    """``manifest[key]``, an int in ``[low, high]``; :class:`ArtifactError` naming ``where + key`` otherwise."""
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise manifest_error(where + key, value, f"an int in [{low}, {high}]")
    return value


def _number(manifest: Mapping[str, Any], key: str, low: float, high: float, *, open_low: bool, where: str) -> float:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise manifest_error(where + key, value, "a finite number")
    if value > high or value < low or (open_low and value == low):
        raise manifest_error(where + key, value, f"in {'(' if open_low else '['}{low}, {high}]")
    return float(value)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise manifest_error(what, value, "a non-empty string of at most 200 characters")
    return value


def _tensor(value: Any, what: str, dtypes: Sequence[str]) -> TensorSpec:
    if not isinstance(value, Mapping):
        raise manifest_error(what, value, "an object with name, dtype and shape")
    shape = value.get("shape")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 9 or shape[0] != "batch":
        raise manifest_error(f"{what}.shape", shape, 'a list ["batch", d1, ...] of at most 9 axes')
    dims = shape[1:]
    if any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIM for d in dims):
        raise manifest_error(f"{what}.shape", shape, f"dimensions that are ints in [1, {MAX_DIM}]")
    if math.prod(dims) > MAX_ROW_ELEMENTS:
        raise manifest_error(f"{what}.shape", shape, f"at most {MAX_ROW_ELEMENTS} elements per sample")
    dtype = value.get("dtype")
    if dtype not in dtypes:
        raise manifest_error(f"{what}.dtype", dtype, f"one of {tuple(dtypes)}")
    bound = value.get("bound")
    if bound is not None and dtype not in ("int64", "int32"):
        raise manifest_error(f"{what}.bound", bound, "absent for a non-integer input")
    if bound is not None:
        bound = manifest_int(value, "bound", 1, 2**62, f"{what}.")
    return TensorSpec(_name(value.get("name"), f"{what}.name"), str(dtype), tuple(dims), bound)


def _rate_and_decay(value: Mapping[str, Any], where: str) -> dict[str, float]:
    return {"lr": _number(value, "lr", 0.0, 1e6, open_low=True, where=where),
            "weight_decay": _number(value, "weight_decay", 0.0, 1e6, open_low=False, where=where)}  # fmt: skip


def parse_sgd(value: Mapping[str, Any], where: str = "optimizer.") -> dict[str, Any]:
    """SGD settings bounded so that a step stays finite: ``lr`` in (0, 1e6], ``weight_decay`` in [0, 1e6],
    ``momentum`` and ``dampening`` in [0, 1], ``nesterov`` a bool (the ExecuTorch manifest reuses it)."""
    config: dict[str, Any] = _rate_and_decay(value, where)
    config["momentum"] = _number(value, "momentum", 0.0, 1.0, open_low=False, where=where)
    config["dampening"] = _number(value, "dampening", 0.0, 1.0, open_low=False, where=where)
    nesterov = value.get("nesterov")
    if not isinstance(nesterov, bool):
        raise manifest_error(where + "nesterov", nesterov, "true or false")
    config["nesterov"] = nesterov
    return config


def _optimizer(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.get("type") not in ("sgd", "adamw"):
        raise manifest_error("optimizer.type", value.get("type") if isinstance(value, Mapping) else value, "'sgd' or 'adamw'")
    if value["type"] == "sgd":
        return {"type": "sgd", **parse_sgd(value)}
    config: dict[str, Any] = {"type": "adamw", **_rate_and_decay(value, "optimizer.")}
    betas = value.get("betas")
    if not isinstance(betas, list) or len(betas) != 2:
        raise manifest_error("optimizer.betas", betas, "a list of two numbers in [0, 1)")
    config["betas"] = [_number({"b": b}, "b", 0.0, 1.0, open_low=False, where="optimizer.betas.") for b in betas]
    if max(config["betas"]) >= 1.0:
        raise manifest_error("optimizer.betas", betas, "two numbers in [0, 1)")
    config["eps"] = _number(value, "eps", 0.0, 1.0, open_low=True, where="optimizer.")
    return config


def replay_size(value: Any) -> tuple[int, int]:
    """A replay entry's ``capacity`` (at most ``MAX_CAPACITY``) and ``size`` (at most the capacity), checked
    before its ``replay.npz`` is read; both backends' manifests hold them."""
    if not isinstance(value, Mapping) or value.get("file") != REPLAY_FILE:
        raise manifest_error("replay.file", value.get("file") if isinstance(value, Mapping) else value, repr(REPLAY_FILE))
    capacity = manifest_int(value, "capacity", 1, MAX_CAPACITY, "replay.")
    return capacity, manifest_int(value, "size", 0, capacity, "replay.")


def _replay_info(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    capacity, size = replay_size(value)
    where = "replay."
    seen = manifest_int(value, "seen", size, 2**62, where)
    rng = value.get("rng")
    if rng is not None:
        if not isinstance(rng, Mapping) or set(rng) != {"state", "inc", "has_uint32", "uinteger"}:
            raise manifest_error("replay.rng", rng, "null or {state, inc, has_uint32, uinteger}")
        manifest_int(rng, "has_uint32", 0, 1, "replay.rng.")
        manifest_int(rng, "uinteger", 0, 2**32 - 1, "replay.rng.")
        for key in ("state", "inc"):
            text = rng[key]
            if not isinstance(text, str) or not text.isdigit() or len(text) > 40 or int(text) >= 2**128:
                raise manifest_error(f"replay.rng.{key}", text, "a decimal string below 2**128")
    return {"file": REPLAY_FILE, "capacity": capacity, "size": size, "seen": seen,
            "seed": manifest_int(value, "seed", 0, 2**63 - 1, where), "rng": rng}  # fmt: skip


def _running_stat(entry: Mapping[str, Any], i: int, param_names: Mapping[str, str]) -> RunningStat:
    where = f"running_stats[{i}]."
    parameter = entry.get("parameter")
    if parameter not in param_names:
        raise manifest_error(where + "parameter", parameter, "a name from param_names")
    if entry.get("stat") not in ("mean", "var"):
        raise manifest_error(where + "stat", entry.get("stat"), "'mean' or 'var'")
    return RunningStat(
        _name(entry.get("output"), where + "output"),
        str(parameter),
        entry["stat"],
        _number(entry, "momentum", 0.0, 1.0, open_low=True, where=where),
        manifest_int(entry, "per_sample", 1, MAX_ROW_ELEMENTS, where),
    )


def parse_manifest(manifest: Mapping[str, Any]) -> DeviceSpec:
    """Validate every value the device uses; :class:`ArtifactError` names the first bad one."""
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"manifest format {manifest.get('format')!r}; this taste_cl reads format {ARTIFACT_FORMAT}")
    raw_inputs = manifest.get("inputs")
    if not isinstance(raw_inputs, list) or not 1 <= len(raw_inputs) <= MAX_INPUTS:
        raise manifest_error("inputs", raw_inputs, f"a list of 1 to {MAX_INPUTS} inputs")
    inputs = tuple(_tensor(item, f"inputs[{i}]", INPUT_DTYPES) for i, item in enumerate(raw_inputs))
    structure = manifest.get("structure")
    if structure not in STRUCTURES or (structure == "tensor" and len(inputs) != 1):
        raise manifest_error("structure", structure, f"one of {STRUCTURES} ('tensor' with exactly one input)")
    labels = _tensor(manifest.get("labels"), "labels", LABEL_DTYPES)
    output = _tensor(manifest.get("output"), "output", ("float32",))
    names = [spec.name for spec in inputs]
    if len({*names, labels.name, output.name}) != len(names) + 2:
        raise manifest_error("inputs", names, "distinct names, different from the labels and output names")
    num_classes = manifest.get("num_classes")
    if num_classes is not None:
        num_classes = manifest_int(manifest, "num_classes", 1, MAX_CLASSES)
    if (labels.dtype == "int64") != (num_classes is not None):
        raise manifest_error("num_classes", num_classes, "an int exactly when the labels are int64 class indices")
    if num_classes is not None and output.shape[:1] != (num_classes,):
        width = output.shape[0] if output.shape else None
        raise manifest_error("num_classes", num_classes, f"the output width {width} (the output is {output.as_json()['shape']})")
    ignore_index = manifest.get("ignore_index")
    if ignore_index is not None:
        ignore_index = manifest_int(manifest, "ignore_index", -(2**31), 2**31 - 1)
    param_names = manifest.get("param_names")
    if not isinstance(param_names, Mapping) or not param_names:
        raise manifest_error("param_names", param_names, "a non-empty object mapping graph names to PyTorch names")
    for key, value in param_names.items():
        _name(key, "param_names key")
        _name(value, f"param_names[{key!r}]")
    trainable = manifest.get("trainable")
    if not isinstance(trainable, list) or not trainable or any(name not in param_names for name in trainable):
        raise manifest_error("trainable", trainable, "a non-empty list of names from param_names")
    stats = manifest.get("running_stats", [])
    if not isinstance(stats, list) or any(not isinstance(entry, Mapping) for entry in stats):
        raise manifest_error("running_stats", stats, "a list of {output, parameter, stat, momentum, per_sample} objects")
    running_stats = tuple(_running_stat(entry, i, param_names) for i, entry in enumerate(stats))
    batch_size = manifest.get("batch_size")
    if batch_size is not None:
        manifest_int(manifest, "batch_size", 1, MAX_REPLAY_BATCH)
    counters = manifest.get("counters")
    if not isinstance(counters, Mapping):
        raise manifest_error("counters", counters, "an object with samples_seen and steps")
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
        replay_batch_size=manifest_int(manifest, "replay_batch_size", 0, MAX_REPLAY_BATCH),
        train_iterations=manifest_int(manifest, "train_iterations", 1, MAX_ITERATIONS),
        samples_seen=manifest_int(counters, "samples_seen", 0, 2**62, "counters."),
        steps=manifest_int(counters, "steps", 0, 2**62, "counters."),
        active_classes=parse_active_classes(manifest.get("active_classes"), num_classes),
    )
