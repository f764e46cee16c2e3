"""Export a torch model to the ONNX engine's folder: forward, backward and optimizer graphs in standard ONNX.

:func:`export_engine` captures torch's own forward/backward partition
(:mod:`~taste_cl.adapters.onnx_engine.capture`), exports each graph with the dynamo ONNX exporter
(opset 18, IR version 10, so ONNX Runtime 1.18 and every later release read it), writes the
optimizer step as a third graph (:mod:`~taste_cl.adapters.onnx_engine.optimizers`) and saves the
trainable tensors and the optimizer state beside them. The folder trains on plain ``onnxruntime``
with :class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine`; no training build and no torch.

``batchnorm="adapt"`` writes what test-time adaptation on the device needs
(:class:`~taste_cl.engine.adapt.EngineAdapter`): BatchNorm's running statistics become inputs of the
graphs (``statistics.npz``, so the engine can move them), and a second pair of graphs,
``forward_batch.onnx`` and ``backward_batch.onnx``, normalises with the batch's own statistics over
the rows marked in a ``batch_rows`` input (padding left out) and returns each layer's batch mean and
biased variance after the output; the engine updates the running statistics from them as torch's
train-mode BatchNorm does.

An operator of either graph that the exporter cannot write in standard ONNX is refused with
:class:`~taste_cl.exceptions.UntranslatableOperatorError`, which names it.

>>> import tempfile, torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
>>> folder = export_engine(model, torch.randn(16, 4), tempfile.mkdtemp(), optimizer="sgd", lr=0.1)
>>> sorted(p.name for p in folder.iterdir())
['backward.onnx', 'engine.json', 'forward.onnx', 'optimizer.onnx', 'optimizer_state.npz', 'parameters.npz']
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import fx, nn

from taste_cl.adapters.onnx_engine.capture import CapturedGraphs, capture
from taste_cl.adapters.onnx_engine.engine import FORMAT, MANIFEST
from taste_cl.adapters.onnx_engine.optimizers import IR_VERSION, OPSET, OptimizerSpec, build_optimizer_graph, state_names
from taste_cl.exceptions import ExportError, MissingDependencyError, UntranslatableOperatorError

__all__ = ["BatchStatisticsNorm", "export_engine"]

BATCH_ROWS = "batch_rows"
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class BatchStatisticsNorm(nn.Module):
    """A BatchNorm layer normalising with the batch's statistics over the rows ``rows()`` marks with 1 (padding is 0),
    which it records as ``(index, mean, biased variance)``: the layer of the batch-statistics graphs."""

    rows: Callable[[], torch.Tensor]

    def __init__(self, norm: Any, index: int, rows: Callable[[], torch.Tensor], records: list[Any]) -> None:
        super().__init__()
        self.register_parameter("weight", norm.weight)
        self.register_parameter("bias", norm.bias)
        self.eps, self.index, self.rows, self.records = norm.eps, index, rows, records
        self.positions = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        mask = self.rows().reshape(-1, *[1] * (x.dim() - 1))
        count = self.rows().sum() * (x[0, 0].numel())
        mean = (x * mask).sum(dims) / count
        centred = x - mean.reshape(shape)
        var = (centred * centred * mask).sum(dims) / count
        out = centred * torch.rsqrt(var.reshape(shape) + self.eps)
        weight, bias = cast("torch.Tensor | None", self.weight), cast("torch.Tensor", self.bias)
        if weight is not None:
            out = out * weight.reshape(shape) + bias.reshape(shape)
        self.positions = int(x[0, 0].numel())  # values per channel and row: the unbiased variance's count
        self.records.append((self.index, mean, var))
        return out


def _require_exporter() -> Any:
    try:
        import onnx
        import onnxscript  # noqa: F401 - the dynamo exporter's translations
    except ImportError as error:
        raise MissingDependencyError(error.name or "onnxscript", "onnx") from error
    return onnx


def _untranslated(graph_module: fx.GraphModule) -> list[str]:
    """The operators of ``graph_module`` the exporter has no translation or decomposition for."""
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib()
    decompositions = torch.export.default_decompositions()
    missing = []
    for node in graph_module.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            if not registry.is_registered(target) and target not in decompositions:
                missing.append(str(target))
    return sorted(set(missing))


def _export_graph(graph_module: fx.GraphModule, args: Sequence[torch.Tensor], inputs: list[str], outputs: list[str], path: Path) -> None:
    onnx = _require_exporter()
    missing = _untranslated(graph_module)
    if missing:
        raise UntranslatableOperatorError(missing[0], f"no ONNX translation (all missing: {', '.join(missing)})")
    for logger in ("torch.onnx", "onnx_ir", "onnxscript"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                graph_module, tuple(args), dynamo=True, opset_version=OPSET, input_names=inputs, output_names=outputs, optimize=True
            )
    except Exception as error:
        found = re.search(r"(aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)", str(error))
        raise UntranslatableOperatorError(found.group(1) if found else "unknown", str(error).splitlines()[0][:300]) from error
    if program is None:
        raise ExportError("torch.onnx.export returned no program")
    model = program.model_proto
    model.ir_version = IR_VERSION
    onnx.save_model(model, str(path))


def _example_args(graphs: CapturedGraphs, values: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Example arguments of both graphs, by running the forward once."""
    forward_args = [values[name] for name in graphs.forward_inputs]
    with torch.no_grad():
        produced = dict(zip(graphs.forward_outputs, graphs.forward(*forward_args)))
    everything = {**values, **produced}
    backward_args = [torch.ones_like(produced["output"]) if name == "grad_output" else everything[name] for name in graphs.backward_inputs]
    return forward_args, backward_args


