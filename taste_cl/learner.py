"""OnlineLearner: keep a PyTorch model learning from a stream without forgetting.

>>> import torch
>>> from torch import nn
>>> from taste_cl import OnlineLearner, ReservoirReplay
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
>>> learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
...                         replay=ReservoirReplay(capacity=50), replay_batch_size=5)
>>> stats = learner.observe((torch.randn(8, 4), torch.randint(0, 3, (8,))))
>>> stats.samples, stats.replay_samples, stats.batch_size
(8, 0, 8)
>>> stats = learner.observe((torch.randn(8, 4), torch.randint(0, 3, (8,))))
>>> stats.replay_samples, tuple(learner.predict(torch.randn(2, 4)).shape)
(5, (2, 3))
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl._batch import (
    BatchLike,
    Inputs,
    Spec,
    as_tensor,
    batch_len,
    call_model,
    cat_batches,
    index_batch,
    leaves,
    map_leaves,
    split_batch,
    to_inputs,
    to_like,
)
from taste_cl._checks import check_int
from taste_cl._report import format_fields
from taste_cl.exceptions import CheckpointError, InvalidBatchError
from taste_cl.guards.update import UpdateGuard
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy
from taste_cl.state.checkpoint import CheckpointLimits, read_checkpoint, write_checkpoint
from taste_cl.state.restore import (
    CHECKPOINT_FORMAT,
    MONITOR_CONFIG,
    build_parts,
    restore_state,
    validate_state,
)
from taste_cl.strategies import Strategy, resolve_strategy
from taste_cl.tasks import Classification, Task, infer_task, resolve_task

__all__ = ["BatchPlan", "ObserveStats", "OnlineLearner"]

_FEW_TENSORS = 16  # gradient tensors up to which _total_norm reads each norm


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


@dataclass
class _Totals:
    """Running sums over the micro-batches of one ``observe`` call."""

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

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def metrics(self, task: Task | None) -> dict[str, float]:
        return task.metrics(self.scores) if self.scores and task is not None else {}


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


class OnlineLearner:
    """Wrap a model so it keeps adapting to a stream of labelled batches.

    Inputs ``x`` are a tensor or a dict / tuple / list of tensors, passed as ``model(x)``,
    ``model(**x)`` or ``model(*x)``; floating leaves follow the model's dtype and device,
    integer and bool leaves keep their dtype. Targets follow the ``task``: class labels,
    0/1 multi-label targets, real values or per-token tags (see :mod:`taste_cl.tasks`).

    Each :meth:`observe` scores the incoming batch (test-then-train), trains one step on
    it mixed with ``replay_batch_size`` samples from the replay buffer, and offers the
    batch to the buffer. Calls are serialised by a lock: ``observe``, ``predict`` and
    ``save`` may be called from several threads.

    Parameters
    ----------
    model:
        A module mapping inputs to one output tensor ``(n, ...)``: ``(n, num_classes)``
        logits for classification.
    loss_fn:
        Training loss taking ``(outputs, targets)`` and returning a scalar; default cross-entropy.
    optimizer:
        Optimizer over ``model``'s parameters; default SGD with lr 0.01. It must hold every
        trainable parameter of the model (``ValueError`` naming those it misses).
    task:
        A :class:`~taste_cl.tasks.Task` or its name; default inferred from ``loss_fn``
        (:func:`~taste_cl.tasks.infer_task`): cross-entropy/NLL -> classification (token
        classification for ``(n, C, t)`` outputs), MSE/L1/SmoothL1/Huber -> regression,
        BCE -> multi-label. For another loss, integer targets mean classification and
        float targets need ``task=``.
    replay:
        A :class:`~taste_cl.replay.ReplayStrategy`, or None to train on the stream only.
    replay_batch_size:
        Replayed samples added to every training step.
    train_iterations:
        Optimizer steps per stream batch, each with a fresh replay sample (repeated
        rehearsal; 2-3 help a lot when the stream is short).
    num_classes, input_shape:
        Inferred from the first batch and the model's output when not given
        (``input_shape`` is for a single-tensor ``x``; a structured ``x`` is described by ``input_spec``).
    monitor:
        The :class:`~taste_cl.monitor.monitor.StabilityPlasticityMonitor`; a default one if None.
    plugins:
        :class:`~taste_cl.plugins.LearnerPlugin` instances (batch-size tuner, elastic training).
    strategy:
        How a micro-batch's loss is formed from its stream and replay parts: a
        :class:`~taste_cl.strategies.Strategy` or ``"er"`` (default), ``"er_ace"``,
        ``"der++"``, ``"lwf"`` (see :mod:`taste_cl.strategies`).
    guard_updates:
        An :class:`~taste_cl.guards.update.UpdateGuard`, or its mode: ``"auto"`` (default)
        skips steps with a non-finite loss or gradient or a NaN/negative/absurd learning
        rate, and copy-protects a step whose size bound (largest learning rate times
        ``max(1, gradient norm)``) exceeds 1e4, undoing it if a parameter becomes
        non-finite; ordinary steps pay nothing. ``"always"`` copy-protects every step,
        ``"never"`` none. Pass ``UpdateGuard(rollback=True, ...)`` to roll back to the
        last good snapshot when updates get stuck.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        replay: ReplayStrategy | None = None,
        replay_batch_size: int = 10,
        train_iterations: int = 1,
        num_classes: int | None = None,
        input_shape: Sequence[int] | None = None,
        monitor: StabilityPlasticityMonitor | None = None,
        plugins: Sequence[LearnerPlugin] = (),
        guard_updates: str | UpdateGuard = "auto",
        task: Task | str | None = None,
        strategy: Strategy | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if replay is not None and not isinstance(replay, ReplayStrategy):
            raise TypeError(f"replay must be a taste_cl.ReplayStrategy or None; got {type(replay).__name__}")
        check_int("replay_batch_size", replay_batch_size, 0)
        check_int("train_iterations", train_iterations, 1)
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"`num_classes == {num_classes}`, must be >= 1")
        names = [plugin.name for plugin in plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"plugin names must be unique (they key checkpoint state); got {names}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.01)
        _check_optimizer_covers(model, self.optimizer)
        self.task: Task | None = resolve_task(task) if task is not None else infer_task(self.loss_fn)
        _check_replay_fits(replay, self.task)
        self.strategy = resolve_strategy(strategy)
        self.strategy.check(self.task, replay)
        self.replay = replay
        self.replay_batch_size = replay_batch_size
        self.train_iterations = train_iterations
        self.num_classes = num_classes
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self.input_spec: Spec | None = None if self.input_shape is None else Spec("tensor", "float", "", self.input_shape)
        self.output_shape: tuple[int, ...] | None = None
        self._task_given = task is not None
        self._score_eval = False  # prequential score from an eval-mode forward (decided on the first batch)
        self.monitor = monitor if monitor is not None else StabilityPlasticityMonitor()
        self.plugins = list(plugins)
        self.guard = guard_updates if isinstance(guard_updates, UpdateGuard) else UpdateGuard(guard_updates)
        self.samples_seen = 0
        self.steps = 0
        self.batch_plan: BatchPlan | None = None
        self._stream_batch_size: int | None = None
        self._pending: tuple[Inputs, torch.Tensor] | None = None
        self._arrivals: deque[list[float]] = deque()  # [monotonic time, count] of stream samples not yet stepped on
        self._window_stream = 0  # stream samples in the accumulation window in progress
        self._accumulated = 0
        self._window_finite = True
        self._lock = threading.RLock()
        self.strategy.attach(self)
        for plugin in self.plugins:
            plugin.on_attach(self)

    # ------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self._placement()[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._placement()[1]

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """Device and dtype of the parameters the optimizer trains (where inputs must go).

        Read from the optimizer: walking ``model.parameters()`` costs more than a small
        model's forward pass of one layer.
        """
        first = self.optimizer.param_groups[0]["params"][0]
        return first.device, first.dtype

    # -------------------------------------------------------------- learning
    def set_batch_plan(
        self,
        micro_batch_size: int | None,
        *,
        accumulation_steps: int = 1,
        lr_scale: float = 1.0,
        max_wait_samples: int | None = None,
        max_wait_s: float | None = None,
    ) -> None:
        """Train in micro-batches of ``micro_batch_size`` samples (stream plus replay share),
        ``accumulation_steps`` micro-batches per optimizer step.

        ``lr_scale`` is the plan's learning-rate factor relative to the optimizer's own
        configuration: the *live* learning rates (whatever a scheduler has set) are
        multiplied by ``lr_scale / previous lr_scale``, so scheduler decay is kept and
        ``None`` (back to one step per ``observe``) divides the previous factor out.
        Stream samples are buffered until a micro-batch is full; ``max_wait_samples``
        (waiting stream samples) and ``max_wait_s`` (age of the oldest) force a step on
        what is there, weighted by its share of stream samples. An accumulation window in
        progress is applied first. The batch-size tuner calls this.
        """
        with self._lock:
            for label, value in (("micro_batch_size", micro_batch_size), ("max_wait_samples", max_wait_samples)):
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"`{label} == {value!r}`, must be an int >= 1 or None")
            check_int("accumulation_steps", accumulation_steps, 1)
            if not isinstance(lr_scale, (int, float)) or not math.isfinite(lr_scale) or lr_scale <= 0:
                raise ValueError(f"`lr_scale == {lr_scale!r}`, must be a finite number > 0")
            if max_wait_s is not None and (not isinstance(max_wait_s, (int, float)) or not math.isfinite(max_wait_s) or max_wait_s <= 0):
                raise ValueError(f"`max_wait_s == {max_wait_s!r}`, must be a finite number > 0 or None")
            self._apply_accumulated()
            plan = None
            if micro_batch_size is not None:
                plan = BatchPlan(micro_batch_size, accumulation_steps, float(lr_scale), max_wait_samples, max_wait_s)
            factor = (1.0 if plan is None else plan.lr_scale) / (1.0 if self.batch_plan is None else self.batch_plan.lr_scale)
            if factor != 1.0:
                for group in self.optimizer.param_groups:
                    if isinstance(group["lr"], torch.Tensor):
                        group["lr"].mul_(factor)
                    else:
                        group["lr"] = group["lr"] * factor
            if plan is None:
                self._arrivals.clear()
            self.batch_plan = plan

    def observe(self, batch: BatchLike) -> ObserveStats:
        """Test-then-train on one stream batch ``(x, y)`` or ``{"x": x, "y": y}``.

        ``x`` is a tensor or array, or a dict / tuple / list of them (see the class doc).

        Raises :class:`~taste_cl.exceptions.InvalidBatchError` (a ``ValueError``) on a
        malformed batch, before anything is changed.
        """
        with self._lock:
            x, y = self._validate(batch)
            n = y.shape[0]
            if self._stream_batch_size is None:
                self._stream_batch_size = n
                for plugin in self.plugins:
                    plugin.on_first_batch(self, x, y=y)
            start = time.perf_counter()
            totals = _Totals()
            if self.batch_plan is not None:
                self._arrivals.append([time.monotonic(), n])
            for chunk_x, chunk_y, n_replay in self._chunks(x, y):
                self._learn_chunk(chunk_x, chunk_y, n_replay, totals)
            if self._waited_too_long():
                self._flush(totals)
            elapsed = time.perf_counter() - start
            self.samples_seen += n
            self.steps += 1
            metrics = totals.metrics(self.task)
            stats = ObserveStats(
                loss=totals.mean_loss,
                accuracy=metrics.get("accuracy", math.nan) if totals.scores else None,
                samples=n,
                replay_samples=totals.replay_samples,
                batch_size=totals.batch_size,
                steps=totals.steps,
                step_time_s=elapsed,
                skipped=totals.skipped,
                micro_batches=totals.micro_batches,
                metrics=metrics,
                pending=0 if self._pending is None else self._pending[1].shape[0],
            )
            for plugin in self.plugins:
                plugin.after_observe(self, stats, batch=(x, y))
            self.monitor.dispatch()
            return stats

    def _chunks(self, x: Inputs, y: torch.Tensor) -> list[tuple[Inputs, torch.Tensor, int]]:
        """Split the stream into training chunks: the batch itself, or full micro-batches of the plan."""
        stored = len(self.replay) if self.replay is not None else 0
        if self.batch_plan is None:
            if self._pending is not None:  # left by a plan that was removed
                (x, y), self._pending = (cat_batches([self._pending[0], x]), torch.cat([self._pending[1], y])), None
            return [(x, y, min(self.replay_batch_size, stored))]
        stream_part, replay_part = self._micro_split()
        pending_x = x if self._pending is None else cat_batches([self._pending[0], x])
        pending_y = y if self._pending is None else torch.cat([self._pending[1], y])
        total = pending_y.shape[0]
        full = total // stream_part * stream_part
        # Views are safe: both are the learner's own copies, never the caller's memory.
        self._pending = None if full == total else (index_batch(pending_x, slice(full, None)), pending_y[full:])
        return [
            (index_batch(pending_x, slice(i, i + stream_part)), pending_y[i : i + stream_part], min(replay_part, stored))
            for i in range(0, full, stream_part)
        ]

    def _micro_split(self) -> tuple[int, int]:
        """Stream and replay samples of a full micro-batch of the plan (the learner's stream:replay ratio)."""
        assert self.batch_plan is not None and self._stream_batch_size is not None
        micro = self.batch_plan.micro_batch_size
        share = self.replay_batch_size / (self._stream_batch_size + self.replay_batch_size) if self.replay else 0.0
        replay_part = min(round(micro * share), micro - 1)
        return micro - replay_part, replay_part

    def _waited_too_long(self) -> bool:
        """Whether the plan's freshness bound asks for a step now."""
        plan = self.batch_plan
        if plan is None or not self._arrivals:
            return False
        waiting = sum(int(count) for _, count in self._arrivals)
        if plan.max_wait_samples is not None and waiting >= plan.max_wait_samples:
            return True
        return plan.max_wait_s is not None and time.monotonic() - self._arrivals[0][0] >= plan.max_wait_s

    def _flush(self, totals: _Totals) -> None:
        """Train the pending stream samples as one smaller micro-batch and apply the window."""
        if self._pending is not None:
            (x, y), self._pending = self._pending, None
            stream_part, replay_part = self._micro_split()
            stored = len(self.replay) if self.replay is not None else 0
            self._learn_chunk(x, y, min(round(y.shape[0] * replay_part / stream_part), stored), totals)
        totals.add_step(self._apply_accumulated())

    def _consume_arrivals(self, count: int) -> None:
        """Forget the arrival times of ``count`` stream samples an applied step has trained on."""
        while count > 0 and self._arrivals:
            taken = min(count, int(self._arrivals[0][1]))
            self._arrivals[0][1] -= taken
            count -= taken
            if self._arrivals[0][1] <= 0:
                self._arrivals.popleft()

    def _learn_chunk(self, x: Inputs, y: torch.Tensor, n_replay: int, totals: _Totals) -> None:
        """Score ``x`` (test), train ``train_iterations`` micro-batches on it with replay, then store it.

        The score comes from an eval-mode forward (what :meth:`predict` returns) when the
        model's output depends on the train/eval mode, else from the first training forward.
        A chunk whose loss overflowed is scored but never stored: it would poison later steps.
        With a plan, each micro-batch's loss is weighted by its stream samples over those
        of a full accumulation window: a full window is the mean, a forced smaller step
        (freshness bound) is proportionally smaller.
        """
        n = y.shape[0]
        weight = 1.0
        if self.batch_plan is not None:
            weight = n / (self._micro_split()[0] * self.batch_plan.accumulation_steps)
            self._window_stream += n
        finite = True
        stream_outputs = self._logits(x) if self._score_eval else None
        for _ in range(self.train_iterations):
            train_x, train_y, fields = self._with_replay(x, y, n_replay)
            outputs, loss = self._micro_step(train_x, train_y, n, fields, weight)
            outputs = outputs[:n]  # the stream rows
            finite &= math.isfinite(loss)
            if stream_outputs is None:
                stream_outputs = outputs  # scored before any update on this chunk
            totals.add_micro(loss, train_y.shape[0], n_replay)
            if self._accumulated == self._accumulation_steps:
                totals.add_step(self._apply_accumulated())
        assert stream_outputs is not None
        totals.add_scored(self.monitor.record(x, y, stream_outputs, validated=True, store=finite))
        if self.replay is not None and finite:
            self.replay.add_validated(x, y, **self.strategy.fields(x, y, outputs))
        if self.monitor.due():
            self.monitor.evaluate(lambda probe_x: self._logits(self._place(probe_x)))
        self.strategy.after_chunk(self)

    @property
    def _accumulation_steps(self) -> int:
        return 1 if self.batch_plan is None else self.batch_plan.accumulation_steps

    def _with_replay(self, x: Inputs, y: torch.Tensor, n_replay: int) -> tuple[Inputs, torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch ``[stream | replayed]`` and the replayed samples' stored fields (those the strategy uses)."""
        if not n_replay:
            return x, y, {}
        assert self.replay is not None
        fields: dict[str, torch.Tensor] = {}
        if self.strategy.stored_fields:
            replay_x, replay_y, fields = self.replay.sample(n_replay, with_fields=True)  # type: ignore[call-arg, misc]
        else:
            replay_x, replay_y = self.replay.sample(n_replay)
        replay_y = to_like(replay_y, y)
        if isinstance(x, torch.Tensor):  # the common case, without the pytree walk
            return torch.cat([x, to_like(replay_x, x)]), torch.cat([y, replay_y]), fields
        return cat_batches([x, self._place(replay_x)]), torch.cat([y, replay_y]), fields

    def _place(self, x: Inputs) -> Inputs:
        """Stored samples moved to the model: floating leaves to its dtype, all to its device."""
        device, dtype = self._placement()
        return map_leaves(lambda t: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device), x)

    def _micro_step(
        self,
        x: Inputs,
        y: torch.Tensor,
        n_stream: int | None = None,
        fields: dict[str, torch.Tensor] | None = None,
        weight: float = 1.0,
    ) -> tuple[torch.Tensor, float]:
        """Forward and backward one micro-batch (its first ``n_stream`` rows from the stream,
        default all), adding ``weight`` times its loss's gradient to the window; the strategy
        forms the loss."""
        if self._accumulated == 0:
            for plugin in self.plugins:
                plugin.before_step(self)
        if not self.model.training:  # train() walks every module: only when needed
            self.model.train()
        logits = call_model(self.model, x)
        n_stream = y.shape[0] if n_stream is None else n_stream
        loss = self.strategy.loss(self.loss_fn, logits, y, x=x, n_stream=n_stream, fields=fields or {})
        loss_value = loss.item()
        self.guard.record_loss(loss_value)
        if math.isfinite(loss_value):
            (loss if weight == 1.0 else loss * weight).backward()
        else:
            self._window_finite = False
        self._accumulated += 1
        return logits.detach(), loss_value

    def _apply_accumulated(self) -> bool | None:
        """Apply the accumulated gradient; return True if applied, False if skipped, None if nothing was pending.

        The :class:`~taste_cl.guards.update.UpdateGuard` decides: a non-finite loss or gradient or
        an unsafe hyperparameter skips the update, a step that leaves a parameter
        non-finite is undone; both emit ``numerical_fault``.
        """
        if self._accumulated == 0:
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        self._consume_arrivals(self._window_stream)
        self._window_stream = 0
        applied = self.guard.step(self, params, _total_norm(grads), self._window_finite)
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated, self._window_finite = 0, True
        return applied

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
        """One optimizer step on validated tensors, outside the stream bookkeeping.

        Returns (detached logits, loss, skipped). Any accumulation window in progress is
        applied first.
        """
        with self._lock:
            self._apply_accumulated()
            saved_plan, self.batch_plan = self.batch_plan, None
            try:
                logits, loss = self._micro_step(x, y)
                applied = self._apply_accumulated()
            finally:
                self.batch_plan = saved_plan
            return logits, loss, not applied

    def predict(self, x: Any) -> torch.Tensor:
        """Model outputs (logits for classification) for ``x`` in eval mode without gradients;
        changes no state. ``x`` is validated like :meth:`observe`'s."""
        with self._lock:
            device, dtype = self._placement()
            inputs, _ = to_inputs(x, spec=self.input_spec, dtype=dtype, device=device)
            return self._logits(inputs)

    def _logits(self, x: Inputs) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return call_model(self.model, x)
        finally:
            self.model.train(was_training)

    def _validate(self, batch: BatchLike) -> tuple[Inputs, torch.Tensor]:
        raw_x, raw_y = split_batch(batch)
        device, dtype = self._placement()
        x, spec = to_inputs(raw_x, spec=self.input_spec, dtype=dtype, device=device)
        if self.output_shape is None:
            return x, self._first_batch(x, spec, raw_y)
        assert self.task is not None
        return x, self.task.to_targets(raw_y, n=batch_len(x), output_shape=self.output_shape, dtype=dtype, device=device)

    def _first_batch(self, x: Inputs, spec: Spec, raw_y: Any) -> torch.Tensor:
        """On the first batch: check that the model takes ``x`` and returns one tensor, settle
        the task, validate the targets, check that the loss is a scalar, and decide how the
        prequential score is computed. Commits the learned shapes only if all of it passes."""
        device, dtype = self._placement()
        n = batch_len(x)
        try:
            out = self._logits(index_batch(x, slice(0, 1)))
        except Exception as error:
            raise InvalidBatchError(f"model cannot take x of {_shapes(x)}: {error}{_integer_hint(x)}") from error
        if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != 1:
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise InvalidBatchError(f"model must return one tensor of shape (batch, ...); got {got} for a batch of 1")
        output_shape = tuple(out.shape[1:])
        task = self.task if self._task_given else infer_task(self.loss_fn, output_shape)
        if task is None:
            task = _task_from_targets(raw_y, self.loss_fn)
        task.check_outputs(output_shape)
        num_classes = task.num_classes(output_shape)
        if self.num_classes is not None and num_classes != self.num_classes:
            raise ValueError(f"model outputs {num_classes} logits but num_classes={self.num_classes}")
        y = task.to_targets(raw_y, n=n, output_shape=output_shape, dtype=dtype, device=device)
        _check_replay_fits(self.replay, task)
        self.strategy.check(task, self.replay)
        _check_scalar_loss(self.loss_fn, out, y[:1])
        if task != self.monitor.task and (self.monitor.steps or self.monitor.samples_seen):
            raise ValueError(f"the monitor already scored {self.monitor.task!r}; this learner's task is {task!r}")
        mode = self.monitor.prequential
        score_eval = mode == "eval" or (mode == "auto" and _output_depends_on_mode(self.model, x))
        self.monitor.set_task(task)
        self.task, self.input_spec, self.output_shape = task, spec, output_shape
        self.input_shape = spec.shape if spec.is_tensor else None
        self.num_classes = num_classes
        self._score_eval = score_eval
        return y

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, buffer, monitor, plugins, RNG."""
        with self._lock:
            return {
                "format": CHECKPOINT_FORMAT,
                "config": {
                    "replay_batch_size": self.replay_batch_size,
                    "train_iterations": self.train_iterations,
                    "num_classes": self.num_classes,
                    "input_shape": None if self.input_shape is None else list(self.input_shape),
                    "input_spec": None if self.input_spec is None else self.input_spec.to_json(),
                    "output_shape": None if self.output_shape is None else list(self.output_shape),
                    "task": None if self.task is None else self.task.config(),
                    "score_eval": self._score_eval,
                    "monitor": {key: getattr(self.monitor, key) for key in MONITOR_CONFIG},
                    "optimizer_type": type(self.optimizer).__name__,
                    "strategy": {"name": self.strategy.name, "config": self.strategy.config()},
                },
                "counters": {"samples_seen": self.samples_seen, "steps": self.steps},
                "training": {
                    "batch_plan": None if self.batch_plan is None else vars(self.batch_plan).copy(),
                    "stream_batch_size": self._stream_batch_size,
                    "pending": None if self._pending is None else [*leaves(self._pending[0]), self._pending[1]],
                    "accumulated": self._accumulated,
                    "window_finite": self._window_finite,
                    "grads": [None if p.grad is None else p.grad.clone() for p in self.model.parameters()],
                },
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "replay_type": None if self.replay is None else type(self.replay).__name__,
                "replay": None if self.replay is None else self.replay.state_dict(),
                "monitor": self.monitor.state_dict(),
                "strategy": self.strategy.state_dict(),
                "plugins": {plugin.name: plugin.state_dict() for plugin in self.plugins},
                "rng": {"torch": torch.get_rng_state()},
                "guard": self.guard.state_dict(),
            }

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Atomically write a checkpoint into ``directory`` (created if needed); no pickle, see :mod:`taste_cl.state.checkpoint`."""
        write_checkpoint(directory, self.state_dict, lock=self._lock)  # a consistent snapshot, written unlocked

    def export_onnx(self, directory: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Write ONNX Runtime on-device training artifacts; see :func:`taste_cl.adapters.onnxruntime.export.export`."""
        from taste_cl.adapters.onnxruntime.export import export  # lazy: the [onnx] extra is optional

        return export(self, directory, **kwargs)

    def export(self, directory: str | os.PathLike[str], *, backend: str = "auto", **kwargs: Any) -> Path:
        """Write parity-checked on-device training artifacts with ``backend`` (``"onnxruntime"``,
        ``"executorch"`` or ``"auto"``); see :func:`taste_cl.adapters.device.export.export`."""
        from taste_cl.adapters.device.export import export  # lazy: optional extras

        return export(self, directory, backend=backend, **kwargs)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        replay: ReplayStrategy | None = None,
        monitor: StabilityPlasticityMonitor | None = None,
        plugins: Sequence[LearnerPlugin] = (),
        max_bytes: int = CheckpointLimits.max_bytes,
        strategy: Strategy | None = None,
    ) -> OnlineLearner:
        """Rebuild a learner from :meth:`save` output around a freshly built ``model``.

        Built-in replay buffers and strategies are rebuilt from the checkpoint; pass
        ``replay`` / ``strategy`` for a custom one. The task, input structure and output shape come from the checkpoint.
        Files over ``max_bytes`` are refused before being read. The whole checkpoint is
        validated before anything is applied: on any error
        :class:`~taste_cl.exceptions.CheckpointError` is raised (its subclass
        ``CheckpointNotFoundError`` for a missing file) and ``model``, ``optimizer``,
        ``replay``, ``monitor`` and ``plugins`` are left exactly as they were.
        """
        state = read_checkpoint(directory, limits=CheckpointLimits(max_bytes=max_bytes))
        config, replay, monitor = build_parts(state, model=model, replay=replay, monitor=monitor, max_bytes=max_bytes)
        parts: dict[str, Any] = {
            "loss_fn": loss_fn,
            "optimizer": optimizer,
            "replay": replay,
            "replay_batch_size": config["replay_batch_size"],
            "train_iterations": config["train_iterations"],
            "monitor": monitor,
            "task": config["task"],
            "strategy": _rebuild_strategy(config["strategy"], strategy),
        }
        # Checked on a throwaway learner before plugins attach (they, and a strategy, may subscribe to the monitor).
        validate_state(cls(model, **{**parts, "strategy": copy.deepcopy(parts["strategy"])}), state)
        learner = cls(model, **parts, plugins=plugins)
        learner.load_state_dict(state)
        return learner

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, all or nothing.

        Every section is validated against this learner first (shapes and dtypes of the
        model, optimizer groups and state, gradients, batch plan, pending samples,
        counters, replay and monitor contents, RNG and guard state); only then is
        anything changed. On any error :class:`~taste_cl.exceptions.CheckpointError` is
        raised and the learner, its replay, monitor and plugins are exactly as before.
        """
        with self._lock:
            restore_state(self, state)


def _shapes(x: Inputs) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}"
    return "leaf shapes " + ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves(x))


