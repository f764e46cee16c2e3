"""The probe guard's settings and window verdict in plain floats (no torch, no numpy).

The PyTorch learner's :class:`~taste_cl.guards.probe.ProbeGuard` and the engine loop's
:class:`~taste_cl.engine.probe_guard.LoopProbeGuard` check their settings and judge an update
window with these functions, so a window is rolled back on a device exactly when it would be in torch.

A window's verdict compares each probe sample's score now with its score at the last accepted
window (samples scored both times only): ``drop`` is the mean fall of the score, the negative flip
rate the share of samples right then and wrong now. The window regressed, after ``warmup`` windows,
when ``drop > max_drop`` or the flip rate exceeds ``max_flip_rate`` (None: flips are not judged).

>>> verdict = window_verdict({0: 1.0, 1: 1.0}, {0: True, 1: True}, {0: 1.0, 1: 0.0, 2: 0.0}, {0: True, 1: False, 2: False})
>>> verdict
(0.5, 0.5, 2)
>>> regressed(windows=3, warmup=0, drop=verdict[0], flips=verdict[1], max_drop=0.05, max_flip_rate=0.1)
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taste_cl._checks import check_int

__all__ = ["check_probe_settings", "lowered_lr", "regressed", "window_verdict"]


def _fraction(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"`{name} == {value!r}`, must be a number in [0, 1]" + (" or None" if allow_none else ""))
    return float(value)


def check_probe_settings(
    *, window: Any, max_drop: Any, max_flip_rate: Any, probe_capacity: Any, lr_factor: Any, min_lr: Any, warmup: Any, seed: Any
) -> dict[str, Any]:
    """The guard's numeric settings checked (``ValueError`` naming the first bad one) and normalised."""
    check_int("window", window, 1)
    check_int("probe_capacity", probe_capacity, 1)
    check_int("warmup", warmup, 0)
    check_int("seed", seed, 0)
    if isinstance(lr_factor, bool) or not isinstance(lr_factor, (int, float)) or not 0 < lr_factor <= 1:
        raise ValueError(f"`lr_factor == {lr_factor!r}`, must be a number in (0, 1]")
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise ValueError(f"`max_drop == {max_drop!r}`, must be a number >= 0")
    if isinstance(min_lr, bool) or not isinstance(min_lr, (int, float)) or not min_lr >= 0:
        raise ValueError(f"`min_lr == {min_lr!r}`, must be a number >= 0")
    return {
        "window": window, "max_drop": float(max_drop), "max_flip_rate": _fraction("max_flip_rate", max_flip_rate, allow_none=True),
        "probe_capacity": probe_capacity, "lr_factor": float(lr_factor), "min_lr": float(min_lr), "warmup": warmup, "seed": seed,
    }  # fmt: skip


def window_verdict(
    baseline: Mapping[int, float], baseline_correct: Mapping[int, bool], scores: Mapping[int, float], correct: Mapping[int, bool]
) -> tuple[float, float, int]:
    """``(drop, negative flip rate, samples compared)`` of probe ``scores`` (and ``correct``: right or wrong,
    empty for regression) against the last accepted window's, over the samples scored both times."""
    common = [i for i in scores if i in baseline]
    drop, flips = 0.0, 0.0
    if common:
        drop = sum(baseline[i] - scores[i] for i in common) / len(common)
        if correct:
            flips = sum(baseline_correct[i] and not correct[i] for i in common) / len(common)
    return drop, flips, len(common)


def regressed(*, windows: int, warmup: int, drop: float, flips: float, max_drop: float, max_flip_rate: float | None) -> bool:
    """Whether window number ``windows`` (from 1) is rolled back: past ``warmup``, its drop or flip rate is over the limit."""
    return windows > warmup and (drop > max_drop or (max_flip_rate is not None and flips > max_flip_rate))


def lowered_lr(lr: float, lr_factor: float, min_lr: float) -> float:
    """The learning rate after a rollback: ``lr * lr_factor``, not below ``min_lr``."""
    return max(min_lr, lr * lr_factor)
