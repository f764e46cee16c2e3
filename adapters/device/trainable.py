"""Which parameters a device trains: those the optimizer holds and that require gradients.

A frozen backbone (``requires_grad=False``, or left out of the optimizer) stays frozen on the
device: both exporters mark every other parameter non-trainable in the model copy they
export (ONNX Runtime: frozen parameters of the artifacts, no gradient and no optimizer state;
ExecuTorch: no gradient, so the device SGD never sees it), and the parity gate's torch
reference then trains exactly what the device trains.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
>>> optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
>>> trained_parameters(model, optimizer)
['1.weight', '1.bias']
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn, optim

__all__ = ["freeze_untrained", "trained_parameters"]


def trained_parameters(model: nn.Module, optimizer: optim.Optimizer) -> list[str]:
    """Names of ``model``'s parameters that ``optimizer`` holds and that require gradients, in model order."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) in held]


def freeze_untrained(model: nn.Module, trained: Collection[str]) -> None:
    """Make exactly the ``trained`` parameters of ``model`` require gradients (by name)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trained)
