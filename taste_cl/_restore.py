"""Validate a learner state against the live learner, then apply all of it or nothing.

:func:`restore_state` runs every registered section parser over the state first. A
parser checks its section (types, ranges, finiteness, shapes and dtypes against the live
model and optimizer, label range, capacities, RNG state) and returns a closure that
applies it and cannot fail. Only when every section has parsed are plugin states loaded
(undone if one fails) and the closures run; on any error the learner and every object
passed to it are left exactly as they were and :class:`CheckpointError` names the section.

New state sections register a parser with :func:`section` (the order of registration
is the order of parsing; later parsers may read what earlier ones put in the context).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._batch import count_nonfinite
from taste_cl.exceptions import CheckpointError
from taste_cl.monitor import StabilityPlasticityMonitor
from taste_cl.monitor import _parse_state as parse_monitor_state
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy, ReservoirReplay
from taste_cl.safety import UpdateGuard, hyperparameter_problem

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["CHECKPOINT_FORMAT", "build_parts", "restore_state", "section", "validate_state"]

CHECKPOINT_FORMAT = 2
CONFIG_KEYS = {"replay_batch_size", "train_iterations", "num_classes", "input_shape", "monitor", "optimizer_type"}
"""Keys of the ``config`` section; a new config entry is added here and checked in :func:`_config`."""
MONITOR_CONFIG = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "max_events", "seed")
_BUILTIN_REPLAY: dict[str, type[ReservoirReplay | ClassBalancedReplay]] = {
    "ReservoirReplay": ReservoirReplay,
    "ClassBalancedReplay": ClassBalancedReplay,
}
_INT_LIMIT = 2**62  # counters beyond this are corrupt (and would overflow int64 tensors)
_TOP_LEVEL_EXTRA = ("format", "replay_type")

Apply = Callable[[], None]


class _Invalid(ValueError):
    """A section value breaks a rule; the message names the field, the rule and the value."""


@dataclass
class _Context:
    """What the parsers share: the learner, the raw state, and facts parsed so far."""

    learner: OnlineLearner
    state: dict[str, Any]
    num_classes: int | None = None
    input_shape: tuple[int, ...] | None = None
    accumulation_steps: int = 1
    notes: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, kind: type | tuple[type, ...] = dict) -> Any:
        if name not in self.state:
            raise _Invalid(f"section `{name}` is missing")
        value = self.state[name]
        if not isinstance(value, kind):
            raise _Invalid(f"section `{name}` must be a {_kind_name(kind)}; got {type(value).__name__}")
        return value


_SECTIONS: dict[str, Callable[[_Context], Apply]] = {}


def section(name: str) -> Callable[[Callable[[_Context], Apply]], Callable[[_Context], Apply]]:
    """Register the parser of state section ``name``."""

    def register(parser: Callable[[_Context], Apply]) -> Callable[[_Context], Apply]:
        _SECTIONS[name] = parser
        return parser

    return register


# ------------------------------------------------------------------ small checks
def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _int(where: str, value: Any, low: int = 0, high: int = _INT_LIMIT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _Invalid(f"`{where} == {_short(value)}`, must be an int in [{low}, {high}]")
    return value


def _number(where: str, value: Any, *, low: float = -math.inf, positive: bool = False) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(f"`{where} == {_short(value)}`, must be a number")
    number = float(value)
    if not math.isfinite(number) or number < low or (positive and number <= 0):
        rule = "> 0" if positive else f">= {low:g}"
        raise _Invalid(f"`{where} == {number}`, must be finite and {rule}")
    return number


def _tensor(where: str, value: Any, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _Invalid(f"`{where}` must be a tensor; got {type(value).__name__}")
    if shape is not None and tuple(value.shape) != shape:
        raise _Invalid(f"`{where}` must have shape {shape}; got {tuple(value.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise _Invalid(f"`{where}` must have dtype {dtype}; got {value.dtype}")
    if (value.is_floating_point() or value.is_complex()) and count_nonfinite(value):
        raise _Invalid(f"`{where}` holds {count_nonfinite(value)} non-finite values")
    return value


def _same(value: Any, expected: int | str) -> bool:
    """``value == expected`` for a value of exactly the expected type (a tensor never compares)."""
    return type(value) is type(expected) and value == expected


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _keys(where: str, value: dict[str, Any], expected: set[str]) -> None:
    if set(value) != expected:
        missing, extra = sorted(expected - set(value)), sorted(map(str, set(value) - expected))
        raise _Invalid(f"`{where}` keys differ: missing {missing[:5]}, unexpected {extra[:5]}")


def check_samples(ctx: _Context, where: str, x: Any, y: Any) -> None:
    """Stored samples (pending, replay, probe) must fit the learner: feature shape, finite, labels in range."""
    x = _tensor(f"{where}.x", x)
    y = _tensor(f"{where}.y", y, dtype=torch.long)
    n = y.shape[0] if y.dim() == 1 else -1
    if x.dim() < 1 or x.shape[0] != n:
        raise _Invalid(f"`{where}` must hold x of shape (n, ...) and y of shape (n,); got {tuple(x.shape)} and {tuple(y.shape)}")
    if n == 0:
        return
    if ctx.input_shape is None or ctx.num_classes is None:
        raise _Invalid(f"`{where}` holds samples but the checkpoint has no input_shape/num_classes")
    if tuple(x.shape[1:]) != ctx.input_shape:
        raise _Invalid(f"`{where}.x` has feature shape {tuple(x.shape[1:])}; the learner takes {ctx.input_shape}")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= ctx.num_classes:
        raise _Invalid(f"`{where}.y` has labels in [{low}, {high}]; must be in [0, {ctx.num_classes - 1}]")


def _generator_state(where: str, value: Any) -> torch.Tensor:
    value = _tensor(where, value, dtype=torch.uint8)
    try:
        torch.Generator().set_state(value.cpu())
    except RuntimeError as error:
        raise _Invalid(f"`{where}` is not a valid generator state: {error}") from error
    return value


# ------------------------------------------------------------------------ sections
def monitor_kwargs(config: Any) -> dict[str, Any]:
    """Validated constructor arguments of the checkpointed monitor."""
    if not isinstance(config, dict):
        raise _Invalid("`config.monitor` must be a dict")
    _keys("config.monitor", config, set(MONITOR_CONFIG))
    kwargs: dict[str, Any] = {name: _int(f"config.monitor.{name}", config[name], 1, 2**31) for name in ("probe_capacity", "eval_every", "window", "max_events")}
    kwargs["seed"] = _int("config.monitor.seed", config["seed"], -(2**63), 2**64 - 1)
    kwargs["forgetting_threshold"] = _number("config.monitor.forgetting_threshold", config["forgetting_threshold"])
    return kwargs


@section("config")
def _config(ctx: _Context) -> Apply:
    config = ctx.get("config")
    _keys("config", config, CONFIG_KEYS)
    _int("config.replay_batch_size", config["replay_batch_size"])
    _int("config.train_iterations", config["train_iterations"], 1, 2**20)
    monitor_kwargs(config["monitor"])
    learner = ctx.learner
    if not _same(config["optimizer_type"], type(learner.optimizer).__name__):
        raise _Invalid(f"checkpoint holds {_short(config['optimizer_type'])} state; got a {type(learner.optimizer).__name__} optimizer")
    num_classes, shape = config["num_classes"], config["input_shape"]
    if (num_classes is None) != (shape is None):
        raise _Invalid("`config.num_classes` and `config.input_shape` are set together (from the first batch)")
    if num_classes is not None:
        ctx.num_classes = _int("config.num_classes", num_classes, 1, 2**31)
        if not isinstance(shape, (list, tuple)) or len(shape) > 16:
            raise _Invalid(f"`config.input_shape == {_short(shape)}`, must be a list of at most 16 ints")
        ctx.input_shape = tuple(_int("config.input_shape", d, 1, 2**31) for d in shape)
        if math.prod(ctx.input_shape) > 2**31:
            raise _Invalid(f"`config.input_shape == {list(ctx.input_shape)}` has more than 2**31 features")
    for name, live in (("num_classes", learner.num_classes), ("input_shape", learner.input_shape)):
        if live is not None and live != getattr(ctx, name):
            raise _Invalid(f"`config.{name}` is {getattr(ctx, name)}; this learner was built with {live}")

    def apply() -> None:
        learner.num_classes, learner.input_shape = ctx.num_classes, ctx.input_shape

    return apply


@section("counters")
def _counters(ctx: _Context) -> Apply:
    counters = ctx.get("counters")
    _keys("counters", counters, {"samples_seen", "steps"})
    seen, steps = _int("counters.samples_seen", counters["samples_seen"]), _int("counters.steps", counters["steps"])
    learner = ctx.learner

    def apply() -> None:
        learner.samples_seen, learner.steps = seen, steps

    return apply


@section("model")
def _model(ctx: _Context) -> Apply:
    saved = ctx.get("model")
    live = ctx.learner.model.state_dict()
    _keys("model", saved, set(live))
    for name, tensor in live.items():
        _tensor(f"model.{name}", saved[name], shape=tuple(tensor.shape), dtype=tensor.dtype)
    model = ctx.learner.model
    return lambda: model.load_state_dict(saved)


def _hyperparameter(where: str, saved: Any, live: Any, key: str) -> None:
    """A param-group value must have the live value's kind; numbers must be finite and
    in range (lr >= 0; see :data:`taste_cl.safety.HYPERPARAMETER_RANGES`)."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        if saved is not None and type(saved) is not type(live) and live is not None:
            raise _Invalid(f"`{where} == {_short(saved)}`, must be a {type(live).__name__}")
        if live is None and not (saved is None or isinstance(saved, (bool, str, int, float))):
            raise _Invalid(f"`{where} == {_short(saved)}` has an unexpected type")
    elif isinstance(live, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(live):
            raise _Invalid(f"`{where} == {_short(saved)}`, must be a sequence of {len(live)}")
        for i, (s, v) in enumerate(zip(saved, live)):
            _hyperparameter(f"{where}[{i}]", s, v, key)
    elif isinstance(live, (int, float, torch.Tensor)):
        number = _number(where, saved, low=0.0 if key == "lr" else -math.inf)
        problem = hyperparameter_problem(key, number)
        if problem is not None:
            raise _Invalid(f"`{where}` {problem}")


_SCALAR_STATE = {"step", "mu_product", "eta", "mu"}  # per-parameter scalars of torch's optimizers
_FACTORED_STATE = {"row_var", "col_var"}  # Adafactor: the parameter's shape with some dims reduced to 1


def _optimizer_state_value(where: str, key: str, value: Any, shape: tuple[int, ...]) -> None:
    """Per-parameter optimizer state: scalars for the known scalar keys, else a tensor of the
    parameter's shape (``momentum_buffer`` may be None: SGD without momentum)."""
    if key in _SCALAR_STATE:
        if isinstance(value, torch.Tensor) and value.dim() != 0:
            raise _Invalid(f"`{where}` must be a scalar; got shape {tuple(value.shape)}")
        _number(where, value, low=0.0 if key == "step" else -math.inf)
        return
    if value is None and key == "momentum_buffer":
        return
    tensor = _tensor(where, value)
    got = tuple(tensor.shape)
    fits = got == shape or (
        key in _FACTORED_STATE and len(got) == len(shape) and all(g in (1, s) for g, s in zip(got, shape))
    )
    if not fits or not (tensor.is_floating_point() or tensor.is_complex()):
        raise _Invalid(f"`{where}` must be a floating tensor of the parameter's shape {shape}; got {tensor.dtype} {got}")


@section("optimizer")
def _optimizer(ctx: _Context) -> Apply:
    saved = ctx.get("optimizer")
    optimizer = ctx.learner.optimizer
    live = optimizer.state_dict()
    _keys("optimizer", saved, {"state", "param_groups"})
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
        raise _Invalid(f"`optimizer.param_groups` must be a list of {len(live['param_groups'])} groups")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for g, (group, live_group) in enumerate(zip(groups, live["param_groups"])):
        if not isinstance(group, dict):
            raise _Invalid(f"`optimizer.param_groups[{g}]` must be a dict")
        _keys(f"optimizer.param_groups[{g}]", group, set(live_group))
        if group["params"] != live_group["params"]:
            raise _Invalid(f"`optimizer.param_groups[{g}].params` must be {live_group['params'][:8]}...")
        for key, value in live_group.items():
            if key != "params":
                _hyperparameter(f"optimizer.param_groups[{g}].{key}", group[key], value, key)
    state = saved["state"]
    if not isinstance(state, dict):
        raise _Invalid("`optimizer.state` must be a dict")
    for index, entry in state.items():
        _int("optimizer.state key", index, 0, len(params) - 1)
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise _Invalid(f"`optimizer.state[{index}]` must be a dict with string keys")
        for key, value in entry.items():
            _optimizer_state_value(f"optimizer.state[{index}].{key}", key, value, tuple(params[index].shape))
    return lambda: optimizer.load_state_dict(saved)


@section("guard")
def _guard(ctx: _Context) -> Apply:
    state = ctx.get("guard")
    try:
        UpdateGuard.parse_state(state)
    except (ValueError, TypeError) as error:
        raise _Invalid(str(error)) from error
    guard = ctx.learner.guard
    return lambda: guard.load_state_dict(state)


@section("training")
def _training(ctx: _Context) -> Apply:
    training = ctx.get("training")
    _keys("training", training, {"batch_plan", "base_lrs", "stream_batch_size", "pending", "accumulated", "window_finite", "grads"})
    learner = ctx.learner
    plan = training["batch_plan"]
    if plan is not None:
        if not isinstance(plan, dict):
            raise _Invalid("`training.batch_plan` must be a dict or None")
        _keys("training.batch_plan", plan, {"micro_batch_size", "accumulation_steps", "lr_scale"})
        plan = {
            "micro_batch_size": _int("training.batch_plan.micro_batch_size", plan["micro_batch_size"], 1, 2**31),
            "accumulation_steps": _int("training.batch_plan.accumulation_steps", plan["accumulation_steps"], 1, 2**20),
            "lr_scale": _number("training.batch_plan.lr_scale", plan["lr_scale"], positive=True),
        }
        ctx.accumulation_steps = plan["accumulation_steps"]
    base_lrs = training["base_lrs"]
    if base_lrs is not None:
        if not isinstance(base_lrs, list) or len(base_lrs) != len(learner.optimizer.param_groups):
            raise _Invalid(f"`training.base_lrs` must be None or a list of {len(learner.optimizer.param_groups)} numbers")
        base_lrs = [_number("training.base_lrs", lr, low=0.0) for lr in base_lrs]
    stream = training["stream_batch_size"]
    if stream is not None:
        _int("training.stream_batch_size", stream, 1, 2**31)
    pending = training["pending"]
    if pending is not None:
        if not isinstance(pending, (list, tuple)) or len(pending) != 2 or plan is None:
            raise _Invalid("`training.pending` must be None or [x, y], and only with a batch plan")
        check_samples(ctx, "training.pending", *pending)
        if pending[1].shape[0] == 0:
            raise _Invalid("`training.pending` must hold at least one sample")
    accumulated = _int("training.accumulated", training["accumulated"], 0, ctx.accumulation_steps - 1)
    if not isinstance(training["window_finite"], bool):
        raise _Invalid("`training.window_finite` must be a bool")
    grads = training["grads"]
    parameters = list(learner.model.parameters())
    if not isinstance(grads, list) or len(grads) != len(parameters):
        raise _Invalid(f"`training.grads` must be a list of {len(parameters)} entries (one per parameter)")
    for i, (grad, param) in enumerate(zip(grads, parameters)):
        if grad is not None and (
            not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(param.shape) or grad.dtype != param.dtype
        ):
            raise _Invalid(
                f"`training.grads[{i}]` must be None or a {param.dtype} tensor of shape {tuple(param.shape)}; "
                f"got {_short(grad) if not isinstance(grad, torch.Tensor) else (grad.dtype, tuple(grad.shape))}"
            )
    if accumulated == 0 and any(g is not None for g in grads):
        raise _Invalid("`training.grads` are set but no micro-batch is accumulated")
    window_finite = training["window_finite"]

    def apply() -> None:
        from taste_cl.learner import BatchPlan

        learner.batch_plan = None if plan is None else BatchPlan(**plan)
        learner._base_lrs = base_lrs
        learner._stream_batch_size = stream
        learner._pending = None if pending is None else tuple(t.to(learner.device).clone() for t in pending)
        learner._accumulated, learner._window_finite = accumulated, window_finite
        for param, grad in zip(parameters, grads):
            param.grad = None if grad is None else grad.to(param.device).clone()

    return apply


def _trial_replay(replay: ReplayStrategy) -> ReplayStrategy:
    """A throwaway strategy to try a state on: a fresh built-in, or a deep copy of a custom one."""
    if isinstance(replay, (ReservoirReplay, ClassBalancedReplay)) and type(replay) in _BUILTIN_REPLAY.values():
        return type(replay)(replay.capacity, seed=replay.seed)
    return copy.deepcopy(replay)


@section("replay")
def _replay(ctx: _Context) -> Apply:
    replay, saved = ctx.learner.replay, ctx.state.get("replay")
    saved_type = ctx.state.get("replay_type")
    if replay is None:
        if saved_type is not None or saved is not None:
            raise _Invalid(f"checkpoint holds a {_short(saved_type)} buffer; this learner has no replay")
        return lambda: None
    if not _same(saved_type, type(replay).__name__):
        raise _Invalid(f"checkpoint holds a {_short(saved_type)} buffer; got replay={type(replay).__name__}")
    trial = _trial_replay(replay)
    try:
        trial.load_state_dict(saved)  # type: ignore[arg-type]  # a non-dict is refused by the strategy
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise _Invalid(f"replay state: {error}") from error
    if isinstance(trial, (ReservoirReplay, ClassBalancedReplay)):
        storage = trial._storage.state_dict()
        if storage["size"]:
            check_samples(ctx, "replay.storage", storage["x"], storage["y"])
    return lambda: replay.load_state_dict(saved)  # type: ignore[arg-type]


@section("monitor")
def _monitor(ctx: _Context) -> Apply:
    saved = ctx.get("monitor")
    monitor = ctx.learner.monitor
    try:
        parsed = parse_monitor_state(saved, monitor)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise _Invalid(str(error)) from error
    probe = parsed["probe"]._storage.state_dict()
    if probe["size"]:
        check_samples(ctx, "monitor.probe", probe["x"], probe["y"])
    return lambda: monitor.load_state_dict(saved)


@section("rng")
def _rng(ctx: _Context) -> Apply:
    rng = ctx.get("rng")
    _keys("rng", rng, {"torch"})
    value = _generator_state("rng.torch", rng["torch"])
    return lambda: torch.set_rng_state(value.cpu())


@section("plugins")
def _plugins(ctx: _Context) -> Apply:
    plugins = ctx.get("plugins")
    if not all(isinstance(k, str) and isinstance(v, dict) for k, v in plugins.items()):
        raise _Invalid("`plugins` must map plugin names to dicts")
    return lambda: None  # loaded before the other sections apply, see _load_plugins


# ------------------------------------------------------------------------- entry
def restore_state(learner: OnlineLearner, state: Any) -> None:
    """Validate ``state`` against ``learner``, then apply it; all or nothing (see the module docstring)."""
    applies = _parse_sections(learner, state)
    _load_plugins(learner, state["plugins"])
    for apply in applies:
        apply()


def validate_state(learner: OnlineLearner, state: Any) -> None:
    """Raise :class:`CheckpointError` unless ``state`` fits ``learner``; changes nothing."""
    _parse_sections(learner, state)


def _parse_sections(learner: OnlineLearner, state: Any) -> list[Apply]:
    if not isinstance(state, dict):
        raise CheckpointError(f"a learner state is a dict; got {type(state).__name__}")
    if not _same(state.get("format"), CHECKPOINT_FORMAT):
        raise CheckpointError(f"checkpoint format {_short(state.get('format'))} is not supported (want {CHECKPOINT_FORMAT})")
    unknown = sorted(map(str, set(state) - set(_SECTIONS) - set(_TOP_LEVEL_EXTRA)))
    if unknown:
        raise CheckpointError(f"checkpoint has unknown sections {unknown[:5]}")
    ctx = _Context(learner, state)
    applies = []
    for name, parse in _SECTIONS.items():
        try:
            applies.append(parse(ctx))
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError) as error:
            raise CheckpointError(f"checkpoint does not fit this learner: section `{name}`: {error}") from error
    return applies


