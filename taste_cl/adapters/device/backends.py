"""Export a learner for on-device training through ONNX Runtime, ExecuTorch, or whichever passes the parity gate.

The two runtimes are complementary: ONNX Runtime trains pooling and AdamW and, with its
exporter's transforms, BatchNorm, Hardswish and LayerNorm, but its training build is deprecated
upstream (1.19.2 was its last release, no wheels for Linux aarch64 or Python 3.13; the
``[onnx-training]`` extra, which cannot share a venv with plain ``onnxruntime``) and has no Einsum
gradient; ExecuTorch is maintained and trains Hardswish, LayerNorm, attention and Einsum,
but ships only SGD, needs BatchNorm frozen (``transforms=("freeze_batchnorm",)``) and gets
some MaxPool2d gradients wrong, which its parity gate catches. ``backend="auto"`` tries them
in :func:`auto_order` (ONNX Runtime first: measured faster, see :data:`AUTO_ORDER`; where the
training build is not installed, the ONNX engine on plain ``onnxruntime`` in its place) and
publishes the first whose export passes its parity gate (the ONNX engine has none yet: it
publishes what it can write in standard ONNX); the manifest's ``"selection"`` records the
chosen backend and why each earlier one was refused. A refusal that blames the training,
not the runtime (:class:`~taste_cl.adapters.device.parity.TrainingDivergesError`,
:class:`~taste_cl.adapters.device.parity.UnstableTrainingError`: torch itself diverges or
amplifies rounding on those batches), stops the search and propagates: the next backend
would train the same way.

Options are passed to each backend that accepts them (``transforms`` and
``max_batch_size`` only reach ExecuTorch; ``batchnorm``, ``optimizer``, ``opset`` only
ONNX Runtime; ``example``, ``lr`` and ``trainable`` both); an option no tried backend
accepts is a ``TypeError``. ``trainable`` (parameter names, or an attached
:class:`~taste_cl.elastic.ElasticTrainer`: its current selection) exports only those
tensors as trainable: a smaller gradient graph and optimizer state, a faster device step.

The trainable set is fixed per artifact folder (ONNX Runtime builds the gradient graph and
the optimizer state for exactly those tensors; ExecuTorch lowers a program whose gradients
are those tensors'), so the device does not re-select on its own: to change the selection,
export again from the learner (weights, buffer and counters travel with it).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from taste_cl.adapters.device.artifacts import (
    ExportError,
    read_manifest,
    staged_folder,
    write_manifest,
)
from taste_cl.adapters.device.loader import training_build_installed
from taste_cl.adapters.device.parity import TrainingDivergesError, UnstableTrainingError

__all__ = ["AUTO_ORDER", "BACKENDS", "auto_order", "export"]

BACKENDS = ("onnxruntime", "executorch", "onnx_engine")
# ONNX Runtime first, measured (`taste-cl bench device --models mlp cnn`, 1 thread, batch 32, see
# docs/executorch.md): on the models both runtimes train, its SGD step ran 2.4x (MLP) and
# 1.4x (stride-2 CNN) eager PyTorch's samples/s, ExecuTorch's (the Python runtime's
# portable kernels) 0.33x and 0.08x, and its export took under a second against 10-20 s.
# ExecuTorch is the fallback for what ONNX Runtime refuses (Einsum; before the ONNX
# exporter's transforms also Hardswish, HardSigmoid and BatchNorm eval graphs) and where ONNX
# Runtime has no wheel (Linux aarch64, Python 3.13). Pass ``order=("executorch", "onnxruntime")``
# to prefer the maintained runtime. Where the training build is not installed (the `[onnx]` extra
# brings plain onnxruntime), :func:`auto_order` puts the ONNX engine in its place: slower than the
# training build where both train (docs/onnx.md), faster than ExecuTorch's portable kernels (issue #45's
# probes, untuned: 0.58x eager on an MLP and 0.34x on a CNN, against ExecuTorch's 0.33x and 0.08x above).
AUTO_ORDER = ("onnxruntime", "executorch")


def auto_order() -> tuple[str, ...]:
    """The backends ``"auto"`` tries by default: :data:`AUTO_ORDER`, with ``"onnx_engine"`` in place of
    ``"onnxruntime"`` where ONNX Runtime's training build is not installed (plain ``onnxruntime``)."""
    if training_build_installed():
        return AUTO_ORDER
    return tuple("onnx_engine" if name == "onnxruntime" else name for name in AUTO_ORDER)


