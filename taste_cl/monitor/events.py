"""The monitors' events and the arithmetic of a probe evaluation, torch-free: what the torch monitor
(:mod:`taste_cl.monitor.monitor`) and the engine loop's (:mod:`taste_cl.engine.monitor`) share, so both
score a probe alike and emit the same events.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EVENT_NAMES", "MonitorEvent", "Subscriber", "negative_flips", "probe_outcome"]

EVENT_NAMES = (
    "drift_detected",
    "forgetting_rising",
    "numerical_fault",
    "updates_stuck",
    "diverging",
    "load_shift",
    "retuned",
    "update_regressed",
    "update_rolled_back",
    "classes_added",
    "adaptation_reset",
)


@dataclass(frozen=True)
class MonitorEvent:
    """Something subscribers may react to; ``details`` holds only plain values."""

    name: str
    step: int
    details: dict[str, Any] = field(default_factory=dict)


Subscriber = Callable[[MonitorEvent], None]


def negative_flips(last_ids: np.ndarray, last_correct: np.ndarray, ids: np.ndarray, correct: np.ndarray) -> tuple[float, float] | None:
    """Among probe samples scored at the previous evaluation (``last_*``) and now, the share that was right and
    became wrong, and the share of the current errors that are such flips; None if no sample is in both."""
    if not last_ids.size:
        return None
    order = np.argsort(last_ids, kind="stable")
    sorted_ids = last_ids[order]
    at = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
    common = sorted_ids[at] == ids  # probe ids are unique: a match is the same sample
    n_common = int(common.sum())
    if not n_common:
        return None
    before, now = last_correct[order][at][common], correct[common]
    negative, errors = int((before & ~now).sum()), int((~now).sum())
    return negative / n_common, negative / errors if errors else 0.0


def probe_outcome(
    scores: Mapping[int, float],
    current: dict[int, float],
    best: dict[int, float],
    *,
    previous: float | None,
    stability: float,
    forgetting: float,
    higher_is_better: bool,
    regression_threshold: float,
    forgetting_threshold: float,
) -> tuple[float | None, float, bool]:
    """Fold one probe evaluation's per-class ``scores`` into ``current`` and ``best`` (in place) and return
    ``(drop, forgetting, rising)``: the drop of the probe score from ``previous`` when it exceeds
    ``regression_threshold`` (``update_regressed``, else None), the new average forgetting over classes, and
    whether it just rose above ``forgetting_threshold`` (``forgetting_rising``). Shared by both monitors."""
    sign = 1.0 if higher_is_better else -1.0
    drop = None
    if previous is not None and math.isfinite(stability) and sign * (previous - stability) > regression_threshold:
        drop = sign * (previous - stability)
    better = max if higher_is_better else min
    for label, score in scores.items():
        current[label] = score
        best[label] = better(best.get(label, score), score)
    drops = [sign * (best[c] - a) for c, a in current.items()]
    now = sum(drops) / len(drops)
    return drop, now, forgetting <= forgetting_threshold < now