def _load_plugins(learner: OnlineLearner, states: dict[str, Any]) -> None:
    """Load each plugin's state; if one fails, put the ones already loaded back and raise."""
    done: list[tuple[Any, dict[str, Any]]] = []
    for plugin in learner.plugins:
        if plugin.name not in states:
            continue
        before = plugin.state_dict()
        try:
            plugin.load_state_dict(states[plugin.name])
        except Exception as error:
            for loaded, previous in reversed(done + [(plugin, before)]):
                loaded.load_state_dict(previous)
            raise CheckpointError(f"checkpoint does not fit this learner: plugin {plugin.name!r}: {error}") from error
        done.append((plugin, before))


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
    so their preallocated store fits ``max_bytes``; nothing passed in is modified.
    """
    try:
        if not isinstance(state, dict) or not _same(state.get("format"), CHECKPOINT_FORMAT):
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint format {_short(found)} is not supported (want {CHECKPOINT_FORMAT})")
        config = state.get("config")
        if not isinstance(config, dict):
            raise _Invalid("section `config` is missing or not a dict")
        _keys("config", config, CONFIG_KEYS)
        _int("config.replay_batch_size", config["replay_batch_size"])
        _int("config.train_iterations", config["train_iterations"], 1, 2**20)
        shape = config["input_shape"]
        row_bytes = 8 + 8 * (math.prod(shape) if isinstance(shape, list) and all(isinstance(d, int) for d in shape) else 1)
        largest = max(1, max_bytes // row_bytes)  # samples whose store fits the memory bound
        kwargs = monitor_kwargs(config["monitor"])
        _int("config.monitor.probe_capacity", kwargs["probe_capacity"], 1, largest)
        built_monitor = monitor if monitor is not None else StabilityPlasticityMonitor(**kwargs)
        return config, _rebuild_replay(state, replay, largest), built_monitor
    except (ValueError, TypeError, KeyError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint does not fit this learner: {error}") from error


def _rebuild_replay(state: dict[str, Any], replay: ReplayStrategy | None, largest: int) -> ReplayStrategy | None:
    saved_type = state.get("replay_type")
    if replay is not None:
        if not _same(saved_type, type(replay).__name__):
            raise CheckpointError(f"checkpoint holds a {_short(saved_type)} buffer; got replay={type(replay).__name__}")
        return replay
    if saved_type is None:
        return None
    if saved_type not in _BUILTIN_REPLAY:
        raise CheckpointError(f"checkpoint holds a custom {_short(saved_type)} buffer: pass replay={saved_type}(...) to load()")
    saved = state.get("replay")
    if not isinstance(saved, dict):
        raise _Invalid("section `replay` must be a dict")
    capacity = _int("replay.capacity", saved.get("capacity"), 1, largest)
    seed = _int("replay.seed", saved.get("seed"), 0, 2**64 - 1)
    return _BUILTIN_REPLAY[saved_type](capacity, seed=seed)