def _exporter(backend: str) -> Callable[..., Path]:
    if backend == "onnx_engine":
        from taste_cl.adapters.onnx_engine.learner_export import export as engine_export

        return engine_export
    if backend == "executorch":
        from taste_cl.adapters.executorch.build import export as et_export

        return et_export
    from taste_cl.adapters.onnxruntime.learner_export import export as ort_export

    return ort_export


_PACKAGES = {"onnxruntime": ("onnx", "onnxruntime"), "executorch": ("executorch",), "onnx_engine": ("onnx", "onnxscript", "onnxruntime")}
_EXTRAS = {"onnxruntime": "onnx-training", "executorch": "executorch", "onnx_engine": "onnx"}
# what ``taste_cl.adapters.onnxruntime.learner_export.export`` passes on to its ``export_model`` through ``**options``
_ORT_PASSTHROUGH = frozenset({"trainable", "batchnorm", "lr", "verify", "parity_steps", "tolerance", "opset"})


def _accepted(function: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The options ``function`` takes: its keyword parameters, plus the documented pass-through of a ``**``."""
    parameters = inspect.signature(function).parameters
    names = {name for name, p in parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        names |= _ORT_PASSTHROUGH
    return {key: value for key, value in options.items() if key in names}


def export(
    learner: Any,
    directory: str | os.PathLike[str],
    *,
    backend: str = "auto",
    order: Sequence[str] | None = None,
    **options: Any,
) -> Path:
    """Write on-device training artifacts for ``learner`` with ``backend``; return the folder.

    ``backend`` is ``"onnxruntime"``, ``"executorch"``, ``"onnx_engine"`` (standard-ONNX graphs on
    plain onnxruntime, driven by the engine loop: :mod:`taste_cl.adapters.onnx_engine.learner_export`;
    it has no parity gate, so ``"auto"`` tries it where the training build is missing or ``order`` names
    it) or ``"auto"`` (try the backends in ``order``, default :func:`auto_order`). A single backend's
    refusal propagates unchanged; under ``"auto"`` an :class:`ExportError` lists every backend's refusal
    when none passes. ``directory`` is written only on success.
    """
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"`backend == {backend!r}`, must be one of {[*BACKENDS, 'auto']}")
    if order is None:
        order = auto_order()
    if isinstance(order, str) or not order or any(name not in BACKENDS for name in order) or len(set(order)) != len(order):
        raise ValueError(f"`order == {order!r}`, must be a non-empty sequence of distinct names from {list(BACKENDS)}")
    order = tuple(order) if backend == "auto" else (backend,)
    exporters = {name: _exporter_or_none(name) for name in order}
    unknown = set(options)
    for function in exporters.values():
        if function is not None:
            unknown -= set(_accepted(function, options))
    if unknown and any(exporters.values()):
        raise TypeError(f"export options {sorted(unknown)} are accepted by none of the backends {list(order)}")
    if backend != "auto":
        return _exporter(backend)(learner, directory, **_accepted(_exporter(backend), options))
    refused: dict[str, str] = {}
    with staged_folder(directory) as stage:
        for name in order:
            function = exporters[name]
            if function is None:
                refused[name] = f"not installed (pip install 'taste-cl[{_EXTRAS[name]}]')"
                continue
            trial = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=stage.parent))
            try:
                function(learner, trial / "out", **_accepted(function, options))
            except (TrainingDivergesError, UnstableTrainingError):
                raise  # the training's, not the backend's: trying the next one only costs minutes
            except Exception as error:  # noqa: BLE001 - under auto, any exporter failure is that backend's recorded refusal
                # exporters also fail with RuntimeError etc. (ONNX Runtime on BatchNorm): record and fall back
                refused[name] = f"{type(error).__name__}: {error}"
                continue
            else:
                for item in (trial / "out").iterdir():
                    os.replace(item, stage / item.name)
                manifest = {k: v for k, v in read_manifest(stage).items() if k != "files"}
                manifest["selection"] = {"backend": name, "order": list(order), "refused": refused}
                write_manifest(stage, manifest)
                return Path(directory).absolute()
            finally:
                shutil.rmtree(trial, ignore_errors=True)
        raise ExportError("no device backend can train this model with parity: " + "; ".join(f"{name}: {reason}" for name, reason in refused.items()))


def _exporter_or_none(backend: str) -> Callable[..., Path] | None:
    """The backend's export function, or None when its packages (for ``"onnxruntime"``: the training build) are not installed."""
    if any(importlib.util.find_spec(package) is None for package in _PACKAGES[backend]):
        return None
    if backend == "onnxruntime" and not training_build_installed():
        return None
    return _exporter(backend)
