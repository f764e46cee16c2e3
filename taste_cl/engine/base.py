"""The engine interface: what a runtime must do for the learner's loop, in numpy.

The loop (replay draws, the strategy's loss, clipping, the guards, the monitor) is the same
on every runtime; an *engine* is what differs. It runs the model forward, turns the gradient
of the loss with respect to the outputs into parameter gradients (a vector-Jacobian
product), applies its optimizer, and reads and writes its parameters and optimizer state.
Every loss is then written once, in the loop, in numpy (:mod:`taste_cl.engine.losses`), for
every engine alike: torch eager (:class:`taste_cl.engine.torch_engine.TorchEngine`), ONNX
Runtime (:class:`taste_cl.adapters.onnx_engine.engine.OnnxEngine`), and whatever comes next.

This module imports neither torch nor a runtime. :func:`taste_cl.testing.check_engine` is the
contract check an engine must pass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["AdaptableEngine", "Engine", "Inputs"]

Inputs = np.ndarray | Mapping[str, np.ndarray]


@runtime_checkable
class Engine(Protocol):
    """A model on a runtime, trained by the learner's loop.

    - :meth:`forward` returns the outputs; with ``train=True`` it keeps what :meth:`backward`
      needs (the activations, once), and the model runs in training mode.
    - :meth:`backward` takes ``dLoss/dOutputs`` for the last training forward and returns the
      gradients of the :attr:`trainable` tensors, by name, without applying them.
    - :meth:`step` applies gradients with the engine's optimizer at learning rate ``lr``.
    - :meth:`parameters` / :meth:`load_parameters` and :meth:`optimizer_state` /
      :meth:`load_optimizer_state` copy state out and in (copies, never views of live
      buffers), so the loop can save, roll back and resume; a loaded state continues
      bit for bit.
    - :meth:`save` writes what is needed to load the engine again into ``folder``.
    """

    trainable: tuple[str, ...]

    def forward(self, x: Inputs, *, train: bool) -> np.ndarray: ...

    def backward(self, grad_outputs: np.ndarray) -> dict[str, np.ndarray]: ...

    def step(self, gradients: Mapping[str, np.ndarray], lr: float) -> None: ...

    def parameters(self) -> dict[str, np.ndarray]: ...

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None: ...

    def optimizer_state(self) -> dict[str, np.ndarray]: ...

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None: ...

    def save(self, folder: str | os.PathLike[str]) -> None: ...


@runtime_checkable
class AdaptableEngine(Engine, Protocol):
    """An engine whose BatchNorm layers can run on the batch's statistics: what test-time adaptation
    (:class:`taste_cl.engine.adapt.EngineAdapter`) needs besides :class:`Engine`.

    - :meth:`forward_batch_statistics` is :meth:`Engine.forward` with BatchNorm normalising with the batch's
      own statistics (the rest of the model in eval mode), after which the running statistics have
      followed them as torch's train-mode BatchNorm does; ``train=True`` keeps what :meth:`Engine.backward` needs.
    - :meth:`norm_statistics` / :meth:`load_norm_statistics` copy the running means, variances and batch
      counts out and in by buffer name (``<layer>.running_mean``, ``<layer>.running_var``,
      ``<layer>.num_batches_tracked``); :meth:`Engine.forward` uses the loaded ones.
    """

    def forward_batch_statistics(self, x: Inputs, *, train: bool) -> np.ndarray: ...

    def norm_statistics(self) -> dict[str, np.ndarray]: ...

    def load_norm_statistics(self, values: Mapping[str, np.ndarray]) -> None: ...
