"""The learner's batch plan: which stream samples go into which micro-batch, and when a step is due.

A :class:`BatchPlan` (set by the batch-size tuner through ``OnlineLearner.set_batch_plan``)
says how stream samples become optimizer steps. :class:`MicroBatcher` carries it out: it
keeps the stream samples waiting for a full micro-batch and their arrival times (the
freshness bound), splits each batch into micro-batches with the learner's stream:replay
ratio, weights their losses, and counts the gradient-accumulation window in progress. The
learner runs the forward/backward passes and optimizer steps it plans.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import torch

from taste_cl._batch import Inputs, cat_batches, index_batch, leaves
from taste_cl._checks import check_int

__all__ = ["BatchPlan", "Chunk", "MicroBatcher", "OnBatcher", "plan_from", "replaying_micro_batch", "rescale_lr"]

T = TypeVar("T")
Chunk = tuple[Inputs, torch.Tensor, int]  # stream inputs, targets, replayed samples to add


@dataclass(frozen=True)
class BatchPlan:
    """How stream samples become optimizer steps (set by the batch-size tuner).

    ``lr_scale`` is the factor the learning rates carry relative to the optimizer's own
    configuration. ``max_wait_samples`` / ``max_wait_s`` bound how long stream samples
    may wait for an optimizer step (None: no bound of that kind).
    """

    micro_batch_size: int
    accumulation_steps: int = 1
    lr_scale: float = 1.0
    max_wait_samples: int | None = None
    max_wait_s: float | None = None


def plan_from(
    micro_batch_size: int | None,
    accumulation_steps: int,
    lr_scale: float,
    max_wait_samples: int | None,
    max_wait_s: float | None,
) -> BatchPlan | None:
    """The checked plan of ``OnlineLearner.set_batch_plan``'s arguments (None for ``micro_batch_size=None``).

    Raises ``ValueError`` naming the first bad argument.
    """
    for label, value in (("micro_batch_size", micro_batch_size), ("max_wait_samples", max_wait_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{label} == {value!r}`, must be an int >= 1 or None")
    check_int("accumulation_steps", accumulation_steps, 1)
    if not isinstance(lr_scale, (int, float)) or not math.isfinite(lr_scale) or lr_scale <= 0:
        raise ValueError(f"`lr_scale == {lr_scale!r}`, must be a finite number > 0")
    if max_wait_s is not None and (not isinstance(max_wait_s, (int, float)) or not math.isfinite(max_wait_s) or max_wait_s <= 0):
        raise ValueError(f"`max_wait_s == {max_wait_s!r}`, must be a finite number > 0 or None")
    if micro_batch_size is None:
        return None
    return BatchPlan(micro_batch_size, accumulation_steps, float(lr_scale), max_wait_samples, max_wait_s)


def rescale_lr(optimizer: torch.optim.Optimizer, old: BatchPlan | None, new: BatchPlan | None) -> None:
    """Move the live learning rates from ``old``'s ``lr_scale`` to ``new``'s (no plan: factor 1).

    Multiplies by the ratio, so whatever a scheduler set since is kept.
    """
    factor = (1.0 if new is None else new.lr_scale) / (1.0 if old is None else old.lr_scale)
    if factor != 1.0:
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].mul_(factor)
            else:
                group["lr"] = group["lr"] * factor


def replay_part(micro_batch_size: int, share: float) -> int:
    """Replayed samples in a micro-batch of ``micro_batch_size`` at replay ``share`` (at least one stream sample)."""
    return min(round(micro_batch_size * share), micro_batch_size - 1)


def replaying_micro_batch(stream_batch_size: int, replay_batch_size: int) -> int:
    """The smallest micro-batch that holds a replayed sample at the learner's stream:replay ratio
    (1 without replay): a smaller one would train on the stream alone and forget."""
    if replay_batch_size <= 0:
        return 1
    share = replay_batch_size / (stream_batch_size + replay_batch_size)
    micro = 2
    while replay_part(micro, share) < 1:
        micro += 1
    return micro


class MicroBatcher:
    """Plans a learner's micro-batches under its :class:`BatchPlan` and counts its accumulation window.

    ``stream_batch_size`` is the first stream batch's size: the plan keeps the learner's
    ratio of stream to replayed samples (``replay_batch_size`` per stream batch) inside
    each micro-batch. ``pending`` holds the stream samples waiting for a full micro-batch
    (the learner's own copies), ``arrivals`` the ``[monotonic time, count]`` of stream
    samples not yet stepped on. ``accumulated`` counts the micro-batches whose gradients
    wait for the optimizer step, ``window_finite`` whether all their losses were finite,
    ``window_stream`` their stream samples.
    """

    def __init__(self) -> None:
        self.plan: BatchPlan | None = None
        self.stream_batch_size: int | None = None
        self.pending: tuple[Inputs, torch.Tensor] | None = None
        self.arrivals: deque[list[float]] = deque()
        self.window_stream = 0
        self.accumulated = 0
        self.window_finite = True

    def set_plan(self, plan: BatchPlan | None) -> None:
        """Follow ``plan`` from now on (the window in progress must have been applied)."""
        if plan is None:
            self.arrivals.clear()
        self.plan = plan

    def arrive(self, n: int) -> None:
        """Note ``n`` stream samples arriving now (their wait counts under a plan)."""
        if self.plan is not None:
            self.arrivals.append([time.monotonic(), n])

    def chunks(self, x: Inputs, y: torch.Tensor, replay_batch_size: int, stored: int) -> list[Chunk]:
        """Split the stream into training chunks: the batch itself, or micro-batches of the plan.

        ``stored`` is the replay buffer's size now. Under a plan whose window spans observes,
        the stream samples that do not fill a micro-batch wait in :attr:`pending`; under a
        per-observe plan (:meth:`per_observe`) they train now as one smaller micro-batch, so an
        observe's samples are stepped on in that observe, and its micro-batches replay as many
        rows in all as the learner's own step (the plan's share each while the buffer's rows
        last, the rest with the last one), short batches (a task's last) included.
        """
        if self.plan is None:
            if self.pending is not None:  # left by a plan that was removed
                (x, y), self.pending = (cat_batches([self.pending[0], x]), torch.cat([self.pending[1], y])), None
            return [(x, y, min(replay_batch_size, stored))]
        stream_part = self.micro_split(replay_batch_size)[0]
        pending_x = x if self.pending is None else cat_batches([self.pending[0], x])
        pending_y = y if self.pending is None else torch.cat([self.pending[1], y])
        total = pending_y.shape[0]
        per_observe = self.per_observe(replay_batch_size)
        full = total if per_observe else total // stream_part * stream_part
        # Views are safe: both are the learner's own copies, never the caller's memory.
        self.pending = None if full == total else (index_batch(pending_x, slice(full, None)), pending_y[full:])
        budget = min(replay_batch_size, stored)  # a per-observe plan replays what the learner's own step does
        chunks = []
        for i in range(0, full, stream_part):
            replayed = self._replayed(min(stream_part, full - i), replay_batch_size, stored)
            if per_observe:  # the plan's share while it lasts, the rest with the last micro-batch
                replayed = budget if i + stream_part >= full else min(replayed, budget)
                budget -= replayed
            chunks.append((index_batch(pending_x, slice(i, i + stream_part)), pending_y[i : i + stream_part], replayed))
        return chunks

    def _replayed(self, n: int, replay_batch_size: int, stored: int) -> int:
        """Replayed rows beside ``n`` stream samples: the plan's share (a full micro-batch's own)."""
        stream_part, replay_part = self.micro_split(replay_batch_size)
        return min(round(n * replay_part / stream_part), stored)

    def micro_split(self, replay_batch_size: int) -> tuple[int, int]:
        """Stream and replay samples of a full micro-batch of the plan: the learner's stream:replay
        ratio, also while the buffer holds fewer rows (its micro-batches then replay what it has),
        so an observe's stream splits the same way from the first batch on."""
        assert self.plan is not None and self.stream_batch_size is not None
        micro = self.plan.micro_batch_size
        share = replay_batch_size / (self.stream_batch_size + replay_batch_size)
        replayed = replay_part(micro, share)
        return micro - replayed, replayed

    def per_observe(self, replay_batch_size: int) -> bool:
        """Whether a full window is one stream batch plus its replay (the tuner's plan for the
        learner's own step), rather than spanning observes (a larger effective batch): at most
        that many rows, or that many rounded up to whole micro-batches (``split_plan`` rounds the
        micro-batch up: 20 rows as 3 x 7)."""
        assert self.plan is not None and self.stream_batch_size is not None
        plan = self.plan
        return plan.micro_batch_size * plan.accumulation_steps < self.stream_batch_size + replay_batch_size + plan.accumulation_steps

    def observe_windows(self, count: int) -> list[int]:
        """Micro-batches per window of one pass over an observe's ``count`` micro-batches under a
        per-observe plan: ``round(count / accumulation_steps)`` windows (at least one), as even as
        they can be. A plan that does not tile the stream batch (a rounded replay share, a
        micro-batch rounded up) thus takes the learner's own steps, not one more, smaller one."""
        assert self.plan is not None
        windows = max(1, round(count / self.plan.accumulation_steps))
        return [count // windows + (i < count % windows) for i in range(windows)]

    def waited_too_long(self) -> bool:
        """Whether the plan's freshness bound asks for a step now."""
        plan = self.plan
        if plan is None or not self.arrivals:
            return False
        waiting = sum(int(count) for _, count in self.arrivals)
        if plan.max_wait_samples is not None and waiting >= plan.max_wait_samples:
            return True
        return plan.max_wait_s is not None and time.monotonic() - self.arrivals[0][0] >= plan.max_wait_s

    def take_pending(self, replay_batch_size: int, stored: int) -> Chunk | None:
        """The waiting stream samples as one smaller chunk (replay in the plan's proportion), or None."""
        if self.pending is None:
            return None
        (x, y), self.pending = self.pending, None
        return x, y, self._replayed(y.shape[0], replay_batch_size, stored)

    def pending_count(self) -> int:
        return 0 if self.pending is None else self.pending[1].shape[0]

    def weights(self, sizes: list[tuple[int, int]], replay_batch_size: int) -> list[float]:
        """The loss weights of chunks of ``(stream, replayed)`` samples: each one's share of its window's.

        Under a per-observe plan an observe's chunks form whole windows (:meth:`observe_windows`),
        each the mean over its rows, stream and replayed (as the learner's own step, short
        batches included). Otherwise each chunk's stream samples are weighted against a
        full window's, so a forced smaller step (freshness bound) is proportionally smaller.
        Only called under a plan (the weight is 1 without).
        """
        assert self.plan is not None
        if not self.per_observe(replay_batch_size):
            full = self.micro_split(replay_batch_size)[0] * self.plan.accumulation_steps
            return [n / full for n, _ in sizes]
        rows = [n + r for n, r in sizes]
        weights: list[float] = []
        for size in self.observe_windows(len(rows)):
            window, rows = rows[:size], rows[size:]
            weights.extend(n / sum(window) for n in window)
        return weights

    def enter(self, n: int) -> None:
        """Count ``n`` stream samples into the window (their arrivals leave with its step)."""
        self.window_stream += n

    def add_micro(self, finite: bool) -> None:
        """Count one micro-batch's gradient into the window (``finite``: its loss was)."""
        self.window_finite &= finite
        self.accumulated += 1

    def window_full(self) -> bool:
        return self.accumulated == (1 if self.plan is None else self.plan.accumulation_steps)

    def release_arrivals(self) -> None:
        """Forget the arrival times of the stream samples the window now being stepped on trained on."""
        count, self.window_stream = self.window_stream, 0
        while count > 0 and self.arrivals:
            taken = min(count, int(self.arrivals[0][1]))
            self.arrivals[0][1] -= taken
            count -= taken
            if self.arrivals[0][1] <= 0:
                self.arrivals.popleft()

    def reset_window(self) -> None:
        """Start a new accumulation window (the last one was applied or dropped)."""
        self.accumulated, self.window_finite = 0, True

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``training`` entries this object owns (arrival times do not survive a process)."""
        return {
            "batch_plan": None if self.plan is None else vars(self.plan).copy(),
            "stream_batch_size": self.stream_batch_size,
            "pending": None if self.pending is None else [*leaves(self.pending[0]), self.pending[1]],
            "accumulated": self.accumulated,
            "window_finite": self.window_finite,
        }


class OnBatcher(Generic[T]):
    """A learner attribute that lives on its :class:`MicroBatcher` (``learner._batcher``).

    :mod:`taste_cl.state.restore` and the probe guard's rollback set the learner's
    ``_pending``, ``_accumulated``, ... by these names; the learner itself reads its
    batcher directly.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, learner: None, owner: type) -> OnBatcher[T]: ...
    @overload
    def __get__(self, learner: object, owner: type | None = None) -> T: ...
    def __get__(self, learner: Any, owner: type | None = None) -> OnBatcher[T] | T:
        return self if learner is None else getattr(learner._batcher, self.name)

    def __set__(self, learner: Any, value: T) -> None:
        setattr(learner._batcher, self.name, value)
