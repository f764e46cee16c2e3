"""What travels between a device and the server, with numpy and flwr only (no torch).

The shared/personal split of a model's tensors by name, the check of an update against
the arrays the server sent, and the Flower import with telemetry off. Both ClientApps use
them: the PyTorch one (:mod:`.fleet`, :mod:`.app`) and the device-runtime one
(:mod:`.device_client`), which must run where torch is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from taste_cl.exceptions import MissingDependencyError, TasteCLError

if TYPE_CHECKING:
    from flwr.app import Message

__all__ = ["ArraySpec", "InvalidUpdateError", "PersonalSpec", "check_update", "personal_predicate", "privacy_mod", "require_flwr"]

PersonalSpec = Sequence[str] | Callable[[str], bool]
ArraySpec = dict[str, tuple[tuple[int, ...], np.dtype]]


class InvalidUpdateError(TasteCLError, ValueError):
    """A model update has the wrong names, shapes or dtypes, or non-finite values."""


def require_flwr() -> None:
    """Import flwr with its telemetry (and Ray's usage stats) off, or raise an install hint.

    Call it before any ``import flwr`` of your own: flwr reads the setting at import.
    """
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the simulation asks for no GPUs; opt in to Ray's future behaviour (leave the visible
    # devices alone), which also silences its FutureWarning about the change
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    try:
        import flwr  # noqa: F401
    except ImportError as error:
        raise MissingDependencyError("flwr", "federated") from error


def personal_predicate(personal: PersonalSpec) -> Callable[[str], bool]:
    """``personal`` (name prefixes or a predicate) as a predicate on tensor names; ``TypeError`` otherwise."""
    if callable(personal):
        return personal
    if isinstance(personal, str) or not all(isinstance(p, str) for p in personal):
        raise TypeError(f"personal must be a sequence of name prefixes or a predicate; got {personal!r}")
    prefixes = tuple(personal)
    return lambda name: name.startswith(prefixes)


def array_spec(arrays: Mapping[str, np.ndarray]) -> ArraySpec:
    """Name -> (shape, dtype) of ``arrays``: what an update must match."""
    return {name: (tuple(a.shape), a.dtype) for name, a in arrays.items()}


def check_update(arrays: Mapping[str, np.ndarray], expected: ArraySpec) -> None:
    """Raise :class:`InvalidUpdateError` unless ``arrays`` match ``expected`` and are finite."""
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing or extra:
        raise InvalidUpdateError(f"update names do not match the shared part: missing {missing}, unexpected {extra}")
    for name, (shape, dtype) in expected.items():
        array = arrays[name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise InvalidUpdateError(f"`{name}` must be {dtype} of shape {shape}; got {array.dtype} of shape {tuple(array.shape)}")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise InvalidUpdateError(f"`{name}` has {int((~np.isfinite(array)).sum())} non-finite values")


def privacy_mod(privacy: str, clip: float, epsilon: float, delta: float) -> Callable[..., Message]:
    """Flower's client mod for the fleet's ``privacy`` setting, applied to train messages.

    ``client``: ``fixedclipping_mod`` (the device clips to the norm the server sends);
    ``local``: ``LocalDpMod`` (the device clips to ``clip`` and adds noise for
    ``(epsilon, delta)``); ``off`` and ``central`` (the server's job): nothing.
    """
    from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod

    if privacy == "client":
        return fixedclipping_mod
    if privacy == "local":
        return LocalDpMod(clip, clip, epsilon, delta)
    return _pass_through


def _pass_through(msg: Message, context: Any, call_next: Callable[..., Message]) -> Message:
    return call_next(msg, context)
