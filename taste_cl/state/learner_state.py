"""An :class:`~taste_cl.learner.OnlineLearner`'s state: what ``state_dict`` collects and how ``load`` rebuilds it.

The checkpoint format (:mod:`.checkpoint`) and the validate-then-apply restore
(:mod:`.restore`) know nothing of how a learner is built; this module is the glue: it
gathers every section of a learner's state, and rebuilds a learner from a checkpoint
folder around a freshly built model, checking the whole state before anything is applied.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from taste_cl.exceptions import CheckpointError
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.outputs import OutputLike
from taste_cl.state.checkpoint import CheckpointLimits, read_checkpoint
from taste_cl.state.restore import CHECKPOINT_FORMAT, MONITOR_CONFIG, build_parts, validate_state
from taste_cl.strategies import Strategy, resolve_strategy

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner
    from taste_cl.plugins import LearnerPlugin
    from taste_cl.replay import ReplayStrategy

__all__ = ["learner_state", "load_learner"]

L = TypeVar("L", bound="OnlineLearner")


def learner_state(learner: OnlineLearner) -> dict[str, Any]:
    """Everything a resumed run needs: model, optimizer, buffer, monitor, plugins, RNG (call under the learner's lock)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "config": {
            "replay_batch_size": learner.replay_batch_size,
            "train_iterations": learner.train_iterations,
            "num_classes": learner.num_classes,
            "max_classes": learner.max_classes,
            "max_grad_norm": learner.max_grad_norm,
            "frozen_norm": learner.frozen_norm,
            "call": learner.call,
            "input_shape": None if learner.input_shape is None else list(learner.input_shape),
            "input_spec": None if learner.input_spec is None else learner.input_spec.to_json(),
            "output_shape": None if learner.output_shape is None else list(learner.output_shape),
            "output": None if learner.output is None else learner.output.to_json(),
            "task": None if learner.task is None else learner.task.config(),
            "score_eval": learner.score_eval,
            "monitor": {key: getattr(learner.monitor, key) for key in MONITOR_CONFIG},
            "optimizer_type": type(learner.optimizer).__name__,
            "strategy": {"name": learner.strategy.name, "config": learner.strategy.config()},
        },
        "counters": {"samples_seen": learner.samples_seen, "steps": learner.steps},
        "training": {
            **learner._batcher.state_dict(),
            "grads": [None if p.grad is None else p.grad.clone() for p in learner.model.parameters()],
        },
        "model": learner.model.state_dict(),
        "optimizer": learner.optimizer.state_dict(),
        "replay_type": None if learner.replay is None else type(learner.replay).__name__,
        "replay": None if learner.replay is None else learner.replay.state_dict(),
        "monitor": learner.monitor.state_dict(),
        "strategy": learner.strategy.state_dict(),
        "plugins": {plugin.name: plugin.state_dict() for plugin in learner.plugins},
        "rng": {"torch": torch.get_rng_state()},
        "guard": learner.guard.state_dict(learner.optimizer.param_groups),
    }


def load_learner(
    cls: type[L],
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    replay: ReplayStrategy | None,
    monitor: StabilityPlasticityMonitor | None,
    plugins: Sequence[LearnerPlugin],
    max_bytes: int,
    strategy: Strategy | None,
    output: OutputLike | None,
) -> L:
    """``cls.load``: read the checkpoint in ``directory``, check it whole on a throwaway learner, then build and restore."""
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
        "output": output,  # checked against the checkpoint's, which a key or index comes from (section config)
        "max_classes": config.get("max_classes"),  # checked with the config section
        "max_grad_norm": config.get("max_grad_norm"),
        "frozen_norm": config.get("frozen_norm", "train"),  # checked with the config section; "train": how an older one trained
        "call": config.get("call", "keywords"),  # checked with the config section; older checkpoints spread dicts
    }
    # Checked whole, plugin states included, on a throwaway learner before anything passed in attaches: it has a
    # twin of the monitor and copies of the strategy and plugins (they subscribe to the monitor and bind to the learner).
    shared = {id(part): part for part in (model, optimizer, replay, monitor)}
    trial_parts = {**parts, "monitor": _twin(monitor), "strategy": copy.deepcopy(parts["strategy"], dict(shared))}
    validate_state(cls(model, **trial_parts, plugins=[_stand_in(plugin, shared) for plugin in plugins]), state)
    learner = cls(model, **parts, plugins=plugins)
    learner.load_state_dict(state)
    return learner


def _twin(monitor: StabilityPlasticityMonitor) -> StabilityPlasticityMonitor:
    """A fresh monitor with ``monitor``'s settings and a copy of its drift detector: what a checkpoint's
    monitor section is checked against, without the subscribers ``monitor`` has or would get."""
    settings = {key: getattr(monitor, key) for key in MONITOR_CONFIG}
    return StabilityPlasticityMonitor(**settings, drift_detector=copy.deepcopy(monitor.drift_detector))


def _stand_in(plugin: LearnerPlugin, shared: dict[int, Any]) -> LearnerPlugin:
    """A copy of ``plugin`` to try its checkpointed state on (some plugins check theirs only when attached).

    A deep copy that shares the learner's parts (``shared``, by id); a plugin holding what cannot be
    copied (a lock, a process handle) gets a shallow one: attaching rebinds only the copy's attributes,
    and the trial load is put back (see :func:`~taste_cl.state.restore.validate_state`).
    """
    try:
        return copy.deepcopy(plugin, dict(shared))
    except (TypeError, RuntimeError, copy.Error):
        return copy.copy(plugin)


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
