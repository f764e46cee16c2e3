"""The on-disk profile cache: untrusted input, validated field by field before use.

A cache file may be stale, truncated, hand-edited or hostile. Every problem (unreadable
path, oversize file, bad JSON, deep nesting, wrong types, negative or non-finite times,
unit names that are not this model's) gives a :class:`RuntimeWarning` and a fresh
measurement; nothing from a bad entry is used, and a cache that cannot be written is
warned about, never fatal.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from taste_cl.elastic.profiling import (
    CLOCKS,
    GRANULARITIES,
    Granularity,
    TensorProfile,
    describe_input,
    profile_tensors,
    unit_names,
)
from taste_cl.state.checkpoint import atomic_write_bytes
from taste_cl.tuning.fingerprint import hardware_fingerprint, model_signature

__all__ = ["CACHE_FILE", "load_or_profile", "parse_profile"]

CACHE_FILE = "elastic_profiles.json"
PROFILE_FORMAT = 3  # 3: profiles name their clock
MAX_CACHE_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 64
_MAX_UNITS = 100_000
_MAX_BYTES = 2**50  # a petabyte: larger "memory" is corruption


def _field(state: dict[str, Any], name: str) -> Any:
    if name not in state:
        raise ValueError(f"profile field `{name}` is missing")
    return state[name]


def _number(name: str, value: Any, *, upper: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 <= value <= upper):
        raise ValueError(f"profile field `{name} == {value!r}`, must be a finite number >= 0 and <= {upper}")
    return float(value)


def _numbers(state: dict[str, Any], name: str, n: int, *, integer: bool = False) -> list[Any]:
    values = _field(state, name)
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"profile field `{name}` must be a list of {n} numbers; got {type(values).__name__}")
    if integer:
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_BYTES]
        if bad:
            raise ValueError(f"profile field `{name}` must hold ints in [0, {_MAX_BYTES}]; got {bad[0]!r}")
        return list(values)
    return [_number(name, v, upper=1e6) for v in values]


def parse_profile(state: Any) -> TensorProfile:
    """A :class:`TensorProfile` from untrusted plain values; ``ValueError`` naming the first bad field."""
    if not isinstance(state, dict):
        raise ValueError(f"a profile must be a JSON object; got {type(state).__name__}")  # noqa: TRY004 (documented: corrupt cache -> ValueError)
    units = _field(state, "units")
    if not isinstance(units, list) or not 0 < len(units) <= _MAX_UNITS or not all(isinstance(u, str) for u in units):
        raise ValueError("profile field `units` must be a non-empty list of strings")
    if len(set(units)) != len(units):
        raise ValueError("profile field `units` holds duplicate names")
    granularity = _field(state, "granularity")
    if granularity not in GRANULARITIES:
        raise ValueError(f"profile field `granularity == {granularity!r}`, must be one of {GRANULARITIES}")
    rounds = _field(state, "rounds")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"profile field `rounds == {rounds!r}`, must be an int >= 0")
    noisy = _field(state, "noisy")
    if not isinstance(noisy, bool):
        raise ValueError(f"profile field `noisy == {noisy!r}`, must be a bool")  # noqa: TRY004
    clock = state.get("clock", "wall")  # checkpoints from before clocks were named: wall
    if clock not in CLOCKS:
        raise ValueError(f"profile field `clock == {clock!r}`, must be one of {tuple(CLOCKS)}")
    n = len(units)
    return TensorProfile(
        units=list(units),
        weight_grad_s=_numbers(state, "weight_grad_s", n),
        act_grad_s=_numbers(state, "act_grad_s", n),
        forward_s=_number("forward_s", _field(state, "forward_s"), upper=1e6),
        backward_s=_number("backward_s", _field(state, "backward_s"), upper=1e6),
        weight_grad_ci=_numbers(state, "weight_grad_ci", n),
        act_grad_ci=_numbers(state, "act_grad_ci", n),
        forward_ci=_number("forward_ci", _field(state, "forward_ci"), upper=1e6),
        param_bytes=_numbers(state, "param_bytes", n, integer=True),
        input_bytes=_numbers(state, "input_bytes", n, integer=True),
        act_bytes=_numbers(state, "act_bytes", n, integer=True),
        granularity=granularity,
        rounds=rounds,
        noisy=noisy,
        clock=clock,
    )


def _read_entries(path: Path) -> dict[str, Any]:
    """The cache's profile entries (raw), or {} with a warning when the file is unusable."""
    try:
        if not path.exists():
            return {}
        if path.stat().st_size > MAX_CACHE_BYTES:
            raise ValueError(f"it is larger than {MAX_CACHE_BYTES} bytes")
        payload = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(payload, dict) or payload.get("format") != PROFILE_FORMAT:
            return {}  # another format version: silently measure again
        entries = payload.get("profiles")
        if not isinstance(entries, dict):
            raise ValueError("`profiles` is not an object")  # noqa: TRY004
        return entries
    except (OSError, ValueError, RecursionError, UnicodeDecodeError) as error:
        warnings.warn(f"elastic profile cache {str(path)!r} is unusable ({error}); measuring again", RuntimeWarning, stacklevel=3)
        return {}


def load_or_profile(
    model: nn.Module,
    example: Any,
    *,
    cache_dir: str | os.PathLike[str],
    granularity: Granularity = "tensor",
    refresh: bool = False,
    **profile_kwargs: Any,
) -> tuple[TensorProfile, bool]:
    """Return ``(profile, from_cache)``, reading/writing ``cache_dir/elastic_profiles.json``.

    The key is the model signature for ``example``'s shapes and dtype, the granularity, the
    clock and the hardware fingerprint, so a changed architecture, batch size, machine or torch
    version profiles anew. A cached entry is used only if every field is valid and its
    units are this model's units in execution order. ``refresh`` measures again.
    ``profile_kwargs`` go to :func:`profile_tensors`.
    """
    path = Path(cache_dir) / CACHE_FILE
    shape, dtype = describe_input(example)
    clock = profile_kwargs.get("clock", "wall")
    key = f"{model_signature(model, shape, dtype)}:{granularity}:{clock}:{hardware_fingerprint()}"
    entries = _read_entries(path)
    if not refresh and key in entries:
        try:
            profile = parse_profile(entries[key])
            expected = unit_names(model, example, granularity=granularity)
            if profile.units != expected or profile.granularity != granularity or profile.clock != clock:
                raise ValueError(f"its units {profile.units[:4]}... are not this model's {expected[:4]}...")
            return profile, True
        except ValueError as error:
            warnings.warn(f"elastic profile cache entry in {str(path)!r} is invalid ({error}); measuring again", RuntimeWarning, stacklevel=2)
    profile = profile_tensors(model, example, granularity=granularity, **profile_kwargs)
    kept = {k: v for k, v in entries.items() if k != key}
    kept = dict(list(kept.items())[-(MAX_ENTRIES - 1) :]) if MAX_ENTRIES > 1 else {}
    payload = {"format": PROFILE_FORMAT, "profiles": {**kept, key: profile.to_dict()}}
    try:
        atomic_write_bytes(path, (json.dumps(payload, sort_keys=False) + "\n").encode())
    except (OSError, ValueError) as error:
        warnings.warn(
            f"cannot write the elastic profile cache {str(path)!r} ({error}); using the fresh profile uncached", RuntimeWarning, stacklevel=2
        )
    return profile, False
