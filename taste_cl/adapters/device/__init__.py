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

The torch-free device runtime imports this package: its names are listed once, in
``__init__.pyi``, and each loads its module on first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