def _optimizer_state(spec: OptimizerSpec, optimizer: Any, model: nn.Module, trainable: Sequence[str]) -> dict[str, np.ndarray]:
    """The torch optimizer's state (zeros where it has none), by the engine's names."""
    params = dict(model.named_parameters())
    state: dict[str, np.ndarray] = {"step": np.zeros((), np.float32)}
    held = getattr(optimizer, "state", {}) if optimizer is not None else {}
    for name in trainable:
        value = params[name] if name in params else None
        entry = held.get(value, {}) if value is not None else {}
        keys = {"momentum.": "momentum_buffer", "exp_avg.": "exp_avg", "exp_avg_sq.": "exp_avg_sq"}
        for state_name in state_names(spec, name):
            prefix = state_name[: state_name.index(".") + 1]
            stored = entry.get(keys[prefix])
            shape = tuple(dict(model.named_parameters())[name].shape)
            state[state_name] = np.zeros(shape, np.float32) if stored is None else stored.detach().numpy().astype(np.float32)
            if stored is not None and prefix == "momentum." and not state["step"]:
                # torch's SGD counts no steps; the graph starts its momentum afresh at step 0, so a held buffer means step 1
                state["step"] = np.ones((), np.float32)
        if "step" in entry:
            state["step"] = np.asarray(float(entry["step"]), np.float32)
    return state


