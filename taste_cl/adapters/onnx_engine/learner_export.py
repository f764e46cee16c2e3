"""Export an :class:`~taste_cl.OnlineLearner` as an ONNX engine learner folder: ``learner.export(folder, backend="onnx_engine")``.

What travels: the model (the ``trainable=`` selection, default what the learner trains), the
optimizer (``torch.optim.SGD`` with momentum, dampening, Nesterov and weight decay, or ``AdamW``)
with its state and live learning rate, ``num_classes`` (the output width), the strategy (ER,
ER-ACE, DER++ with ``alpha``/``beta``, LwF with ``alpha``/``temperature``, its teacher and its
snapshot period), ``max_grad_norm``, ``replay_batch_size``, ``train_iterations``, the replay
buffer (``ReservoirReplay`` -> ``"reservoir"``, ``ClassBalancedReplay`` -> ``"class_balanced"``:
its capacity, rows, labels, counts and, for DER++, the stored logits) and the buffer's generator
(:mod:`taste_cl.replay.draws`), so the device keeps and replays exactly the rows the torch learner
would have (or a fresh one from ``seed=``), and the monitor (its settings, its Page-Hinkley test
with its state, its probe's rows, ids and generator, its scores and events: the device's
:class:`~taste_cl.engine.monitor.LoopMonitor` goes on with the same drift and forgetting events;
it scores with the eval-mode forward, which is what a torch monitor's ``prequential="auto"``
uses for a model whose output depends on the mode). The folder is written by
:meth:`~taste_cl.adapters.onnx_engine.learner.OnnxEngineLearner.save` (staged and hashed).

An attached :class:`~taste_cl.elastic.ElasticTrainer` travels when ``trainable`` is left None: the
folder gets one pruned backward graph per cut (:mod:`~taste_cl.adapters.onnx_engine.cuts`) and the
trainer's settings and units, and the device re-selects every ``reselect_every`` steps from its own
measured costs and gradients (:class:`~taste_cl.engine.elastic.ElasticEngine`); it starts with a probe
and times its cuts on its first training step. ``trainable=elastic`` (or names) asks for its current
selection, fixed, as before. What the device cycle cannot carry is refused, named: a
``memory_budget_bytes``, two ElasticTrainers, an optimizer other than SGD with ``dampening=0``
(a unit rejoining must start its momentum as torch's does).

Refused before anything is written, with :class:`~taste_cl.exceptions.ExportError` naming what:
another optimizer, a custom strategy or buffer, a monitor whose drift detector is not a ``PageHinkley``,
a loss other than plain mean cross-entropy, a
task other than classification, structured inputs (dicts, tuples) or a model output that is not
``(n, classes)``, a callable ``output=`` selection, a learner that has not settled its input
(never observed and no ``input_shape=``), and ``batchnorm="batch"``.

BatchNorm: the engine's graphs run BatchNorm on its running statistics (eval mode). Like the
ONNX Runtime export's ``batchnorm="auto"``, which falls back to frozen statistics with a
:class:`~taste_cl.exceptions.BatchNormModeWarning` when batch statistics cannot be exported with
parity, a learner that trains BatchNorm with batch statistics is exported with them frozen and
that warning; ``batchnorm="frozen"`` asks for it (no warning), ``"batch"`` is refused. The
manifest's ``export.batchnorm_choice`` records what was asked, chosen and why. Dropout is off in
the graphs, as in every device export.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from taste_cl.adapters.device.learner_data import buffered_rows, synthetic_example
from taste_cl.adapters.device.trainable import freeze_untrained, selected_parameters, selection_record
from taste_cl.adapters.device.transforms import FrozenBatchNorm
from taste_cl.adapters.onnx_engine.cuts import cut_groups, write_cuts
from taste_cl.adapters.onnx_engine.engine import OnnxEngine
from taste_cl.adapters.onnx_engine.export import export_engine
from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner
from taste_cl.adapters.onnxruntime.manifest import MAX_CAPACITY
from taste_cl.elastic import ElasticTrainer
from taste_cl.elastic.profiling import unit_names, unit_parameters
from taste_cl.engine.elastic import SETTINGS as ELASTIC_SETTINGS
from taste_cl.engine.monitor import SETTINGS as MONITOR_SETTINGS
from taste_cl.engine.monitor import LoopMonitor
from taste_cl.engine.probe_guard import SETTINGS as PROBE_GUARD_SETTINGS
from taste_cl.engine.probe_guard import LoopProbeGuard
from taste_cl.exceptions import BatchNormModeWarning, ExportError
from taste_cl.guards.probe import ProbeGuard
from taste_cl.learner import OnlineLearner
from taste_cl.monitor import PageHinkley, StabilityPlasticityMonitor
from taste_cl.replay import ClassBalancedReplay, ReplayStrategy, ReservoirReplay
from taste_cl.replay.draws import decode_rng
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy

__all__ = ["DEFAULT_BATCH", "DEFAULT_LWF_EVERY", "export"]

DEFAULT_BATCH = 32
DEFAULT_LWF_EVERY = 50
_STRATEGIES: dict[type[Strategy], str] = {ExperienceReplay: "er", ERACE: "er_ace", DERPlusPlus: "der++", LwF: "lwf"}
_BUFFERS: dict[type[ReplayStrategy], str] = {ReservoirReplay: "reservoir", ClassBalancedReplay: "class_balanced"}
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _plain_mean_cross_entropy(loss_fn: Any) -> bool:
    if loss_fn is F.cross_entropy:
        return True
    return (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.label_smoothing == 0
        and loss_fn.ignore_index < 0
        and loss_fn.reduction == "mean"
    )


def _refusals(learner: OnlineLearner, batchnorm: str) -> tuple[str, str | None, float]:
    """The strategy's and the buffer's names and the live lr; ``ExportError`` naming the first thing the engine loop cannot run."""
    strategy = _STRATEGIES.get(type(learner.strategy))  # exact types: a subclass is a custom strategy
    if strategy is None:
        raise ExportError(
            f"the onnx_engine backend runs the strategies ER, ER-ACE, DER++ and LwF; this learner's is {type(learner.strategy).__name__} "
            f"(name {learner.strategy.name!r}), a custom strategy whose loss the device loop cannot form"
        )
    replay = None if learner.replay is None else _BUFFERS.get(type(learner.replay))
    if learner.replay is not None and replay is None:
        raise ExportError(
            f"the onnx_engine backend keeps a ReservoirReplay or ClassBalancedReplay buffer; this learner's is {type(learner.replay).__name__}"
        )
    if learner.replay is not None and learner.replay.capacity > MAX_CAPACITY:
        raise ExportError(f"the buffer's capacity {learner.replay.capacity} is over the device bound of {MAX_CAPACITY} rows")
    optimizer = learner.optimizer
    if type(optimizer) not in (torch.optim.SGD, torch.optim.AdamW):
        raise ExportError(f"the onnx_engine backend steps torch.optim.SGD or AdamW; this learner's optimizer is {type(optimizer).__name__}")
    if len(optimizer.param_groups) != 1:
        raise ExportError(
            f"the onnx_engine backend steps one parameter group; this learner's {type(optimizer).__name__} has {len(optimizer.param_groups)}"
        )
    group = optimizer.param_groups[0]
    if group.get("maximize") or group.get("amsgrad"):
        raise ExportError(f"the onnx_engine backend's optimizer graph does not do maximize=True or amsgrad=True ({type(optimizer).__name__})")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) or not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ExportError(f"the optimizer's learning rate {lr!r} must be a finite number > 0")
    if not _plain_mean_cross_entropy(learner.loss_fn):
        raise ExportError(
            f"the onnx_engine backend trains with mean cross-entropy; this learner's loss is {type(learner.loss_fn).__name__} "
            "(or a CrossEntropyLoss with weights, label smoothing, an ignore index or a sum)"
        )
    if learner.task is not None and learner.task.name != "classification":
        raise ExportError(f"the onnx_engine backend trains classification; this learner's task is {learner.task.name}")
    spec = learner.input_spec
    if spec is None:
        raise ExportError("the learner has not settled its input (it observed nothing and has no input_shape=): observe a batch first")
    if not spec.is_tensor:
        raise ExportError("the onnx_engine backend takes one input tensor; this learner's inputs are structured (a dict, tuple or list)")
    if learner.output_shape is not None and len(learner.output_shape) != 1:
        raise ExportError(f"the onnx_engine backend trains (n, classes) outputs; this learner's are (n, {', '.join(map(str, learner.output_shape))})")
    if learner.output is not None and not learner.output.saveable:
        raise ExportError(f"the learner selects its trained output with a callable ({learner.output}); the export takes a key or an index")
    if batchnorm not in ("auto", "frozen"):
        raise ExportError(
            f"`batchnorm == {batchnorm!r}`: the onnx_engine backend runs BatchNorm on its running statistics; pass 'auto' or 'frozen' "
            "(or use backend='onnxruntime', which trains batch statistics)"
        )
    return strategy, replay, float(lr)


def _replay_counts(state: dict[str, Any], size: int, seen: int) -> dict[str, Any]:
    """The device loop's replay counts (:meth:`~taste_cl.engine.loop.LoopReplay.counts`) for a torch buffer's state."""
    if "classes" not in state:
        return {"size": size, "seen": seen}
    class_seen = list(state["seen"])
    return {"size": size, "seen": sum(class_seen), "classes": list(state["classes"]), "class_seen": class_seen,
            "slots": [[int(i) for i in slots.tolist()] for slots in state["slots"]]}  # fmt: skip


def _monitor_settings(monitor: StabilityPlasticityMonitor) -> LoopMonitor:
    """The device loop's monitor with the torch monitor's settings (``ExportError`` for what it cannot run)."""
    detector = monitor.drift_detector
    if type(detector) is not PageHinkley:
        raise ExportError(f"the onnx_engine backend's monitor runs PageHinkley; this learner's drift detector is {type(detector).__name__}")
    settings = monitor.settings()
    drift = {"min_instances": detector.min_instances, "delta": detector.delta, "threshold": detector.threshold, "alpha": detector.alpha}
    try:
        return LoopMonitor.from_settings({key: settings[key] for key in MONITOR_SETTINGS[:-1]} | {"drift": drift})
    except ValueError as error:
        raise ExportError(f"the learner's monitor does not fit the device loop: {error}") from None


def _monitor_state(state: dict[str, Any], dtype: np.dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The device monitor's state (:meth:`~taste_cl.engine.monitor.LoopMonitor.state`) for a torch monitor's
    ``state_dict``: the same probe rows, ids and generator, drift test, scores and events (details that are not
    plain finite values stay behind)."""
    ids, flags = state["last_correct"]
    counts, arrays = _probe_rows(state["probe"], "monitor.probe", dtype)
    arrays |= {
        "monitor.recent": np.asarray(state["recent"], dtype=np.float64).reshape(-1, 3),
        "monitor.last_ids": np.asarray(ids, dtype=np.int64),
        "monitor.last_correct": np.asarray(flags, dtype=np.bool_),
    }
    plain = {key: state[key] for key in ("steps", "samples_seen", "class_accuracy", "best_class_accuracy", "stability", "forgetting",
                                         "anytime", "flips", "last_drift_step", "event_counts")}  # fmt: skip
    plain |= {
        "recent": len(state["recent"]),
        "last_correct": len(ids),
        "events": [{**event, "details": {k: v for k, v in event["details"].items() if _plain(v)}} for event in state["events"]],
        "drift": state["drift_detector"],
        "probe": counts,
    }
    return plain, arrays


