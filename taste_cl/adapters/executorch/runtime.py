"""The ExecuTorch training runtime behind both the parity gate and the on-device learner.

:class:`EtTrainer` loads a ``.pte`` program and its ``.ptd`` weights from bytes (so what
runs is what was hash-checked), runs the exported ``forward`` method (loss, outputs, then
gradients) and steps the shipped SGD (``get_sgd_optimizer``: momentum, dampening, weight
decay, Nesterov). :class:`IOSpec` describes the inputs and targets recorded in the manifest
and turns user values into the flat list of tensors the program takes.
The artifact folder's file names and format number live here too: the export writes
the folder and the device learner reads it, and neither imports the other.

Limits of the shipped runtime (ExecuTorch 1.5), which this module works around or states:
the parameters are reachable only after a first ``forward_backward`` (done once at load, on
a zero batch, without a step); the shipped SGD object has no learning-rate setter and no
state access, so the step is PyTorch's ``SGD`` on the program's parameter tensors instead
(the program computes loss and gradients, as ONNX Runtime's graphs do beside the numpy SGD),
which lets the device guard restore the momentum of a refused step; the batch dimension has
a lower bound of 2, so a single-sample ``predict`` is padded and a single-sample training
step is refused.

The SGD settings are bounded as the ONNX Runtime manifest bounds them
(:func:`~taste_cl.adapters.onnxruntime.manifest.parse_sgd`), and each file of a folder has a
largest size the device reads (:data:`MAX_FILE_BYTES`, checked on disk before reading).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.onnxruntime.manifest import parse_sgd
from taste_cl.adapters.onnxruntime.replay import MAX_REPLAY_BYTES
from taste_cl.exceptions import InvalidBatchError, MissingDependencyError

if TYPE_CHECKING:
    from taste_cl.guards.device import DeviceUpdateGuard

__all__ = [
    "BACKEND", "FORMAT", "MAX_FILE_BYTES", "PARAM_PREFIX", "EtTrainer", "IOSpec", "LeafSpec", "check_program", "executorch_runtime", "load_program",
]  # fmt: skip

PARAM_PREFIX = "model."  # the exported wrapper holds the user's model as ``model``
BACKEND = "executorch"
FORMAT = 1  # the artifact folder's format, written by the export and by EtOnlineLearner.save
PROGRAM, WEIGHTS, PARAMS, REPLAY = "model.pte", "model.ptd", "params.npz", "replay.npz"
# the largest file of each kind the device reads: far above a model that trains on a device, low enough
# that a hostile folder cannot exhaust its memory (the program and its weights are read whole)
MAX_FILE_BYTES = {PROGRAM: 1 << 30, WEIGHTS: 1 << 30, PARAMS: 1 << 30, REPLAY: MAX_REPLAY_BYTES}
MIN_BATCH = 2
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}
SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_SCALAR_TYPES = {3: "int32", 4: "int64", 6: "float32", 7: "float64", 11: "bool"}  # ExecuTorch ScalarType -> dtype name


def executorch_runtime() -> Any:
    """Import the ExecuTorch training runtime lazily, with an install hint when missing."""
    try:
        from executorch.extension.pybindings import portable_lib
        from executorch.extension.training import TrainingModule, get_sgd_optimizer  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError("executorch", "executorch") from error
    return portable_lib


def load_program(program: bytes, data: bytes) -> Any:
    """ExecuTorch's module for ``.pte`` bytes ``program`` and ``.ptd`` bytes ``data`` (the runtime reads from
    them: the caller keeps both alive as long as the module). ``RuntimeError`` when ExecuTorch refuses them."""
    runtime = executorch_runtime()
    with warnings.catch_warnings():  # every ExecuTorch training API is marked experimental
        warnings.simplefilter("ignore")
        return runtime._load_for_executorch_from_buffer(program, data)


@dataclass(frozen=True)
class LeafSpec:
    """One tensor of a batch: the shape after the batch dimension and the dtype name; ``bound``:
    integer embedding ids take values in ``[0, bound)`` (checked before the program runs)."""

    shape: tuple[int, ...]
    dtype: str
    bound: int | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, bound: int | None = None) -> LeafSpec:
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"tensors of dtype {tensor.dtype} cannot be exported; use one of {sorted(_DTYPES)}")
        return cls(tuple(int(d) for d in tensor.shape[1:]), name, bound)

    def to_json(self) -> dict[str, Any]:
        return {"shape": ["batch", *self.shape], "dtype": self.dtype, **({} if self.bound is None else {"bound": self.bound})}

    @classmethod
    def from_json(cls, value: Any, what: str) -> LeafSpec:
        if not isinstance(value, Mapping) or value.get("dtype") not in _DTYPES or not isinstance(value.get("shape"), list):
            raise ValueError(f"manifest {what} {value!r} must be {{'shape': ['batch', ...], 'dtype': one of {sorted(_DTYPES)}}}")
        shape = value["shape"][1:]
        if value["shape"][:1] != ["batch"] or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise ValueError(f"manifest {what} shape {value['shape']!r} must be ['batch', positive ints...]")
        bound = value.get("bound")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1 or value["dtype"].startswith("float")):
            raise ValueError(f"manifest {what} bound {bound!r} must be null or, for integer ids, an int >= 1")
        return cls(tuple(shape), value["dtype"], bound)

    def coerce(self, value: Any, name: str, n: int | None) -> torch.Tensor:
        """``value`` as a fresh tensor of this spec; :class:`InvalidBatchError` naming ``name`` otherwise."""
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
        elif isinstance(value, np.ndarray) and value.dtype != object:
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        else:
            raise InvalidBatchError(f"{name} must be a torch.Tensor or numpy.ndarray; got {type(value).__name__}")
        if tuple(tensor.shape[1:]) != self.shape or tensor.dim() != len(self.shape) + 1:
            raise InvalidBatchError(f"{name} has shape {tuple(tensor.shape)}, expected (batch, *{self.shape})")
        if n is not None and tensor.shape[0] != n:
            raise InvalidBatchError(f"{name} has {tensor.shape[0]} samples, the batch has {n}")
        dtype = _DTYPES[self.dtype]
        if dtype.is_floating_point != (tensor.is_floating_point()):
            raise InvalidBatchError(f"{name} has dtype {tensor.dtype}, expected {self.dtype}")
        if self.bound is not None and tensor.numel() and not 0 <= int(tensor.min()) <= int(tensor.max()) < self.bound:
            raise InvalidBatchError(
                f"{name} holds ids in [{int(tensor.min())}, {int(tensor.max())}], must be in [0, {self.bound - 1}] (the embedding table's rows)"
            )
        tensor = tensor.to(dtype, copy=True).contiguous()
        if dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            raise InvalidBatchError(f"{name} contains non-finite values (NaN or inf)")
        return tensor


@dataclass(frozen=True)
class IOSpec:
    """Inputs (one tensor, or a dict of tensors in ``keys`` order) and targets of an exported program."""

    keys: tuple[str, ...] | None
    inputs: tuple[LeafSpec, ...]
    target: LeafSpec
    num_classes: int | None

    @classmethod
    def of(cls, x: Any, y: torch.Tensor, num_classes: int | None, bounds: Mapping[str, int] | None = None) -> IOSpec:
        """The spec of an example batch; ``bounds``: embedding table sizes by input key (``"input"`` for a tensor ``x``)."""
        bounds = bounds or {}
        if isinstance(x, Mapping):
            keys = tuple(str(k) for k in x)
            return cls(keys, tuple(LeafSpec.of(x[k], bounds.get(k)) for k in keys), LeafSpec.of(y), num_classes)
        return cls(None, (LeafSpec.of(x, bounds.get("input")),), LeafSpec.of(y), num_classes)

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": list(self.keys) if self.keys is not None else None,
            "inputs": [leaf.to_json() for leaf in self.inputs],
            "target": self.target.to_json(),
            "num_classes": self.num_classes,
        }

    @classmethod
    def from_json(cls, value: Any) -> IOSpec:
        if not isinstance(value, Mapping) or not isinstance(value.get("inputs"), list) or not value["inputs"]:
            raise ValueError(f"manifest 'io' {value!r} must hold a non-empty 'inputs' list")
        keys = value.get("keys")
        if keys is not None and (not isinstance(keys, list) or len(keys) != len(value["inputs"]) or not all(isinstance(k, str) for k in keys)):
            raise ValueError(f"manifest io 'keys' {keys!r} must be null or one name per input")
        if keys is None and len(value["inputs"]) != 1:
            raise ValueError("manifest io without 'keys' must have exactly one input")
        classes = value.get("num_classes")
        if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int) or classes < 1):
            raise ValueError(f"manifest io 'num_classes' {classes!r} must be null or an int >= 1")
        inputs = tuple(LeafSpec.from_json(leaf, "input") for leaf in value["inputs"])
        return cls(tuple(keys) if keys is not None else None, inputs, LeafSpec.from_json(value.get("target"), "target"), classes)

    def flat_inputs(self, x: Any) -> list[torch.Tensor]:
        """Validate ``x`` and return its tensors in the program's order (all with one batch size)."""
        if self.keys is None:
            return [self.inputs[0].coerce(x, "x", None)]
        if not isinstance(x, Mapping) or set(x) != set(self.keys):
            got = sorted(map(str, x)) if isinstance(x, Mapping) else type(x).__name__
            raise InvalidBatchError(f"x must be a mapping with keys {sorted(self.keys)}; got {got}")
        first = self.inputs[0].coerce(x[self.keys[0]], f"x[{self.keys[0]!r}]", None)
        rest = [leaf.coerce(x[key], f"x[{key!r}]", first.shape[0]) for key, leaf in zip(self.keys[1:], self.inputs[1:])]
        return [first, *rest]

    def targets(self, y: Any, n: int) -> torch.Tensor:
        """Validate targets for ``n`` samples (class labels in range when ``num_classes`` is known);
        a regression target ``(n,)`` for an ``(n, 1)`` output is taken, as the learner takes it."""
        if self.target.shape == (1,) and self.target.dtype.startswith("float") and getattr(y, "ndim", 0) == 1:
            y = y.reshape(-1, 1)
        target = self.target.coerce(y, "y", n)
        if self.num_classes is not None and not target.is_floating_point():
            valid = target[target != -100]  # CrossEntropyLoss's default ignore_index
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= self.num_classes):
                raise InvalidBatchError(f"y has labels outside [0, {self.num_classes - 1}]")
        return target

    def zero_targets(self, n: int) -> torch.Tensor:
        return torch.zeros((n, *self.target.shape), dtype=_DTYPES[self.target.dtype])


