"""A backend-neutral artifact folder: staged atomically, every file listed and hashed, checked before use.

An artifact folder holds plain files only (no subfolders, no links) and a ``manifest.json``
whose ``"files"`` maps each plain file name to its SHA-256. :func:`staged_folder` builds a
new folder next to the target and swaps it in only when complete; :func:`write_manifest`
hashes the folder into the manifest; :func:`read_manifest` checks everything (size and depth
of the JSON, plain names, no unlisted or missing file, every hash) before any value is used,
and :func:`read_verified` reads one listed file and re-checks its hash, so what gets parsed is
what was checked. Backends validate their own manifest fields. No torch import here: the
device runtime uses this module.

>>> import tempfile
>>> from pathlib import Path
>>> root = Path(tempfile.mkdtemp())
>>> with staged_folder(root / "art") as stage:
...     _ = (stage / "weights.bin").write_bytes(b"123")
...     write_manifest(stage, {"format": 1})
>>> sorted(read_manifest(root / "art", required=["weights.bin"])["files"])
['weights.bin']
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from taste_cl.exceptions import ArtifactError, ExportError

__all__ = [
    "GENERATED_ROWS_NOTE",
    "MANIFEST_FILE",
    "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES",
    "PARITY_ROWS",
    "ArtifactError",
    "ExportError",
    "check_plain_name",
    "read_manifest",
    "read_verified",
    "staged_folder",
    "write_manifest",
]

PARITY_ROWS = ("replay", "example", "generated", "given")
"""Where the rows the parity gate trained on came from, as a manifest's ``parity.rows`` says: the learner's
replay buffer, the ``example=`` the user passed, rows generated from ``input_shape``/``num_classes`` (uniform
in [0, 1), random labels: not the user's data), or batches a caller of ``export_model`` gave."""
GENERATED_ROWS_NOTE = (
    "the parity gate trained on generated rows (uniform in [0, 1), random labels), not on the user's data: "
    "it shows that the runtime computes like torch on such rows, not that training on real data is stable; "
    "pass example=(x, y) with real rows, or export after the learner has observed some (the device guard "
    "measures every one of the first steps, and undoes a step that blows up)"
)
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files and settings: 1 MiB is generous
MAX_JSON_DEPTH = 16
_HASH_CHUNK = 1 << 20


def check_plain_name(name: object) -> str:
    """Return ``name`` if it is a plain file name inside a folder, else raise :class:`ArtifactError`.

    Plain: a non-empty ``str`` of at most 255 characters, not ``.``/``..``, with no path
    separator, no NUL and not absolute (``/etc/passwd``, ``../x``, ``a/b`` are refused).
    """
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 255
        or name in (".", "..")
        or any(char in name for char in ("/", "\\", "\0"))
        or os.path.isabs(name)
    ):
        raise ArtifactError(f"artifact file name {name!r} is not a plain file name inside the folder")
    return name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _regular_entries(folder: Path) -> list[str]:
    """Names of the folder's entries; anything but a regular file (link, folder, device) is refused."""
    names = []
    for entry in os.scandir(folder):
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise ArtifactError(f"{str(folder)!r} holds {entry.name!r}, which is not a regular file (links and folders are refused)")
        names.append(entry.name)
    return sorted(names)


@contextlib.contextmanager
def staged_folder(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh staging folder next to ``directory``; swap it into place on normal exit.

    ``directory`` must be absent, empty, or an earlier artifact folder (holding a
    ``manifest.json``); the earlier folder is removed only after the new one is in place.
    On an exception the staging folder is deleted and ``directory`` is untouched.
    """
    target = Path(directory).absolute()
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ValueError(f"`directory == {str(target)!r}` is a file or a link, must be a folder")
    if target.exists() and any(target.iterdir()) and not (target / MANIFEST_FILE).is_file():
        raise ValueError(
            f"`directory == {str(target)!r}` is a non-empty folder without {MANIFEST_FILE}; "
            "give a new or empty folder (or an earlier artifact folder to replace)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, target: Path) -> None:
    """Move the completed ``staging`` folder to ``target``, replacing an earlier folder only once it is in place."""
    if not target.exists():
        os.replace(staging, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.replace(target, backup / target.name)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup / target.name, target)  # put the earlier folder back
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Add ``"files": {name: sha256}`` for every file in ``folder`` and write ``manifest.json``.

    Raises :class:`ArtifactError` if the folder holds anything but plain regular files.
    """
    folder = Path(folder)
    names = [name for name in _regular_entries(folder) if name != MANIFEST_FILE]
    files = {check_plain_name(name): _sha256(folder / name) for name in names}
    text = json.dumps({**manifest, "files": files}, indent=2, sort_keys=True, allow_nan=False) + "\n"
    if len(text.encode()) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"the manifest would be {len(text.encode())} bytes, over the {MAX_MANIFEST_BYTES}-byte bound")
    (folder / MANIFEST_FILE).write_text(text)


