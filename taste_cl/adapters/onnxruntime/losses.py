"""Regression losses in elementwise ops the ONNX exporter traces, equal to PyTorch's.

``torch.onnx.export`` (the legacy exporter ONNX Runtime 1.19 training takes) has no symbolic
for ``aten::l1_loss``, ``aten::smooth_l1_loss`` or ``aten::huber_loss``, and traces
``F.mse_loss`` through ``broadcast_tensors``, whose ``Expand`` over the labels is what the
traced outputs then hang from. :func:`traceable_loss` gives the export an equal function of
``Sub``, ``Abs``, ``Mul``, ``Where`` and a reduction for the regression losses the learner
knows (:data:`taste_cl.tasks._REGRESSION_LOSSES`), their ``reduction``, ``beta`` and
``delta`` kept; the gradients are PyTorch's too (``sign(d)`` on the linear part, ``0`` at
``d == 0``; the quadratic branch for ``|d| < beta``, as ``smooth_l1_loss_backward`` takes it).
Every other loss is returned as it is.

>>> import torch
>>> from torch import nn
>>> loss = nn.SmoothL1Loss(beta=0.5)
>>> a, b = torch.randn(6, 2), torch.randn(6, 2)
>>> bool(torch.allclose(traceable_loss(loss)(a, b), loss(a, b)))
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from taste_cl.adapters.device.artifacts import ExportError

__all__ = ["traceable_loss"]

Loss = Callable[[Any, Any], Any]


def _smooth_l1(diff: torch.Tensor, beta: float) -> torch.Tensor:
    """``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta`` (``|d|`` for ``beta == 0``, as torch does)."""
    size = diff.abs()
    if beta == 0.0:
        return size
    return torch.where(size < beta, 0.5 * diff * diff / beta, size - 0.5 * beta)


def _huber(diff: torch.Tensor, delta: float) -> torch.Tensor:
    """``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)``."""
    size = diff.abs()
    return torch.where(size < delta, 0.5 * diff * diff, delta * (size - 0.5 * delta))


# loss class -> (the loss, d = output - target) -> the loss of each element
_ELEMENTWISE: dict[type, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    nn.MSELoss: lambda loss, d: d * d,
    nn.L1Loss: lambda loss, d: d.abs(),
    nn.SmoothL1Loss: lambda loss, d: _smooth_l1(d, float(loss.beta)),
    nn.HuberLoss: lambda loss, d: _huber(d, float(loss.delta)),
}


def traceable_loss(loss_fn: Loss) -> Loss:
    """``loss_fn`` in traceable elementwise ops when it is a regression loss; any other loss unchanged.

    Only the exact classes are rewritten (a subclass may compute something else). A
    ``reduction="none"`` regression loss is refused with :class:`ExportError`: training needs
    one number per step.
    """
    element = _ELEMENTWISE.get(type(loss_fn))
    if element is None:
        return loss_fn
    name = type(loss_fn).__name__
    reduction = str(getattr(loss_fn, "reduction", None))
    if reduction not in ("mean", "sum"):
        raise ExportError(
            f"{name}(reduction={reduction!r}) gives one loss per element; the device trains on one number per step: use reduction='mean' or 'sum'"
        )

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        values = element(loss_fn, output - target)
        return values.mean() if reduction == "mean" else values.sum()

    loss.__name__ = name
    return loss
