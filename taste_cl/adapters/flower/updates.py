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

from taste_cl.exceptions import InvalidUpdateError, MissingDependencyError

if TYPE_CHECKING:
    from flwr.app import Message

__all__ = [
    "CLIPPING_RANGE",
    "MAX_WEIGHT",
    "RECONSTRUCTION_THRESHOLD",
    "SHARES",
    "ArraySpec",
    "InvalidUpdateError",
    "PersonalSpec",
    "check_secagg_upload",
    "check_update",
    "personal_predicate",
    "privacy_mod",
    "require_flwr",
]

PersonalSpec = Sequence[str] | Callable[[str], bool]
ArraySpec = dict[str, tuple[tuple[int, ...], np.dtype]]


# SecAgg+ settings, shared by the server's workflow and every device's quantizer
SHARES = 0.5
"""Each device's secret is split among this fraction of the devices (SecAgg+'s ``num_shares``; at least 3)."""
RECONSTRUCTION_THRESHOLD = 0.7
"""Fraction of a device's shares needed to rebuild its masks if it drops (at least 2)."""
MAX_WEIGHT = 1000.0
"""Largest ``num-examples`` a device may claim per round (capped on the device)."""
CLIPPING_RANGE = 8.0
"""Each value of ``weight / MAX_WEIGHT * shared`` is clipped to ``[-8, 8]`` before quantization."""


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


def named_arrays(spec: Mapping[str, np.ndarray], arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Name an ordered list of arrays after the shared part ``spec`` and cast each to its dtype.

    SecAgg+ and the legacy ``NumPyClient`` API carry lists; casting matters because SecAgg+
    dequantizes to float64 and DP noise is float64.
    """
    if len(arrays) != len(spec):
        raise InvalidUpdateError(f"expected {len(spec)} shared arrays; got {len(arrays)}")
    return {name: np.asarray(a).astype(ref.dtype, copy=False) for (name, ref), a in zip(spec.items(), arrays)}


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


def check_secagg_upload(arrays: Mapping[str, np.ndarray], expected: ArraySpec, weight: float) -> None:
    """A device's own check of its update before SecAgg+ masks it (the server cannot check a masked one).

    Raises :class:`InvalidUpdateError` unless ``arrays`` match ``expected``, are finite,
    and no value would be clipped by SecAgg+'s quantizer (``|value| * weight / MAX_WEIGHT
    > CLIPPING_RANGE``), which would silently change the secure sum.
    """
    check_update(arrays, expected)
    bound = CLIPPING_RANGE * MAX_WEIGHT / min(max(float(weight), 1.0), MAX_WEIGHT)
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and array.size:
            largest = float(np.max(np.abs(array.astype(np.float64, copy=False))))
            if largest > bound:
                raise InvalidUpdateError(
                    f"refusing to upload: `{name}` holds |value| {largest:.3g} > {bound:.3g}, which SecAgg+ would clip "
                    f"(CLIPPING_RANGE={CLIPPING_RANGE:g} at weight {weight:g} of MAX_WEIGHT={MAX_WEIGHT:g})"
                )


def privacy_mod(privacy: str, clip: float, epsilon: float, delta: float, *, legacy: bool = False) -> Callable[..., Message]:
    """Flower's client mod for the fleet's ``privacy`` setting, applied to train messages.

    ``client``: ``fixedclipping_mod`` (the device clips to the norm the server sends);
    ``local``: ``LocalDpMod`` (the device clips to ``clip`` and adds noise for
    ``(epsilon, delta)``); ``off`` and ``central`` (the server's job): nothing.
    ``legacy=True`` gives the twins that speak the legacy ``FitIns``/``FitRes`` records
    (``flwr.client.mod``), as the SecAgg+ apps need.
    """
    if legacy:
        from flwr.client.mod import LocalDpMod, fixedclipping_mod
    else:
        from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod  # type: ignore[assignment]

    if privacy == "client":
        return fixedclipping_mod
    if privacy == "local":
        return LocalDpMod(clip, clip, epsilon, delta)
    return _pass_through


def _pass_through(msg: Message, context: Any, call_next: Callable[..., Message]) -> Message:
    return call_next(msg, context)
