"""export_engine: a torch model as an ExecuTorch engine folder (:class:`~taste_cl.adapters.executorch.engine.ExecuTorchEngine`).

The program has two methods (see :mod:`.engine`): ``forward`` (inputs and trainable tensors ->
outputs) and ``vjp``, ExecuTorch's joint forward-backward export of the loss
``(outputs * grad_outputs).sum()``, whose parameter gradients are the vector-Jacobian product. The
model is copied and trained as in eval mode: BatchNorm frozen on its running statistics and random
layers off (the transforms :func:`~taste_cl.adapters.device.transforms.needed_transforms` names, applied
and recorded), as the standard-ONNX engine captures it; the rewrites the ExecuTorch backend makes
(``nn.EmbeddingBag``, ``nn.Conv1d``, peft LoHa; :func:`~taste_cl.adapters.executorch.build.prepare_model`)
are made too. The folder is published only if the loaded engine's outputs and vector-Jacobian
product match torch's on the example (``rtol``), else :class:`~taste_cl.exceptions.UnsupportedModelError`
with the numbers, and nothing is written.

Needs the ``[executorch]`` extra; its Python runtime imports torch.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> folder = export_engine(model, torch.randn(8, 4), "engine", optimizer=sgd)  # doctest: +SKIP
>>> from taste_cl.adapters.executorch.engine import ExecuTorchEngine
>>> engine = ExecuTorchEngine(folder)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl._checks import check_int
from taste_cl.adapters.device.artifacts import staged_folder
from taste_cl.adapters.device.trainable import trained_parameters
from taste_cl.adapters.device.transforms import apply_transforms, needed_transforms
from taste_cl.adapters.executorch.build import check_kernels, joint_program, lower_programs, prepare_model, write_program
from taste_cl.adapters.executorch.engine import FORMAT, FORWARD, MANIFEST, OPTIMIZER_STATE, PARAMETERS, PROGRAM, VJP, WEIGHTS, ExecuTorchEngine
from taste_cl.adapters.executorch.optimizer import NumpyOptimizer
from taste_cl.adapters.executorch.runtime import MIN_BATCH, executorch_runtime
from taste_cl.exceptions import ExportError, UnsupportedModelError

__all__ = ["export_engine"]


class _VectorJacobian(nn.Module):
    """The scalar ``(model(x) * grad_outputs).sum()``: its parameter gradients are the vector-Jacobian product."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, grad_outputs: torch.Tensor) -> tuple[torch.Tensor]:
        return ((self.model(x) * grad_outputs).sum(),)


class _Forward(nn.Module):
    """``model(x)`` with the trainable tensors as inputs (ExecuTorch methods do not share mutable weights)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)

    def forward(self, x: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.func.functional_call(self.model, dict(zip(self.names, params)), (x,), strict=False)


def _lower(model: nn.Module, names: Sequence[str], x: torch.Tensor, grad: torch.Tensor, max_batch: int) -> Any:
    from torch.export import Dim, export
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = Dim("batch", min=MIN_BATCH, max=max_batch)
    params = tuple(dict(model.named_parameters())[name].detach().clone() for name in names)
    stage = f"torch.export of {VJP!r}"
    try:
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention kernel has no ExecuTorch backward
            vjp = export(_VectorJacobian(model), (x, grad), dynamic_shapes=({0: batch}, {0: batch}), strict=True)
            stage = "the joint forward-backward graph"
            vjp = joint_program(vjp)
            stage = f"torch.export of {FORWARD!r}"
            forward = export(_Forward(model, names), (x, params), dynamic_shapes=({0: batch}, (None,) * len(params)), strict=False)
        stage = "to_edge/to_executorch"
        return lower_programs({FORWARD: forward, VJP: vjp})
    except Exception as error:  # the exporters raise many unrelated types; name the step and keep the cause
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedModelError(f"ExecuTorch cannot train this model as an engine: {stage} failed: {first_line}") from error


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-6))


def _gate(folder: Path, model: nn.Module, names: Sequence[str], x: torch.Tensor, rtol: float) -> None:
    """Refuse (``UnsupportedModelError``) an engine whose outputs or vector-Jacobian product on ``x`` differ from torch's."""
    engine = ExecuTorchEngine(folder)
    params = dict(model.named_parameters())
    outputs = model(x)
    direction = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(0))
    expected = torch.autograd.grad(outputs, [params[n] for n in names], direction)
    got_outputs = engine.forward(x.numpy(), train=True)
    got = engine.backward(direction.numpy())
    errors = {"outputs": _relative(got_outputs, outputs.detach().numpy())}
    errors |= {f"grad.{n}": _relative(got[n], e.numpy()) for n, e in zip(names, expected)}
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] > rtol:
        raise UnsupportedModelError(
            f"ExecuTorch computes this model differently from torch: {worst} differs by {errors[worst]:.3g} (relative; "
            f"tolerance {rtol:g}); not published. Use backend='onnx_engine' or another layer"
        )


