"""Stability-plasticity monitor: does the model keep old knowledge while learning new data?

- **plasticity**: prequential (test-then-train) accuracy on each incoming stream batch,
  measured with the parameters *before* the model trains on that batch, over a
  sliding window of recent batches;
- **stability**: accuracy on a class-balanced *probe* of past stream samples, kept by
  the monitor apart from the replay buffer and re-evaluated every ``eval_every`` steps;
- **forgetting**: per class, best probe accuracy so far minus current probe accuracy,
  averaged over classes (the class-wise analogue of Chaudhry et al.'s forgetting);
- **drift**: Page-Hinkley test on the prequential loss.

Other components subscribe to its events (``drift_detected``, ``forgetting_rising``,
``numerical_fault``, and the tuner's ``load_shift``) with :meth:`subscribe`.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from taste_cl._report import MonitorReport
from taste_cl.drift import PageHinkley
from taste_cl.replay import ClassBalancedReplay

__all__ = ["MonitorEvent", "StabilityPlasticityMonitor"]

EVENT_NAMES = ("drift_detected", "forgetting_rising", "numerical_fault", "load_shift", "retuned")


@dataclass(frozen=True)
class MonitorEvent:
    """Something subscribers may react to; ``details`` holds only plain values."""

    name: str
    step: int
    details: dict[str, Any] = field(default_factory=dict)


Subscriber = Callable[[MonitorEvent], None]


class StabilityPlasticityMonitor:
    """Measure stability, plasticity, forgetting and drift of an online learner.

    Parameters
    ----------
    probe_capacity:
        Size of the class-balanced probe of past samples used for stability.
    eval_every:
        Evaluate the probe every this many training steps.
    window:
        Number of recent stream batches the plasticity estimate averages over.
    forgetting_threshold:
        ``forgetting_rising`` fires when average forgetting rises above this.
    drift_detector:
        Any object with ``update(value) -> bool`` and ``state_dict``/``load_state_dict``;
        defaults to :class:`~taste_cl.drift.PageHinkley` on the batch loss.
    max_events:
        Bound on the remembered event history (memory stays flat on long streams).
    """

    def __init__(
        self,
        *,
        probe_capacity: int = 200,
        eval_every: int = 10,
        window: int = 50,
        forgetting_threshold: float = 0.1,
        drift_detector: PageHinkley | None = None,
        max_events: int = 1000,
        seed: int = 0,
    ) -> None:
        for name, value in (("eval_every", eval_every), ("window", window), ("max_events", max_events)):
            if value < 1:
                raise ValueError(f"`{name} == {value}`, must be >= 1")
        self.probe_capacity = probe_capacity
        self.eval_every = eval_every
        self.window = window
        self.forgetting_threshold = forgetting_threshold
        self.drift_detector = drift_detector if drift_detector is not None else PageHinkley()
        self.max_events = max_events
        self.seed = seed
        self._probe = ClassBalancedReplay(probe_capacity, seed=seed)
        self._subscribers: list[tuple[str | None, Subscriber]] = []
        self._pending: list[MonitorEvent] = []
        self._reset_measurements()

    def _reset_measurements(self) -> None:
        self.steps = 0
        self.samples_seen = 0
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=self.window)  # (correct, n, loss)
        self._class_accuracy: dict[int, float] = {}
        self._best_class_accuracy: dict[int, float] = {}
        self._stability: float | None = None
        self._forgetting = 0.0
        self._events: deque[MonitorEvent] = deque(maxlen=self.max_events)
        self._event_counts: Counter[str] = Counter()
        self._last_drift_step: int | None = None

    # ----------------------------------------------------------------- events
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

    # ----------------------------------------------------------- measurements
    def record(self, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, *, validated: bool = False) -> int:
        """Score a stream batch with logits computed *before* training on it, then store it in the probe.

        Returns the number of samples the logits classified correctly. ``validated=True``
        (the learner's own calls) skips the probe's input checks.
        """
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(logits.float(), y))
            correct = int((logits.argmax(dim=1) == y).sum())
        self.steps += 1
        self.samples_seen += y.shape[0]
        self._recent.append((correct, y.shape[0], loss))
        if math.isfinite(loss) and self.drift_detector.update(loss):
            self._last_drift_step = self.steps
            self.emit("drift_detected", loss=loss)
        if validated:
            self._probe.add_validated(x, y)
        else:
            self._probe.add(x, y)
        return correct

    def due(self) -> bool:
        """Whether the probe should be evaluated after this step."""
        return self.steps % self.eval_every == 0 and len(self._probe) > 0

    def evaluate(self, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Evaluate the probe with ``predict`` (features -> logits) and update stability/forgetting."""
        x, y = self._probe.sample(len(self._probe))
        with torch.no_grad():
            hits = predict(x).argmax(dim=1) == y
        self._stability = float(hits.float().mean())
        totals = torch.bincount(y).tolist()
        correct = torch.bincount(y, weights=hits.double()).tolist()
        for label, (n, right) in enumerate(zip(totals, correct)):
            if n:
                accuracy = right / n
                self._class_accuracy[label] = accuracy
                self._best_class_accuracy[label] = max(self._best_class_accuracy.get(label, 0.0), accuracy)
        drops = [self._best_class_accuracy[c] - a for c, a in self._class_accuracy.items()]
        previous, self._forgetting = self._forgetting, sum(drops) / len(drops)
        if previous <= self.forgetting_threshold < self._forgetting:
            self.emit("forgetting_rising", forgetting=self._forgetting, threshold=self.forgetting_threshold)

    # ---------------------------------------------------------------- reading
    @property
    def plasticity(self) -> float | None:
        """Prequential accuracy over the recent window (None before any batch)."""
        n = sum(count for _, count, _ in self._recent)
        return sum(correct for correct, _, _ in self._recent) / n if n else None

    @property
    def stability(self) -> float | None:
        """Accuracy on the probe of past samples at the last evaluation (None before one)."""
        return self._stability

    @property
    def forgetting(self) -> float:
        """Average over classes of best-so-far minus current probe accuracy."""
        return self._forgetting

    def report(self) -> MonitorReport:
        """A dict summary: stability, plasticity, forgetting, drift, per-class accuracy
        (``print`` shows it as a few rounded lines)."""
        losses = [loss for _, _, loss in self._recent if math.isfinite(loss)]
        report = {
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "stability": self._stability,
            "plasticity": self.plasticity,
            "plasticity_loss": sum(losses) / len(losses) if losses else None,
            "forgetting": self._forgetting,
            "drift": {
                "count": self._event_counts["drift_detected"],
                "last_step": self._last_drift_step,
                "recent": self._last_drift_step is not None and self.steps - self._last_drift_step < self.window,
            },
            "per_class_accuracy": dict(sorted(self._class_accuracy.items())),
            "events": dict(self._event_counts),
        }
        return MonitorReport(report)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "recent": [list(item) for item in self._recent],
            "class_accuracy": [[c, a] for c, a in self._class_accuracy.items()],
            "best_class_accuracy": [[c, a] for c, a in self._best_class_accuracy.items()],
            "stability": self._stability,
            "forgetting": self._forgetting,
            "events": [asdict(event) for event in self._events],
            "event_counts": dict(self._event_counts),
            "last_drift_step": self._last_drift_step,
            "probe": self._probe.state_dict(),
            "drift_detector": self.drift_detector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset_measurements()
        self.steps = int(state["steps"])
        self.samples_seen = int(state["samples_seen"])
        self._recent.extend((int(c), int(n), float(loss)) for c, n, loss in state["recent"])
        self._class_accuracy = {int(c): float(a) for c, a in state["class_accuracy"]}
        self._best_class_accuracy = {int(c): float(a) for c, a in state["best_class_accuracy"]}
        self._stability = None if state["stability"] is None else float(state["stability"])
        self._forgetting = float(state["forgetting"])
        self._events.extend(MonitorEvent(e["name"], int(e["step"]), dict(e["details"])) for e in state["events"])
        self._event_counts.update({str(k): int(v) for k, v in state["event_counts"].items()})
        self._last_drift_step = state["last_drift_step"]
        self._probe.load_state_dict(state["probe"])
        self.drift_detector.load_state_dict(state["drift_detector"])
