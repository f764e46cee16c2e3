"""Artifact generation: a PyTorch model, loss and optimizer -> ONNX Runtime training artifacts, gated by parity.

:func:`export_model` works on a float32 copy of the model (and of the optimizer, state
included), applies the export transforms (:mod:`.transforms`), traces model + loss
into one ONNX graph (outputs ``loss`` and ``logits``; inputs named after the example's
structure, dtypes kept), folds each frozen BatchNorm into the convolution before it
(:mod:`.fold`), builds the training/eval/optimizer graphs with ONNX Runtime,
refuses a training graph holding a gradient kernel known to kill the process
(:data:`CRASHING_GRADIENTS`), tries the graphs first in a child process (:mod:`.trial`:
a crash there is a refusal, not the end of this process), writes the optimizer state
(AdamW moments and step into the ORT checkpoint, SGD momentum buffers beside it), the
replay rows converted to the exported dtypes, and a manifest. Before the staged folder is
published, the parity gate trains a few steps in torch and in the device runtime from
identical weights and refuses to publish if they differ, or if torch's own training diverges
within :data:`~taste_cl.adapters.device.parity.WATCH_STEPS` steps.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl import __version__
from taste_cl._batch import call_model, check_call
from taste_cl.adapters.device.artifacts import PARITY_ROWS, ExportError, staged_folder, write_manifest
from taste_cl.adapters.device.embeddings import index_bounds
from taste_cl.adapters.device.learner_data import BufferedRows, task_targets
from taste_cl.adapters.device.parity import (
    ParityReport,
    TorchTrainer,
    check_parity,
    default_tolerance,
)
from taste_cl.adapters.device.trainable import freeze_untrained, trained_parameters
from taste_cl.adapters.device.transforms import FrozenBatchNorm
from taste_cl.adapters.onnxruntime.batches import features
from taste_cl.adapters.onnxruntime.fold import fold_frozen_batchnorm
from taste_cl.adapters.onnxruntime.losses import traceable_loss
from taste_cl.adapters.onnxruntime.manifest import (
    ARTIFACT_FORMAT,
    CHECKPOINT,
    EVAL_MODEL,
    LABEL_NAME,
    LOSS_NAME,
    OPTIMIZER_MODEL,
    OUTPUT_NAME,
    REPLAY_FILE,
    TRAINING_MODEL,
    DeviceSpec,
    TensorSpec,
    parse_manifest,
)
from taste_cl.adapters.onnxruntime.runtime import load
from taste_cl.adapters.onnxruntime.session import OrtSession
from taste_cl.adapters.onnxruntime.transforms import (
    apply_transforms,
    check_equivalent,
    disable_random_layers,
    eval_outputs,
)
from taste_cl.adapters.onnxruntime.trial import TrialFailure, trial_run
from taste_cl.adapters.web.compat import add_web_artifacts
from taste_cl.exceptions import MissingDependencyError, UnsupportedOperatorError
from taste_cl.tasks import Task, infer_task, resolve_task

__all__ = ["CRASHING_GRADIENTS", "NON_DIFFERENTIABLE_OPS", "ReplayRows", "UnsupportedOperatorError", "export_model"]

# ops ONNX Runtime 1.19 has no gradient for, as the exporter may emit them (checked on this release)
NON_DIFFERENTIABLE_OPS = frozenset({"HardSwish", "HardSigmoid", "Einsum", "LayerNormalization"})
# gradient kernels of ONNX Runtime 1.19 that kill the process (no exception) on these graphs: kernel -> (op, why)
CRASHING_GRADIENTS = {
    "AveragePoolGrad": (
        "AveragePool",
        "ONNX Runtime 1.19's AveragePoolGrad takes its output shape from the graph, where the batch axis is dynamic, "
        "and kills the process (SIGFPE) on the first training step; nn.AvgPool*d and nn.AdaptiveAvgPool*d modules "
        "are rewritten into a trainable form, so pool with a module instead of F.avg_pool*d",
    ),
}
_PREFIX = "model."  # the traced wrapper holds the model as its `model` attribute
_INFO_LINE = re.compile(rb"\[[IV]:onnxruntime:")


ReplayRows = BufferedRows  # replay samples to ship: ``x`` shaped like the model input (batch first), targets ``y``


def _ort() -> Any:
    # onnxruntime.training imports torch.utils.cpp_extension, which warns "No CUDA runtime is
    # found" on every CPU machine: a line about torch's build, not about this export
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension.level
    cpp_extension.setLevel(logging.ERROR)
    try:
        import onnx  # noqa: F401
        import onnxruntime
        from onnxruntime.training import artifacts  # noqa: F401
    except ImportError as error:
        missing = "onnx" if (error.name or "").split(".")[0] == "onnx" else "onnxruntime-training-cpu"
        raise MissingDependencyError(missing, "onnx-training") from error
    finally:
        cpp_extension.setLevel(level)
    onnxruntime.set_default_logger_severity(3)  # artifact generation logs every graph pass at INFO
    return onnxruntime


@contextlib.contextmanager
def _native_info_silenced() -> Iterator[None]:
    """Drop ONNX Runtime's native INFO/VERBOSE lines from stderr; pass every other line through.

    ORT's gradient builder logs each graph pass at INFO through a logger that ignores
    ``set_default_logger_severity``, so file descriptor 2 is captured around it.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().splitlines(keepends=True) if not _INFO_LINE.search(line)]
            if kept:
                os.write(2, b"".join(kept))