def _integer_hint(x: Inputs) -> str:
    if any(not t.is_floating_point() for t in leaves(x)):
        return " (integer and bool inputs are passed to the model unchanged, for embeddings; convert float features with .float())"
    return ""


def _task_from_targets(raw_y: Any, loss_fn: Any) -> Task:
    """The task for a loss taste_cl does not know: classification for integer targets only."""
    y = as_tensor(raw_y, "y")
    if y.is_floating_point() or y.dtype == torch.bool or y.dim() != 1:
        raise InvalidBatchError(
            f"cannot infer the task from loss_fn={type(loss_fn).__name__} and targets of dtype {y.dtype}, shape "
            f"{tuple(y.shape)}: pass task='regression', 'multilabel', 'classification' or 'token_classification' "
            "(or a taste_cl.tasks.Task) to OnlineLearner(task=...)"
        )
    return Classification()


def _check_scalar_loss(loss_fn: Callable[..., Any], outputs: torch.Tensor, targets: torch.Tensor) -> None:
    """The loss of one sample must be a scalar tensor (a mean or a sum), or the step would fail mid-way."""
    try:
        with torch.no_grad():
            loss = loss_fn(outputs, targets)
    except Exception as error:
        raise InvalidBatchError(
            f"loss_fn cannot take model outputs of shape {tuple(outputs.shape)} and targets of shape "
            f"{tuple(targets.shape)}, dtype {targets.dtype}: {error}"
        ) from error
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidBatchError(f"loss_fn must return a scalar tensor (use reduction='mean' or 'sum'); got {got}")


