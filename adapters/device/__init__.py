"""What every on-device backend shares: the artifact folder, the parity gate, the export
transforms, the learner's data, and the choice of backend.

- :mod:`.backends`: ``export(learner, folder, backend="auto" | "onnxruntime" | "executorch")``;
- :mod:`.loader`: ``load_learner(folder)``, the device learner the folder's manifest names;
- :mod:`.artifacts`: staged, hashed artifact folders and their manifest;
- :mod:`.parity`: train in torch and in the backend from identical weights, compare;
- :mod:`.transforms`: model rewrites a device backend needs (frozen BatchNorm, no dropout or stochastic depth);
- :mod:`.embeddings`: ``nn.EmbeddingBag`` as trainable gather/reduce ops, and the id bounds devices check;
- :mod:`.learner_data`: what exporters read from an :class:`~taste_cl.OnlineLearner`;
- :mod:`.tuning`: :class:`DeviceBatchTuner`, the batch-size (and threads) tuner of the device learners, no torch.
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "MANIFEST_FILE",
    "ArtifactError",
    "DeviceBatchTuner",
    "ExportError",
    "ParityError",
    "ParityReport",
    "TrainingDivergesError",
    "UnstableTrainingError",
    "export",
    "load_learner",
    "read_manifest",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "AUTO_ORDER": "taste_cl.adapters.device.backends",
        "BACKENDS": "taste_cl.adapters.device.backends",
        "export": "taste_cl.adapters.device.backends",
        "load_learner": "taste_cl.adapters.device.loader",
        "MANIFEST_FILE": "taste_cl.adapters.device.artifacts",
        "ArtifactError": "taste_cl.adapters.device.artifacts",
        "ExportError": "taste_cl.adapters.device.artifacts",
        "read_manifest": "taste_cl.adapters.device.artifacts",
        "DeviceBatchTuner": "taste_cl.adapters.device.tuning",
        "ParityError": "taste_cl.adapters.device.parity",
        "ParityReport": "taste_cl.adapters.device.parity",
        "TrainingDivergesError": "taste_cl.adapters.device.parity",
        "UnstableTrainingError": "taste_cl.adapters.device.parity",
    },
)
