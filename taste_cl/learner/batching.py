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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from taste_cl._batch import Inputs, Spec, cat_batches, index_batch, leaves, unflatten
from taste_cl._checks import check_int
from taste_cl.state.restore import check_int as state_int
from taste_cl.state.restore import check_keys, check_number

__all__ = [
    "BatchPlan",
    "BatcherState",
    "Chunk",
    "MicroBatcher",
    "Replayed",
    "plan_from",
    "replay_slice",
    "replaying_micro_batch",
    "rescale_lr",
    "total_norm",
]

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


_PLAN_KEYS = {"micro_batch_size", "accumulation_steps", "lr_scale", "max_wait_samples", "max_wait_s"}
TRAINING_KEYS = {"batch_plan", "stream_batch_size", "pending", "accumulated", "window_finite"}
"""The checkpoint's ``training`` entries a :class:`MicroBatcher` owns."""

Samples = tuple[Inputs, torch.Tensor]


@dataclass(frozen=True)
class BatcherState:
    """A checked :meth:`MicroBatcher.state_dict`, ready for :meth:`MicroBatcher.load_state`."""

    plan: BatchPlan | None
    stream_batch_size: int | None
    pending: Samples | None
    accumulated: int
    window_finite: bool


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

    @staticmethod
    def parse_state(state: dict[str, Any], spec: Spec | None, check_samples: Callable[[str, Inputs, Any], None]) -> BatcherState:
        """Check the ``training`` entries of :meth:`state_dict` (``state`` may hold others); changes nothing.

        ``spec`` is the input structure the pending samples must have, ``check_samples(where, x, y)``
        checks them as a stream batch is checked. Raises ``ValueError`` naming the entry."""
        plan = state["batch_plan"]
        if plan is not None:
            if not isinstance(plan, dict):
                raise ValueError("`training.batch_plan` must be a dict or None")
            check_keys("training.batch_plan", plan, _PLAN_KEYS)
            where = "training.batch_plan."
            plan = BatchPlan(
                micro_batch_size=state_int(where + "micro_batch_size", plan["micro_batch_size"], 1, 2**31),
                accumulation_steps=state_int(where + "accumulation_steps", plan["accumulation_steps"], 1, 2**20),
                lr_scale=check_number(where + "lr_scale", plan["lr_scale"], positive=True),
                max_wait_samples=None
                if plan["max_wait_samples"] is None
                else state_int(where + "max_wait_samples", plan["max_wait_samples"], 1, 2**31),
                max_wait_s=None if plan["max_wait_s"] is None else check_number(where + "max_wait_s", plan["max_wait_s"], positive=True),
            )
        stream = state["stream_batch_size"]
        if stream is not None:
            state_int("training.stream_batch_size", stream, 1, 2**31)
        pending = state["pending"]
        if pending is not None:
            if not isinstance(pending, list) or plan is None or spec is None or len(pending) != spec.leaf_count + 1:
                raise ValueError("`training.pending` must be None or [*input leaves, targets], and only with a batch plan")
            try:
                pending = (unflatten(spec, pending[:-1]), pending[-1])
            except (ValueError, TypeError) as error:
                raise ValueError(f"`training.pending`: {error}") from error
            if not isinstance(pending[1], torch.Tensor) or pending[1].dim() == 0 or pending[1].shape[0] == 0:
                raise ValueError("`training.pending` must hold at least one sample")
            check_samples("training.pending", *pending)
        steps = 1 if plan is None else plan.accumulation_steps
        accumulated = state_int("training.accumulated", state["accumulated"], 0, steps - 1)
        if not isinstance(state["window_finite"], bool):
            raise ValueError("`training.window_finite` must be a bool")  # noqa: TRY004 (a bad state is a ValueError)
        return BatcherState(plan, stream, pending, accumulated, state["window_finite"])

    def load_state(self, state: BatcherState, place: Callable[[Samples], Samples]) -> None:
        """Take a state :meth:`parse_state` checked (``place`` moves its pending samples to the model); cannot fail.

        Arrival times do not survive a process: pending samples count as arrived now."""
        self.plan = state.plan
        self.stream_batch_size = state.stream_batch_size
        self.pending = None if state.pending is None else place(state.pending)
        self.arrivals.clear()
        self.window_stream = 0
        if state.plan is not None and state.pending is not None:
            self.arrivals.append([time.monotonic(), state.pending[1].shape[0]])
        self.accumulated, self.window_finite = state.accumulated, state.window_finite


_FEW_TENSORS = 16  # gradient tensors up to which total_norm reads each norm


Replayed = tuple[Inputs, torch.Tensor, dict[str, torch.Tensor]]  # replayed inputs, targets and stored fields


def replay_slice(drawn: Replayed, start: int, n: int) -> Replayed | None:
    """Rows ``start:start + n`` of replayed samples; None for none."""
    if not n:
        return None
    x, y, fields = drawn
    rows = slice(start, start + n)
    return index_batch(x, rows), y[rows], {name: value[rows] for name, value in fields.items()}


def total_norm(tensors: list[torch.Tensor]) -> float:
    """L2 norm of all ``tensors`` together (NaN or inf if any entry is)."""
    if not tensors:
        return 0.0
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        # The fused kernel torch's own get_total_norm ends in, without its per-call
        # regrouping by device and dtype (half the cost of a small model's step). For a
        # few tensors, reading each norm costs less than stacking them for one more
        # reduction (math.hypot gives inf for an inf entry and NaN for a NaN one).
        norms = torch._foreach_norm(tensors)
        if len(norms) <= _FEW_TENSORS:
            return math.hypot(*[norm.item() for norm in norms])
        return float(torch.linalg.vector_norm(torch.stack(norms)))
    return float(torch.nn.utils.get_total_norm(tensors))
