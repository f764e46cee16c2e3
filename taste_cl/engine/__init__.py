"""The engine interface and the losses the loop computes for every engine (torch-free).

- :mod:`~taste_cl.engine.base`: :class:`Engine`, what a runtime does for the loop;
- :mod:`~taste_cl.engine.losses`: the strategies' losses and gradient clipping in numpy;
- :mod:`~taste_cl.engine.check`: :func:`check_engine`, the contract an engine keeps;
- :mod:`~taste_cl.engine.adapt`: :class:`EngineAdapter`, BN-adapt and TENT over an engine, and the collapse guard's rule;
- :mod:`~taste_cl.engine.torch_engine`: torch eager as an engine (imports torch: import it by name).
"""

from taste_cl.engine.base import Engine
from taste_cl.engine.check import check_engine

__all__ = ["Engine", "check_engine"]
