"""The learner's own state sections, each checked against the live learner before anything is applied.

``config`` (the options and what the first batch settled, the monitor's settings and the
strategy's description), ``counters``, ``model``, ``optimizer``, ``training`` (the micro-batcher's
plan, pending samples and window, and the accumulated gradients) and ``rng``. A parser takes the
shared :class:`Context`, checks its section (types, ranges, finiteness, shapes and dtypes against
the live model and optimizer, label range) and returns a closure that applies it and cannot fail;
it raises ``ValueError`` naming the field. :mod:`.restore` adds the parts' sections and runs them
all through :mod:`taste_cl.state.restore`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._batch import Inputs, Spec, check_call, leaves, map_leaves, to_inputs
from taste_cl.guards.update import hyperparameter_problem
from taste_cl.learner.batching import TRAINING_KEYS, MicroBatcher, Samples
from taste_cl.learner.frozen import check_frozen_norm
from taste_cl.learner.heads import MAX_CLASSES
from taste_cl.monitor.monitor import PREQUENTIAL_MODES, SETTINGS
from taste_cl.outputs import restored_output
from taste_cl.replay import ReplayStrategy
from taste_cl.state.restore import Apply, check_generator_state, check_int, check_keys, check_number, check_tensor, same, short
from taste_cl.strategies import BUILTIN_STRATEGIES, ExperienceReplay, Strategy
from taste_cl.tasks import Task, resolve_task

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner

__all__ = [
    "CONFIG_KEYS",
    "LEARNER_SECTIONS",
    "OPTIONAL_CONFIG_KEYS",
    "Context",
    "check_config",
    "max_classes_of",
    "max_grad_norm_of",
    "monitor_kwargs",
    "parse_strategy",
    "parse_task",
    "rebuilt_strategy",
    "strategy_fits",
]

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


@dataclass
class Context:
    """What the parsers share: the learner, the raw state, and facts parsed so far."""

    learner: OnlineLearner
    state: dict[str, Any]
    num_classes: int | None = None
    input_spec: Spec | None = None
    output_shape: tuple[int, ...] | None = None
    task: Task | None = None

    def get(self, name: str, kind: type | tuple[type, ...] = dict) -> Any:
        if name not in self.state:
            raise ValueError(f"section `{name}` is missing")
        value = self.state[name]
        if not isinstance(value, kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            raise ValueError(f"section `{name}` must be a {' or '.join(k.__name__ for k in kinds)}; got {type(value).__name__}")  # noqa: TRY004
        return value

    def check_samples(self, where: str, x: Inputs, y: Any) -> None:
        """Stored samples (pending, replay, probe) must pass the checks a stream batch passes:
        the input structure, leaf kinds and shapes the learner settled, finite floats, and
        targets the task accepts (labels in range, shapes matching the model's outputs)."""
        y = check_tensor(f"{where}.y", y)
        n = y.shape[0] if y.dim() else -1
        if n == 0:
            return
        if self.input_spec is None or self.output_shape is None or self.task is None:
            raise ValueError(f"`{where}` holds samples but the checkpoint has no input spec, output shape or task")
        cpu = torch.device("cpu")
        try:
            inputs, _ = to_inputs(x, spec=self.input_spec, dtype=self.learner.dtype, device=cpu, name=f"{where}.x")
            self.task.to_targets(y, n=n, output_shape=self.output_shape, dtype=self.learner.dtype, device=cpu)
        except ValueError as error:  # InvalidBatchError: the message names the problem
            raise ValueError(f"`{where}`: {error}") from error
        lengths = {t.shape[0] for t in leaves(inputs)}
        if lengths != {n}:
            raise ValueError(f"`{where}` holds {n} targets but inputs of lengths {sorted(lengths)}")


# ------------------------------------------------------------------------ config
def monitor_kwargs(config: Any) -> dict[str, Any]:
    """Validated constructor arguments of the checkpointed monitor."""
    if not isinstance(config, dict):
        raise ValueError("`config.monitor` must be a dict")  # noqa: TRY004 (a bad state is a ValueError)
    check_keys("config.monitor", config, set(SETTINGS))
    kwargs: dict[str, Any] = {
        name: check_int(f"config.monitor.{name}", config[name], 1, 2**31) for name in ("probe_capacity", "eval_every", "window", "max_events")
    }
    kwargs["seed"] = check_int("config.monitor.seed", config["seed"], -(2**63), 2**64 - 1)
    kwargs["forgetting_threshold"] = check_number("config.monitor.forgetting_threshold", config["forgetting_threshold"])
    if config["prequential"] not in PREQUENTIAL_MODES:
        raise ValueError(f"`config.monitor.prequential == {short(config['prequential'])}`, must be one of {PREQUENTIAL_MODES}")
    kwargs["prequential"] = config["prequential"]
    kwargs["regression_threshold"] = check_number("config.monitor.regression_threshold", config["regression_threshold"], low=0.0)
    return kwargs


def check_config(config: dict[str, Any]) -> None:
    """``config`` must hold the known keys, and the replay batch size and training iterations a learner takes."""
    check_keys("config", config, CONFIG_KEYS | (OPTIONAL_CONFIG_KEYS & set(config)))
    check_int("config.replay_batch_size", config["replay_batch_size"])
    check_int("config.train_iterations", config["train_iterations"], 1, 2**20)


def _config(ctx: Context) -> Apply:
    config = ctx.get("config")
    check_config(config)
    monitor_kwargs(config["monitor"])
    learner = ctx.learner
    if not same(config["optimizer_type"], type(learner.optimizer).__name__):
        raise ValueError(f"checkpoint holds {short(config['optimizer_type'])} state; got a {type(learner.optimizer).__name__} optimizer")
    if not isinstance(config["score_eval"], bool):
        raise ValueError("`config.score_eval` must be a bool")  # noqa: TRY004 (a bad state is a ValueError)
    ctx.task = parse_task(config["task"])
    raw_spec, output_shape = config["input_spec"], config["output_shape"]
    if raw_spec is None and output_shape is not None:
        raise ValueError("`config.output_shape` is set only with `config.input_spec` (from the first batch)")
    if raw_spec is not None:  # without an output shape: from input_shape= or an adapt() before the first labelled batch
        try:
            ctx.input_spec = Spec.from_json(raw_spec)
        except ValueError as error:
            raise ValueError(f"`config.input_spec`: {error}") from error
    if output_shape is not None:
        ctx.output_shape = _shape("config.output_shape", output_shape)
        if ctx.task is None:
            raise ValueError("`config.task` must be set once the first batch settled the input spec")
        try:
            ctx.task.check_outputs(ctx.output_shape)
        except ValueError as error:
            raise ValueError(f"`config.output_shape` does not fit the task: {error}") from error
        ctx.num_classes = ctx.task.num_classes(ctx.output_shape)
    shape = None if ctx.input_spec is None or not ctx.input_spec.is_tensor else tuple(ctx.input_spec.shape)
    if config["num_classes"] != ctx.num_classes or config["input_shape"] != (None if shape is None else list(shape)):
        raise ValueError(
            f"`config.num_classes == {short(config['num_classes'])}` and `config.input_shape == "
            f"{short(config['input_shape'])}` must follow from the input spec, output shape and task"
        )
    for name, live in (("input_spec", learner.input_spec), ("output_shape", learner.output_shape)):
        if live is not None and live != getattr(ctx, name):
            raise ValueError(f"`config.{name}` is {getattr(ctx, name)}; this learner has {live}")
    if learner.task_given and learner.task is not None and ctx.task is not None and learner.task != ctx.task:
        raise ValueError(f"checkpoint holds the task {ctx.task!r}; this learner was built with {learner.task!r}")
    _check_strategy(ctx, config["strategy"])
    settled, live_settled = ctx.output_shape is not None, learner.output_shape is not None
    output = restored_output(config.get("output"), learner.output, settled=settled, live_settled=live_settled)
    score_eval = config["score_eval"]
    max_classes = max_classes_of(config.get("max_classes"), ctx.num_classes)
    max_grad_norm = max_grad_norm_of(config.get("max_grad_norm"))
    call = check_call(config.get("call", "keywords"), "config.call")  # how the model takes a dict / tuple / list input
    frozen_norm = check_frozen_norm(config.get("frozen_norm", "train"), "config.frozen_norm")
    task, spec, out_shape, num_classes = ctx.task, ctx.input_spec, ctx.output_shape, ctx.num_classes

    def apply() -> None:
        learner.restore_config(
            output=output, max_classes=max_classes, max_grad_norm=max_grad_norm, call=call, frozen_norm=frozen_norm,
            task=task, input_spec=spec, output_shape=out_shape, num_classes=num_classes, score_eval=score_eval,
        )  # fmt: skip

    return apply


def max_classes_of(value: Any, num_classes: int | None) -> int | None:
    """``config.max_classes``: None, or the bound a growing classifier's width stays within."""
    if value is None:
        return None
    return check_int("config.max_classes", value, num_classes or 1, MAX_CLASSES)


def max_grad_norm_of(value: Any) -> float | None:
    """``config.max_grad_norm``: None, or the positive finite norm each step's gradient is clipped to."""
    return None if value is None else check_number("config.max_grad_norm", value, positive=True)


def parse_task(value: Any) -> Task | None:
    """The checkpointed task (a :meth:`Task.config` dict), or None before it was settled."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"`config.task == {short(value)}`, must be a task config dict or None")  # noqa: TRY004 (a bad state is a ValueError)
    try:
        return resolve_task(value)
    except ValueError as error:
        raise ValueError(f"`config.task`: {error}") from error


def parse_strategy(value: Any) -> dict[str, Any] | None:
    """The checkpointed strategy description ``{"name", "config"}`` (None in older states: plain ER)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "config"} or not isinstance(value["name"], str) or not isinstance(value["config"], dict):
        raise ValueError(f"`config.strategy == {short(value)}`, must be {{'name': str, 'config': dict}}")
    return value


