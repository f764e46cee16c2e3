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

:class:`OnlineLearner` orchestrates validate -> plan -> step -> store; its parts live
beside it: :mod:`.batching` plans the micro-batches and counts the accumulation window,
:mod:`.checks` checks the arguments and settles the task and shapes on the first batch,
:mod:`.stats` holds what ``observe`` returns, and :mod:`.learner_state`
gathers and rebuilds its checkpoint state. The class runs past 350 lines only through
the documentation of its public methods (about 130 lines); its code is about 250.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from taste_cl._batch import (
    BatchLike,
    Inputs,
    Spec,
    batch_len,
    call_model,
    cat_batches,
    map_leaves,
    split_batch,
    to_inputs,
    to_like,
)  # fmt: skip
from taste_cl.adaptation.adapter import AdaptStats, TestTimeAdapter
from taste_cl.guards.update import UpdateGuard
from taste_cl.learner.batching import BatchPlan, Chunk, MicroBatcher, Replayed, plan_from, replay_slice, rescale_lr, total_norm
from taste_cl.learner.checks import check_arguments, check_optimizer_covers, check_replay_fits, settle_first_batch
from taste_cl.learner.frozen import frozen_norms, train_mode
from taste_cl.learner.heads import plan_growth
from taste_cl.learner.persistence import LearnerPersistence
from taste_cl.learner.stats import ObserveStats, Totals
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.outputs import OutputLike, OutputSelector, resolve_output, select_checked
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import ReplayStrategy
from taste_cl.strategies import Strategy, resolve_strategy
from taste_cl.tasks import Task, infer_task, resolve_task

__all__ = ["OnlineLearner"]

logger = logging.getLogger(__name__)


