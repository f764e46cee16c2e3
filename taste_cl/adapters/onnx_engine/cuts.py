"""The backward graph pruned per cut: what an elastic learner's export adds to the engine folder (export side, uses onnx).

A cut ``k`` is the gradients of every trainable tensor from the ``k``-th module on (the units in
execution order). Its graph is ``backward.onnx`` with only those outputs and the nodes they need:
the input-gradient chain below the cut and the weight gradients before it are gone. ONNX Runtime
does not skip them itself when ``session.run`` asks for fewer outputs (see
:mod:`taste_cl.engine.elastic` for the measurement), so each cut is a graph of its own; all read
the engine's one parameter store, and :meth:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine.select`
switches among them without a new export.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import onnx

from taste_cl.adapters.onnx_engine.engine import MANIFEST

__all__ = ["cut_groups", "write_cuts"]


def cut_groups(units: Sequence[Sequence[str]]) -> list[list[str]]:
    """The tensors of each cut after the first: from each module's first unit on (units grouped by module, in order)."""
    modules = [unit[0].rpartition(".")[0] for unit in units]
    starts = [i for i in range(1, len(units)) if modules[i] != modules[i - 1]]
    return [[name for unit in units[i:] for name in unit] for i in starts]


def _pruned(model: onnx.ModelProto, keep: Sequence[str]) -> onnx.ModelProto:
    """``model`` with only the outputs ``keep`` and the nodes, inputs and initializers they need."""
    graph, needed, nodes = model.graph, set(keep), []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed |= set(node.input)
    nodes.reverse()
    pruned = onnx.helper.make_graph(
        nodes, graph.name, [i for i in graph.input if i.name in needed], [o for o in graph.output if o.name in set(keep)],
        [t for t in graph.initializer if t.name in needed], value_info=[v for v in graph.value_info if v.name in needed],
    )  # fmt: skip
    result = onnx.helper.make_model(pruned, opset_imports=model.opset_import, producer_name=model.producer_name)
    result.ir_version = model.ir_version
    result.functions.extend(model.functions)
    return result


def write_cuts(folder: str | Path, cuts: Sequence[Sequence[str]]) -> None:
    """Write ``backward.cut<k>.onnx`` for each of ``cuts`` (tensor names, each a subset of the one before) into the engine
    ``folder`` and list them in its ``engine.json``."""
    target = Path(folder)
    model = onnx.load(str(target / "backward.onnx"))
    manifest = json.loads((target / MANIFEST).read_text())
    entries = []
    for k, names in enumerate(cuts, start=1):
        keep = [f"grad.{name}" for name in manifest["trainable"] if name in set(names)]
        pruned = _pruned(model, keep)
        onnx.save_model(pruned, str(target / f"backward.cut{k}.onnx"))
        inputs = [i.name for i in pruned.graph.input]
        entries.append({"file": f"backward.cut{k}.onnx", "trainable": [g.removeprefix("grad.") for g in keep], "inputs": inputs, "outputs": keep})
    manifest["cuts"] = entries
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
