"""Grow the classifier at run time: a class the pretrained model never saw.

A user adds their own class (a new contact, gesture or word) after deployment.
``OnlineLearner(model, max_classes=N)`` lets a classification learner's output grow up
to ``N`` classes: a batch carrying a label at or above the current width widens the
classifier to ``label + 1`` outputs before it trains (Avalanche's
``IncrementalClassifier`` does the same per experience). The classifier is the last
``nn.Linear`` whose ``out_features`` is the output width and whose output *is* the
model's output, checked by a one-sample forward; a model without one is refused on the
first batch, naming the linear layers it has.

Widening keeps the old rows bit for bit and initialises the new ones as a fresh
``nn.Linear`` would (what ``IncrementalClassifier`` does); the parameters keep their
identity (their ``.data`` grows), so the optimizer, plugins and anything else holding
them keep working. Everything that depends on the width follows:

* optimizer state of the classifier (momentum, Adam's moments) gets zero rows; step
  counts are kept (one per tensor); a pending gradient gets zero rows;
* ER-ACE's masking and the monitor read the width from the outputs: nothing to do;
* DER++'s stored logits get the new columns the grown model gives the stored samples,
  as if the head had been that wide, its new rows untrained, since they were stored
  (DER++'s reference code keeps a fixed-width head and distils every column the same way);
* LwF's snapshot gets the same new rows, so its distillation target is the model as it
  was plus the untrained rows;
* the update guard drops its rollback snapshot (it predates the head; the next applied
  step takes one); a ``ProbeGuard`` plugin keeps a copy of the model and refuses growth;
* checkpoints record the width: :meth:`OnlineLearner.load` with the original-width model
  grows it to the saved width before validating the rest (undone if anything fails).

>>> import torch
>>> from torch import nn
>>> from taste_cl import OnlineLearner
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> learner = OnlineLearner(model, max_classes=10)
>>> _ = learner.observe((torch.randn(4, 4), torch.tensor([0, 1, 2, 3])))
>>> learner.num_classes, tuple(learner.predict(torch.randn(2, 4)).shape)
(4, (2, 4))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from taste_cl._batch import Inputs, call_model, index_batch
from taste_cl.exceptions import InvalidBatchError
from taste_cl.outputs import OutputSelector
from taste_cl.tasks import Classification, Task

if TYPE_CHECKING:
    from taste_cl.learner.learner import OnlineLearner

__all__ = ["MAX_CLASSES", "Head", "find_head", "grow_for_state", "plan_growth", "reserved_slots", "widen"]

Undo = Callable[[], None]
MAX_CLASSES = 100_000
"""The largest ``max_classes`` (the device runtimes' bound on a manifest's classes too)."""
_SHOWN = 8  # layers named in a refusal
_CHUNK = 256  # stored samples per forward when DER++'s logits are widened


@dataclass(frozen=True)
class Head:
    """The classifier: the ``nn.Linear`` at ``name`` (a ``model.get_submodule`` path) whose output is the model's."""

    name: str
    linear: nn.Linear


