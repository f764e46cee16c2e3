"""A label-free accuracy estimate of test-time adaptation: AETTA, from dropout inference on the classifier.

AETTA (Lee et al., CVPR 2024, arXiv 2404.01351) estimates a test-time-adapted model's accuracy
without labels: run the batch again with dropout several times, and count how often the dropout
predictions disagree with the prediction (prediction disagreement with dropout inference, PDD);
that disagreement estimates the error. A model that collapses agrees with itself under dropout
while its predictions fall onto few classes, so AETTA divides the PDD by the cube of the entropy of
the batch-mean dropout prediction over its maximum (its robustness term; the arithmetic, torch-free
and shared with the device guard, is :func:`~taste_cl.engine.adapt.aetta_accuracy`).

The models adapted here have no dropout layers. :class:`DropoutProbe` therefore applies dropout
(rate ``rate``, 0.4 as AETTA's CIFAR-10 setting) to the **features feeding the classifier**, the
model's last ``nn.Linear``, read by a hook during the adapted forward, and reruns only that layer
``passes`` times (10, as AETTA): the cost is 10 extra passes through the last linear layer per
batch, no extra forward of the backbone. The dropout masks come from a generator seeded by the
batch's index, so a resumed adapter draws the same masks. Where the model's output is not that
layer's output (something follows it), the probe gives no summary and the estimate is absent.

Differences from the paper, on purpose: the estimate is taken over the guard's window of rows (128)
rather than per batch with a moving average, so that batches of 4 rows give a usable marginal
entropy; and with a class prior the entropy's maximum is the prior's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from taste_cl._checks import check_int, check_positive
from taste_cl.engine.adapt import dropout_summary

__all__ = ["DropoutProbe", "classifier"]


def classifier(model: nn.Module) -> nn.Linear | None:
    """The model's last ``nn.Linear`` in module order (its classifier, for the models adapted here), or None."""
    found = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return found[-1] if found else None


class DropoutProbe:
    """Dropout inference on the features feeding ``model``'s classifier (see the module)."""

    def __init__(self, model: nn.Module, *, rate: float = 0.4, passes: int = 10) -> None:
        self.rate = check_positive("rate", rate, upper=1.0)
        if self.rate >= 1:
            raise ValueError(f"`rate == {rate!r}`, must be below 1")
        self.passes = check_int("passes", passes, 1)
        self.head = classifier(model)
        self._features: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Read the classifier's input and output during the forwards inside (the hook is removed afterwards)."""
        self._features = self._output = None
        if self.head is None:
            yield
            return

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            self._features, self._output = inputs[0].detach(), output.detach()

        handle = self.head.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def summary(self, logits: torch.Tensor, seed: int) -> torch.Tensor | None:
        """Per row of the captured forward whose output is ``logits``: the share of ``passes`` dropout predictions
        that agree with its prediction, and their mean probabilities (``(rows, 1 + classes)``); None when the
        classifier's output is not ``logits`` (nothing captured, or something follows the layer)."""
        features, output, head = self._features, self._output, self.head
        if features is None or output is None or head is None or output.shape != logits.shape or not torch.equal(output, logits.detach()):
            return None
        generator = torch.Generator(device=features.device).manual_seed(seed)
        keep = 1.0 - self.rate
        with torch.no_grad():
            dropped = [
                head(features * (torch.rand(features.shape, generator=generator, device=features.device) < keep) / keep) for _ in range(self.passes)
            ]
        summary = dropout_summary(logits.detach().float().cpu().numpy(), torch.stack(dropped).float().cpu().numpy())
        return torch.from_numpy(summary).to(device=logits.device)
