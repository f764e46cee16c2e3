"""Export transforms: rewrite a copy of a model into modules whose ONNX graph ONNX Runtime can train.

Each transform swaps the class of a module of the (already copied) model for an equivalent
one that exports to ops with a gradient in ONNX Runtime 1.19, keeping every parameter
and buffer (so names and values are unchanged):

- ``BatchNorm*d`` with ``batchnorm="frozen"`` (the default, common on-device practice):
  the shared :class:`~taste_cl.adapters.device.transforms.FrozenBatchNorm`, normalised with
  the running statistics as an affine map, in training too; the running
  statistics are frozen and ``weight``/``bias`` train. With ``batchnorm="batch"`` the
  module is kept (batch statistics in training); the exporter writes the running
  statistics back after each device step.
- ``Hardswish``/``Hardsigmoid``: ``x * relu6(x + 3) / 6`` and ``relu6(x + 3) / 6`` with
  ``relu6(z) = relu(z) - relu(z - 6)`` (ONNX Runtime has no HardSwish/HardSigmoid gradient).
- ``LayerNorm``: decomposed into mean/variance/rsqrt (its fused op's gradient does not build).
- ``Dropout`` is kept as it is; the parity gate's reference turns it off with the shared
  :func:`~taste_cl.adapters.device.transforms.disable_dropout` (re-exported here).

:func:`check_equivalent` compares the transformed copy's eval outputs (:func:`eval_outputs`) with the original's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from taste_cl.adapters.device.transforms import FrozenBatchNorm, disable_dropout

__all__ = ["BATCHNORM_MODES", "apply_transforms", "check_equivalent", "disable_dropout", "eval_outputs"]

BATCHNORM_MODES = ("frozen", "batch")


def _relu6(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) - torch.relu(x - 6.0)


class _ExportHardswish(nn.Hardswish):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _relu6(x + 3.0) / 6.0


class _ExportHardsigmoid(nn.Hardsigmoid):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _relu6(x + 3.0) / 6.0


class _ExportReLU6(nn.ReLU6):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _relu6(x)


class _ExportLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        centered = x - x.mean(dim=dims, keepdim=True)
        out = centered * torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + self.eps)
        if self.weight is not None:
            out = out * self.weight
        if self.bias is not None:
            out = out + self.bias
        return out


def apply_transforms(model: nn.Module, *, batchnorm: str = "frozen") -> list[str]:
    """Rewrite ``model`` (a copy: it is changed in place) for export; return ``"path: what"`` lines.

    Raises ``ValueError`` for ``batchnorm="frozen"`` on a BatchNorm without running
    statistics (``track_running_stats=False``), naming its module path.
    """
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"`batchnorm == {batchnorm!r}`, must be one of {BATCHNORM_MODES}")
    done = []
    for path, module in model.named_modules():
        kind = type(module)
        if kind is nn.Hardswish:
            module.__class__ = _ExportHardswish
        elif kind is nn.Hardsigmoid:
            module.__class__ = _ExportHardsigmoid
        elif kind is nn.ReLU6:
            module.__class__ = _ExportReLU6
        elif kind is nn.LayerNorm:
            module.__class__ = _ExportLayerNorm
        elif kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) and batchnorm == "frozen":
            if module.running_mean is None:
                raise ValueError(
                    f"module {path!r} is a BatchNorm without running statistics (track_running_stats=False), "
                    "so it cannot be frozen; export with batchnorm='batch'"
                )
            module.__class__ = FrozenBatchNorm
        else:
            continue
        done.append(f"{path or '<root>'}: {kind.__name__} -> {type(module).__name__.lstrip('_')}")
    return done


def eval_outputs(model: nn.Module, forward: Any, x: Any) -> torch.Tensor:
    """``forward(model, x)`` in eval mode without gradients, as float32; the model's mode is restored."""
    mode = model.training
    model.eval()
    try:
        with torch.no_grad():
            return forward(model, x).float()
    finally:
        model.train(mode)


def check_equivalent(expected: torch.Tensor, got: torch.Tensor, *, tolerance: float) -> float:
    """Largest scaled difference of two eval outputs; ``ValueError`` naming it above ``tolerance``."""
    diff = float((expected - got).abs().max() / expected.abs().max().clamp_min(1.0)) if expected.numel() else 0.0
    if not diff <= tolerance:
        raise ValueError(f"the export transforms changed the model's outputs by {diff:.3g} (tolerance {tolerance:.3g})")
    return diff
