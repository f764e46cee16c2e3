"""Test-time adaptation over an engine, in numpy: BN-adapt and TENT on the device, under the collapse guard.

:class:`EngineAdapter` is :class:`~taste_cl.adaptation.adapter.TestTimeAdapter`'s loop over an
:class:`~taste_cl.engine.base.AdaptableEngine` (torch eager, or the ONNX engine of a folder exported
with ``batchnorm="adapt"``), with the same rules:

- **BN-adapt**: BatchNorm normalises with the batch's statistics and its running statistics follow
  them (the engine's :meth:`~taste_cl.engine.base.AdaptableEngine.forward_batch_statistics`); no step.
- **TENT**: the same forward, then one step of the engine's optimizer on its trainable tensors (the
  normalisation layers' affine weights and biases) down the gradient of the mean prediction entropy
  (:func:`~taste_cl.engine.losses.mean_entropy`). The predictions returned are the forward's, before
  the step, as the torch adapter's.
- Below ``min_batch`` rows nothing adapts: the batch gets the current model's predictions (running
  statistics), and the first such batch warns (:class:`~taste_cl.exceptions.AdaptationWarning`).
- The guard (:class:`ArrayCollapseGuard`, the torch :class:`~taste_cl.adaptation.guard.CollapseGuard`'s
  rule on numpy arrays: both judge with :meth:`CollapseRule.judge`) resets to the anchor, the trainable
  tensors and running statistics the adapter was built on, and scales the learning rate by ``backoff``;
  the batch that reset gets the source's predictions. Non-finite parameters after a step reset too.
- The label-free accuracy estimate (AETTA, :func:`aetta_accuracy`) is the rule's too: both guards read it
  from per-row dropout summaries (:func:`dropout_summary`) when they are given. The ONNX engine's graphs
  return only logits, not the features feeding the classifier, so :class:`EngineAdapter` gives none yet
  and the device guard decides on the marginal ratio (and source agreement) alone.

The engine's optimizer is TENT's: export it as the torch adapter's, ``AdamW`` with ``betas=(momentum,
0.999)``, ``eps=1e-8`` and no weight decay (its ``"adam"``), or ``SGD`` with ``momentum``. A reset
clears its state. Torch-free.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from taste_cl._checks import check_finite_positive, check_int, check_positive
from taste_cl.engine.base import AdaptableEngine, Inputs
from taste_cl.engine.losses import mean_entropy, softmax
from taste_cl.exceptions import AdaptationWarning, InvalidBatchError

__all__ = [
    "ArrayCollapseGuard",
    "CollapseRule",
    "EngineAdaptStats",
    "EngineAdapter",
    "GuardVerdict",
    "aetta_accuracy",
    "dropout_summary",
    "normalised_prior",
]

METHODS = ("bn", "tent")


@dataclass(frozen=True)
class GuardVerdict:
    """The guard's reading after a batch: its signals (None until measurable) and whether to reset."""

    reset: bool
    reason: str | None
    marginal_ratio: float | None
    agreement: float | None
    entropy: float
    rows: int
    accuracy: float | None = None
    """AETTA's label-free accuracy estimate of the adapted predictions over the window (None without dropout summaries)."""
    source_accuracy: float | None = None
    """The same estimate of the source model's predictions on the same rows (None unless the source's summaries are given)."""
    fallback: bool = False
    """The estimate says the source predicts better than the adapted model (by more than ``accuracy_margin``): the batch
    is answered with the source's predictions, and adaptation goes on (no reset, the window kept)."""


def normalised_prior(prior: Sequence[float]) -> np.ndarray:
    """Class frequencies as a float64 distribution; ``ValueError`` unless at least 2 finite, non-negative ones with a positive sum."""
    values = np.asarray(list(prior), np.float64)
    if values.ndim != 1 or values.size < 2 or not np.isfinite(values).all() or (values < 0).any() or values.sum() <= 0:
        raise ValueError("`class_prior` must be at least 2 finite, non-negative frequencies with a positive sum")
    return values / values.sum()