# ------------------------------------------------------------------ structure
def _leaves(x: Any) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    if isinstance(x, torch.Tensor):
        return "tensor", [("input", x)]
    if isinstance(x, Mapping):
        return "dict", [(str(key), value) for key, value in x.items()]
    if isinstance(x, (list, tuple)):
        return "sequence", [(f"input_{i}", value) for i, value in enumerate(x)]
    raise ExportError(f"example x must be a tensor, a dict or a list/tuple of tensors; got {type(x).__name__}")


def _check_flat(leaves: list[tuple[str, Any]]) -> None:
    """The device runtime feeds one graph input per leaf: nested structures are refused by name."""
    nested = [name for name, value in leaves if not isinstance(value, torch.Tensor)]
    if nested:
        raise ExportError(
            f"x[{nested[0]!r}] is a {type(dict(leaves)[nested[0]]).__name__}, not a tensor: the device runtime takes a "
            "tensor or a flat dict/tuple/list of tensors (flatten nested inputs in a wrapper module)"
        )


def _rebuild(structure: str, names: Sequence[str], tensors: Sequence[Any]) -> Any:
    if structure == "tensor":
        return tensors[0]
    if structure == "dict":
        return dict(zip(names, tensors))
    return tuple(tensors)


def _export_dtype(tensor: torch.Tensor, what: str) -> torch.dtype:
    if tensor.is_floating_point():
        return torch.float32
    if tensor.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return torch.int64
    if tensor.dtype == torch.bool:
        return torch.bool
    raise ExportError(f"{what} has dtype {tensor.dtype}, which the device runtime does not take")


def _spec(name: str, dtype: torch.dtype, example: torch.Tensor, bound: int | None = None) -> dict[str, Any]:
    return TensorSpec(name, str(dtype).removeprefix("torch."), tuple(example.shape[1:]), bound).as_json()


def _as_numpy(value: Any, dtype: torch.dtype) -> np.ndarray:
    return torch.as_tensor(value).detach().cpu().to(dtype).numpy()


class _Graph(nn.Module):
    """Model + loss as one traced module: ``(*inputs, labels) -> (loss, outputs)``; the inputs are rebuilt
    into the example's structure and passed to the model as ``call`` says (:func:`~taste_cl._batch.call_model`).

    The loss gets an alias of the outputs: an op inside it that returns its input object
    (``broadcast_tensors`` of equal shapes, as ``F.mse_loss`` calls it) would otherwise become
    the traced ``outputs``, and the inference model would then demand the labels.
    """

    def __init__(self, model: nn.Module, loss: Callable[[Any, Any], Any], structure: str, names: list[str], call: str) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.structure, self.names, self.call = structure, names, call

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *inputs, labels = tensors
        out = call_model(self.model, _rebuild(self.structure, self.names, inputs), call=self.call)
        return self.loss(out.view_as(out), labels), out


