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
  ``relu6`` a ``hardtanh`` (one ``Clip``; ONNX Runtime has no HardSwish/HardSigmoid gradient).
  ``ReLU6`` exports as a ``Clip`` as it is. ONNX Runtime's ``Clip`` gradient passes the
  gradient at the bounds, PyTorch's stops it there (which matters: a depthwise convolution
  over a region ReLU6 zeroed gives exact zeros), so the exporter makes the training graph's
  ``Clip`` gradients strict (``build._strict_clip_gradients``); with that the decomposed
  Hardswish and Hardsigmoid also have PyTorch's own gradients at ``x == -3`` and ``x == 3``.
- ``LayerNorm``: decomposed into mean/variance/rsqrt (its fused op's gradient does not build).
- ``AvgPool1d/2d/3d`` and ``AdaptiveAvgPool1d/2d/3d`` with an output larger than 1 and
  evenly divided windows: a depthwise convolution with a kernel of ones, times the
  reciprocal of each window's divisor (PyTorch's rules: padding, ``ceil_mode``,
  ``count_include_pad``, ``divisor_override``). ONNX Runtime 1.19's ``AveragePoolGrad``
  takes its output shape from the graph, where the batch axis is dynamic, and kills the
  process (SIGFPE) on the first training step; global pooling (``GlobalAveragePool``)
  trains and is kept.
- ``EmbeddingBag``: gather, mask and reduce
  (:class:`~taste_cl.adapters.device.embeddings.GatherEmbeddingBag`; the exporter refuses it
  with a ``padding_idx`` and otherwise emits a ``Loop`` ONNX Runtime cannot differentiate).
- ``Conv2d`` on feature maps so small that some kernel taps read only padding (a 3x3 kernel
  over a 1x1 map, as the last stages of ResNets and MobileNets meet at 32x32 inputs): the
  kernel is cropped to the taps that read the input (picked from the same weight, so its
  gradient lands in the same parameter), which saves up to 8/9 of the convolution's work.
  A depthwise ``Conv2d`` whose output positions times input positions are at most
  :data:`DEPTHWISE_MATRIX_MAX` (outputs up to 4x4 from inputs up to 8x8) becomes one small
  matrix per channel, built from the kernel, applied as one batched ``MatMul`` over the
  channels (samples as rows): ONNX Runtime 1.19's CPU ``Conv`` and ``ConvGrad`` run one
  small GEMM per group and sample, which on small maps with hundreds of channels costs far
  more than the arithmetic (a broadcast product and sum, tried first, spent its time in
  ``ReduceSum`` and ``Expand`` gradients). Both are decided from the input size each
  convolution sees on the example (spatial sizes are fixed at export); any other input
  size runs PyTorch's own convolution.
- ``Dropout`` is kept as it is; the parity gate's reference turns it off with the shared
  :func:`~taste_cl.adapters.device.transforms.disable_random_layers` (re-exported here).
- Stochastic depth (torchvision's ``StochasticDepth``, in EfficientNet; timm's ``DropPath``):
  ``nn.Identity``, so the device trains without it. Its random mask is drawn inside the
  graph, where the parity gate cannot turn it off as it does a ``Dropout`` ratio.

:func:`check_equivalent` compares the transformed copy's eval outputs (:func:`eval_outputs`) with the original's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from taste_cl.adapters.device.embeddings import GatherEmbeddingBag, check_rewritable
from taste_cl.adapters.device.transforms import FrozenBatchNorm, disable_random_layers, is_stochastic_depth

__all__ = ["BATCHNORM_MODES", "DEPTHWISE_MATRIX_MAX", "apply_transforms", "check_equivalent", "disable_random_layers", "eval_outputs"]

BATCHNORM_MODES = ("frozen", "batch")
# a depthwise convolution with at most this many (output positions x input positions) runs as per-channel matrices;
# ORT 1.19, one thread, batch 32, training step samples/s over eager torch: MobileNetV2 at 32x32 0.94x with the
# convolution everywhere, 1.12x at 16 (2x2 maps), 1.26x at 256, 1.31-1.40x at 1024 (4x4 from 8x8), no better above
# (1.35-1.39x at 4096 and 16384, with 7-28x the arithmetic of the 3x3 taps); MobileNetV3-small 1.61x -> 2.02x at 1024
DEPTHWISE_MATRIX_MAX = 1024