def export_engine(
    model: nn.Module,
    example: torch.Tensor | Mapping[str, torch.Tensor],
    folder: str | os.PathLike[str],
    *,
    trainable: Sequence[str] | None = None,
    optimizer: str | torch.optim.Optimizer = "sgd",
    output: str | int | None = None,
    batchnorm: str = "running",
    **optimizer_settings: Any,
) -> Path:
    """Write the engine folder for ``model`` at batches shaped like ``example`` and return its path.

    ``example``: one batch, a tensor (the model's one positional input) or a dict of tensors
    (keyword inputs); its batch size is the graphs' (the engine pads and chunks others). The model is
    copied and traced in eval mode: BatchNorm uses its running statistics, dropout is off.
    ``trainable``: the parameter names that get gradients (default: those with ``requires_grad``);
    every other parameter and buffer is a constant of the graphs. ``optimizer``: a ``torch.optim.SGD``
    or ``AdamW`` (its settings and state travel), or ``"sgd"`` / ``"adamw"`` with ``optimizer_settings``
    (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``, ...). ``output``: the key or index of the
    tensor that trains when the model returns a dict or tuple. ``batchnorm``: ``"running"`` (BatchNorm on its
    running statistics, constants of the graphs) or ``"adapt"`` (see the module).
    """
    if batchnorm not in ("running", "adapt"):
        raise ExportError(f"`batchnorm == {batchnorm!r}`, must be 'running' or 'adapt'")
    onnx = _require_exporter()
    keyword = isinstance(example, Mapping)
    inputs = {str(k): v for k, v in example.items()} if isinstance(example, Mapping) else {"input": example}
    if any(not isinstance(v, torch.Tensor) for v in inputs.values()):
        raise ExportError("`example` must be a tensor or a dict of tensors")
    copied = copy.deepcopy(model).eval()
    names = [name for name, p in copied.named_parameters() if p.requires_grad] if trainable is None else list(trainable)
    known = dict(copied.named_parameters())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ExportError(
            f"`trainable` must name parameters of the model; unknown: {unknown}" if unknown else "`trainable` is empty: nothing would train"
        )
    if isinstance(optimizer, str):
        spec = OptimizerSpec.from_torch_name(optimizer.lower(), **optimizer_settings)
    else:
        spec = OptimizerSpec.from_torch(optimizer)
    statistics = _running_statistics(copied) if batchnorm == "adapt" else {}
    graphs = capture(copied, inputs, names, output=output, keyword=keyword, fed=[n for name in statistics for n in _fed_names(name)])
    values = {**{k: v.detach() for k, v in copied.named_parameters()}, **{k: v.detach() for k, v in copied.named_buffers()}, **inputs}
    forward_args, backward_args = _example_args(graphs, values)
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    _export_graph(graphs.forward, forward_args, graphs.forward_inputs, graphs.forward_outputs, target / "forward.onnx")
    _export_graph(graphs.backward, backward_args, graphs.backward_inputs, graphs.backward_outputs, target / "backward.onnx")
    shapes = {name: tuple(known[name].shape) for name in names}
    onnx.save_model(build_optimizer_graph(spec, shapes), str(target / "optimizer.onnx"))
    np.savez(target / "parameters.npz", **{name: known[name].detach().numpy().astype(np.float32) for name in names})  # type: ignore[arg-type]
    source = optimizer if not isinstance(optimizer, str) else None
    np.savez(target / "optimizer_state.npz", **_optimizer_state(spec, source, model, names))  # type: ignore[arg-type]
    manifest = {
        "format": FORMAT,
        "keyword_inputs": keyword,
        "inputs": {name: {"dtype": str(t.numpy().dtype), "shape": list(t.shape)} for name, t in inputs.items()},
        "batch_size": int(next(iter(inputs.values())).shape[0]),
        "output_shape": list(forward_args and graphs.forward(*forward_args)[0].shape),
        "trainable": {name: list(shape) for name, shape in shapes.items()},
        "forward": {"inputs": graphs.forward_inputs, "outputs": graphs.forward_outputs},
        "backward": {"inputs": graphs.backward_inputs, "outputs": graphs.backward_outputs},
        "optimizer": spec.to_json(),
    }
    if batchnorm == "adapt":
        manifest["statistics"] = {n: list(known_buffer.shape) for name in statistics for n, known_buffer in _fed_tensors(copied, name).items()}
        manifest["batch"] = _export_batch_graphs(copied, inputs, names, statistics, target, output=output, keyword=keyword)
        np.savez(target / "statistics.npz", **_statistics_arrays(copied, statistics))  # type: ignore[arg-type]
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return target


