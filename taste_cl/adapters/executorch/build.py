"""ExecuTorch export: a model or learner as a ``.pte`` training program, published only if parity holds.

:func:`export_model` captures model + loss with ``torch.export`` (batch dimension dynamic,
``Dim("batch", min=2, max=max_batch_size)``), builds the joint forward-backward graph, lowers
it with ``to_edge(...).to_executorch()`` with the weights in an external ``model.ptd``, and
publishes the folder only if the program passes the parity gate against eager PyTorch
(:func:`taste_cl.adapters.device.parity.check_parity`): a model whose gradients ExecuTorch gets
wrong (MaxPool2d in 1.5) is refused with the numbers, never published. :func:`export` does
the same for an :class:`~taste_cl.OnlineLearner`, adding its replay buffer and batch plan.
The device side, :class:`~taste_cl.adapters.executorch.learner.EtOnlineLearner`, loads the
folder (see :mod:`.learner`); it imports nothing from this module.

Needs the ``[executorch]`` extra (``executorch>=1.5,<1.6``); its Python runtime imports torch.

>>> import torch
>>> from torch import nn
>>> from taste_cl.adapters.executorch.build import export_model
>>> from taste_cl.adapters.executorch.learner import EtOnlineLearner
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
>>> folder = export_model(model, nn.CrossEntropyLoss(), sgd, (x, y), "art")  # doctest: +SKIP
>>> device = EtOnlineLearner.from_artifacts(folder)  # doctest: +SKIP
>>> stats = device.observe((x.numpy(), y.numpy()))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl import __version__
from taste_cl._batch import call_model, call_style, check_call, index_batch, split_batch
from taste_cl._checks import check_int
from taste_cl.adapters.device.artifacts import (
    GENERATED_ROWS_NOTE,
    staged_folder,
    write_manifest,
)
from taste_cl.adapters.device.embeddings import index_bounds, rewrite_embedding_bags
from taste_cl.adapters.device.learner_data import buffered_rows, check_device_trains_alike, synthetic_example, task_targets
from taste_cl.adapters.device.parity import ParityReport, TorchTrainer, check_parity
from taste_cl.adapters.device.trainable import freeze_untrained, selected_parameters, selection_record, trained_parameters
from taste_cl.adapters.device.transforms import apply_transforms, conv1d_as_conv2d, needed_transforms
from taste_cl.adapters.executorch.loha import rewrite_loha
from taste_cl.adapters.executorch.replay import save_replay
from taste_cl.adapters.executorch.runtime import (
    BACKEND,
    FORMAT,
    MIN_BATCH,
    PROGRAM,
    REPLAY,
    WEIGHTS,
    EtTrainer,
    IOSpec,
    executorch_runtime,
    sgd_config,
)
from taste_cl.exceptions import GeneratedRowsWarning, UnsupportedModelError
from taste_cl.learner import OnlineLearner
from taste_cl.learner.heads import reserved_slots
from taste_cl.outputs import selecting
from taste_cl.replay import ReplayStrategy

__all__ = ["BACKEND", "UnsupportedModelError", "export", "export_model"]

PARITY_STEPS = 20
PARITY_SIZES = (3, 8)  # alternate two batch sizes: the gate also checks the dynamic batch dimension


class _WithLoss(nn.Module):
    """Model + loss as one module: the loss first (what ExecuTorch differentiates), then the detached outputs;
    ``x`` is passed to the model as ``call`` says (:func:`~taste_cl._batch.call_model`)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], call: str) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.call = call

    def forward(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = call_model(self.model, x, call=self.call)
        return self.loss_fn(out, y), out.detach()


def _split_addmm(program: Any) -> int:
    """Rewrite every ``addmm(bias, a, b)`` of ``program``'s graph (a ``Linear`` with bias) as ``mm(a, b) + bias``,
    in place; returns how many. ExecuTorch 1.5's runtime has an optimised kernel for ``mm`` and ``add``
    (``kernels/optimized/optimized.yaml``) but only the portable loop for ``addmm``, so the same step runs
    faster; the result is the same sum of the same products (the parity gate checks it still)."""
    graph = program.graph_module.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.addmm.default or len(node.args) != 3 or node.kwargs:
            continue  # beta/alpha given: left as it is
        bias, left, right = node.args
        with graph.inserting_before(node):
            product = graph.call_function(torch.ops.aten.mm.default, (left, right))
            total = graph.call_function(torch.ops.aten.add.Tensor, (product, bias))
        product.meta, total.meta = dict(node.meta), dict(node.meta)  # same shape and dtype as the addmm's output
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return rewritten


def _copy_parameter_views(program: Any) -> int:
    """Put a ``clone`` between each trainable parameter and a ``view`` of it (peft IA3's
    ``ia3_l.flatten()``), in place; returns how many. ExecuTorch 1.5 turns a view into an alias of
    its input's memory, and its emitter cannot alias an external mutable weight (it asserts
    ``constant_tag is None``); the clone gives the view a planned tensor to alias. Exact: a copy."""
    graph = program.graph_module.graph
    parameters = set(program.graph_signature.inputs_to_parameters)
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
    rewritten = 0
    for node in list(graph.nodes):
        source = node.args[0] if node.target in views and node.args else None
        if not isinstance(source, torch.fx.Node) or source.op != "placeholder" or source.name not in parameters:
            continue
        with graph.inserting_before(node):
            copy_ = graph.call_function(torch.ops.aten.clone.default, (source,))
        copy_.meta = dict(source.meta)
        node.replace_input_with(source, copy_)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return rewritten


def joint_program(program: Any) -> Any:
    """The joint forward-backward graph of an exported ``program`` whose first output is a scalar loss: the
    gradients of the parameters that require them follow the outputs (ExecuTorch's training layout), with
    ``addmm`` split (:func:`_split_addmm`) and parameter views copied (:func:`_copy_parameter_views`)."""
    from torch.export.experimental import _export_forward_backward

    joint = _export_forward_backward(program)
    _split_addmm(joint)
    _copy_parameter_views(joint)
    return joint


def lower_programs(programs: Mapping[str, Any]) -> Any:
    """``to_edge`` + ``to_executorch`` of exported methods by name, the weights in one external file (trainable ones mutable)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge

    edge = to_edge(dict(programs), compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch(ExecutorchBackendConfig(external_constants=True, external_mutable_weights=True))


def _lower(model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: Any, y: torch.Tensor, max_batch: int, call: str = "auto") -> Any:
    """``torch.export`` + joint forward-backward (:func:`joint_program`) + ``to_executorch`` with external weights."""
    from torch.export import Dim, export
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = Dim("batch", min=MIN_BATCH, max=max_batch)
    x_dims = {key: {0: batch} for key in x} if isinstance(x, Mapping) else {0: batch}
    stage = "torch.export"
    try:
        # the fused CPU attention kernel has no ExecuTorch backward: capture the math one (plain matmul/softmax)
        with sdpa_kernel(SDPBackend.MATH):
            program = export(_WithLoss(model, loss_fn, call), (x, y), dynamic_shapes=(x_dims, {0: batch}), strict=True)
            stage = "the joint forward-backward graph"
            program = joint_program(program)
        stage = "to_edge/to_executorch"
        return lower_programs({"forward": program})
    except Exception as error:  # the exporters raise many unrelated types; name the step and keep the cause
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedModelError(f"ExecuTorch cannot train this model: {stage} failed: {first_line}") from error


def check_kernels(lowered: Any) -> None:
    """Refuse a program calling an operator the runtime has no kernel for (1.5: AvgPool2d's backward), naming it."""
    registered = set(executorch_runtime()._get_operator_names())
    used = {f"{op.name}.{op.overload}" if op.overload else op.name
            for plan in lowered.executorch_program.execution_plan for op in plan.operators}  # fmt: skip
    missing = sorted(used - registered)
    if missing:
        raise UnsupportedModelError(
            f"ExecuTorch cannot train this model: its runtime has no kernel for {', '.join(missing)}, which the training "
            "program calls; replace the layer that needs it or use backend='onnxruntime'"
        )


def write_program(lowered: Any, folder: Path, program: str = PROGRAM, weights: str = WEIGHTS) -> None:
    """Write the program as ``program`` (``model.pte``) and its single external weight file as ``weights`` (``model.ptd``)."""
    (folder / program).write_bytes(lowered.buffer)
    data = getattr(lowered, "_tensor_data", {})
    if len(data) != 1:
        raise UnsupportedModelError(f"expected one external weight file from ExecuTorch, got {sorted(data)}")
    lowered.write_tensor_data_to_file(str(folder))
    (folder / f"{next(iter(data))}.ptd").rename(folder / weights)


def _cpu_example(example: tuple[Any, Any], limit: int) -> tuple[Any, torch.Tensor]:
    """The example on the CPU, floats as float32 (integers keep their dtype), at most ``limit`` rows."""

    def leaf(value: Any) -> torch.Tensor:
        tensor = torch.as_tensor(value).detach().cpu()[:limit]
        return tensor.float() if tensor.is_floating_point() else tensor

    x, y = example
    if not isinstance(x, (Mapping, torch.Tensor, np.ndarray)):
        raise UnsupportedModelError(
            f"the ExecuTorch backend takes x as a tensor or a dict of tensors, not a {type(x).__name__}: "
            "wrap the model to take a dict, or use backend='onnxruntime'"
        )
    return ({key: leaf(value) for key, value in x.items()} if isinstance(x, Mapping) else leaf(x)), leaf(y)


def _as_numpy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _as_numpy(item) for key, item in value.items()}
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _parity_batches(example: tuple[Any, torch.Tensor], steps: int) -> list[tuple[Any, np.ndarray]]:
    """``steps`` batches of sizes 3 and 8 in turn, rows drawn (seeded) from the example batch."""
    x, y = example
    n = y.shape[0]
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        idx = torch.randint(0, n, (PARITY_SIZES[step % len(PARITY_SIZES)],), generator=generator)
        picked = {key: value[idx] for key, value in x.items()} if isinstance(x, Mapping) else x[idx]
        batches.append((_as_numpy(picked), _as_numpy(y[idx])))
    return batches


def prepare_model(model: nn.Module, trained: Sequence[str], transforms: Sequence[str]) -> tuple[nn.Module, list[str]]:
    """A float32 CPU copy of ``model`` in training mode, only ``trained`` requiring gradients
    (the device's SGD never sees the rest), ``nn.EmbeddingBag`` rewritten (ExecuTorch 1.5 has no
    ``_embedding_bag_backward``; the rewrite is exact), ``nn.Conv1d`` computed as a 2-D convolution
    (its 1-D backward kernel refuses to run; exact too), peft LoHa layers in plain ops
    (:mod:`taste_cl.adapters.executorch.loha`; exact) and ``transforms`` applied; with the transforms that changed it."""
    prepared = copy.deepcopy(model).cpu().float().train()
    freeze_untrained(prepared, trained)
    rewritten = ["rewrite_embedding_bags"] if rewrite_embedding_bags(prepared) else []
    rewritten += ["conv1d_as_conv2d"] if conv1d_as_conv2d(prepared) else []
    try:
        rewritten += ["rewrite_loha"] if rewrite_loha(prepared) else []
    except ValueError as error:
        raise UnsupportedModelError(f"ExecuTorch cannot train this model: {error}") from None
    return prepared, rewritten + apply_transforms(prepared, transforms)


def _reference(prepared: nn.Module, loss_fn: Callable[..., torch.Tensor], sgd: dict[str, Any], call: str, dtype: str | None = None) -> TorchTrainer:
    """Torch training ``prepared`` with the device's SGD, in ``dtype`` (default float32); the model takes its inputs as ``call`` says."""
    optimizer = torch.optim.SGD([p for p in prepared.parameters() if p.requires_grad], **sgd)
    return TorchTrainer(prepared, optimizer, loss_fn, forward=partial(call_model, call=call), dtype=dtype)


def _torch_trainer(
    model: nn.Module,
    trained: Sequence[str],
    transforms: Sequence[str],
    loss_fn: Callable[..., torch.Tensor],
    sgd: dict[str, Any],
    call: str,
    dtype: str | None = None,
) -> TorchTrainer:
    """Torch training ``model`` with other transforms or SGD settings, in ``dtype``: an alternative the gate tries."""
    return _reference(prepare_model(model, trained, transforms)[0], loss_fn, sgd, call, dtype)


def _validate_options(max_batch_size: Any, transforms: Any, parity_steps: Any) -> list[str]:
    check_int("max_batch_size", max_batch_size, 8)
    check_int("parity_steps", parity_steps, 1)
    if isinstance(transforms, str) or not isinstance(transforms, Sequence):
        raise TypeError(f"`transforms == {transforms!r}`, must be a sequence of names")
    return list(transforms)


def export_model(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    example: tuple[Any, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    num_classes: int | None = None,
    transforms: Sequence[str] = (),
    lr: float | None = None,
    max_batch_size: int = 128,
    parity_steps: int = PARITY_STEPS,
    extra: Mapping[str, Any] | None = None,
    write_extra: Callable[[Path], dict[str, Any]] | None = None,
    call: str = "auto",
    parity_rows: str = "given",
) -> Path:
    """Export ``model`` for ExecuTorch training into ``directory``, published only if parity holds.

    ``example`` is an ``(x, y)`` batch (``x`` a tensor or a dict of tensors) that fixes the
    shapes and dtypes and provides the parity batches. ``optimizer`` must be an SGD over
    ``model``'s parameters; its hyper-parameters (``lr`` overridable) become the device's, and
    the parameters it does not hold, or that do not require gradients, are frozen on the device
    (no gradient, no SGD step). ``transforms`` (see
    :mod:`taste_cl.adapters.device.transforms`) are applied to a copy first. Raises
    :class:`UnsupportedModelError` when ExecuTorch cannot lower the model,
    :class:`~taste_cl.adapters.device.parity.ParityError` (``.report``) when it trains differently,
    and :class:`~taste_cl.adapters.device.parity.TrainingDivergesError` when torch's own training
    diverges on those batches (saying whether a lower ``lr``, or batch statistics on ONNX Runtime,
    keeps it finite); ``directory`` is then untouched. ``call`` (see :data:`~taste_cl._batch.CALL_MODES`)
    says how a dict ``x`` is passed to the model (spread, or whole to a ``forward(self, batch)``); the
    program's inputs are ``x``'s leaves either way. ``parity_rows`` says where ``example`` came from
    (:data:`~taste_cl.adapters.device.artifacts.PARITY_ROWS`): on ``"generated"`` rows every verdict
    says so, the manifest records it in ``parity.rows``, and the device measures its first steps. Returns the folder.
    """
    executorch_runtime()
    check_call(call)
    names = _validate_options(max_batch_size, transforms, parity_steps)
    sgd = sgd_config(optimizer, lr)
    example = _cpu_example(example, max_batch_size)
    x, y = example
    if y.shape[0] < MIN_BATCH:
        raise ValueError(f"`example` has {y.shape[0]} samples, must have at least {MIN_BATCH}")
    trained = trained_parameters(model, optimizer)
    if not trained:
        raise ValueError("no trainable parameters: the optimizer holds none of the model's with requires_grad")
    prepared, applied = prepare_model(model, trained, names)
    left = needed_transforms(prepared)
    if "freeze_batchnorm" in left:
        raise UnsupportedModelError(
            "ExecuTorch 1.5 cannot train BatchNorm with batch statistics (no out variant of "
            "_native_batch_norm_legit_functional); pass transforms=('freeze_batchnorm',) to train it as an "
            "affine layer with frozen statistics, or use backend='onnxruntime'"
        )
    leaves = dict(x) if isinstance(x, Mapping) else {"input": x}
    spec = IOSpec.of(x, y, num_classes, index_bounds(prepared, partial(call_model, prepared, x, call=call), leaves))
    start = time.perf_counter()
    lowered = _lower(prepared, loss_fn, x, y, max_batch_size, call)
    check_kernels(lowered)
    export_s = time.perf_counter() - start
    batches = _parity_batches(example, parity_steps)
    # settings torch tries on the gate's batches if its own training diverges there
    alternatives = {f"lr={sgd['lr'] / 10:g}": partial(_torch_trainer, model, trained, names, loss_fn, {**sgd, "lr": sgd["lr"] / 10}, call)}
    if "freeze_batchnorm" in applied:
        unfrozen = [name for name in names if name != "freeze_batchnorm"]
        alternatives["backend='onnxruntime' with batchnorm='batch'"] = partial(_torch_trainer, model, trained, unfrozen, loss_fn, sgd, call)
    with staged_folder(directory) as stage:
        write_program(lowered, stage)
        program, data = (stage / PROGRAM).read_bytes(), (stage / WEIGHTS).read_bytes()
        report = check_parity(
            _reference(prepared, loss_fn, sgd, call),
            EtTrainer(program, data, spec, sgd),
            batches,
            backend=BACKEND,
            alternatives=alternatives,
            precise=partial(_reference, prepared, loss_fn, sgd, call, "float64"),
            rows=parity_rows,
        )
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "backend": BACKEND,
            "producer": f"taste_cl {__version__}",
            "program": PROGRAM,
            "weights": WEIGHTS,
            "params": None,
            "io": spec.to_json(),
            "batch": {"min": MIN_BATCH, "max": max_batch_size},
            "optimizer": {"type": "sgd", **sgd},
            "optimizer_state": "not saved: the shipped ExecuTorch SGD exposes no momentum buffers",
            "transforms": applied,
            "parity": _report_json(report),
            "export_s": round(export_s, 3),
            **(extra or {}),
        }
        if write_extra is not None:
            manifest.update(write_extra(stage))
        write_manifest(stage, manifest)
    return Path(directory).absolute()


def _report_json(report: ParityReport) -> dict[str, Any]:
    return {
        "steps": report.steps,
        "max_output_diff": report.max_output_diff,
        "max_loss_diff": report.max_loss_diff,
        "max_param_diff": report.max_param_diff,
        "tolerance": report.param_tol,
        "watched_steps": report.watched_steps,
        "float64_departure": report.exact_departure,
        "rows": report.rows,
        "summary": str(report),
    }


# ------------------------------------------------------------------ the learner
def _learner_example(learner: OnlineLearner, example: tuple[Any, Any] | None) -> tuple[tuple[Any, torch.Tensor], str]:
    """The shape-fixing batch and where it came from (:data:`~taste_cl.adapters.device.artifacts.PARITY_ROWS`):
    ``example``, else the replay buffer's contents (at least 8 samples), else 16 seeded rows from the
    learner's ``input_shape`` and ``num_classes`` (a learner that has not observed yet); targets shaped
    by the learner's task once it has seen a batch."""
    source = "example"
    if example is not None:
        x, y = split_batch(example)
    else:
        rows = buffered_rows(learner.replay)
        size = 0 if rows is None else len(rows)
        if rows is not None and size >= 8:
            (x, y), source = (index_batch(rows.x, slice(0, size)), rows.y), "replay"
        elif (synthetic := synthetic_example(learner, 16)) is not None:
            (x, y), source = synthetic, "generated"
        else:
            raise ValueError(
                "exporting for ExecuTorch needs example data to fix shapes and check parity: pass example=(x, y), "
                f"build the learner with input_shape= and num_classes=, or export after the replay buffer holds at least 8 samples (it holds {size})"
            )
    if learner.output_shape is None:
        return (x, torch.as_tensor(y)), source
    return (x, task_targets(learner.task, x, y, learner.output_shape)), source


def _replay_writer(replay: ReplayStrategy | None) -> Callable[[Path], dict[str, Any]]:
    def write(stage: Path) -> dict[str, Any]:
        return {"replay": None if replay is None else save_replay(stage / REPLAY, replay)}

    return write


def export(
    learner: OnlineLearner,
    directory: str | os.PathLike[str],
    *,
    example: tuple[Any, Any] | None = None,
    trainable: Any = None,
    transforms: Sequence[str] = (),
    lr: float | None = None,
    max_batch_size: int = 128,
    include_replay: bool = True,
    reserved_classes: int = 0,
) -> Path:
    """Export an :class:`~taste_cl.OnlineLearner` for ExecuTorch training (see :func:`export_model`).

    The learning rate defaults to the learner's current one, which a batch plan has already
    scaled by its ``lr_scale`` (the plan is recorded; the device takes one step per
    ``observe``); ``example`` defaults to the replay buffer's contents. ``trainable``
    (parameter names, or an attached :class:`~taste_cl.elastic.ElasticTrainer`: its current
    selection) trains only those tensors on the device (see
    :func:`~taste_cl.adapters.device.trainable.selected_parameters`; the manifest's
    ``trainable_selection`` records it). ``reserved_classes``
    widens the classifier by output slots the device activates on their first label (see
    :mod:`taste_cl.adapters.device.class_slots`).
    """
    if not isinstance(learner, OnlineLearner):
        raise TypeError(f"learner must be a taste_cl.OnlineLearner; got {type(learner).__name__}")
    check_device_trains_alike(learner)
    with learner.lock:
        model, optimizer = copy.deepcopy((learner.model, learner.optimizer))  # the optimizer tells what trains
        chosen = selected_parameters(learner, trainable)
        selection = selection_record(learner, trainable, chosen)
        freeze_untrained(model, chosen)  # units an ElasticTrainer switched off for now train unless left out
        plan = learner.batch_plan
        replay = copy.deepcopy(learner.replay) if include_replay else None
        base, parity_rows = _learner_example(learner, example)
        call = call_style(model, base[0], learner.call)  # decided on the model itself: the selecting subclass hides its signature
        # the program outputs the tensor the learner trains on (the model's output picked by learner.output)
        model = selecting(model, learner.output, base[0] if learner.output_shape is None else None, call)
        active_classes = reserved_slots(model, optimizer, learner, reserved_classes, base[0])
        extra = {
            "batch_plan": None
            if plan is None
            else {
                "micro_batch_size": plan.micro_batch_size,
                "accumulation_steps": plan.accumulation_steps,
                "lr_scale": plan.lr_scale,
            },
            "replay_batch_size": learner.replay_batch_size,
            "train_iterations": learner.train_iterations,
            "counters": {"samples_seen": learner.samples_seen, "steps": learner.steps},
            **({} if selection is None else {"trainable_selection": selection}),
            **({} if active_classes is None else {"active_classes": active_classes}),
        }
    if parity_rows == "generated":
        warnings.warn(f"exporting for executorch: {GENERATED_ROWS_NOTE}", GeneratedRowsWarning, stacklevel=3)
    return export_model(
        model,
        learner.loss_fn,
        optimizer,
        base,
        directory,
        num_classes=learner.num_classes if active_classes is None else len(active_classes) + reserved_classes,
        transforms=transforms,
        lr=lr,
        max_batch_size=max_batch_size,
        extra=extra,
        write_extra=_replay_writer(replay),
        call=call,
        parity_rows=parity_rows,
    )
