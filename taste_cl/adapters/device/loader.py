"""Open any exported artifact folder with the device learner its manifest names.

``learner.export(folder, backend="auto")`` may publish ONNX Runtime or ExecuTorch
artifacts, ``backend="onnx_engine"`` ONNX engine ones; :func:`load_learner` reads the (hash-checked)
manifest and returns an :class:`~taste_cl.adapters.onnxruntime.runtime.OrtOnlineLearner`, an
:class:`~taste_cl.adapters.executorch.EtOnlineLearner` or an
:class:`~taste_cl.adapters.onnx_engine.learner.OnnxEngineLearner`, so the app need not know which.
The ONNX Runtime and ONNX engine paths import no torch.

>>> from taste_cl.adapters.device import load_learner
>>> device = load_learner("artifacts")  # doctest: +SKIP
>>> device.observe((x, y))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

from taste_cl.adapters.device.artifacts import ArtifactError, read_manifest

__all__ = ["load_learner"]


def load_learner(directory: str | os.PathLike[str], **options: Any) -> Any:
    """The device learner for the artifact folder ``directory``; ``options`` go to its ``from_artifacts``.

    Raises :class:`ArtifactError` for a folder that is not a checked artifact folder or whose
    manifest names no backend this taste_cl reads, and ``TypeError`` for an option that
    backend's loader does not take (``session_options`` is ONNX Runtime's).
    """
    manifest = read_manifest(directory)
    backend = manifest.get("backend", "onnxruntime")  # ONNX Runtime folders predate the field
    if backend == "onnxruntime":
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
