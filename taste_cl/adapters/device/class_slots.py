"""Reserved output slots: classes a device learns after export, without a new export.

``export(..., reserved_classes=K)`` widens the classifier of the exported copy by ``K``
outputs (see :func:`taste_cl.learner.heads.reserve_classes`); the manifest's
``"num_classes"`` is then the total number of slots and ``"active_classes"`` lists the
classes in use (the model's own). A device learner takes labels up to the slot count: a
slot becomes active on its first label, and is active from then on (its saved state
keeps the list). :meth:`ClassSlots.mask` gives inactive slots the logit ``-inf`` in
what ``predict`` returns, so an argmax or a softmax runs over the active classes only.

The training graph is the exported one: inactive slots take part in its softmax, as the
unused outputs of a fixed-width head do (their logits are pushed down until their class
arrives). Numpy only: the device runtimes import it without torch.

>>> import numpy as np
>>> slots = ClassSlots(parse_active_classes([0, 1], 4), 4)
>>> slots.activate(np.array([3, 1]))
[3]
>>> slots.mask(np.zeros((1, 4), dtype=np.float32)).tolist()
[[0.0, 0.0, -inf, 0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ArtifactError

__all__ = ["ClassSlots", "parse_active_classes"]


def parse_active_classes(value: Any, num_classes: int | None) -> tuple[int, ...] | None:
    """A manifest's ``"active_classes"``: None (every class active), or distinct increasing
    class indices below ``num_classes`` (the output width the graphs were checked to have)."""
    if value is None:
        return None
    rule = f"None or a non-empty, increasing list of class indices in [0, {num_classes}) (the output width)"
    if num_classes is None or not isinstance(value, list) or not value:
        raise ArtifactError(f"manifest `active_classes` must be {rule}; got {_short(value)}")
    if any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < num_classes for c in value) or value != sorted(set(value)):
        raise ArtifactError(f"manifest `active_classes` must be {rule}; got {_short(value)}")
    return tuple(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class ClassSlots:
    """Which of ``slots`` output slots are active (``active`` None: all of them, nothing masked)."""

    def __init__(self, active: Sequence[int] | None, slots: int | None) -> None:
        self.slots = slots
        self.active: set[int] | None = None if active is None else set(active)

    def activate(self, labels: np.ndarray, ignore_index: int | None = None) -> list[int]:
        """Activate the slots of validated class ``labels``; return the newly active ones."""
        if self.active is None or not labels.size:
            return []
        seen = {int(c) for c in np.unique(labels) if c != ignore_index}
        added = sorted(seen - self.active)
        self.active |= seen
        return added

    def mask(self, outputs: np.ndarray) -> np.ndarray:
        """``outputs`` (classes on axis 1) with ``-inf`` in the inactive slots."""
        if self.active is None or len(self.active) == self.slots or outputs.ndim < 2:
            return outputs
        inactive = np.ones(outputs.shape[1], dtype=bool)
        inactive[sorted(self.active)] = False
        masked = np.array(outputs, copy=True)
        masked[:, inactive] = -np.inf
        return masked

    def manifest(self) -> dict[str, Any]:
        """The manifest entry a saved state carries (none when every slot was always active)."""
        return {} if self.active is None else {"active_classes": sorted(self.active)}
