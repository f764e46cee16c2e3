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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._batch import Inputs, Spec, check_call, count_nonfinite, leaves, map_leaves, to_inputs, unflatten
from taste_cl._checks import INT_LIMIT
from taste_cl.exceptions import CheckpointError
from taste_cl.guards.update import UpdateGuard, hyperparameter_problem
from taste_cl.learner.frozen import check_frozen_norm
from taste_cl.learner.heads import MAX_CLASSES, grow_for_state
from taste_cl.monitor.monitor import PREQUENTIAL_MODES, StabilityPlasticityMonitor
from taste_cl.monitor.monitor import _parse_state as parse_monitor_state
from taste_cl.outputs import restored_output
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy, ReservoirReplay
from taste_cl.strategies import BUILTIN_STRATEGIES, ExperienceReplay, FieldSpec, LwF, Strategy
from taste_cl.tasks import Task, resolve_task

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["CHECKPOINT_FORMAT", "build_parts", "restore_state", "section", "validate_state"]

CHECKPOINT_FORMAT = 2
CONFIG_KEYS = {
    "replay_batch_size",
    "train_iterations",
    "num_classes",
    "input_shape",
    "input_spec",
    "output_shape",
    "task",
    "score_eval",
    "strategy",
    "monitor",
    "optimizer_type",
}
"""Keys of the ``config`` section; a new config entry is added here and checked in :func:`_config`."""
OPTIONAL_CONFIG_KEYS = {"output", "max_classes", "max_grad_norm", "call", "frozen_norm"}
"""``config`` keys that checkpoints written before them lack (``output``, ``max_classes``, ``max_grad_norm``: None then;
``call``: ``"keywords"``, how every model was called before; ``frozen_norm``: ``"train"``, how they trained)."""
MONITOR_CONFIG = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "max_events", "seed", "prequential", "regression_threshold")
_BUILTIN_REPLAY: dict[str, type[ReservoirReplay | ClassBalancedReplay]] = {
    "ReservoirReplay": ReservoirReplay,
    "ClassBalancedReplay": ClassBalancedReplay,
}
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
    input_spec: Spec | None = None
    output_shape: tuple[int, ...] | None = None
    task: Task | None = None
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


def _int(where: str, value: Any, low: int = 0, high: int = INT_LIMIT) -> int:
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


def _keys(where: str, value: dict[str, Any], expected: set[str], whose: str = "") -> None:
    """``value`` must have exactly the keys ``expected`` (``whose``: what they are expected from, for the message)."""
    if set(value) != expected:
        missing, extra = sorted(expected - set(value)), sorted(map(str, set(value) - expected))
        raise _Invalid(f"`{where}` keys differ{whose}: missing {missing[:5]}, unexpected {extra[:5]}")


def check_samples(ctx: _Context, where: str, x: Inputs, y: Any) -> None:
    """Stored samples (pending, replay, probe) must pass the checks a stream batch passes:
    the input structure, leaf kinds and shapes the learner settled, finite floats, and
    targets the task accepts (labels in range, shapes matching the model's outputs)."""
    y = _tensor(f"{where}.y", y)
    n = y.shape[0] if y.dim() else -1
    if n == 0:
        return
    if ctx.input_spec is None or ctx.output_shape is None or ctx.task is None:
        raise _Invalid(f"`{where}` holds samples but the checkpoint has no input spec, output shape or task")
    cpu = torch.device("cpu")
    try:
        inputs, _ = to_inputs(x, spec=ctx.input_spec, dtype=ctx.learner.dtype, device=cpu, name=f"{where}.x")
        ctx.task.to_targets(y, n=n, output_shape=ctx.output_shape, dtype=ctx.learner.dtype, device=cpu)
    except ValueError as error:  # InvalidBatchError: the message names the problem
        raise _Invalid(f"`{where}`: {error}") from error
    lengths = {t.shape[0] for t in leaves(inputs)}
    if lengths != {n}:
        raise _Invalid(f"`{where}` holds {n} targets but inputs of lengths {sorted(lengths)}")


