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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from taste_cl._batch import BatchLike, split_batch, to_features, to_labels
from taste_cl.checkpoint import read_checkpoint, write_checkpoint
from taste_cl.exceptions import CheckpointError, InvalidBatchError
from taste_cl.monitor import StabilityPlasticityMonitor
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy, ReservoirReplay

__all__ = ["BatchPlan", "ObserveStats", "OnlineLearner"]

CHECKPOINT_FORMAT = 1
_BUILTIN_REPLAY: dict[str, type[ReservoirReplay] | type[ClassBalancedReplay]] = {
    "ReservoirReplay": ReservoirReplay,
    "ClassBalancedReplay": ClassBalancedReplay,
}
_GUARD_MODES = ("auto", "always", "never")
_GUARD_UPDATE_BOUND = 1e4  # far below float32 overflow (3e38), far above healthy steps
_MONITOR_CONFIG = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "max_events", "seed")


@dataclass(frozen=True)
class BatchPlan:
    """How stream samples become optimizer steps (set by the batch-size tuner)."""

    micro_batch_size: int
    accumulation_steps: int = 1
    lr_scale: float = 1.0


@dataclass
class _Totals:
    """Running sums over the micro-batches of one ``observe`` call."""

    losses: list[float] = field(default_factory=list)
    batch_size: int = 0
    replay_samples: int = 0
    micro_batches: int = 0
    steps: int = 0
    skipped: bool = False
    correct: int = 0
    scored: int = 0

    def add_micro(self, loss: float, size: int, n_replay: int) -> None:
        self.losses.append(loss)
        self.batch_size = max(self.batch_size, size)
        self.replay_samples += n_replay
        self.micro_batches += 1

    def add_step(self, applied: bool | None) -> None:
        self.steps += bool(applied)
        self.skipped |= applied is False

    def add_scored(self, correct: int, n: int) -> None:
        self.correct += correct
        self.scored += n

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    @property
    def accuracy(self) -> float:
        return self.correct / self.scored if self.scored else math.nan


@dataclass(frozen=True)
class ObserveStats:
    """What one ``observe`` call did.

    ``loss`` is the mean training loss over stream and replay samples; ``accuracy`` is
    the prequential accuracy on the stream samples, scored before training on them.
    ``skipped`` is true when a non-finite loss or gradient was detected, or a step that
    made a parameter non-finite was rolled back, so an update was not applied. ``batch_size`` is the largest micro-batch trained (stream plus
    replay); ``micro_batches`` counts forward/backward passes, ``steps`` optimizer steps.
    With a batch plan, samples may wait for a full micro-batch: then ``loss`` and
    ``accuracy`` are NaN and ``micro_batches`` is 0.
    """

    loss: float
    accuracy: float
    samples: int
    replay_samples: int
    batch_size: int
    steps: int
    step_time_s: float
    skipped: bool = False
    micro_batches: int = 1


