"""Page-Hinkley change detection on a stream of scalars (e.g. per-batch loss).

Page (1954), Hinkley (1971); the same test as river's ``drift.PageHinkley``, kept
in-house so the core has no compiled dependency. It detects an *increase* of the
mean, which is what a distribution shift does to the prequential loss. Torch-free: the torch
monitor (:mod:`taste_cl.monitor.monitor`) and the engine loop's (:mod:`taste_cl.engine.monitor`)
run the same test, so both detect drift at the same batch.

>>> detector = PageHinkley(min_instances=5, delta=0.05, threshold=2.0)
>>> [detector.update(0.3) for _ in range(20)][-1]
False
>>> any(detector.update(2.5) for _ in range(5))
True
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["PageHinkley"]


class PageHinkley:
    """Detect an upward shift in the mean of a scalar stream.

    Parameters
    ----------
    min_instances:
        Observations needed before a detection may be signalled.
    delta:
        Magnitude of change tolerated (noise allowance) per observation.
    threshold:
        Cumulative deviation that triggers a detection (lambda).
    alpha:
        Forgetting factor of the cumulative sum (1.0 = no forgetting).
    """

    def __init__(self, *, min_instances: int = 10, delta: float = 0.05, threshold: float = 3.0, alpha: float = 0.9999):
        if min_instances < 1:
            raise ValueError(f"`min_instances == {min_instances}`, must be >= 1")
        if threshold <= 0:
            raise ValueError(f"`threshold == {threshold}`, must be > 0")
        if not 0 < alpha <= 1:
            raise ValueError(f"`alpha == {alpha}`, must be in (0, 1]")
        self.min_instances = min_instances
        self.delta = delta
        self.threshold = threshold
        self.alpha = alpha
        self._reset()
        self.drift_detected = False

    def _reset(self) -> None:
        self._n = 0
        self._mean = 0.0
        self._sum = 0.0
        self._min_sum = 0.0

    def update(self, value: float) -> bool:
        """Add one observation; return (and store in ``drift_detected``) whether a shift was detected."""
        if not math.isfinite(value):
            raise ValueError(f"PageHinkley.update got a non-finite value {value}")
        self._n += 1
        self._mean += (value - self._mean) / self._n
        self._sum = self.alpha * self._sum + (value - self._mean - self.delta)
        self._min_sum = min(self._min_sum, self._sum)
        self.drift_detected = self._n >= self.min_instances and self._sum - self._min_sum > self.threshold
        if self.drift_detected:
            self._reset()
        return self.drift_detected

    def state_dict(self) -> dict[str, Any]:
        return {"n": self._n, "mean": self._mean, "sum": self._sum, "min_sum": self._min_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; validated first (ValueError, nothing changed)."""
        if not isinstance(state, dict) or set(state) != {"n", "mean", "sum", "min_sum"}:
            raise ValueError("PageHinkley state must be a dict with keys n, mean, sum, min_sum")
        n = state["n"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"PageHinkley state `n == {n!r}`, must be an int >= 0")
        values = [state[k] for k in ("mean", "sum", "min_sum")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ValueError(f"PageHinkley state mean/sum/min_sum must be finite numbers; got {values}")
        self._n = n
        self._mean, self._sum, self._min_sum = (float(v) for v in values)
