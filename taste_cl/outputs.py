"""Which tensor of a model's output the learner trains on.

Hugging Face models return a ``ModelOutput`` (a dict with ``logits`` beside hidden states
and attentions), many others a tuple ``(logits, aux)`` or a dataclass. The learner needs
one ``(batch, ...)`` tensor; ``OnlineLearner(model, output=...)`` names it:

- a ``str``: the mapping entry or attribute of that name (dicts, dataclasses, ``ModelOutput``);
- an ``int``: the element at that index (tuples and lists);
- a callable ``outputs -> tensor`` for anything else.

Without ``output=``, the first batch decides (:func:`infer_output`, logged at INFO): a
tensor is used as it is, a mapping or dataclass with a ``logits`` entry gives
``output="logits"``, a tuple or list whose first element is a ``(batch, ...)`` tensor gives
``output=0``; anything else is refused with what came back and how to pass ``output=``.

One :class:`OutputSelector` goes wherever the model is called
(:func:`~taste_cl._batch.call_model`'s ``output``): training, ``predict``, the monitor,
strategies, the tuner's probes, elastic profiling, the probe guard, and export, whose
graphs output the selected tensor (:func:`selecting`). A key or an index is saved in
checkpoints; a callable cannot be, so ``OnlineLearner.load`` needs it again.

>>> import torch
>>> pick = OutputSelector("logits")
>>> pick({"logits": torch.zeros(2, 3), "hidden_states": torch.zeros(2, 5, 8)}).shape
torch.Size([2, 3])
>>> infer_output((torch.zeros(2, 3), torch.zeros(2)), n=2)
OutputSelector(0)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from taste_cl._batch import call_model, index_batch, map_leaves
from taste_cl.exceptions import InvalidBatchError

__all__ = ["OutputLike", "OutputSelector", "describe_output", "infer_output", "resolve_output", "restored_output", "select_checked", "selecting"]

HINT = (
    "pass OnlineLearner(..., output=...) naming the tensor to train on: a key or attribute (output='logits'), "
    "an index (output=0) or a callable (output=lambda out: out.scores)"
)


class OutputSelector:
    """Picks the tensor to train on from a model's output: a key or attribute (``str``), an
    index (``int``) or a callable. Calling it on an output that lacks the entry raises
    :class:`~taste_cl.exceptions.InvalidBatchError` naming what the model returned."""

    __slots__ = ("how",)

    def __init__(self, how: str | int | Callable[[Any], torch.Tensor]) -> None:
        if isinstance(how, str):
            if not how:
                raise ValueError("output must be a non-empty key, an index or a callable; got ''")
        elif isinstance(how, bool) or not (isinstance(how, int) or callable(how)):
            raise TypeError(f"output must be a str key, an int index or a callable outputs -> tensor; got {type(how).__name__}")
        self.how = how

    def __call__(self, out: Any) -> Any:
        how = self.how
        if callable(how):
            return how(out)
        try:
            if isinstance(how, int) or isinstance(out, Mapping):
                return out[how]
            return getattr(out, how)
        except (KeyError, IndexError, AttributeError, TypeError) as error:
            entry = f"element at index {how}" if isinstance(how, int) else f"entry or attribute {how!r}"
            raise InvalidBatchError(f"model output has no {entry}: it returned {describe_output(out)}; {HINT}") from error

    @property
    def saveable(self) -> bool:
        """Whether a checkpoint can hold it (a key or an index; a callable is code)."""
        return not callable(self.how)

    def to_json(self) -> str | int | dict[str, str]:
        """The checkpoint form: the key or index, or ``{"callable": qualified name}`` (a marker: the code is not saved)."""
        if callable(self.how):
            return {"callable": _callable_name(self.how)}
        return self.how

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputSelector) and self.how == other.how

    def __hash__(self) -> int:
        return hash(self.how)

    def __repr__(self) -> str:
        return f"OutputSelector({_callable_name(self.how) if callable(self.how) else repr(self.how)})"

    def __str__(self) -> str:
        return f"output={_callable_name(self.how) if callable(self.how) else repr(self.how)}"


OutputLike = str | int | Callable[[Any], torch.Tensor] | OutputSelector
"""What ``output=`` takes: a key or attribute name, an index, a callable, or a selector."""


def _callable_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def resolve_output(output: OutputLike | None) -> OutputSelector | None:
    """The selector for ``output=`` (None: decided on the first batch)."""
    return output if output is None or isinstance(output, OutputSelector) else OutputSelector(output)


def describe_output(out: Any) -> str:
    """What a model returned, for messages: its type and shape, keys, fields or items."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    kind = type(out).__name__
    if isinstance(out, Mapping):
        return f"a {kind} with keys {[str(key) for key in list(out)[:8]]}"
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return f"a {kind} dataclass with fields {[field.name for field in dataclasses.fields(out)][:8]}"
    if isinstance(out, (tuple, list)):
        items = ", ".join(f"tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__ for v in out[:4])
        return f"a {kind} of {len(out)} ({items}{', ...' if len(out) > 4 else ''})"
    return f"a {kind}"


def infer_output(out: Any, n: int) -> OutputSelector | None:
    """The selector for a model that returned ``out`` on ``n`` samples: None for a tensor (used
    as it is), ``"logits"`` for a mapping or dataclass with a ``logits`` entry, ``0`` for a tuple
    or list whose first element is an ``(n, ...)`` tensor. Anything else raises
    :class:`~taste_cl.exceptions.InvalidBatchError` saying what came back and how to pass ``output=``."""
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, Mapping) and "logits" in out:
        return OutputSelector("logits")
    if dataclasses.is_dataclass(out) and not isinstance(out, type) and any(f.name == "logits" for f in dataclasses.fields(out)):
        return OutputSelector("logits")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() >= 1 and out[0].shape[0] == n:
        return OutputSelector(0)
    raise InvalidBatchError(
        f"model must return one tensor of shape (batch, ...), or a dict, dataclass or tuple the learner can take it from "
        f"(a 'logits' entry, or a batch-sized tensor first); it returned {describe_output(out)}: {HINT}"
    )


