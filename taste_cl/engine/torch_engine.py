"""Torch eager as an engine (:class:`~taste_cl.engine.base.Engine`).

The forward keeps its autograd graph; :meth:`TorchEngine.backward` is one
``torch.autograd.grad`` of the outputs against ``grad_outputs``, so the activations are
computed once. The optimizer is the user's ``torch.optim`` optimizer: gradients are set on
the trainable parameters and it steps; its state is flattened to named arrays
(``"<param>/<key>"``, ``"step"`` included) and read back into ``torch.optim``'s own format.
Arrays cross without copies where torch allows (CPU, float32).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl._batch import call_model
from taste_cl.engine.base import Inputs

__all__ = ["TorchEngine"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class TorchEngine:
    """``model`` trained by ``optimizer``; ``trainable`` names the parameters that get gradients
    (default: those the optimizer holds that require gradients). ``train_mode=False`` runs the
    training forward in eval mode too (BatchNorm on its running statistics, no dropout), as the
    standard-ONNX engine's graphs are captured."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        trainable: Sequence[str] | None = None,
        call: str = "auto",
        output: Callable[[Any], Any] | None = None,
        train_mode: bool = True,
    ) -> None:
        self.model = model
        self.train_mode = train_mode
        self.optimizer = optimizer
        self.call = call
        self.output = output
        named = dict(model.named_parameters())
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = [n for n, p in named.items() if id(p) in held and p.requires_grad] if trainable is None else list(trainable)
        unknown = [n for n in names if n not in named or id(named[n]) not in held]
        if unknown:
            raise ValueError(f"`trainable` names tensors that are not parameters the optimizer holds: {unknown[:4]}")
        self.trainable = tuple(names)
        self._params = [named[n] for n in names]
        self._outputs: torch.Tensor | None = None

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        first = self._params[0] if self._params else next(self.model.parameters())
        return first.device, first.dtype

    def _tensors(self, x: Inputs) -> Any:
        device, dtype = self._placement()

        def one(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
            return t.to(dtype) if t.is_floating_point() else t

        return {k: one(v) for k, v in x.items()} if isinstance(x, Mapping) else one(x)

    def forward(self, x: Inputs, *, train: bool) -> np.ndarray:
        inputs = self._tensors(x)
        self.model.train(train and self.train_mode)
        return self._run(inputs, train=train)

    def _run(self, inputs: Any, *, train: bool) -> np.ndarray:
        """The model's outputs on ``inputs`` in its current mode; with ``train`` kept (with their graph) for :meth:`backward`."""
        if train:
            outputs = call_model(self.model, inputs, output=self.output, call=self.call)
            self._outputs = outputs
        else:
            self._outputs = None
            with torch.no_grad():
                outputs = call_model(self.model, inputs, output=self.output, call=self.call)
        return outputs.detach().cpu().numpy()

    def backward(self, grad_outputs: np.ndarray) -> dict[str, np.ndarray]:
        if self._outputs is None:
            raise RuntimeError("backward needs a forward(..., train=True) first")
        outputs, self._outputs = self._outputs, None
        grad = torch.from_numpy(np.ascontiguousarray(grad_outputs)).to(outputs.device, outputs.dtype)
        grads = torch.autograd.grad(outputs, self._params, grad, allow_unused=True)
        return {
            n: np.zeros(tuple(p.shape), dtype=np.float32) if g is None else g.detach().cpu().numpy()
            for n, p, g in zip(self.trainable, self._params, grads)
        }

    def step(self, gradients: Mapping[str, np.ndarray], lr: float) -> None:
        for name, p in zip(self.trainable, self._params):
            p.grad = torch.from_numpy(np.ascontiguousarray(gradients[name])).to(p.device, p.dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: p.detach().cpu().numpy().copy() for n, p in zip(self.trainable, self._params)}

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        with torch.no_grad():
            for n, p in zip(self.trainable, self._params):
                p.copy_(torch.from_numpy(np.asarray(values[n])))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        flat: dict[str, np.ndarray] = {}
        for n, p in zip(self.trainable, self._params):
            for key, value in self.optimizer.state.get(p, {}).items():
                flat[f"{n}/{key}"] = value.detach().cpu().numpy().copy() if isinstance(value, torch.Tensor) else np.asarray(value)
        return flat

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        for n, p in zip(self.trainable, self._params):
            prefix = f"{n}/"
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if not own:
                self.optimizer.state.pop(p, None)
                continue
            self.optimizer.state[p] = {key: torch.tensor(np.asarray(value), device=p.device) for key, value in own.items()}

    # ------------------------------------------------------------------ test-time adaptation (AdaptableEngine)
    def _batch_norms(self) -> dict[str, nn.Module]:
        return {
            name: m for name, m in self.model.named_modules() if isinstance(m, _BATCH_NORMS) and m.track_running_stats and m.running_mean is not None
        }

    def forward_batch_statistics(self, x: Inputs, *, train: bool) -> np.ndarray:
        """The output with the model in eval mode but its BatchNorm layers in training mode (batch statistics,
        running statistics updated), as :class:`~taste_cl.adaptation.adapter.TestTimeAdapter` runs it."""
        inputs = self._tensors(x)
        self.model.eval()
        for module in self._batch_norms().values():
            module.train()
        try:
            return self._run(inputs, train=train)
        finally:
            self.model.eval()

    def norm_statistics(self) -> dict[str, np.ndarray]:
        buffers = dict(self.model.named_buffers())
        names = [
            f"{layer}.{key}" if layer else key for layer in self._batch_norms() for key in ("running_mean", "running_var", "num_batches_tracked")
        ]
        return {name: buffers[name].detach().cpu().numpy().copy() for name in names}

    def load_norm_statistics(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy ``values`` (:meth:`norm_statistics`' names and shapes, finite) into the buffers; ``ValueError`` and nothing changed otherwise."""
        live = self.norm_statistics()
        if set(values) != set(live):
            raise ValueError(f"statistics name {sorted(set(values) ^ set(live))[:4]} that are not the model's BatchNorm buffers")
        for name, value in values.items():
            array = np.asarray(value)
            if array.shape != live[name].shape or array.dtype.kind != live[name].dtype.kind or not np.isfinite(array).all():
                raise ValueError(f"statistics `{name}` must be a finite {live[name].dtype} array of shape {live[name].shape}")
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, value in values.items():
                buffers[name].copy_(torch.from_numpy(np.array(value, dtype=live[name].dtype)))

    def save(self, folder: str | os.PathLike[str]) -> None:
        from safetensors.numpy import save_file

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.parameters(), str(path / "parameters.safetensors"))
        state = {k: np.ascontiguousarray(v) for k, v in self.optimizer_state().items()}
        save_file(state, str(path / "optimizer.safetensors"))
