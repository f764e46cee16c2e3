"""Every fact an artifact folder states twice agrees: the manifest against the graphs, the graphs
against the checkpoint, the optimizer state against the parameters; read from bytes, before ONNX
Runtime loads anything (so no C++ error can surface from a mixed or edited folder)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    INFERENCE_MODEL,
    LOSS_NAME,
    OPTIMIZER_MODEL,
    TRAINING_MODEL,
    DeviceSpec,
    TensorSpec,
)
from taste_cl.adapters.onnxruntime.ort_checkpoint import CheckpointInfo
from taste_cl.adapters.onnxruntime.proto import Signature, ValueInfo

__all__ = ["ADAMW_OP", "TRAINING_OPS", "check_agreement"]

_GRAD_BUFFER, _GRAD_OUTPUT, _RESET_GRAD = "_grad.accumulation.buffer", "_grad.accumulation.out", "lazy_reset_grad"
_LOSS_OPS = ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad")
_NORM_OPS = ("BatchNormalization", "BatchNormInternal")  # inputs (x, scale, bias, mean, var), outputs (y, mean, var, ...)
TRAINING_OPS = (*_LOSS_OPS, *_NORM_OPS)
ADAMW_OP = "AdamWOptimizer"
_MOMENTS = {"adamw": ["momentum0", "momentum1"], "sgd": ["momentum0"]}  # ORT's optimizer state per parameter


def _dims(dims: Sequence[int | None] | None) -> str:
    if dims is None:
        return "[no shape]"
    return "[" + ", ".join("batch" if d is None and i == 0 else "?" if d is None else str(d) for i, d in enumerate(dims)) + "]"


def _check_tensor(value: ValueInfo, spec: TensorSpec, file: str, role: str) -> None:
    """The graph's tensor is the manifest's: same name and dtype, a free batch axis, every other axis equal or free."""
    dims = value.dims
    if (
        value.name != spec.name
        or value.dtype != spec.dtype
        or dims is None
        or len(dims) != len(spec.shape) + 1
        or dims[0] is not None
        or any(d is not None and d != s for d, s in zip(dims[1:], spec.shape))
    ):
        renamed = f"{spec.name!r} " if spec.name != value.name else ""
        raise ArtifactError(
            f"{file}: {role} {value.name!r} is {value.dtype} {_dims(dims)}; the manifest says {renamed}{spec.dtype} {_dims((None, *spec.shape))}"
        )


def _check_inputs(graph: Signature, file: str, expected: Sequence[TensorSpec]) -> tuple[ValueInfo, ...]:
    """The graph's first inputs are ``expected``; returns the inputs after them (parameters and buffers)."""
    if len(graph.inputs) < len(expected):
        raise ArtifactError(f"{file} takes {len(graph.inputs)} inputs; the manifest describes {len(expected)} before the parameters")
    for value, spec in zip(graph.inputs, expected):
        _check_tensor(value, spec, file, "input")
    return graph.inputs[len(expected) :]


def _check_outputs(graph: Signature, file: str, spec: DeviceSpec, info: CheckpointInfo, *, training: bool, loss: bool = True) -> None:
    """Loss (scalar), the model output, then (training) each running statistic, shaped like its parameter."""
    outputs = [value for value in graph.outputs if not value.name.endswith(_GRAD_OUTPUT)]
    stats = spec.running_stats if training else ()
    expected = [*([LOSS_NAME] if loss else []), spec.output.name, *(stat.output for stat in stats)]
    if [value.name for value in outputs] != expected:
        raise ArtifactError(f"{file} outputs {[value.name for value in outputs]}; the manifest describes {expected}")
    if loss and (outputs[0].dtype != "float32" or outputs[0].dims != ()):
        raise ArtifactError(f"{file}: the loss is {outputs[0].dtype} {_dims(outputs[0].dims)}, must be a float32 scalar")
    _check_tensor(outputs[int(loss)], spec.output, file, "output")
    for value, stat in zip(outputs[int(loss) + 1 :], stats):
        held = info.frozen.get(stat.parameter)
        if held is None:  # the device overwrites it after each step: a trained parameter would lose its update
            raise ArtifactError(
                f"{file}: running statistic {value.name!r} would overwrite {stat.parameter!r}, not a frozen parameter of the checkpoint"
            )
        dims = value.dims
        if value.dtype != held.dtype or dims is None or len(dims) != len(held.dims) or any(d not in (None, h) for d, h in zip(dims, held.dims)):
            raise ArtifactError(f"{file}: running statistic {value.name!r} is {value.dtype} {dims}; {stat.parameter!r} is {held.describe()}")