def sgd_config(optimizer: Any, lr: float | None = None) -> dict[str, Any]:
    """The SGD hyper-parameters of a ``torch.optim.SGD`` (the only optimizer ExecuTorch ships)."""
    if not isinstance(optimizer, torch.optim.SGD):  # a capability refusal (ExportError), not a type error
        raise ExportError(
            f"ExecuTorch ships only SGD; the learner uses {type(optimizer).__name__}: "
            "use torch.optim.SGD (momentum, weight decay, Nesterov are supported) or backend='onnxruntime'"
        )
    group = optimizer.param_groups[0]
    config = {key: group[key] for key in SGD_KEYS}
    if lr is not None:
        config["lr"] = lr
    return check_sgd(config)


def check_sgd(config: Any) -> dict[str, Any]:
    """Validate SGD settings (from a learner or a manifest) within the device's bounds (those of
    :func:`~taste_cl.adapters.onnxruntime.manifest.parse_sgd`); return them as plain floats/bool."""
    if not isinstance(config, Mapping) or set(config) != set(SGD_KEYS):
        raise ValueError(f"SGD settings {config!r} must have exactly the keys {list(SGD_KEYS)}")
    return parse_sgd(config)


def _shape(dims: tuple[int, ...]) -> str:
    return "[" + ", ".join(["batch", *map(str, dims)]) + "]"


