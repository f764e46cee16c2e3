"""Open any exported artifact folder with the device learner its manifest names.

``learner.export(folder, backend="auto")`` may publish ONNX Runtime or ExecuTorch
artifacts, ``backend="onnx_engine"`` ONNX engine ones; :func:`load_learner` reads the (hash-checked)
manifest and returns an :class:`~taste_cl.adapters.onnxruntime.runtime.OrtOnlineLearner`, an
:class:`~taste_cl.adapters.executorch.EtOnlineLearner` or an
:class:`~taste_cl.adapters.onnx_engine.learner.OnnxEngineLearner`, so the app need not know which.
The ONNX Runtime and ONNX engine paths import no torch.

An ONNX Runtime training folder needs ONNX Runtime's training build (``onnxruntime-training-cpu``
1.19.2, the ``[onnx-training]`` extra; deprecated upstream): where plain ``onnxruntime`` is
installed instead, loading one is refused with a message that says how to get the build or to
re-export with ``backend="onnx_engine"``, whose folders train on plain ``onnxruntime``.

>>> from taste_cl.adapters.device import load_learner
>>> device = load_learner("artifacts")  # doctest: +SKIP
>>> device.observe((x, y))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from taste_cl.adapters.device.artifacts import ArtifactError, read_manifest
from taste_cl.exceptions import MissingDependencyError

__all__ = ["TRAINING_BUILD_HINT", "load_learner", "training_build_installed"]

# how to open or replace an ONNX Runtime training folder where the training build is missing
TRAINING_BUILD_HINT = (
    'pip install "taste-cl[onnx-training]" (in a venv without plain onnxruntime: the training build provides '
    'the onnxruntime module itself), or re-export from the torch learner with backend="onnx_engine", '
    "which trains on plain onnxruntime"
)


def training_build_installed() -> bool:
    """Whether the ``onnxruntime`` here is ONNX Runtime's training build, which ``backend="onnxruntime"`` needs.

    Plain ``onnxruntime`` has no ``onnxruntime/training`` package. Looked up on disk, without
    importing ``onnxruntime``: the training build's package imports torch when torch is installed.
    """
    spec = importlib.util.find_spec("onnxruntime")
    locations = (spec.submodule_search_locations if spec is not None else None) or ()
    return any((Path(location) / "training" / "__init__.py").is_file() for location in locations)


def load_learner(directory: str | os.PathLike[str], **options: Any) -> Any:
    """The device learner for the artifact folder ``directory``; ``options`` go to its ``from_artifacts``.

    Raises :class:`ArtifactError` for a folder that is not a checked artifact folder or whose
    manifest names no backend this taste_cl reads, :class:`~taste_cl.exceptions.MissingDependencyError`
    (saying :data:`TRAINING_BUILD_HINT`) for an ONNX Runtime training folder without the training
    build, and ``TypeError`` for an option that backend's loader does not take (``session_options``
    is ONNX Runtime's).
    """
    manifest = read_manifest(directory)
    backend = manifest.get("backend", "onnxruntime")  # ONNX Runtime folders predate the field
    if backend == "onnxruntime":
        if not training_build_installed():
            raise MissingDependencyError("onnxruntime-training-cpu", command=TRAINING_BUILD_HINT)
        from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

        return OrtOnlineLearner.from_artifacts(directory, **options)
    if backend == "onnx_engine":
        from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner  # numpy and onnxruntime only

        return OnnxEngineLearner.from_artifacts(directory, **options)
    if backend == "executorch":
        from taste_cl.adapters.executorch.learner import EtOnlineLearner  # its runtime imports torch

        return EtOnlineLearner.from_artifacts(directory, **options)
    raise ArtifactError(
        f"{os.fspath(directory)!r} holds artifacts of backend {backend!r}; this taste_cl reads 'onnxruntime', 'executorch' and 'onnx_engine'"
    )