def _entropy(p: np.ndarray) -> float:
    p = np.maximum(p, 1e-12)
    return float(-(p * np.log(p)).sum())


def dropout_summary(logits: np.ndarray, dropout_logits: np.ndarray) -> np.ndarray:
    """Per row, what AETTA reads from dropout inference: the share of the ``passes`` dropout predictions
    (``dropout_logits``, ``(passes, rows, classes)``) that agree with the prediction (``logits``, ``(rows,
    classes)``), then their mean probabilities: a float32 ``(rows, 1 + classes)`` array."""
    logits, dropout_logits = np.asarray(logits, np.float32), np.asarray(dropout_logits, np.float32)
    if dropout_logits.ndim != 3 or dropout_logits.shape[1:] != logits.shape or logits.ndim != 2:
        raise ValueError(f"`dropout_logits` must be (passes, rows, classes) of logits {logits.shape}; got {dropout_logits.shape}")
    agreement = (dropout_logits.argmax(axis=2) == logits.argmax(axis=1)).mean(axis=0)
    probs = np.stack([softmax(d) for d in dropout_logits]).mean(axis=0)
    return np.concatenate([agreement[:, None], probs], axis=1).astype(np.float32)


def aetta_accuracy(summary: np.ndarray, prior: np.ndarray | None = None) -> float:
    """AETTA's accuracy estimate (Lee et al., CVPR 2024, arXiv 2404.01351) over the rows of :func:`dropout_summary`.

    The prediction disagreement with dropout inference (PDD: one minus the mean agreement) estimates the error;
    AETTA's robustness term divides it by the cube of the batch-mean prediction's entropy over its maximum, here
    the class ``prior``'s entropy (None: ``log(classes)``), since a collapsing model agrees with itself under
    dropout while its predictions fall onto few classes; the error is clipped to ``[0, 1 - 1/classes]``."""
    summary = np.asarray(summary, np.float64)
    classes = summary.shape[1] - 1
    pdd = 1.0 - float(summary[:, 0].mean())
    top = _entropy(np.asarray(prior, np.float64)) if prior is not None and prior.size == classes else math.log(classes)
    ratio = _entropy(summary[:, 1:].mean(axis=0)) / top if top > 1e-6 else 1.0
    error = pdd / max(ratio, 1e-6) ** 3
    return 1.0 - min(max(error, 0.0), 1.0 - 1.0 / classes)