def _check_parameters(file: str, params: Sequence[ValueInfo], info: CheckpointInfo) -> None:
    """The graph takes exactly the checkpoint's parameters, each with its dtype and dims."""
    held = info.parameters
    taken = {value.name: value for value in params}
    if taken.keys() != held.keys():
        raise ArtifactError(
            f"the checkpoint holds parameters {sorted(held.keys() - taken.keys())} that {file} does not take, "
            f"and lacks {sorted(taken.keys() - held.keys())} that it takes"
        )
    for value in params:
        tensor = held[value.name]
        if value.dtype != tensor.dtype or value.dims != tensor.dims:
            raise ArtifactError(f"checkpoint parameter {value.name!r} is {tensor.describe()}; {file} takes {value.dtype} {value.dims}")


def _check_running_stats(graph: Signature, spec: DeviceSpec) -> None:
    """Each running statistic is the BatchNorm output the manifest says: of that parameter, kind and momentum."""
    writers = {node.outputs[i]: (node, i) for node in graph.nodes if node.op_type in _NORM_OPS for i in (1, 2) if len(node.outputs) > i}
    for stat in spec.running_stats:
        if stat.output not in writers or len(writers[stat.output][0].inputs) < 5:
            raise ArtifactError(f"{TRAINING_MODEL}: no BatchNormalization outputs the running statistic {stat.output!r}")
        node, index = writers[stat.output]
        kind, parameter = ("mean", "var")[index - 1], node.inputs[index + 2]
        momentum = 1.0 - float(node.attributes.get("momentum", 0.9))  # ONNX keeps the old value's share: 1 - PyTorch's
        if (kind, parameter) != (stat.stat, stat.parameter) or abs(momentum - stat.momentum) > 1e-6:
            raise ArtifactError(
                f"{TRAINING_MODEL}: {stat.output!r} is the running {kind} of {parameter!r} with momentum {momentum:.6g}; "
                f"the manifest says the running {stat.stat} of {stat.parameter!r} with momentum {stat.momentum:.6g}"
            )


def _check_training_graph(graph: Signature, spec: DeviceSpec, info: CheckpointInfo) -> None:
    rest = _check_inputs(graph, TRAINING_MODEL, [*spec.inputs, spec.labels])
    _check_outputs(graph, TRAINING_MODEL, spec, info, training=True)
    _check_running_stats(graph, spec)
    if spec.ignore_index is not None:  # the device lets ignore_index labels through: the loss must ignore them
        losses = [node for node in graph.nodes if node.op_type in _LOSS_OPS]
        if not losses:
            raise ArtifactError(f"{TRAINING_MODEL} has no {_LOSS_OPS[0]}, so the manifest's ignore_index {spec.ignore_index} cannot hold")
        for node in losses:
            ignored = node.attributes.get("ignore_index")
            if ignored != spec.ignore_index:
                raise ArtifactError(f"{TRAINING_MODEL}: {node.op_type} has ignore_index {ignored}; the manifest says {spec.ignore_index}")
    trained = sorted(value.name.removesuffix(_GRAD_BUFFER) for value in rest if value.name.endswith(_GRAD_BUFFER))
    if trained != sorted(spec.trainable):
        raise ArtifactError(f"{TRAINING_MODEL} trains {trained}; the manifest's trainable lists {sorted(spec.trainable)}")
    _check_parameters(TRAINING_MODEL, [v for v in rest if not v.name.endswith(_GRAD_BUFFER) and v.name != _RESET_GRAD], info)


