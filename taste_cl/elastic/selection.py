"""Which units to train: importance per unit, and a DP over time (and memory) budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl._checks import check_int, check_positive

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


def _check_costs(name: str, values: Sequence[float], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"`{name}` must have one value per unit ({n}); got {len(values)}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"`{name}` must hold finite numbers >= 0; got {bad[0]!r}")


def _bins(values: Sequence[float], unit: float) -> list[int]:
    return [math.ceil(v / unit - 1e-9) for v in values]


def select_tensors(
    importance: Sequence[float],
    weight_grad_s: Sequence[float],
    act_grad_s: Sequence[float],
    budget_s: float,
    *,
    resolution: int = 1000,
    weight_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    budget_bytes: float | None = None,
    memory_resolution: int = 64,
) -> list[int]:
    """Indices (ascending) of the units of maximal total importance within the budgets.

    The time of a set ``S`` is ``sum(weight_grad_s[S]) + sum(act_grad_s[min(S) + 1:])``;
    with ``budget_bytes``, its memory ``sum(weight_bytes[S]) + sum(act_bytes[min(S) + 1:])``
    must fit too (both have the same shape: a per-unit part and a part paid for every
    unit after the earliest trainable one). Costs are rounded *up* to ``budget /
    resolution``, so the result never exceeds a budget; it is optimal for the rounded
    costs. For each candidate earliest unit ``k`` the rest is a 0/1 knapsack over the later
    units; adding units from the output backwards shares one table, so the search is
    O(units x resolution x memory_resolution). Returns ``[]`` when no unit fits.
    """
    n = len(importance)
    for name, values in (("importance", importance), ("weight_grad_s", weight_grad_s), ("act_grad_s", act_grad_s)):
        _check_costs(name, values, n)
    check_positive("budget_s", budget_s)
    check_int("resolution", resolution, 1)
    with_memory = budget_bytes is not None
    if with_memory:
        if weight_bytes is None or act_bytes is None:
            raise ValueError("`budget_bytes` needs `weight_bytes` and `act_bytes`")
        _check_costs("weight_bytes", weight_bytes, n)
        _check_costs("act_bytes", act_bytes, n)
        check_positive("budget_bytes", budget_bytes)
        check_int("memory_resolution", memory_resolution, 1)
    t_cap = resolution
    m_cap = memory_resolution if with_memory else 0
    w_t, a_t = _bins(weight_grad_s, budget_s / t_cap), _bins(act_grad_s, budget_s / t_cap)
    if with_memory:
        unit_m = budget_bytes / m_cap  # type: ignore[operator]
        w_m, a_m = _bins(weight_bytes, unit_m), _bins(act_bytes, unit_m)  # type: ignore[arg-type]
    else:
        w_m, a_m = [0] * n, [0] * n
    after_t = [sum(a_t[k + 1 :]) for k in range(n)]
    after_m = [sum(a_m[k + 1 :]) for k in range(n)]
    table = np.zeros((t_cap + 1, m_cap + 1))  # best importance of the units added so far, per (time, memory) capacity
    takes = np.zeros((n, t_cap + 1, m_cap + 1), dtype=bool)
    best, best_k, best_cap = -math.inf, -1, (0, 0)
    for k in reversed(range(n)):
        cap_t, cap_m = t_cap - after_t[k] - w_t[k], m_cap - after_m[k] - w_m[k]
        if cap_t >= 0 and cap_m >= 0 and importance[k] + table[cap_t, cap_m] > best:
            best, best_k, best_cap = importance[k] + table[cap_t, cap_m], k, (cap_t, cap_m)
        if w_t[k] <= t_cap and w_m[k] <= m_cap:
            with_k = np.full_like(table, -math.inf)
            with_k[w_t[k] :, w_m[k] :] = table[: t_cap + 1 - w_t[k], : m_cap + 1 - w_m[k]] + importance[k]
            takes[k] = with_k > table
            table = np.maximum(table, with_k)
    if best_k < 0:
        return []
    chosen, (cap_t, cap_m) = [best_k], best_cap
    for i in range(best_k + 1, n):
        if takes[i, cap_t, cap_m]:
            chosen.append(i)
            cap_t, cap_m = cap_t - w_t[i], cap_m - w_m[i]
    return chosen
