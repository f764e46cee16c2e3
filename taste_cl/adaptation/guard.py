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
- **estimated accuracy** (AETTA, Lee et al., CVPR 2024, arXiv 2404.01351): the agreement of the
  predictions with dropout-perturbed ones, corrected by the entropy of the window's mean
  prediction (:mod:`~taste_cl.adaptation.estimate`); of the adapted model, and of the source on
  the same rows when the source is run. Reported whenever the adapter gives dropout summaries.
  With ``accuracy_margin`` set the source is run on every batch, and while the adapted estimate
  is below the source's by more than the margin the verdict is a **fallback**: the batch is
  answered with the source's predictions (the adaptation goes on underneath, the window is
  kept). This catches what a reset cannot: batch statistics that hurt on every batch afresh
  (batches of one class, batches of 4 sequences), where resetting the anchor changes nothing.

When the window holds at least ``min_rows`` rows and the marginal ratio falls below
``min_marginal_ratio`` (or the confident agreement below ``min_agreement``, when set), the
verdict is a reset to the anchor (the source's normalisation tensors) and the window starts
over.

Checkpoints: :meth:`CollapseGuard.state_dict` holds the settings, the class prior, the reset
count and the window itself (each batch's adapted probabilities, the source's or None, and their
dropout summaries or None);
:meth:`CollapseGuard.parse_state` checks one, changing nothing, and returns what applies it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from taste_cl._checks import INT_LIMIT
from taste_cl.engine.adapt import CollapseRule, GuardVerdict, normalised_prior
from taste_cl.state.restore import Apply, check_keys, check_tensor, refusing
from taste_cl.state.restore import check_int as check_int_in

__all__ = ["CollapseGuard", "GuardVerdict"]

_Entry = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""One batch of the window: adapted probabilities, the source's, and their dropout summaries (None where not known)."""


def _probabilities(where: str, value: Any, shape: tuple[int, ...] | None) -> torch.Tensor:
    """One batch of the window: float32 rows of probabilities, ``(rows >= 1, classes >= 2)`` or ``shape``."""
    tensor = check_tensor(where, value, dtype=torch.float32)
    if tensor.dim() != 2 or tensor.shape[0] < 1 or tensor.shape[1] < 2 or (shape is not None and tuple(tensor.shape) != shape):
        rule = f"shape {shape}" if shape is not None else "shape (rows >= 1, classes >= 2)"
        raise ValueError(f"`{where}` must be a float32 tensor of {rule}; got {tuple(tensor.shape)}")
    if bool(((tensor < 0) | (tensor > 1)).any()):
        raise ValueError(f"`{where}` must hold probabilities in [0, 1]")
    return tensor


def _placed(entry: _Entry, device: torch.device | None) -> _Entry:
    """Copies of a window entry's tensors on ``device`` (None: where they are)."""
    adapted, source, summary, source_summary = (None if t is None else t.to(device=device).clone() for t in entry)
    assert adapted is not None  # a checked entry always has its adapted probabilities
    return adapted, source, summary, source_summary


class CollapseGuard(CollapseRule):
    """Reset adaptation to the anchor when label-free signals say it collapses (see the module): the torch-free
    :class:`~taste_cl.engine.adapt.CollapseRule` (its settings and decision, the device guard's too) on torch predictions."""

    def __init__(
        self,
        *,
        window: int = 128,
        min_rows: int = 64,
        min_marginal_ratio: float = 0.85,
        min_agreement: float | None = None,
        confident: float = 0.9,
        accuracy_margin: float | None = 0.0,
        class_prior: Sequence[float] | None = None,
    ) -> None:
        super().__init__(
            window=window,
            min_rows=min_rows,
            min_marginal_ratio=min_marginal_ratio,
            min_agreement=min_agreement,
            confident=confident,
            accuracy_margin=accuracy_margin,
        )
        self.class_prior: torch.Tensor | None = None
        if class_prior is not None:
            self.set_class_prior(class_prior)

    def set_class_prior(self, prior: Sequence[float]) -> None:
        """The class frequencies the marginal is compared with (normalised here), e.g. label counts."""
        self.class_prior = torch.from_numpy(normalised_prior(prior)).float()

    def update(
        self,
        adapted_logits: torch.Tensor,
        source_logits: torch.Tensor | None = None,
        summary: torch.Tensor | None = None,
        source_summary: torch.Tensor | None = None,
    ) -> GuardVerdict:
        """Add one batch's predictions (adapted, and the source's on the same rows if known), with their dropout
        summaries if known (:meth:`~taste_cl.adaptation.estimate.DropoutProbe.summary`), and read the signals."""
        adapted = adapted_logits.detach().float().softmax(dim=1)
        source = None if source_logits is None else source_logits.detach().float().softmax(dim=1)
        self._admit(adapted, source, summary, source_summary)
        return self.read(None if self.class_prior is None else self.class_prior.cpu().numpy())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Settings, class prior (a tensor: restored bit for bit), resets and the window, oldest first (copies): per
        batch ``[adapted, source or None, summary or None, source summary or None]``, probabilities and dropout
        summaries."""
        return {
            "settings": {key: value for key, value in self.settings().items() if key != "class_prior"},
            "class_prior": None if self.class_prior is None else self.class_prior.clone(),
            "resets": self.resets,
            "window": [[None if t is None else t.clone() for t in batch] for batch in self._batches],
        }

    def parse_state(self, state: Any, *, where: str = "adaptation.guard", device: torch.device | None = None) -> Apply:
        """Check a :meth:`state_dict`, changing nothing, and return what applies it to this guard (its settings too;
        the window's tensors go to ``device`` when given). Raises :class:`~taste_cl.exceptions.CheckpointError`
        naming the field: settings a guard refuses, a class prior that is not a distribution, a negative reset
        count, window rows that are not probabilities of one class count (or summaries of one more column: an
        agreement and the mean probabilities), or more rows after the oldest batch than the window keeps
        (:meth:`update` drops the oldest batch once the others fill the window)."""
        with refusing():
            if not isinstance(state, dict):
                raise ValueError(f"`{where}` must be a dict or None; got {type(state).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
            check_keys(where, state, set(self.state_dict()), " from what a CollapseGuard keeps")
            settings = state["settings"]
            if not isinstance(settings, dict):
                raise ValueError(f"`{where}.settings` must be a dict; got {type(settings).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
            settings = {"accuracy_margin": None, **settings}  # written before the accuracy estimate: none
            check_keys(f"{where}.settings", settings, set(self.settings()) - {"class_prior"})
            try:
                fresh = CollapseGuard(**settings)
            except (ValueError, TypeError) as error:
                raise ValueError(f"`{where}.settings`: {error}") from error
            prior = state["class_prior"]
            if prior is not None:
                prior = check_tensor(f"{where}.class_prior", prior, dtype=torch.float32)
                if prior.dim() != 1 or prior.numel() < 2 or bool((prior < 0).any()) or float(prior.sum()) <= 0:
                    raise ValueError(f"`{where}.class_prior` must be None or at least 2 non-negative frequencies with a positive sum")
            resets = check_int_in(f"{where}.resets", state["resets"], 0, INT_LIMIT)
            batches = self._parse_window(state["window"], f"{where}.window", fresh.window)
        placed = [_placed(entry, device) for entry in batches]
        placed_prior = None if prior is None else prior.clone()

        def apply() -> None:
            self.window, self.min_rows, self.confident = fresh.window, fresh.min_rows, fresh.confident
            self.min_marginal_ratio, self.min_agreement = fresh.min_marginal_ratio, fresh.min_agreement
            self.accuracy_margin = fresh.accuracy_margin
            self.class_prior, self.resets = placed_prior, resets
            self._batches = deque(placed)
            self._rows = sum(batch[0].shape[0] for batch in placed)

        return apply

    @staticmethod
    def _parse_window(value: Any, where: str, window: int) -> list[_Entry]:
        """The window's batches; a pair ``[adapted, source or None]`` (written before the dropout summaries) reads
        as one without summaries."""
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"`{where}` must be a list of [adapted, source, summary, source summary] entries; got {type(value).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
        batches: list[_Entry] = []
        classes = None
        for i, entry in enumerate(value):
            if not isinstance(entry, (list, tuple)) or len(entry) not in (2, 4):
                raise ValueError(f"`{where}[{i}]` must be an [adapted, source, summary, source summary] entry (each but adapted may be None)")
            adapted = _probabilities(f"{where}[{i}][0]", entry[0], None)
            classes = adapted.shape[1] if classes is None else classes
            if adapted.shape[1] != classes:
                raise ValueError(f"`{where}[{i}][0]` has {adapted.shape[1]} classes; the window's first batch has {classes}")
            shape = tuple(adapted.shape)
            summaries = [None if t is None else _probabilities(f"{where}[{i}][{k}]", t, (shape[0], shape[1] + 1)) for k, t in enumerate(entry[2:], 2)]
            source = None if entry[1] is None else _probabilities(f"{where}[{i}][1]", entry[1], shape)
            summary, source_summary = summaries or [None, None]
            batches.append((adapted, source, summary, source_summary))
        rows = sum(batch[0].shape[0] for batch in batches)
        first = batches[0][0].shape[0] if batches else 0
        if batches and rows - first >= window:
            raise ValueError(f"`{where}` holds {rows - first} rows after its oldest batch; a window of {window} rows keeps fewer")
        return batches

    def settings(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "min_rows": self.min_rows,
            "min_marginal_ratio": self.min_marginal_ratio,
            "min_agreement": self.min_agreement,
            "confident": self.confident,
            "accuracy_margin": self.accuracy_margin,
            "class_prior": None if self.class_prior is None else self.class_prior.tolist(),
        }
