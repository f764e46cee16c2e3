"""ONNX Runtime on-device training: export a model, keep it learning on a device without torch.

The package's other modules: :mod:`.transforms` (export rewrites), :mod:`.build` (artifact
generation with the parity gate of :mod:`taste_cl.adapters.device.parity`) and :mod:`.runtime`
(the torch-free device learner).

:func:`export` is the learner-level entry point (``learner.export(..., backend="onnxruntime")``): it takes
the learner's model, loss, optimizer, counters and replay buffer. Needs the ``[onnx]``
extra (``onnx==1.17.0``, ``onnxruntime-training-cpu==1.19.2``).

>>> import torch
>>> from taste_cl.adapters.onnxruntime.build import export_model
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
>>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
>>> example = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
>>> folder = export_model(model, torch.nn.CrossEntropyLoss(), optimizer, example, "artifacts")  # doctest: +SKIP
>>> from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
>>> device = OrtOnlineLearner.from_artifacts(folder)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl._batch import call_style, index_batch
from taste_cl.adapters.device.artifacts import GENERATED_ROWS_NOTE
from taste_cl.adapters.device.learner_data import BufferedRows, buffered_rows, check_device_trains_alike, synthetic_example
from taste_cl.adapters.device.trainable import freeze_untrained, selected_parameters, selection_record
from taste_cl.adapters.device.transforms import FrozenBatchNorm
from taste_cl.adapters.onnxruntime.build import (
    export_model,
)
from taste_cl.adapters.onnxruntime.manifest import CHECKPOINT, EVAL_MODEL, INFERENCE_MODEL, OPTIMIZER_MODEL, TRAINING_MODEL
from taste_cl.adapters.onnxruntime.transforms import BATCHNORM_MODES
from taste_cl.exceptions import BatchNormModeWarning, GeneratedRowsWarning, TrainingDivergesError, UnstableTrainingError
from taste_cl.learner import OnlineLearner
from taste_cl.learner.heads import reserved_slots
from taste_cl.outputs import selecting

__all__ = ["ARTIFACT_FILES", "export"]

ARTIFACT_FILES = (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT, INFERENCE_MODEL)
_EXAMPLE_ROWS = 8


def export(
    learner: OnlineLearner,
    directory: str | os.PathLike[str],
    *,
    include_replay: bool = True,
    example: tuple[Any, Any] | None = None,
    trainable: Any = None,
    optimizer: str | None = None,
    batch_size: int | None = None,
    reserved_classes: int = 0,
    **options: Any,
) -> Path:
    """Export an :class:`~taste_cl.OnlineLearner` (model, loss, optimizer, counters, buffer).

    ``example`` defaults to up to 8 buffered rows; a learner with fewer (one that has not
    observed yet) gets 8 seeded rows built from its ``input_shape`` and ``num_classes``.
    The parity gate trains on buffered rows, else on ``example``, else on those generated rows:
    then a :class:`~taste_cl.exceptions.GeneratedRowsWarning` (and any refusal's message) says so
    and how to give real rows, the manifest's ``parity.rows`` records it, and the device learner
    measures every one of its first steps. ``trainable`` (parameter names, or an attached
    :class:`~taste_cl.elastic.ElasticTrainer`: its current selection) exports only those
    tensors as trainable, the rest frozen (see
    :func:`~taste_cl.adapters.device.trainable.selected_parameters`); the manifest's
    ``trainable_selection`` records it. ``optimizer``
    (``"sgd"``/``"adamw"``) trains on the device with a fresh optimizer of that kind instead
    of the learner's (state not carried); ``batch_size`` (default: the tuned micro-batch)
    is recorded in the manifest for the app. ``reserved_classes`` widens the exported
    classifier by that many output slots that the device activates on their first label (a
    class added after deployment, without a new export; see
    :mod:`taste_cl.adapters.device.class_slots`). Every other keyword
    (``lr``, ``verify``, ``parity_steps``, ``tolerance``, ``opset``) goes to :func:`export_model`.

    ``batchnorm`` (default ``"auto"``) follows what the learner does: ``"batch"`` (batch
    statistics, running statistics written back after each device step) when it trains a
    BatchNorm with batch statistics, the BatchNorms of its frozen parts
    (:attr:`~taste_cl.OnlineLearner.frozen_norms`) normalising with their running statistics as
    in torch; else ``"frozen"``. When the gate finds that batch statistics diverge or amplify
    rounding on its rows, the export is made with ``"frozen"`` statistics instead and a
    :class:`~taste_cl.exceptions.BatchNormModeWarning` says so and why. The manifest's
    ``batchnorm_choice`` records what was asked, chosen and why. Returns the published folder.
    """
    if not isinstance(learner, OnlineLearner):
        raise TypeError(f"learner must be a taste_cl.OnlineLearner; got {type(learner).__name__}")
    if optimizer not in (None, "sgd", "adamw"):
        raise ValueError(f"`optimizer == {optimizer!r}`, must be None, 'sgd' or 'adamw'")
    check_device_trains_alike(learner)
    with learner.lock:  # a consistent snapshot; the export itself runs without the lock
        model, torch_optimizer = copy.deepcopy((learner.model, learner.optimizer))
        chosen = selected_parameters(learner, trainable)
        selection = selection_record(learner, trainable, chosen)
        freeze_untrained(model, chosen)  # units an ElasticTrainer switched off for now train unless left out
        rows = buffered_rows(learner.replay)
        task = learner.task
        counters = {"samples_seen": learner.samples_seen, "steps": learner.steps}
        output, unsettled = learner.output, learner.output_shape is None
        call = learner.call
        frozen_norms = learner.frozen_norms
        if batch_size is None and learner.batch_plan is not None:
            batch_size = learner.batch_plan.micro_batch_size  # the tuner's choice
    if optimizer is not None:
        lr = options.pop("lr", None) or torch_optimizer.param_groups[0]["lr"]
        kind = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        torch_optimizer = kind([p for p in model.parameters() if p.requires_grad], lr=lr)
    parity_rows = "example"
    if example is None and rows is not None and len(rows) >= 2:
        example = (index_batch(rows.x, slice(0, _EXAMPLE_ROWS)), rows.y[:_EXAMPLE_ROWS])
    elif example is None:
        example, parity_rows = synthetic_example(learner, _EXAMPLE_ROWS), "generated"
        if example is None:
            raise ValueError(
                "the learner's buffer holds fewer than 2 rows and the learner was built without input_shape= and num_classes=: "
                "pass example=(x, y) with at least 2 rows"
            )
    if include_replay and rows is None and learner.replay is not None and learner.replay.capacity:
        # an empty buffer still ships (its capacity and seed): the device rehearses once it holds rows
        seed = learner.replay.state_dict().get("seed", 0)
        rows = BufferedRows(index_batch(example[0], slice(0, 0)), example[1][:0], int(learner.replay.capacity), 0, int(seed))
    batches = None
    if rows is not None and len(rows) >= 2:
        steps = options.get("parity_steps", 3)
        starts = [(i * _EXAMPLE_ROWS) % max(1, len(rows) - 1) for i in range(steps)]
        batches = [(index_batch(rows.x, slice(s, s + _EXAMPLE_ROWS)), rows.y[s : s + _EXAMPLE_ROWS]) for s in starts]
        parity_rows = "replay"
    if parity_rows == "generated" and options.get("verify", True):
        warnings.warn(f"exporting for onnxruntime: {GENERATED_ROWS_NOTE}", GeneratedRowsWarning, stacklevel=3)
    call = call_style(model, example[0], call)  # decided on the model itself: the selecting subclass hides its signature
    asked = options.pop("batchnorm", "auto")
    if asked not in ("auto", *BATCHNORM_MODES):
        raise ValueError(f"`batchnorm == {asked!r}`, must be one of {', '.join(map(repr, ('auto', *BATCHNORM_MODES)))}")
    batch_trained = batch_statistics(model, frozen_norms)
    mode = asked if asked != "auto" else ("batch" if batch_trained else "frozen")
    if mode == "batch":  # the learner's frozen parts normalise with their running statistics on the device too
        for name, module in model.named_modules():
            if name in frozen_norms:
                module.__class__ = FrozenBatchNorm
    model = selecting(model, output, example[0] if unsettled else None, call)  # the graph outputs the tensor the learner trains on
    active_classes = reserved_slots(model, torch_optimizer, learner, reserved_classes, example[0])

    def publish(batchnorm: str, why: str) -> Path:
        extra = {"batchnorm_choice": {"asked": asked, "chosen": batchnorm, "why": why}}
        if selection is not None:
            extra["trainable_selection"] = selection
        return export_model(
            model,  # the exporter copies it; batchnorm="frozen" freezes every BatchNorm of its copy
            learner.loss_fn,
            torch_optimizer,
            example,
            directory,
            replay=rows if include_replay else None,
            replay_batch_size=learner.replay_batch_size,
            train_iterations=learner.train_iterations,
            counters=counters,
            parity_batches=batches,
            batch_size=batch_size,
            task=task,
            trainable=chosen,
            extra=extra,
            active_classes=active_classes,
            parity_rows=parity_rows,
            call=call,
            batchnorm=batchnorm,
            **options,
        )

    if asked != "auto":
        return publish(mode, "asked for")
    if mode == "frozen":
        return publish(mode, "the learner trains no BatchNorm with batch statistics")
    try:
        return publish("batch", f"as the learner trains {_names(batch_trained)}: with batch statistics")
    except (TrainingDivergesError, UnstableTrainingError) as error:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None for m in model.modules()):
            raise  # a BatchNorm without running statistics cannot be frozen
        why = (
            f"the learner trains {_names(batch_trained)} with batch statistics, but on the gate's rows that training "
            f"{'diverges' if isinstance(error, TrainingDivergesError) else 'amplifies rounding'} ({type(error).__name__}); "
            "exported with frozen running statistics instead, which the gate then passed"
        )
        folder = publish("frozen", why)
    warnings.warn(f"exporting for onnxruntime: {why}", BatchNormModeWarning, stacklevel=3)
    return folder


def batch_statistics(model: nn.Module, frozen: Sequence[str]) -> list[str]:
    """The BatchNorm modules of ``model`` that the learner trains with batch statistics: all but those
    in its frozen parts (``OnlineLearner.frozen_norms``), and every one without running statistics."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, FrozenBatchNorm)
        and (name not in frozen or module.running_mean is None)
    ]  # fmt: skip


def _names(modules: Sequence[str], shown: int = 3) -> str:
    listed = ", ".join(repr(name) for name in modules[:shown])
    return f"BatchNorm {listed}" + (f" and {len(modules) - shown} more" if len(modules) > shown else "")
