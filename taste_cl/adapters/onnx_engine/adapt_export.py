"""Export a model's test-time adaptation for the device: the ONNX engine folder that :func:`load_adapter` runs torch-free.

:func:`export_adapter` writes an engine folder (:func:`~taste_cl.adapters.onnx_engine.export.export_engine`
with ``batchnorm="adapt"``) whose trainable tensors are the normalisation layers' affine weights and
biases and whose optimizer is the :class:`~taste_cl.adaptation.adapter.TestTimeAdapter`'s (``"adam"``:
``AdamW`` with ``betas=(momentum, 0.999)``, ``eps=1e-8``, no weight decay; ``"sgd"``: SGD with
``momentum``), and ``adapter.json``: the method, learning rate, ``min_batch``, ``backoff`` and the guard's
settings. :func:`~taste_cl.adapters.onnx_engine.learner.load_adapter` opens it as an
:class:`~taste_cl.engine.adapt.EngineAdapter` over an :class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine`.

BN-adapt and TENT travel; EATA (its reliability filter, redundancy memory and Fisher anchor) is refused
with :class:`~taste_cl.exceptions.ExportError`. The graphs' batch size is the largest batch the device
adapts on (smaller ones are padded and masked out of the statistics).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl.adaptation.adapter import TestTimeAdapter
from taste_cl.adaptation.methods import affine_parameters
from taste_cl.adapters.onnx_engine.export import export_engine
from taste_cl.adapters.onnx_engine.learner import ADAPTER_FILE, ADAPTER_FORMAT
from taste_cl.exceptions import ExportError

__all__ = ["export_adapter"]


def export_adapter(model: nn.Module, example: torch.Tensor, folder: str | os.PathLike[str], adapter: TestTimeAdapter | None = None) -> Path:
    """Write the device adaptation folder for ``model`` adapted as ``adapter`` says (default: guarded TENT), at
    batches of up to ``example``'s rows; return its path. ``model`` is copied; its current normalisation
    tensors are the anchor the device resets to."""
    adapter = adapter if adapter is not None else TestTimeAdapter()
    method = adapter.method.name
    if method not in ("bn", "tent"):
        raise ExportError(f"the device adapts with 'bn' or 'tent'; this adapter's method is {method!r}")
    names = list(affine_parameters(model))
    if not names:
        raise ExportError("the model has no normalisation layer with affine parameters: nothing for the adaptation graphs to train")
    lr = adapter.method.lr
    settings: dict[str, Any]
    if adapter.optimizer == "adam":
        settings = {"lr": lr, "betas": (adapter.momentum, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        optimizer = "adamw"
    else:
        settings, optimizer = {"lr": lr, "momentum": adapter.momentum}, "sgd"
    target = export_engine(model, example, folder, trainable=names, optimizer=optimizer, batchnorm="adapt", **settings)
    guard = adapter.guard.settings() if adapter.guard is not None else None
    record = {"format": ADAPTER_FORMAT, "method": method, "lr": lr, "min_batch": adapter.min_batch, "backoff": adapter.backoff, "guard": guard}
    (target / ADAPTER_FILE).write_text(json.dumps(record, indent=1))
    return target
