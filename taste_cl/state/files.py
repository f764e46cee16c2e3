"""Atomic file writes, torch-free: readers see the old file or the new one, never half.

Used by learner checkpoints (:mod:`.checkpoint`) and by the tuner's caches, which also run on
torch-free devices (the device batch-size tuner).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = ["atomic_write_bytes"]


def _host_tag() -> str:
    """This machine's name reduced to ``[A-Za-z0-9-]`` (PIDs only mean something on their host)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _sweep_stale(target: Path) -> None:
    """Remove temp files of ``target`` left by writers on this host that are no longer alive.

    A temp file whose writer still runs is in flight and is never touched; files of other
    hosts (a shared folder) and names that do not carry a host and PID are left alone.
    """
    prefix = f".{target.name}.{_host_tag()}."
    for candidate in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid_text = candidate.name[len(prefix) :].split(".", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text)):
            candidate.unlink(missing_ok=True)


def atomic_write_bytes(target: Path, data: bytes | Sequence[bytes]) -> None:
    """Write ``data`` (bytes, or chunks written in order) to ``target`` so readers see the
    old file or the new one, never half.

    Safe with concurrent writers in several threads or processes: each writes its own
    temp file; the last rename wins and the result is always one complete file.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in [data] if isinstance(data, bytes) else data:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sweep_stale(target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