def _stored_samples(strategy: ReplayStrategy) -> tuple[Inputs, torch.Tensor] | None:
    """All samples a built-in strategy holds, as ``(x, y)``; None when it is empty."""
    storage = strategy._storage  # type: ignore[attr-defined]  # built-in strategies only
    if not len(storage):
        return None
    return storage.gather(torch.arange(len(storage)))


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
    kwargs: dict[str, Any] = {
        name: _int(f"config.monitor.{name}", config[name], 1, 2**31) for name in ("probe_capacity", "eval_every", "window", "max_events")
    }
    kwargs["seed"] = _int("config.monitor.seed", config["seed"], -(2**63), 2**64 - 1)
    kwargs["forgetting_threshold"] = _number("config.monitor.forgetting_threshold", config["forgetting_threshold"])
    if config["prequential"] not in PREQUENTIAL_MODES:
        raise _Invalid(f"`config.monitor.prequential == {_short(config['prequential'])}`, must be one of {PREQUENTIAL_MODES}")
    kwargs["prequential"] = config["prequential"]
    kwargs["regression_threshold"] = _number("config.monitor.regression_threshold", config["regression_threshold"], low=0.0)
    return kwargs


@section("config")
def _config(ctx: _Context) -> Apply:
    config = ctx.get("config")
    _keys("config", config, CONFIG_KEYS | (OPTIONAL_CONFIG_KEYS & set(config)))
    _int("config.replay_batch_size", config["replay_batch_size"])
    _int("config.train_iterations", config["train_iterations"], 1, 2**20)
    monitor_kwargs(config["monitor"])
    learner = ctx.learner
    if not _same(config["optimizer_type"], type(learner.optimizer).__name__):
        raise _Invalid(f"checkpoint holds {_short(config['optimizer_type'])} state; got a {type(learner.optimizer).__name__} optimizer")
    if not isinstance(config["score_eval"], bool):
        raise _Invalid("`config.score_eval` must be a bool")
    ctx.task = parse_task(config["task"])
    raw_spec, output_shape = config["input_spec"], config["output_shape"]
    if (raw_spec is None) != (output_shape is None):
        raise _Invalid("`config.input_spec` and `config.output_shape` are set together (from the first batch)")
    if raw_spec is not None:
        try:
            ctx.input_spec = Spec.from_json(raw_spec)
        except ValueError as error:
            raise _Invalid(f"`config.input_spec`: {error}") from error
        ctx.output_shape = _shape("config.output_shape", output_shape)
        if ctx.task is None:
            raise _Invalid("`config.task` must be set once the first batch settled the input spec")
        try:
            ctx.task.check_outputs(ctx.output_shape)
        except ValueError as error:
            raise _Invalid(f"`config.output_shape` does not fit the task: {error}") from error
        ctx.num_classes = ctx.task.num_classes(ctx.output_shape)
    shape = None if ctx.input_spec is None or not ctx.input_spec.is_tensor else tuple(ctx.input_spec.shape)
    if config["num_classes"] != ctx.num_classes or config["input_shape"] != (None if shape is None else list(shape)):
        raise _Invalid(
            f"`config.num_classes == {_short(config['num_classes'])}` and `config.input_shape == "
            f"{_short(config['input_shape'])}` must follow from the input spec, output shape and task"
        )
    for name, live in (("input_spec", learner.input_spec), ("output_shape", learner.output_shape)):
        if live is not None and live != getattr(ctx, name):
            raise _Invalid(f"`config.{name}` is {getattr(ctx, name)}; this learner has {live}")
    if learner._task_given and learner.task is not None and ctx.task is not None and learner.task != ctx.task:
        raise _Invalid(f"checkpoint holds the task {ctx.task!r}; this learner was built with {learner.task!r}")
    _check_strategy(ctx, config["strategy"])
    try:
        output = restored_output(
            config.get("output"), learner.output, settled=ctx.output_shape is not None, live_settled=learner.output_shape is not None
        )
    except ValueError as error:
        raise _Invalid(str(error)) from error
    score_eval = config["score_eval"]
    strategy = learner.strategy
    max_classes = _max_classes(config.get("max_classes"), ctx.num_classes)
    max_grad_norm = _max_grad_norm(config.get("max_grad_norm"))
    call = _call(config.get("call", "keywords"))
    frozen_norm = _frozen_norm(config.get("frozen_norm", "train"))

    def apply() -> None:
        learner.output = output
        learner.max_classes = max_classes
        learner.max_grad_norm = max_grad_norm
        learner.call = call
        learner.frozen_norm = frozen_norm
        learner.input_spec, learner.output_shape, learner.num_classes = ctx.input_spec, ctx.output_shape, ctx.num_classes
        learner.input_shape = shape
        learner.task = ctx.task if ctx.task is not None else learner.task
        strategy.task = learner.task  # as the learner's check() on the first batch would
        learner._score_eval = score_eval

    return apply