def _json_depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in JSON ``text`` (brackets inside strings ignored), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _refuse_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name} is not allowed")


def read_manifest(directory: str | os.PathLike[str], *, required: Iterable[str] = ()) -> dict[str, Any]:
    """Check the artifact folder ``directory`` and return its manifest; nothing is used before it is checked.

    Refused with :class:`ArtifactError` naming the problem: a missing, linked or oversized
    (> ``MAX_MANIFEST_BYTES``) manifest, invalid JSON, NaN/Infinity literals, nesting deeper
    than ``MAX_JSON_DEPTH``, a file name that is not plain, a file in the folder that is not
    listed (or not a regular file), a listed file that is missing or whose SHA-256 differs,
    and a name of ``required`` not listed.
    """
    folder = Path(directory)
    path = folder / MANIFEST_FILE
    try:
        info = path.lstat()
    except OSError:
        raise ArtifactError(f"no {MANIFEST_FILE} in {str(folder)!r}: not an artifact folder") from None
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(f"{str(path)!r} is not a regular file")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{str(path)!r} is {info.st_size} bytes, over the {MAX_MANIFEST_BYTES}-byte bound")
    with path.open("rb") as file:
        raw = file.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{str(path)!r} is over the {MAX_MANIFEST_BYTES}-byte bound")
    try:
        text = raw.decode("utf-8")
        depth = _json_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise ArtifactError(f"{str(path)!r} nests {depth} levels deep, over the bound of {MAX_JSON_DEPTH}")
        manifest = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        if isinstance(error, ArtifactError):
            raise
        raise ArtifactError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{str(path)!r} holds a {type(manifest).__name__}, must be a JSON object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{str(path)!r} has no 'files' object listing the artifact files")
    for name, digest in files.items():
        check_plain_name(name)
        if name == MANIFEST_FILE:
            raise ArtifactError(f"{str(path)!r} lists itself in 'files'")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ArtifactError(f"{str(path)!r} gives file {name!r} the hash {digest!r}, must be 64 lowercase hex digits")
    for name in required:
        if name not in files:
            raise ArtifactError(f"{str(path)!r} does not list the required file {name!r}")
    present = [name for name in _regular_entries(folder) if name != MANIFEST_FILE]
    unlisted = sorted(set(present) - set(files))
    if unlisted:
        raise ArtifactError(f"{str(folder)!r} holds files the manifest does not list: {unlisted}")
    for name, digest in files.items():
        if name not in present:
            raise ArtifactError(f"artifact file {name!r} is missing from {str(folder)!r}")
        if _sha256(folder / name) != digest:
            raise ArtifactError(f"artifact file {name!r} in {str(folder)!r} is corrupt or was modified: SHA-256 mismatch")
    return manifest


def read_verified(folder: str | os.PathLike[str], manifest: dict[str, Any], name: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of the listed file ``name``, re-checked against the manifest's hash as they are read;
    refused unread when it is larger than ``max_bytes`` (the most a valid file of its kind can hold)."""
    check_plain_name(name)
    digest = manifest.get("files", {}).get(name)
    if digest is None:
        raise ArtifactError(f"file {name!r} is not listed in the manifest, so it is not read")
    path = Path(folder) / name
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"artifact file {name!r} is missing from {str(folder)!r} or not a regular file")
    if max_bytes is not None and (size := path.lstat().st_size) > max_bytes:
        raise ArtifactError(f"{name} in {str(folder)!r} is {size} bytes, over the {max_bytes}-byte bound for this file")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != digest:
        raise ArtifactError(f"artifact file {name!r} in {str(folder)!r} changed after it was checked: SHA-256 mismatch")
    return data