# ----------------------------------------------------------------- optimizer
def _optimizer_config(optimizer: torch.optim.Optimizer, lr: float | None) -> dict[str, Any]:
    groups = optimizer.param_groups
    keys = sorted(set(groups[0]) - {"params", "initial_lr"})
    for group in groups[1:]:
        differing = [key for key in keys if group.get(key) != groups[0].get(key)]
        if differing:
            raise ExportError(f"optimizer param groups differ in {differing}; the device has one setting per optimizer")
    group = groups[0]
    for flag in ("maximize", "amsgrad"):
        if group.get(flag):
            raise ExportError(f"optimizer has {flag}=True, which the device optimizer does not do")
    rate = float(group["lr"]) if lr is None else lr
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"`lr == {rate!r}`, must be a finite number > 0")
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return {"type": "sgd", "lr": float(rate), "momentum": float(group["momentum"]),
                "dampening": float(group["dampening"]), "weight_decay": float(group["weight_decay"]),
                "nesterov": bool(group["nesterov"])}  # fmt: skip
    if kind is torch.optim.AdamW or (kind is torch.optim.Adam and not group["weight_decay"]):
        return {"type": "adamw", "lr": float(rate), "betas": [float(b) for b in group["betas"]],
                "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}  # fmt: skip
    raise ExportError(f"optimizer {kind.__name__} cannot run on the device; use SGD, AdamW or Adam without weight decay")


def _adamw_block(config: dict[str, Any]) -> Any:
    from onnxruntime.training import onnxblock

    return onnxblock.optim.AdamW(betas=tuple(config["betas"]), eps=config["eps"], weight_decay=config["weight_decay"])


def _torch_mode_adamw(path: Path) -> None:
    """Switch ORT's AdamW node to PyTorch's update rule (``adam_mode=0``; onnxblock writes Hugging Face's)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0
    onnx.save(model, str(path))


def _write_adamw_state(folder: Path, spec: DeviceSpec, state: dict[str, dict[str, torch.Tensor]], example: Any) -> None:
    """Put PyTorch's AdamW moments and step into the ORT checkpoint.

    ORT has no setter for optimizer state, so one step with learning rate 0 (which leaves
    the weights as they are) makes ORT write a checkpoint holding the step and both moments
    of every parameter; those bytes are then overwritten in place with PyTorch's values.
    """
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import Checkpoint

    session = OrtSession(folder, spec)
    session.save_after_zero_step(folder / CHECKPOINT, *example)
    del session
    data = bytearray((folder / CHECKPOINT).read_bytes())
    root = Checkpoint.Checkpoint.GetRootAs(data, 0)
    steps = {int(s["step"]) for s in state.values()}
    if len(steps) != 1:
        raise ExportError(f"AdamW parameters are at different steps {sorted(steps)}; the device keeps one step count")
    (step,) = steps
    for g in range(root.OptimizerGroupsLength()):
        group = root.OptimizerGroups(g)
        offset = group._tab.Offset(6)
        if not offset:
            raise ExportError("ORT's checkpoint has no step field to set")
        np.frombuffer(data, np.int64, 1, group._tab.Pos + offset)[...] = step
        for p in range(group.OptimizerStatesLength()):
            entry = group.OptimizerStates(p)
            name = spec.param_names[entry.ParamName().decode()]
            for m in range(entry.MomentumsLength()):
                tensor = entry.Momentums(m)
                key = {b"momentum0": "exp_avg", b"momentum1": "exp_avg_sq"}[tensor.Name()]
                raw = tensor._tab.Offset(12)
                start = tensor._tab.Vector(raw)
                value = state[name][key].detach().cpu().float().numpy().tobytes()
                if len(value) != tensor._tab.VectorLen(raw):
                    raise ExportError(f"AdamW state of {name!r} does not match the parameter's size")
                data[start : start + len(value)] = value
    (folder / CHECKPOINT).write_bytes(bytes(data))


# --------------------------------------------------------------------- graphs
def module_path(node_name: str, modules: Sequence[str] = ()) -> str:
    """The module path in a legacy-exporter node name (``/model/features/features.0/Conv`` -> ``features.0``).

    Scopes of containers already carry their parent's name (``features.0``), attributes do not.
    """
    parts: list[str] = []
    for scope in [part for part in node_name.split("/") if part][:-1]:  # the op's own name is last
        if parts and scope.startswith(parts[-1] + "."):
            parts[-1] = scope
        else:
            parts.append(scope)
    path = ".".join(parts)
    path = path.removeprefix(_PREFIX) if path.startswith(_PREFIX) else "<model>"
    # a module called directly through an uncalled parent is scoped by its own name only
    matches = [name for name in modules if name == path or name.endswith("." + path)]
    return matches[0] if len(matches) == 1 else path


def _module_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def _trace(graph_module: _Graph, tensors: list[torch.Tensor], names: list[str], opset: int) -> Any:
    """Trace model + loss in training mode with every batch axis dynamic; refuse ops without a gradient."""
    import onnx

    modules = _module_names(graph_module.model)
    buffer = io.BytesIO()
    axes = {name: {0: "batch"} for name in [*names, LABEL_NAME, OUTPUT_NAME]}
    with warnings.catch_warnings():  # the legacy exporter (what ORT 1.19 training takes) warns on every call
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                graph_module,
                tuple(tensors),
                buffer,  # type: ignore[arg-type]
                input_names=[*names, LABEL_NAME],
                output_names=[LOSS_NAME, OUTPUT_NAME],
                dynamic_axes=axes,
                opset_version=opset,
                do_constant_folding=False,
                training=torch.onnx.TrainingMode.TRAINING,
                export_params=True,
                dynamo=False,
            )
        except Exception as error:  # the exporter raises many kinds; keep its first line, chain the rest
            first = (str(error).strip().splitlines() or [repr(error)])[0][:400]
            raise ExportError(f"torch.onnx.export could not trace the model: {first}") from error
    model = onnx.load_from_string(buffer.getvalue())
    for node in model.graph.node:
        if node.op_type in NON_DIFFERENTIABLE_OPS:
            raise UnsupportedOperatorError(node.op_type, module_path(node.name, modules))
    _complete_outputs(model)
    return model


def _set_initializers(graph: Any, state: dict[str, torch.Tensor]) -> None:
    """Overwrite the graph's copies of the model's parameters and buffers with ``state``."""
    from onnx import numpy_helper

    for i, init in enumerate(graph.graph.initializer):
        key = init.name.removeprefix(_PREFIX)
        if init.name.startswith(_PREFIX) and key in state:
            graph.graph.initializer[i].CopyFrom(numpy_helper.from_array(state[key].numpy(), init.name))


def _complete_outputs(model: Any) -> None:
    """Give Dropout a training-mode input and a mask, MaxPool its indices, cross-entropy its log_prob: ORT's gradients read them.

    The exporter writes attention dropout (inside ``scaled_dot_product_attention``) without
    them, which would make it a no-op in training and break the gradient builder.
    """
    import onnx

    flag = "taste_cl_dropout_training"
    for i, node in enumerate(model.graph.node):
        if node.op_type == "MaxPool" and len(node.output) == 1:  # MaxPool's gradient reads the indices
            node.output.append(f"taste_cl_maxpool_indices_{i}")
        if node.op_type == "SoftmaxCrossEntropyLoss" and len(node.output) == 1:  # its gradient reads log_prob
            node.output.append(f"taste_cl_log_prob_{i}")
        if node.op_type != "Dropout":
            continue
        if len(node.input) == 2:
            node.input.append(flag)
        if len(node.output) == 1:
            node.output.append(f"taste_cl_dropout_mask_{i}")
    if any(flag in node.input for node in model.graph.node):
        model.graph.initializer.append(onnx.helper.make_tensor(flag, onnx.TensorProto.BOOL, [], [True]))


def _gradient_failure(error: Exception, graph: Any) -> ExportError:
    """Name the op (and its module) in ORT's gradient-builder error when the message names one."""
    message = (str(error).splitlines() or [repr(error)])[0][:300]
    for node in graph.graph.node:
        if (node.name and node.name in str(error)) or f"'{node.op_type}'" in message or f"{node.op_type}Grad" in message:
            return UnsupportedOperatorError(node.op_type, module_path(node.name), message)
    return ExportError(f"ONNX Runtime could not build the training graph: {message}")


def _refuse_crashing_gradients(path: Path, graph: Any, modules: Sequence[str]) -> None:
    """Refuse a training graph holding a gradient kernel of :data:`CRASHING_GRADIENTS`, naming the op and its module."""
    import onnx

    producers = {output: node for node in graph.graph.node for output in node.output}
    for node in onnx.load(str(path)).graph.node:
        if node.op_type in CRASHING_GRADIENTS:
            op, why = CRASHING_GRADIENTS[node.op_type]
            source = producers.get(node.input[0].removesuffix("_grad"))  # the gradient of the forward op's output
            raise UnsupportedOperatorError(op, module_path(node.name if source is None else source.name, modules), why)


def _trial_failure(failure: TrialFailure, graph: Any, modules: Sequence[str]) -> ExportError:
    """Name the op and module when ONNX Runtime's message names the node that failed (``Name:'/model/fc/Gemm_Grad/...'``)."""
    reported = re.search(r"Name:'([^']+)'", failure.detail)
    if reported is None:
        return failure
    name = reported.group(1)
    matches = [node for node in graph.graph.node if node.name and (name == node.name or name.startswith(node.name + "_Grad/"))]
    if not matches:
        return failure
    node = max(matches, key=lambda node: len(node.name))
    return UnsupportedOperatorError(node.op_type, module_path(node.name, modules), str(failure))


def _fix_eval_graph(path: Path) -> None:
    """Give eval-mode BatchNormalization one output (ORT keeps the training outputs, which fail to load)."""
    import onnx

    model = onnx.load(str(path))
    dropped: set[str] = set()
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) > 1:
            dropped.update(node.output[1:])
            del node.output[1:]
    if dropped:
        keep = [output for output in model.graph.output if output.name not in dropped]
        del model.graph.output[:]
        model.graph.output.extend(keep)
        onnx.save(model, str(path))