def _max_classes(value: Any, num_classes: int | None) -> int | None:
    """``config.max_classes``: None, or the bound a growing classifier's width stays within."""
    if value is None:
        return None
    return _int("config.max_classes", value, num_classes or 1, MAX_CLASSES)


def _max_grad_norm(value: Any) -> float | None:
    """``config.max_grad_norm``: None, or the positive finite norm each step's gradient is clipped to."""
    return None if value is None else _number("config.max_grad_norm", value, positive=True)


def _call(value: Any) -> str:
    """``config.call``: how the model takes a dict / tuple / list input (see :data:`~taste_cl._batch.CALL_MODES`)."""
    try:
        return check_call(value, "config.call")
    except ValueError as error:
        raise _Invalid(str(error)) from error


def _frozen_norm(value: Any) -> str:
    """``config.frozen_norm``: the mode of the normalisation modules in frozen parts (see :mod:`taste_cl.learner.frozen`)."""
    try:
        return check_frozen_norm(value, "config.frozen_norm")
    except ValueError as error:
        raise _Invalid(str(error)) from error


def parse_task(value: Any) -> Task | None:
    """The checkpointed task (a :meth:`Task.config` dict), or None before it was settled."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Invalid(f"`config.task == {_short(value)}`, must be a task config dict or None")
    try:
        return resolve_task(value)
    except ValueError as error:
        raise _Invalid(f"`config.task`: {error}") from error


def parse_strategy(value: Any) -> dict[str, Any] | None:
    """The checkpointed strategy description ``{"name", "config"}`` (None in older states: plain ER)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "config"} or not isinstance(value["name"], str) or not isinstance(value["config"], dict):
        raise _Invalid(f"`config.strategy == {_short(value)}`, must be {{'name': str, 'config': dict}}")
    return value


def rebuilt_strategy(described: dict[str, Any]) -> Strategy | None:
    """The built-in strategy a parsed description names, rebuilt from its config, which must
    hold exactly the constructor's keys with values it accepts; None for a custom name."""
    builtin = BUILTIN_STRATEGIES.get(described["name"])
    if builtin is None:
        return None
    _keys("config.strategy.config", described["config"], set(builtin().config()), f" from {builtin.__name__}'s")
    try:
        return builtin(**described["config"])
    except (ValueError, TypeError) as error:
        raise _Invalid(f"`config.strategy.config`: {error}") from error


def _strategy_fits(strategy: Strategy, task: Task | None, replay: ReplayStrategy | None) -> None:
    """The strategy must support the checkpoint's task and the buffer (DER++ needs one that keeps fields)."""
    problem = strategy.problem(task, replay)
    if problem is not None:
        raise _Invalid(f"`config.strategy`: {problem}")