def _probe_rows(probe: dict[str, Any], name: str, dtype: np.dtype) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The counts and ``<name>.x/.y/.sid`` arrays of a :class:`~taste_cl.engine.monitor.ProbeRows` for a torch probe
    buffer's ``state_dict`` (a class-balanced one, or an empty reservoir: a probe before its first batch)."""
    storage = probe["storage"]
    size = storage["size"]
    arrays = {}
    if size:
        arrays = {
            f"{name}.x": storage["x"].detach().cpu().numpy().astype(dtype),
            f"{name}.y": storage["y"].cpu().numpy().astype(np.int64),
            f"{name}.sid": storage["fields"]["sid"].cpu().numpy().astype(np.int64),
        }
    counts = {"size": size, "classes": [], "class_seen": [], "slots": []}
    if "classes" in probe or size:
        counts = {key: value for key, value in _replay_counts(probe, size, 0).items() if key != "seen"}
    return counts | {"rng": decode_rng(probe["generator"].numpy()).bit_generator.state}, arrays


def _probe_guard(learner: OnlineLearner) -> tuple[LoopProbeGuard | None, dict[str, Any]]:
    """The device loop's probe guard with the learner's ``ProbeGuard`` settings and that guard's state (None, {}: none);
    ``ExportError`` for what the device cannot carry: two guards, a fixed probe, a window half done."""
    guards = [plugin for plugin in learner.plugins if isinstance(plugin, ProbeGuard)]
    if not guards:
        return None, {}
    if len(guards) > 1:
        raise ExportError(f"the onnx_engine backend runs one ProbeGuard; this learner has {len(guards)}")
    guard = guards[0]
    if guard.fixed_probe is not None:
        raise ExportError("the onnx_engine backend's probe guard fills its probe from accepted windows; this ProbeGuard has a fixed probe")
    state = guard.state_dict()
    if state["calls"] % guard.window:
        left = guard.window - state["calls"] % guard.window
        raise ExportError(
            f"the ProbeGuard's update window is half done ({state['calls'] % guard.window} of {guard.window} observes): export when it "
            f"closes, after {left} more observe(s), so the device starts from an accepted snapshot"
        )
    settings = {key: getattr(guard, key) for key in PROBE_GUARD_SETTINGS}  # the torch guard's attributes of those names
    try:
        return LoopProbeGuard(**settings), state
    except ValueError as error:
        raise ExportError(f"the learner's ProbeGuard does not fit the device loop: {error}") from None


