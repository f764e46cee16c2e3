"""peft LoHa layers in plain tensor ops, for ExecuTorch's training export.

peft's LoHa (Hadamard-product adapter) computes its weight delta
``(w1_a @ w1_b) * (w2_a @ w2_b) * scaling`` in a custom ``autograd.Function``
(``HadaWeight``), whose hand-written backward ExecuTorch's joint forward-backward graph
cannot see (the loss ends up not requiring a gradient), and its forward draws
``torch.rand(1) > module_dropout`` in training mode, a branch ``torch.export`` cannot trace.
:func:`rewrite_loha` gives each LoHa layer of a model copy a ``forward`` with the same
product in plain ops (autograd derives the same gradients) and without the draw, which is
exact when the layer's ``module_dropout`` and ``rank_dropout`` are 0 (peft's defaults): the
draw then always adds the adapter. A layer with a dropout or a CP-decomposed convolution
(``use_effective_conv2d``) has no such twin: :func:`rewrite_loha` refuses the model, naming
those layers and the settings that export. peft is not imported: LoHa layers are found by
their ``hada_w1_a`` adapters.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

__all__ = ["rewrite_loha"]


def _delta_weight(layer: Any, adapter: str, *, apply_rank_dropout: bool = False) -> torch.Tensor:
    """The adapter's weight delta in the base layer's shape: peft's ``get_delta_weight`` (rank dropout 0)."""
    product = (layer.hada_w1_a[adapter] @ layer.hada_w1_b[adapter]) * (layer.hada_w2_a[adapter] @ layer.hada_w2_b[adapter])
    return (product * layer.scaling[adapter]).reshape(layer.get_base_layer().weight.shape)


def _forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The base layer's output plus every active adapter's, as peft's ``forward`` with its dropouts at 0."""
    result = layer.base_layer(x, *args, **kwargs)
    for adapter in layer.active_adapters:
        if adapter in layer._available_adapters:
            result = result + layer._get_delta_activations(adapter, x, *args, **kwargs)
    return result.to(x.dtype)


def _rewritable(layer: Any) -> bool:
    adapters = [a for a in layer.active_adapters if a in layer._available_adapters]
    return all(a not in layer.hada_t1 and not layer.module_dropout[a] and not layer.rank_dropout[a] for a in adapters)


def rewrite_loha(model: nn.Module) -> int:
    """Rewrite ``model``'s unmerged LoHa layers in place (see the module docstring); how many.

    Raises ``ValueError`` naming the layers that draw a dropout or are CP-decomposed, before
    changing any layer."""
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "hada_w1_a") and not m.merged}
    refused = [name for name, layer in layers.items() if not _rewritable(layer)]
    if refused:
        raise ValueError(
            f"peft LoHa layers {', '.join(refused)} draw a random module or rank dropout per step, or are CP-decomposed "
            "convolutions, which ExecuTorch's export cannot trace; export a model built with LoHaConfig(module_dropout=0, "
            "rank_dropout=0, use_effective_conv2d=False), or use backend='onnxruntime'"
        )
    for layer in layers.values():
        layer.forward = types.MethodType(_forward, layer)
        layer.get_delta_weight = types.MethodType(_delta_weight, layer)
    return len(layers)
