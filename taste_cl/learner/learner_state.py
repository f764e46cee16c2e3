"""An :class:`~taste_cl.learner.OnlineLearner`'s state: what ``state_dict`` collects and how ``load`` rebuilds it.

The checkpoint format (:mod:`taste_cl.state.checkpoint`) knows nothing of how a learner is
built, and the restore (:mod:`.restore`) only checks a state against a live learner; this
module is the glue: it gathers every section of a learner's state (each part gives its own),
and rebuilds a learner from a checkpoint folder around a freshly built model: the parts the
checkpoint names are built from its checked config, then the whole state is checked on a
throwaway learner before anything passed in is touched.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from taste_cl._batch import Spec, check_call
from taste_cl.exceptions import CheckpointError
from taste_cl.learner.frozen import check_frozen_norm
from taste_cl.learner.restore import BUILTIN_REPLAY, validate_state
from taste_cl.learner.sections import (
    check_config,
    max_classes_of,
    max_grad_norm_of,
    monitor_kwargs,
    parse_strategy,
    parse_task,
    rebuilt_strategy,
    strategy_fits,
)  # fmt: skip
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.outputs import OutputLike
from taste_cl.replay import ReplayStrategy
from taste_cl.state.checkpoint import CheckpointLimits, read_checkpoint
from taste_cl.state.restore import CHECKPOINT_FORMAT, check_int, same, short
from taste_cl.strategies import Strategy, resolve_strategy

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner
    from taste_cl.plugins import LearnerPlugin

__all__ = ["build_parts", "learner_state", "load_learner"]

L = TypeVar("L", bound="OnlineLearner")


def learner_state(learner: OnlineLearner) -> dict[str, Any]:
    """Everything a resumed run needs: model, optimizer, buffer, monitor, test-time adapter, plugins, RNG (call under the learner's lock)."""
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
            "monitor": learner.monitor.settings(),
            "optimizer_type": type(learner.optimizer).__name__,
            "strategy": {"name": learner.strategy.name, "config": learner.strategy.config()},
        },
        "counters": {"samples_seen": learner.samples_seen, "steps": learner.steps},
        "training": {
            **learner.batcher.state_dict(),
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
        "adaptation": None if learner.adapter is None else learner.adapter.state_dict(),
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
    trial_parts = {**parts, "monitor": monitor.twin(), "strategy": copy.deepcopy(parts["strategy"], dict(shared))}
    validate_state(cls(model, **trial_parts, plugins=[_stand_in(plugin, shared) for plugin in plugins]), state)
    learner = cls(model, **parts, plugins=plugins)
    learner.load_state_dict(state)
    return learner


def _stand_in(plugin: LearnerPlugin, shared: dict[int, Any]) -> LearnerPlugin:
    """A copy of ``plugin`` to try its checkpointed state on (some plugins check theirs only when attached).

    A deep copy that shares the learner's parts (``shared``, by id); a plugin holding what cannot be
    copied (a lock, a process handle) gets a shallow one: attaching rebinds only the copy's attributes,
    and the trial load is put back (see :func:`~taste_cl.learner.restore.validate_state`).
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


def build_parts(
    state: Any,
    *,
    model: torch.nn.Module,
    replay: ReplayStrategy | None,
    monitor: StabilityPlasticityMonitor | None,
    max_bytes: int,
) -> tuple[dict[str, Any], ReplayStrategy | None, StabilityPlasticityMonitor]:
    """What :meth:`OnlineLearner.load` builds the learner from: validated config, replay and monitor.

    Built-in replay strategies are rebuilt from the checkpoint with a capacity bounded
    so their preallocated store fits ``max_bytes``; a built-in strategy named by the
    checkpoint must rebuild from its config and work with the task and buffer. Nothing
    passed in is modified.
    """
    try:
        if not isinstance(state, dict) or not same(state.get("format"), CHECKPOINT_FORMAT):
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint format {short(found)} is not supported (want {CHECKPOINT_FORMAT})")
        config = state.get("config")
        if not isinstance(config, dict):
            raise ValueError("section `config` is missing or not a dict")  # noqa: TRY004 (a bad state is a ValueError)
        check_config(config)
        config = {**config, "task": parse_task(config["task"]), "strategy": parse_strategy(config["strategy"])}
        max_classes_of(config.get("max_classes"), None)  # the learner is built with it
        max_grad_norm_of(config.get("max_grad_norm"))
        check_call(config.get("call", "keywords"), "config.call")
        check_frozen_norm(config.get("frozen_norm", "train"), "config.frozen_norm")
        try:
            entries = 1 if config["input_spec"] is None else Spec.from_json(config["input_spec"]).entries
        except ValueError as error:
            raise ValueError(f"`config.input_spec`: {error}") from error
        row_bytes = 8 + 8 * max(1, entries)
        largest = max(1, max_bytes // row_bytes)  # samples whose store fits the memory bound
        kwargs = monitor_kwargs(config["monitor"])
        check_int("config.monitor.probe_capacity", kwargs["probe_capacity"], 1, largest)
        built_monitor = monitor if monitor is not None else StabilityPlasticityMonitor(**kwargs)
        built_replay = _rebuild_replay(state, replay, largest)
        strategy = None if config["strategy"] is None else rebuilt_strategy(config["strategy"])
        if strategy is not None:  # the learner is built with it: it must work with the task and buffer
            strategy_fits(strategy, config["task"], built_replay)
        return config, built_replay, built_monitor
    except (ValueError, TypeError, KeyError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint does not fit this learner: {error}") from error


def _rebuild_replay(state: dict[str, Any], replay: ReplayStrategy | None, largest: int) -> ReplayStrategy | None:
    saved_type = state.get("replay_type")
    if replay is not None:
        if not same(saved_type, type(replay).__name__):
            raise CheckpointError(f"checkpoint holds a {short(saved_type)} buffer; got replay={type(replay).__name__}")
        return replay
    if saved_type is None:
        return None
    if saved_type not in BUILTIN_REPLAY:
        raise CheckpointError(f"checkpoint holds a custom {short(saved_type)} buffer: pass replay={saved_type}(...) to load()")
    saved = state.get("replay")
    if not isinstance(saved, dict):
        raise ValueError("section `replay` must be a dict")  # noqa: TRY004 (a bad state is a ValueError)
    capacity = check_int("replay.capacity", saved.get("capacity"), 1, largest)
    seed = check_int("replay.seed", saved.get("seed"), 0, 2**64 - 1)
    return BUILTIN_REPLAY[saved_type](capacity, seed=seed)