class CollapseRule:
    """The collapse guard's settings, window and decision, torch-free (see :mod:`taste_cl.adaptation.guard`).

    The window holds ``(adapted, source or None)`` probability batches of any array type with a row
    axis first (torch tensors in the torch guard, numpy arrays on the device); :meth:`judge` reads them
    as numpy, so both guards decide with the same arithmetic.
    """

    def __init__(
        self,
        *,
        window: int = 128,
        min_rows: int = 64,
        min_marginal_ratio: float = 0.85,
        min_agreement: float | None = None,
        confident: float = 0.9,
        accuracy_margin: float | None = 0.0,
    ) -> None:
        self.window = check_int("window", window, 1)
        self.min_rows = check_int("min_rows", min_rows, 1)
        if min_rows > window:
            raise ValueError(f"`min_rows == {min_rows}`, must be <= window ({window})")
        self.min_marginal_ratio = check_positive("min_marginal_ratio", min_marginal_ratio, upper=1.0)
        self.min_agreement = None if min_agreement is None else check_positive("min_agreement", min_agreement, upper=1.0)
        self.confident = check_positive("confident", confident, upper=1.0)
        if accuracy_margin is not None and (
            isinstance(accuracy_margin, bool) or not isinstance(accuracy_margin, (int, float)) or not 0 <= accuracy_margin <= 1
        ):
            raise ValueError(f"`accuracy_margin == {accuracy_margin!r}`, must be None or a number in [0, 1]")
        self.accuracy_margin = None if accuracy_margin is None else float(accuracy_margin)
        self.resets = 0
        self._batches: deque[tuple[Any, Any, Any, Any]] = deque()
        self._rows = 0

    def needs_source(self, *, estimates: bool = True) -> bool:
        """Whether an update needs the source model's predictions: for ``min_agreement``, and for ``accuracy_margin``
        when the adapter gives dropout summaries (``estimates``; the device's does not yet)."""
        return self.min_agreement is not None or (estimates and self.accuracy_margin is not None)

    def clear(self) -> None:
        """Start the window over (after a reset, or when the anchor moves)."""
        self._batches.clear()
        self._rows = 0

    def _admit(self, adapted: Any, source: Any, summary: Any = None, source_summary: Any = None) -> None:
        """Add one batch to the window (its probabilities, and the dropout summaries or None), dropping the oldest
        batches once the others fill it."""
        self._batches.append((adapted, source, summary, source_summary))
        self._rows += adapted.shape[0]
        while self._batches and self._rows - self._batches[0][0].shape[0] >= self.window:
            self._rows -= self._batches.popleft()[0].shape[0]

    def _window(self, column: int) -> np.ndarray | None:
        """One column of the window (0 adapted, 1 source, 2 and 3 their dropout summaries) over every batch, as
        numpy; None unless every batch has it."""
        parts = [batch[column] for batch in self._batches if batch[column] is not None]
        if not parts or len(parts) != len(self._batches):
            return None
        return np.concatenate([np.asarray(p.cpu() if hasattr(p, "cpu") else p) for p in parts])  # torch's: to the CPU first

    def read(self, prior: np.ndarray | None) -> GuardVerdict:
        """The verdict on the window as it stands (see :meth:`judge`)."""
        adapted = self._window(0)
        if adapted is None:
            raise ValueError("the guard's window is empty")
        return self.judge(adapted, self._window(1), prior, self._window(2), self._window(3))

    def judge(
        self,
        adapted: np.ndarray,
        source: np.ndarray | None,
        prior: np.ndarray | None,
        summary: np.ndarray | None = None,
        source_summary: np.ndarray | None = None,
    ) -> GuardVerdict:
        """The verdict on the window's probabilities ``adapted`` (and the source's on the same rows, or None), against
        the class ``prior`` (None: uniform), with AETTA's estimates from the dropout summaries when given; a reset
        counts and starts the window over."""
        probs = np.asarray(adapted, np.float64)
        classes = probs.shape[1]
        ent = float(-(probs * np.log(np.maximum(probs, 1e-12))).sum(axis=1).mean()) / math.log(classes)
        usable_prior = prior if prior is not None and prior.size == classes else None
        prior_entropy = math.log(classes) if usable_prior is None else _entropy(np.asarray(usable_prior, np.float64))
        ratio = _entropy(probs.mean(axis=0)) / prior_entropy if prior_entropy > 1e-6 else None
        accuracy = None if summary is None else aetta_accuracy(summary, usable_prior)
        source_accuracy = None if source_summary is None else aetta_accuracy(source_summary, usable_prior)
        agreement = None
        if source is not None:
            confident = np.asarray(source).max(axis=1) >= self.confident
            if confident.any():
                agreement = float((probs.argmax(1) == np.asarray(source).argmax(1))[confident].mean())
        reason = None
        if self._rows >= self.min_rows:
            if ratio is not None and ratio < self.min_marginal_ratio:
                reason = f"marginal ratio {ratio:.2f} < {self.min_marginal_ratio}"
            elif self.min_agreement is not None and agreement is not None and agreement < self.min_agreement:
                reason = f"confident agreement {agreement:.2f} < {self.min_agreement}"
        fallback = (
            reason is None
            and self._rows >= self.min_rows
            and self.accuracy_margin is not None
            and accuracy is not None
            and source_accuracy is not None
            and accuracy < source_accuracy - self.accuracy_margin
        )
        verdict = GuardVerdict(reason is not None, reason, ratio, agreement, ent, self._rows, accuracy, source_accuracy, fallback)
        if reason is not None:
            self.resets += 1
            self.clear()
        return verdict