# the comparisons in ONNX Runtime 1.19's Clip gradient (inclusive) -> PyTorch's hardtanh/clamp backward (strict)
_STRICT = {"GreaterOrEqual": "Greater", "LessOrEqual": "Less"}


def _strict_clip_gradients(path: Path) -> None:
    """Make each ``Clip`` gradient pass the gradient only strictly inside the bounds, as PyTorch does.

    ORT builds ``Clip``'s gradient as ``grad * (x >= min and x <= max)``; PyTorch's
    ``hardtanh`` (``ReLU6``) and ``clamp`` backward use ``min < x < max``. Inputs exactly at a
    bound are common (a depthwise convolution over a region ReLU6 zeroed gives exact zeros),
    and the inclusive mask then trains other weights than PyTorch does.
    """
    import onnx

    model = onnx.load(str(path))
    clips = {node.name: node.input[0] for node in model.graph.node if node.op_type == "Clip" and node.name}
    changed = False
    for node in model.graph.node:
        scope, _, _ = node.name.partition("_Grad/")
        if node.op_type in _STRICT and scope in clips and node.input[0] == clips[scope]:
            node.op_type = _STRICT[node.op_type]
            changed = True
    if changed:
        onnx.save(model, str(path))


def _without_dropout(path: Path, target: Path) -> None:
    """Copy the training graph with every Dropout ratio 0, so the gate compares deterministic steps."""
    import onnx

    model = onnx.load(str(path))
    ratios = {node.input[1] for node in model.graph.node if node.op_type == "Dropout" and len(node.input) > 1}
    if ratios:
        zero = onnx.helper.make_tensor("taste_cl_zero_ratio", onnx.TensorProto.FLOAT, [], [0.0])
        model.graph.initializer.append(zero)
        for node in model.graph.node:
            node.input[:] = [zero.name if name in ratios else name for name in node.input]
    onnx.save(model, str(target))


