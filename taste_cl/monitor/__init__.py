"""Stability-plasticity monitoring: does the model keep old knowledge while learning new data?

- :mod:`.monitor`: :class:`StabilityPlasticityMonitor`, its probe buffer and events;
- :mod:`.drift`: Page-Hinkley change detection on the loss stream;
- :mod:`.events`: the events and the arithmetic of a probe evaluation, which the engine loop's monitor shares;
- :mod:`.saved`: the checks of the fields both monitors save;
- :mod:`.evaluation`: task-sequence metrics (accuracy matrix, forgetting, backward transfer).

The torch-free engine loop's monitor (:mod:`taste_cl.engine.monitor`) imports :mod:`.drift`, :mod:`.events` and :mod:`.saved`,
so this package loads its names on first use: they are listed once, in ``__init__.pyi`` (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