def _output_depends_on_mode(model: nn.Module, x: Inputs) -> bool:
    """Whether train mode changes the model's output on ``x`` (batch statistics, dropout, ...).

    Checked on a copy, with the RNG restored afterwards, so neither the model's buffers nor
    the random stream change. Any failure counts as mode-dependent (scoring in eval mode is
    always right, only slower).
    """
    try:
        twin = copy.deepcopy(model)
        devices = sorted({t.device.index or 0 for t in leaves(x) if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            eval_out = call_model(twin.eval(), x)
            train_out = call_model(twin.train(), x)
        return not torch.allclose(train_out.float(), eval_out.float(), rtol=1e-4, atol=1e-5)
    except Exception:  # noqa: BLE001 - any failure (copy, train-mode forward) means: score in eval mode
        return True


def _check_optimizer_covers(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must train the model: hold some of its parameters and every trainable one."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    if named and not any(id(p) in held for _, p in named):
        raise ValueError(
            "optimizer holds none of the model's parameters (was it built for another model or a copy?); build it from model.parameters()"
        )
    missing = [name for name, p in named if p.requires_grad and id(p) not in held]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"{len(missing)} trainable parameter(s) are in no optimizer group: {shown}; add them to the optimizer or set requires_grad=False"
        )


def _check_replay_fits(replay: ReplayStrategy | None, task: Task | None) -> None:
    if isinstance(replay, ClassBalancedReplay) and task is not None and not task.balances_classes:
        raise ValueError(f"ClassBalancedReplay balances on one class label per sample; the {task.name} task has none. Use ReservoirReplay")


def _total_norm(tensors: list[torch.Tensor]) -> float:
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


def _rebuild_strategy(saved: dict[str, Any] | None, strategy: Strategy | None) -> Strategy | None:
    """The strategy a checkpoint names: ``strategy`` if given (it must be of that kind), else a built-in one."""
    if saved is None:
        return strategy
    if strategy is not None:
        if strategy.name != saved["name"]:
            raise CheckpointError(f"checkpoint was trained with strategy {saved['name']!r}; got strategy={strategy.name!r}")
        return strategy
    try:
        return resolve_strategy(saved)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"checkpoint's strategy cannot be rebuilt ({error}): pass strategy=... to load()") from error
