"""ExecuTorch on-device training: export a model as a ``.pte`` program, keep it learning on the device.

- :mod:`.build`: :func:`export_model` and the learner-level :func:`export`, gated by parity;
- :mod:`.learner`: :class:`EtOnlineLearner`, the device side (imports nothing from :mod:`.build`);
- :mod:`.runtime`: the ExecuTorch training runtime behind the parity gate and the device learner;
- :mod:`.replay`: the exported replay buffer (plain arrays, checked on load).
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "BACKEND",
    "EtOnlineLearner",
    "UnsupportedModelError",
    "export",
    "export_model",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "BACKEND": "taste_cl.adapters.executorch.build",
        "EtOnlineLearner": "taste_cl.adapters.executorch.learner",
        "UnsupportedModelError": "taste_cl.adapters.executorch.build",
        "export": "taste_cl.adapters.executorch.build",
        "export_model": "taste_cl.adapters.executorch.build",
    },
)
