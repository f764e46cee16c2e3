"""What the model predicts and how it is scored: classification, multi-label, regression, tagging.

A :class:`Task` owns everything that depends on the kind of target: which targets are
valid for a model output, the prequential score of a stream batch, the stability score
of the monitor's probe, and whether :class:`~taste_cl.replay.ClassBalancedReplay` can
balance on the targets. :class:`~taste_cl.learner.OnlineLearner` infers it from the
loss (:func:`infer_task`); ``task=`` overrides.

>>> import torch
>>> from torch import nn
>>> from taste_cl.tasks import Regression, infer_task
>>> infer_task(nn.MSELoss())
Regression()
>>> task = Regression()
>>> y = task.to_targets(torch.tensor([1.0, 2.0]), n=2, output_shape=(1,), dtype=torch.float32, device=torch.device("cpu"))
>>> tuple(y.shape), task.metrics(task.batch_stats(torch.tensor([[1.0], [4.0]]), y))
((2, 1), {'mse': 2.0, 'mae': 1.0})
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from taste_cl._batch import as_tensor, count_nonfinite, label_range, to_like
from taste_cl.exceptions import InvalidBatchError

__all__ = ["Classification", "MultiLabel", "Regression", "Task", "TokenClassification", "infer_task", "resolve_task"]

Stats = tuple[float, ...]


class Task(ABC):
    """Base class: target validation and scoring for one kind of prediction.

    Scores are built from additive per-batch statistics (:meth:`batch_stats`), so a
    window of batches is scored exactly as one big batch would be (:meth:`metrics`).
    ``primary`` names the metric reported as plasticity and stability;
    ``higher_is_better`` says which way it improves.
    """

    name: ClassVar[str]
    primary: ClassVar[str]
    higher_is_better: ClassVar[bool] = True
    balances_classes: ClassVar[bool] = False

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Task) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))

    def config(self) -> dict[str, Any]:
        """Plain JSON-able description; :func:`resolve_task` rebuilds the task from it."""
        return {"name": self.name}

    @abstractmethod
    def check_outputs(self, output_shape: tuple[int, ...]) -> None:
        """Raise :class:`InvalidBatchError` unless a model output of ``(n, *output_shape)`` fits."""

    @abstractmethod
    def to_targets(self, value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Validate a target batch for outputs ``(n, *output_shape)``; return a fresh tensor."""

    @abstractmethod
    def batch_stats(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        """Additive statistics of one batch (sums and counts)."""

    @abstractmethod
    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        """Metrics from summed :meth:`batch_stats` (NaN where nothing was counted)."""

    @abstractmethod
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """A loss of the batch the drift detector watches."""

    def num_classes(self, output_shape: tuple[int, ...]) -> int | None:
        """Number of classes for outputs ``(n, *output_shape)``; None when not a class task."""
        return None

    def group_scores(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[int, float]:
        """Primary score per group of samples (per class for classification) for forgetting."""
        return {0: self.metrics(self.batch_stats(outputs, targets))[self.primary]}


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 or wider for a stable loss (no dispatch when it already is: the hot path)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _wide_pair(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs via :func:`_wide` and float targets in their dtype (the losses need one dtype)."""
    wide = _wide(outputs)
    return wide, to_like(targets, wide)


def _check_length(y: torch.Tensor, n: int, name: str) -> None:
    if y.dim() == 0 or y.shape[0] != n:
        got = "a scalar" if y.dim() == 0 else f"{y.shape[0]}"
        raise InvalidBatchError(f"x and {name} lengths differ: x has {n} samples, {name} has {got}")


def _plain_int64(value: Any, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether ``value`` is a dense int64 tensor of ``shape`` on ``device``, which the full checks pass unchanged."""
    return (
        type(value) is torch.Tensor
        and value.dtype == torch.int64
        and value.device == device
        and value.layout == torch.strided
        and not value.is_nested
        and value.shape == shape
    )


def _class_targets(
    value: Any, *, n: int, num_classes: int, shape: tuple[int, ...], ignore_index: int | None, task: str, device: torch.device
) -> torch.Tensor:
    """Integer class labels of shape ``(n, *shape)`` in ``[0, num_classes)`` (or ``ignore_index``)."""
    if ignore_index is None and n and _plain_int64(value, (n, *shape), device):  # the hot path: only the range to check
        low, high = label_range(value)
        if low >= 0 and high < num_classes:
            return value.clone()
    y = as_tensor(value, "y")
    if y.is_floating_point() or y.dtype == torch.bool:
        raise InvalidBatchError(
            f"y must hold integer class labels for {task}; got dtype {y.dtype}. For float targets use "
            "loss_fn=nn.MSELoss() (regression) or nn.BCEWithLogitsLoss() (multi-label), or pass task=..."
        )
    if tuple(y.shape[1:]) != shape or y.dim() == 0:
        want = ", ".join(str(d) for d in (n, *shape))
        raise InvalidBatchError(f"y must be {len(shape) + 1}-D of shape ({want}{',' if not shape else ''}); got shape {tuple(y.shape)}")
    _check_length(y, n, "y")
    if y.numel():
        valid = y if ignore_index is None else y[y != ignore_index]
        if valid.numel():
            low, high = label_range(valid)
            if low < 0 or high >= num_classes:
                extra = "" if ignore_index is None else f" (or {ignore_index}, ignored)"
                if high >= num_classes and task == "classification":  # a class the model never saw
                    extra += "; a class the model never saw needs a classifier that grows: OnlineLearner(..., max_classes=N), N above the label"
                raise InvalidBatchError(f"y has label {low if low < 0 else high} out of range; labels must be in [0, {num_classes - 1}]{extra}")
    return y.to(device=device, dtype=torch.long, copy=True)


class Classification(Task):
    """Multi-class: outputs ``(n, C)`` logits, targets ``(n,)`` integer labels; scored by accuracy."""

    name = "classification"
    primary = "accuracy"
    balances_classes = True

    def check_outputs(self, output_shape: tuple[int, ...]) -> None:
        if len(output_shape) != 1:
            raise InvalidBatchError(f"model must output (batch, num_classes) logits; got shape (n, {', '.join(map(str, output_shape))})")

    def num_classes(self, output_shape: tuple[int, ...]) -> int | None:
        return output_shape[0]

    def to_targets(self, value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _class_targets(value, n=n, num_classes=output_shape[0], shape=(), ignore_index=None, task="classification", device=device)

    def batch_stats(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        return int((outputs.argmax(dim=1) == targets).sum()), targets.shape[0]

    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        correct, n = sums
        return {"accuracy": correct / n if n else math.nan}

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        return float(F.cross_entropy(_wide(outputs), targets))

    def group_scores(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[int, float]:
        hits = outputs.argmax(dim=1) == targets
        totals = torch.bincount(targets).tolist()
        correct = torch.bincount(targets, weights=hits.double()).tolist()
        return {label: right / n for label, (n, right) in enumerate(zip(totals, correct)) if n}


class TokenClassification(Task):
    """Per-token classes: outputs ``(n, C, t)`` logits (``CrossEntropyLoss``'s layout), targets
    ``(n, t)`` integer tags; ``ignore_index`` tags (padding) are not scored. Scored by token accuracy."""

    name = "token_classification"
    primary = "accuracy"

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = int(ignore_index)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "ignore_index": self.ignore_index}

    def check_outputs(self, output_shape: tuple[int, ...]) -> None:
        if len(output_shape) != 2:
            raise InvalidBatchError(
                f"token classification needs model outputs (batch, classes, tokens); got shape (n, {', '.join(map(str, output_shape))})"
            )

    def num_classes(self, output_shape: tuple[int, ...]) -> int | None:
        return output_shape[0]

    def to_targets(self, value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        classes, tokens = output_shape
        return _class_targets(
            value, n=n, num_classes=classes, shape=(tokens,), ignore_index=self.ignore_index, task="token classification", device=device
        )

    def batch_stats(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        scored = targets != self.ignore_index
        return int(((outputs.argmax(dim=1) == targets) & scored).sum()), int(scored.sum())

    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        correct, n = sums
        return {"accuracy": correct / n if n else math.nan}

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        return float(F.cross_entropy(_wide(outputs), targets, ignore_index=self.ignore_index))


def _float_targets(value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, task: str) -> torch.Tensor:
    """Float targets of the output's shape; ``(n,)`` for an ``(n, 1)`` output is reshaped."""
    y = as_tensor(value, "y")
    _check_length(y, n, "y")
    shape = tuple(y.shape[1:])
    if shape != output_shape:
        if not (shape == () and output_shape == (1,)):
            raise InvalidBatchError(
                f"y has shape {tuple(y.shape)} but the model outputs (n, {', '.join(map(str, output_shape))}) for {task}; "
                "targets must match the output shape (no broadcasting)"
            )
        y = y.reshape(n, 1)
    y = y.to(device=device, dtype=dtype, copy=True)
    bad = count_nonfinite(y)
    if bad:
        raise InvalidBatchError(f"y contains {bad} non-finite value(s) (NaN or inf)")
    return y


class Regression(Task):
    """Real-valued targets ``(n,)`` or ``(n, *output_shape)``; scored by MSE (primary) and MAE."""

    name = "regression"
    primary = "mse"
    higher_is_better = False

    def check_outputs(self, output_shape: tuple[int, ...]) -> None:
        if not output_shape:
            raise InvalidBatchError("regression needs model outputs (batch, outputs); got shape (n,): add an output dimension")

    def to_targets(self, value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _float_targets(value, n=n, output_shape=output_shape, dtype=dtype, device=device, task="regression")

    def batch_stats(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        error = (outputs.double() - targets.double()).flatten()
        return float(error.square().sum()), float(error.abs().sum()), error.numel()

    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        squared, absolute, count = sums
        return {"mse": squared / count if count else math.nan, "mae": absolute / count if count else math.nan}

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        return float(F.mse_loss(*_wide_pair(outputs, targets)))


class MultiLabel(Task):
    """Independent 0/1 labels ``(n, k)``; outputs ``(n, k)`` logits (``logits=True``, for
    ``BCEWithLogitsLoss``) or probabilities (for ``BCELoss``). Scored by micro-F1 (primary)
    and exact-match ratio."""

    name = "multilabel"
    primary = "micro_f1"

    def __init__(self, logits: bool = True) -> None:
        self.logits = bool(logits)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "logits": self.logits}

    def check_outputs(self, output_shape: tuple[int, ...]) -> None:
        if len(output_shape) != 1:
            raise InvalidBatchError(f"multi-label needs model outputs (batch, labels); got shape (n, {', '.join(map(str, output_shape))})")

    def to_targets(self, value: Any, *, n: int, output_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        y = _float_targets(value, n=n, output_shape=output_shape, dtype=dtype, device=device, task="multi-label")
        if y.numel() and (float(y.min()) < 0 or float(y.max()) > 1):
            raise InvalidBatchError(f"multi-label targets must be in [0, 1]; got values in [{float(y.min())}, {float(y.max())}]")
        return y

    def batch_stats(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        predicted = outputs > (0.0 if self.logits else 0.5)
        actual = targets > 0.5
        tp = int((predicted & actual).sum())
        fp = int((predicted & ~actual).sum())
        fn = int((~predicted & actual).sum())
        exact = int((predicted == actual).all(dim=1).sum())
        return tp, fp, fn, exact, targets.shape[0]

    def metrics(self, sums: Sequence[float]) -> dict[str, float]:
        tp, fp, fn, exact, n = sums
        if not n:
            return {"micro_f1": math.nan, "exact_match": math.nan}
        denominator = 2 * tp + fp + fn
        return {"micro_f1": 2 * tp / denominator if denominator else 1.0, "exact_match": exact / n}

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        wide, targets = _wide_pair(outputs, targets)
        if self.logits:
            return float(F.binary_cross_entropy_with_logits(wide, targets))
        return float(F.binary_cross_entropy(wide.clamp(0, 1), targets))


_BY_NAME: dict[str, type[Task]] = {cls.name: cls for cls in (Classification, MultiLabel, Regression, TokenClassification)}
_REGRESSION_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)


def infer_task(loss_fn: Any, output_shape: tuple[int, ...] | None = None) -> Task | None:
    """The task a loss implies, or None for a loss taste_cl does not know.

    ``CrossEntropyLoss``/``NLLLoss``: classification, or token classification (with the
    loss's ``ignore_index``) once outputs ``(n, C, t)`` are seen; ``MSELoss``, ``L1Loss``,
    ``SmoothL1Loss``, ``HuberLoss``: regression; ``BCEWithLogitsLoss``: multi-label on
    logits; ``BCELoss``: multi-label on probabilities.
    """
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if output_shape is not None and len(output_shape) == 2:
            return TokenClassification(loss_fn.ignore_index)
        return Classification()
    if isinstance(loss_fn, _REGRESSION_LOSSES):
        return Regression()
    if isinstance(loss_fn, nn.BCEWithLogitsLoss):
        return MultiLabel(logits=True)
    if isinstance(loss_fn, nn.BCELoss):
        return MultiLabel(logits=False)
    return None


def resolve_task(task: Task | str | dict[str, Any]) -> Task:
    """A :class:`Task` from an instance, a name (``"classification"``, ``"multilabel"``,
    ``"regression"``, ``"token_classification"``) or a :meth:`Task.config` dict."""
    if isinstance(task, Task):
        return task
    config = {"name": task} if isinstance(task, str) else task
    if not isinstance(config, dict) or config.get("name") not in _BY_NAME:
        raise ValueError(f"`task == {task!r}`, must be a Task or one of {', '.join(map(repr, _BY_NAME))}")
    params = {k: v for k, v in config.items() if k != "name"}
    try:
        return _BY_NAME[config["name"]](**params)
    except TypeError as error:
        raise ValueError(f"task config {config!r} has unknown parameters: {error}") from error
