"""Model transforms a device backend needs, applied to a model copy before export.

ExecuTorch 1.5 cannot lower BatchNorm in training mode (``to_executorch()`` stops with
"Missing out variants: aten::_native_batch_norm_legit_functional"), and a device's dropout
draws other random numbers than PyTorch, so no parity check can pass through it. Each
transform edits a model copy in place and returns how many modules it changed; parameter
and buffer names are kept, so trained weights map back to the original model by name. The
transforms change what training does (frozen statistics, no dropout): the parity gate
compares the device against eager PyTorch on the *transformed* model, and the manifest
records which transforms were applied. ONNX Runtime's export
(:mod:`taste_cl.adapters.onnxruntime.transforms`) uses the same :class:`FrozenBatchNorm`
and :func:`disable_dropout`.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
>>> apply_transforms(model, ("freeze_batchnorm", "disable_dropout"))
['freeze_batchnorm', 'disable_dropout']
>>> [type(m).__name__ for m in model]
['Linear', 'FrozenBatchNorm', 'Identity']
>>> sorted(name for name, _ in model.named_parameters())
['0.bias', '0.weight', '1.bias', '1.weight']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["TRANSFORMS", "FrozenBatchNorm", "apply_transforms", "disable_dropout", "freeze_batchnorm", "needed_transforms"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class FrozenBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm normalised with its running statistics in training too; only ``weight`` and ``bias`` train.

    ``y = (x - running_mean) / sqrt(running_var + eps) * weight + bias`` over channel dim 1,
    which is what ``BatchNorm`` computes in eval mode; the statistics never change. A
    BatchNorm with running statistics becomes one by swapping its class
    (``module.__class__ = FrozenBatchNorm``), which keeps every parameter and buffer.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.running_mean is None or self.running_var is None:
            raise ValueError("a FrozenBatchNorm needs running statistics (the BatchNorm had track_running_stats=False)")
        # per-channel scale and shift first, then reshaped: ExecuTorch cannot emit a view of a buffer
        scale = torch.rsqrt(self.running_var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shift = -self.running_mean * scale
        if self.bias is not None:
            shift = shift + self.bias
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * scale.reshape(shape) + shift.reshape(shape)


def _replace(model: nn.Module, match: Callable[[nn.Module], bool], build: Callable[[nn.Module], nn.Module]) -> int:
    """Swap every submodule matching ``match`` for ``build(old)``; return how many were swapped."""
    count = 0
    for name, child in list(model.named_children()):
        if match(child):
            setattr(model, name, build(child))
            count += 1
        else:
            count += _replace(child, match, build)
    return count


def _is_trainable_batchnorm(module: nn.Module) -> bool:
    """A BatchNorm whose training-mode forward uses batch statistics and updates its running ones."""
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and not isinstance(module, FrozenBatchNorm)
        and module.track_running_stats
        and module.running_mean is not None
    )


def freeze_batchnorm(model: nn.Module) -> int:
    """Make every BatchNorm that tracks running statistics a :class:`FrozenBatchNorm`; return how many."""
    count = 0
    for module in model.modules():
        if _is_trainable_batchnorm(module):
            module.__class__ = FrozenBatchNorm
            count += 1
    return count


def disable_dropout(model: nn.Module) -> int:
    """Replace dropout modules by ``nn.Identity`` and zero the attention dropout of ``nn.MultiheadAttention``."""
    count = _replace(model, lambda m: isinstance(m, _DROPOUTS) and m.p > 0, lambda m: nn.Identity())
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            module.dropout = 0.0
            count += 1
    return count


TRANSFORMS: dict[str, Callable[[nn.Module], int]] = {
    "freeze_batchnorm": freeze_batchnorm,
    "disable_dropout": disable_dropout,
}


def needed_transforms(model: nn.Module) -> list[str]:
    """The transforms that would change ``model``: what ExecuTorch needs to train it with parity."""
    needed = []
    if any(_is_trainable_batchnorm(m) for m in model.modules()):
        needed.append("freeze_batchnorm")
    if any(isinstance(m, _DROPOUTS) and m.p > 0 for m in model.modules()) or any(
        isinstance(m, nn.MultiheadAttention) and m.dropout > 0 for m in model.modules()
    ):
        needed.append("disable_dropout")
    return needed


def apply_transforms(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Apply the named transforms to ``model`` in place, in order; return the names that changed something."""
    if isinstance(names, str):
        raise TypeError(f"transforms must be a sequence of names, not a str; got {names!r}")
    unknown = [name for name in names if name not in TRANSFORMS]
    if unknown:
        raise ValueError(f"`transforms` has unknown names {unknown}; known: {sorted(TRANSFORMS)}")
    return [name for name in dict.fromkeys(names) if TRANSFORMS[name](model)]
