"""The optimizer step as a small standard ONNX graph: SGD (momentum, Nesterov, weight decay) and AdamW.

The graph takes ``lr`` and ``step`` (float32 scalars: the learning rate, and how many steps ran
before), then for each trainable tensor ``param.<name>``, ``grad.<name>`` and its state
(``momentum.<name>``, or ``exp_avg.<name>`` and ``exp_avg_sq.<name>``), and returns ``new.`` each
of them and ``new.step``. The formulas are those of torch's single-tensor implementations, so an
engine stepping with it follows ``torch.optim.SGD`` / ``torch.optim.AdamW``. Any ONNX Runtime
binding can run it; nothing here needs torch.

>>> spec = OptimizerSpec.from_torch_name("sgd", momentum=0.9)
>>> graph = build_optimizer_graph(spec, {"w": (3, 2)})
>>> sorted(i.name for i in graph.graph.input)
['grad.w', 'lr', 'momentum.w', 'param.w', 'step']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from taste_cl.exceptions import ExportError

__all__ = ["IR_VERSION", "MIN_ONNXRUNTIME", "OPSET", "OptimizerSpec", "build_optimizer_graph", "state_names"]

OPSET = 18
IR_VERSION = 10  # ONNX Runtime reads IR 10 from 1.18 on (1.17: IR <= 9)
# The oldest plain onnxruntime the engine's folders train on, tested (the `[onnx]` extra's floor): 1.18.0 reads
# these graphs but its wheels are built against numpy 1 while declaring no numpy < 2 (beside numpy 2 it fails at
# import); 1.18.1 declares numpy < 2; 1.19 and later run on numpy 2. tests/test_onnx_install.py checks it.
MIN_ONNXRUNTIME = "1.18.1"


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyperparameters (the learning rate is an input of every step)."""

    kind: str
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def from_torch_name(cls, kind: str, **settings: Any) -> OptimizerSpec:
        if kind not in ("sgd", "adamw"):
            raise ExportError(f"`optimizer == {kind!r}`, must be 'sgd' or 'adamw' (or a torch.optim.SGD / AdamW instance)")
        return cls(kind=kind, lr=float(settings.pop("lr", 0.01)), **settings)

    @classmethod
    def from_torch(cls, optimizer: Any) -> OptimizerSpec:
        """The spec of a ``torch.optim.SGD`` or ``torch.optim.AdamW`` (one parameter group)."""
        name = type(optimizer).__name__
        if name not in ("SGD", "AdamW") or len(optimizer.param_groups) != 1:
            raise ExportError(f"the ONNX engine steps SGD and AdamW with one parameter group; got {name} with {len(optimizer.param_groups)} groups")
        group = optimizer.param_groups[0]
        if group.get("maximize") or group.get("amsgrad"):
            raise ExportError("the ONNX engine's optimizer graph does not do maximize=True or amsgrad=True")
        if name == "SGD":
            return cls(
                "sgd", float(group["lr"]), float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"]), float(group["weight_decay"])
            )
        return cls("adamw", float(group["lr"]), weight_decay=float(group["weight_decay"]), betas=tuple(group["betas"]), eps=float(group["eps"]))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "betas": list(self.betas)}


def state_names(spec: OptimizerSpec, name: str) -> list[str]:
    """The state tensors the optimizer keeps for trainable tensor ``name`` (each shaped like it)."""
    if spec.kind == "adamw":
        return [f"exp_avg.{name}", f"exp_avg_sq.{name}"]
    return [f"momentum.{name}"] if spec.momentum else []


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, value: float) -> str:
        name = f"c{len(self.initializers)}"
        self.initializers.append(helper.make_tensor(name, TensorProto.FLOAT, [], [value]))
        return name

    def op(self, kind: str, *inputs: str, out: str | None = None) -> str:
        self.count += 1
        name = out or f"t{self.count}"
        self.nodes.append(helper.make_node(kind, list(inputs), [name]))
        return name


def _sgd(b: _Builder, spec: OptimizerSpec, name: str, first: str) -> None:
    param, grad = f"param.{name}", f"grad.{name}"
    if spec.weight_decay:
        grad = b.op("Add", grad, b.op("Mul", param, b.const(spec.weight_decay)))
    if spec.momentum:
        state = f"momentum.{name}"
        running = b.op("Add", b.op("Mul", state, b.const(spec.momentum)), b.op("Mul", grad, b.const(1.0 - spec.dampening)))
        buffer = b.op("Where", first, grad, running, out=f"new.{state}")
        grad = b.op("Add", grad, b.op("Mul", buffer, b.const(spec.momentum))) if spec.nesterov else buffer
    b.op("Sub", param, b.op("Mul", grad, "lr"), out=f"new.param.{name}")


def _adamw(b: _Builder, spec: OptimizerSpec, name: str, scalars: Mapping[str, str]) -> None:
    param, grad = f"param.{name}", f"grad.{name}"
    avg, avg_sq = f"exp_avg.{name}", f"exp_avg_sq.{name}"
    decayed = b.op("Mul", param, scalars["decay"]) if spec.weight_decay else param
    new_avg = b.op("Add", avg, b.op("Mul", b.op("Sub", grad, avg), b.const(1.0 - spec.betas[0])), out=f"new.{avg}")
    new_sq = b.op(
        "Add", b.op("Mul", avg_sq, b.const(spec.betas[1])), b.op("Mul", b.op("Mul", grad, grad), b.const(1.0 - spec.betas[1])), out=f"new.{avg_sq}"
    )
    denom = b.op("Add", b.op("Div", b.op("Sqrt", new_sq), scalars["bc2_sqrt"]), b.const(spec.eps))
    b.op("Sub", decayed, b.op("Mul", b.op("Div", new_avg, denom), scalars["step_size"]), out=f"new.param.{name}")


def build_optimizer_graph(spec: OptimizerSpec, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """The ONNX graph of one step of ``spec`` over trainable tensors ``shapes`` (name to shape)."""
    b = _Builder()
    b.op("Add", "step", b.const(1.0), out="new.step")
    inputs = [helper.make_tensor_value_info("lr", TensorProto.FLOAT, []), helper.make_tensor_value_info("step", TensorProto.FLOAT, [])]
    outputs = [helper.make_tensor_value_info("new.step", TensorProto.FLOAT, [])]
    scalars: dict[str, str] = {}
    first = ""
    if spec.kind == "sgd" and spec.momentum:
        first = b.op("Equal", "step", b.const(0.0))
    if spec.kind == "adamw":
        scalars["decay"] = b.op("Sub", b.const(1.0), b.op("Mul", "lr", b.const(spec.weight_decay)))
        bc1 = b.op("Sub", b.const(1.0), b.op("Pow", b.const(spec.betas[0]), "new.step"))
        scalars["step_size"] = b.op("Div", "lr", bc1)
        scalars["bc2_sqrt"] = b.op("Sqrt", b.op("Sub", b.const(1.0), b.op("Pow", b.const(spec.betas[1]), "new.step")))
    for name, shape in shapes.items():
        tensors = [f"param.{name}", f"grad.{name}", *state_names(spec, name)]
        inputs += [helper.make_tensor_value_info(t, TensorProto.FLOAT, list(shape)) for t in tensors]
        outputs += [helper.make_tensor_value_info(f"new.{t}", TensorProto.FLOAT, list(shape)) for t in tensors if not t.startswith("grad.")]
        if spec.kind == "sgd":
            _sgd(b, spec, name, first)
        else:
            _adamw(b, spec, name, scalars)
    graph = helper.make_graph(b.nodes, f"{spec.kind}_step", inputs, outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="taste_cl")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model
