"""The parity gate: train a few steps in eager PyTorch and in a device backend from identical weights, compare.

An exported training graph can load and run yet compute something else (a dropped
optimizer state, a wrong loss reduction, a transform that is not equivalent). Before
artifacts are published, :func:`check_parity` runs the same batches through a
:class:`TorchTrainer` (the eager reference) and a backend's :class:`Trainer`, and compares
the outputs before and after training, every step's loss and every trainable parameter.
Differences are scaled by magnitude (``|a - b| / max(1, |a|)``, maximum over elements) and
compared with tolerances that default from the dtype. The module itself imports no torch
(only :class:`TorchTrainer` does, when built).

>>> import numpy as np
>>> class Const:
...     def train_step(self, x, y): return 0.5
...     def parameters(self): return {"w": np.ones(2, np.float32)}
...     def predict(self, x): return np.zeros((len(x), 2), np.float32)
>>> report = check_parity(Const(), Const(), [(np.zeros((3, 1)), np.zeros(3))], backend="same")
>>> report.passed, report.max_loss_diff
(True, 0.0)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from taste_cl.adapters.device.artifacts import ExportError

__all__ = ["ParityError", "ParityReport", "TorchTrainer", "Trainer", "check_parity", "default_tolerance"]

_TOLERANCES = {"float64": 1e-8, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


class Trainer(Protocol):
    """One training step on numpy inputs, as a device would do it."""

    def train_step(self, x: Any, y: np.ndarray) -> float:
        """Train one step on ``x`` (an array or a dict of arrays) and targets ``y``; return the loss."""
        ...

    def parameters(self) -> dict[str, np.ndarray]:
        """Trainable parameters by their PyTorch ``named_parameters()`` names."""
        ...

    def predict(self, x: Any) -> np.ndarray:
        """Outputs for ``x`` in eval mode, changing no state."""
        ...


def _to_torch(value: Any) -> Any:
    import torch

    if isinstance(value, Mapping):
        return {key: _to_torch(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_torch(item) for item in value)
    return torch.as_tensor(np.asarray(value))


def _call(model: Any, x: Any) -> Any:
    """``model(x)``, ``model(**x)`` for a dict, ``model(*x)`` for a tuple/list."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, (list, tuple)):
        return model(*x)
    return model(x)


def _numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of ``tensor`` (bfloat16, which numpy lacks, as float32)."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy().copy()


class TorchTrainer:
    """The eager reference: deep copies of ``model`` and ``optimizer`` (state included) and ``loss_fn``.

    ``forward(model, x)`` calls the model (default: by the structure of ``x``); numpy inputs
    become tensors with their dtype; ``loss_fn(outputs, targets)`` gives the loss.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        forward: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        # one deepcopy call keeps the optimizer's state keyed by the copied parameters
        self.model, self.optimizer = copy.deepcopy((model, optimizer))
        self.loss_fn = loss_fn
        self.forward = forward or _call
        self._names = {id(p): name for name, p in self.model.named_parameters()}

    def train_step(self, x: Any, y: np.ndarray) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.forward(self.model, _to_torch(x)), _to_torch(y))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: _numpy(p) for name, p in self.model.named_parameters() if p.requires_grad}

    def predict(self, x: Any) -> np.ndarray:
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.forward(self.model, _to_torch(x))
        finally:
            self.model.train(was_training)
        return _numpy(out)


@dataclass(frozen=True)
class ParityReport:
    """The largest scaled differences found by :func:`check_parity`, and the tolerances they were held to."""

    backend: str
    steps: int
    max_output_diff: float
    max_loss_diff: float
    max_param_diff: float
    output_tol: float
    loss_tol: float
    param_tol: float

    @property
    def passed(self) -> bool:
        """Every difference is finite and within its tolerance."""
        return self.max_output_diff <= self.output_tol and self.max_loss_diff <= self.loss_tol and self.max_param_diff <= self.param_tol

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"{self.backend} parity {verdict} over {self.steps} steps: "
            f"outputs {self.max_output_diff:.3g} (tol {self.output_tol:.3g}), "
            f"losses {self.max_loss_diff:.3g} (tol {self.loss_tol:.3g}), "
            f"parameters {self.max_param_diff:.3g} (tol {self.param_tol:.3g})"
        )


class ParityError(ExportError):
    """The backend does not train like PyTorch; ``.report`` holds the numbers."""

    def __init__(self, report: ParityReport) -> None:
        super().__init__(f"refusing to publish: {report}")
        self.report = report


def default_tolerance(dtype: Any) -> float:
    """The scaled tolerance for a dtype name or numpy dtype (float32: 1e-4); unknown dtypes get float32's."""
    return _TOLERANCES.get(str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype, _TOLERANCES["float32"])


def _scaled_diff(reference: Any, candidate: Any) -> float:
    """``max |a - b| / max(1, max |a|)``; ``inf`` on a shape mismatch or a non-finite value."""
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(candidate, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    return float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))


def check_parity(
    reference: Trainer,
    candidate: Trainer,
    batches: Iterable[tuple[Any, np.ndarray]],
    *,
    backend: str,
    tolerance: float | None = None,
    param_tolerance: float | None = None,
) -> ParityReport:
    """Train ``reference`` and ``candidate`` on the same ``batches``; raise :class:`ParityError` if they differ.

    Compares the outputs on the first batch before training and on every batch after it,
    every step's loss, and every parameter of the reference (the candidate must report all
    of them under the same names). ``tolerance`` (default: from the reference's output
    dtype, 1e-4 for float32) applies to all three scaled differences; ``param_tolerance``
    (default: ``tolerance``) overrides it for parameters, e.g. for Adam-type optimizers,
    which turn rounding noise in a zero gradient into a full ``lr`` step. Returns the report.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` is empty, must hold at least one (x, y) batch")
    for name, value in (("tolerance", tolerance), ("param_tolerance", param_tolerance)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"`{name} == {value!r}`, must be None or a number > 0")
    first = reference.predict(batches[0][0])
    tol = float(tolerance) if tolerance is not None else default_tolerance(np.asarray(first).dtype)
    output_diff = _scaled_diff(first, candidate.predict(batches[0][0]))
    loss_diff = 0.0
    for x, y in batches:
        loss_diff = max(loss_diff, _scaled_diff(reference.train_step(x, y), candidate.train_step(x, y)))
    for x, _ in batches:
        output_diff = max(output_diff, _scaled_diff(reference.predict(x), candidate.predict(x)))
    expected, got = reference.parameters(), candidate.parameters()
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"{backend} reports no values for the trainable parameters {missing}")
    param_diff = max((_scaled_diff(expected[name], got[name]) for name in expected), default=0.0)
    param_tol = float(param_tolerance) if param_tolerance is not None else tol
    report = ParityReport(backend, len(batches), output_diff, loss_diff, param_diff, tol, tol, param_tol)
    if not report.passed:
        raise ParityError(report)
    return report
