"""What one ``observe`` call did: :class:`ObserveStats`, shared by every learner.

The PyTorch :class:`~taste_cl.learner.learner.OnlineLearner` and the device learners
(ONNX Runtime's ``OrtOnlineLearner``, ExecuTorch's ``EtOnlineLearner``) all return it, so
code that reads stats runs unchanged on a device. This module imports no torch: the ONNX
Runtime learner runs where torch is not installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from taste_cl.report import format_fields

if TYPE_CHECKING:
    from taste_cl.tasks import Task

__all__ = ["ObserveStats", "Totals"]


@dataclass(frozen=True)
class ObserveStats:
    """What one ``observe`` call did.

    ``loss`` is the mean training loss over stream and replay samples; ``metrics`` are the
    task's prequential metrics on the stream samples, scored before training on them
    (``accuracy`` repeats the accuracy of class tasks; NaN for others).
    ``skipped`` is true when a non-finite loss or gradient was detected, or a step that
    made a parameter non-finite was rolled back, so an update was not applied. ``batch_size`` is the largest micro-batch trained (stream plus
    replay); ``micro_batches`` counts forward/backward passes, ``steps`` optimizer steps.
    With a batch plan, samples may wait for a full micro-batch: ``pending`` counts the
    stream samples waiting after this call, and when nothing was trained ``loss`` and
    ``accuracy`` are None and ``micro_batches`` is 0.

    The device learners fill the same fields: ``accuracy`` from the first training pass's
    outputs on the stream samples (NaN for other than class labels), ``metrics`` empty and
    ``pending`` 0 (they train every batch at once).
    """

    loss: float | None
    accuracy: float | None
    samples: int
    replay_samples: int
    batch_size: int
    steps: int
    step_time_s: float
    skipped: bool = False
    micro_batches: int = 1
    metrics: dict[str, float] = field(default_factory=dict)
    pending: int = 0

    def __str__(self) -> str:
        """One rounded line for ``print(stats)``."""
        fields: dict[str, float | int | None] = {
            "loss": self.loss,
            **(self.metrics or {"accuracy": self.accuracy}),
            "samples": self.samples,
            "replayed": self.replay_samples,
            "batch": self.batch_size,
            "steps": self.steps,
            "step ms": self.step_time_s * 1000,
        }
        waiting = f"  pending {self.pending}" if self.pending else ""
        return "observe: " + format_fields(fields) + waiting + ("  skipped (update not applied)" if self.skipped else "")


@dataclass
class Totals:
    """Running sums over the micro-batches of one ``observe`` call, turned into its :class:`ObserveStats`."""

    losses: list[float] = field(default_factory=list)
    batch_size: int = 0
    replay_samples: int = 0
    micro_batches: int = 0
    steps: int = 0
    skipped: bool = False
    scores: list[float] = field(default_factory=list)  # the task's summed batch statistics

    def add_micro(self, loss: float, size: int, n_replay: int) -> None:
        self.losses.append(loss)
        self.batch_size = max(self.batch_size, size)
        self.replay_samples += n_replay
        self.micro_batches += 1

    def add_step(self, applied: bool | None) -> None:
        self.steps += bool(applied)
        self.skipped |= applied is False

    def add_scored(self, stats: tuple[float, ...]) -> None:
        self.scores = [a + b for a, b in zip(self.scores, stats)] if self.scores else list(stats)

    def stats(self, task: Task | None, *, samples: int, step_time_s: float, pending: int) -> ObserveStats:
        """The call's stats: ``samples`` stream samples observed, ``pending`` of them still waiting."""
        metrics = task.metrics(self.scores) if self.scores and task is not None else {}
        return ObserveStats(
            loss=sum(self.losses) / len(self.losses) if self.losses else None,
            accuracy=metrics.get("accuracy", math.nan) if self.scores else None,
            samples=samples,
            replay_samples=self.replay_samples,
            batch_size=self.batch_size,
            steps=self.steps,
            step_time_s=step_time_s,
            skipped=self.skipped,
            micro_batches=self.micro_batches,
            metrics=metrics,
            pending=pending,
        )