def check_program(program: Any, spec: IOSpec) -> int:
    """Check a loaded program's ``forward`` against the manifest's ``spec``; return its batch bound.

    ``forward`` takes the inputs, then the target, each with the manifest's dtype and shape
    after the batch axis, and outputs the loss then the model outputs, whose axis 1 has
    ``num_classes`` entries when the manifest gives classes. Read from the program's method
    metadata, before anything runs; :class:`ArtifactError` names the first disagreement.
    """
    meta = program.method_meta("forward")
    leaves = [*((f"io.inputs[{i}]", leaf) for i, leaf in enumerate(spec.inputs)), ("io.target", spec.target)]
    if meta.num_inputs() != len(leaves) or meta.num_outputs() < 2:
        raise ArtifactError(
            f"{PROGRAM}: forward takes {meta.num_inputs()} inputs and has {meta.num_outputs()} outputs; "
            f"the manifest's io describes {len(leaves)} (inputs, then target) and needs the loss and the outputs"
        )
    bounds = []
    for i, (what, leaf) in enumerate(leaves):
        try:
            tensor = meta.input_tensor_meta(i)
        except (RuntimeError, IndexError):
            raise ArtifactError(f"{PROGRAM}: forward input {i} is not a tensor; the manifest's {what} is one") from None
        sizes, number = tuple(tensor.sizes()), int(tensor.dtype())
        dtype = _SCALAR_TYPES.get(number, f"type {number}")
        if not sizes or dtype != leaf.dtype or sizes[1:] != leaf.shape:
            raise ArtifactError(
                f"{PROGRAM}: forward input {i} is {dtype} {_shape(sizes[1:])}; the manifest's {what} is {leaf.dtype} {_shape(leaf.shape)}"
            )
        bounds.append(sizes[0])
    if spec.num_classes is not None:
        logits = tuple(meta.output_tensor_meta(1).sizes())
        classes = logits[1] if len(logits) > 1 else 0
        if classes != spec.num_classes:
            raise ArtifactError(
                f"{PROGRAM}: forward's logits are {_shape(logits[1:])}: {classes} classes; the manifest's io.num_classes is {spec.num_classes}"
            )
    return min(bounds)


