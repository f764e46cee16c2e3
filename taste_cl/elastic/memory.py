"""Training memory: what the selected units cost beyond inference, estimated and measured.

Training memory here is what a step needs on top of the model itself: the activations
autograd keeps for the backward pass, the gradients, and the optimizer state of the
trainable parameters. :meth:`TensorProfile.memory_bytes` estimates it per selection from
the profile; :func:`measure_training_memory` measures it on a real step by counting every
tensor storage autograd saves (parameters excluded), every gradient and every optimizer
state tensor, and on CUDA also reports the allocator's peak.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from taste_cl._batch import call_model
from taste_cl.elastic.profiling import SavedBytes

__all__ = ["measure_training_memory", "optimizer_state_factor"]


def optimizer_state_factor(optimizer: torch.optim.Optimizer | None) -> float:
    """Optimizer state bytes per trainable parameter byte (SGD momentum 1, Adam/AdamW 2, AMSGrad 3).

    Unknown optimizers count as 2 (the common case of two moments).
    """
    if optimizer is None:
        return 0.0
    defaults = optimizer.defaults
    if isinstance(optimizer, torch.optim.SGD):
        return 1.0 if defaults.get("momentum", 0) else 0.0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3.0 if defaults.get("amsgrad") else 2.0
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1.0 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered"))
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1.0
    return 2.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_training_memory(
    model: nn.Module,
    x: Any,
    y: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    output: Callable[[Any], Any] | None = None,
) -> dict[str, int]:
    """Measure one training step's memory on a deep copy of ``model`` (trainability as set).

    Returns bytes: ``saved`` (distinct storages autograd keeps for backward, parameters
    excluded), ``grads`` (gradients of the trainable parameters), ``optimizer_state``
    (state tensors ``optimizer`` holds for the trainable parameters, or the
    :func:`optimizer_state_factor` estimate for those it has no state for yet),
    ``total`` (their sum) and, on CUDA, ``cuda_peak`` (allocator peak during the step
    minus the memory allocated before it). ``model`` and ``optimizer`` are not changed.
    ``output`` picks the trained tensor from the model's output (the learner's ``output``).
    """
    replica = copy.deepcopy(model)
    replica.train()
    device = next((p.device for p in replica.parameters()), torch.device("cpu"))
    params = list(replica.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with SavedBytes(param_ptrs) as saved:
        out = call_model(replica, x, output=output)
        loss = loss_fn(out, y)
    if loss.requires_grad:
        loss.backward()
    del out, loss
    grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    state = 0
    if optimizer is not None:
        originals = list(model.parameters())
        factor = optimizer_state_factor(optimizer)
        for original, p in zip(originals, params):
            if not p.requires_grad:
                continue
            held = optimizer.state.get(original, {})
            tensors = [v for v in held.values() if torch.is_tensor(v) and v.numel() > 1]
            state += sum(_nbytes(v) for v in tensors) if tensors else int(factor * _nbytes(p))
    result = {"saved": saved.total, "grads": grads, "optimizer_state": state, "total": saved.total + grads + state}
    if cuda:
        torch.cuda.synchronize(device)
        result["cuda_peak"] = int(torch.cuda.max_memory_allocated(device) - before)
    return result