def _check_strategy(ctx: _Context, value: Any) -> None:
    """``config.strategy`` must describe the learner's strategy: the same name (None, in older
    states: plain ER), the hyperparameter keys of the live strategy with valid values (a
    built-in is rebuilt from them), and a task and buffer it works with."""
    described = parse_strategy(value) or {"name": ExperienceReplay.name, "config": {}}
    strategy = ctx.learner.strategy
    if described["name"] != strategy.name:
        raise _Invalid(f"checkpoint was trained with strategy {_short(described['name'])}; this learner uses {strategy.name!r}")
    if type(strategy) is BUILTIN_STRATEGIES.get(strategy.name):
        rebuilt_strategy(described)
    else:
        _keys("config.strategy.config", described["config"], set(strategy.config()), f" from {type(strategy).__name__}'s")
    _strategy_fits(strategy, ctx.task, ctx.learner.replay)


def _shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 16:
        raise _Invalid(f"`{where} == {_short(value)}`, must be a list of at most 16 ints")
    shape = tuple(_int(where, d, 1, 2**31) for d in value)
    if math.prod(shape) > 2**31:
        raise _Invalid(f"`{where} == {list(shape)}` has more than 2**31 entries")
    return shape


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
    try:
        _keys("model", saved, set(live))
    except _Invalid as error:
        raise _Invalid(f"{error}{_wrapping_hint(saved, live)}") from None
    for name, tensor in live.items():
        _tensor(f"model.{name}", saved[name], shape=tuple(tensor.shape), dtype=tensor.dtype)
    model = ctx.learner.model
    return lambda: model.load_state_dict(saved)


_PEFT_PREFIX = "base_model.model."  # where Hugging Face peft's wrapper puts the wrapped model's keys


def _wrapping_hint(saved: dict[str, Any], live: dict[str, Any]) -> str:
    """Why the model keys differ when one side is wrapped by peft and the other is not ("" otherwise).

    Read from the key names alone (peft is an optional extra this module never imports).
    """
    saved_wrapped = any(str(key).startswith(_PEFT_PREFIX) for key in saved)
    live_wrapped = any(key.startswith(_PEFT_PREFIX) for key in live)
    if saved_wrapped and not live_wrapped:
        return (
            f"; the checkpoint's model was wrapped by peft (keys '{_PEFT_PREFIX}...') and this one is not:"
            " wrap it with the same adapter config (get_peft_model) before load"
        )
    if live_wrapped and not saved_wrapped:
        return "; this model is wrapped by peft and the checkpoint's was not: load it into the plain model it was saved from"
    return ""


def _hyperparameter(where: str, saved: Any, live: Any, key: str) -> None:
    """A param-group value must have the live value's kind; numbers must be finite and
    in range (lr >= 0; see :data:`taste_cl.guards.update.HYPERPARAMETER_RANGES`)."""
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
    fits = got == shape or (key in _FACTORED_STATE and len(got) == len(shape) and all(g in (1, s) for g, s in zip(got, shape)))
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
    guard, optimizer = ctx.learner.guard, ctx.learner.optimizer
    return lambda: guard.load_state_dict(state, optimizer.param_groups)  # after the optimizer's section