def find_head(model: nn.Module, width: int, x: Inputs | None = None, output: OutputSelector | None = None, call: str = "auto") -> Head:
    """The classifier of ``model``: the last ``nn.Linear`` with ``width`` outputs whose output
    is the model's output on ``x`` (one eval-mode forward; skipped when ``x`` is None).

    ``ValueError`` names the linear layers found when none fits, or when the classifier's
    weight is shared with another layer (tied embeddings: widening it would change both).
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    candidates = [(name, m) for name, m in linears if m.out_features == width]
    if not candidates:
        found = ", ".join(f"{name or '<model>'} ({m.out_features} outputs)" for name, m in linears[-_SHOWN:]) or "none"
        raise ValueError(
            f"cannot grow the classifier: no nn.Linear has the model's {width} outputs (linear layers found: {found}); "
            "growing needs the classifier to be an nn.Linear producing the model's output"
        )
    if x is not None:
        candidates = _producing_output(model, candidates, x, output, call)
    name, linear = candidates[-1]
    tied = sum(p is linear.weight for _, p in model.named_parameters(remove_duplicate=False))
    if tied > 1:
        raise ValueError(f"cannot grow the classifier {name!r}: its weight is shared with another layer (tied weights)")
    return Head(name, linear)


def _producing_output(
    model: nn.Module, candidates: list[tuple[str, nn.Linear]], x: Inputs, output: OutputSelector | None, call: str
) -> list[tuple[str, nn.Linear]]:
    """The candidates whose output on the first sample of ``x`` is exactly the model's output."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out)) for name, m in candidates]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            out = call_model(model, index_batch(x, slice(0, 1)), output=output, call=call)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    producing = [(name, m) for name, m in candidates if name in seen and seen[name].shape == out.shape and torch.equal(seen[name], out)]
    if not producing:
        names = ", ".join(name or "<model>" for name, _ in candidates[-_SHOWN:])
        raise ValueError(
            f"cannot grow the classifier: the nn.Linear layers with the model's {out.shape[1]} outputs ({names}) do not give "
            "the model's output (something runs after them); growing needs the classifier's output to be the model's"
        )
    return producing


