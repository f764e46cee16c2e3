"""ExecuTorchEngine: forward, vector-Jacobian product and optimizer step on ExecuTorch's training runtime.

The folder written by :func:`~taste_cl.adapters.executorch.engine_export.export_engine` holds one
ExecuTorch program with two methods and the state:

- ``engine.pte`` / ``engine.ptd``: the program and its weights. Method ``forward`` takes the inputs
  and the trainable tensors and returns the outputs. Method ``vjp`` is a joint forward-backward
  program (ExecuTorch's training export) whose scalar loss is ``(outputs * grad_outputs).sum()``
  with ``grad_outputs`` an input, so the parameter gradients it returns are exactly the
  vector-Jacobian product. The trainable tensors live in the ``vjp`` method's mutable memory,
  which ExecuTorch's ``TrainingModule`` exposes; the engine reads and writes them there (numpy views)
  and feeds them to ``forward``;
- ``engine.json``: names, shapes, dtypes, the batch bound and the optimizer's settings, all checked
  on load; ``parameters.npz`` and ``optimizer_state.npz``.

**The backward recomputes the forward.** ExecuTorch's training programs compute the gradients in
the same run as the forward, with nothing kept between two runs, and ``grad_outputs`` is known only
after the loop has seen the outputs. So ``forward(x, train=True)`` keeps ``x`` and
:meth:`ExecuTorchEngine.backward` runs ``vjp`` on it: each training step runs the model's forward
twice. :attr:`ExecuTorchEngine.recomputed_forwards` counts those second runs.

The optimizer step is numpy (:class:`~taste_cl.adapters.executorch.optimizer.NumpyOptimizer`, torch's
SGD and AdamW), applied in place to the program's parameters: ExecuTorch's shipped SGD keeps its
momentum where nothing can read or restore it. The program's batch axis runs from 2 to the export's
``max_batch_size``: a single row is padded by repeating it (its padded gradient rows are zero, so
the gradients are exact), a larger batch runs in chunks. Layers run as in eval mode (the export
freezes BatchNorm and switches random layers off).

ExecuTorch's Python runtime imports torch, so this engine does too (to hand tensors to the
runtime); it is outside the torch-free device path. It imports nothing from the export side.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl.adapters.executorch.optimizer import NumpyOptimizer
from taste_cl.adapters.executorch.runtime import MIN_BATCH, PARAM_PREFIX, executorch_runtime, load_program
from taste_cl.engine.arrays import checked_floats, npz_bytes, read_npz
from taste_cl.engine.base import Inputs
from taste_cl.exceptions import ArtifactError, CheckpointError, InvalidBatchError
from taste_cl.state.files import atomic_write_bytes, read_regular_file

__all__ = ["FILES", "FORMAT", "MANIFEST", "PROGRAM", "WEIGHTS", "ExecuTorchEngine"]

FORMAT = "taste_cl.executorch_engine/1"
MANIFEST, PROGRAM, WEIGHTS = "engine.json", "engine.pte", "engine.ptd"
PARAMETERS, OPTIMIZER_STATE = "parameters.npz", "optimizer_state.npz"
FILES = (PROGRAM, WEIGHTS, MANIFEST, PARAMETERS, OPTIMIZER_STATE)
FORWARD, VJP = "forward", "vjp"
INPUT = "input"  # the one input's name, for a mapping ``x``
_MAX_MANIFEST = 1 << 20
_MAX_FILE = 1 << 30
_DTYPES = ("float32", "float64", "int64", "int32")


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 2**31 for d in value):
        raise ArtifactError(f"{MANIFEST}: {what} must be a list of ints in [0, 2**31]; got {value!r}")
    return tuple(value)


class ExecuTorchEngine:
    """The ExecuTorch engine over an exported folder: the engine interface of the learning loop (see the module).

    ``forward(x, train=True)`` keeps ``x`` for one :meth:`backward`; ``backward(grad_outputs)`` reruns the
    forward with the backward (``vjp``) and returns the gradients of :attr:`trainable`; ``step(gradients, lr)``
    applies the numpy optimizer. A folder that does not load is an :class:`~taste_cl.exceptions.ArtifactError`.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        executorch_runtime()
        self.folder = Path(folder)
        try:
            manifest = json.loads(read_regular_file(self.folder / MANIFEST, _MAX_MANIFEST))
        except (OSError, ValueError) as error:
            raise ArtifactError(f"{self.folder} has no readable {MANIFEST}: {error}") from None
        self._manifest = self._check_manifest(manifest)
        try:
            self._files = {name: read_regular_file(self.folder / name, _MAX_FILE) for name in (PROGRAM, WEIGHTS)}
        except (OSError, ValueError) as error:  # missing, unreadable, a link or over the bound
            raise ArtifactError(f"{self.folder}: {error}") from None
        self._module = self._load_module()
        self._parameters = self._live_parameters()
        self.load_parameters(self._loaded(PARAMETERS))
        self._state = self._loaded(OPTIMIZER_STATE, self.optimizer.state_shapes(self._shapes))
        self._kept: np.ndarray | None = None
        self._output_shape: tuple[int, ...] | None = None
        self.recomputed_forwards = 0  # runs of the forward that a backward repeated (every backward: see the module)

    # ------------------------------------------------------------------ loading
    def _check_manifest(self, manifest: Any) -> dict[str, Any]:
        keys = {"format", "input", "output_shape", "trainable", "max_batch", "optimizer", "transforms"}
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or set(manifest) != keys:
            raise ArtifactError(f"{self.folder / MANIFEST} is not an ExecuTorch engine manifest (format {FORMAT!r}, exactly the keys {sorted(keys)})")
        entry = manifest["input"]
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise ArtifactError(f"{MANIFEST}: input must be {{'dtype': one of {list(_DTYPES)}, 'shape': [...]}}; got {entry!r}")
        self.input_dtype = np.dtype(entry["dtype"])
        self.input_shape = _shape(entry.get("shape"), "input.shape")
        self.row_output_shape = _shape(manifest["output_shape"], "output_shape")
        trainable = manifest["trainable"]
        if not isinstance(trainable, dict) or not trainable:
            raise ArtifactError(f"{MANIFEST}: trainable must be a non-empty object of parameter shapes")
        self._shapes = {str(name): _shape(shape, f"trainable[{name!r}]") for name, shape in trainable.items()}
        self.trainable: tuple[str, ...] = tuple(self._shapes)
        bound = manifest["max_batch"]
        if isinstance(bound, bool) or not isinstance(bound, int) or not MIN_BATCH <= bound <= 2**20:
            raise ArtifactError(f"{MANIFEST}: max_batch must be an int in [{MIN_BATCH}, 2**20]; got {bound!r}")
        self.max_batch = bound
        try:
            self.optimizer = NumpyOptimizer.from_json(manifest["optimizer"])
        except (ValueError, TypeError) as error:
            raise ArtifactError(f"{MANIFEST}: optimizer: {error}") from None
        return manifest

    def _load_module(self) -> Any:
        """The program loaded and checked: both methods there, taking what the manifest says."""
        from executorch.extension.training import TrainingModule

        try:
            loaded = load_program(self._files[PROGRAM], self._files[WEIGHTS])
            methods = set(loaded.method_names())
            if not {FORWARD, VJP} <= methods:
                raise ArtifactError(f"{PROGRAM} must have the methods {FORWARD!r} and {VJP!r}; it has {sorted(methods)}")
            for method, count in ((FORWARD, 1 + len(self.trainable)), (VJP, 2)):
                if loaded.method_meta(method).num_inputs() != count:
                    raise ArtifactError(f"{PROGRAM}: method {method!r} must take {count} inputs (see {MANIFEST})")
            with warnings.catch_warnings():  # every ExecuTorch training API is marked experimental
                warnings.simplefilter("ignore")
                return TrainingModule(loaded)
        except RuntimeError as error:
            raise ArtifactError(f"ExecuTorch could not load {self.folder / PROGRAM}: {error}") from None

    def _live_parameters(self) -> dict[str, np.ndarray]:
        """Numpy views of the ``vjp`` method's trainable tensors (reachable after one run, here on zeros), by name."""
        rows = np.zeros((MIN_BATCH, *self.input_shape), self.input_dtype)
        try:
            self._module.forward_backward(VJP, (torch.from_numpy(rows), torch.zeros((MIN_BATCH, *self.row_output_shape))))
        except RuntimeError as error:
            raise ArtifactError(f"{PROGRAM}: method {VJP!r} does not run on the manifest's shapes: {error}") from None
        live = {name.removeprefix(PARAM_PREFIX): tensor for name, tensor in self._module.named_parameters().items()}
        if set(live) != set(self.trainable) or any(tuple(live[n].shape) != self._shapes[n] or live[n].dtype != torch.float32 for n in live):
            raise ArtifactError(f"{PROGRAM}'s trainable tensors {sorted(live)} are not the float32 tensors {MANIFEST} lists")
        self._tensors = [live[name] for name in self.trainable]  # what the forward method takes, in order
        return {name: tensor.detach().numpy() for name, tensor in live.items()}

    def _loaded(self, file: str, shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
        try:
            return checked_floats(file, read_npz(self.folder / file, _MAX_FILE), self._shapes if shapes is None else shapes, CheckpointError)
        except CheckpointError as error:
            raise ArtifactError(str(error)) from None

    # ------------------------------------------------------------------ batches
    @property
    def inputs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The one input's dtype and shape without the batch axis, by name (as :attr:`OnnxEngine.inputs
        <taste_cl.adapters.onnx_engine.engine.OnnxEngine.inputs>`)."""
        return {INPUT: (self.input_dtype, self.input_shape)}

    def _as_input(self, x: Inputs) -> np.ndarray:
        array = x.get(INPUT) if isinstance(x, Mapping) and set(x) == {INPUT} else x
        if not isinstance(array, np.ndarray):
            raise InvalidBatchError(f"the engine takes one numpy array (or {{{INPUT!r}: array}}); got {type(x).__name__}")
        if array.shape[1:] != self.input_shape or array.shape[0] < 1:
            raise InvalidBatchError(f"x must be shaped (n, {', '.join(map(str, self.input_shape))}) with n >= 1 rows; got {array.shape}")
        if array.dtype.kind != self.input_dtype.kind:
            raise InvalidBatchError(f"x must be of kind {self.input_dtype}; got {array.dtype}")
        return np.ascontiguousarray(array, dtype=self.input_dtype)

    def _chunks(self, rows: int) -> list[tuple[np.ndarray, int]]:
        """Row indices of each run (at least :data:`MIN_BATCH`, at most :attr:`max_batch` rows; padding repeats a
        chunk's first row) and how many of them are real."""
        chunks = []
        for start in range(0, rows, self.max_batch):
            taken = min(self.max_batch, rows - start)
            index = np.arange(start, start + taken)
            if taken < MIN_BATCH:
                index = np.concatenate([index, np.full(MIN_BATCH - taken, start)])
            chunks.append((index, taken))
        return chunks

    # ------------------------------------------------------------------ the engine interface
    def forward(self, x: Inputs, *, train: bool) -> np.ndarray:
        """The model's outputs for ``x``; with ``train=True`` ``x`` is kept for one :meth:`backward`."""
        array = self._as_input(x)
        outputs = []
        for index, taken in self._chunks(array.shape[0]):
            (out,) = self._module.model.run_method(FORWARD, (torch.from_numpy(array[index]), *self._tensors))
            outputs.append(out.numpy()[:taken])
        output = outputs[0] if len(outputs) == 1 else np.concatenate(outputs)
        self._kept = array.copy() if train else None
        self._output_shape = output.shape
        return output

    def backward(self, grad_outputs: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of the trainable tensors for the last ``forward(..., train=True)``, given dLoss/dOutputs
        (the forward runs again, inside the ``vjp`` method)."""
        if self._kept is None:
            raise RuntimeError("backward needs a forward(x, train=True) first (each forward serves one backward)")
        grad = np.asarray(grad_outputs, dtype=np.float32)
        if grad.shape != self._output_shape:
            raise InvalidBatchError(f"grad_outputs must be shaped like the outputs {self._output_shape}; got {grad.shape}")
        array, self._kept = self._kept, None
        total: dict[str, np.ndarray] = {}
        for index, taken in self._chunks(array.shape[0]):
            part = grad[index]
            part[taken:] = 0.0  # padded rows add nothing
            self._module.forward_backward(VJP, (torch.from_numpy(array[index]), torch.from_numpy(part)))
            self.recomputed_forwards += 1
            for name, value in self._module.named_gradients().items():
                key = name.removeprefix(PARAM_PREFIX)
                total[key] = value.numpy() if key not in total else total[key] + value.numpy()
        return total

    def step(self, gradients: Mapping[str, np.ndarray], lr: float) -> None:
        """One optimizer step with ``gradients`` (one per trainable tensor) at learning rate ``lr``."""
        checked = checked_floats("gradients", gradients, self._shapes, InvalidBatchError)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not np.isfinite(lr) or lr < 0:
            raise InvalidBatchError(f"`lr == {lr!r}`, must be a finite number >= 0")
        self.optimizer.step(self._parameters, checked, self._state, float(lr))

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self._parameters.items()}

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy ``values`` into the program's tensors (exactly :attr:`trainable`, shaped and finite; ``CheckpointError``
        and nothing changed otherwise)."""
        checked = checked_floats("parameters", values, self._shapes, CheckpointError)
        for name, value in checked.items():
            np.copyto(self._parameters[name], value)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self._state.items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._state = checked_floats("optimizer state", state, self.optimizer.state_shapes(self._shapes), CheckpointError)

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write the program, the manifest, the parameters and the optimizer state to ``folder``."""
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        for name, data in self._files.items():
            atomic_write_bytes(target / name, data)
        atomic_write_bytes(target / MANIFEST, json.dumps(self._manifest, indent=1).encode())
        atomic_write_bytes(target / PARAMETERS, npz_bytes(self._parameters))
        atomic_write_bytes(target / OPTIMIZER_STATE, npz_bytes(self._state))