def select_checked(out: Any, output: OutputSelector | None, n: int, *, where: str) -> tuple[OutputSelector | None, torch.Tensor]:
    """The selector (``output``, or the one :func:`infer_output` finds) and the tensor it picks
    from ``out``, which the model returned on ``n`` samples (``where`` says which, for messages).

    The tensor must be ``(n, ...)``; else :class:`~taste_cl.exceptions.InvalidBatchError`.
    """
    selector = output if output is not None else infer_output(out, n)
    picked = out if selector is None else selector(out)
    if not isinstance(picked, torch.Tensor) or picked.dim() < 1 or picked.shape[0] != n:
        got = f"shape {tuple(picked.shape)}" if isinstance(picked, torch.Tensor) else describe_output(picked)
        source = "" if selector is None else f" (picked by {selector} from {describe_output(out)})"
        raise InvalidBatchError(
            f"model must return one tensor of shape (batch, ...) with one row per sample; on {where} "
            f"({n} row{'s' if n != 1 else ''}) it returned {got}{source}"
        )
    return selector, picked


def restored_output(saved: Any, live: OutputSelector | None, *, settled: bool, live_settled: bool = False) -> OutputSelector | None:
    """The selector a learner holding ``live`` gets from a checkpoint's ``config.output``
    (``saved``; ``settled``: the checkpoint's first batch was seen; ``live_settled``: the
    learner's own was, so ``live`` None means its model returns one tensor). ``ValueError``
    when they disagree."""
    if saved is not None and live is None and live_settled:
        raise ValueError(f"the checkpoint was trained with output={saved!r:.200}; this learner's model returns one tensor (no output= selection)")
    if saved is None:
        if settled and live is not None:
            raise ValueError(f"the checkpoint's model returned one tensor (no output= selection); this learner has {live}")
        return live
    if isinstance(saved, dict):
        if set(saved) != {"callable"} or not isinstance(saved["callable"], str):
            raise ValueError(f"`config.output` must be a key, an index, {{'callable': name}} or None; got {saved!r:.200}")
        if live is None or live.saveable:
            shown = "none" if live is None else str(live)
            raise ValueError(
                f"the checkpoint was trained with a callable output= ({saved['callable']}), which a checkpoint cannot hold: "
                f"pass it again, OnlineLearner.load(..., output=...) (got {shown})"
            )
        return live
    if isinstance(saved, bool) or not isinstance(saved, (str, int)) or saved == "":
        raise ValueError(f"`config.output` must be a key, an index, {{'callable': name}} or None; got {saved!r:.200}")
    if live is not None and live != OutputSelector(saved):
        raise ValueError(f"the checkpoint was trained with output={saved!r}; this learner has {live}")
    return OutputSelector(saved)


def selecting(model: nn.Module, output: OutputSelector | None, example: Any = None, call: str = "auto") -> nn.Module:
    """``model`` whose ``forward`` returns ``output``'s pick, for export: traced, its graph
    outputs the selected tensor. With no ``output`` and an ``example`` input (a learner
    exported before its first batch), the selector is inferred from the model's eval-mode
    output on the example's first sample, as the first batch would.

    The model is changed in place (pass a copy): its class becomes a subclass with that
    ``forward``, so parameter and module names stay the model's own (device artifacts and
    parameter exchange name parameters as PyTorch does), and its signature is the model's own
    (``call="auto"`` reads it). ``call`` passes ``example`` to the model as the learner does.
    """
    if output is None and example is not None:
        first = next(model.parameters(), None)
        sample = index_batch(example, slice(0, 1))
        if first is not None:  # to the model's placement, as the learner places inputs
            sample = map_leaves(lambda t: t.to(first.device, first.dtype) if t.is_floating_point() else t.to(first.device), sample)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                output = infer_output(call_model(model, sample, call=call), 1)
        finally:
            model.train(was_training)
    if output is None:
        return model
    base = type(model)
    pick = output

    @functools.wraps(base.forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return pick(base.forward(self, *args, **kwargs))

    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__})
    return model
