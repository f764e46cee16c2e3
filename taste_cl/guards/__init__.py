"""Guards that keep a learner from harming its model, side by side.

- :mod:`.update`: :class:`UpdateGuard`, per optimizer step: no step that can poison the model;
- :mod:`.probe`: :class:`ProbeGuard`, per update window: roll back a window that made the model worse for its user;
- :mod:`.device`: :class:`DeviceUpdateGuard`, the same per-step rule on any runtime's step (torch-free);
- :mod:`.size_rule`: the update-size rule, in plain floats, that both apply.
- :mod:`.probe_rule`: the probe guard's settings and window verdict, in plain floats, that :mod:`.probe` and the engine loop's guard apply.

The torch-free device runtimes import :mod:`.device` and :mod:`.size_rule`, so this package loads its names on
first use: they are listed once, in ``__init__.pyi`` (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
