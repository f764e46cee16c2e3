"""Which units to train: importance per unit (:class:`GradientImportance`), and :func:`select_tensors`, the DP over time
(and memory) budgets, which lives in the torch-free :mod:`taste_cl.engine.elastic` so that the device loop selects with it too."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from taste_cl.engine.elastic import select_tensors  # the dynamic programme is torch-free: the device loop selects with it too

__all__ = ["GradientImportance", "select_tensors"]


class GradientImportance:
    """Importance of each unit over one training step: ``sum |grad * delta_w|``.

    :meth:`arm` snapshots the weights and hooks the gradients; after the step,
    :meth:`collect` returns one non-negative score per unit (None if no gradient arrived,
    e.g. the step was skipped) and removes the hooks. Costs one copy of the weights and
    gradients, only on probe steps.
    """

    def __init__(self, units: Sequence[Sequence[nn.Parameter]]) -> None:
        self.units = [list(params) for params in units]
        self._before: list[list[torch.Tensor]] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._before)

    def arm(self) -> None:
        self.disarm()
        self._before = [[p.detach().clone() for p in params] for params in self.units]
        for params in self.units:
            for p in params:
                if p.requires_grad:  # a parameter frozen since the profile gets no gradient: it scores 0
                    self._handles.append(p.register_post_accumulate_grad_hook(self._record))

    def _record(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._grads[id(param)] = param.grad.detach().clone()

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._before, self._grads = [], [], {}

    def collect(self) -> list[float] | None:
        """Scores from the gradients seen since :meth:`arm` and the weight change since then."""
        if not self._grads:
            self.disarm()
            return None
        scores = []
        with torch.no_grad():
            for params, before in zip(self.units, self._before):
                score = 0.0
                for p, old in zip(params, before):
                    grad = self._grads.get(id(p))
                    if grad is not None:
                        score += float((grad * (p.detach() - old)).abs().sum())
                scores.append(score if math.isfinite(score) else 0.0)
        self.disarm()
        return scores
