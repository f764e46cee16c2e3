"""ExecuTorch on-device training: export a model as a ``.pte`` program, keep it learning on the device.

- :mod:`.build`: :func:`export_model` and the learner-level :func:`export`, gated by parity;
- :mod:`.learner`: :class:`EtOnlineLearner`, the device side (imports nothing from :mod:`.build`);
- :mod:`.runtime`: the ExecuTorch training runtime behind the parity gate and the device learner;
- :mod:`.replay`: the exported replay buffer (plain arrays, checked on load);
- :mod:`.engine`: :class:`ExecuTorchEngine`, ExecuTorch on the engine interface of the one loop
  (:class:`~taste_cl.engine.loop.EngineLearner`), stepping with :mod:`.optimizer`; :mod:`.engine_export`
  (:func:`export_engine`) writes its folder.

The device side imports nothing from the export side, so this package loads each name on first
use: the names are listed once, in ``__init__.pyi`` (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