def _relu6(x: torch.Tensor) -> torch.Tensor:
    return F.hardtanh(x, 0.0, 6.0)  # one Clip, its gradient made strict at the bounds as PyTorch's (build.py)


class _ExportHardswish(nn.Hardswish):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _relu6(x + 3.0) / 6.0


class _ExportHardsigmoid(nn.Hardsigmoid):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _relu6(x + 3.0) / 6.0


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


def _window_divisors(size: int, kernel: int, stride: int, pad: int, ceil_mode: bool, include_pad: bool) -> tuple[list[int], int]:
    """One axis of PyTorch's average pooling: each output's divisor, and the zeros its last window needs beyond the padding."""
    out = (size + 2 * pad - kernel + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:  # a last window starting in the right padding is dropped
        out -= 1
    divisors = []
    for o in range(out):
        start = o * stride - pad
        end = min(start + kernel, size + pad)
        divisors.append(end - start if include_pad else min(end, size) - max(start, 0))
    return divisors, max(0, (out - 1) * stride + kernel - size - 2 * pad)


def _avg_pool(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    *,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> torch.Tensor:
    """``avg_pool{1,2,3}d`` as a depthwise convolution with a kernel of ones times reciprocal divisors.

    The spatial sizes are fixed at export (only the batch axis is dynamic), so the divisors
    are constants of the graph; the ones kernel depends on no parameter, so no gradient flows to it.
    """
    dims = len(kernel)
    axes = [_window_divisors(int(n), k, s, p, ceil_mode, count_include_pad)
            for n, k, s, p in zip(x.shape[2:], kernel, stride, padding)]  # fmt: skip
    extra = [e for _, e in reversed(axes)]
    if any(extra):  # ceil_mode's partial last window: zeros on the right add nothing to its sum
        x = F.pad(x, [v for e in extra for v in (0, e)])
    channels = int(x.shape[1])
    convolution = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    summed = convolution(x, x.new_ones((channels, 1, *kernel)), stride=tuple(stride), padding=tuple(padding), groups=channels)
    if divisor_override is not None:
        return summed / divisor_override
    scale = torch.ones((), dtype=torch.float64)
    for axis, (divisors, _) in enumerate(axes):
        shape = [1] * dims
        shape[axis] = len(divisors)
        scale = scale * (1.0 / torch.tensor(divisors, dtype=torch.float64)).reshape(shape)
    return summed * scale.to(dtype=x.dtype, device=x.device)


def _tuple(value: int | Sequence[int], dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,) * dims


class _ExportAvgPool(nn.Module):
    """``AvgPool{1,2,3}d`` through :func:`_avg_pool`; mixed into a copy of each class (see :data:`_POOLS`)."""

    dims: int
    kernel_size: Any
    stride: Any
    padding: Any
    ceil_mode: bool
    count_include_pad: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.dims + 2:  # unbatched: PyTorch's own op (the graph check refuses it if it needs a gradient)
            return super().forward(x)
        return _avg_pool(x, _tuple(self.kernel_size, self.dims), _tuple(self.stride, self.dims), _tuple(self.padding, self.dims),
                         ceil_mode=self.ceil_mode, count_include_pad=self.count_include_pad,
                         divisor_override=getattr(self, "divisor_override", None))  # fmt: skip


class _ExportAdaptiveAvgPool(nn.Module):
    """``AdaptiveAvgPool{1,2,3}d`` with evenly dividing windows as :func:`_avg_pool`.

    Global pooling stays as it is (``GlobalAveragePool`` trains); uneven windows too (the
    ONNX exporter refuses them with a clear error).
    """

    dims: int
    output_size: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = [int(n) for n in x.shape[2:]]
        wanted = [size if out is None else out for size, out in zip(sizes, _tuple(self.output_size, self.dims))]
        if x.dim() != self.dims + 2 or all(out == 1 for out in wanted) or any(size % out for size, out in zip(sizes, wanted)):
            return super().forward(x)
        kernel = [size // out for size, out in zip(sizes, wanted)]
        return _avg_pool(x, kernel, kernel, [0] * self.dims)


# each pooling class -> a subclass whose forward is the mixin's (its attributes are kept when swapped in)
_POOLS: dict[type[nn.Module], type[nn.Module]] = {
    kind: type(f"_Export{kind.__name__}", (mixin, kind), {"dims": dims})
    for mixin, kinds in ((_ExportAvgPool, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)),
                         (_ExportAdaptiveAvgPool, (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)))
    for dims, kind in enumerate(kinds, start=1)
}  # fmt: skip


class _ConvAxis(NamedTuple):
    """One spatial axis of a zero-padded, undilated convolution on a fixed input size."""

    size: int  # input size
    out: int  # output size
    first: int  # first kernel tap that reads the input on some output
    last: int  # last such tap
    before: int  # zeros before the input for the cropped kernel
    after: int  # zeros after the input for the cropped kernel
    end: int  # one past the last input index any tap reads

    @classmethod
    def of(cls, size: int, kernel: int, stride: int, pad: int) -> _ConvAxis:
        out = (size + 2 * pad - kernel) // stride + 1
        first, last = max(0, pad - (out - 1) * stride), min(kernel - 1, size - 1 + pad)
        end = (out - 1) * stride - pad + last + 1
        return cls(size, out, first, last, pad - first, max(0, end - size), min(end, size))


def _conv_axes(conv: nn.Conv2d, shape: Sequence[int]) -> tuple[_ConvAxis, _ConvAxis] | None:
    """Both spatial axes of ``conv`` on an input of ``shape`` (batched), or None where the rewrite does not apply."""
    if len(shape) != 4 or conv.padding_mode != "zeros" or conv.dilation != (1, 1) or isinstance(conv.padding, str):
        return None
    h, w = (_ConvAxis.of(int(n), k, s, p) for n, k, s, p in zip(shape[2:], conv.kernel_size, conv.stride, conv.padding))
    return None if h.first > h.last or w.first > w.last else (h, w)  # an output reading only padding: left as it is


def _is_depthwise(conv: nn.Conv2d) -> bool:
    return conv.groups == conv.in_channels == conv.out_channels


def _cropped_kernel(weight: torch.Tensor, h: _ConvAxis, w: _ConvAxis) -> torch.Tensor:
    """``weight[:, :, h.first : h.last + 1, w.first : w.last + 1]`` as a product with a constant 0/1 matrix.

    ONNX Runtime 1.19's ``Slice`` and ``SliceGrad`` copy a strided pick like this one element at
    a time: on ResNet-18's 512x512x3x3 kernels they took 47 ms of a 313 ms training step, a
    ``MatMul`` over the same bytes (and its gradient) a small fraction of that. Exact: each
    output is one weight times 1 plus zeros.
    """
    rows, columns = weight.shape[2:]
    taps = [i * columns + j for i in range(h.first, h.last + 1) for j in range(w.first, w.last + 1)]
    pick = torch.tensor([[1.0 if row == tap else 0.0 for tap in taps] for row in range(rows * columns)], dtype=weight.dtype)
    picked = weight.reshape(-1, rows * columns) @ pick.to(weight.device)
    return picked.reshape(weight.shape[0], weight.shape[1], h.last - h.first + 1, w.last - w.first + 1)


def _depthwise_matrix(conv: nn.Conv2d, x: torch.Tensor, h: _ConvAxis, w: _ConvAxis) -> torch.Tensor:
    """A depthwise ``conv`` as one ``outputs x inputs`` matrix per channel, built from the kernel by a
    product with a constant 0/1 matrix (padding is the zeros of that matrix), applied as one batched
    matrix product: ``channels`` GEMMs of ``batch x inputs`` by ``inputs x outputs``."""
    rows, columns = conv.kernel_size
    (sh, sw), (ph, pw) = conv.stride, (int(pad) for pad in conv.padding)  # not a str: _conv_axes refused those
    outputs, inputs = h.out * w.out, h.size * w.size
    pick = [[0.0] * (outputs * inputs) for _ in range(rows * columns)]
    for u in range(h.out):
        for v in range(w.out):
            for p in range(h.size):
                for q in range(w.size):
                    i, j = p - u * sh + ph, q - v * sw + pw
                    if 0 <= i < rows and 0 <= j < columns:
                        pick[i * columns + j][(u * w.out + v) * inputs + p * w.size + q] = 1.0
    kernel = conv.weight.reshape(-1, rows * columns)
    matrix = (kernel @ torch.tensor(pick, dtype=kernel.dtype).to(kernel.device)).reshape(-1, outputs, inputs)
    by_channel = x.reshape(-1, conv.in_channels, inputs).transpose(0, 1)  # channels x batch x inputs
    out = torch.matmul(by_channel, matrix.transpose(1, 2)).transpose(0, 1).reshape(-1, conv.out_channels, h.out, w.out)
    return out if conv.bias is None else out + conv.bias.reshape(1, -1, 1, 1)


class _ExportConv2d(nn.Conv2d):
    """``Conv2d`` on its export input size (``input_size``): the kernel cropped to the taps that read
    the input, or a depthwise one on a small map as per-channel matrices (``as_matrix``); see the module docstring."""

    input_size: tuple[int, int]
    as_matrix: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes = _conv_axes(self, x.shape) if x.dim() == 4 and tuple(x.shape[2:]) == self.input_size else None
        if axes is None:
            return super().forward(x)
        h, w = axes
        if self.as_matrix:
            return _depthwise_matrix(self, x, h, w)
        weight = _cropped_kernel(self.weight, h, w)
        if h.end < h.size or w.end < w.size:  # rows or columns no live tap reads
            x = x[:, :, : h.end, : w.end]
        if h.before == h.after and w.before == w.after:
            return F.conv2d(x, weight, self.bias, self.stride, (h.before, w.before), 1, self.groups)
        x = F.pad(x, (w.before, w.after, h.before, h.after))
        return F.conv2d(x, weight, self.bias, self.stride, 0, 1, self.groups)


def _conv_inputs(model: nn.Module, run: Callable[[], Any]) -> dict[nn.Module, set[tuple[int, ...]]]:
    """The input shapes each ``nn.Conv2d`` of ``model`` sees while ``run()`` runs."""
    shapes: dict[nn.Module, set[tuple[int, ...]]] = {}
    hooks = [module.register_forward_pre_hook(lambda m, args: shapes.setdefault(m, set()).add(tuple(args[0].shape)))
             for module in model.modules() if type(module) is nn.Conv2d]  # fmt: skip
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return shapes


def _rewrite_conv(conv: nn.Conv2d, shapes: set[tuple[int, ...]]) -> bool:
    """Make ``conv`` an :class:`_ExportConv2d` when its one input size lets the rewrite save work; whether it did."""
    axes = _conv_axes(conv, next(iter(shapes))) if len(shapes) == 1 else None
    if axes is None:
        return False
    h, w = axes
    as_matrix = _is_depthwise(conv) and h.out * w.out * h.size * w.size <= DEPTHWISE_MATRIX_MAX
    cropped = (h.first, h.last, w.first, w.last) != (0, conv.kernel_size[0] - 1, 0, conv.kernel_size[1] - 1)
    if not (as_matrix or cropped):
        return False
    conv.__class__ = _ExportConv2d
    rewritten = cast(_ExportConv2d, conv)
    rewritten.input_size, rewritten.as_matrix = (h.size, w.size), as_matrix
    return True


def apply_transforms(model: nn.Module, *, batchnorm: str = "frozen", run: Callable[[], Any] | None = None) -> list[str]:
    """Rewrite ``model`` (a copy: it is changed in place) for export; return ``"path: what"`` lines.

    ``run`` (optional) runs the model once on the export example: the input sizes its
    ``Conv2d`` modules see there decide their rewrite (none without it).
    Raises ``ValueError`` for ``batchnorm="frozen"`` on a BatchNorm without running
    statistics (``track_running_stats=False``), naming its module path.
    """
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"`batchnorm == {batchnorm!r}`, must be one of {BATCHNORM_MODES}")
    conv_inputs = {} if run is None else _conv_inputs(model, run)
    done = []
    for path, module in model.named_modules():
        kind = type(module)
        if kind is nn.Conv2d:
            if not _rewrite_conv(module, conv_inputs.get(module, set())):
                continue
        elif kind is nn.Hardswish:
            module.__class__ = _ExportHardswish
        elif kind is nn.Hardsigmoid:
            module.__class__ = _ExportHardsigmoid
        elif kind is nn.LayerNorm:
            module.__class__ = _ExportLayerNorm
        elif kind in _POOLS:
            module.__class__ = _POOLS[kind]
        elif is_stochastic_depth(module):
            module.__class__ = nn.Identity
        elif kind is nn.EmbeddingBag:
            check_rewritable(module, path or "<model>")
            module.__class__ = GatherEmbeddingBag
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
