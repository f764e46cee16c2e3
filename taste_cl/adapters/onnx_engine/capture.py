"""Torch's forward and backward graphs, partitioned by AOT autograd, cut to what the engine passes.

:func:`capture` traces ``model`` (in eval mode) with :func:`torch._functorch.aot_autograd.aot_function`
and ``default_partition``: the forward graph returns the outputs and the activations the backward
needs (each computed once), the backward graph takes those activations and ``dLoss/dOutputs`` and
returns the gradients. The graphs are then cut to what the engine passes between them:

- frozen tensors (not in ``trainable``, buffers included) become constants of the graphs;
- an activation that is a graph input (a weight, the model's input) is not returned by the forward:
  the engine feeds the value it already holds to the backward;
- aliases and duplicates of one activation travel once;
- the backward returns the trainable tensors' gradients only;
- tensors named in ``fed`` (BatchNorm's running statistics, for test-time adaptation) stay inputs
  of the graphs, without gradients, so the engine can change them;
- ``extras``, when given, is called after each run of the model and returns tensors the forward
  returns too, after the output and without gradients (the batch statistics of the adaptation graphs).

Shapes are those of the example batch (static): :class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine`
runs other batch sizes as padded chunks of that size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition
from torch.nn.attention import SDPBackend, sdpa_kernel

from taste_cl.adapters.onnx_engine.decompositions import backward_decompositions
from taste_cl.exceptions import ExportError

__all__ = ["CapturedGraphs", "capture"]

aten = torch.ops.aten


@dataclass
class CapturedGraphs:
    """The cut graphs and the names of what flows between them (``fed`` maps a backward input to
    the forward input or output the engine feeds it from)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    forward_inputs: list[str]
    forward_outputs: list[str]
    backward_inputs: list[str]
    backward_outputs: list[str]
    fed: dict[str, str] = field(default_factory=dict)
    residuals: list[str] = field(default_factory=list)


def _pick_output(result: Any, output: str | int | None) -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        return result
    if output is None:
        raise ExportError(f"the model returns {type(result).__name__}, not a tensor: pass output= (the key or index of the tensor that trains)")
    try:
        picked = result[output]
    except (KeyError, IndexError, TypeError) as error:
        raise ExportError(f"`output={output!r}` does not select a tensor of the model's {type(result).__name__} output: {error}") from error
    if not isinstance(picked, torch.Tensor):
        raise ExportError(f"`output={output!r}` selects a {type(picked).__name__}, not a tensor")
    return picked