class OnlineLearner(LearnerPersistence):
    """Wrap a model so it keeps adapting to a stream of labelled batches.

    Inputs ``x`` are a tensor or a dict / tuple / list of tensors, passed as ``model(x)``,
    ``model(**x)`` or ``model(*x)``, or whole as ``model(x)`` to a ``forward(self, batch)``
    (see ``call``); floating leaves follow the model's dtype and device,
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
        logits for classification; or to a dict, tuple, dataclass or Hugging Face
        ``ModelOutput`` holding it (see ``output``).
    output:
        Which tensor of the model's output to train on, for models that return more than
        one: a key or attribute (``"logits"``), an index (``0``) or a callable
        ``outputs -> tensor`` (see :mod:`taste_cl.outputs`). Default: decided on the first
        batch (a tensor as it is; a ``logits`` entry; a tuple's first element when it is
        batch-sized) and logged; anything else is refused with what the model returned.
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
    max_classes:
        Let a classifier grow at run time, up to this many classes: a label at or above
        the model's output width widens its last ``nn.Linear`` before the batch trains
        (a class the pretrained model never saw; see :mod:`taste_cl.learner.heads`).
        Default None: the width is fixed and a larger label is refused.
    max_grad_norm:
        Clip each optimizer step's gradient to this global L2 norm (over every parameter
        the optimizer holds, after plugins such as ElasticTrainer have chosen what trains),
        as ``torch.nn.utils.clip_grad_norm_`` does. Fine-tuning a pretrained model on
        shifted data needs it: its first gradients can be large enough to wreck the
        features (see docs/personalize.md). Default None: no clipping. Saved in checkpoints.
    frozen_norm:
        ``"eval"`` (default) runs the normalisation modules of the parts that do not train (frozen, or
        held by no optimizer group; decided once, here) in eval mode while the learner trains, as Keras
        does for ``trainable=False``: a frozen backbone's running statistics never move.
        ``"train"`` lets them follow the data. See :mod:`taste_cl.learner.frozen`;
        :attr:`frozen_norms` names them. Saved in checkpoints (older ones load as ``"train"``).
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
    call:
        How a dict / tuple / list ``x`` is passed to the model wherever it runs on a batch:
        ``"keywords"`` spreads it (``model(**x)``, ``model(*x)``), ``"positional"`` passes it whole
        (``model(x)``, for a ``forward(self, batch)``), ``"auto"`` (default) decides from
        ``model.forward``'s signature (:func:`taste_cl._batch.call_style`). Saved in checkpoints
        (older ones load as ``"keywords"``). A tensor ``x`` is always ``model(x)``.
    adaptation:
        What :meth:`adapt` runs on unlabelled batches: a
        :class:`~taste_cl.adaptation.adapter.TestTimeAdapter`, or a method name (``"tent"``,
        ``"eata"``, ``"bn"``) guarded by the default collapse guard. None (default): guarded
        TENT, made on the first :meth:`adapt`.
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
        output: OutputLike | None = None,
        max_classes: int | None = None,
        max_grad_norm: float | None = None,
        frozen_norm: str = "eval",
        call: str = "auto",
        adaptation: TestTimeAdapter | str | None = None,
    ) -> None:
        check_arguments(model, replay, replay_batch_size, train_iterations, num_classes, plugins, max_classes, max_grad_norm, call, frozen_norm)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.call = call
        self.output: OutputSelector | None = resolve_output(output)  # settled on the first batch when None
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.01)
        check_optimizer_covers(model, self.optimizer)
        self.frozen_norm = frozen_norm
        trained = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._frozen_parts = frozen_norms(model, trained)  # decided once, before plugins attach
        self.task: Task | None = resolve_task(task) if task is not None else infer_task(self.loss_fn)
        check_replay_fits(replay, self.task)
        self.strategy = resolve_strategy(strategy)
        self.strategy.check(self.task, replay)
        self.replay = replay
        self.replay_batch_size = replay_batch_size
        self.train_iterations = train_iterations
        self.num_classes = num_classes
        self.max_classes = max_classes
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
        self._batcher = MicroBatcher()  # the batch plan, waiting stream samples, the accumulation window
        self._lock = threading.RLock()
        self.adapter = adaptation if isinstance(adaptation, TestTimeAdapter) or adaptation is None else TestTimeAdapter(adaptation)
        self.strategy.attach(self)
        for plugin in self.plugins:
            plugin.on_attach(self)
        # Gradients left by training before the learner (a pretrained model fresh from its loop) would be
        # added to its first step and, on parameters it does not train (a frozen base), stay in every
        # checkpoint, which load then refuses (gradients with no micro-batch accumulated).
        model.zero_grad(set_to_none=True)

    @property
    def lock(self) -> threading.RLock:
        """The lock ``observe``, ``predict`` and ``save`` hold; hold it to act on the learner between two calls
        (an exporter's consistent snapshot of the model and optimizer)."""
        return self._lock

    @property
    def batcher(self) -> MicroBatcher:
        """The :class:`~taste_cl.learner.batching.MicroBatcher`: the batch plan, the stream samples waiting
        for a micro-batch and the accumulation window; its state is saved as the checkpoint's ``training``."""
        return self._batcher

    @property
    def task_given(self) -> bool:
        """Whether ``task=`` was given (else the task is inferred, on the first batch at the latest)."""
        return self._task_given

    @property
    def batch_plan(self) -> BatchPlan | None:
        """The plan set by :meth:`set_batch_plan` (None: one step per ``observe``)."""
        return self._batcher.plan

    @batch_plan.setter
    def batch_plan(self, plan: BatchPlan | None) -> None:
        self._batcher.plan = plan

    @property
    def score_eval(self) -> bool:
        """Whether the prequential score comes from an eval-mode forward before training (decided on the first batch:
        a model whose train-mode outputs differ, e.g. with BatchNorm or dropout), rather than from the training forward."""
        return self._score_eval

    @property
    def frozen_norms(self) -> list[str]:
        """Names of the normalisation modules that run in eval mode while the learner trains: those in
        frozen parts, decided when it was built; none under ``frozen_norm="train"``."""
        return [] if self.frozen_norm == "train" else list(self._frozen_parts)

    @property
    def replay_rows(self) -> int:
        """Replayed samples mixed into each stream batch's step (0 without a buffer)."""
        return self.replay_batch_size if self.replay is not None else 0

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
        A plan whose window is at most one stream batch plus its replay steps on each observe
        in full (its last micro-batch smaller); under a larger one, stream samples are
        buffered until a micro-batch is full; ``max_wait_samples``
        (waiting stream samples) and ``max_wait_s`` (age of the oldest) force a step on
        what is there, weighted by its share of stream samples. An accumulation window in
        progress is applied first. The batch-size tuner calls this.
        """
        with self._lock:
            plan = plan_from(micro_batch_size, accumulation_steps, lr_scale, max_wait_samples, max_wait_s)
            self._apply_accumulated()
            rescale_lr(self.optimizer, self._batcher.plan, plan)
            self._batcher.set_plan(plan)

    def observe(self, batch: BatchLike) -> ObserveStats:
        """Test-then-train on one stream batch ``(x, y)`` or ``{"x": x, "y": y}``.

        ``x`` is a tensor or array, or a dict / tuple / list of them (see the class doc).

        Raises :class:`~taste_cl.exceptions.InvalidBatchError` (a ``ValueError``) on a
        malformed batch, before anything is changed.
        """
        with self._lock:
            x, y = self._validate(batch)
            n = y.shape[0]
            batcher = self._batcher
            if batcher.stream_batch_size is None:
                batcher.stream_batch_size = n
                for plugin in self.plugins:
                    plugin.on_first_batch(self, x, y=y)
            start = time.perf_counter()
            totals = Totals()
            batcher.arrive(n)
            self._learn_chunks(batcher.chunks(x, y, self.replay_rows, self._stored()), totals)
            if batcher.waited_too_long():
                self._flush(totals)
            elapsed = time.perf_counter() - start
            self.samples_seen += n
            self.steps += 1
            stats = totals.stats(self.task, samples=n, step_time_s=elapsed, pending=batcher.pending_count())
            for plugin in self.plugins:
                plugin.after_observe(self, stats, batch=(x, y))
            if self.adapter is not None:
                self.adapter.labelled_update()
            self.monitor.dispatch()
            return stats

    def adapt(self, x: Any) -> AdaptStats:
        """Adapt to one unlabelled batch ``x`` and return its predictions (test-time adaptation).

        Runs :attr:`adapter` (a :class:`~taste_cl.adaptation.adapter.TestTimeAdapter`; the
        guarded TENT default when the learner was built without ``adaptation=``). Nothing
        enters the replay buffer or the monitor's labelled metrics; a reset by the collapse
        guard emits ``adaptation_reset``. A labelled :meth:`observe` moves the adapter's anchor
        to the model it trained. ``x`` is validated like :meth:`observe`'s, before anything changes.
        """
        with self._lock:
            device, dtype = self._placement()
            inputs, spec = to_inputs(x, spec=self.input_spec, dtype=dtype, device=device)
            if self.input_spec is None:  # before the first labelled batch: later batches must look like this one
                self.input_spec = spec
                self.input_shape = spec.shape if spec.is_tensor else None
            if self.adapter is None:
                self.adapter = TestTimeAdapter()
            if not self.adapter.bound:
                self.adapter.bind(self.model)
            stats = self.adapter.adapt(inputs, call=self.call, output=self.output)
            if stats.reset:
                self.monitor.emit("adaptation_reset", reason=stats.reason, batches=self.adapter.batches)
            self.monitor.dispatch()
            return stats

    def _stored(self) -> int:
        return len(self.replay) if self.replay is not None else 0

    def _flush(self, totals: Totals) -> None:
        """Train the pending stream samples as one smaller micro-batch and apply the window."""
        chunk = self._batcher.take_pending(self.replay_rows, self._stored())
        if chunk is not None:
            self._learn_chunks([chunk], totals)
        totals.add_step(self._apply_accumulated())

    def _learn_chunks(self, chunks: list[Chunk], totals: Totals) -> None:
        """Score each chunk (test), train ``train_iterations`` passes over them with replay, then store them.

        Each pass trains every chunk once. Under a plan whose window is one stream batch with
        its replay (:meth:`MicroBatcher.per_observe`), each pass splits the observe's chunks into
        whole windows (:meth:`MicroBatcher.observe_windows`; their loss weights make each the
        mean over its own samples), so a window never holds two passes or two observes, as the
        learner's own step; a larger
        effective batch accumulates across passes and observes. The score comes from
        an eval-mode forward (what :meth:`predict` returns) when the model's output depends on
        the train/eval mode, else from the chunk's first training forward. A chunk whose loss overflowed is scored but never stored: it would
        poison later steps. With a plan, each micro-batch's loss is weighted by the batcher
        (see :meth:`MicroBatcher.enter`).
        """
        batcher = self._batcher
        weights = [1.0] * len(chunks)
        if batcher.plan is not None:
            weights = batcher.weights([(y.shape[0], r) for _, y, r in chunks], self.replay_rows)
            batcher.enter(sum(y.shape[0] for _, y, _ in chunks))
        finite = [True] * len(chunks)
        scored: list[torch.Tensor | None] = [self._logits(x) if self._score_eval else None for x, _, _ in chunks]
        last: list[torch.Tensor | None] = [None] * len(chunks)
        per_observe = batcher.plan is not None and batcher.per_observe(self.replay_rows)
        window_ends = set(itertools.accumulate(batcher.observe_windows(len(chunks)))) if per_observe else set()
        for _ in range(self.train_iterations):
            # a per-observe plan draws the observe's replayed rows at once and splits them, as the learner's own step
            shared = self._draw_replay(sum(r for *_, r in chunks)) if per_observe else None
            offset = 0
            for i, (x, y, n_replay) in enumerate(chunks):
                n = y.shape[0]
                drawn = self._draw_replay(n_replay) if shared is None else replay_slice(shared, offset, n_replay)
                offset += n_replay
                train_x, train_y, fields = self._with_replay(x, y, drawn)
                outputs, loss = self._micro_step(train_x, train_y, n, fields, weights[i])
                last[i] = outputs[:n]  # the stream rows
                finite[i] &= math.isfinite(loss)
                if scored[i] is None:
                    scored[i] = last[i]  # scored before any update on this chunk
                totals.add_micro(loss, train_y.shape[0], n_replay)
                if (i + 1 in window_ends) if per_observe else batcher.window_full():  # a window never spans passes
                    totals.add_step(self._apply_accumulated())
        for (x, y, _), score, trained, ok in zip(chunks, scored, last, finite):
            assert score is not None and trained is not None
            totals.add_scored(self.monitor.record(x, y, score, validated=True, store=ok))
            if self.replay is not None and ok:
                self.replay.add_validated(x, y, **self.strategy.fields(x, y, trained))
            if self.monitor.due():
                self.monitor.evaluate(self.stored_logits)
            self.strategy.after_chunk(self)

    def _draw_replay(self, n: int) -> Replayed | None:
        """``n`` replayed samples with their stored fields (those the strategy uses); None for none."""
        if not n:
            return None
        assert self.replay is not None
        if self.strategy.stored_fields:
            return self.replay.sample(n, with_fields=True)  # type: ignore[call-arg, return-value]
        replay_x, replay_y = self.replay.sample(n)
        return replay_x, replay_y, {}

    def _with_replay(self, x: Inputs, y: torch.Tensor, drawn: Replayed | None) -> tuple[Inputs, torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch ``[stream | replayed]`` and the replayed samples' stored fields."""
        if drawn is None:
            return x, y, {}
        replay_x, replay_y, fields = drawn
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
        if self._batcher.accumulated == 0:
            for plugin in self.plugins:
                plugin.before_step(self)
        self._train_mode()
        logits = call_model(self.model, x, output=self.output, call=self.call)
        n_stream = y.shape[0] if n_stream is None else n_stream
        loss = self.strategy.loss(self.loss_fn, logits, y, x=x, n_stream=n_stream, fields=fields or {})
        loss_value = loss.item()
        self.guard.record_loss(loss_value)
        finite = math.isfinite(loss_value)
        if finite:
            (loss if weight == 1.0 else loss * weight).backward()
        self._batcher.add_micro(finite)
        return logits.detach(), loss_value

    def _apply_accumulated(self) -> bool | None:
        """Apply the accumulated gradient; return True if applied, False if skipped, None if nothing was pending.

        The :class:`~taste_cl.guards.update.UpdateGuard` decides: a non-finite loss or gradient or
        an unsafe hyperparameter skips the update, a step that leaves a parameter
        non-finite is undone; both emit ``numerical_fault``.
        """
        batcher = self._batcher
        if batcher.accumulated == 0:
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        batcher.release_arrivals()
        norm = total_norm(grads)
        if self.max_grad_norm is not None and norm > self.max_grad_norm:  # False for NaN: the guard skips it
            torch._foreach_mul_(grads, self.max_grad_norm / (norm + 1e-6))  # clip_grad_norm_'s scale
            norm = self.max_grad_norm
        applied = self.guard.step(self, params, norm, batcher.window_finite)
        self.optimizer.zero_grad(set_to_none=True)
        batcher.reset_window()
        return applied

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
        """One optimizer step on validated tensors, outside the stream bookkeeping.

        Returns (detached logits, loss, skipped). Any accumulation window in progress is
        applied first.
        """
        with self._lock:
            self._apply_accumulated()
            batcher = self._batcher
            saved_plan, batcher.plan = batcher.plan, None
            try:
                logits, loss = self._micro_step(x, y)
                applied = self._apply_accumulated()
            finally:
                batcher.plan = saved_plan
            return logits, loss, not applied

    def predict(self, x: Any) -> torch.Tensor:
        """Model outputs (logits for classification) for ``x`` in eval mode without gradients;
        changes no state. ``x`` is validated like :meth:`observe`'s, and the output is
        selected (``output``) and checked like the first batch's, before the first batch too."""
        with self._lock:
            device, dtype = self._placement()
            inputs, _ = to_inputs(x, spec=self.input_spec, dtype=dtype, device=device)
            if self.output_shape is not None:  # settled: the first batch checked the selection
                return self._logits(inputs)
            return select_checked(self.eval_outputs(inputs, None), self.output, batch_len(inputs), where="the batch given to predict")[1]

    def _logits(self, x: Inputs) -> torch.Tensor:
        """The selected outputs for ``x`` in eval mode without gradients."""
        return self.eval_outputs(x, self.output)

    def stored_logits(self, x: Inputs) -> torch.Tensor:
        """The selected outputs for stored samples ``x`` (a buffer's, the probe's): moved to the model's device
        and dtype, run in eval mode without gradients."""
        return self._logits(self._place(x))

    def discard_window(self) -> None:
        """Drop the accumulation window in progress: its gradients and its count (a rolled-back model)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._batcher.reset_window()

    def eval_outputs(self, x: Inputs, output: OutputSelector | None = None) -> Any:
        """The model's eval-mode output for placed inputs ``x`` without gradients, picked by ``output`` (None: as
        returned); the model's train/eval modes are put back."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return call_model(self.model, x, output=output, call=self.call)
        finally:
            if was_training:
                self._train_mode()

    def _train_mode(self) -> None:
        """Train mode, the normalisation modules of frozen parts in eval mode unless ``frozen_norm="train"``."""
        train_mode(self.model, self._frozen_parts.values(), keep_frozen=self.frozen_norm != "train")

    def _validate(self, batch: BatchLike) -> tuple[Inputs, torch.Tensor]:
        raw_x, raw_y = split_batch(batch)
        device, dtype = self._placement()
        x, spec = to_inputs(raw_x, spec=self.input_spec, dtype=dtype, device=device)
        if self.output_shape is None:
            return x, self._first_batch(x, spec, raw_y)
        assert self.task is not None
        if self.max_classes is None:
            return x, self.task.to_targets(raw_y, n=batch_len(x), output_shape=self.output_shape, dtype=dtype, device=device)
        y = self.task.to_targets(raw_y, n=batch_len(x), output_shape=(self.max_classes,), dtype=dtype, device=device)
        grow = plan_growth(self, x, y, self.output_shape, self.output)
        if grow is not None:
            grow()
        return x, y

    def _first_batch(self, x: Inputs, spec: Spec, raw_y: Any) -> torch.Tensor:
        """Settle the task, input spec and output shape on the first batch (see
        :func:`~taste_cl.learner.checks.settle_first_batch`); commit them only if every check passes."""
        first = settle_first_batch(self, x, spec, raw_y)
        grow = None if self.max_classes is None else plan_growth(self, x, first.targets, first.output_shape, first.output, first=True)
        self.monitor.set_task(first.task)
        self.task, self.input_spec, self.output_shape = first.task, first.spec, first.output_shape
        self.input_shape = first.spec.shape if first.spec.is_tensor else None
        self.num_classes = first.num_classes
        self._score_eval = first.score_eval
        if first.output is not None and self.output is None:
            logger.info(
                "OnlineLearner: the model returns %s; training on %s (pass OnlineLearner(output=...) to pick another tensor)",
                first.returned, first.output,
            )  # fmt: skip
        self.output = first.output
        if grow is not None:
            grow()
        return first.targets
