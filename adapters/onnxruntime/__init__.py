"""ONNX Runtime on-device training: export a model, keep it learning on a device without torch.

- :mod:`.learner_export`: the learner-level :func:`export` (``learner.export_onnx(...)``);
- :mod:`.build`: artifact generation from a model, loss and optimizer, gated by parity;
- :mod:`.transforms`: rewrites that make a model's ONNX graph trainable by ONNX Runtime;
- :mod:`.fold`: each frozen BatchNorm folded into the convolution before it, in the traced graph;
- :mod:`.trial`: the first run of new artifacts, in a child process (a crash there is a refusal);
- :mod:`.proto`: refuse models that point at external data, without ``onnx`` or torch;
- :mod:`.runtime`: :class:`OrtOnlineLearner`, the device learner (numpy and ONNX Runtime only, no torch);
- :mod:`.step_costs`: :func:`measure_step_costs`, ORT's own cost of each unit, for an ElasticTrainer to select with.

Importing this package imports nothing heavy; each name loads its module on first use.
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "ARTIFACT_FILES",
    "MANIFEST_FILE",
    "ArtifactError",
    "DeviceObserveStats",
    "ExportError",
    "OrtOnlineLearner",
    "ParityError",
    "ParityReport",
    "ReplayRows",
    "UnsupportedOperatorError",
    "export",
    "export_model",
    "measure_step_costs",
    "read_manifest",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "ARTIFACT_FILES": "taste_cl.adapters.onnxruntime.learner_export",
        "export": "taste_cl.adapters.onnxruntime.learner_export",
        "ReplayRows": "taste_cl.adapters.onnxruntime.build",
        "UnsupportedOperatorError": "taste_cl.adapters.onnxruntime.build",
        "export_model": "taste_cl.adapters.onnxruntime.build",
        "DeviceObserveStats": "taste_cl.adapters.onnxruntime.runtime",
        "OrtOnlineLearner": "taste_cl.adapters.onnxruntime.runtime",
        "MANIFEST_FILE": "taste_cl.adapters.device.artifacts",
        "ArtifactError": "taste_cl.adapters.device.artifacts",
        "ExportError": "taste_cl.adapters.device.artifacts",
        "read_manifest": "taste_cl.adapters.device.artifacts",
        "ParityError": "taste_cl.adapters.device.parity",
        "ParityReport": "taste_cl.adapters.device.parity",
        "measure_step_costs": "taste_cl.adapters.onnxruntime.step_costs",
    },
)
