"""Replay buffers: what the learner rehearses so it does not forget.

- :mod:`.buffers`: :class:`ReplayStrategy` (the extension point), :class:`ReservoirReplay` and
  :class:`ClassBalancedReplay`;
- :mod:`.storage`: :class:`BufferStorage`, the tensor store the built-in buffers share;
- :mod:`.draws`: the buffers' decisions (which rows to keep, give up and replay) from one seeded
  numpy generator, torch-free: the device loop (:mod:`taste_cl.engine.loop`) makes the same ones.

The torch-free device loop imports :mod:`.draws`, so this package loads its names on first use:
they are listed once, in ``__init__.pyi`` (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