def rebuilt_strategy(described: dict[str, Any]) -> Strategy | None:
    """The built-in strategy a parsed description names, rebuilt from its config, which must
    hold exactly the constructor's keys with values it accepts; None for a custom name."""
    builtin = BUILTIN_STRATEGIES.get(described["name"])
    if builtin is None:
        return None
    check_keys("config.strategy.config", described["config"], set(builtin().config()), f" from {builtin.__name__}'s")
    try:
        return builtin(**described["config"])
    except (ValueError, TypeError) as error:
        raise ValueError(f"`config.strategy.config`: {error}") from error


def strategy_fits(strategy: Strategy, task: Task | None, replay: ReplayStrategy | None) -> None:
    """The strategy must support the checkpoint's task and the buffer (DER++ needs one that keeps fields)."""
    problem = strategy.problem(task, replay)
    if problem is not None:
        raise ValueError(f"`config.strategy`: {problem}")


def _check_strategy(ctx: Context, value: Any) -> None:
    """``config.strategy`` must describe the learner's strategy: the same name (None, in older
    states: plain ER), the hyperparameter keys of the live strategy with valid values (a
    built-in is rebuilt from them), and a task and buffer it works with."""
    described = parse_strategy(value) or {"name": ExperienceReplay.name, "config": {}}
    strategy = ctx.learner.strategy
    if described["name"] != strategy.name:
        raise ValueError(f"checkpoint was trained with strategy {short(described['name'])}; this learner uses {strategy.name!r}")
    if type(strategy) is BUILTIN_STRATEGIES.get(strategy.name):
        rebuilt_strategy(described)
    else:
        check_keys("config.strategy.config", described["config"], set(strategy.config()), f" from {type(strategy).__name__}'s")
    strategy_fits(strategy, ctx.task, ctx.learner.replay)


