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

__all__ = ["ArrayCollapseGuard", "CollapseRule", "EngineAdaptStats", "EngineAdapter", "GuardVerdict", "normalised_prior"]

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


def normalised_prior(prior: Sequence[float]) -> np.ndarray:
    """Class frequencies as a float64 distribution; ``ValueError`` unless at least 2 finite, non-negative ones with a positive sum."""
    values = np.asarray(list(prior), np.float64)
    if values.ndim != 1 or values.size < 2 or not np.isfinite(values).all() or (values < 0).any() or values.sum() <= 0:
        raise ValueError("`class_prior` must be at least 2 finite, non-negative frequencies with a positive sum")
    return values / values.sum()


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
    ) -> None:
        self.window = check_int("window", window, 1)
        self.min_rows = check_int("min_rows", min_rows, 1)
        if min_rows > window:
            raise ValueError(f"`min_rows == {min_rows}`, must be <= window ({window})")
        self.min_marginal_ratio = check_positive("min_marginal_ratio", min_marginal_ratio, upper=1.0)
        self.min_agreement = None if min_agreement is None else check_positive("min_agreement", min_agreement, upper=1.0)
        self.confident = check_positive("confident", confident, upper=1.0)
        self.resets = 0
        self._batches: deque[tuple[Any, Any]] = deque()
        self._rows = 0

    @property
    def needs_source(self) -> bool:
        """Whether an update needs the source model's predictions (only for ``min_agreement``)."""
        return self.min_agreement is not None

    def clear(self) -> None:
        """Start the window over (after a reset, or when the anchor moves)."""
        self._batches.clear()
        self._rows = 0

    def _admit(self, adapted: Any, source: Any) -> None:
        """Add one batch to the window, dropping the oldest batches once the others fill it."""
        self._batches.append((adapted, source))
        self._rows += adapted.shape[0]
        while self._batches and self._rows - self._batches[0][0].shape[0] >= self.window:
            self._rows -= self._batches.popleft()[0].shape[0]

    def judge(self, adapted: np.ndarray, source: np.ndarray | None, prior: np.ndarray | None) -> GuardVerdict:
        """The verdict on the window's probabilities ``adapted`` (and the source's on the same rows, or None), against
        the class ``prior`` (None: uniform); a reset counts and starts the window over."""
        probs = np.asarray(adapted, np.float64)
        classes = probs.shape[1]
        ent = float(-(probs * np.log(np.maximum(probs, 1e-12))).sum(axis=1).mean()) / math.log(classes)
        if prior is not None and prior.size == classes:
            p = np.asarray(prior, np.float64)
            prior_entropy = float(-(p * np.log(np.maximum(p, 1e-12))).sum())
        else:
            prior_entropy = math.log(classes)
        mean = np.maximum(probs.mean(axis=0), 1e-12)
        ratio = float(-(mean * np.log(mean)).sum()) / prior_entropy if prior_entropy > 1e-6 else None
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
        verdict = GuardVerdict(reason is not None, reason, ratio, agreement, ent, self._rows)
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

    def update(self, adapted_logits: np.ndarray, source_logits: np.ndarray | None = None) -> GuardVerdict:
        """Add one batch's predictions (adapted, and the source's on the same rows if known) and read the signals."""
        adapted = softmax(np.asarray(adapted_logits, np.float32))
        source = None if source_logits is None else softmax(np.asarray(source_logits, np.float32))
        self._admit(adapted, source)
        sources = [s for _, s in self._batches if s is not None]
        all_source = np.concatenate(sources) if len(sources) == len(self._batches) else None
        return self.judge(np.concatenate([a for a, _ in self._batches]), all_source, self.class_prior)


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
        source = self.source_forward(x) if self.guard is not None and self.guard.needs_source else None
        if not finite:
            reason = "non-finite normalisation parameters after the step"
        elif self.guard is not None:
            verdict = self.guard.update(adapted, source)
            reason = verdict.reason
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
