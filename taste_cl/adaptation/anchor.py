"""The undo of test-time adaptation: a copy of exactly what it may change.

BN-adapt, TENT and EATA change only the normalisation layers: their affine weights and
biases, and BatchNorm's running statistics. :class:`NormAnchor` copies those and nothing
else, so resetting to the source model costs a few kilobytes where a frozen copy of the
whole model would cost the model's size (:attr:`NormAnchor.nbytes` against
:func:`model_bytes`); the source model's predictions come from the same copy, swapped in
for one forward (:meth:`NormAnchor.swapped`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from taste_cl.adaptation.methods import norm_layers

__all__ = ["NormAnchor", "model_bytes", "norm_tensors"]


def norm_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The normalisation layers' parameters and buffers (running statistics, batch counts) by full name."""
    found: dict[str, torch.Tensor] = {}
    for name, module in norm_layers(model):
        prefix = f"{name}." if name else ""
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None:
                found[prefix + key] = tensor
    return found


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer: what a frozen source copy of the model would take."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class NormAnchor:
    """A copy of the model's normalisation tensors, to reset to and to predict as the source."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._saved: dict[str, torch.Tensor] = {}
        self.capture()

    def capture(self) -> None:
        """Make the model's current normalisation tensors the anchor."""
        self._saved = {name: t.detach().clone() for name, t in norm_tensors(self.model).items()}

    def restore(self) -> None:
        """Put the anchor's values back into the model (in place, so optimizers keep their parameters)."""
        live = norm_tensors(self.model)
        with torch.no_grad():
            for name, value in self._saved.items():
                live[name].copy_(value)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The model with the anchor's values for the duration; its own values afterwards."""
        current = {name: t.detach().clone() for name, t in norm_tensors(self.model).items()}
        self.restore()
        try:
            yield
        finally:
            live = norm_tensors(self.model)
            with torch.no_grad():
                for name, value in current.items():
                    live[name].copy_(value)

    def values(self) -> dict[str, torch.Tensor]:
        """The anchor's tensors (copies), for checkpoints."""
        return {name: t.clone() for name, t in self._saved.items()}

    def load_values(self, values: dict[str, torch.Tensor]) -> None:
        """Set the anchor from :meth:`values` of the same model; ``ValueError`` (nothing changed) on other names or shapes."""
        live = norm_tensors(self.model)
        if set(values) != set(live):
            raise ValueError(f"the anchor names {sorted(set(values) ^ set(live))[:4]} that are not this model's normalisation tensors")
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or value.shape != live[name].shape or value.dtype != live[name].dtype:
                raise ValueError(f"anchor tensor `{name}` must be a {live[name].dtype} tensor of shape {tuple(live[name].shape)}")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"anchor tensor `{name}` holds non-finite values")
        self._saved = {name: value.detach().clone() for name, value in values.items()}

    @property
    def nbytes(self) -> int:
        """Memory the anchor takes."""
        return sum(t.numel() * t.element_size() for t in self._saved.values())