def _shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 16:
        raise ValueError(f"`{where} == {short(value)}`, must be a list of at most 16 ints")
    shape = tuple(check_int(where, d, 1, 2**31) for d in value)
    if math.prod(shape) > 2**31:
        raise ValueError(f"`{where} == {list(shape)}` has more than 2**31 entries")
    return shape


# -------------------------------------------------------------- counters, model
def _counters(ctx: Context) -> Apply:
    counters = ctx.get("counters")
    check_keys("counters", counters, {"samples_seen", "steps"})
    seen, steps = check_int("counters.samples_seen", counters["samples_seen"]), check_int("counters.steps", counters["steps"])
    learner = ctx.learner

    def apply() -> None:
        learner.samples_seen, learner.steps = seen, steps

    return apply


def _model(ctx: Context) -> Apply:
    saved = ctx.get("model")
    live = ctx.learner.model.state_dict()
    try:
        check_keys("model", saved, set(live))
    except ValueError as error:
        raise ValueError(f"{error}{_wrapping_hint(saved, live)}") from None
    for name, tensor in live.items():
        check_tensor(f"model.{name}", saved[name], shape=tuple(tensor.shape), dtype=tensor.dtype)
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


# --------------------------------------------------------------------- optimizer
def _hyperparameter(where: str, saved: Any, live: Any, key: str) -> None:
    """A param-group value must have the live value's kind; numbers must be finite and
    in range (lr >= 0; see :data:`taste_cl.guards.update.HYPERPARAMETER_RANGES`)."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        if saved is not None and type(saved) is not type(live) and live is not None:
            raise ValueError(f"`{where} == {short(saved)}`, must be a {type(live).__name__}")
        if live is None and not (saved is None or isinstance(saved, (bool, str, int, float))):
            raise ValueError(f"`{where} == {short(saved)}` has an unexpected type")
    elif isinstance(live, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(live):
            raise ValueError(f"`{where} == {short(saved)}`, must be a sequence of {len(live)}")
        for i, (s, v) in enumerate(zip(saved, live)):
            _hyperparameter(f"{where}[{i}]", s, v, key)
    elif isinstance(live, (int, float, torch.Tensor)):
        number = check_number(where, saved, low=0.0 if key == "lr" else -math.inf)
        problem = hyperparameter_problem(key, number)
        if problem is not None:
            raise ValueError(f"`{where}` {problem}")


_SCALAR_STATE = {"step", "mu_product", "eta", "mu"}  # per-parameter scalars of torch's optimizers
_FACTORED_STATE = {"row_var", "col_var"}  # Adafactor: the parameter's shape with some dims reduced to 1


def _optimizer_state_value(where: str, key: str, value: Any, shape: tuple[int, ...]) -> None:
    """Per-parameter optimizer state: scalars for the known scalar keys, else a tensor of the
    parameter's shape (``momentum_buffer`` may be None: SGD without momentum)."""
    if key in _SCALAR_STATE:
        if isinstance(value, torch.Tensor) and value.dim() != 0:
            raise ValueError(f"`{where}` must be a scalar; got shape {tuple(value.shape)}")
        check_number(where, value, low=0.0 if key == "step" else -math.inf)
        return
    if value is None and key == "momentum_buffer":
        return
    tensor = check_tensor(where, value)
    got = tuple(tensor.shape)
    fits = got == shape or (key in _FACTORED_STATE and len(got) == len(shape) and all(g in (1, s) for g, s in zip(got, shape)))
    if not fits or not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"`{where}` must be a floating tensor of the parameter's shape {shape}; got {tensor.dtype} {got}")