def new_rows(linear: nn.Linear, count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights and bias for ``count`` new outputs, drawn as ``nn.Linear.reset_parameters`` draws them."""
    weight = torch.empty(count, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if linear.bias is None:
        return weight, None
    bound = 1 / math.sqrt(linear.in_features) if linear.in_features > 0 else 0.0
    return weight, torch.empty(count, dtype=linear.bias.dtype, device=linear.bias.device).uniform_(-bound, bound)


def _padded_state(optimizer: torch.optim.Optimizer | None, param: torch.Tensor, extra: int) -> dict[str, Any] | None:
    """The optimizer state of ``param`` with ``extra`` zero rows on every per-element tensor
    (scalars such as step counts kept); None when it holds none. ``ValueError`` for a state
    tensor of another shape (a factored state the rows cannot be added to)."""
    if optimizer is None or param not in optimizer.state:
        return None
    padded: dict[str, Any] = {}
    for key, value in optimizer.state[param].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != param.shape:
                raise ValueError(
                    f"cannot grow the classifier: the optimizer's state {key!r} has shape {tuple(value.shape)}, not the "
                    f"parameter's {tuple(param.shape)}; use an optimizer with per-element state (SGD, Adam, AdamW)"
                )
            value = torch.cat([value, value.new_zeros((extra, *value.shape[1:]))])
        padded[key] = value
    return padded


def widen(
    head: Head,
    width: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    rows: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> Undo:
    """Grow ``head`` to ``width`` outputs in place: old rows kept bit for bit, new ones
    ``rows`` (default: :func:`new_rows`); the optimizer's state and any pending gradient get
    zero rows. Everything is checked first. Returns a function that undoes it exactly."""
    linear = head.linear
    extra = width - linear.out_features
    if extra < 1:
        raise ValueError(f"`width == {width}`, must be more than the classifier's {linear.out_features} outputs")
    params = [p for p in (linear.weight, linear.bias) if p is not None]
    states = [_padded_state(optimizer, p, extra) for p in params]  # checks every state before anything changes
    added = rows if rows is not None else new_rows(linear, extra)
    saved = [(p.data, p.grad, None if optimizer is None else optimizer.state.get(p)) for p in params]
    old_width = linear.out_features
    for p, grow, state in zip(params, added, states):
        grad = p.grad
        assert grow is not None
        p.data = torch.cat([p.data, grow.to(p.data)])
        if grad is not None:
            p.grad = torch.cat([grad, grad.new_zeros((extra, *grad.shape[1:]))])
        if optimizer is not None and state is not None:
            optimizer.state[p] = state
    linear.out_features = width

    def undo() -> None:
        for p, (data, grad, state) in zip(params, saved):
            p.data = data
            p.grad = grad
            if optimizer is not None:
                if state is None:
                    optimizer.state.pop(p, None)
                else:
                    optimizer.state[p] = state
        linear.out_features = old_width

    return undo


def check_growable(task: Task, output_shape: tuple[int, ...], max_classes: int) -> None:
    """A learner with ``max_classes`` must classify (one label per sample) into at most that many classes."""
    if type(task) is not Classification:
        raise ValueError(f"max_classes grows a classifier; this learner's task is {task.name}: leave max_classes=None")
    if output_shape[0] > max_classes:
        raise ValueError(f"`max_classes == {max_classes}`, must be >= the model's {output_shape[0]} outputs")


def _refusal(learner: OnlineLearner) -> str | None:
    """Why ``learner``'s parts cannot follow a grown head, or None."""
    from taste_cl.guards.probe import ProbeGuard
    from taste_cl.replay import ClassBalancedReplay, ReservoirReplay
    from taste_cl.strategies import BUILTIN_STRATEGIES

    strategy = learner.strategy
    if type(strategy) not in BUILTIN_STRATEGIES.values() and strategy.stored_fields:
        return f"strategy {strategy.name!r} stores {', '.join(strategy.stored_fields)} of the old width"
    if strategy.stored_fields and not isinstance(learner.replay, (ReservoirReplay, ClassBalancedReplay)):
        return f"the buffer {type(learner.replay).__name__} keeps DER++'s logits where they cannot be widened"
    guards = [plugin.name for plugin in learner.plugins if isinstance(plugin, ProbeGuard)]
    if guards:
        return f"the ProbeGuard plugin {guards[0]!r} keeps a copy of the model of the old width"
    return None


def plan_growth(
    learner: OnlineLearner, x: Inputs, y: torch.Tensor, output_shape: tuple[int, ...], output: OutputSelector | None, *, first: bool = False
) -> Callable[[], None] | None:
    """Check that ``learner`` can grow to the labels ``y`` (validated against ``max_classes``)
    and return the function that grows it, or None when the head is wide enough. Changes nothing.

    On the ``first`` batch the classifier is looked for even when no label needs it, so a
    model that cannot grow is refused at once (``ValueError`` naming its linear layers).
    :class:`~taste_cl.exceptions.InvalidBatchError` names the label when growth is not possible.
    """
    width = output_shape[0]
    needed = int(y.max()) + 1 if y.numel() else 0
    if needed <= width and not first:
        return None
    head = find_head(learner.model, width, x, output, learner.call)
    if needed <= width:
        return None
    problem = _refusal(learner)
    if problem is None:
        try:
            [_padded_state(learner.optimizer, p, needed - width) for p in (head.linear.weight, head.linear.bias) if p is not None]
        except ValueError as error:
            problem = str(error).removeprefix("cannot grow the classifier: ")
    if problem is not None:
        raise InvalidBatchError(f"y has label {needed - 1}, beyond the model's {width} classes; the classifier cannot grow: {problem}")
    return lambda: _grow(learner, head, needed)


def _grow(learner: OnlineLearner, head: Head, width: int) -> None:
    """Widen ``learner``'s classifier to ``width`` outputs and everything that follows it (see the module doc)."""
    from taste_cl.replay import SeededStrategy
    from taste_cl.strategies import DERPlusPlus, LwF

    old = head.linear.out_features
    rows = new_rows(head.linear, width - old)
    widen(head, width, optimizer=learner.optimizer, rows=rows)
    learner.output_shape, learner.num_classes = (width,), width
    strategy = learner.strategy
    if isinstance(strategy, LwF) and strategy.teacher is not None:
        teacher_head = Head(head.name, strategy.teacher.get_submodule(head.name))  # type: ignore[arg-type]
        widen(teacher_head, width, rows=rows)
    storage = learner.replay.storage if isinstance(learner.replay, SeededStrategy) else None  # _refusal checked it for DER++
    if isinstance(strategy, DERPlusPlus) and storage is not None and "logits" in storage.field_names:
        x = storage.contents()[0] if len(storage) else None
        columns = [learner.stored_logits(index_batch(x, slice(s, s + _CHUNK)))[:, old:] for s in range(0, len(storage), _CHUNK)]
        storage.widen_field("logits", torch.cat(columns) if columns else torch.empty(0, width - old))
    learner.guard.drop_snapshot()  # of the old width: the next applied step snapshots
    learner.monitor.emit("classes_added", classes=list(range(old, width)), width=width)


def grow_for_state(learner: OnlineLearner, state: Any) -> Undo | None:
    """Before a checkpoint is validated: grow ``learner``'s classifier to the width the
    checkpoint's grew to, when the checkpoint was written by a learner with ``max_classes``
    and its model differs from this one only in the rows of one ``nn.Linear``. Returns the
    undo, or None (nothing to grow; the validation then reports any mismatch)."""
    config = state.get("config") if isinstance(state, dict) else None
    saved = state.get("model") if isinstance(state, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("max_classes"), int) or not isinstance(saved, dict):
        return None
    shape = config.get("output_shape")
    if not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int) or shape[0] > config["max_classes"]:
        return None
    live = learner.model.state_dict()
    differing = sorted(k for k, v in live.items() if isinstance(saved.get(k), torch.Tensor) and saved[k].shape != v.shape)
    prefixes = {k.rpartition(".")[0] for k in differing}
    if len(prefixes) != 1:
        return None
    (name,) = prefixes
    try:
        linear = learner.model.get_submodule(name)
    except AttributeError:
        return None
    keys = {f"{name}.{p}" if name else p for p in ("weight", "bias")}  # name "": the model is the nn.Linear
    weight = saved.get(f"{name}.weight" if name else "weight")
    if not isinstance(linear, nn.Linear) or not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (shape[0], linear.in_features):
        return None
    if shape[0] <= linear.out_features or not set(differing) <= keys:
        return None
    try:
        undo_head = widen(Head(name, linear), shape[0], optimizer=learner.optimizer)
    except ValueError:  # optimizer state the rows cannot be added to: the validation names the mismatch
        return None
    before = learner.output_shape, learner.num_classes
    if learner.output_shape is not None:
        learner.output_shape, learner.num_classes = (shape[0],), shape[0]

    def undo() -> None:
        undo_head()
        learner.output_shape, learner.num_classes = before

    return undo


def reserved_slots(model: nn.Module, optimizer: torch.optim.Optimizer | None, learner: OnlineLearner, reserved: int, x: Inputs) -> list[int] | None:
    """Widen an export's copy of ``learner``'s model (``model``, returning the tensor trained
    on, and its ``optimizer``) by ``reserved`` output slots for classes added on the device,
    which masks them until their first label. Returns the active classes, or None when
    ``reserved`` is 0 (nothing changed)."""
    if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
        raise ValueError(f"`reserved_classes == {reserved!r}`, must be an int >= 0")
    if not reserved:
        return None
    width = learner.num_classes
    if type(learner.task) is not Classification or width is None:
        what = "of unknown width: let it observe a batch or pass num_classes=" if width is None else f"for {learner.task}"
        raise ValueError(f"reserved_classes adds classifier outputs; this learner has no classifier {what}")
    if width + reserved > MAX_CLASSES:
        raise ValueError(f"`reserved_classes == {reserved}`, must keep the classes within {MAX_CLASSES}; the model has {width}")
    with torch.random.fork_rng(devices=[]):  # the new rows' draw leaves the learner's random stream as it was
        widen(find_head(model, width, x, call=learner.call), width + reserved, optimizer=optimizer)
    return list(range(width))
