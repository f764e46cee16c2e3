"""What each trainable unit costs in ONNX Runtime's training step, for ElasticTrainer to select with.

ElasticTrainer budgets with a profile of *torch's* backward (weight gradients per unit, the
input-gradient chain per unit). ONNX Runtime splits the same backward differently: its
``ConvGrad`` spends about two thirds of a ResNet-18 step on input gradients, so the chain
matters more and the weight gradients less than in torch, and a selection chosen with
torch's costs (early tensors kept: the whole chain paid) gains 1.3x on ONNX Runtime where it
gains 1.9x in torch (``bench device --cuts``).

:func:`measure_step_costs` measures the device runtime's own costs in the shape of a
:class:`~taste_cl.elastic.tensor_profile.TensorProfile` over the ElasticTrainer's units, so
:meth:`~taste_cl.elastic.ElasticTrainer.selection_for` can choose, with the importance the
learner measured, what a device exported with ``trainable=`` should train:

- the model is exported twice (each through the parity gate): every unit trainable, and only
  the first unit trainable (the whole input-gradient chain with a single weight gradient);
- both run ``steps`` training steps with ONNX Runtime's per-node profiler on;
- profiled nodes are matched to modules by the parameters their scope reads in the exported
  graph, else by scope names (peft's ``lora_A['default']`` is scoped ``default`` alone);
- per module, the first export's backward nodes time its input gradient, the difference
  between the two its weight gradients; parameter-free modules (activations, residual adds,
  pooling) and frozen ones are charged to the next unit, as in torch's profile, and those
  after the last unit to the tail; forward and loss nodes make the forward time. The
  gradient accumulators (per-parameter copies, microseconds each) are left out.

The costs are absolute times: measure on a quiet device (other work in the process or on
the machine inflates them unevenly, and the selection with them).

Memory fields are copied from the learner's torch profile (the same units, the same tensors).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Mapping
from functools import cache, partial
from pathlib import Path
from typing import Any

from taste_cl._checks import check_int
from taste_cl.elastic.profiling import robust_estimate, unit_parameters
from taste_cl.elastic.tensor_profile import TensorProfile

__all__ = ["measure_step_costs"]

_GRAD = "_Grad/"
_KERNEL = "_kernel_time"
_ACCUMULATORS = ("GradientAccumulator", "AccumulateGrad_")  # per-parameter gradient copies: microseconds, left out


def measure_step_costs(
    learner: Any,
    elastic: Any,
    batch: tuple[Any, Any],
    *,
    steps: int = 6,
    threads: int | None = None,
    workdir: str | Path | None = None,
) -> TensorProfile:
    """ONNX Runtime's step costs per unit of ``elastic``'s profile, measured on ``batch``.

    ``elastic`` is the :class:`~taste_cl.elastic.ElasticTrainer` attached to ``learner``,
    after its first profile; ``batch`` is ``(inputs, targets)`` (tensors) at the batch size the
    device trains at, also the exports' example (a learner without replay rows needs one);
    ``steps`` training steps are profiled per export after one untimed one, with
    ``threads`` intra-op threads (None: ONNX Runtime's default). The learner is not changed
    (the exports train copies). ``workdir`` keeps the two exports (default: a temporary folder,
    removed). Nodes are matched to modules by the parameters they read, else by their scope
    names (peft adapters included). ``ValueError`` when no node matches a unit's module:
    nothing would be measured.
    """
    import onnxruntime

    from taste_cl.adapters.onnxruntime.build import module_path
    from taste_cl.adapters.onnxruntime.manifest import TRAINING_MODEL
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"batch must be (inputs, targets); got {type(batch).__name__}")
    if elastic not in learner.plugins or elastic.profile_ is None:
        raise ValueError("measure_step_costs needs an ElasticTrainer attached to the learner, after its first profile (observe a batch first)")
    check_int("steps", steps, 1)
    if threads is not None:
        check_int("threads", threads, 1)
    profile: TensorProfile = elastic.profile_
    model = learner.model
    unit_modules = list(profile.units) if profile.granularity == "module" else [unit.rpartition(".")[0] or "<model>" for unit in profile.units]
    (first_unit,) = unit_parameters(model, profile.units[:1], profile.granularity, elastic.candidates())
    first = [name for name, p in model.named_parameters() if any(p is q for q in first_unit)]
    modules = [name for name, _ in model.named_modules() if name]
    x, y = (_numpy(part) for part in batch)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(workdir) if workdir is not None else Path(scratch)
        runs = {}
        for key, trainable in (("all", None), ("first", first)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporter's tracer warnings: the parity gate is the check
                folder = learner.export(root / key, backend="onnxruntime", trainable=trainable, example=tuple(batch))
            options = onnxruntime.SessionOptions()
            options.log_severity_level = 3
            if threads is not None:
                options.intra_op_num_threads = threads
            options.enable_profiling = True
            options.profile_file_prefix = str(root / f"profile-{key}")
            device = OrtOnlineLearner.from_artifacts(folder, session_options=options)
            for _ in range(steps + 1):
                device.train_step(x, y)
            del device  # ONNX Runtime writes the profile when the session goes
            gc.collect()
            if key == "all":  # both exports trace the same forward graph: its scopes and the parameters they read
                owners = _parameter_owners(folder / TRAINING_MODEL, model)
                module_of = cache(partial(_node_module, owners, partial(module_path, modules=modules)))  # per node name
            # one file per session (the eval session's has no runs): the training session's has the most
            files = [_per_step(json.loads(path.read_text()), module_of) for path in root.glob(f"profile-{key}*.json")]
            steps_seen = max(files, key=len, default=[])
            if len(steps_seen) != steps + 1:
                raise RuntimeError(f"ONNX Runtime's profile of the {key!r} export holds {len(steps_seen)} training runs, not {steps + 1}")
            runs[key] = steps_seen[1:]  # the first run allocates: not timed
    costs = _profile(profile, unit_modules, runs["all"], runs["first"])
    if not any(costs.weight_grad_s) and not any(costs.act_grad_s):
        raise ValueError(
            "ONNX Runtime's node names match none of this model's trainable modules, so its backward cannot be split per "
            "unit: export the torch-costed selection (trainable=elastic) instead"
        )
    return costs


def _node_module(owners: dict[str, str], by_scope: Any, node: str) -> str:
    """The module of profiled ``node``: that of its innermost scope in ``owners``, else by its scope names.

    ONNX Runtime's graph optimizer renames fused nodes (``.../MatMul/MatmulTransposeFusion/``)
    but keeps their scope, so a node is matched by scope, not by name."""
    scopes = [scope for scope in owners if node.startswith(scope + "/")]
    return owners[max(scopes, key=len)] if scopes else by_scope(node)


def _parameter_owners(graph: Path, model: Any) -> dict[str, str]:
    """Scope -> the module whose parameter a node of that scope reads first, from the exported training graph.

    Scope names alone lose modules called through a ``ModuleDict`` (peft's ``lora_A['default']``
    is scoped ``default``, its ``lora_B`` ``default_1``); the parameters the scope's nodes read
    name them exactly (the export keeps torch's names behind the wrapper's ``model.`` prefix;
    a ``Linear``'s weight is read by its ``Transpose``, whose scope its ``MatMul`` shares).
    Scopes whose nodes read no parameter are left to their scope names."""
    import onnx

    module_of = {f"model.{name}": name.rpartition(".")[0] or "<model>" for name, _ in model.named_parameters()}
    owners: dict[str, str] = {}
    for node in onnx.load(str(graph), load_external_data=False).graph.node:
        module = next((module_of[name] for name in node.input if name in module_of), None)
        # a gradient node reads the weight of its forward node's scope: the forward node's scope is the module's
        if module is not None and node.name.startswith("/") and _GRAD not in node.name:
            owners.setdefault(node.name.rpartition("/")[0], module)
    return owners


def _numpy(value: Any) -> Any:
    """Arrays for the device learner: tensors converted, dict inputs key by key."""
    if isinstance(value, Mapping):
        return {key: _numpy(part) for key, part in value.items()}
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _per_step(events: list[dict[str, Any]], module_of: Any) -> list[dict[tuple[str, bool], float]]:
    """Seconds per (module, is-backward) in each ``model_run`` of an ONNX Runtime profile, in run order;
    within a run, keys in order of first execution (so forward modules come in forward order)."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    out: list[dict[tuple[str, bool], float]] = [defaultdict(float) for _ in runs]
    for event in sorted(events, key=lambda e: e.get("ts", 0)):
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith(_KERNEL) or name.startswith(_ACCUMULATORS):
            continue
        for index, (start, end) in enumerate(runs):
            if start <= event["ts"] <= end:
                backward = _GRAD in name
                node = name.split(_GRAD)[0] if backward else name.removesuffix(_KERNEL)
                out[index][(module_of(node), backward)] += event["dur"] / 1e6
                break
    return out


def _profile(
    torch_profile: TensorProfile,
    unit_modules: list[str],
    every: list[dict[tuple[str, bool], float]],
    first: list[dict[tuple[str, bool], float]],
) -> TensorProfile:
    """A TensorProfile from the per-step node times of the two exports (see the module's docstring)."""
    n = len(torch_profile.units)
    owner: dict[str, int] = {}  # module -> the index of its first unit
    for index, module in enumerate(unit_modules):
        owner.setdefault(module, index)
    # charge every backward module to the unit whose gradient chain passes it: its own unit, or the
    # next unit in forward order (parameter-free and frozen modules); after the last unit: the tail
    charged: dict[str, int | None] = {}
    following: int | None = None
    for module in reversed([module for module, backward in every[0] if not backward]):
        following = owner.get(module, following)
        charged[module] = following
    samples: dict[str, list[list[float]]] = {"weight": [], "act": [], "forward": [], "tail": []}
    for all_step, first_step in zip(every, first):
        weight, act, forward, tail = [0.0] * n, [0.0] * n, 0.0, 0.0
        for (module, backward), seconds in all_step.items():
            if not backward:
                forward += seconds
                continue
            unit = charged.get(module, owner.get(module))
            chain = first_step.get((module, True), 0.0)
            if unit is None:
                tail += seconds
            elif unit == 0 and module in owner:  # the first unit's module: no input gradient is ever needed
                weight[0] += seconds
            elif module in owner:
                act[unit] += chain
                weight[unit] += max(0.0, seconds - chain)
            else:
                act[unit] += seconds
        samples["weight"].append(weight)
        samples["act"].append(act)
        samples["forward"].append([forward])
        samples["tail"].append([tail])
    (forward_s,), (forward_ci,) = _estimates(samples["forward"])
    (tail_s,), (tail_ci,) = _estimates(samples["tail"])
    weight_s, weight_ci = _estimates(samples["weight"])
    act_s, act_ci = _estimates(samples["act"])
    return dataclasses.replace(  # units, granularity and memory: the torch profile's (the same tensors)
        torch_profile,
        weight_grad_s=weight_s,
        act_grad_s=act_s,
        forward_s=forward_s,
        backward_s=sum(weight_s) + sum(act_s[1:]) + tail_s,
        weight_grad_ci=weight_ci,
        act_grad_ci=act_ci,
        forward_ci=forward_ci,
        rounds=len(every),
        noisy=False,
        clock="wall",
        tail_grad_s=tail_s,
        tail_grad_ci=tail_ci,
    )


def _estimates(rows: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per column of per-step rows, the profiler's robust estimate and its 95% CI half-width."""
    pairs = [robust_estimate(column) for column in zip(*rows)]
    return [estimate for estimate, _ in pairs], [ci for _, ci in pairs]
