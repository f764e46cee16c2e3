"""Safe, atomic checkpoint files.

A checkpoint is one file, ``<dir>/learner.ckpt``: an 8-byte magic, the SHA-256 of the
payload, and the payload written by ``torch.save``. It is read back with
``torch.load(weights_only=True)``, which refuses to build arbitrary Python objects, so a
tampered file cannot execute code; the checksum catches truncation and bit rot first.
Writes go to a temporary file in the same folder, are fsynced, then renamed over the old
file, so a crash mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from taste_cl.exceptions import CheckpointError

__all__ = ["CHECKPOINT_FILE", "read_checkpoint", "write_checkpoint"]

CHECKPOINT_FILE = "learner.ckpt"
_MAGIC = b"TASTECL1"
_DIGEST_SIZE = hashlib.sha256().digest_size


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` so readers see the old file or the new one, never half."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    for stale in target.parent.glob(f".{target.name}.*.tmp"):  # left by a writer killed mid-write
        stale.unlink(missing_ok=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (tensors and plain values only) into ``directory``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    target = Path(directory) / CHECKPOINT_FILE
    atomic_write_bytes(target, _MAGIC + hashlib.sha256(payload).digest() + payload)
    return target


def read_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`write_checkpoint`."""
    path = Path(directory)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: file does not exist")
    data = path.read_bytes()
    header = len(_MAGIC) + _DIGEST_SIZE
    if len(data) < header or not data.startswith(_MAGIC):
        raise CheckpointError(f"{str(path)!r} is not a taste_cl checkpoint (bad header)")
    digest, payload = data[len(_MAGIC) : header], data[header:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{str(path)!r} is corrupt or was modified: checksum mismatch")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as error:  # weights_only refuses pickled code: report, never run it
        raise CheckpointError(f"{str(path)!r} could not be loaded safely: {error}") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{str(path)!r} holds a {type(state).__name__}, expected a dict")
    return state
