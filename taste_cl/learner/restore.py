"""Restore a learner's state: its own sections and its parts', validated all, then applied all.

The learner's sections live in :mod:`.sections`; the parts' are here, each asking the part that
owns the state to check it without changing anything: the replay buffer (a trial buffer loads
it), the strategy (a copy loads a custom one's), the monitor
(:meth:`~taste_cl.monitor.monitor.StabilityPlasticityMonitor.check_state`) and the update guard
(:meth:`~taste_cl.guards.update.UpdateGuard.parse_state`) and the test-time adapter
(:meth:`~taste_cl.adaptation.adapter.TestTimeAdapter.parse_state`); samples they hold must pass the checks
a stream batch passes. :mod:`taste_cl.state.restore` runs every parser, loads the plugins' states
(each put back if one fails) and only then applies every section; on any error the learner and
every part are exactly as they were and :class:`~taste_cl.exceptions.CheckpointError` names the section.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from taste_cl.adaptation.adapter import TestTimeAdapter
from taste_cl.guards.update import UpdateGuard
from taste_cl.learner.heads import grow_for_state
from taste_cl.learner.sections import LEARNER_SECTIONS, Context
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy, ReservoirReplay, SeededStrategy
from taste_cl.state.restore import (
    Apply,
    check_format,
    check_int,
    check_keys,
    check_tensor,
    parse_sections,
    restore_sections,
    same,
    short,
    validate_sections,
)  # fmt: skip
from taste_cl.strategies import BUILTIN_STRATEGIES, FieldSpec, LwF, Strategy

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner

__all__ = ["BUILTIN_REPLAY", "restore_state", "validate_state"]

BUILTIN_REPLAY: dict[str, type[ReservoirReplay | ClassBalancedReplay]] = {
    "ReservoirReplay": ReservoirReplay,
    "ClassBalancedReplay": ClassBalancedReplay,
}
_TOP_LEVEL_EXTRA = ("replay_type",)


# ------------------------------------------------------------------------ replay
def _trial_replay(replay: ReplayStrategy) -> ReplayStrategy:
    """A throwaway strategy to try a state on: a fresh built-in, or a deep copy of a custom one."""
    if isinstance(replay, (ReservoirReplay, ClassBalancedReplay)) and type(replay) in BUILTIN_REPLAY.values():
        return type(replay)(replay.capacity, seed=replay.seed)
    return copy.deepcopy(replay)


def _stored_samples(replay: SeededStrategy) -> tuple[Any, torch.Tensor] | None:
    """All samples a built-in strategy holds, as ``(x, y)``; None when it is empty."""
    storage = replay.storage
    if not len(storage):
        return None
    return storage.gather(torch.arange(len(storage)))


def _replay(ctx: Context) -> Apply:
    replay, saved = ctx.learner.replay, ctx.state.get("replay")
    saved_type = ctx.state.get("replay_type")
    if replay is None:
        if saved_type is not None or saved is not None:
            raise ValueError(f"checkpoint holds a {short(saved_type)} buffer; this learner has no replay")
        return lambda: None
    if not same(saved_type, type(replay).__name__):
        raise ValueError(f"checkpoint holds a {short(saved_type)} buffer; got replay={type(replay).__name__}")
    trial = _trial_replay(replay)
    try:
        trial.load_state_dict(saved)  # type: ignore[arg-type]  # a non-dict is refused by the strategy
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise ValueError(f"replay state: {error}") from error
    if isinstance(trial, (ReservoirReplay, ClassBalancedReplay)):
        stored = _stored_samples(trial)
        if stored is not None:
            ctx.check_samples("replay.storage", *stored)
    _check_strategy_fields(ctx, trial)
    return lambda: replay.load_state_dict(saved)  # type: ignore[arg-type]


def _held_fields(replay: ReplayStrategy, strategy: Strategy) -> tuple[str, int, dict[str, Any]] | None:
    """Where a buffer's extra per-sample fields are in the state, how many samples it holds,
    and the fields; None when they cannot be read (a custom buffer whose strategy stores none)."""
    if isinstance(replay, (ReservoirReplay, ClassBalancedReplay)):
        storage = replay.storage
        return "replay.storage.fields", len(storage), storage.contents()[2] if len(storage) else {}
    if not strategy.stored_fields or not len(replay):
        return None
    with torch.random.fork_rng(devices=[]):  # a custom buffer may draw from the global generator
        _, y, fields = replay.sample(len(replay), with_fields=True)  # type: ignore[call-arg, misc]  # strategy.check() saw the keyword
    return "replay.fields", y.shape[0], fields


def _check_fields(where: str, rows: int, fields: dict[str, Any], specs: dict[str, FieldSpec | None], whose: str) -> None:
    """The extra per-sample fields of a buffer holding ``rows`` samples must be exactly those
    ``specs`` names (what ``whose`` stores): one finite row per stored sample, of the declared
    per-sample shape and dtype where one is declared."""
    if rows == 0:
        return
    check_keys(where, fields, set(specs), f" from what {whose} stores")
    for name, spec in specs.items():
        tensor = check_tensor(f"{where}.{name}", fields[name], dtype=None if spec is None else spec[1])
        per_sample = tuple(tensor.shape[1:]) if spec is None else spec[0]
        if tensor.dim() == 0 or tuple(tensor.shape) != (rows, *per_sample):
            raise ValueError(
                f"`{where}.{name}` must have shape {(rows, *per_sample)}: a {per_sample} row per stored sample; got {tuple(tensor.shape)}"
            )


def _check_strategy_fields(ctx: Context, replay: ReplayStrategy) -> None:
    """A (trial) buffer's extra fields must be those the learner's strategy stores, of the
    shape and dtype it declares for this model's outputs (DER++: the logits,
    ``(n, *output_shape)`` in the model's dtype)."""
    strategy = ctx.learner.strategy
    held = _held_fields(replay, strategy)
    if held is not None:
        specs = dict.fromkeys(strategy.stored_fields) if ctx.output_shape is None else strategy.field_specs(ctx.output_shape, ctx.learner.dtype)
        _check_fields(*held, specs, f"strategy {strategy.name!r}")


