"""A learner's checkpoints and exports: what :class:`~taste_cl.learner.learner.OnlineLearner` saves, loads and ships.

Kept apart from the training loop (``learner.py``): :class:`LearnerPersistence` is the
learner's base class and holds the methods that write or read its whole state
(:mod:`taste_cl.learner.learner_state`, :mod:`taste_cl.learner.restore`) and hand it to a
device exporter; the loop itself never calls them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from taste_cl._batch import Spec
from taste_cl.learner.learner_state import learner_state, load_learner
from taste_cl.learner.restore import restore_state
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.outputs import OutputLike, OutputSelector
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import ReplayStrategy
from taste_cl.state.checkpoint import CheckpointLimits, write_checkpoint
from taste_cl.strategies import Strategy
from taste_cl.tasks import Task

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner

__all__ = ["LearnerPersistence"]


class LearnerPersistence:
    """Checkpoints (:meth:`save`, :meth:`load`, :meth:`state_dict`, :meth:`load_state_dict`) and
    device exports (:meth:`export`) of an online learner."""

    if TYPE_CHECKING:  # set by OnlineLearner.__init__
        _lock: threading.RLock
        _score_eval: bool
        output: OutputSelector | None
        max_classes: int | None
        max_grad_norm: float | None
        call: str
        frozen_norm: str
        input_spec: Spec | None
        input_shape: tuple[int, ...] | None
        output_shape: tuple[int, ...] | None
        num_classes: int | None
        task: Task | None
        strategy: Strategy

    @property
    def _as_learner(self) -> OnlineLearner:
        """This object as the :class:`~taste_cl.learner.learner.OnlineLearner` it is (for the type checker)."""
        return cast("OnlineLearner", self)

    def restore_config(
        self,
        *,
        output: OutputSelector | None,
        max_classes: int | None,
        max_grad_norm: float | None,
        call: str,
        frozen_norm: str,
        task: Task | None,
        input_spec: Spec | None,
        output_shape: tuple[int, ...] | None,
        num_classes: int | None,
        score_eval: bool,
    ) -> None:
        """Take a checkpoint's ``config``, checked by :mod:`taste_cl.learner.sections`: the options it was saved
        with and what its first batch settled (a None task keeps this learner's); cannot fail."""
        self.output, self.max_classes, self.max_grad_norm = output, max_classes, max_grad_norm
        self.call, self.frozen_norm = call, frozen_norm
        self.input_spec, self.output_shape, self.num_classes = input_spec, output_shape, num_classes
        self.input_shape = None if input_spec is None or not input_spec.is_tensor else tuple(input_spec.shape)
        self.task = task if task is not None else self.task
        self.strategy.task = self.task  # as the strategy's check() on the first batch would
        self._score_eval = score_eval

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, buffer, monitor, test-time adapter, plugins, RNG."""
        with self._lock:
            return learner_state(self._as_learner)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Atomically write a checkpoint into ``directory`` (created if needed); no pickle, see :mod:`taste_cl.state.checkpoint`."""
        write_checkpoint(directory, self.state_dict, lock=self._lock)  # a consistent snapshot, written unlocked

    def export(self, directory: str | os.PathLike[str], *, backend: str = "auto", **kwargs: Any) -> Path:
        """Write parity-checked on-device training artifacts with ``backend`` (``"onnxruntime"``,
        ``"executorch"`` or ``"auto"``); see :func:`taste_cl.adapters.device.backends.export`."""
        from taste_cl.adapters.device.backends import export  # lazy: optional extras

        return export(self._as_learner, directory, backend=backend, **kwargs)

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
        output: OutputLike | None = None,
    ) -> OnlineLearner:
        """Rebuild a learner from :meth:`save` output around a freshly built ``model``.

        Built-in replay buffers and strategies are rebuilt from the checkpoint; pass
        ``replay`` / ``strategy`` for a custom one. The task, input structure, output shape
        and ``output`` selection (a key or an index) come from the checkpoint; a callable
        ``output=`` cannot be saved, so pass it again (the load is refused without it).
        Files over ``max_bytes`` are refused before being read. The whole checkpoint is
        validated before anything is applied: on any error
        :class:`~taste_cl.exceptions.CheckpointError` is raised (its subclass
        ``CheckpointNotFoundError`` for a missing file) and ``model``, ``optimizer``,
        ``replay``, ``monitor`` and ``plugins`` are left exactly as they were.
        """
        return load_learner(
            cast("type[OnlineLearner]", cls), directory, model=model, optimizer=optimizer, loss_fn=loss_fn, replay=replay,
            monitor=monitor, plugins=plugins, max_bytes=max_bytes, strategy=strategy, output=output,
        )  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, all or nothing.

        Every section is validated against this learner first (shapes and dtypes of the
        model, optimizer groups and state, gradients, batch plan, pending samples,
        counters, replay and monitor contents, test-time adapter, RNG and guard state); only then is
        anything changed. On any error :class:`~taste_cl.exceptions.CheckpointError` is
        raised and the learner, its replay, monitor and plugins are exactly as before.
        """
        with self._lock:
            restore_state(self._as_learner, state)
