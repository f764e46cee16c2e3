"""What a learner checks before it trains, and what it learns from its first batch.

At construction: the arguments' types and ranges, that the optimizer trains the model,
and that the replay buffer fits the task. On the first batch, :func:`settle_first_batch`
checks that the model takes the inputs and returns one tensor (or a dict, tuple or
dataclass holding it, picked by the learner's ``output`` or inferred: see
:mod:`taste_cl.outputs`), settles the task (given,
implied by the loss, or classification for integer targets), validates the targets,
checks that the loss is a scalar and decides whether the prequential score needs an
eval-mode forward. It changes nothing: the learner commits the returned
:class:`FirstBatch` only when all of it passed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from taste_cl._batch import Inputs, Spec, as_tensor, batch_len, call_model, call_style, check_call, index_batch, leaves
from taste_cl._checks import check_int, check_positive
from taste_cl.exceptions import InvalidBatchError
from taste_cl.learner.frozen import check_frozen_norm, norm_modules, train_mode
from taste_cl.learner.heads import MAX_CLASSES, check_growable
from taste_cl.outputs import OutputSelector, describe_output, select_checked
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy
from taste_cl.tasks import Classification, Task, infer_task

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner
    from taste_cl.plugins import LearnerPlugin

__all__ = ["FirstBatch", "check_arguments", "check_optimizer_covers", "check_replay_fits", "settle_first_batch"]


@dataclass(frozen=True)
class FirstBatch:
    """What the first batch settled, and its targets as the task wants them."""

    task: Task
    spec: Spec
    output_shape: tuple[int, ...]
    num_classes: int | None
    score_eval: bool  # the prequential score comes from an eval-mode forward
    targets: torch.Tensor
    output: OutputSelector | None  # picks the trained tensor from the model's output (None: it is one)
    returned: str  # what the model returned, described


def settle_first_batch(learner: OnlineLearner, x: Inputs, spec: Spec, raw_y: Any) -> FirstBatch:
    """Check the first batch ``(x, raw_y)`` (``x`` already placed, described by ``spec``) against ``learner``.

    Raises :class:`~taste_cl.exceptions.InvalidBatchError` for inputs or targets the
    model, task or loss cannot take, ``ValueError`` for a learner set up against them
    (``num_classes``, replay buffer, strategy, the monitor's task).
    """
    device, dtype = learner.device, learner.dtype
    n = batch_len(x)
    try:
        raw = learner.eval_outputs(index_batch(x, slice(0, 1)))
    except Exception as error:
        raise InvalidBatchError(f"model cannot take x of {_shapes(x)}: {error}{_integer_hint(x)}{_call_hint(learner, x, error)}") from error
    # the model is checked on the first sample only: a cheap forward, whatever the batch size
    output, out = select_checked(raw, learner.output, 1, where="the first sample of the first batch")
    output_shape = tuple(out.shape[1:])
    task = learner.task if learner.task_given else infer_task(learner.loss_fn, output_shape)
    if task is None:
        task = _task_from_targets(raw_y, learner.loss_fn)
    task.check_outputs(output_shape)
    num_classes = task.num_classes(output_shape)
    if learner.num_classes is not None and num_classes != learner.num_classes:
        raise ValueError(f"model outputs {num_classes} logits but num_classes={learner.num_classes}")
    label_shape = output_shape
    if learner.max_classes is not None:  # labels up to max_classes - 1: the classifier grows to them
        check_growable(task, output_shape, learner.max_classes)
        label_shape = (learner.max_classes,)
    y = task.to_targets(raw_y, n=n, output_shape=label_shape, dtype=dtype, device=device)
    check_replay_fits(learner.replay, task)
    learner.strategy.check(task, learner.replay)
    _check_scalar_loss(learner.loss_fn, out, y[:1].clamp(max=output_shape[0] - 1) if label_shape != output_shape else y[:1])
    monitor = learner.monitor
    if task != monitor.task and (monitor.steps or monitor.samples_seen):
        raise ValueError(f"the monitor already scored {monitor.task!r}; this learner's task is {task!r}")
    mode = monitor.prequential
    score_eval = mode == "eval" or (mode == "auto" and _output_depends_on_mode(learner.model, x, output, learner.call, learner.frozen_norms))
    return FirstBatch(task, spec, output_shape, num_classes, score_eval, y, output, describe_output(raw))


def check_arguments(
    model: nn.Module,
    replay: ReplayStrategy | None,
    replay_batch_size: int,
    train_iterations: int,
    num_classes: int | None,
    plugins: Sequence[LearnerPlugin],
    max_classes: int | None = None,
    max_grad_norm: float | None = None,
    call: str = "auto",
    frozen_norm: str = "eval",
) -> None:
    """The constructor's arguments that are checked on their own: types, ranges, unique plugin names."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if replay is not None and not isinstance(replay, ReplayStrategy):
        raise TypeError(f"replay must be a taste_cl.ReplayStrategy or None; got {type(replay).__name__}")
    check_int("replay_batch_size", replay_batch_size, 0)
    check_int("train_iterations", train_iterations, 1)
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"`num_classes == {num_classes}`, must be >= 1")
    if max_classes is not None and (check_int("max_classes", max_classes, 1) > MAX_CLASSES):
        raise ValueError(f"`max_classes == {max_classes}`, must be <= {MAX_CLASSES}")
    if max_grad_norm is not None and not math.isfinite(check_positive("max_grad_norm", max_grad_norm)):
        raise ValueError(f"`max_grad_norm` must be finite (None: no clipping); got {max_grad_norm}")
    check_call(call)
    check_frozen_norm(frozen_norm)
    names = [plugin.name for plugin in plugins]
    if len(set(names)) != len(names):
        raise ValueError(f"plugin names must be unique (they key checkpoint state); got {names}")


