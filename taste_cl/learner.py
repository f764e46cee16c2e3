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
from dataclasses import dataclass
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

__all__ = ["ObserveStats", "OnlineLearner"]

CHECKPOINT_FORMAT = 1
_BUILTIN_REPLAY: dict[str, type[ReservoirReplay] | type[ClassBalancedReplay]] = {
    "ReservoirReplay": ReservoirReplay,
    "ClassBalancedReplay": ClassBalancedReplay,
}
_MONITOR_CONFIG = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "max_events", "seed")


@dataclass(frozen=True)
class ObserveStats:
    """What one ``observe`` call did.

    ``loss`` is the mean training loss over stream and replay samples; ``accuracy`` is
    the prequential accuracy on the stream samples, scored before training on them.
    ``skipped`` is true when a non-finite loss or gradient was detected and no update
    was applied.
    """

    loss: float
    accuracy: float
    samples: int
    replay_samples: int
    batch_size: int
    steps: int
    step_time_s: float
    skipped: bool = False


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
        self.samples_seen = 0
        self.steps = 0
        self._lock = threading.RLock()
        for plugin in self.plugins:
            plugin.on_attach(self)

    # ------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        first = next(self.model.parameters(), None)
        return first.dtype if first is not None else torch.float32

    # -------------------------------------------------------------- learning
    def observe(self, batch: BatchLike) -> ObserveStats:
        """Test-then-train on one stream batch ``(x, y)`` or ``{"x": x, "y": y}``.

        Raises :class:`~taste_cl.exceptions.InvalidBatchError` (a ``ValueError``) on a
        malformed batch, before anything is changed.
        """
        with self._lock:
            x, y = self._validate(batch)
            first = self.steps == 0
            if first:
                for plugin in self.plugins:
                    plugin.on_first_batch(self, x)
            start = time.perf_counter()
            n_replay = min(self.replay_batch_size, len(self.replay)) if self.replay is not None else 0
            steps, losses = 0, []
            for iteration in range(self.train_iterations):
                train_x, train_y = self._with_replay(x, y, n_replay)
                logits, loss, skipped = self.train_step(train_x, train_y)
                if iteration == 0:
                    stream_logits = logits[: x.shape[0]]  # scored before any update on this batch
                steps += not skipped
                losses.append(loss)
            elapsed = time.perf_counter() - start
            self.monitor.record(x, y, stream_logits)
            if self.replay is not None:
                self.replay.add(x, y)
            self.samples_seen += x.shape[0]
            self.steps += 1
            if self.monitor.due():
                self.monitor.evaluate(self._logits)
            stats = ObserveStats(
                loss=sum(losses) / len(losses),
                accuracy=float((stream_logits.argmax(dim=1) == y).float().mean()),
                samples=x.shape[0],
                replay_samples=n_replay,
                batch_size=x.shape[0] + n_replay,
                steps=steps,
                step_time_s=elapsed,
                skipped=steps < self.train_iterations,
            )
            for plugin in self.plugins:
                plugin.after_observe(self, stats)
            self.monitor.dispatch()
            return stats

    def _with_replay(self, x: torch.Tensor, y: torch.Tensor, n_replay: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not n_replay:
            return x, y
        assert self.replay is not None
        replay_x, replay_y = self.replay.sample(n_replay)
        return torch.cat([x, replay_x.to(self.device)]), torch.cat([y, replay_y.to(self.device)])

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
        """One optimizer step on validated tensors; return (detached logits, loss, skipped).

        A non-finite loss or gradient skips the update and emits ``numerical_fault``.
        """
        for plugin in self.plugins:
            plugin.before_step(self)
        self.model.train()
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        loss_value = float(loss.detach())
        skipped = not math.isfinite(loss_value)
        if not skipped:
            loss.backward()
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            skipped = bool(grads) and not math.isfinite(float(torch.nn.utils.get_total_norm(grads)))
            if not skipped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.monitor.emit("numerical_fault", loss=loss_value)
        return logits.detach(), loss_value, skipped

    def predict(self, x: Any) -> torch.Tensor:
        """Logits for ``x`` in eval mode without gradients; changes no state."""
        with self._lock:
            features = to_features(x, feature_shape=self.input_shape, dtype=self.dtype, device=self.device)
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
        x = to_features(raw_x, feature_shape=self.input_shape, dtype=self.dtype, device=self.device)
        num_classes = self.num_classes if self.input_shape is not None else self._probe_output(x)
        y = to_labels(raw_y, n=x.shape[0], num_classes=num_classes, device=self.device)
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
            torch.set_rng_state(state["rng"]["torch"])


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