def export_engine(
    model: nn.Module,
    example: torch.Tensor,
    folder: str | os.PathLike[str],
    *,
    optimizer: torch.optim.Optimizer,
    trainable: Sequence[str] | None = None,
    transforms: Sequence[str] = (),
    max_batch_size: int = 128,
    rtol: float = 1e-3,
) -> Path:
    """Write the ExecuTorch engine folder for ``model`` and return its path (see the module).

    ``example``: a batch of the model's one input tensor (at least 2 rows), which fixes the row shape and
    dtype and is what the gate compares on. ``optimizer``: a ``torch.optim.SGD`` or ``AdamW`` over the model's
    parameters (one group); its settings and state travel (the learning rate is the loop's). ``trainable``:
    the parameters that get gradients (default: those the optimizer holds that require gradients).
    ``transforms``: more rewrites to apply first (:mod:`taste_cl.adapters.device.transforms`).
    ``max_batch_size``: the program's largest batch (the engine runs larger ones in chunks). ``folder``
    must be absent or empty; it is complete or untouched.
    """
    executorch_runtime()
    check_int("max_batch_size", max_batch_size, MIN_BATCH)
    if not isinstance(example, torch.Tensor) or example.dim() < 1 or example.shape[0] < MIN_BATCH:
        raise ExportError(f"`example` must be one tensor batch of at least {MIN_BATCH} rows (the engine takes one input tensor)")
    spec = NumpyOptimizer.from_torch(optimizer)
    held = trained_parameters(model, optimizer)
    names = held if trainable is None else list(trainable)
    unknown = [name for name in names if name not in held]
    if unknown or not names:
        raise ExportError(f"`trainable` must name parameters the optimizer holds; unknown: {unknown}" if unknown else "nothing would train")
    prepared, applied = prepare_model(model, names, transforms)
    applied += apply_transforms(prepared, needed_transforms(prepared))  # as in eval mode: frozen BatchNorm, no random layers
    prepared.eval()
    x = example.detach().cpu()[:max_batch_size]
    x = x.float() if x.is_floating_point() else x
    with torch.no_grad():
        out = prepared(x)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or not out.is_floating_point():
        raise ExportError(f"the model must return one float tensor shaped (rows, ...); got {type(out).__name__}")
    lowered = _lower(prepared, names, x, torch.zeros_like(out), max_batch_size)
    check_kernels(lowered)
    params = dict(prepared.named_parameters())
    originals = dict(model.named_parameters())
    manifest = {
        "format": FORMAT,
        "input": {"dtype": str(x.numpy().dtype), "shape": list(x.shape[1:])},
        "output_shape": list(out.shape[1:]),
        "trainable": {name: list(params[name].shape) for name in names},
        "max_batch": max_batch_size,
        "optimizer": spec.to_json(),
        "transforms": applied,
    }
    with staged_folder(folder) as stage:
        write_program(lowered, stage, PROGRAM, WEIGHTS)
        np.savez(stage / PARAMETERS, **{name: params[name].detach().numpy().astype(np.float32) for name in names})  # type: ignore[arg-type]
        np.savez(stage / OPTIMIZER_STATE, **spec.torch_state(optimizer, {name: originals[name] for name in names}))  # type: ignore[arg-type]
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _gate(stage, prepared, names, x, rtol)
    return Path(folder).absolute()
