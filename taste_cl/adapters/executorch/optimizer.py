"""SGD and AdamW steps in numpy, as ``torch.optim.SGD`` and ``torch.optim.AdamW`` define them, for the ExecuTorch engine.

ExecuTorch 1.5 ships only an SGD object whose momentum nothing can read or restore, so the
engine (:mod:`.engine`) steps its program's parameters with these functions instead. The formulas
and their order are those of torch's single-tensor implementations (``_single_tensor_sgd``,
``_single_tensor_adam`` with decoupled weight decay), in float32, so a step follows torch's to
float rounding. The state is named arrays, as the standard-ONNX engine names them: ``step`` (a
float32 scalar, the steps taken) and ``momentum.<name>``, or ``exp_avg.<name>`` and
``exp_avg_sq.<name>``, each shaped like its parameter. Torch-free (numpy only).

>>> import numpy as np
>>> sgd = NumpyOptimizer("sgd", momentum=0.9)
>>> params = {"w": np.ones(2, np.float32)}
>>> state = sgd.initial_state({"w": (2,)})
>>> sgd.step(params, {"w": np.full(2, 0.5, np.float32)}, state, lr=0.1)
>>> params["w"].tolist(), float(state["step"])
([0.949999988079071, 0.949999988079071], 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from taste_cl.exceptions import ExportError

__all__ = ["KINDS", "NumpyOptimizer"]

KINDS = ("sgd", "adamw")


def _unit(name: str, value: Any, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name} == {value!r}`, must be a finite number")
    if not (0.0 < value < 1.0 if low_open else 0.0 <= value < 1.0):
        raise ValueError(f"`{name} == {value!r}`, must be in {'(0, 1)' if low_open else '[0, 1)'}")
    return float(value)


@dataclass(frozen=True)
class NumpyOptimizer:
    """One optimizer's settings (the learning rate is given to each :meth:`step`); every value is checked
    (``ValueError`` naming it): momentum, dampening and betas in [0, 1), weight decay and eps >= 0."""

    kind: str
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`kind == {self.kind!r}`, must be one of {KINDS}")
        _unit("momentum", self.momentum)
        _unit("dampening", self.dampening)
        for name, value in (("weight_decay", self.weight_decay), ("eps", self.eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"`{name} == {value!r}`, must be a finite number >= 0")
        if not isinstance(self.nesterov, bool) or (self.nesterov and (not self.momentum or self.dampening)):
            raise ValueError(f"`nesterov == {self.nesterov!r}`: Nesterov momentum needs momentum > 0 and no dampening (torch's rule)")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ValueError(f"`betas == {self.betas!r}`, must be two numbers")
        for i, beta in enumerate(self.betas):
            _unit(f"betas[{i}]", beta)

    @classmethod
    def from_torch(cls, optimizer: Any) -> NumpyOptimizer:
        """The settings of a ``torch.optim.SGD`` or ``torch.optim.AdamW`` with one parameter group;
        :class:`~taste_cl.exceptions.ExportError` for anything else (the engine steps only these two)."""
        name = type(optimizer).__name__
        groups = getattr(optimizer, "param_groups", [])
        if name not in ("SGD", "AdamW") or len(groups) != 1:
            raise ExportError(f"the ExecuTorch engine steps SGD or AdamW with one parameter group; got {name} with {len(groups)} groups")
        group = groups[0]
        if group.get("maximize") or group.get("amsgrad"):
            raise ExportError("the ExecuTorch engine's optimizer does not do maximize=True or amsgrad=True")
        if name == "SGD":
            return cls("sgd", float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"]), float(group["weight_decay"]))
        return cls("adamw", weight_decay=float(group["weight_decay"]), betas=tuple(float(b) for b in group["betas"]), eps=float(group["eps"]))  # type: ignore[arg-type]

    @classmethod
    def from_json(cls, value: Any) -> NumpyOptimizer:
        """Settings from :meth:`to_json`; ``ValueError`` naming the first bad one."""
        keys = {"kind", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps"}
        if not isinstance(value, Mapping) or set(value) != keys:
            raise ValueError(f"optimizer settings must be an object with exactly the keys {sorted(keys)}")
        betas = value["betas"]
        if not isinstance(betas, list) or len(betas) != 2:
            raise ValueError(f"`betas == {betas!r}`, must be a list of two numbers")
        return cls(**{**value, "betas": tuple(betas)})

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "betas": list(self.betas)}

    def state_names(self, name: str) -> tuple[str, ...]:
        """The state arrays kept for parameter ``name`` (each shaped like it)."""
        if self.kind == "adamw":
            return (f"exp_avg.{name}", f"exp_avg_sq.{name}")
        return (f"momentum.{name}",) if self.momentum else ()

    def state_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every state array's shape, ``step`` first, for parameters of ``shapes``."""
        return {"step": (), **{key: tuple(shape) for name, shape in shapes.items() for key in self.state_names(name)}}

    def initial_state(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The state before any step: ``step`` 0 and zeros."""
        return {key: np.zeros(shape, np.float32) for key, shape in self.state_shapes(shapes).items()}

    def torch_state(self, optimizer: Any, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The state a torch optimizer holds for ``params`` (name to its ``torch.nn.Parameter``), as this
        optimizer's arrays: what an export carries so that the device continues the torch run."""
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        state = self.initial_state(shapes)
        keys = {"momentum": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        for name, parameter in params.items():
            held = optimizer.state.get(parameter, {})
            for key in self.state_names(name):
                stored = held.get(keys[key.split(".", 1)[0]])
                if stored is not None:
                    state[key] = stored.detach().cpu().numpy().astype(np.float32).reshape(shapes[name])
            if "step" in held:
                state["step"] = np.asarray(float(held["step"]), np.float32)
            elif held.get("momentum_buffer") is not None and not state["step"]:
                state["step"] = np.ones((), np.float32)  # torch's SGD counts no steps: a held buffer means one was taken
        return state

    def step(
        self, params: MutableMapping[str, np.ndarray], grads: Mapping[str, np.ndarray], state: MutableMapping[str, np.ndarray], lr: float
    ) -> None:
        """One step at learning rate ``lr``: ``params`` and ``state`` are updated in place (their arrays are
        written, not replaced), ``grads`` are read only."""
        count = float(state["step"]) + 1.0
        for name, param in params.items():
            if self.kind == "sgd":
                self._sgd(name, param, grads[name], state, lr, first=count == 1.0)
            else:
                self._adamw(name, param, grads[name], state, lr, count)
        state["step"][...] = np.float32(count)

    def _sgd(self, name: str, param: np.ndarray, grad: np.ndarray, state: MutableMapping[str, np.ndarray], lr: float, *, first: bool) -> None:
        f32 = np.float32
        step = grad + param * f32(self.weight_decay) if self.weight_decay else grad
        if self.momentum:
            buffer = state[f"momentum.{name}"]
            if first:  # torch clones the first gradient into the buffer, undamped
                buffer[...] = step
            else:
                buffer *= f32(self.momentum)
                buffer += step * f32(1.0 - self.dampening) if self.dampening else step
            step = step + buffer * f32(self.momentum) if self.nesterov else buffer
        param -= step * f32(lr)

    def _adamw(self, name: str, param: np.ndarray, grad: np.ndarray, state: MutableMapping[str, np.ndarray], lr: float, count: float) -> None:
        f32 = np.float32
        beta1, beta2 = self.betas
        if self.weight_decay:
            param *= f32(1.0 - lr * self.weight_decay)
        avg, avg_sq = state[f"exp_avg.{name}"], state[f"exp_avg_sq.{name}"]
        avg += (grad - avg) * f32(1.0 - beta1)  # torch's lerp with a weight below 0.5
        avg_sq *= f32(beta2)
        avg_sq += grad * f32(1.0 - beta2) * grad
        step_size = lr / (1.0 - beta1**count)
        denom = np.sqrt(avg_sq) / f32(math.sqrt(1.0 - beta2**count)) + f32(self.eps)
        param -= (avg / denom) * f32(step_size)