def _running_stats_outputs(graph: Any, per_sample: dict[str, int], momenta: dict[str, float]) -> list[dict[str, Any]]:
    """Make training-mode BatchNormalization's new running statistics graph outputs; describe each."""
    import onnx

    sizes = {init.name: list(init.dims) for init in graph.graph.initializer}
    stats = []
    for node in graph.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) == 3:
            path = node.input[3].removeprefix(_PREFIX).removesuffix(".running_mean")
            for output, parameter, stat in ((node.output[1], node.input[3], "mean"), (node.output[2], node.input[4], "var")):
                graph.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, sizes[parameter]))
                stats.append({"output": output, "parameter": parameter, "stat": stat,
                              "momentum": momenta[path], "per_sample": per_sample[path]})  # fmt: skip
    return stats


def _batchnorm_geometry(model: nn.Module, x: Any, call: str) -> tuple[dict[str, int], dict[str, float]]:
    """Per BatchNorm path: elements per channel of one sample, and PyTorch's momentum (None refused)."""
    per_sample: dict[str, int] = {}
    momenta: dict[str, float] = {}
    hooks = []
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.momentum is None or module.running_mean is None:
                raise ExportError(f"BatchNorm {path!r} has momentum=None or no running statistics; batchnorm='batch' needs both")
            momenta[path] = float(module.momentum)
            hooks.append(module.register_forward_hook(
                lambda m, inputs, _, path=path: per_sample.__setitem__(path, math.prod(inputs[0].shape[2:]))
            ))  # fmt: skip
    try:
        eval_outputs(model, partial(call_model, call=call), x)
    finally:
        for hook in hooks:
            hook.remove()
    return per_sample, momenta


# -------------------------------------------------------------------- export
def _torch_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], Any],
    lr: float,
    trainable: Sequence[str] | None,
    batchnorm: str,
    call: str,
    dtype: str | None = None,
) -> TorchTrainer:
    """Torch training ``model`` as an export with ``lr`` and ``batchnorm`` would (dropout off), in
    ``dtype`` (default float32): an alternative the gate tries."""
    work, work_optimizer, _ = _working_copy(model, optimizer, lr, trainable)
    apply_transforms(work, batchnorm=batchnorm)
    return _reference(work, work_optimizer, loss_fn, call, dtype)


def _reference(
    work: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], Any], call: str, dtype: str | None = None
) -> TorchTrainer:
    """Eager torch training copies of the transformed ``work`` and its optimizer, random layers off, in ``dtype``;
    the model takes its inputs as ``call`` says."""
    reference = TorchTrainer(work, optimizer, loss_fn, forward=partial(call_model, call=call), dtype=dtype)
    disable_random_layers(reference.model)
    return reference


def _working_copy(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, trainable: Sequence[str] | None
) -> tuple[nn.Module, torch.optim.Optimizer, list[str]]:
    """A float32 CPU copy of model + optimizer (state keyed by the copied parameters) at ``lr``,
    training what the device trains; returns it with the trained parameters' names."""
    work, work_optimizer = copy.deepcopy((model, optimizer))
    work = work.cpu().float()
    for state in work_optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.detach().cpu().float()
    for group in work_optimizer.param_groups:
        group["lr"] = lr
    chosen = _trainable(work, work_optimizer, trainable)
    freeze_untrained(work, chosen)
    return work, work_optimizer, chosen


def _trainable(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: Sequence[str] | None) -> list[str]:
    """The parameters the device trains: ``trainable`` (names the optimizer holds), by default those it holds with requires_grad."""
    if trainable is None:
        chosen = trained_parameters(model, optimizer)
    else:
        if isinstance(trainable, str):
            raise TypeError(f"trainable must be a sequence of parameter names, not a str; got {trainable!r}")
        names = {id(p): name for name, p in model.named_parameters()}
        in_optimizer = {names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in names}
        chosen = list(trainable)
        unknown = [name for name in chosen if name not in in_optimizer]
        if unknown:
            raise ValueError(f"`trainable` names {unknown}, which are not parameters in the optimizer")
    if not chosen:
        raise ValueError("no trainable parameters: the optimizer holds none with requires_grad")
    return chosen


def _replay_bytes(rows: ReplayRows, dtypes: list[torch.dtype], label_dtype: torch.dtype) -> tuple[bytes, int]:
    _, leaves = _leaves(rows.x)
    arrays = {f"x{i}": _as_numpy(value, dtype) for i, ((_, value), dtype) in enumerate(zip(leaves, dtypes))}
    arrays["y"] = _as_numpy(rows.y, label_dtype)
    size = int(arrays["y"].shape[0])
    if size > rows.capacity or any(array.shape[0] != size for array in arrays.values()):
        raise ValueError(f"replay rows: {size} targets for capacity {rows.capacity}, every input must have as many rows")
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue(), size


