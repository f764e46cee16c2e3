"""Public names imported on first use, so a package's ``__init__`` stays light.

A package lists where each public name lives; its module ``__getattr__`` imports that
module only when the name is first read. ``import taste_cl`` then needs no torch, and the
torch-free device runtime can import its own package on a device without torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``homes[name]``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)  # later reads skip this hook
        return value

    return __getattr__
