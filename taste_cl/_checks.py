"""Argument checks shared by every constructor: one rule, one message shape.

Torch-free, so the device runtimes (``taste_cl/adapters/onnxruntime/``) can use it too.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["INT_LIMIT", "check_finite_positive", "check_int", "check_positive"]

INT_LIMIT = 2**62  # saved counters beyond this are corrupt (and would overflow int64 tensors)


def check_int(name: str, value: Any, low: int = 0) -> int:
    """``value`` if it is an int (not a bool) ``>= low``, else ``ValueError`` naming the argument, rule and value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name} == {value!r}`, must be an int >= {low}")
    return value


def check_positive(name: str, value: Any, *, upper: float | None = None) -> float:
    """``value`` if it is a number (not a bool) ``> 0`` and, with ``upper``, ``<= upper``; else
    ``ValueError`` naming the argument, rule and value (NaN fails; infinity passes without ``upper``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (upper is not None and value > upper):
        rule = "a number > 0" + ("" if upper is None else f" and <= {upper}")
        raise ValueError(f"`{name} == {value!r}`, must be {rule}")
    return value


def check_finite_positive(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite number (not a bool) ``> 0``, else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name} == {value!r}`, must be a finite number > 0")
    return float(value)