def _sgd_buffers(model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, np.ndarray]:
    """PyTorch SGD momentum buffers of the trainable parameters, by graph name (empty for AdamW)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return {}
    buffers = {}
    for name, parameter in model.named_parameters():
        buffer = optimizer.state.get(parameter, {}).get("momentum_buffer")
        if _PREFIX + name in names and buffer is not None:
            buffers[_PREFIX + name] = buffer.detach().cpu().float().numpy()
    return buffers


class _SessionTrainer:
    """The device runtime as a parity :class:`~taste_cl.adapters.device.parity.Trainer`."""

    def __init__(self, loaded: Any) -> None:
        self.spec, self.session = loaded.spec, loaded.session

    def train_step(self, x: Any, y: np.ndarray) -> float:
        return self.session.train_step(features(x, self.spec), y)[1]

    def parameters(self) -> dict[str, np.ndarray]:
        return self.session.parameters(trainable_only=True)

    def predict(self, x: Any) -> np.ndarray:
        return self.session.predict(features(x, self.spec))


def export_model(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Any],
    optimizer: torch.optim.Optimizer,
    example: tuple[Any, Any],
    directory: str | os.PathLike[str],
    *,
    trainable: Sequence[str] | None = None,
    extra: dict[str, Any] | None = None,
    batchnorm: str = "frozen",
    lr: float | None = None,
    replay: ReplayRows | None = None,
    replay_batch_size: int = 0,
    train_iterations: int = 1,
    counters: dict[str, int] | None = None,
    batch_size: int | None = None,
    verify: bool = True,
    parity_steps: int = 3,
    parity_batches: Sequence[tuple[Any, Any]] | None = None,
    tolerance: float | None = None,
    opset: int = 17,
    task: Task | str | None = None,
    active_classes: Sequence[int] | None = None,
    call: str = "auto",
    parity_rows: str = "given",
) -> Path:
    """Write ONNX Runtime training artifacts for ``model`` trained with ``loss_fn`` and ``optimizer``.

    ``example`` is one batch ``(x, y)`` (``x`` a tensor, a dict or a list/tuple of tensors;
    at least 2 rows): it fixes the input names, dtypes and shapes (batch axis dynamic).
    The model, optimizer and their state are copied, never changed. ``trainable`` (names of
    parameters the optimizer holds; default: those it holds that require gradients) are the
    tensors the device trains, the rest frozen; ``extra`` adds keys to the manifest. ``batch_size`` is
    recorded in the manifest for the app. ``batchnorm``:
    ``"frozen"`` (running statistics fixed, affine part trains) or ``"batch"`` (batch
    statistics, running statistics written back after each device step). Unless
    ``verify=False``, ``parity_steps`` steps on ``parity_batches`` (default: the example)
    run in torch and in the device runtime from identical weights (dropout off) and a
    difference beyond ``tolerance`` (default 1e-4 scaled, float32) raises
    :class:`~taste_cl.adapters.device.parity.ParityError` with the numbers; both then keep training
    to 10 steps, and when torch's own training diverges (non-finite, or a loss grown a
    thousandfold) :class:`~taste_cl.adapters.device.parity.TrainingDivergesError` says so and
    whether the other ``batchnorm`` mode or a tenth of the ``lr`` keeps torch finite on those
    batches; when torch's own float32 training departs from float64 as far as the device does
    (rounding amplified, e.g. batch statistics over few values per channel)
    :class:`~taste_cl.adapters.device.parity.UnstableTrainingError` says which of them keeps it
    within the tolerance; nothing is published.
    ``task`` (default: inferred from ``loss_fn`` and the output shape, as the learner does)
    validates and shapes every target batch like :class:`~taste_cl.OnlineLearner`'s: a
    regression target ``(n,)`` for an ``(n, 1)`` output is trained as ``(n, 1)`` (the device
    takes either). ``active_classes`` (classes in use when the classifier has reserved
    slots) is recorded in the manifest. ``call`` (see :data:`~taste_cl._batch.CALL_MODES`) says how
    a dict or tuple ``x`` is passed to the model (spread, or whole to a ``forward(self, batch)``); the
    graph's inputs are ``x``'s leaves, named by its keys, either way. ``parity_rows`` says where the
    gate's batches came from (:data:`~taste_cl.adapters.device.artifacts.PARITY_ROWS`; the learner's
    export says it): on ``"generated"`` rows every verdict says so, the manifest records it in
    ``parity.rows``, and the device learner measures every one of its first steps. Returns the published folder.
    """
    _ort()
    check_call(call)
    if parity_rows not in PARITY_ROWS:
        raise ValueError(f"`parity_rows == {parity_rows!r}`, must be one of {', '.join(map(repr, PARITY_ROWS))}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    for name, value, low in (("train_iterations", train_iterations, 1), ("replay_batch_size", replay_batch_size, 0),
                             ("parity_steps", parity_steps, 1), ("opset", opset, 15)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name} == {value!r}`, must be an int >= {low}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"`batch_size == {batch_size!r}`, must be None or an int >= 1")
    config = _optimizer_config(optimizer, lr)
    x, y = example
    structure, leaves = _leaves(x)
    names = [name for name, _ in leaves]
    _check_flat(leaves)
    if not isinstance(y, torch.Tensor):
        raise ExportError(f"example y must be a tensor; got {type(y).__name__}")
    n = y.shape[0]
    if n < 2 or any(value.shape[0] != n for _, value in leaves):
        raise ValueError(f"example must hold at least 2 rows, the same number in every input; got {n} targets")
    dtypes = [_export_dtype(value, f"example x[{name!r}]") for name, value in leaves]
    ex_inputs = [value.detach().cpu().to(dtype) for (_, value), dtype in zip(leaves, dtypes)]

    source_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    work, work_optimizer, chosen = _working_copy(model, optimizer, config["lr"], trainable)
    example_x = _rebuild(structure, names, ex_inputs)
    forward = partial(call_model, call=call)
    before = eval_outputs(work, forward, example_x)
    bounds = index_bounds(work, partial(forward, work, example_x), dict(zip(names, ex_inputs)))  # ids checked on the device
    output_shape = tuple(before.shape[1:])
    task = resolve_task(task) if task is not None else infer_task(loss_fn, output_shape)
    ex_labels = task_targets(task, example_x, y, output_shape)
    label_dtype = torch.int64 if not ex_labels.is_floating_point() else torch.float32
    ex_labels = ex_labels.to(label_dtype)
    transforms = apply_transforms(work, batchnorm=batchnorm, run=partial(eval_outputs, work, forward, example_x))
    check_equivalent(before, eval_outputs(work, forward, example_x), tolerance=default_tolerance("float32"))
    work.train()
    snapshot = {key: value.clone() for key, value in work.state_dict().items()}
    graph = _trace(_Graph(work, traceable_loss(loss_fn), structure, names, call), [*ex_inputs, ex_labels], names, opset)
    work.load_state_dict(snapshot)  # tracing ran a training-mode forward (BatchNorm statistics moved)
    _set_initializers(graph, snapshot)
    fold_frozen_batchnorm(graph)  # before the gradient graph is built: ORT does not fuse training graphs
    running_stats = []
    if batchnorm == "batch":
        running_stats = _running_stats_outputs(graph, *_batchnorm_geometry(work, example_x, call))
    initializers = [init.name for init in graph.graph.initializer]
    requires_grad = [_PREFIX + name for name in chosen]
    missing = [name for name in requires_grad if name not in initializers]
    if missing:
        raise ExportError(f"trainable parameters {missing} do not appear in the exported graph (unused or tied?)")
    frozen = [name for name in initializers if name not in requires_grad]
    param_names = {name: name.removeprefix(_PREFIX) for name in initializers if name.startswith(_PREFIX)}
    num_classes = int(output_shape[0]) if label_dtype == torch.int64 else None
    if task is not None:
        num_classes = task.num_classes(output_shape)
    manifest: dict[str, Any] = {
        "format": ARTIFACT_FORMAT,
        "producer": f"taste_cl {__version__}",
        "opset": opset,
        "structure": structure,
        "inputs": [_spec(name, d, t, bounds.get(name)) for name, d, t in zip(names, dtypes, ex_inputs)],
        "labels": _spec(LABEL_NAME, label_dtype, ex_labels),
        "output": TensorSpec(OUTPUT_NAME, "float32", tuple(output_shape)).as_json(),
        "loss": type(loss_fn).__name__,
        "task": None if task is None else task.config(),
        "num_classes": num_classes,
        "ignore_index": int(loss_fn.ignore_index) if isinstance(loss_fn, nn.CrossEntropyLoss) else None,
        "source_dtype": str(source_dtype).removeprefix("torch."),
        "optimizer": config,
        "batchnorm": batchnorm,
        "transforms": transforms,
        "param_names": param_names,
        "trainable": requires_grad,
        **(extra or {}),
        "running_stats": running_stats,
        "replay_batch_size": replay_batch_size,
        "train_iterations": train_iterations,
        "counters": dict(counters or {"samples_seen": 0, "steps": 0}),
        "batch_size": batch_size,
        "replay": None,
        **({} if active_classes is None else {"active_classes": list(active_classes)}),
    }
    feed = ([t.numpy() for t in ex_inputs], ex_labels.numpy())
    with staged_folder(directory) as stage:
        from onnxruntime.training import artifacts, onnxblock

        adamw = config["type"] == "adamw"
        try:
            with _native_info_silenced():
                artifacts.generate_artifacts(
                    graph,
                    requires_grad=requires_grad,
                    frozen_params=frozen,
                    loss=onnxblock.blocks.PassThrough(),
                    loss_input_names=[LOSS_NAME],
                    optimizer=_adamw_block(config) if adamw else None,
                    artifact_directory=stage,
                    additional_output_names=[OUTPUT_NAME, *(stat["output"] for stat in running_stats)],
                )
        except Exception as error:  # ORT reports a missing gradient as a bare RuntimeError
            raise _gradient_failure(error, graph) from error
        _fix_eval_graph(stage / EVAL_MODEL)
        _strict_clip_gradients(stage / TRAINING_MODEL)
        if adamw:
            _torch_mode_adamw(stage / OPTIMIZER_MODEL)
        modules = _module_names(work)
        _refuse_crashing_gradients(stage / TRAINING_MODEL, graph, modules)
        try:  # the first run of these graphs happens where a crash cannot take this process with it
            trial_run(stage, {**manifest, "files": {}}, *feed)
        except TrialFailure as failure:
            raise _trial_failure(failure, graph, modules) from failure
        spec = parse_manifest({**manifest, "files": {}})
        if adamw and work_optimizer.state:
            state = {name: work_optimizer.state[p] for name, p in work.named_parameters() if p in work_optimizer.state}
            _write_adamw_state(stage, spec, state, feed)
        session = OrtSession(stage, spec, _sgd_buffers(work, work_optimizer, requires_grad))
        session.save(stage)  # the checkpoint (AdamW state included), SGD buffers, inference model
        if session.sgd_state:
            manifest["sgd_state"] = session.sgd_order()
        del session
        if replay is not None:
            replay = ReplayRows(replay.x, task_targets(task, replay.x, replay.y, output_shape), replay.capacity,
                                replay.seen, replay.seed)  # fmt: skip
            data, size = _replay_bytes(replay, dtypes, label_dtype)
            (stage / REPLAY_FILE).write_bytes(data)
            manifest["replay"] = {"file": REPLAY_FILE, "capacity": replay.capacity, "size": size,
                                  "seen": max(replay.seen, size), "seed": replay.seed, "rng": None}  # fmt: skip
        report = None
        if verify:
            write_manifest(stage, manifest)
            batches = [(bx, task_targets(task, bx, by, output_shape)) for bx, by in parity_batches or [example]]
            # settings torch tries on the gate's batches if its own training diverges there
            trainer = partial(_torch_trainer, model, optimizer, loss_fn, call=call)
            alternatives = {f"lr={config['lr'] / 10:g}": partial(trainer, config["lr"] / 10, trainable, batchnorm)}
            if batchnorm == "frozen" and any(isinstance(module, FrozenBatchNorm) for module in work.modules()):
                alternatives = {"batchnorm='batch'": partial(trainer, config["lr"], trainable, "batch"), **alternatives}
            elif batchnorm == "batch" and running_stats:
                alternatives = {"batchnorm='frozen'": partial(trainer, config["lr"], trainable, "frozen"), **alternatives}
            report = _parity_gate(stage, work, work_optimizer, loss_fn, structure, names, dtypes, label_dtype,
                                  batches, parity_steps, tolerance, alternatives, call, rows=parity_rows)  # fmt: skip
        manifest["parity"] = None if report is None else {
            "steps": report.steps, "max_output_diff": report.max_output_diff,
            "max_loss_diff": report.max_loss_diff, "max_param_diff": report.max_param_diff,
            "tolerance": report.output_tol, "param_tolerance": report.param_tol,
            "watched_steps": report.watched_steps, "float64_departure": report.exact_departure, "rows": report.rows}  # fmt: skip
        write_manifest(stage, manifest)
        add_web_artifacts(stage)  # the browser learner's files, or the reason it cannot train this model
    return Path(directory).absolute()


def _parity_gate(
    stage: Path,
    work: nn.Module,
    work_optimizer: torch.optim.Optimizer,
    loss: Callable[[Any, Any], Any],
    structure: str,
    names: list[str],
    dtypes: list[torch.dtype],
    label_dtype: torch.dtype,
    batches: Sequence[tuple[Any, Any]],
    steps: int,
    tolerance: float | None,
    alternatives: Mapping[str, Callable[[], TorchTrainer]],
    call: str,
    *,
    rows: str,
) -> ParityReport:
    """Train ``steps`` steps in torch and in the staged artifacts (dropout off in both) and compare;
    both keep training to :data:`~taste_cl.adapters.device.parity.WATCH_STEPS` steps, watched for divergence."""
    numpy_batches = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        _, leaves = _leaves(x)
        arrays = [_as_numpy(value, dtype) for (_, value), dtype in zip(leaves, dtypes)]
        numpy_batches.append((_rebuild(structure, names, arrays), _as_numpy(y, label_dtype)))
    param_tolerance = None
    if isinstance(work_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # Adam normalises each gradient element: where the true gradient is 0 (the key bias of
        # attention, invariant under softmax), either backend's rounding noise moves a parameter
        # by up to lr per step. Outputs and losses keep the tight bound.
        tol = tolerance if tolerance is not None else default_tolerance("float32")
        param_tolerance = max(tol, 2.0 * float(work_optimizer.param_groups[0]["lr"]) * steps)
    reference = _reference(work, work_optimizer, loss, call)
    with tempfile.TemporaryDirectory(prefix="taste_cl_parity_") as scratch:
        graph = Path(scratch) / TRAINING_MODEL
        _without_dropout(stage / TRAINING_MODEL, graph)
        candidate = _SessionTrainer(load(stage, training_model=graph))
        return check_parity(reference, candidate, numpy_batches, backend="onnxruntime", tolerance=tolerance,
                            param_tolerance=param_tolerance, alternatives=alternatives,
                            precise=partial(_reference, work, work_optimizer, loss, call, "float64"), rows=rows)  # fmt: skip
