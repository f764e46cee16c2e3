"""Label-free signals of a collapsing adaptation, and when to reset.

Test-time adaptation on long or recurring streams tends to collapse: entropy minimisation
rewards confident predictions, and the cheapest way to be confident is to predict few
classes (RDumb/CCC, arXiv 2306.05401, finds that all but one published method ends worse
than never adapting, and that resetting to the source periodically beats them). Without
labels the guard watches, over the last ``window`` rows, what collapse does:

- **marginal ratio**: the entropy of the mean adapted prediction over the entropy of the
  class prior (uniform unless ``class_prior`` is given, e.g. the label counts seen so far).
  Collapse onto few classes drives it towards 0, whatever the shift.
- **confident agreement**: on the rows where the source model is confident (top
  probability at least ``confident``), the share where the adapted model predicts the same
  class. Reported; a reset signal only with ``min_agreement`` set, because under a strong
  shift the source is confidently wrong and good adaptation overrides it (on severity-5
  contrast the source errs on 91% of generated images and BN-adapt on 4%).
- **entropy**: the adapted predictions' mean entropy over ``log(classes)`` (reported only:
  low entropy is what adaptation aims for, so it cannot tell success from collapse alone).

When the window holds at least ``min_rows`` rows and the marginal ratio falls below
``min_marginal_ratio`` (or the confident agreement below ``min_agreement``, when set), the
verdict is a reset to the anchor (the source's normalisation tensors) and the window starts
over.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from taste_cl._checks import check_int, check_positive

__all__ = ["CollapseGuard", "GuardVerdict"]


@dataclass(frozen=True)
class GuardVerdict:
    """The guard's reading after a batch: its signals (None until measurable) and whether to reset."""

    reset: bool
    reason: str | None
    marginal_ratio: float | None
    agreement: float | None
    entropy: float
    rows: int


def _marginal_entropy(probs: torch.Tensor) -> float:
    mean = probs.mean(dim=0).clamp_min(1e-12)
    return float(-(mean * mean.log()).sum())


class CollapseGuard:
    """Reset adaptation to the anchor when label-free signals say it collapses (see the module)."""

    def __init__(
        self,
        *,
        window: int = 128,
        min_rows: int = 64,
        min_marginal_ratio: float = 0.85,
        min_agreement: float | None = None,
        confident: float = 0.9,
        class_prior: Sequence[float] | None = None,
    ) -> None:
        self.window = check_int("window", window, 1)
        self.min_rows = check_int("min_rows", min_rows, 1)
        if min_rows > window:
            raise ValueError(f"`min_rows == {min_rows}`, must be <= window ({window})")
        self.min_marginal_ratio = check_positive("min_marginal_ratio", min_marginal_ratio, upper=1.0)
        self.min_agreement = None if min_agreement is None else check_positive("min_agreement", min_agreement, upper=1.0)
        self.confident = check_positive("confident", confident, upper=1.0)
        self.class_prior: torch.Tensor | None = None
        if class_prior is not None:
            self.set_class_prior(class_prior)
        self.resets = 0
        self._batches: deque[tuple[torch.Tensor, torch.Tensor | None]] = deque()
        self._rows = 0

    def set_class_prior(self, prior: Sequence[float]) -> None:
        """The class frequencies the marginal is compared with (normalised here), e.g. label counts."""
        values = torch.as_tensor(list(prior), dtype=torch.float64)
        if values.dim() != 1 or values.numel() < 2 or not bool(torch.isfinite(values).all()) or bool((values < 0).any()) or float(values.sum()) <= 0:
            raise ValueError("`class_prior` must be at least 2 finite, non-negative frequencies with a positive sum")
        self.class_prior = (values / values.sum()).float()

    def clear(self) -> None:
        """Start the window over (after a reset, or when the anchor moves)."""
        self._batches.clear()
        self._rows = 0

    @property
    def needs_source(self) -> bool:
        """Whether :meth:`update` needs the source model's predictions (only for ``min_agreement``)."""
        return self.min_agreement is not None

    def update(self, adapted_logits: torch.Tensor, source_logits: torch.Tensor | None = None) -> GuardVerdict:
        """Add one batch's predictions (adapted, and the source's on the same rows if known) and read the signals."""
        adapted = adapted_logits.detach().float().softmax(dim=1)
        source = None if source_logits is None else source_logits.detach().float().softmax(dim=1)
        self._batches.append((adapted, source))
        self._rows += adapted.shape[0]
        while self._batches and self._rows - self._batches[0][0].shape[0] >= self.window:
            self._rows -= self._batches.popleft()[0].shape[0]
        all_adapted = torch.cat([a for a, _ in self._batches])
        sources = [s for _, s in self._batches if s is not None]
        all_source = torch.cat(sources) if len(sources) == len(self._batches) else None
        classes = all_adapted.shape[1]
        ent = float(-(all_adapted * all_adapted.clamp_min(1e-12).log()).sum(dim=1).mean()) / math.log(classes)
        if self.class_prior is not None and self.class_prior.numel() == classes:
            prior_entropy = float(-(self.class_prior * self.class_prior.clamp_min(1e-12).log()).sum())
        else:
            prior_entropy = math.log(classes)
        ratio = _marginal_entropy(all_adapted) / prior_entropy if prior_entropy > 1e-6 else None
        agreement = None
        if all_source is not None:
            confident = all_source.max(dim=1).values >= self.confident
            if bool(confident.any()):
                agreement = float((all_adapted.argmax(1) == all_source.argmax(1))[confident].float().mean())
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

    def settings(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "min_rows": self.min_rows,
            "min_marginal_ratio": self.min_marginal_ratio,
            "min_agreement": self.min_agreement,
            "confident": self.confident,
            "class_prior": None if self.class_prior is None else self.class_prior.tolist(),
        }