class EtTrainer:
    """A loaded ExecuTorch training program and its SGD step; satisfies the parity gate's ``Trainer``.

    ``program`` and ``data`` are the ``.pte`` and ``.ptd`` bytes; they are kept alive as long
    as the trainer (the runtime reads from them). The program is checked against ``spec``
    (:func:`check_program`) before it runs. Parameter names are PyTorch's. The program computes
    the loss and the gradients; the step is PyTorch's ``SGD`` on the program's parameter tensors
    (ExecuTorch's shipped SGD keeps its momentum where nothing can read or restore it, which the
    device guard needs). With a :class:`~taste_cl.adapters.device.guard.DeviceUpdateGuard` in
    :attr:`guard` (the device learner attaches one; the parity gate trains unguarded, as torch
    does) every step goes through it.
    """

    def __init__(self, program: bytes, data: bytes, spec: IOSpec, sgd: dict[str, Any]) -> None:
        executorch_runtime()
        from executorch.extension.training import TrainingModule

        self._buffers = (program, data)
        self.spec = spec
        self.sgd = check_sgd(sgd)
        loaded = load_program(program, data)
        self.max_batch = check_program(loaded, spec)
        with warnings.catch_warnings():  # every ExecuTorch training API is marked experimental
            warnings.simplefilter("ignore")
            self.module = TrainingModule(loaded)
        warm = [
            torch.zeros((MIN_BATCH, *leaf.shape), dtype=_DTYPES[leaf.dtype]) for leaf in spec.inputs
        ]  # parameters are reachable only after one forward_backward
        self.module.forward_backward("forward", (*warm, spec.zero_targets(MIN_BATCH)))
        self.params = {name.removeprefix(PARAM_PREFIX): p for name, p in self.module.named_parameters().items()}
        self.optimizer = self.new_optimizer()
        self.guard: DeviceUpdateGuard | None = None

    def new_optimizer(self) -> torch.optim.SGD:
        """A fresh PyTorch SGD with this program's settings over its parameters (no momentum yet)."""
        s = self.sgd
        try:
            return torch.optim.SGD(
                list(self.params.values()), lr=s["lr"], momentum=s["momentum"], dampening=s["dampening"],
                weight_decay=s["weight_decay"], nesterov=s["nesterov"], foreach=False,
            )  # fmt: skip
        except ValueError as error:  # e.g. Nesterov without momentum
            raise ArtifactError(f"the SGD settings {s} cannot train: {error}") from None

    def set_lr(self, lr: float) -> None:
        """Change the learning rate; momentum is kept."""
        self.sgd = check_sgd({**self.sgd, "lr": lr})
        for group in self.optimizer.param_groups:
            group["lr"] = self.sgd["lr"]

    def _step(self, grads: Mapping[str, torch.Tensor], loss: float) -> bool:
        """One SGD step with ``grads`` (by the program's names) unless the loss or a gradient is not
        finite or the guard refuses it; return whether it was applied."""
        for name, grad in grads.items():
            self.params[name.removeprefix(PARAM_PREFIX)].grad = grad
        try:
            if self.guard is None:
                finite = math.isfinite(loss) and all(bool(torch.isfinite(g).all()) for g in grads.values())
                if finite:
                    self.optimizer.step()
                return finite
            norm = math.sqrt(sum(float(torch.dot(g.flatten(), g.flatten())) for g in grads.values()))  # torch's float32 norm
            return self.guard.step(self, self.optimizer.step, lr=self.sgd["lr"], grad_norm=norm, loss=loss) is None
        finally:
            for parameter in self.params.values():
                parameter.grad = None  # the runtime reuses its gradient buffers

    # ------------------------------------------------------------ the guard's view of a step
    def save_step_state(self) -> Any:
        """Copies of the parameters and their momentum buffers."""
        params = {name: p.detach().clone() for name, p in self.params.items()}
        state = {name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()}
                 for name, p in self.params.items() if p in self.optimizer.state}  # fmt: skip
        return params, state

    def measure_step(self, saved: Any) -> tuple[float, float, float, int]:
        before: dict[str, torch.Tensor] = saved[0]
        largest = max((float(p.detach().abs().max()) for p in self.params.values() if p.numel()), default=0.0)
        change = math.sqrt(sum(float(((self.params[n].detach() - old) ** 2).sum()) for n, old in before.items()))
        size = math.sqrt(sum(float((old**2).sum()) for old in before.values()))
        return largest, change, size, sum(old.numel() for old in before.values())

    def restore_step_state(self, saved: Any) -> None:
        params, state = saved
        with torch.no_grad():
            for name, value in params.items():
                self.params[name].copy_(value)
        for name, p in self.params.items():
            if name in state:
                self.optimizer.state[p] = state[name]
            else:
                self.optimizer.state.pop(p, None)

    def run(self, inputs: list[torch.Tensor], y: torch.Tensor, *, step: bool) -> tuple[float, torch.Tensor, bool]:
        """Forward and backward on validated tensors; step unless told not to or non-finite.

        Returns ``(loss, outputs, skipped)``; ``skipped`` is true when a step was asked for
        and a non-finite loss or gradient prevented it.
        """
        self.check_batch(inputs[0].shape[0])
        outputs = self.module.forward_backward("forward", (*inputs, y))
        loss = float(outputs[0])
        if not step:
            return loss, outputs[1], False
        return loss, outputs[1], not self._step(self.module.named_gradients(), loss)

    def accumulated_step(self, parts: list[tuple[list[torch.Tensor], torch.Tensor]]) -> tuple[float, torch.Tensor, bool]:
        """One SGD step on micro-batches' gradients, each weighted by its share of the rows: the step
        :meth:`run` takes on them concatenated, up to float rounding (the device batch-size tuner's
        gradient accumulation). Returns ``(loss, outputs of all rows, skipped)`` like :meth:`run`."""
        total = sum(y.shape[0] for _, y in parts)
        outputs: list[torch.Tensor] = []
        summed: dict[str, torch.Tensor] = {}
        loss = 0.0
        for inputs, y in parts:
            self.check_batch(inputs[0].shape[0])
            fetched = self.module.forward_backward("forward", (*inputs, y))
            weight = y.shape[0] / total
            loss += weight * float(fetched[0])
            for name, grad in self.module.named_gradients().items():  # the runtime reuses these buffers: keep copies
                summed[name] = grad * weight if name not in summed else summed[name].add_(grad, alpha=weight)
            outputs.append(fetched[1].clone())
        return loss, torch.cat(outputs), not self._step(summed, loss)

    def check_batch(self, n: int) -> None:
        """Refuse a batch of ``n`` samples outside the program's bounds (:class:`InvalidBatchError`) before it runs."""
        if n < MIN_BATCH:
            raise InvalidBatchError(f"a training batch needs at least {MIN_BATCH} samples on ExecuTorch; got {n}")
        if n > self.max_batch:
            raise InvalidBatchError(f"a batch holds at most {self.max_batch} samples on this program (the export's max_batch_size); got {n}")

    def train_step(self, x: Any, y: Any) -> float:
        inputs = self.spec.flat_inputs(x)
        return self.run(inputs, self.spec.targets(y, inputs[0].shape[0]), step=True)[0]

    def outputs(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Model outputs without a step (a one-sample batch is padded to two, then cut)."""
        n = inputs[0].shape[0]
        if n < MIN_BATCH:
            inputs = [torch.cat([t] * MIN_BATCH) for t in inputs]
        out = self.run(inputs, self.spec.zero_targets(inputs[0].shape[0]), step=False)[1]
        return out[:n].clone()

    def predict(self, x: Any) -> np.ndarray:
        return self.outputs(self.spec.flat_inputs(x)).numpy()

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: p.detach().numpy().copy() for name, p in self.params.items()}

    def check_parameters(self, saved: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        """Refuse saved parameters ``{name: (dtype, shape)}`` (an archive's headers, before it is read) whose names,
        shapes or dtypes are not the program's; a ``ValueError`` names the first."""
        if set(saved) != set(self.params):
            raise ValueError(f"saved parameters {sorted(saved)} do not match the program's {sorted(self.params)}")
        for name, (dtype, shape) in saved.items():
            parameter = self.params[name]
            expected = str(parameter.dtype).removeprefix("torch.")
            if tuple(shape) != tuple(parameter.shape):
                raise ValueError(f"saved parameter {name!r} has shape {tuple(shape)}, the program's is {tuple(parameter.shape)}")
            if dtype != np.dtype(expected):
                raise ValueError(f"saved parameter {name!r} is {dtype}; the program's is {expected}")

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy saved values into the live parameters; names, shapes and dtypes must all match (:meth:`check_parameters`)
        and values be finite (a ``ValueError`` names the first that does not, before any is copied)."""
        self.check_parameters({name: (value.dtype, value.shape) for name, value in values.items()})
        for name, value in values.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise ValueError(f"saved parameter {name!r} holds NaN or infinite values")
        for name, value in values.items():
            self.params[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