class ArrayCollapseGuard(CollapseRule):
    """The collapse guard on numpy logits (the device's): :class:`CollapseRule` with a window of numpy probabilities.

    ``class_prior``: the class frequencies the marginal is compared with (normalised here), or None (uniform).
    """

    def __init__(self, *, class_prior: Sequence[float] | None = None, **settings: Any) -> None:
        super().__init__(**settings)
        self.class_prior = None if class_prior is None else normalised_prior(class_prior).astype(np.float32)

    def update(
        self,
        adapted_logits: np.ndarray,
        source_logits: np.ndarray | None = None,
        summary: np.ndarray | None = None,
        source_summary: np.ndarray | None = None,
    ) -> GuardVerdict:
        """Add one batch's predictions (adapted, and the source's on the same rows if known), with their
        :func:`dropout_summary` rows if known, and read the signals."""
        adapted = softmax(np.asarray(adapted_logits, np.float32))
        source = None if source_logits is None else softmax(np.asarray(source_logits, np.float32))
        self._admit(adapted, source, summary, source_summary)
        return self.read(self.class_prior)


@dataclass(frozen=True)
class EngineAdaptStats:
    """What one :meth:`EngineAdapter.adapt` did (as :class:`~taste_cl.adaptation.adapter.AdaptStats`, in numpy)."""

    outputs: np.ndarray
    rows_used: int
    batch_statistics: bool
    reset: bool
    reason: str | None
    verdict: GuardVerdict | None