def _carry_guard(device: OnnxEngineLearner, state: dict[str, Any]) -> None:
    """Give the device's probe guard the torch guard's counters, probe and baseline, with the device as it is now as
    the accepted snapshot (the export is at a window's end, where torch's snapshot is the learner itself)."""
    guard = device.probe_guard
    assert guard is not None
    guard.attach(device)
    plain, arrays = guard.state()
    counts, rows = _probe_rows(state["probe"], "probe_guard.probe", device.input_dtype)
    ids, correct = state["baseline_correct"]
    arrays = {k: v for k, v in arrays.items() if not k.startswith("probe_guard.probe.")} | rows
    arrays |= {"probe_guard.baseline.ids": np.asarray(ids, np.int64), "probe_guard.baseline.correct": np.asarray(correct, np.bool_)}
    plain |= {key: state[key] for key in ("windows", "rollbacks", "calls", "next_id")} | {"probe": counts, "baseline": len(ids)}
    try:
        guard.load_state(guard.check_state(plain, arrays, device), arrays)
    except ValueError as error:
        raise ExportError(f"the learner's ProbeGuard state does not fit the device loop: {error}") from None


def _elastic(learner: OnlineLearner, trainable: Any, example: Any) -> dict[str, Any] | None:
    """The device cycle's settings and units for the learner's ElasticTrainer (None: none attached, or ``trainable=``
    fixes a selection); ``ExportError`` naming what the device cycle cannot carry."""
    trainers = [plugin for plugin in learner.plugins if isinstance(plugin, ElasticTrainer)]
    if trainable is not None or not trainers:
        return None
    if len(trainers) > 1:
        raise ExportError(f"the onnx_engine backend runs one elastic cycle; this learner has {len(trainers)} ElasticTrainers")
    elastic = trainers[0]
    if elastic.memory_budget_bytes is not None:
        raise ExportError("the onnx_engine backend's elastic cycle budgets time only; this ElasticTrainer has memory_budget_bytes set")
    group = learner.optimizer.param_groups[0]
    if type(learner.optimizer).__name__ != "SGD" or group.get("dampening", 0.0):
        raise ExportError(
            "the onnx_engine backend's elastic cycle steps SGD with dampening=0 (a unit rejoining the selection starts its "
            f"momentum as torch's does); this learner's optimizer is {type(learner.optimizer).__name__}"
            + (f" with dampening={group['dampening']}" if group.get("dampening") else "")
        )
    candidates = elastic.candidates()
    if elastic.profile_ is not None:
        units = list(elastic.profile_.units)
    elif example is not None:
        units = unit_names(learner.model, example[0][:1], granularity=elastic.granularity, trainable=candidates, call=learner.call)
    else:
        raise ExportError("the ElasticTrainer's units are unknown: observe a batch first (its profile orders them)")
    names = {id(p): name for name, p in learner.model.named_parameters()}
    tensors = [[names[id(p)] for p in params] for params in unit_parameters(learner.model, units, elastic.granularity, candidates)]
    settings = {key: getattr(elastic, key) for key in ELASTIC_SETTINGS}
    return settings | {"units": tensors, "names": units}


