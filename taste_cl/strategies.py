"""Continual-learning strategies: how a micro-batch's training loss is formed from its
stream part and its replay part, and what each stored sample keeps.

The learner trains on micro-batches ``[stream samples | replayed samples]``. A
:class:`Strategy` turns the model's outputs on that micro-batch into the loss (it may
treat the two parts differently) and may ask the replay buffer to keep extra
per-sample fields at insertion (DER++ keeps the logits). Built-ins:

================  ===========================================  =====================================
strategy          loss                                         tasks
================  ===========================================  =====================================
ExperienceReplay  ``loss_fn`` on the whole micro-batch         all (the default; today's behaviour)
ERACE             stream part over the classes present in it   classification only
                  plus replay part over all classes
DERPlusPlus       stream loss + alpha MSE(replay outputs,      all (MSE to stored outputs is
                  outputs stored at insertion) + beta replay   plain output distillation)
                  loss
LwF               loss + alpha distillation to a snapshot      all (KL for classes, BCE to the
                  taken at a drift event or every N steps      snapshot's probabilities for
                  (no buffer needed)                           multi-label, MSE for regression)
================  ===========================================  =====================================

>>> import torch
>>> from torch import nn
>>> from taste_cl import OnlineLearner, ReservoirReplay
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
>>> learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
...                         replay=ReservoirReplay(50), strategy="der++")
>>> _ = learner.observe((torch.randn(8, 4), torch.randint(0, 3, (8,))))
>>> learner.replay.sample(2, with_fields=True)[2]["logits"].shape
torch.Size([2, 3])
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from taste_cl._batch import Inputs, call_model, to_like
from taste_cl.replay import ReplayStrategy
from taste_cl.tasks import Task

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["ERACE", "DERPlusPlus", "ExperienceReplay", "LwF", "Strategy", "resolve_strategy"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
FieldSpec = tuple[tuple[int, ...], torch.dtype]
"""Per-sample shape and dtype of a stored field."""
_ALL_TASKS = ("classification", "token_classification", "regression", "multilabel")


def _forward(model: nn.Module, x: Inputs, learner: OnlineLearner | None) -> torch.Tensor:
    """The one place strategies call a model (a teacher), as ``learner`` calls its own: its ``output``
    picks the tensor from what the model returns, its ``call`` mode passes ``x``."""
    if learner is None:
        return call_model(model, x)
    return call_model(model, x, output=learner.output, call=learner.call)


def _check_weight(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"`{name} == {value!r}`, must be a finite number >= 0")
    return float(value)


class Strategy:
    """Base class: how the loss of a micro-batch ``[stream | replay]`` is formed.

    Override :meth:`loss` (default: ``loss_fn`` on the whole micro-batch); override
    :meth:`fields` to store extra per-sample tensors with each sample the buffer keeps
    (list their names in ``stored_fields``, and their shapes in :meth:`field_specs`).
    ``tasks`` names the tasks the strategy makes sense for; :meth:`check` refuses the
    others when the learner is built (or when its first batch settles the task). Keep
    constructor arguments in ``config()`` (the same keys for every instance) so a
    checkpoint can rebuild the strategy; ``name`` identifies it in checkpoints, so give a
    custom strategy a name of its own. A checkpoint's strategy fields are checked against
    all of these before it is restored (see :mod:`taste_cl.state.restore`).
    """

    name: ClassVar[str] = "strategy"
    tasks: ClassVar[tuple[str, ...]] = _ALL_TASKS
    stored_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.task: Task | None = None

    def check(self, task: Task | None, replay: ReplayStrategy | None) -> None:
        """Refuse a task or a buffer this strategy cannot work with (``ValueError``); else adopt ``task``."""
        problem = self.problem(task, replay)
        if problem is not None:
            raise ValueError(problem)
        self.task = task

    def problem(self, task: Task | None, replay: ReplayStrategy | None) -> str | None:
        """Why this strategy cannot work with ``task`` and ``replay``, or None; changes nothing."""
        if task is not None and task.name not in self.tasks:
            return (
                f"{type(self).__name__} supports the {', '.join(self.tasks)} task(s); this learner's task is "
                f"{task.name}. Use ExperienceReplay, DERPlusPlus or LwF"
            )
        if self.stored_fields:
            if replay is None:
                return f"{type(self).__name__} rehearses stored {', '.join(self.stored_fields)}: pass replay=ReservoirReplay(...)"
            if "with_fields" not in inspect.signature(replay.sample).parameters:
                return (
                    f"{type(self).__name__} needs a buffer that keeps extra per-sample fields "
                    f"(sample(n, with_fields=True)); {type(replay).__name__} does not. Use ReservoirReplay or ClassBalancedReplay"
                )
        return None

    def attach(self, learner: OnlineLearner) -> None:
        """Called once when the learner is built with this strategy."""

    def loss(
        self, loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor, *, x: Inputs, n_stream: int, fields: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Training loss of a micro-batch: the first ``n_stream`` rows are stream samples,
        the rest replayed ones (with their stored ``fields``)."""
        return loss_fn(outputs, y)

    def fields(self, x: Inputs, y: torch.Tensor, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra per-sample tensors to store with stream samples ``x`` (``outputs``: the
        model's training outputs on them)."""
        return {}

    def field_specs(self, output_shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, FieldSpec | None]:
        """Per-sample shape and dtype of each of ``stored_fields`` for a model whose outputs are
        ``(n, *output_shape)`` and whose parameters are ``dtype`` (None: not known, then only
        the row count and finiteness are checked). A checkpoint's buffer is checked against it."""
        return dict.fromkeys(self.stored_fields)

    def after_chunk(self, learner: OnlineLearner) -> None:
        """Called after each stream chunk has been trained on and stored."""

    def config(self) -> dict[str, Any]:
        """Constructor arguments (plain values) that rebuild this strategy."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""


class ExperienceReplay(Strategy):
    """Plain experience replay: ``loss_fn`` over stream and replayed samples together (the default)."""

    name = "er"


class ERACE(Strategy):
    """ER-ACE (Caccia et al., 2022): the stream part's cross-entropy only over the classes
    present in the stream part, the replay part's over all classes; the two are added
    (the paper's form, as in Mammoth; Avalanche's ``ER_ACE`` halves the sum).

    New classes then no longer push the logits of old, absent classes down, which is what
    makes plain replay forget abruptly in class-incremental streams. Classification only.
    """

    name = "er_ace"
    tasks = ("classification",)

    def loss(
        self, loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor, *, x: Inputs, n_stream: int, fields: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        reduction = _plain_cross_entropy(loss_fn)
        if reduction is not None:  # the same loss in one pass over the micro-batch
            stream_rows = _stream_rows(outputs.shape[0], n_stream, outputs.device)
            # the stream rows' absent classes get logit -inf: probability 0 and gradient 0,
            # so their softmax runs over the present classes only
            absent = torch.bincount(y[:n_stream], minlength=outputs.shape[1]) == 0
            masked = outputs.masked_fill(absent & stream_rows, -math.inf)
            return _two_part_loss(masked, y, n_stream, reduction)
        stream_y = y[:n_stream]
        present = torch.unique(stream_y)  # sorted
        stream_loss = loss_fn(outputs[:n_stream].index_select(1, present), torch.searchsorted(present, stream_y))
        if n_stream == y.shape[0]:
            return stream_loss
        return stream_loss + loss_fn(outputs[n_stream:], y[n_stream:])


class DERPlusPlus(Strategy):
    """DER++ (Buzzega et al., 2020): the buffer keeps each sample's model outputs from the
    moment it was stored (field ``logits``); the loss is ``loss_fn`` on the stream part
    plus ``alpha`` times the MSE between the replayed samples' outputs and their stored
    ones plus ``beta`` times ``loss_fn`` on the replayed samples.

    Defaults ``alpha = beta = 1``, in the range of the paper's tuned values (Avalanche's
    defaults 0.1 / 0.5 gave plain ER's accuracy on online split digits at one step per
    batch; there ``alpha = 0.5, beta = 2`` did best, for Avalanche's ``DER`` too: see
    ``taste-cl bench strategies``). In class-incremental streams pair it with
    ``ClassBalancedReplay``.
    Works for every task (for regression the MSE term is output distillation). Needs a
    buffer that keeps extra fields (the built-in ones do); the checkpoint holds the logits.
    """

    name = "der++"
    stored_fields = ("logits",)

    def __init__(self, alpha: float = 1.0, beta: float = 1.0) -> None:
        super().__init__()
        self.alpha = _check_weight("alpha", alpha)
        self.beta = _check_weight("beta", beta)

    def loss(
        self, loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor, *, x: Inputs, n_stream: int, fields: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if n_stream == y.shape[0]:
            return loss_fn(outputs, y)
        replayed = outputs[n_stream:]
        distill = self.alpha * F.mse_loss(replayed, to_like(fields["logits"], replayed))
        reduction = _plain_cross_entropy(loss_fn)
        if reduction is not None:  # both cross-entropy terms in one pass over the micro-batch
            return _two_part_loss(outputs, y, n_stream, reduction, self.beta) + distill
        return loss_fn(outputs[:n_stream], y[:n_stream]) + distill + self.beta * loss_fn(replayed, y[n_stream:])

    def fields(self, x: Inputs, y: torch.Tensor, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": outputs.detach()}

    def field_specs(self, output_shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, FieldSpec | None]:
        return {"logits": (output_shape, dtype)}  # the model's outputs, in the dtype it computes in

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta}


class LwF(Strategy):
    """Learning without Forgetting, online: ``loss_fn`` plus ``alpha`` times a distillation
    loss to a frozen snapshot of the model, taken when the monitor reports drift
    (``on_drift``) and/or every ``every`` stream chunks. Needs no buffer (for devices that
    may not store user data); with one, replayed samples are distilled too.

    Distillation follows the task: KL divergence at ``temperature`` over classes
    (classification, token tagging), BCE to the snapshot's probabilities (multi-label),
    MSE to its outputs (regression). Memory: one copy of the model; time: one extra
    forward per micro-batch once a snapshot exists.
    """

    name = "lwf"

    def __init__(self, alpha: float = 1.0, *, temperature: float = 2.0, every: int | None = None, on_drift: bool = True) -> None:
        super().__init__()
        self.alpha = _check_weight("alpha", alpha)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
            raise ValueError(f"`temperature == {temperature!r}`, must be a finite number > 0")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"`every == {every!r}`, must be an int >= 1 or None")
        if not isinstance(on_drift, bool):
            raise ValueError(f"`on_drift == {on_drift!r}`, must be a bool")  # noqa: TRY004 - like the other refusals
        if every is None and not on_drift:
            raise ValueError("LwF needs a moment to take its snapshot: set every=N or on_drift=True")
        self.temperature = float(temperature)
        self.every = every
        self.on_drift = on_drift
        self.teacher: nn.Module | None = None
        self.chunks = 0
        self._learner: OnlineLearner | None = None  # its model is snapshot; its output selection applies to the teacher

    def attach(self, learner: OnlineLearner) -> None:
        self._learner = learner
        if self.on_drift:
            learner.monitor.subscribe(lambda event: self.snapshot(), "drift_detected")

    def snapshot(self) -> None:
        """Freeze a copy of the model as the distillation target."""
        if self._learner is None:
            raise RuntimeError("LwF.snapshot() needs the strategy attached to a learner")
        teacher = copy.deepcopy(self._learner.model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.teacher = teacher

    def after_chunk(self, learner: OnlineLearner) -> None:
        self.chunks += 1
        if self.every is not None and self.chunks % self.every == 0:
            self.snapshot()

    def loss(
        self, loss_fn: LossFn, outputs: torch.Tensor, y: torch.Tensor, *, x: Inputs, n_stream: int, fields: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        loss = loss_fn(outputs, y)
        if self.teacher is None or not self.alpha:
            return loss
        with torch.no_grad():
            target = _forward(self.teacher, x, self._learner)
        return loss + self.alpha * self._distill(outputs, target)

    def _distill(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        name = self.task.name if self.task is not None else "classification"
        if name in ("classification", "token_classification"):
            t = self.temperature
            teacher_p = F.softmax(target / t, dim=1)
            return (teacher_p * (F.log_softmax(target / t, dim=1) - F.log_softmax(outputs / t, dim=1))).sum(1).mean() * t * t
        if name == "multilabel" and getattr(self.task, "logits", True):
            return F.binary_cross_entropy_with_logits(outputs, torch.sigmoid(target))
        return F.mse_loss(outputs, target)

    def config(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "temperature": self.temperature, "every": self.every, "on_drift": self.on_drift}

    def state_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "teacher": None if self.teacher is None else self.teacher.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chunks = int(state["chunks"])
        if state["teacher"] is None:
            self.teacher = None
            return
        self.snapshot()
        assert self.teacher is not None
        self.teacher.load_state_dict(state["teacher"])


def _plain_cross_entropy(loss_fn: LossFn) -> str | None:
    """The reduction (``"mean"`` or ``"sum"``) of a cross-entropy with no class weights,
    label smoothing or in-range ignore index, else None (ER-ACE then calls ``loss_fn`` as is)."""
    if loss_fn is F.cross_entropy:
        return "mean"
    if (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.label_smoothing == 0
        and loss_fn.ignore_index < 0
        and loss_fn.reduction in ("mean", "sum")
    ):
        return loss_fn.reduction
    return None


@functools.lru_cache(maxsize=8)
def _stream_rows(size: int, n_stream: int, device: torch.device) -> torch.Tensor:
    """``(size, 1)`` bool, True for the stream rows of a micro-batch ``[stream | replay]`` (read only)."""
    with torch.inference_mode(False):  # usable by autograd even if first made under inference mode
        return (torch.arange(size, device=device) < n_stream).unsqueeze(1)


@functools.lru_cache(maxsize=8)
def _row_weights(size: int, n_stream: int, reduction: str, replay_weight: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row weights ``(size,)`` that turn per-sample losses into ``stream loss +
    replay_weight * replay loss``, each part reduced by ``reduction`` (read only)."""
    with torch.inference_mode(False):  # usable by autograd even if first made under inference mode
        weights = torch.ones(size, dtype=dtype, device=device)
        weights[n_stream:] = replay_weight
        if reduction == "mean":
            weights[:n_stream] /= n_stream
            weights[n_stream:] /= max(size - n_stream, 1)
    return weights


def _two_part_loss(outputs: torch.Tensor, y: torch.Tensor, n_stream: int, reduction: str, replay_weight: float = 1.0) -> torch.Tensor:
    """Cross-entropy of the stream rows plus ``replay_weight`` times that of the replayed
    rows, from one per-sample cross-entropy and one weighted sum (fewer ops, forward and
    backward, than two losses over slices)."""
    weights = _row_weights(outputs.shape[0], n_stream, reduction, replay_weight, outputs.dtype, outputs.device)
    return torch.dot(F.cross_entropy(outputs, y, reduction="none"), weights)


BUILTIN_STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (ExperienceReplay, ERACE, DERPlusPlus, LwF)}


def resolve_strategy(strategy: Strategy | str | dict[str, Any] | None) -> Strategy:
    """A strategy from an instance, a built-in name (``"er"``, ``"er_ace"``, ``"der++"``,
    ``"lwf"``), a checkpoint's ``{"name": ..., "config": ...}``, or None (plain ER)."""
    if strategy is None:
        return ExperienceReplay()
    if isinstance(strategy, Strategy):
        return strategy
    name, config = (strategy.get("name"), strategy.get("config", {})) if isinstance(strategy, dict) else (strategy, {})
    if name not in BUILTIN_STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; built-in strategies: {', '.join(map(repr, BUILTIN_STRATEGIES))} "
            "(or pass a taste_cl.strategies.Strategy instance)"
        )
    return BUILTIN_STRATEGIES[name](**config)