@section("training")
def _training(ctx: _Context) -> Apply:
    training = ctx.get("training")
    _keys("training", training, {"batch_plan", "stream_batch_size", "pending", "accumulated", "window_finite", "grads"})
    learner = ctx.learner
    plan = training["batch_plan"]
    if plan is not None:
        if not isinstance(plan, dict):
            raise _Invalid("`training.batch_plan` must be a dict or None")
        _keys("training.batch_plan", plan, {"micro_batch_size", "accumulation_steps", "lr_scale", "max_wait_samples", "max_wait_s"})
        plan = {
            "micro_batch_size": _int("training.batch_plan.micro_batch_size", plan["micro_batch_size"], 1, 2**31),
            "accumulation_steps": _int("training.batch_plan.accumulation_steps", plan["accumulation_steps"], 1, 2**20),
            "lr_scale": _number("training.batch_plan.lr_scale", plan["lr_scale"], positive=True),
            "max_wait_samples": None
            if plan["max_wait_samples"] is None
            else _int("training.batch_plan.max_wait_samples", plan["max_wait_samples"], 1, 2**31),
            "max_wait_s": None if plan["max_wait_s"] is None else _number("training.batch_plan.max_wait_s", plan["max_wait_s"], positive=True),
        }
        ctx.accumulation_steps = plan["accumulation_steps"]
    stream = training["stream_batch_size"]
    if stream is not None:
        _int("training.stream_batch_size", stream, 1, 2**31)
    pending = training["pending"]
    if pending is not None:
        if not isinstance(pending, list) or plan is None or ctx.input_spec is None or len(pending) != ctx.input_spec.leaf_count + 1:
            raise _Invalid("`training.pending` must be None or [*input leaves, targets], and only with a batch plan")
        try:
            pending = (unflatten(ctx.input_spec, pending[:-1]), pending[-1])
        except (ValueError, TypeError) as error:
            raise _Invalid(f"`training.pending`: {error}") from error
        if not isinstance(pending[1], torch.Tensor) or pending[1].dim() == 0 or pending[1].shape[0] == 0:
            raise _Invalid("`training.pending` must hold at least one sample")
        check_samples(ctx, "training.pending", *pending)
    accumulated = _int("training.accumulated", training["accumulated"], 0, ctx.accumulation_steps - 1)
    if not isinstance(training["window_finite"], bool):
        raise _Invalid("`training.window_finite` must be a bool")
    grads = training["grads"]
    parameters = list(learner.model.parameters())
    if not isinstance(grads, list) or len(grads) != len(parameters):
        raise _Invalid(f"`training.grads` must be a list of {len(parameters)} entries (one per parameter)")
    for i, (grad, param) in enumerate(zip(grads, parameters)):
        if grad is not None and (not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(param.shape) or grad.dtype != param.dtype):
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
        learner._stream_batch_size = stream
        learner._pending = None if pending is None else _placed(learner, pending)
        learner._arrivals.clear()  # arrival times do not survive a process: pending samples count from now
        learner._window_stream = 0
        if plan is not None and pending is not None:
            learner._arrivals.append([time.monotonic(), pending[1].shape[0]])
        learner._accumulated, learner._window_finite = accumulated, window_finite
        for param, grad in zip(parameters, grads):
            param.grad = None if grad is None else grad.to(param.device).clone()

    return apply


def _placed(learner: OnlineLearner, pending: tuple[Inputs, torch.Tensor]) -> tuple[Inputs, torch.Tensor]:
    """Pending samples as the learner keeps them: floating leaves in its dtype, all on its device."""
    device, dtype = learner.device, learner.dtype
    x = map_leaves(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).clone(), pending[0])
    return x, pending[1].to(device).clone()


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
        stored = _stored_samples(trial)
        if stored is not None:
            check_samples(ctx, "replay.storage", *stored)
    _check_strategy_fields(ctx, trial)
    return lambda: replay.load_state_dict(saved)  # type: ignore[arg-type]


def _held_fields(replay: ReplayStrategy, strategy: Strategy) -> tuple[str, int, dict[str, Any]] | None:
    """Where a buffer's extra per-sample fields are in the state, how many samples it holds,
    and the fields; None when they cannot be read (a custom buffer whose strategy stores none)."""
    if isinstance(replay, (ReservoirReplay, ClassBalancedReplay)):
        return ("replay.storage.fields", *_storage_fields(replay))
    if not strategy.stored_fields or not len(replay):
        return None
    with torch.random.fork_rng(devices=[]):  # a custom buffer may draw from the global generator
        _, y, fields = replay.sample(len(replay), with_fields=True)  # type: ignore[call-arg, misc]  # strategy.check() saw the keyword
    return "replay.fields", y.shape[0], fields


