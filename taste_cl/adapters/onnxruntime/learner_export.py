"""ONNX Runtime on-device training: export a model, keep it learning on a device without torch.

The package's other modules: :mod:`.transforms` (export rewrites), :mod:`.build` (artifact
generation with the parity gate of :mod:`taste_cl.adapters.device.parity`) and :mod:`.runtime`
(the torch-free device learner).

:func:`export` is the learner-level entry point (``learner.export(..., backend="onnxruntime")``): it takes
the learner's model, loss, optimizer, counters and replay buffer. Needs the ``[onnx]``
extra (``onnx==1.17.0``, ``onnxruntime-training-cpu==1.19.2``).

>>> import torch
>>> from taste_cl.adapters.onnxruntime.learner_export import export_model
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
from pathlib import Path
from typing import Any

import torch

from taste_cl._batch import index_batch
from taste_cl.adapters.device.learner_data import BufferedRows, buffered_rows, check_device_trains_alike, synthetic_example
from taste_cl.adapters.device.trainable import freeze_untrained, selected_parameters, selection_record
from taste_cl.adapters.onnxruntime.build import (
    export_model,
)
from taste_cl.adapters.onnxruntime.manifest import CHECKPOINT, EVAL_MODEL, INFERENCE_MODEL, OPTIMIZER_MODEL, TRAINING_MODEL
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
    The parity gate trains on buffered rows. ``trainable`` (parameter names, or an attached
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
    (``batchnorm``, ``lr``, ``verify``, ``parity_steps``, ``tolerance``,
    ``opset``) goes to :func:`export_model`. Returns the published folder.
    """
    if not isinstance(learner, OnlineLearner):
        raise TypeError(f"learner must be a taste_cl.OnlineLearner; got {type(learner).__name__}")
    if optimizer not in (None, "sgd", "adamw"):
        raise ValueError(f"`optimizer == {optimizer!r}`, must be None, 'sgd' or 'adamw'")
    check_device_trains_alike(learner)
    with learner._lock:  # a consistent snapshot; the export itself runs without the lock
        model, torch_optimizer = copy.deepcopy((learner.model, learner.optimizer))
        chosen = selected_parameters(learner, trainable)
        selection = selection_record(learner, trainable, chosen)
        freeze_untrained(model, chosen)  # units an ElasticTrainer switched off for now train unless left out
        rows = buffered_rows(learner.replay)
        task = learner.task
        counters = {"samples_seen": learner.samples_seen, "steps": learner.steps}
        output, unsettled = learner.output, learner.output_shape is None
        if batch_size is None and learner.batch_plan is not None:
            batch_size = learner.batch_plan.micro_batch_size  # the tuner's choice
    if optimizer is not None:
        lr = options.pop("lr", None) or torch_optimizer.param_groups[0]["lr"]
        kind = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        torch_optimizer = kind([p for p in model.parameters() if p.requires_grad], lr=lr)
    if example is None and rows is not None and len(rows) >= 2:
        example = (index_batch(rows.x, slice(0, _EXAMPLE_ROWS)), rows.y[:_EXAMPLE_ROWS])
    elif example is None:
        example = synthetic_example(learner, _EXAMPLE_ROWS)
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
    model = selecting(model, output, example[0] if unsettled else None)  # the graph outputs the tensor the learner trains on
    active_classes = reserved_slots(model, torch_optimizer, learner, reserved_classes, example[0])
    return export_model(
        model,
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
        extra=None if selection is None else {"trainable_selection": selection},
        active_classes=active_classes,
        **options,
    )
