"""The monitors' events and the arithmetic of a probe evaluation, torch-free: what the torch monitor
(:mod:`taste_cl.monitor.monitor`) and the engine loop's (:mod:`taste_cl.engine.monitor`) share, so both
score a probe alike and emit the same events.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["EVENT_NAMES", "EventBus", "MonitorEvent", "Subscriber", "negative_flips", "probe_outcome"]

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


class EventBus:
    """A monitor's events: subscribers, the events queued during an observe, and the log of recent ones.

    Both monitors are one; ``steps`` (the owner's observe count) stamps each event. :meth:`_open_bus`
    starts it, :meth:`_clear_log` empties the log (at most ``max_events`` kept)."""

    steps: int

    def _open_bus(self, max_events: int) -> None:
        self._subscribers: list[tuple[str | None, Subscriber]] = []
        self._pending: list[MonitorEvent] = []
        self._clear_log(max_events)

    def _clear_log(self, max_events: int) -> None:
        self._events: deque[MonitorEvent] = deque(maxlen=max_events)
        self._event_counts: Counter[str] = Counter()

    def subscribe(self, callback: Subscriber, event: str | None = None) -> Callable[[], None]:
        """Call ``callback(event)`` for every event (or only those named ``event``).

        Returns a function that unsubscribes.
        """
        if event is not None and event not in EVENT_NAMES:
            raise ValueError(f"unknown event {event!r}; known events: {', '.join(EVENT_NAMES)}")
        entry = (event, callback)
        self._subscribers.append(entry)
        return lambda: self._subscribers.remove(entry) if entry in self._subscribers else None

    def emit(self, name: str, **details: Any) -> None:
        """Queue an event; subscribers hear it at the end of the current ``observe``."""
        self._pending.append(MonitorEvent(name, self.steps, details))

    def dispatch(self) -> list[MonitorEvent]:
        """Record queued events and call their subscribers; return them."""
        events, self._pending = self._pending, []
        for event in events:
            self._events.append(event)
            self._event_counts[event.name] += 1
        for event in events:
            for wanted, callback in list(self._subscribers):
                if wanted is None or wanted == event.name:
                    callback(event)
        return events

    @property
    def events(self) -> list[MonitorEvent]:
        """Recent events, oldest first (at most ``max_events``)."""
        return list(self._events)


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