def _storage_fields(replay: ReservoirReplay | ClassBalancedReplay) -> tuple[int, dict[str, torch.Tensor]]:
    """How many samples a built-in buffer holds, and its extra per-sample fields."""
    storage = replay._storage
    return len(storage), storage.contents()[2] if len(storage) else {}


def _check_fields(where: str, rows: int, fields: dict[str, Any], specs: dict[str, FieldSpec | None], whose: str) -> None:
    """The extra per-sample fields of a buffer holding ``rows`` samples must be exactly those
    ``specs`` names (what ``whose`` stores): one finite row per stored sample, of the declared
    per-sample shape and dtype where one is declared."""
    if rows == 0:
        return
    _keys(where, fields, set(specs), f" from what {whose} stores")
    for name, spec in specs.items():
        tensor = _tensor(f"{where}.{name}", fields[name], dtype=None if spec is None else spec[1])
        per_sample = tuple(tensor.shape[1:]) if spec is None else spec[0]
        if tensor.dim() == 0 or tuple(tensor.shape) != (rows, *per_sample):
            raise _Invalid(f"`{where}.{name}` must have shape {(rows, *per_sample)}: a {per_sample} row per stored sample; got {tuple(tensor.shape)}")


def _check_strategy_fields(ctx: _Context, replay: ReplayStrategy) -> None:
    """A (trial) buffer's extra fields must be those the learner's strategy stores, of the
    shape and dtype it declares for this model's outputs (DER++: the logits,
    ``(n, *output_shape)`` in the model's dtype)."""
    strategy = ctx.learner.strategy
    held = _held_fields(replay, strategy)
    if held is not None:
        specs = dict.fromkeys(strategy.stored_fields) if ctx.output_shape is None else strategy.field_specs(ctx.output_shape, ctx.learner.dtype)
        _check_fields(*held, specs, f"strategy {strategy.name!r}")


@section("strategy")
def _strategy(ctx: _Context) -> Apply:
    """The strategy's own state (its description was checked with the config): the keys of
    the live strategy's state; LwF's chunk count and snapshot (a state of this model); a
    custom strategy's state is tried on a copy first."""
    saved = ctx.get("strategy")
    learner = ctx.learner
    strategy = learner.strategy
    _keys("strategy", saved, set(strategy.state_dict()), f" from what strategy {strategy.name!r} keeps")
    if isinstance(strategy, LwF):
        _int("strategy.chunks", saved["chunks"])
        teacher = saved["teacher"]
        if teacher is not None:
            model = learner.model.state_dict()
            if not isinstance(teacher, dict):
                raise _Invalid(f"`strategy.teacher` must be None or a model state; got {type(teacher).__name__}")
            _keys("strategy.teacher", teacher, set(model), " from the model's state")
            for name, tensor in model.items():
                _tensor(f"strategy.teacher.{name}", teacher[name], shape=tuple(tensor.shape), dtype=tensor.dtype)
    if type(strategy) not in BUILTIN_STRATEGIES.values():
        # the copy shares what the strategy may refer to (the learner and its parts), never copies them
        shared = {id(part): part for part in (learner, learner.model, learner.optimizer, learner.monitor, learner.replay)}
        try:
            with torch.random.fork_rng(devices=[]):
                copy.deepcopy(strategy, shared).load_state_dict(saved)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as error:
            raise _Invalid(f"strategy state: {error}") from error
    return lambda: strategy.load_state_dict(saved)