def _rows(x: Inputs) -> int:
    """Rows of a validated batch; ``InvalidBatchError`` for an empty, non-numeric or non-finite one."""
    arrays = list(x.values()) if isinstance(x, Mapping) else [x]
    rows = -1
    for value in arrays:
        array = np.asarray(value)
        if array.dtype.kind not in "fiub" or array.ndim < 1 or array.shape[0] < 1:
            raise InvalidBatchError(f"adapt takes numeric arrays with at least one row; got {array.dtype} {array.shape}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidBatchError("adapt: the batch holds NaN or infinite values")
        if rows >= 0 and array.shape[0] != rows:
            raise InvalidBatchError(f"adapt: the inputs have different row counts ({rows} and {array.shape[0]})")
        rows = array.shape[0]
    return rows


class EngineAdapter:
    """Adapt ``engine`` to unlabelled batches with ``method`` (``"bn"`` or ``"tent"``), guarded (see the module).

    ``lr``: TENT's learning rate; ``guard``: an :class:`ArrayCollapseGuard`, ``"default"`` (one with its defaults)
    or None; ``min_batch`` and ``backoff``: as the torch adapter's. The anchor is the engine's trainable
    tensors and running statistics now.
    """

    def __init__(
        self,
        engine: AdaptableEngine,
        method: str = "tent",
        *,
        lr: float = 1e-3,
        guard: ArrayCollapseGuard | str | None = "default",
        min_batch: int = 2,
        backoff: float = 0.5,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"`method == {method!r}`, must be one of {list(METHODS)}")
        if not isinstance(engine, AdaptableEngine):
            raise TypeError(f"`engine` must adapt BatchNorm statistics (an AdaptableEngine); got {type(engine).__name__}")
        if isinstance(guard, str):
            if guard != "default":
                raise ValueError(f"`guard == {guard!r}`, must be an ArrayCollapseGuard, None or 'default'")
            guard = ArrayCollapseGuard()
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff <= 1:
            raise ValueError(f"`backoff == {backoff!r}`, must be a number in [0, 1]")
        self.engine = engine
        self.method = method
        self.lr = check_finite_positive("lr", lr)
        self.guard = guard
        self.min_batch = check_int("min_batch", min_batch, 2)
        self.backoff = float(backoff)
        self.lr_scale = 1.0
        self.batches = 0
        self.resets = 0
        self._anchor = (engine.parameters(), engine.norm_statistics())
        self._cleared = {name: np.zeros_like(value) for name, value in engine.optimizer_state().items()}
        self._warned_small = False
        engine.load_optimizer_state(self._cleared)

    @property
    def steps(self) -> bool:
        """Whether the method takes gradient steps (TENT) or only moves the running statistics (BN-adapt)."""
        return self.method == "tent"

    def reset(self) -> None:
        """Back to the anchor: trainable tensors, running statistics, cleared optimizer state and guard window."""
        parameters, statistics = self._anchor
        self.engine.load_parameters(parameters)
        self.engine.load_norm_statistics(statistics)
        self.engine.load_optimizer_state(self._cleared)
        if self.guard is not None:
            self.guard.clear()

    def source_forward(self, x: Inputs) -> np.ndarray:
        """The source model's predictions: the anchor swapped in for one forward on running statistics."""
        current = (self.engine.parameters(), self.engine.norm_statistics())
        parameters, statistics = self._anchor
        self.engine.load_parameters(parameters)
        self.engine.load_norm_statistics(statistics)
        try:
            return self.engine.forward(x, train=False)
        finally:
            self.engine.load_parameters(current[0])
            self.engine.load_norm_statistics(current[1])

    def adapt(self, x: Inputs) -> EngineAdaptStats:
        """Adapt on the batch ``x`` and return its predictions (see the module); a refused batch changes nothing."""
        rows = _rows(x)
        batch_stats = rows >= self.min_batch
        adapted, used, finite = self._forward_and_step(x, rows, batch_stats)  # the engine refuses a bad batch before it changes
        if not batch_stats and not self._warned_small:
            self._warned_small = True
            warnings.warn(
                f"adapt: a batch of {rows} row(s) is below min_batch={self.min_batch}: BatchNorm keeps its running statistics"
                f" and {self.method} takes no step on it: its predictions are the current model's",
                AdaptationWarning,
                stacklevel=2,
            )
        verdict, outputs, reason = None, adapted, None
        source = self.source_forward(x) if self.guard is not None and self.guard.needs_source(estimates=False) else None
        if not finite:
            reason = "non-finite normalisation parameters after the step"
        elif self.guard is not None:
            verdict = self.guard.update(adapted, source)
            reason = verdict.reason
        if verdict is not None and verdict.fallback and source is not None:
            outputs = source
        if reason is not None:
            outputs = source if source is not None else self.source_forward(x)
            self.reset()
            self.resets += 1
            self.lr_scale *= self.backoff
        self.batches += 1
        return EngineAdaptStats(outputs, used, batch_stats, reason is not None, reason, verdict)

    def _forward_and_step(self, x: Inputs, rows: int, batch_stats: bool) -> tuple[np.ndarray, int, bool]:
        """The adapted forward, the method's step, and whether the trainable tensors are finite after it."""
        if not batch_stats:
            return self.engine.forward(x, train=False), 0, True
        train = self.steps
        outputs = self.engine.forward_batch_statistics(x, train=train)
        if not train:
            return outputs, 0, True
        loss, grad = mean_entropy(outputs)
        if not math.isfinite(loss):
            return outputs, 0, True
        gradients = self.engine.backward(grad)
        if not all(np.isfinite(g).all() for g in gradients.values()):
            return outputs, rows, False  # the torch adapter's step would make the parameters non-finite
        self.engine.step(gradients, self.lr * self.lr_scale)
        finite = all(np.isfinite(p).all() for p in self.engine.parameters().values())
        return outputs, rows, finite

    def report(self) -> dict[str, Any]:
        """Plain values for logs and benchmarks."""
        return {"method": self.method, "guarded": self.guard is not None, "batches": self.batches, "resets": self.resets, "lr_scale": self.lr_scale}