def _optimizer(ctx: Context) -> Apply:
    saved = ctx.get("optimizer")
    optimizer = ctx.learner.optimizer
    live = optimizer.state_dict()
    check_keys("optimizer", saved, {"state", "param_groups"})
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(live["param_groups"]):
        raise ValueError(f"`optimizer.param_groups` must be a list of {len(live['param_groups'])} groups")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for g, (group, live_group) in enumerate(zip(groups, live["param_groups"])):
        if not isinstance(group, dict):
            raise ValueError(f"`optimizer.param_groups[{g}]` must be a dict")  # noqa: TRY004 (a bad state is a ValueError)
        check_keys(f"optimizer.param_groups[{g}]", group, set(live_group))
        if group["params"] != live_group["params"]:
            raise ValueError(f"`optimizer.param_groups[{g}].params` must be {live_group['params'][:8]}...")
        for key, value in live_group.items():
            if key != "params":
                _hyperparameter(f"optimizer.param_groups[{g}].{key}", group[key], value, key)
    state = saved["state"]
    if not isinstance(state, dict):
        raise ValueError("`optimizer.state` must be a dict")  # noqa: TRY004 (a bad state is a ValueError)
    for index, entry in state.items():
        check_int("optimizer.state key", index, 0, len(params) - 1)
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise ValueError(f"`optimizer.state[{index}]` must be a dict with string keys")
        for key, value in entry.items():
            _optimizer_state_value(f"optimizer.state[{index}].{key}", key, value, tuple(params[index].shape))
    return lambda: optimizer.load_state_dict(saved)


# ----------------------------------------------------------------- training, rng
def _training(ctx: Context) -> Apply:
    training = ctx.get("training")
    check_keys("training", training, TRAINING_KEYS | {"grads"})
    learner = ctx.learner
    batcher_state = MicroBatcher.parse_state(training, ctx.input_spec, ctx.check_samples)
    grads = training["grads"]
    parameters = list(learner.model.parameters())
    if not isinstance(grads, list) or len(grads) != len(parameters):
        raise ValueError(f"`training.grads` must be a list of {len(parameters)} entries (one per parameter)")
    for i, (grad, param) in enumerate(zip(grads, parameters)):
        if grad is not None and (not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(param.shape) or grad.dtype != param.dtype):
            raise ValueError(
                f"`training.grads[{i}]` must be None or a {param.dtype} tensor of shape {tuple(param.shape)}; "
                f"got {short(grad) if not isinstance(grad, torch.Tensor) else (grad.dtype, tuple(grad.shape))}"
            )
    if batcher_state.accumulated == 0 and any(g is not None for g in grads):
        raise ValueError("`training.grads` are set but no micro-batch is accumulated")

    def apply() -> None:
        learner.batcher.load_state(batcher_state, lambda pending: _placed(learner, pending))
        for param, grad in zip(parameters, grads):
            param.grad = None if grad is None else grad.to(param.device).clone()

    return apply


def _placed(learner: OnlineLearner, pending: Samples) -> Samples:
    """Pending samples as the learner keeps them: floating leaves in its dtype, all on its device."""
    device, dtype = learner.device, learner.dtype
    x = map_leaves(lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).clone(), pending[0])
    return x, pending[1].to(device).clone()


def _rng(ctx: Context) -> Apply:
    rng = ctx.get("rng")
    check_keys("rng", rng, {"torch"})
    value = check_generator_state("rng.torch", rng["torch"])
    return lambda: torch.set_rng_state(value.cpu())


LEARNER_SECTIONS: dict[str, Callable[[Context], Apply]] = {
    "config": _config,
    "counters": _counters,
    "model": _model,
    "optimizer": _optimizer,
    "training": _training,
    "rng": _rng,
}
"""The sections the learner owns, by name (:mod:`.restore` puts them in parsing order with its parts')."""
