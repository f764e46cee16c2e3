"""Model transforms a device backend needs, applied to a model copy before export.

ExecuTorch 1.5 cannot lower BatchNorm in training mode (``to_executorch()`` stops with
"Missing out variants: aten::_native_batch_norm_legit_functional"), and a device's random
layers (dropout, stochastic depth) draw other random numbers than PyTorch, so no parity
check can pass through them. Each
transform edits a model copy in place and returns how many modules it changed; parameter
and buffer names are kept, so trained weights map back to the original model by name. The
transforms change what training does (frozen statistics, no dropout, no stochastic depth):
the parity gate compares the device against eager PyTorch on the *transformed* model, and
the manifest records which transforms were applied. ONNX Runtime's export
(:mod:`taste_cl.adapters.onnxruntime.transforms`) uses the same :class:`FrozenBatchNorm`,
:func:`is_stochastic_depth` and, for its gate's reference, :func:`disable_random_layers`.
``"disable_dropout"``, the transform's name before it also covered stochastic depth, is
still accepted.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
>>> apply_transforms(model, ("freeze_batchnorm", "disable_random_layers"))
['freeze_batchnorm', 'disable_random_layers']
>>> [type(m).__name__ for m in model]
['Linear', 'FrozenBatchNorm', 'Identity']
>>> sorted(name for name, _ in model.named_parameters())
['0.bias', '0.weight', '1.bias', '1.weight']
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TRANSFORMS",
    "Conv1dAs2d",
    "FrozenBatchNorm",
    "apply_transforms",
    "conv1d_as_conv2d",
    "disable_random_layers",
    "freeze_batchnorm",
    "is_stochastic_depth",
    "needed_transforms",
]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# stochastic depth (drop a residual branch per sample): (module, class, drop-probability attribute)
_STOCHASTIC_DEPTHS = (("torchvision.ops", "StochasticDepth", "p"), ("timm.layers", "DropPath", "drop_prob"))
_RENAMED = {"disable_dropout": "disable_random_layers"}  # names transforms had before


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


class Conv1dAs2d(nn.Conv1d):
    """``Conv1d`` computed as a ``Conv2d`` over a unit height, the weight viewed as ``(out, in, 1, k)``.

    ExecuTorch 1.5's ``convolution_backward`` kernel refuses 1-D convolutions at run time
    (its argument check fails: "KernelCall failed ... aten::convolution_backward.out: 0x12")
    and trains 2-D ones; the result and the gradients are the same, and the parameters keep
    their shapes and names.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:  # unbatched: PyTorch's own op
            return super().forward(x)
        padding: str | tuple[int, int] = self.padding if isinstance(self.padding, str) else (0, self.padding[0])
        if self.padding_mode != "zeros":
            x, padding = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode), (0, 0)
        out = F.conv2d(x.unsqueeze(2), self.weight.unsqueeze(2), self.bias, (1, self.stride[0]), padding, (1, self.dilation[0]), self.groups)
        return out.squeeze(2)


def conv1d_as_conv2d(model: nn.Module) -> int:
    """Make every ``nn.Conv1d`` a :class:`Conv1dAs2d` (ExecuTorch's export does it); return how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Conv1d:
            module.__class__ = Conv1dAs2d
            count += 1
    return count


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


def is_stochastic_depth(module: nn.Module) -> bool:
    """Whether ``module`` is a stochastic depth layer that drops anything (torchvision's
    ``StochasticDepth``, timm's ``DropPath``); looked up only in libraries already imported."""
    for package, name, attribute in _STOCHASTIC_DEPTHS:
        kind = getattr(sys.modules.get(package), name, None)
        if kind is not None and isinstance(module, kind) and getattr(module, attribute) > 0:
            return True
    return False


def _is_random(module: nn.Module) -> bool:
    return (isinstance(module, _DROPOUTS) and module.p > 0) or is_stochastic_depth(module)


def disable_random_layers(model: nn.Module) -> int:
    """Replace dropout and stochastic depth modules by ``nn.Identity`` and zero the attention
    dropout of ``nn.MultiheadAttention``; return how many modules changed."""
    count = _replace(model, _is_random, lambda m: nn.Identity())
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            module.dropout = 0.0
            count += 1
    return count


TRANSFORMS: dict[str, Callable[[nn.Module], int]] = {
    "freeze_batchnorm": freeze_batchnorm,
    "disable_random_layers": disable_random_layers,
}


def needed_transforms(model: nn.Module) -> list[str]:
    """The transforms that would change ``model``: what ExecuTorch needs to train it with parity."""
    needed = []
    if any(_is_trainable_batchnorm(m) for m in model.modules()):
        needed.append("freeze_batchnorm")
    if any(_is_random(m) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) for m in model.modules()):
        needed.append("disable_random_layers")
    return needed


def apply_transforms(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Apply the named transforms to ``model`` in place, in order; return the names that changed
    something (a former name, such as ``"disable_dropout"``, as its current one)."""
    if isinstance(names, str):
        raise TypeError(f"transforms must be a sequence of names, not a str; got {names!r}")
    unknown = [name for name in names if name not in TRANSFORMS and name not in _RENAMED]
    if unknown:
        raise ValueError(f"`transforms` has unknown names {unknown}; known: {sorted(TRANSFORMS)}")
    current = dict.fromkeys(_RENAMED.get(name, name) for name in names)
    return [name for name in current if TRANSFORMS[name](model)]
