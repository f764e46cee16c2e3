"""Hostile ``.npz`` archives for the artifact-folder tests: headers that claim arrays their data is not.

A ``.npy`` header states the dtype and shape ``np.load`` allocates before it reads a byte of
data, so a tiny file can claim terabytes; a deflated member can hold far more than the file's
size. The loaders must bound both before reading (see ``npz_headers`` in
``taste_cl/adapters/onnxruntime/replay.py``).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np


def write_npz(path: Path, arrays: Mapping[str, np.ndarray], *, claims: Mapping[str, tuple[int, ...]] | None = None, compressed: bool = False) -> None:
    """Write ``arrays`` as ``np.savez`` does, except that each array named in ``claims`` gets a header
    stating that shape over its real data; ``compressed`` deflates every member."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED) as archive:
        for key, array in arrays.items():
            buffer = io.BytesIO()
            if claims and key in claims:
                header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": claims[key]}
                np.lib.format.write_array_header_1_0(buffer, header)
                buffer.write(np.ascontiguousarray(array).tobytes())
            else:
                np.lib.format.write_array(buffer, np.asarray(array), allow_pickle=False)
            archive.writestr(f"{key}.npy", buffer.getvalue())


def edit_npz(
    path: Path,
    change: Callable[[dict[str, np.ndarray]], None] | None = None,
    *,
    claims: Mapping[str, tuple[int, ...]] | None = None,
    compressed: bool = False,
) -> None:
    """Rewrite the archive at ``path`` with ``change`` applied to its arrays (see :func:`write_npz` for the rest)."""
    with np.load(path) as saved:
        arrays = {key: saved[key] for key in saved.files}
    if change is not None:
        change(arrays)
    write_npz(path, arrays, claims=claims, compressed=compressed)