@section("monitor")
def _monitor(ctx: _Context) -> Apply:
    saved = ctx.get("monitor")
    monitor = ctx.learner.monitor
    try:
        parsed = parse_monitor_state(saved, monitor)
    except (ValueError, TypeError, KeyError, RuntimeError) as error:
        raise _Invalid(str(error)) from error
    stored = _stored_samples(parsed["probe"])  # its sample ids were checked by the monitor
    if stored is not None:
        check_samples(ctx, "monitor.probe", *stored)
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
    """Validate ``state`` against ``learner``, then apply it; all or nothing (see the module docstring).

    A checkpoint of a learner whose classifier grew (``max_classes``) first grows this
    learner's to the same width (see :func:`~taste_cl.learner.heads.grow_for_state`), undone on any error."""
    undo = grow_for_state(learner, state)
    try:
        applies = _parse_sections(learner, state)
        _load_plugins(learner, state["plugins"])
    except BaseException:
        if undo is not None:
            undo()
        raise
    for apply in applies:
        apply()


def validate_state(learner: OnlineLearner, state: Any) -> None:
    """Raise :class:`CheckpointError` unless ``state`` fits ``learner``, its plugins' states included; changes
    nothing (each plugin's state is tried and put back: some plugins check theirs only when loading it)."""
    undo = grow_for_state(learner, state)
    try:
        _parse_sections(learner, state)
        _load_plugins(learner, state["plugins"], keep=False)
    finally:
        if undo is not None:
            undo()


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


def _load_plugins(learner: OnlineLearner, states: dict[str, Any], *, keep: bool = True) -> None:
    """Load each plugin's state; if one fails, put the ones already loaded back and raise.
    ``keep=False`` (a trial) puts them all back once every one has loaded."""
    done: list[tuple[Any, dict[str, Any]]] = []
    for plugin in learner.plugins:
        if plugin.name not in states:
            continue
        done.append((plugin, plugin.state_dict()))
        try:
            plugin.load_state_dict(states[plugin.name])
        except Exception as error:
            _put_back(done)
            raise CheckpointError(f"checkpoint does not fit this learner: plugin {plugin.name!r}: {error}") from error
    if not keep:
        _put_back(done)


def _put_back(loaded: list[tuple[Any, dict[str, Any]]]) -> None:
    """Load each ``(plugin, earlier state)`` back, the last loaded first."""
    for plugin, previous in reversed(loaded):
        plugin.load_state_dict(previous)


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
        if not isinstance(state, dict) or not _same(state.get("format"), CHECKPOINT_FORMAT):
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"checkpoint format {_short(found)} is not supported (want {CHECKPOINT_FORMAT})")
        config = state.get("config")
        if not isinstance(config, dict):
            raise _Invalid("section `config` is missing or not a dict")
        _keys("config", config, CONFIG_KEYS | (OPTIONAL_CONFIG_KEYS & set(config)))
        _int("config.replay_batch_size", config["replay_batch_size"])
        _int("config.train_iterations", config["train_iterations"], 1, 2**20)
        config = {**config, "task": parse_task(config["task"]), "strategy": parse_strategy(config["strategy"])}
        _max_classes(config.get("max_classes"), None)  # the learner is built with it
        _max_grad_norm(config.get("max_grad_norm"))
        _call(config.get("call", "keywords"))
        _frozen_norm(config.get("frozen_norm", "train"))
        try:
            entries = 1 if config["input_spec"] is None else Spec.from_json(config["input_spec"]).entries
        except ValueError as error:
            raise _Invalid(f"`config.input_spec`: {error}") from error
        row_bytes = 8 + 8 * max(1, entries)
        largest = max(1, max_bytes // row_bytes)  # samples whose store fits the memory bound
        kwargs = monitor_kwargs(config["monitor"])
        _int("config.monitor.probe_capacity", kwargs["probe_capacity"], 1, largest)
        built_monitor = monitor if monitor is not None else StabilityPlasticityMonitor(**kwargs)
        built_replay = _rebuild_replay(state, replay, largest)
        strategy = None if config["strategy"] is None else rebuilt_strategy(config["strategy"])
        if strategy is not None:  # the learner is built with it: it must work with the task and buffer
            _strategy_fits(strategy, config["task"], built_replay)
        return config, built_replay, built_monitor
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
