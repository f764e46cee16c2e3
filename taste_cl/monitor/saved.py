"""The checks of a monitor's saved plain fields, torch-free: the torch monitor (:mod:`taste_cl.monitor.monitor`)
and the engine loop's (:mod:`taste_cl.engine.monitor`) save the same counters, scores and events, and read
them back through these functions, so a field is refused for the same reason, in the same words, on both.

Every check returns the parsed value or raises ``ValueError`` naming the field as
``monitor.<key>``; nothing is changed. A score is a fraction for accuracy-like tasks; a regression
monitor scores errors, finite and unbounded (``high=math.inf``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from taste_cl._checks import INT_LIMIT
from taste_cl.monitor.events import MonitorEvent

__all__ = ["anytime", "count", "event_counts", "events", "fail", "flips", "last_drift_step", "pairs", "score"]

_PLAIN = (str, int, float, bool, type(None))


def fail(key: str, value: Any, rule: str) -> ValueError:
    """The error for field ``key`` holding ``value``: ``monitor.<key> == value``, and what it must be."""
    return ValueError(f"`monitor.{key} == {str(value)[:80]}`, must be {rule}")


def count(key: str, value: Any, high: int = INT_LIMIT) -> int:
    """An int in ``[0, high]`` (a bool is not a count)."""
    if type(value) is not int or not 0 <= value <= high:
        raise fail(key, value, f"an int in [0, {high}]")
    return value


def score(key: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> float:
    """A finite number in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise fail(key, value, f"a finite number in [{low:g}, {high:g}]")
    return float(value)


def pairs(key: str, value: Any, *, high: float = 1.0) -> dict[int, float]:
    """``[[class, score], ...]`` as a dict: classes are counts, scores in ``[0, high]``."""
    if not isinstance(value, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        raise fail(key, value, "a list of [class, score] pairs")
    return {count(key, c, INT_LIMIT - 1): score(key, a, high=high) for c, a in value}


def anytime(value: Any) -> tuple[float, int]:
    """``[score sum, evaluations]``."""
    if not isinstance(value, list) or len(value) != 2:
        raise fail("anytime", value, "[score sum, evaluations]")
    return score("anytime", value[0], low=-math.inf, high=math.inf), count("anytime", value[1])


def flips(value: Any, *, high: float = 1.0) -> tuple[float, float] | None:
    """None, or ``[negative flip rate, flip impact]``, each in ``[0, high]``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise fail("flips", value, "null or [negative flip rate, flip impact]")
    return score("flips", value[0], high=high), score("flips", value[1], high=high)


def last_drift_step(value: Any, steps: int) -> int | None:
    """None, or the observe of the last drift, at most ``steps``."""
    return None if value is None else count("last_drift_step", value, steps)


def events(value: Any, steps: int, max_events: int, *, plain_details: bool) -> list[MonitorEvent]:
    """At most ``max_events`` ``{name, step <= steps, details}`` objects. ``plain_details``: every detail is a plain
    value, floats finite (a device folder's events); else any JSON-like dict (the torch learner's, which hold lists)."""

    def valid(e: Any) -> bool:
        if not (isinstance(e, Mapping) and set(e) == {"name", "step", "details"} and isinstance(e["name"], str) and len(e["name"]) <= 100):
            return False
        if type(e["step"]) is not int or not 0 <= e["step"] <= steps or not isinstance(e["details"], Mapping):
            return False
        details = e["details"].items()
        return all(isinstance(k, str) and (not plain_details or _plain(v)) for k, v in details)

    if not isinstance(value, list) or len(value) > max_events or not all(valid(e) for e in value):
        kind = "plain values" if plain_details else "a dict"
        raise fail("events", value, f"a list of at most {max_events} {{name, step <= {steps}, details: {kind}}} objects")
    return [MonitorEvent(e["name"], e["step"], dict(e["details"])) for e in value]


def event_counts(value: Any) -> dict[str, int]:
    """Event names to counts."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise fail("event_counts", value, "a map of event names to counts")
    return {k: count("event_counts", v) for k, v in value.items()}


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) and (not isinstance(value, float) or math.isfinite(value))
