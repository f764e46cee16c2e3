"""Embedding layers on a device: ``nn.EmbeddingBag`` rewritten into trainable ops, and id bounds.

``nn.EmbeddingBag`` does not reach a device as it is: the ONNX exporter refuses it with a
``padding_idx`` and otherwise emits a ``Loop`` that ONNX Runtime cannot differentiate.
:class:`GatherEmbeddingBag` computes the same bags from ops both device runtimes train: a
``Gather`` of the rows, a mask for ``padding_idx``, the ``per_sample_weights`` product, then a
sum, mean or max over the bag axis. A 2-D input ``(bags, length)`` reduces over axis 1; a 1-D
input with ``offsets`` becomes a ``(bags, n)`` membership matrix times the gathered rows (a
segment sum). The swap changes the module's class only (``module.__class__``), so the
parameter keeps its name and values; forward values and gradients match PyTorch's to float
rounding (empty bags give zeros, as in PyTorch). ``max_norm`` (renormalises the weight in
place during forward) and ``scale_grad_by_freq`` (rescales gradients by batch counts) have
no rewrite and are refused by :func:`check_rewritable`, naming the module.

Integer inputs index embedding tables: an id outside the table is an ``IndexError`` in
PyTorch, but ONNX Runtime's ``Gather`` wraps negative ids and a device kernel may read out
of bounds. :func:`index_bounds` finds, on the example batch, the input leaves that an
``Embedding`` or ``EmbeddingBag`` indexes directly (or through a view) and the smallest table
each indexes; the device learners refuse ids outside ``[0, bound)`` before the runtime runs.

>>> import torch
>>> from torch import nn
>>> bag = nn.EmbeddingBag(10, 3, mode="mean", padding_idx=0)
>>> ids = torch.tensor([[1, 2, 0], [4, 0, 0]])
>>> rewritten = rewrite_embedding_bags(nn.Sequential(bag))
>>> rewritten
1
>>> type(bag).__name__
'GatherEmbeddingBag'
>>> torch.allclose(bag(ids), nn.EmbeddingBag.forward(bag, ids))
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from taste_cl.adapters.device.artifacts import ExportError

__all__ = ["GatherEmbeddingBag", "check_rewritable", "index_bounds", "rewrite_embedding_bags"]


class GatherEmbeddingBag(nn.EmbeddingBag):
    """``nn.EmbeddingBag`` computed with gather, mask and reduce (see the module docstring).

    Made by swapping the class of an ``nn.EmbeddingBag`` that :func:`check_rewritable` accepts.
    """

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets must be None for a 2-D input (each row is one bag)")
            return self._reduce(input, per_sample_weights, None)
        if input.dim() != 1 or offsets is None or offsets.dim() != 1:
            raise ValueError(f"input must be 2-D (bags, length), or 1-D with 1-D offsets; got input {tuple(input.shape)}")
        starts = offsets[:-1] if self.include_last_offset else offsets
        ends = offsets[1:] if self.include_last_offset else torch.cat([offsets[1:], offsets.new_full((1,), input.shape[0])])
        position = torch.arange(input.shape[0], device=input.device)
        member = (position.unsqueeze(0) >= starts.unsqueeze(1)) & (position.unsqueeze(0) < ends.unsqueeze(1))
        return self._reduce(input, per_sample_weights, member)

    def _reduce(self, ids: torch.Tensor, weights: torch.Tensor | None, member: torch.Tensor | None) -> torch.Tensor:
        """Bags of ``ids`` (2-D: one bag per row; 1-D: the bags of the ``(bags, n)`` matrix ``member``)."""
        if weights is not None and self.mode != "sum":
            raise NotImplementedError("per_sample_weights is only supported for mode='sum' (as in PyTorch)")
        rows = F.embedding(ids, self.weight)  # Gather; no padding_idx here: the mask below excludes those rows
        kept = torch.ones_like(ids, dtype=torch.bool) if self.padding_idx is None else ids != self.padding_idx
        if weights is not None:
            rows = rows * weights.unsqueeze(-1).to(rows.dtype)
        if member is not None:  # (bags, n) x (n, dim): which ids each bag takes
            kept = member & kept.unsqueeze(0)
        if self.mode == "max" and rows.shape[-2]:  # without any id every bag is empty: zeros, from the sum below
            if member is not None:
                rows = rows.unsqueeze(0)  # (bags, n, dim)
            masked = rows.masked_fill(~kept.unsqueeze(-1), float("-inf"))
            # the first largest entry by ArgMax, then GatherElements: the gradient reaches that entry only, as in
            # PyTorch (ONNX Runtime has no ReduceMax gradient)
            best = masked.gather(-2, masked.argmax(dim=-2, keepdim=True)).squeeze(-2)
            return torch.where(kept.any(dim=-1, keepdim=True), best, torch.zeros((), dtype=rows.dtype))
        mask = kept.to(rows.dtype)
        summed = mask @ rows if member is not None else (rows * mask.unsqueeze(-1)).sum(dim=1)
        if self.mode == "sum":
            return summed
        return summed / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)


def check_rewritable(module: nn.EmbeddingBag, path: str) -> None:
    """Refuse, naming ``path``, an ``nn.EmbeddingBag`` whose behaviour the rewrite cannot keep."""
    if module.max_norm is not None:
        raise ExportError(
            f"module {path!r} is an nn.EmbeddingBag with max_norm={module.max_norm}, which renormalises its weight in place "
            "during forward: no device runtime can do that; build it with max_norm=None (renormalise after training if needed)"
        )
    if module.scale_grad_by_freq:
        raise ExportError(
            f"module {path!r} is an nn.EmbeddingBag with scale_grad_by_freq=True, whose gradient depends on batch counts "
            "no device graph computes; build it with scale_grad_by_freq=False"
        )


def rewrite_embedding_bags(model: nn.Module) -> int:
    """Swap every ``nn.EmbeddingBag`` of ``model`` (in place) for a :class:`GatherEmbeddingBag`; return how many.

    Every bag is checked first (:func:`check_rewritable`), so a refusal changes nothing.
    """
    bags = [(path, module) for path, module in model.named_modules() if type(module) is nn.EmbeddingBag]
    for path, module in bags:
        check_rewritable(module, path or "<model>")
    for _, module in bags:
        module.__class__ = GatherEmbeddingBag
    return len(bags)


def index_bounds(model: nn.Module, run: Callable[[], Any], leaves: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The integer ``leaves`` (input name -> the tensor ``run`` feeds ``model``) that index an embedding
    table when ``run()`` calls ``model``, each with the smallest table size it indexes.

    A leaf counts when an ``nn.Embedding`` or ``nn.EmbeddingBag`` receives it, or a view of it
    (same storage and element count), as its ids; ids derived by arithmetic are not tracked.
    ``run`` is called once in eval mode without gradients; the model's mode is restored.
    """
    candidates = {name: leaf for name, leaf in leaves.items() if not leaf.is_floating_point() and leaf.dtype != torch.bool}
    bounds: dict[str, int] = {}

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor):
            return
        for name, leaf in candidates.items():
            if ids is leaf or (ids.numel() == leaf.numel() and ids.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()):
                size = int(module.num_embeddings)  # type: ignore[arg-type]
                bounds[name] = min(bounds.get(name, size), size)

    embeddings = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not embeddings or not candidates:
        return bounds
    hooks = [m.register_forward_pre_hook(record) for m in embeddings]
    mode = model.training
    try:
        model.eval()
        with torch.no_grad():
            run()
    finally:
        model.train(mode)
        for hook in hooks:
            hook.remove()
    return bounds
