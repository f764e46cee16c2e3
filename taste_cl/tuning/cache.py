"""The batch-size tuner's on-disk cache: validated JSON, never trusted, never fatal.

A cache file is read into plain values and every field is checked (format, key, types,
ranges, a bound on its size and on the number of points) before the tuner uses any of
it; only a regular file is read (:func:`~taste_cl.state.files.read_regular_file`). Anything
wrong -- unreadable, too large, too deeply nested, absurd rates, a folder, link, FIFO or device
where a file should be, an unwritable cache folder -- is reported with a
:class:`TunerCacheWarning` and the tuner measures from scratch; a write that fails is a
warning too, never an error out of ``tune`` or ``observe``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taste_cl.exceptions import TunerCacheWarning
from taste_cl.state.files import atomic_write_bytes, read_regular_file
from taste_cl.tuning.fingerprint import default_cache_dir

__all__ = ["MAX_SAMPLES_PER_S", "CachedSurface", "Observation", "SurrogateCache", "TunerCacheWarning", "check_observations"]

Observation = tuple[int, int, float]  # (batch size, torch threads, training samples/s)
MAX_SAMPLES_PER_S = 1e9  # no training step on any hardware this library targets is faster
MAX_BATCH = 1 << 20
MAX_THREADS = 4096
MAX_FILE_BYTES = 256 * 1024


@dataclass(frozen=True)
class CachedSurface:
    """What a cache file holds for one key: the smallest trainable batch and the measured points."""

    min_batch_size: int
    observations: list[Observation]


def _int_in(value: Any, low: int, high: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}]; got {value!r}")
    return value


def check_observations(raw: Any, *, limit: int) -> list[Observation]:
    """Validate ``[[batch, threads, samples/s], ...]`` (at most ``limit`` points) into observations."""
    if not isinstance(raw, list):
        raise ValueError(f"observations must be a list; got {type(raw).__name__}")  # noqa: TRY004 - one error type for bad files
    if len(raw) > limit:
        raise ValueError(f"{len(raw)} observations, more than the {limit} this cache keeps")
    observations = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError(f"an observation must be [batch, threads, samples_per_s]; got {item!r:.60}")
        batch = _int_in(item[0], 1, MAX_BATCH, "batch")
        threads = _int_in(item[1], 1, MAX_THREADS, "threads")
        rate = item[2]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= MAX_SAMPLES_PER_S:
            raise ValueError(f"samples_per_s must be a number in (0, {MAX_SAMPLES_PER_S:g}]; got {rate!r}")
        observations.append((batch, threads, float(rate)))
    return observations


class SurrogateCache:
    """Throughput observations per (model, optimizer, hardware, load) key, as small JSON files.

    Parameters
    ----------
    directory:
        Cache folder (default :func:`~taste_cl.tuning.fingerprint.default_cache_dir`).
    max_observations:
        Points kept per key (the most recent). A file with more is treated as corrupt:
        the surrogate's cost grows with the cube of the points it is told.
    """

    FORMAT = 2

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, max_observations: int = 64) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.max_observations = _int_in(max_observations, 1, 4096, "max_observations")

    def path(self, key: str) -> Path:
        return self.directory / f"batch-{key}.json"

    def load(self, key: str) -> CachedSurface | None:
        """The validated cache entry for ``key``; None on a miss or (with a warning) an unusable file."""
        path = self.path(key)
        try:
            return self._parse(json.loads(read_regular_file(path, MAX_FILE_BYTES)), key)
        except (FileNotFoundError, NotADirectoryError):
            return None  # no cache yet (a folder that is a file is reported when the tuner writes)
        except (OSError, ValueError, TypeError, RecursionError, MemoryError, UnicodeDecodeError) as error:
            _warn(f"ignoring corrupt tuner cache {str(path)!r} ({type(error).__name__}: {error}); measuring afresh")
            return None

    def _parse(self, data: Any, key: str) -> CachedSurface:
        if not isinstance(data, dict) or set(data) != {"format", "key", "min_batch_size", "observations"}:
            raise ValueError("not a tuner cache object (keys format, key, min_batch_size, observations)")
        if data["format"] != self.FORMAT or data["key"] != key:
            raise ValueError(f"format {data['format']!r:.20} or key {data['key']!r:.40} does not match")
        minimum = _int_in(data["min_batch_size"], 1, MAX_BATCH, "min_batch_size")
        observations = check_observations(data["observations"], limit=self.max_observations)
        if any(batch < minimum for batch, _, _ in observations):
            raise ValueError("an observation below min_batch_size")
        return CachedSurface(minimum, observations)

    def save(self, key: str, surface: CachedSurface) -> bool:
        """Write ``surface`` (its most recent points) atomically; warn and return False if the folder refuses."""
        recent = [[int(b), int(t), float(r)] for b, t, r in surface.observations if math.isfinite(r)][-self.max_observations :]
        payload = {"format": self.FORMAT, "key": key, "min_batch_size": int(surface.min_batch_size), "observations": recent}
        try:
            atomic_write_bytes(self.path(key), json.dumps(payload, indent=1).encode())
        except OSError as error:
            _warn(f"cannot write tuner cache {str(self.path(key))!r} ({type(error).__name__}: {error}); results kept in memory only")
            return False
        return True


def _warn(message: str) -> None:
    warnings.warn(message, TunerCacheWarning, stacklevel=4)
