"""One artifact folder's ONNX Runtime training session and its optimizer step (numpy SGD or ORT's AdamW).

It uses ONNX Runtime's own bindings (``onnxruntime.capi._pybind_state``: ``Module``,
``CheckpointState``, ``Optimizer``), because ``onnxruntime.training.api`` imports torch.
With a :class:`~taste_cl.adapters.device.guard.DeviceUpdateGuard` attached (the device
learner attaches one), every step goes through it: the session saves, measures and restores
what a step changes (:class:`~taste_cl.adapters.device.guard.GuardedSession`).
"""

from __future__ import annotations

import importlib.abc
import io
import math
import os
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    INFERENCE_MODEL,
    LOSS_NAME,
    OPTIMIZER_MODEL,
    OUTPUT_NAME,
    SGD_STATE_FILE,
    TRAINING_MODEL,
    DeviceSpec,
    manifest_error,
)
from taste_cl.exceptions import MissingDependencyError
from taste_cl.guards.device import DeviceUpdateGuard, StepMeasure, measure_arrays

__all__ = ["OrtSession", "load_sgd_state", "ort_bindings"]


class _WithoutTorchFrontend(importlib.abc.MetaPathFinder):
    """Refuses ``onnxruntime.training`` while ``onnxruntime`` first loads.

    Its import-time build check imports ORTModule, the PyTorch frontend, and with it torch
    (~600 MB) wherever torch is installed; the runtime uses neither, and the check treats
    the refusal as "no ORTModule".
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError("the device runtime loads ONNX Runtime without its PyTorch frontend")


def ort_bindings() -> Any:
    """ONNX Runtime's training bindings (no torch), logging warnings and errors only."""
    guard = _WithoutTorchFrontend() if "onnxruntime" not in sys.modules and "torch" not in sys.modules else None
    if guard is not None:
        sys.meta_path.insert(0, guard)
    try:
        from onnxruntime.capi import _pybind_state as C
    except ImportError as error:
        raise MissingDependencyError("onnxruntime-training-cpu", "onnx-training") from error
    finally:
        if guard is not None:
            sys.meta_path.remove(guard)
    if not hasattr(C, "CheckpointState"):
        raise MissingDependencyError("onnxruntime-training-cpu", "onnx-training")
    C.set_default_logger_severity(3)
    return C


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
        C = ort_bindings()
        self.folder, self.spec, self._C = folder, spec, C
        self._device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        self._options = session_options
        if self._options is None:
            self._options = C.SessionOptions()
            self._options.log_severity_level = 3  # errors only: sessions log every graph pass at INFO
        self._training_model = str(training_model or folder / TRAINING_MODEL)
        try:
            self._open(C.load_checkpoint(str(folder / CHECKPOINT)))
        except RuntimeError as error:
            raise ArtifactError(f"ONNX Runtime could not load the artifacts in {str(folder)!r}: {error}") from error
        missing = [name for name in spec.param_names if not self.state.has_parameter(name)]
        if missing:
            raise ArtifactError(f"the checkpoint lacks the parameters {missing[:5]} named in the manifest")
        stored = [*spec.param_names, *(stat.parameter for stat in spec.running_stats)]
        damaged = sorted({spec.param_names.get(name, name) for name in stored if not _finite(self.state.get_parameter(name).data.numpy())})
        if damaged:
            raise ArtifactError(f"the checkpoint's {damaged[:5]} hold NaN or infinite values: the model is damaged; load an earlier folder")
        outputs = list(self.module.output_names(True))
        if outputs[:2] != [LOSS_NAME, OUTPUT_NAME] or [stat.output for stat in spec.running_stats] != outputs[2:]:
            raise ArtifactError(f"the training graph's outputs are {outputs}, not what the manifest describes")
        self.lr = spec.optimizer["lr"]
        # own copies: the in-place update must not write into the caller's arrays (an exporter's torch buffers)
        self.sgd_state = {name: np.array(value, np.float32) for name, value in (sgd_state or {}).items()}
        self._scratch_buffer = np.empty(0, np.float32)
        self.guard: DeviceUpdateGuard | None = None  # the device learner's; the parity gate trains unguarded, as torch does

    def _open(self, state: Any) -> None:
        """Bind the training and eval graphs (and AdamW's optimizer graph) to the checkpoint ``state``."""
        C, folder, options = self._C, self.folder, self._options
        self.state = state
        self.module = C.Module(self._training_model, state, str(folder / EVAL_MODEL), self._device, options)
        self.optimizer = C.Optimizer(str(folder / OPTIMIZER_MODEL), state, self._device, options) if self.spec.optimizer["type"] == "adamw" else None
        if self.optimizer is not None and hasattr(self, "_lr"):
            self.optimizer.set_learning_rate(self._lr)

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

    def save_after_zero_step(self, path: Path, inputs: list[np.ndarray], labels: np.ndarray) -> None:
        """Take one optimizer step with learning rate 0 on ``(inputs, labels)`` (the weights stay as they
        are; no running statistics are written back), then save the checkpoint to ``path``: it then holds
        the optimizer state ORT keeps (AdamW's step and moments), whose bytes an exporter overwrites."""
        if self.optimizer is None:
            raise ValueError("a zero step needs an optimizer graph (AdamW); this session has none")
        self.lr = 0.0
        self.module.lazy_reset_grad()
        self._run(inputs, labels, True)
        self.optimizer.optimizer_step()
        self._C.save_checkpoint(self.state, str(path), True)

    def train_step(self, inputs: list[np.ndarray], labels: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """One optimizer step; returns (outputs, loss, skipped). A non-finite loss or gradient skips the
        update; with a guard attached, so does any step the guard refuses (and it is undone)."""
        self.module.lazy_reset_grad()
        fetched = self._run(inputs, labels, True)
        loss = float(fetched[0])
        # views of ORT's own buffers (no copies): the update below writes the weights in place
        params = [self.state.get_parameter(name) for name in self.spec.trainable]
        grads = {name: param.grad.numpy() for name, param in zip(self.spec.trainable, params)}

        def apply() -> None:
            if self.optimizer is not None:
                self.optimizer.optimizer_step()
            else:
                self._sgd_step(grads, [param.data.numpy() for param in params])

        applied = self._guarded(apply, grads.values(), loss)
        if math.isfinite(loss):  # the forward's statistics, as PyTorch's forward moves them, step or not
            self._write_running_stats(fetched[2:], labels.shape[0])
        return fetched[1], loss, not applied

    def _guarded(self, apply: Callable[[], None], grads: Iterable[np.ndarray], loss: float) -> bool:
        """Run ``apply`` (one optimizer step) unless the loss or a gradient is not finite or the guard
        refuses it; return whether it was applied."""
        if self.guard is None:
            finite = math.isfinite(loss) and all(_finite(g) for g in grads)
            if finite:
                apply()
            return finite
        # PyTorch's float32 gradient norm: it overflows where torch's does (and the guard then skips)
        norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads))
        return self.guard.step(self, apply, lr=self._lr, grad_norm=norm, loss=loss) is None

    # ------------------------------------------------------------ the guard's view of a step
    def save_step_state(self) -> Any:
        """Copies of what a step changes: the trained parameters and the optimizer state (running
        statistics follow the forward pass, as in PyTorch, and are not part of a step). ORT 1.19's
        AdamW moments have no setter: with AdamW the whole checkpoint is kept, as bytes, and a
        refusal reloads it."""
        trained = {name: self.state.get_parameter(name).data.numpy().copy() for name in self.spec.trainable}
        if self.optimizer is not None:
            return trained, self._checkpoint_bytes()
        return trained, {name: buffer.copy() for name, buffer in self.sgd_state.items()}

    def measure_step(self, saved: Any) -> StepMeasure:
        before: dict[str, np.ndarray] = saved[0]
        return measure_arrays((old, self.state.get_parameter(name).data.numpy()) for name, old in before.items())

    def restore_step_state(self, saved: Any) -> None:
        trained, rest = saved
        if self.optimizer is not None:
            self._open(self._load_checkpoint_bytes(rest))
            return
        for name, value in trained.items():
            self.write_parameter(name, value)
        self.sgd_state = rest  # a step before which a buffer did not exist leaves none, as in torch

    def _checkpoint_bytes(self) -> bytes:
        fd, path = tempfile.mkstemp(prefix="taste_cl_guard_", suffix=".ckpt")
        os.close(fd)
        try:
            self._C.save_checkpoint(self.state, path, True)
            return Path(path).read_bytes()
        finally:
            os.unlink(path)

    def _load_checkpoint_bytes(self, data: bytes) -> Any:
        fd, path = tempfile.mkstemp(prefix="taste_cl_guard_", suffix=".ckpt")
        try:
            os.write(fd, data)
            os.close(fd)
            return self._C.load_checkpoint(path)
        finally:
            os.unlink(path)

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

        def apply() -> None:
            if self.optimizer is not None:
                for name, grad in summed.items():
                    self.state.get_parameter(name).grad.update_inplace(np.ascontiguousarray(grad, np.float32))
                self.optimizer.optimizer_step()
            else:
                self._sgd_step(summed, [self.state.get_parameter(name).data.numpy() for name in summed])

        return np.concatenate(outputs), loss, not self._guarded(apply, summed.values(), loss)

    def _write_running_stats(self, values: list[np.ndarray], batch: int) -> None:
        """Store the graph's new running statistics; ONNX's variance is biased, PyTorch's unbiased."""
        for value, stat in zip(values, self.spec.running_stats):
            n = batch * stat.per_sample
            if stat.stat == "var" and n > 1:
                kept = (1.0 - stat.momentum) * self.state.get_parameter(stat.parameter).data.numpy()
                value = kept + (value - kept) * (n / (n - 1))
            self.write_parameter(stat.parameter, value.astype(np.float32))

    def write_parameter(self, name: str, value: np.ndarray) -> None:
        """Overwrite ORT's parameter ``name`` (its ORT name) with ``value``, already checked."""
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


def load_sgd_state(data: bytes, spec: DeviceSpec, manifest: Mapping[str, Any], shapes: dict[str, tuple]) -> dict:
    names = manifest.get("sgd_state")
    if not isinstance(names, list) or any(name not in spec.trainable for name in names):
        raise manifest_error("sgd_state", names, "a list of trainable parameter names")
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
