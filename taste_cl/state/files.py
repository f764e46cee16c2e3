"""Atomic file writes and bounded reads of regular files, torch-free.

Writers replace a file so readers see the old one or the new one, never half; readers of files
anyone may have put there (the tuner's and the elastic profiler's caches) get the bytes of a
regular file of bounded size, or a refusal, never a hang or an unbounded read. Learner checkpoints
(:mod:`.checkpoint`) are written here; the caches, which also run on torch-free devices (the device
batch-size tuner), are written and read here.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import secrets
import socket
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = ["atomic_write_bytes", "host_tag", "read_regular_file"]

_READ_CHUNK = 1 << 24


def host_tag() -> str:
    """This machine's name reduced to ``[A-Za-z0-9-]`` (PIDs only mean something on their host)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{host_tag()}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


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
    prefix = f".{target.name}.{host_tag()}."
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


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, refused unless it holds at most ``max_bytes``.

    Opened without following a symbolic link in its last component and without blocking (a FIFO
    would wait for a writer forever); anything but a regular file (a link, FIFO, device such as
    ``/dev/zero``, socket or folder) is refused before a byte is read, and at most
    ``max_bytes + 1`` bytes are ever read (a file that grows while read is refused too).
    Raises ``FileNotFoundError`` (or ``NotADirectoryError``) when there is no file there,
    ``ValueError`` naming the path and the rule for a refused one, ``OSError`` when it cannot be read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"{str(path)!r} is a symbolic link; only regular files are read") from error
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{str(path)!r} is not a regular file (mode {stat.filemode(info.st_mode)}); only regular files are read")
        if info.st_size > max_bytes:
            raise ValueError(f"{str(path)!r} is {info.st_size} bytes, over the bound of {max_bytes}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ValueError(f"{str(path)!r} grew past the bound of {max_bytes} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)