def _plain(value: Any) -> bool:
    return isinstance(value, (str, int, bool, type(None))) or (isinstance(value, float) and math.isfinite(value))


def _batch_trained(model: nn.Module, frozen: list[str]) -> list[str]:
    """The BatchNorm modules the learner trains with batch statistics (those outside its frozen parts)."""
    return [
        name for name, module in model.named_modules()
        if isinstance(module, _BATCHNORMS) and not isinstance(module, FrozenBatchNorm) and (name not in frozen or module.running_mean is None)
    ]  # fmt: skip


def export(
    learner: OnlineLearner,
    directory: str | os.PathLike[str],
    *,
    trainable: Any = None,
    include_replay: bool = True,
    batch_size: int | None = None,
    seed: int | None = None,
    lwf_every: int | None = None,
    batchnorm: str = "auto",
) -> Path:
    """Write ``learner`` as an ONNX engine learner folder at ``directory`` and return its path (see the module).

    ``trainable``: parameter names or an attached ElasticTrainer (as for the other backends).
    ``include_replay=False`` ships an empty buffer of the same capacity. ``batch_size``: the graphs'
    fixed batch (default: the tuned micro-batch, else 32; other sizes run as padded chunks).
    ``seed``: seeds a fresh generator for the device loop (default: the loop continues the buffer's
    generator, the same draws the torch learner would make). ``lwf_every``: LwF's
    snapshot period in observes (default: the strategy's ``every``); an LwF that snapshots on drift
    does so on the device too, on its monitor's ``drift_detected``.
    """
    if not isinstance(learner, OnlineLearner):
        raise TypeError(f"learner must be a taste_cl.OnlineLearner; got {type(learner).__name__}")
    with learner.lock:  # a consistent snapshot; the export itself runs without the lock
        strategy, replay_kind, lr = _refusals(learner, batchnorm)
        model, optimizer = copy.deepcopy((learner.model, learner.optimizer))
        chosen = selected_parameters(learner, trainable)
        selection = selection_record(learner, trainable, chosen)
        rows = buffered_rows(learner.replay) if include_replay else None
        replay_state = learner.replay.state_dict() if learner.replay is not None else {}
        stored = replay_state.get("storage", {}).get("fields", {}).get("logits") if strategy == "der++" and rows is not None else None
        lwf = learner.strategy if isinstance(learner.strategy, LwF) else None
        teacher = None if lwf is None or lwf.teacher is None else {k: v.detach().cpu().float().numpy() for k, v in lwf.teacher.named_parameters()}
        chunks = lwf.chunks if lwf is not None else 0
        trained_bn = _batch_trained(learner.model, learner.frozen_norms)
        output = None if learner.output is None or callable(learner.output.how) else learner.output.how  # a callable is refused above
        plan = learner.batch_plan
        example = synthetic_example(learner, 2)
        settings: dict[str, Any] = {
            "lr": lr,
            "num_classes": 0,  # the output width, once traced
            "strategy": strategy,
            "replay": replay_kind,
            "capacity": int(learner.replay.capacity) if learner.replay is not None else 1,
            "replay_batch_size": learner.replay_batch_size,
            "train_iterations": learner.train_iterations,
            "max_grad_norm": learner.max_grad_norm,
            "alpha": float(getattr(learner.strategy, "alpha", 1.0)),
            "beta": float(getattr(learner.strategy, "beta", 1.0)),
            "temperature": float(getattr(learner.strategy, "temperature", 2.0)),
            "lwf_every": lwf_every or (lwf.every if lwf is not None else DEFAULT_LWF_EVERY),
            "lwf_on_drift": lwf is not None and lwf.on_drift,
            "seed": int(replay_state.get("seed", 0)) if seed is None else seed,
        }
        counters = {"samples_seen": learner.samples_seen, "steps": learner.steps}
        monitor, monitor_state = _monitor_settings(learner.monitor), learner.monitor.state_dict()
        probe_guard, guard_state = _probe_guard(learner)
        elastic = _elastic(learner, trainable, example)
    if batch_size is None:
        batch_size = plan.micro_batch_size if plan is not None else DEFAULT_BATCH
    freeze_untrained(model, chosen)
    if rows is not None and len(rows):
        source = rows.x
    elif example is not None:
        source = example[0]
    else:
        raise ExportError("the learner's buffer is empty and its input is not a float tensor of known shape: observe a batch first")
    x = source[torch.arange(batch_size) % source.shape[0]].detach().cpu()
    why = (
        "asked for" if batchnorm == "frozen"
        else f"the engine runs BatchNorm on running statistics; the learner trains {', '.join(map(repr, trained_bn))} with batch statistics"
        if trained_bn else "the learner trains no BatchNorm with batch statistics"
    )  # fmt: skip
    if batchnorm == "auto" and trained_bn:
        warnings.warn(f"exporting for onnx_engine: {why}; exported with them frozen", BatchNormModeWarning, stacklevel=3)
    info = {
        "source": "OnlineLearner",
        "batchnorm_choice": {"asked": batchnorm, "chosen": "frozen", "why": why},
        "trainable_selection": selection,
        "lwf_every_source": "lwf_every=" if lwf_every else "LwF.every" if lwf is not None and lwf.every else "default",
        "counters": counters,
    }
    if elastic is not None:
        info["elastic"] = "re-selected on the device from its own costs and gradients: a probe and its cuts timed on its first training step"
    parent = Path(directory).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".onnx_engine.", dir=parent))
    try:
        engine_folder = export_engine(model, x, work / "engine", trainable=chosen, optimizer=optimizer, output=output)
        if elastic is not None:
            write_cuts(engine_folder, cut_groups(elastic["units"]))
        engine = OnnxEngine(engine_folder)
        settings["num_classes"] = engine.output_shape[-1]
        device = OnnxEngineLearner(engine, info=info, monitor=monitor, probe_guard=probe_guard, elastic=elastic, **settings)
        plain, arrays = device.state()
        plain.pop("probe_guard")  # carried after the rest loads: its snapshot is the loaded state (_carry_guard)
        arrays = {k: v for k, v in arrays.items() if not k.startswith("probe_guard.")}
        plain["monitor"], monitor_arrays = _monitor_state(monitor_state, device.input_dtype)
        arrays |= monitor_arrays
        if rows is not None and len(rows):
            rx = rows.x.detach().cpu().numpy().astype(device.input_dtype)
            outputs = stored.detach().cpu().float().numpy() if stored is not None else engine.forward(rx, train=False)
            arrays |= {"replay.x": rx, "replay.y": rows.y.detach().cpu().numpy().astype(np.int64), "replay.outputs": outputs}
            plain["replay"] = _replay_counts(replay_state, len(rows), rows.seen)
        if seed is None and "generator" in replay_state:  # the device continues the torch buffer's draws
            plain["rng"] = decode_rng(replay_state["generator"].numpy()).bit_generator.state
        if teacher is not None:
            arrays |= {f"teacher.{name}": teacher[name] for name in engine.trainable}
            plain["teacher"] = True
        plain["observes"] = chunks
        try:
            device.load_state(plain, arrays)
        except ValueError as error:
            raise ExportError(f"the learner's state does not fit the device loop: {error}") from None
        if probe_guard is not None:
            _carry_guard(device, guard_state)
        device.samples_seen = counters["samples_seen"]
        return device.save(directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)
