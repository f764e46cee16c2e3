"""ONNX Runtime on-device training: export a model, keep it learning on a device without torch.

- :mod:`.learner_export`: the learner-level :func:`export` (``learner.export(..., backend="onnxruntime")``);
- :mod:`.build`: artifact generation from a model, loss and optimizer, gated by parity;
- :mod:`.transforms`: rewrites that make a model's ONNX graph trainable by ONNX Runtime;
- :mod:`.fold`: each frozen BatchNorm folded into the convolution before it, in the traced graph;
- :mod:`.trial`: the first run of new artifacts, in a child process (a crash there is a refusal);
- :mod:`.proto`: refuse models that point at external data, without ``onnx`` or torch;
- :mod:`.runtime`: :class:`OrtOnlineLearner`, the device learner (numpy and ONNX Runtime only, no torch);
- :mod:`.step_costs`: :func:`measure_step_costs`, ORT's own cost of each unit, for an ElasticTrainer to select with.

Importing this package imports nothing heavy: the torch-free device runtime imports it. Its names are
listed once, in ``__init__.pyi``, and each loads its module on first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