# ------------------------------------------------------- strategy, monitor, guard
def _strategy(ctx: Context) -> Apply:
    """The strategy's own state (its description was checked with the config): the keys of
    the live strategy's state; LwF's chunk count and snapshot (a state of this model); a
    custom strategy's state is tried on a copy first."""
    saved = ctx.get("strategy")
    learner = ctx.learner
    strategy = learner.strategy
    check_keys("strategy", saved, set(strategy.state_dict()), f" from what strategy {strategy.name!r} keeps")
    if isinstance(strategy, LwF):
        check_int("strategy.chunks", saved["chunks"])
        teacher = saved["teacher"]
        if teacher is not None:
            model = learner.model.state_dict()
            if not isinstance(teacher, dict):
                raise ValueError(f"`strategy.teacher` must be None or a model state; got {type(teacher).__name__}")
            check_keys("strategy.teacher", teacher, set(model), " from the model's state")
            for name, tensor in model.items():
                check_tensor(f"strategy.teacher.{name}", teacher[name], shape=tuple(tensor.shape), dtype=tensor.dtype)
    if type(strategy) not in BUILTIN_STRATEGIES.values():
        # the copy shares what the strategy may refer to (the learner and its parts), never copies them
        shared = {id(part): part for part in (learner, learner.model, learner.optimizer, learner.monitor, learner.replay)}
        try:
            with torch.random.fork_rng(devices=[]):
                copy.deepcopy(strategy, shared).load_state_dict(saved)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as error:
            raise ValueError(f"strategy state: {error}") from error
    return lambda: strategy.load_state_dict(saved)


def _monitor(ctx: Context) -> Apply:
    saved = ctx.get("monitor")
    monitor = ctx.learner.monitor
    try:
        parsed = monitor.check_state(saved)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise ValueError(str(error)) from error
    stored = _stored_samples(parsed["probe"])  # its sample ids were checked by the monitor
    if stored is not None:
        ctx.check_samples("monitor.probe", *stored)
    return lambda: monitor.load_state_dict(saved)


def _guard(ctx: Context) -> Apply:
    state = ctx.get("guard")
    try:
        UpdateGuard.parse_state(state)
    except (ValueError, TypeError) as error:
        raise ValueError(str(error)) from error
    guard, optimizer = ctx.learner.guard, ctx.learner.optimizer
    return lambda: guard.load_state_dict(state, optimizer.param_groups)  # after the optimizer's section


def _adaptation(ctx: Context) -> Apply:
    """The test-time adapter's state, checked by the adapter: absent (a checkpoint from before adapters were saved),
    the learner's adapter is kept as it is; None (the saved learner had none), the learner's is dropped; else it is
    applied to the learner's adapter (of the same method), or to a new one of the built-in method it names."""
    if "adaptation" not in ctx.state:
        return lambda: None
    learner, saved = ctx.learner, ctx.state["adaptation"]
    if saved is None:
        return lambda: setattr(learner, "adapter", None)
    if learner.adapter is not None:
        return learner.adapter.parse_state(saved, learner.model)
    adapter, apply = TestTimeAdapter.from_state(saved, learner.model)

    def install() -> None:
        apply()
        learner.adapter = adapter

    return install


def _plugins(ctx: Context) -> Apply:
    plugins = ctx.get("plugins")
    if not all(isinstance(k, str) and isinstance(v, dict) for k, v in plugins.items()):
        raise ValueError("`plugins` must map plugin names to dicts")
    return lambda: None  # loaded before the other sections apply (taste_cl.state.restore.load_plugins)


_PARTS: dict[str, Callable[[Context], Apply]] = {
    "guard": _guard, "replay": _replay, "strategy": _strategy, "monitor": _monitor, "adaptation": _adaptation, "plugins": _plugins,
}  # fmt: skip
SECTIONS: dict[str, Callable[[Context], Apply]] = {
    name: {**LEARNER_SECTIONS, **_PARTS}[name]
    for name in ("config", "counters", "model", "optimizer", "guard", "training", "replay", "strategy", "monitor", "adaptation", "rng", "plugins")
}
"""Every section's parser in parsing order: later parsers read what earlier ones settled (``config``: the task and shapes)."""


# ------------------------------------------------------------------------- entry
def _parse(learner: OnlineLearner, state: Any) -> list[Apply]:
    state = check_format(state, SECTIONS, _TOP_LEVEL_EXTRA)
    ctx = Context(learner, state)
    return parse_sections([(name, partial(parse, ctx)) for name, parse in SECTIONS.items()])


def restore_state(learner: OnlineLearner, state: Any) -> None:
    """Validate ``state`` against ``learner``, then apply it; all or nothing (see the module docstring).

    A checkpoint of a learner whose classifier grew (``max_classes``) first grows this
    learner's to the same width (see :func:`~taste_cl.learner.heads.grow_for_state`), undone on any error."""
    undo = grow_for_state(learner, state)
    restore_sections(lambda: _parse(learner, state), learner.plugins, state, undo)


def validate_state(learner: OnlineLearner, state: Any) -> None:
    """Raise :class:`~taste_cl.exceptions.CheckpointError` unless ``state`` fits ``learner``, its plugins' states
    included; changes nothing (each plugin's state is tried and put back)."""
    undo = grow_for_state(learner, state)
    validate_sections(lambda: _parse(learner, state), learner.plugins, state, undo)
