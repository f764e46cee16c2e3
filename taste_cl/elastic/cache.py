"""The on-disk profile cache: untrusted input, validated field by field before use.

A cache file may be stale, truncated, hand-edited or hostile. Every problem (unreadable
path, a link, FIFO, device or folder in place of the file, oversize file, bad JSON, deep
nesting, wrong types, negative or non-finite times, unit names that are not this model's)
gives a :class:`~taste_cl.exceptions.ProfileCacheWarning` and a fresh
measurement; nothing from a bad entry is used, and a cache that cannot be written is
warned about, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from taste_cl.elastic.profiling import describe_input, profile_tensors, trainable_ids, unit_names
from taste_cl.elastic.tensor_profile import Granularity, TensorProfile, parse_profile
from taste_cl.exceptions import ProfileCacheWarning
from taste_cl.state.files import atomic_write_bytes, read_regular_file
from taste_cl.tuning.fingerprint import hardware_fingerprint, model_signature

__all__ = ["CACHE_FILE", "load_or_profile"]

CACHE_FILE = "elastic_profiles.json"
PROFILE_FORMAT = 4  # 3: profiles name their clock; 4: frozen layers and nested modules timed where the backward crosses them
MAX_CACHE_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 64


def _read_entries(path: Path) -> dict[str, Any]:
    """The cache's profile entries (raw), or {} with a warning when the file is unusable."""
    try:
        payload = json.loads(read_regular_file(path, MAX_CACHE_BYTES).decode("utf-8"))
        if not isinstance(payload, dict) or payload.get("format") != PROFILE_FORMAT:
            return {}  # another format version: silently measure again
        entries = payload.get("profiles")
        if not isinstance(entries, dict):
            raise ValueError("`profiles` is not an object")  # noqa: TRY004
        return entries
    except (FileNotFoundError, NotADirectoryError):
        return {}  # no cache yet (a folder that is a file is reported when the profile is written)
    except (OSError, ValueError, RecursionError, UnicodeDecodeError) as error:
        warnings.warn(f"elastic profile cache {str(path)!r} is unusable ({error}); measuring again", ProfileCacheWarning, stacklevel=3)
        return {}


def load_or_profile(
    model: nn.Module,
    example: Any,
    *,
    cache_dir: str | os.PathLike[str],
    granularity: Granularity = "tensor",
    refresh: bool = False,
    trainable: Iterable[nn.Parameter] | None = None,
    **profile_kwargs: Any,
) -> tuple[TensorProfile, bool]:
    """Return ``(profile, from_cache)``, reading/writing ``cache_dir/elastic_profiles.json``.

    The key is the model signature for ``example``'s shapes and dtype, the granularity, the
    clock, the hardware fingerprint and which parameters are frozen (all but ``trainable``,
    default: those without ``requires_grad``), so a changed architecture, batch size,
    machine, torch version or frozen set profiles anew. A cached entry is used only if
    every field is valid and its units are this model's units in execution order.
    ``refresh`` measures again. ``profile_kwargs`` go to :func:`profile_tensors`.
    """
    path = Path(cache_dir) / CACHE_FILE
    shape, dtype = describe_input(example)
    clock = profile_kwargs.get("clock", "wall")
    ids = trainable_ids(model, trainable)
    live = [p for p in model.parameters() if id(p) in ids]
    key = f"{model_signature(model, shape, dtype)}:{granularity}:{clock}:{hardware_fingerprint()}{_frozen_key(model, ids)}"
    entries = _read_entries(path)
    if not refresh and key in entries:
        try:
            profile = parse_profile(entries[key])
            expected = unit_names(model, example, granularity=granularity, trainable=live, call=profile_kwargs.get("call", "auto"))
            if profile.units != expected or profile.granularity != granularity or profile.clock != clock:
                raise ValueError(f"its units {profile.units[:4]}... are not this model's {expected[:4]}...")
            return profile, True
        except ValueError as error:
            warnings.warn(f"elastic profile cache entry in {str(path)!r} is invalid ({error}); measuring again", ProfileCacheWarning, stacklevel=2)
    profile = profile_tensors(model, example, granularity=granularity, trainable=live, **profile_kwargs)
    kept = {k: v for k, v in entries.items() if k != key}
    kept = dict(list(kept.items())[-(MAX_ENTRIES - 1) :]) if MAX_ENTRIES > 1 else {}
    payload = {"format": PROFILE_FORMAT, "profiles": {**kept, key: profile.to_dict()}}
    try:
        atomic_write_bytes(path, (json.dumps(payload, sort_keys=False) + "\n").encode())
    except (OSError, ValueError) as error:
        warnings.warn(
            f"cannot write the elastic profile cache {str(path)!r} ({error}); using the fresh profile uncached", ProfileCacheWarning, stacklevel=2
        )
    return profile, False


def _frozen_key(model: nn.Module, trainable: set[int]) -> str:
    """The cache key's part for the frozen parameters: empty when all train (keys as before)."""
    frozen = [name for name, p in model.named_parameters() if id(p) not in trainable]
    return f":frozen={hashlib.sha256(json.dumps(frozen).encode()).hexdigest()[:16]}" if frozen else ""