def _check_inference_graph(graph: Signature, spec: DeviceSpec, info: CheckpointInfo) -> None:
    extra = _check_inputs(graph, INFERENCE_MODEL, spec.inputs)
    if len(extra) > 1:
        raise ArtifactError(f"{INFERENCE_MODEL} takes inputs {[value.name for value in extra]} the manifest does not describe")
    if extra:  # a regression export's logits are broadcast to the labels' shape (the loss's expand), so it keeps them
        _check_tensor(extra[0], spec.labels, INFERENCE_MODEL, "input")
    _check_outputs(graph, INFERENCE_MODEL, spec, info, training=False, loss=False)
    held = info.parameters
    for value in graph.initializers:
        tensor = held.get(value.name)
        if tensor is not None and (value.dtype, value.dims) != (tensor.dtype, tensor.dims):
            raise ArtifactError(f"{INFERENCE_MODEL} holds {value.name!r} as {value.dtype} {value.dims}; the checkpoint's is {tensor.describe()}")


def _check_adamw_graph(graph: Signature, config: Mapping[str, Any]) -> None:
    """The AdamW node's attributes are the manifest's hyper-parameters (in float32) and PyTorch's update rule."""
    nodes = [node for node in graph.nodes if node.op_type == ADAMW_OP]
    if len(nodes) != 1:
        raise ArtifactError(f"{OPTIMIZER_MODEL} has {len(nodes)} {ADAMW_OP} nodes, must have one")
    expected = {"alpha": config["betas"][0], "beta": config["betas"][1], "epsilon": config["eps"],
                "weight_decay": config["weight_decay"], "adam_mode": 0, "correct_bias": 1}  # fmt: skip
    for key, want in expected.items():
        got = nodes[0].attributes.get(key)
        if got is None or np.float32(got) != np.float32(want):
            shown = "absent" if got is None else f"{got:.7g}"
            raise ArtifactError(f"{OPTIMIZER_MODEL}: AdamW {key} is {shown}; the manifest's optimizer gives {want:.7g}")


def _check_checkpoint(spec: DeviceSpec, info: CheckpointInfo) -> None:
    """The checkpoint trains the manifest's parameters and holds optimizer state shaped like them."""
    if sorted(info.trainable) != sorted(spec.trainable):
        raise ArtifactError(f"the checkpoint trains {sorted(info.trainable)}; the manifest's trainable lists {sorted(spec.trainable)}")
    unknown = sorted(set(spec.param_names) - set(info.parameters))
    if unknown:
        raise ArtifactError(f"the manifest's param_names name {unknown[:5]}, not in the checkpoint")
    kind = spec.optimizer["type"]
    for param in sorted(info.optimizer):
        moments = info.optimizer[param]
        if param not in info.trainable:
            raise ArtifactError(f"{CHECKPOINT}: optimizer state of {param!r}, which it does not train")
        if sorted(moments) != _MOMENTS[kind]:
            raise ArtifactError(f"{CHECKPOINT}: optimizer state of {param!r} holds {sorted(moments)}; {kind} keeps {_MOMENTS[kind]}")
        held = info.trainable[param]
        for moment, tensor in sorted(moments.items()):
            if (tensor.dtype, tensor.dims) != (held.dtype, held.dims):
                label = "AdamW" if kind == "adamw" else "SGD"
                raise ArtifactError(f"{CHECKPOINT}: {label} {moment} of {param!r} is {tensor.describe()}; the parameter is {held.describe()}")
    missing = sorted(set(spec.trainable) - set(info.optimizer))
    if kind == "adamw" and missing:  # ORT would start these moments at zero, silently
        raise ArtifactError(f"{CHECKPOINT} has no AdamW state for {missing[:5]}")


def check_agreement(spec: DeviceSpec, graphs: Mapping[str, Signature], info: CheckpointInfo) -> None:
    """Every fact stated twice agrees: the manifest against the graphs, the graphs against the
    checkpoint, the optimizer state against the parameters. :class:`ArtifactError` names the first
    disagreement; nothing here needs ONNX Runtime."""
    _check_training_graph(graphs[TRAINING_MODEL], spec, info)
    evaluation = graphs[EVAL_MODEL]
    params = _check_inputs(evaluation, EVAL_MODEL, [*spec.inputs, spec.labels])
    _check_outputs(evaluation, EVAL_MODEL, spec, info, training=False)
    _check_parameters(EVAL_MODEL, params, info)
    if INFERENCE_MODEL in graphs:
        _check_inference_graph(graphs[INFERENCE_MODEL], spec, info)
    if OPTIMIZER_MODEL in graphs:
        _check_adamw_graph(graphs[OPTIMIZER_MODEL], spec.optimizer)
    _check_checkpoint(spec, info)