def _running_statistics(model: nn.Module) -> dict[str, nn.Module]:
    """The BatchNorm layers that track running statistics, by module name; ExportError when there are none."""
    found: dict[str, nn.Module] = {
        name: m for name, m in model.named_modules() if isinstance(m, _BATCH_NORMS) and m.track_running_stats and m.running_mean is not None
    }
    if not found:
        raise ExportError("`batchnorm='adapt'` adapts BatchNorm statistics, and the model has no BatchNorm that tracks them")
    return found


def _fed_names(layer: str) -> list[str]:
    prefix = f"{layer}." if layer else ""
    return [f"{prefix}running_mean", f"{prefix}running_var"]


def _fed_tensors(model: nn.Module, layer: str) -> dict[str, torch.Tensor]:
    buffers = dict(model.named_buffers())
    return {name: buffers[name] for name in _fed_names(layer)}


def _statistics_arrays(model: nn.Module, statistics: Mapping[str, nn.Module]) -> dict[str, np.ndarray]:
    """The running statistics (float32) and each layer's batch count (int64), by buffer name."""
    arrays: dict[str, np.ndarray] = {}
    for layer in statistics:
        arrays |= {name: t.detach().numpy().astype(np.float32) for name, t in _fed_tensors(model, layer).items()}
        count = f"{layer}.num_batches_tracked" if layer else "num_batches_tracked"
        arrays[count] = np.asarray(int(dict(model.named_buffers())[count]), np.int64)
    return arrays


def _export_batch_graphs(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    names: Sequence[str],
    statistics: Mapping[str, nn.Module],
    target: Path,
    *,
    output: str | int | None,
    keyword: bool,
) -> dict[str, Any]:
    """Write ``forward_batch.onnx`` / ``backward_batch.onnx`` (BatchNorm on the marked rows' statistics) and return their manifest entry."""
    batch_model = copy.deepcopy(model)
    records: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    layers = list(statistics)
    swapped = []
    for index, layer in enumerate(layers):
        parent_name, _, child = layer.rpartition(".")
        parent = batch_model.get_submodule(parent_name)
        swapped.append(BatchStatisticsNorm(parent.get_submodule(child), index, lambda: getattr(batch_model, BATCH_ROWS), records))
        setattr(parent, child, swapped[-1])
    if hasattr(batch_model, BATCH_ROWS):
        raise ExportError(f"the model has an attribute {BATCH_ROWS!r}, the name of the adaptation graphs' row mask")
    batch_model.register_buffer(BATCH_ROWS, torch.ones(next(iter(inputs.values())).shape[0]))

    def extras() -> list[torch.Tensor]:
        if sorted(index for index, _, _ in records) != list(range(len(layers))):
            raise ExportError("every BatchNorm layer must run exactly once per forward for batchnorm='adapt'")
        ordered = [t for _, mean, var in sorted(records, key=lambda record: record[0]) for t in (mean, var)]
        records.clear()
        return ordered

    graphs = capture(batch_model, inputs, names, output=output, keyword=keyword, fed=[BATCH_ROWS], extras=extras)
    graphs.forward_outputs = ["output", *(f"batch_{kind}.{layer}" for layer in layers for kind in ("mean", "var")), *graphs.residuals]
    values = {**{k: v.detach() for k, v in batch_model.named_parameters()}, **{k: v.detach() for k, v in batch_model.named_buffers()}, **inputs}
    forward_args, backward_args = _example_args(graphs, values)
    _export_graph(graphs.forward, forward_args, graphs.forward_inputs, graphs.forward_outputs, target / "forward_batch.onnx")
    _export_graph(graphs.backward, backward_args, graphs.backward_inputs, graphs.backward_outputs, target / "backward_batch.onnx")
    return {
        "forward": {"inputs": graphs.forward_inputs, "outputs": graphs.forward_outputs},
        "backward": {"inputs": graphs.backward_inputs, "outputs": graphs.backward_outputs},
        "rows": BATCH_ROWS,
        "layers": {layer: {"momentum": module.momentum, "positions": norm.positions} for (layer, module), norm in zip(statistics.items(), swapped)},
    }