def check_optimizer_covers(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must train the model: hold some of its parameters and every trainable one."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = list(model.named_parameters())
    if named and not any(id(p) in held for _, p in named):
        raise ValueError(
            "optimizer holds none of the model's parameters (was it built for another model or a copy?); build it from model.parameters()"
        )
    missing = [name for name, p in named if p.requires_grad and id(p) not in held]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"{len(missing)} trainable parameter(s) are in no optimizer group: {shown}; add them to the optimizer or set requires_grad=False"
        )


def check_replay_fits(replay: ReplayStrategy | None, task: Task | None) -> None:
    """A class-balanced buffer needs one class label per sample."""
    if isinstance(replay, ClassBalancedReplay) and task is not None and not task.balances_classes:
        raise ValueError(f"ClassBalancedReplay balances on one class label per sample; the {task.name} task has none. Use ReservoirReplay")


def _shapes(x: Inputs) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}"
    return "leaf shapes " + ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves(x))


def _integer_hint(x: Inputs) -> str:
    if any(not t.is_floating_point() for t in leaves(x)):
        return " (integer and bool inputs are passed to the model unchanged, for embeddings; convert float features with .float())"
    return ""


def _call_hint(learner: OnlineLearner, x: Inputs, error: Exception) -> str:
    """For a structured ``x`` spread into a model that refused the arguments: the call mode that passes it whole."""
    if not isinstance(error, TypeError) or isinstance(x, torch.Tensor) or call_style(learner.model, x, learner.call) != "keywords":
        return ""
    spread = "**" if isinstance(x, dict) else "*"
    return f" (x is passed as model({spread}x); if forward takes it as one argument, pass OnlineLearner(call='positional'))"


def _task_from_targets(raw_y: Any, loss_fn: Any) -> Task:
    """The task for a loss taste_cl does not know: classification for integer targets only."""
    y = as_tensor(raw_y, "y")
    if y.is_floating_point() or y.dtype == torch.bool or y.dim() != 1:
        raise InvalidBatchError(
            f"cannot infer the task from loss_fn={type(loss_fn).__name__} and targets of dtype {y.dtype}, shape "
            f"{tuple(y.shape)}: pass task='regression', 'multilabel', 'classification' or 'token_classification' "
            "(or a taste_cl.tasks.Task) to OnlineLearner(task=...)"
        )
    return Classification()


def _check_scalar_loss(loss_fn: Callable[..., Any], outputs: torch.Tensor, targets: torch.Tensor) -> None:
    """The loss of one sample must be a scalar tensor (a mean or a sum), or the step would fail mid-way."""
    try:
        with torch.no_grad():
            loss = loss_fn(outputs, targets)
    except Exception as error:
        raise InvalidBatchError(
            f"loss_fn cannot take model outputs of shape {tuple(outputs.shape)} and targets of shape "
            f"{tuple(targets.shape)}, dtype {targets.dtype}: {error}"
        ) from error
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidBatchError(f"loss_fn must return a scalar tensor (use reduction='mean' or 'sum'); got {got}")


def _output_depends_on_mode(model: nn.Module, x: Inputs, output: OutputSelector | None, call: str, frozen: Sequence[str]) -> bool:
    """Whether train mode (the learner's: the ``frozen`` normalisation modules in eval mode) changes the
    model's output on ``x`` (batch statistics, dropout, ...).

    Checked on a copy, with the RNG restored afterwards, so neither the model's buffers nor
    the random stream change. Any failure counts as mode-dependent (scoring in eval mode is
    always right, only slower).
    """
    try:
        twin = copy.deepcopy(model)
        devices = sorted({t.device.index or 0 for t in leaves(x) if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            eval_out = call_model(twin.eval(), x, output=output, call=call)
            train_mode(twin, norm_modules(twin, frozen))
            train_out = call_model(twin, x, output=output, call=call)
        return not torch.allclose(train_out.float(), eval_out.float(), rtol=1e-4, atol=1e-5)
    except Exception:  # noqa: BLE001 - any failure (copy, train-mode forward) means: score in eval mode
        return True