class OnlineLearner:
    """Wrap a classifier so it keeps adapting to a stream of labelled batches.

    Each :meth:`observe` scores the incoming batch (test-then-train), trains one step on
    it mixed with ``replay_batch_size`` samples from the replay buffer, and offers the
    batch to the buffer. Calls are serialised by a lock: ``observe``, ``predict`` and
    ``save`` may be called from several threads.

    Parameters
    ----------
    model:
        A module mapping ``(n, *input_shape)`` features to ``(n, num_classes)`` logits.
    loss_fn:
        Training loss taking ``(logits, labels)``; default cross-entropy.
    optimizer:
        Optimizer over ``model``'s parameters; default SGD with lr 0.01.
    replay:
        A :class:`~taste_cl.replay.ReplayStrategy`, or None to train on the stream only.
    replay_batch_size:
        Replayed samples added to every training step.
    train_iterations:
        Optimizer steps per stream batch, each with a fresh replay sample (repeated
        rehearsal; 2-3 help a lot when the stream is short).
    num_classes, input_shape:
        Inferred from the first batch and the model's output when not given.
    monitor:
        The :class:`~taste_cl.monitor.StabilityPlasticityMonitor`; a default one if None.
    plugins:
        :class:`~taste_cl.plugins.LearnerPlugin` instances (batch-size tuner, elastic training).
    guard_updates:
        ``"auto"``: before a step whose size bound (largest learning rate times
        ``max(1, gradient norm)``) exceeds 1e4, copy the parameters and optimizer state,
        and restore them if the step leaves a parameter non-finite (a learning-rate
        spike on a finite gradient). Ordinary steps pay nothing. ``"always"`` guards
        every step (one copy per step), ``"never"`` none.
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
        guard_updates: str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if replay is not None and not isinstance(replay, ReplayStrategy):
            raise TypeError(f"replay must be a taste_cl.ReplayStrategy or None; got {type(replay).__name__}")
        if isinstance(replay_batch_size, bool) or not isinstance(replay_batch_size, int) or replay_batch_size < 0:
            raise ValueError(f"`replay_batch_size == {replay_batch_size!r}`, must be an int >= 0")
        if isinstance(train_iterations, bool) or not isinstance(train_iterations, int) or train_iterations < 1:
            raise ValueError(f"`train_iterations == {train_iterations!r}`, must be an int >= 1")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"`num_classes == {num_classes}`, must be >= 1")
        if guard_updates not in _GUARD_MODES:
            raise ValueError(f"`guard_updates == {guard_updates!r}`, must be one of {', '.join(map(repr, _GUARD_MODES))}")
        names = [plugin.name for plugin in plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"plugin names must be unique (they key checkpoint state); got {names}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.01)
        self.replay = replay
        self.replay_batch_size = replay_batch_size
        self.train_iterations = train_iterations
        self.num_classes = num_classes
        self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self.monitor = monitor if monitor is not None else StabilityPlasticityMonitor()
        self.plugins = list(plugins)
        self.guard_updates = guard_updates
        self.samples_seen = 0
        self.steps = 0
        self.batch_plan: BatchPlan | None = None
        self._base_lrs: list[float] | None = None
        self._stream_batch_size: int | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._accumulated = 0
        self._window_finite = True
        self._lock = threading.RLock()
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
    def set_batch_plan(self, micro_batch_size: int | None, *, accumulation_steps: int = 1, lr_scale: float = 1.0) -> None:
        """Train in micro-batches of ``micro_batch_size`` samples (stream plus replay share),
        ``accumulation_steps`` micro-batches per optimizer step, at ``lr_scale`` times the
        learning rates the optimizer had when the first plan was set.

        Stream samples are buffered until a micro-batch is full, whatever ``observe``
        receives. ``None`` returns to one step per ``observe``. The batch-size tuner
        calls this; an accumulation window in progress is applied first.
        """
        with self._lock:
            if micro_batch_size is not None and micro_batch_size < 1:
                raise ValueError(f"`micro_batch_size == {micro_batch_size}`, must be >= 1 or None")
            if accumulation_steps < 1 or not lr_scale > 0:
                raise ValueError(f"need accumulation_steps >= 1 and lr_scale > 0; got {accumulation_steps}, {lr_scale}")
            self._apply_accumulated()
            if self._base_lrs is None:
                self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
            plan = None if micro_batch_size is None else BatchPlan(micro_batch_size, accumulation_steps, lr_scale)
            scale = 1.0 if plan is None else plan.lr_scale
            for group, base in zip(self.optimizer.param_groups, self._base_lrs):
                group["lr"] = base * scale
            self.batch_plan = plan

    def observe(self, batch: BatchLike) -> ObserveStats:
        """Test-then-train on one stream batch ``(x, y)`` or ``{"x": x, "y": y}``.

        Raises :class:`~taste_cl.exceptions.InvalidBatchError` (a ``ValueError``) on a
        malformed batch, before anything is changed.
        """
        with self._lock:
            x, y = self._validate(batch)
            if self._stream_batch_size is None:
                self._stream_batch_size = x.shape[0]
                for plugin in self.plugins:
                    plugin.on_first_batch(self, x)
            start = time.perf_counter()
            totals = _Totals()
            for chunk_x, chunk_y, n_replay in self._chunks(x, y):
                self._learn_chunk(chunk_x, chunk_y, n_replay, totals)
            elapsed = time.perf_counter() - start
            self.samples_seen += x.shape[0]
            self.steps += 1
            stats = ObserveStats(
                loss=totals.mean_loss,
                accuracy=totals.accuracy,
                samples=x.shape[0],
                replay_samples=totals.replay_samples,
                batch_size=totals.batch_size,
                steps=totals.steps,
                step_time_s=elapsed,
                skipped=totals.skipped,
                micro_batches=totals.micro_batches,
            )
            for plugin in self.plugins:
                plugin.after_observe(self, stats)
            self.monitor.dispatch()
            return stats

    def _chunks(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Split the stream into training chunks: the batch itself, or full micro-batches of the plan."""
        stored = len(self.replay) if self.replay is not None else 0
        if self.batch_plan is None:
            return [(x, y, min(self.replay_batch_size, stored))]
        micro = self.batch_plan.micro_batch_size
        assert self._stream_batch_size is not None
        share = self.replay_batch_size / (self._stream_batch_size + self.replay_batch_size) if self.replay else 0.0
        replay_part = min(int(round(micro * share)), micro - 1)
        stream_part = micro - replay_part
        pending_x = x if self._pending is None else torch.cat([self._pending[0], x])
        pending_y = y if self._pending is None else torch.cat([self._pending[1], y])
        full = pending_x.shape[0] // stream_part * stream_part
        # Views are safe: both tensors are the learner's own copies, never the caller's memory.
        self._pending = None if full == pending_x.shape[0] else (pending_x[full:], pending_y[full:])
        return [
            (pending_x[i : i + stream_part], pending_y[i : i + stream_part], min(replay_part, stored))
            for i in range(0, full, stream_part)
        ]

    def _learn_chunk(self, x: torch.Tensor, y: torch.Tensor, n_replay: int, totals: _Totals) -> None:
        """Score ``x`` (test), train ``train_iterations`` micro-batches on it with replay, then store it."""
        for iteration in range(self.train_iterations):
            train_x, train_y = self._with_replay(x, y, n_replay)
            logits, loss = self._micro_step(train_x, train_y)
            if iteration == 0:
                stream_logits = logits[: x.shape[0]]  # scored before any update on this chunk
            totals.add_micro(loss, train_x.shape[0], n_replay)
            if self._accumulated == self._accumulation_steps:
                totals.add_step(self._apply_accumulated())
        totals.add_scored(self.monitor.record(x, y, stream_logits, validated=True), y.shape[0])
        if self.replay is not None:
            self.replay.add_validated(x, y)
        if self.monitor.due():
            self.monitor.evaluate(lambda probe_x: self._logits(probe_x.to(x)))  # x: the model's device and dtype

    @property
    def _accumulation_steps(self) -> int:
        return 1 if self.batch_plan is None else self.batch_plan.accumulation_steps

    def _with_replay(self, x: torch.Tensor, y: torch.Tensor, n_replay: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not n_replay:
            return x, y
        assert self.replay is not None
        replay_x, replay_y = self.replay.sample(n_replay)
        return torch.cat([x, replay_x.to(x)]), torch.cat([y, replay_y.to(y.device)])

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Forward and backward one micro-batch, adding its share to the accumulated gradient."""
        if self._accumulated == 0:
            for plugin in self.plugins:
                plugin.before_step(self)
        if not self.model.training:  # train() walks every module: only when needed
            self.model.train()
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        loss_value = float(loss.detach())
        if math.isfinite(loss_value):
            steps = self._accumulation_steps
            (loss if steps == 1 else loss / steps).backward()
        else:
            self._window_finite = False
        self._accumulated += 1
        return logits.detach(), loss_value

    def _apply_accumulated(self) -> bool | None:
        """Apply the accumulated gradient; return True if applied, False if skipped, None if nothing was pending.

        A non-finite loss or gradient in the window skips the update; with ``guard_updates``
        a step that leaves a parameter non-finite is undone. Both emit ``numerical_fault``.
        """
        if self._accumulated == 0:
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        if self._accumulated < self._accumulation_steps:  # partial window: make it a mean again
            for grad in grads:
                grad.mul_(self._accumulation_steps / self._accumulated)
        grad_norm = _total_norm(grads)
        applied = self._window_finite and math.isfinite(grad_norm)
        if not applied:
            self.monitor.emit("numerical_fault", micro_batches=self._accumulated, cause="non-finite loss or gradient")
        elif self._needs_guard(grad_norm):
            applied = self._guarded_step(params)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._accumulated, self._window_finite = 0, True
        return applied

    def _needs_guard(self, grad_norm: float) -> bool:
        if self.guard_updates != "auto":
            return self.guard_updates == "always"
        largest_lr = max(float(group["lr"]) for group in self.optimizer.param_groups)
        return largest_lr * max(1.0, grad_norm) > _GUARD_UPDATE_BOUND

    def _guarded_step(self, params: list[nn.Parameter]) -> bool:
        """Step the optimizer; undo the step on ``params`` (the ones with gradients) and their
        optimizer state if a parameter became non-finite."""
        with torch.no_grad():
            saved_params = torch._foreach_mul(params, 1.0)  # one fused copy
        saved_state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()} for p in params if p in self.optimizer.state}
        self.optimizer.step()
        if math.isfinite(float(torch.nn.utils.get_total_norm(params, norm_type=math.inf))):  # max |p|: no overflow
            return True
        with torch.no_grad():
            torch._foreach_copy_(params, saved_params)
        for p in params:
            if p in saved_state:
                self.optimizer.state[p] = saved_state[p]
            else:
                self.optimizer.state.pop(p, None)
        self.monitor.emit("numerical_fault", micro_batches=self._accumulated, cause="non-finite parameters after the step (rolled back)")
        return False

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
        """Logits for ``x`` in eval mode without gradients; changes no state."""
        with self._lock:
            device, dtype = self._placement()
            features = to_features(x, feature_shape=self.input_shape, dtype=dtype, device=device)
            return self._logits(features)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.model(x)
        finally:
            self.model.train(was_training)

    def _validate(self, batch: BatchLike) -> tuple[torch.Tensor, torch.Tensor]:
        raw_x, raw_y = split_batch(batch)
        device, dtype = self._placement()
        x = to_features(raw_x, feature_shape=self.input_shape, dtype=dtype, device=device)
        num_classes = self.num_classes if self.input_shape is not None else self._probe_output(x)
        y = to_labels(raw_y, n=x.shape[0], num_classes=num_classes, device=device)
        self.input_shape = tuple(x.shape[1:])
        self.num_classes = num_classes
        return x, y

    def _probe_output(self, x: torch.Tensor) -> int:
        """Check on the first batch that the model accepts ``x``; return its number of classes."""
        try:
            out = self._logits(x[:1])
        except Exception as error:
            raise InvalidBatchError(f"model cannot take x of shape {tuple(x.shape)}: {error}") from error
        if out.dim() != 2:
            raise InvalidBatchError(f"model must output (batch, num_classes) logits; got shape {tuple(out.shape)}")
        if self.num_classes is not None and out.shape[1] != self.num_classes:
            raise ValueError(f"model outputs {out.shape[1]} logits but num_classes={self.num_classes}")
        return int(out.shape[1])

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
                    "monitor": {key: getattr(self.monitor, key) for key in _MONITOR_CONFIG},
                    "optimizer_type": type(self.optimizer).__name__,
                },
                "counters": {"samples_seen": self.samples_seen, "steps": self.steps},
                "training": {
                    "batch_plan": None if self.batch_plan is None else vars(self.batch_plan).copy(),
                    "base_lrs": self._base_lrs,
                    "stream_batch_size": self._stream_batch_size,
                    "pending": None if self._pending is None else list(self._pending),
                    "accumulated": self._accumulated,
                    "window_finite": self._window_finite,
                    "grads": [None if p.grad is None else p.grad.clone() for p in self.model.parameters()],
                },
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "replay_type": None if self.replay is None else type(self.replay).__name__,
                "replay": None if self.replay is None else self.replay.state_dict(),
                "monitor": self.monitor.state_dict(),
                "plugins": {plugin.name: plugin.state_dict() for plugin in self.plugins},
                "rng": {"torch": torch.get_rng_state()},
            }

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Atomically write a checkpoint into ``directory`` (created if needed)."""
        write_checkpoint(directory, self.state_dict())

    def export_onnx(self, directory: str | os.PathLike[str], **kwargs: Any) -> Path:
        """Write ONNX Runtime on-device training artifacts; see :func:`taste_cl.adapters.onnx.export`."""
        from taste_cl.adapters.onnx import export  # lazy: the [onnx] extra is optional

        return export(self, directory, **kwargs)

    def export(self, directory: str | os.PathLike[str], *, backend: str = "auto", **kwargs: Any) -> Path:
        """Write parity-checked on-device training artifacts with ``backend`` (``"onnxruntime"``,
        ``"executorch"`` or ``"auto"``); see :func:`taste_cl.adapters.device_export.export`."""
        from taste_cl.adapters.device_export import export  # lazy: optional extras

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
    ) -> OnlineLearner:
        """Rebuild a learner from :meth:`save` output around a freshly built ``model``.

        Built-in replay strategies are rebuilt from the checkpoint; pass ``replay`` for a
        custom one. On any error, ``model`` and ``optimizer`` are left as they were.
        """
        state = read_checkpoint(directory)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"checkpoint format {state.get('format')!r} is not supported (want {CHECKPOINT_FORMAT})")
        config = state["config"]
        replay = _rebuild_replay(state, replay)
        if monitor is None:
            monitor = StabilityPlasticityMonitor(**config["monitor"])
        if optimizer is not None and type(optimizer).__name__ != config["optimizer_type"]:
            raise CheckpointError(
                f"checkpoint holds {config['optimizer_type']} state; got a {type(optimizer).__name__} optimizer"
            )
        learner = cls(
            model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            replay=replay,
            replay_batch_size=int(config["replay_batch_size"]),
            train_iterations=int(config["train_iterations"]),
            num_classes=config["num_classes"],
            input_shape=config["input_shape"],
            monitor=monitor,
            plugins=plugins,
        )
        learner.load_state_dict(state)
        return learner

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; all or nothing for model and optimizer."""
        with self._lock:
            model_backup = copy.deepcopy(self.model.state_dict())
            optimizer_backup = copy.deepcopy(self.optimizer.state_dict())
            try:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                if self.replay is not None:
                    self.replay.load_state_dict(state["replay"])
                self.monitor.load_state_dict(state["monitor"])
                for plugin in self.plugins:
                    if plugin.name in state["plugins"]:
                        plugin.load_state_dict(state["plugins"][plugin.name])
            except (KeyError, RuntimeError, ValueError, TypeError) as error:
                self.model.load_state_dict(model_backup)
                self.optimizer.load_state_dict(optimizer_backup)
                raise CheckpointError(f"checkpoint does not fit this learner: {error}") from error
            self.samples_seen = int(state["counters"]["samples_seen"])
            self.steps = int(state["counters"]["steps"])
            training = state["training"]
            plan = training["batch_plan"]
            self.batch_plan = None if plan is None else BatchPlan(**plan)
            self._base_lrs = training["base_lrs"]
            self._stream_batch_size = training["stream_batch_size"]
            self._pending = None if training["pending"] is None else tuple(training["pending"])
            self._accumulated = int(training["accumulated"])
            self._window_finite = bool(training["window_finite"])
            for param, grad in zip(self.model.parameters(), training["grads"]):
                param.grad = grad
            torch.set_rng_state(state["rng"]["torch"])


def _total_norm(tensors: list[torch.Tensor]) -> float:
    """L2 norm of all ``tensors`` together (NaN or inf if any entry is)."""
    if not tensors:
        return 0.0
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors):
        # The fused kernel torch's own get_total_norm ends in, without its per-call
        # regrouping by device and dtype (half the cost of a small model's step).
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))
    return float(torch.nn.utils.get_total_norm(tensors))


def _rebuild_replay(state: dict[str, Any], replay: ReplayStrategy | None) -> ReplayStrategy | None:
    saved_type = state["replay_type"]
    if replay is not None:
        if type(replay).__name__ != saved_type:
            raise CheckpointError(f"checkpoint holds a {saved_type} buffer; got replay={type(replay).__name__}")
        return replay
    if saved_type is None:
        return None
    if saved_type not in _BUILTIN_REPLAY:
        raise CheckpointError(
            f"checkpoint holds a custom {saved_type} buffer: pass replay={saved_type}(...) to load()"
        )
    saved = state["replay"]
    return _BUILTIN_REPLAY[saved_type](int(saved["capacity"]), seed=int(saved["seed"]))
