"""An engine's tensors on disk and on their way in, for every engine alike (torch-free): state files are
``.npz`` archives read within a size bound and without pickle, and values loaded into an engine are
checked against its names and shapes (float, finite) before anything is replaced.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.exceptions import ArtifactError, CheckpointError
from taste_cl.state.files import read_regular_file

__all__ = ["checked_floats", "npz_bytes", "read_npz"]


def read_npz(path: Path, limit: int) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path`` (at most ``limit`` bytes, a regular file, no pickle); else ArtifactError."""
    try:
        with np.load(io.BytesIO(read_regular_file(path, limit)), allow_pickle=False) as data:
            return {name: np.asarray(data[name]) for name in data.files}
    except (OSError, ValueError) as error:
        raise ArtifactError(f"{path.name} in {path.parent} is unreadable: {error}") from None


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an uncompressed ``.npz`` file (for an atomic write)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def checked_floats(
    what: str, values: Any, expected: Mapping[str, tuple[int, ...]], error: type[ValueError] = CheckpointError
) -> dict[str, np.ndarray]:
    """``values`` as fresh float32 C arrays with exactly ``expected``'s names and shapes, all finite; else ``error``
    naming ``what`` and the first array at fault."""
    if not isinstance(values, Mapping) or set(values) != set(expected):
        if not isinstance(values, Mapping):
            raise error(f"{what}: must map names to arrays; got {type(values).__name__}")
        missing, extra = sorted(set(expected) - set(values)), sorted(set(values) - set(expected))
        raise error(f"{what}: names differ from the engine's (missing {missing}, unexpected {extra})")
    checked = {}
    for name, shape in expected.items():
        array = np.asarray(values[name])
        if array.shape != tuple(shape) or array.dtype.kind != "f":
            raise error(f"{what}: {name!r} must be a float array of shape {tuple(shape)}; got {array.dtype} {array.shape}")
        if not np.isfinite(array).all():
            raise error(f"{what}: {name!r} holds NaN or infinite values")
        checked[name] = np.array(array, dtype=np.float32, order="C")  # a copy (ascontiguousarray makes 0-d arrays 1-d)
    return checked