def _resolve(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in (aten.alias.default, aten.detach.default):
        node = node.args[0]  # type: ignore[assignment]
    return node


def _lift_constants(graph_module: fx.GraphModule, constants: Mapping[fx.Node, torch.Tensor]) -> None:
    """Replace each placeholder in ``constants`` by a buffer of the module (an ONNX initializer)."""
    graph = graph_module.graph
    first = next(node for node in graph.nodes if node.op != "placeholder") if any(n.op != "placeholder" for n in graph.nodes) else None
    for index, (node, value) in enumerate(constants.items()):
        attribute = f"frozen_{index}"
        graph_module.register_buffer(attribute, value.detach().clone())
        with graph.inserting_before(first):
            constant = graph.get_attr(attribute)
        node.replace_all_uses_with(constant)
        graph.erase_node(node)


def capture(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    trainable: Sequence[str],
    *,
    output: str | int | None = None,
    keyword: bool = False,
    fed: Sequence[str] = (),
    extras: Callable[[], Sequence[torch.Tensor]] | None = None,
) -> CapturedGraphs:
    """Forward and backward graphs of ``model`` at ``inputs`` (names to example tensors), gradients for ``trainable``;
    ``keyword``: the model is called with the inputs as keyword arguments, else with the one input positionally;
    ``fed`` and ``extras``: see the module."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    frozen = [name for name in tensors if name not in trainable and name not in fed]
    kept = [name for name in tensors if name in fed]
    primal_names = [*trainable, *kept, *frozen, *inputs]
    n_weights = len(trainable) + len(kept) + len(frozen)
    input_keys = list(inputs)
    counts: list[int] = []

    def step(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = dict(zip(primal_names[:n_weights], args[:n_weights]))
        feed = dict(zip(input_keys, args[n_weights:]))
        if keyword:
            result = torch.func.functional_call(model, weights, args=(), kwargs=feed)
        else:
            result = torch.func.functional_call(model, weights, (args[n_weights],))
        recorded = [] if extras is None else [t.detach() for t in extras()]
        counts.append(len(recorded))
        return (_pick_output(result, output), *recorded)

    graphs: dict[str, fx.GraphModule] = {}

    def keep(kind: str) -> Any:
        def compiler(graph_module: fx.GraphModule, _: Any) -> Any:
            graphs[kind] = graph_module
            return make_boxed_func(graph_module)

        return compiler

    traced = aot_function(
        step, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=default_partition, decompositions=backward_decompositions()
    )
    args = [tensors[name].detach().clone().requires_grad_(True) for name in trainable]
    args += [tensors[name].detach().clone() for name in (*kept, *frozen)]
    args += [value.detach().clone() for value in inputs.values()]
    # attention as matmuls and softmax (the fused kernels' backward has no ONNX translation); LSTM/GRU
    # without mkldnn (its fused cell saves tensors AOT autograd cannot partition)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mkldnn.flags warns that its tf32 setter is deprecated
        cpu_flags = torch.backends.mkldnn.flags(enabled=False)
        cpu_flags.__enter__()
    try:
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            result = _run(traced, args)
            if not result.requires_grad:
                raise ExportError("the selected output does not depend on any trainable tensor: check trainable=")
            result.backward(torch.ones_like(result))
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpu_flags.__exit__(None, None, None)
    return _cut(graphs["forward"], graphs["backward"], primal_names, trainable, frozen, args, counts[-1])


def _run(traced: Any, args: Sequence[torch.Tensor]) -> torch.Tensor:
    try:
        return traced(*args)[0]
    except ExportError:
        raise
    except Exception as error:
        raise ExportError(f"torch's AOT autograd could not capture the model: {type(error).__name__}: {str(error)[:300]}") from error


def _cut(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    primal_names: list[str],
    trainable: Sequence[str],
    frozen: Sequence[str],
    values: Sequence[torch.Tensor],
    extra: int = 0,
) -> CapturedGraphs:
    fw_placeholders = [node for node in forward.graph.nodes if node.op == "placeholder"]
    primal_of = dict(zip(fw_placeholders, primal_names))
    fw_output = next(node for node in forward.graph.nodes if node.op == "output")
    outs = list(fw_output.args[0])
    extras, outs = outs[1 : 1 + extra], [outs[0], *outs[1 + extra :]]
    bw_placeholders = [node for node in backward.graph.nodes if node.op == "placeholder"]
    saved, tangents = bw_placeholders[: len(outs) - 1], bw_placeholders[len(outs) - 1 :]
    if len(tangents) != 1 or any(not isinstance(node, fx.Node) for node in outs):
        raise ExportError(
            "the captured graphs pass symbolic sizes or several outputs between forward and backward; the engine takes one output tensor"
        )
    user_output = outs[0]
    residual_nodes: list[fx.Node] = []
    fed: dict[str, str] = {}
    seen: dict[fx.Node, fx.Node] = {}
    bw_frozen: dict[fx.Node, torch.Tensor] = {}
    bw_names: dict[fx.Node, str] = {}
    for fw_node, bw_node in zip(outs[1:], saved):
        source = _resolve(fw_node)
        if source in seen:  # the same activation, already passed
            bw_node.replace_all_uses_with(seen[source])
            backward.graph.erase_node(bw_node)
            continue
        seen[source] = bw_node
        if source in primal_of:
            name = primal_of[source]
            if name in frozen:
                bw_frozen[bw_node] = values[primal_names.index(name)]
            else:
                bw_names[bw_node] = fed[name] = name
        elif source is _resolve(user_output):
            bw_names[bw_node] = "output"
            fed["output"] = "output"
        else:
            bw_names[bw_node] = f"saved_{len(residual_nodes)}"
            residual_nodes.append(source)
    bw_names[tangents[0]] = "grad_output"
    fw_output.args = ((user_output, *extras, *residual_nodes),)
    _lift_constants(forward, {node: values[primal_names.index(primal_of[node])] for node in fw_placeholders if primal_of[node] in frozen})
    _lift_constants(backward, bw_frozen)
    # the backward returns the trainable tensors' gradients, in order
    bw_output = next(node for node in backward.graph.nodes if node.op == "output")
    grads = list(bw_output.args[0])[: len(trainable)]
    if any(grad is None for grad in grads):
        unused = [name for name, grad in zip(trainable, grads) if grad is None]
        raise ExportError(f"trainable tensors {unused} get no gradient from the selected output: leave them out of trainable=")
    bw_output.args = (tuple(grads),)
    for module in (forward, backward):
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()
    forward_inputs = [primal_of[node] for node in forward.graph.nodes if node.op == "placeholder"]
    backward_inputs = [bw_names[node] for node in backward.graph.nodes if node.op == "placeholder"]
    residuals = [f"saved_{i}" for i in range(len(residual_nodes))]
    return CapturedGraphs(
        forward=forward,
        backward=backward,
        forward_inputs=forward_inputs,
        forward_outputs=["output", *(f"extra_{i}" for i in range(extra)), *residuals],
        backward_inputs=backward_inputs,
        backward_outputs=[f"grad.{name}" for name in trainable],
        fed=fed,
        residuals=residuals,
    )
