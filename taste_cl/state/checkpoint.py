"""Checkpoint files with no pickle anywhere: a JSON header plus safetensors buffers.

A checkpoint is one file, ``<dir>/learner.ckpt``::

    b"TASTECL2" | SHA-256 of the rest (32 bytes) | header length (8 bytes, little endian)
    | JSON header (UTF-8) | safetensors section

The JSON header holds every non-tensor value in a small tagged schema (see
:func:`encode_state`); tensors live in the safetensors section (a JSON index and raw
buffers, no code), referenced from the header by name. Reading never builds arbitrary
Python objects: only dicts, lists, tuples, str, int, float, bool, None and tensors.

Reading is bounded before anything is parsed: the file must be a regular file (no
symbolic link, FIFO or device) no larger than ``max_bytes`` (2 GiB by default); the
header is bounded in bytes, nesting depth, value count and tensor count. The checksum is
verified before parsing. Writes go to a temporary file in the same folder, named with
the writer's host, PID and a random part, are fsynced, then renamed over the old file, so a
crash mid-save leaves the previous checkpoint intact and concurrent writers (threads or
processes) never touch each other's temporary files. Temporary files left by a killed
writer are removed by the next save on the same host, once that writer's PID is no
longer alive.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from taste_cl._checks import check_int
from taste_cl.exceptions import CheckpointError, CheckpointNotFoundError
from taste_cl.state.files import atomic_write_bytes, read_regular_file

__all__ = [
    "CHECKPOINT_FILE",
    "CheckpointLimits",
    "atomic_write_bytes",
    "decode_state",
    "encode_state",
    "read_checkpoint",
    "write_checkpoint",
]

CHECKPOINT_FILE = "learner.ckpt"
_MAGIC = b"TASTECL2"
_OLD_MAGIC = b"TASTECL1"
_DIGEST_SIZE = hashlib.sha256().digest_size
_LENGTH_SIZE = 8
_PREFIX = len(_MAGIC) + _DIGEST_SIZE
_TAGS = ("$tensor", "$tuple", "$dict", "$float")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(frozen=True)
class CheckpointLimits:
    """Bounds checked while reading an untrusted checkpoint, before the work they bound.

    ``max_bytes`` bounds the file (and so the memory a load commits); the JSON header is
    bounded by ``max_header_bytes``, ``max_depth`` (nesting), ``max_values`` (values in
    the tree) and ``max_tensors``.
    """

    max_bytes: int = 2 * 2**30
    max_header_bytes: int = 64 * 2**20
    max_depth: int = 32
    max_values: int = 2_000_000
    max_tensors: int = 100_000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            check_int(name, value, 1)


DEFAULT_LIMITS = CheckpointLimits()


# ----------------------------------------------------------------------- encoding
class _Encoder:
    """Turn a state tree into a JSON-able tree plus named tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)  # IntEnum and friends become plain ints
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._add_tensor(value, where)}
        if isinstance(value, tuple):
            return {"$tuple": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            return {"$dict": [[self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        raise CheckpointError(
            f"cannot checkpoint {where}: a {type(value).__name__}; only tensors, dicts, lists, tuples, str, int, float, bool and None are stored"
        )

    def _add_tensor(self, tensor: torch.Tensor, where: str) -> str:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
            raise CheckpointError(f"cannot checkpoint {where}: a {tensor.layout} tensor on {tensor.device}; need a dense tensor")
        name = f"t{len(self.tensors)}"
        self.tensors[name] = self._standalone(tensor.detach())
        return name

    def _standalone(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the CPU owning all of its storage (safetensors refuses views and
        shared memory): as it is when it already does, else a contiguous copy."""
        if tensor.device.type != "cpu":
            return tensor.to("cpu").contiguous()
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if (
            pointer
            and pointer not in self._storages
            and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and storage.nbytes() == tensor.numel() * tensor.element_size()
        ):
            self._storages.add(pointer)
            return tensor
        return tensor.clone(memory_format=torch.contiguous_format)


def _encode_chunks(state: dict[str, Any]) -> list[bytes]:
    """The checkpoint bytes of ``state`` as chunks (no concatenated copy of the tensor section)."""
    from safetensors.torch import save

    if not isinstance(state, dict):
        raise CheckpointError(f"a checkpoint holds a dict; got {type(state).__name__}")
    encoder = _Encoder()
    tree = encoder.encode(state, "state")
    try:
        tensors = save(encoder.tensors) if encoder.tensors else b""
    except Exception as error:  # e.g. a dtype safetensors cannot store
        raise CheckpointError(f"cannot store the checkpoint's tensors: {error}") from error
    header = json.dumps({"tree": tree}, allow_nan=False, separators=(",", ":")).encode()
    digest = hashlib.sha256(len(header).to_bytes(_LENGTH_SIZE, "little"))
    digest.update(header)
    digest.update(tensors)
    return [_MAGIC, digest.digest(), len(header).to_bytes(_LENGTH_SIZE, "little"), header, tensors]


def encode_state(state: dict[str, Any]) -> bytes:
    """Serialize ``state`` (a dict of tensors and plain values) to checkpoint bytes.

    Plain dicts with string keys, lists, str, int, finite floats, bool and None are JSON;
    the rest is tagged as a one-key object: ``{"$tensor": name}``, ``{"$tuple": [...]}``,
    ``{"$dict": [[key, value], ...]}`` (non-string keys) and ``{"$float": "nan"}``.
    """
    return b"".join(_encode_chunks(state))


# ----------------------------------------------------------------------- decoding
class _Decoder:
    """Rebuild a state tree from the header tree and the named tensors, within limits."""

    def __init__(self, tensors: dict[str, torch.Tensor], limits: CheckpointLimits, source: str) -> None:
        self.tensors = tensors
        self.unused = set(tensors)
        self.limits = limits
        self.source = source
        self.values = 0

    def fail(self, rule: str) -> CheckpointError:
        return CheckpointError(f"{self.source} has a malformed header: {rule}")

    def decode(self, node: Any, depth: int) -> Any:
        self.values += 1
        if self.values > self.limits.max_values:
            raise self.fail(f"more than max_values={self.limits.max_values} values")
        if depth > self.limits.max_depth:
            raise self.fail(f"nesting deeper than max_depth={self.limits.max_depth}")
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            return node
        if isinstance(node, list):
            return [self.decode(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise self.fail(f"unexpected JSON value of type {type(node).__name__}")
        tags = [k for k in node if k.startswith("$")]
        if not tags:
            return {k: self.decode(v, depth + 1) for k, v in node.items()}
        if len(node) != 1 or tags[0] not in _TAGS:
            raise self.fail(f"unknown tagged value with keys {sorted(node)[:5]}")
        tag, payload = tags[0], node[tags[0]]
        if tag == "$tensor":
            if not isinstance(payload, str) or payload not in self.unused:
                raise self.fail(f"tensor reference {payload!r} is unknown or used twice")
            self.unused.discard(payload)
            return self.tensors[payload]
        if tag == "$float":
            if payload not in _NON_FINITE:
                raise self.fail(f"$float must be one of {sorted(_NON_FINITE)}; got {payload!r}")
            return _NON_FINITE[payload]
        if not isinstance(payload, list):
            raise self.fail(f"{tag} must hold a list; got {type(payload).__name__}")
        if tag == "$tuple":
            return tuple(self.decode(v, depth + 1) for v in payload)
        pairs = {}
        for pair in payload:
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.fail("$dict entries must be [key, value] pairs")
            key = self.decode(pair[0], depth + 1)
            if isinstance(key, (dict, list, torch.Tensor)):
                raise self.fail(f"$dict key of type {type(key).__name__} is not hashable")
            pairs[key] = self.decode(pair[1], depth + 1)
        return pairs


def decode_state(data: bytes, *, limits: CheckpointLimits = DEFAULT_LIMITS, source: str = "checkpoint") -> dict[str, Any]:
    """Verify and parse bytes written by :func:`encode_state`; raise :class:`CheckpointError` otherwise."""
    from safetensors.torch import load

    if len(data) > limits.max_bytes:
        raise CheckpointError(f"{source} is {len(data)} bytes, over the bound max_bytes={limits.max_bytes}")
    if data.startswith(_OLD_MAGIC):
        raise CheckpointError(f"{source} is a format-1 (pickle-based) checkpoint, which is no longer read; save it again with this version")
    if len(data) < _PREFIX + _LENGTH_SIZE or not data.startswith(_MAGIC):
        raise CheckpointError(f"{source} is not a taste_cl checkpoint (bad header)")
    body = memoryview(data)[_PREFIX:]
    if hashlib.sha256(body).digest() != data[len(_MAGIC) : _PREFIX]:
        raise CheckpointError(f"{source} is corrupt or was modified: checksum mismatch")
    header_len = int.from_bytes(body[:_LENGTH_SIZE], "little")
    if header_len > min(limits.max_header_bytes, len(body) - _LENGTH_SIZE):
        raise CheckpointError(f"{source} has a malformed header: length {header_len} exceeds the file or max_header_bytes={limits.max_header_bytes}")
    try:
        header = json.loads(bytes(body[_LENGTH_SIZE : _LENGTH_SIZE + header_len]))
    except (ValueError, RecursionError) as error:  # bad UTF-8/JSON, huge ints, deep nesting
        raise CheckpointError(f"{source} has a malformed header: {type(error).__name__}: {str(error)[:200]}") from error
    if not isinstance(header, dict) or set(header) != {"tree"}:
        raise CheckpointError(f"{source} has a malformed header: expected an object with one key 'tree'")
    tensor_bytes = bytes(body[_LENGTH_SIZE + header_len :])
    try:
        tensors = load(tensor_bytes) if tensor_bytes else {}
    except Exception as error:  # safetensors validates its own index and offsets
        raise CheckpointError(f"{source} has a malformed tensor section: {error}") from error
    if len(tensors) > limits.max_tensors:
        raise CheckpointError(f"{source} holds {len(tensors)} tensors, over max_tensors={limits.max_tensors}")
    decoder = _Decoder(tensors, limits, source)
    try:
        state = decoder.decode(header["tree"], 0)
    except RecursionError as error:
        raise decoder.fail("nesting too deep") from error
    if decoder.unused:
        raise decoder.fail(f"{len(decoder.unused)} stored tensors are not referenced")
    if not isinstance(state, dict):
        raise CheckpointError(f"{source} holds a {type(state).__name__}, expected a dict")
    return state


def write_checkpoint(
    directory: str | os.PathLike[str],
    state: dict[str, Any] | Callable[[], dict[str, Any]],
    *,
    lock: AbstractContextManager[Any] | None = None,
) -> Path:
    """Atomically write ``state`` (tensors and plain values only) into ``directory``.

    ``state`` may be a function returning it (e.g. a ``state_dict`` method, whose tensors
    are live): it is called and encoded while ``lock`` is held, if one is given, so the
    snapshot is consistent; the file is written after the lock is released.
    """
    target = Path(directory) / CHECKPOINT_FILE
    with lock if lock is not None else nullcontext():
        chunks = _encode_chunks(state() if callable(state) else state)
    atomic_write_bytes(target, chunks)
    return target


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """Read a regular file (never following a symbolic link) of at most ``max_bytes``
    (:func:`~taste_cl.state.files.read_regular_file`), its refusals as checkpoint errors."""
    try:
        return read_regular_file(path, max_bytes)
    except FileNotFoundError as error:
        raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}: file does not exist") from error
    except ValueError as error:
        raise CheckpointError(f"{error}; checkpoints are read from regular files only, within max_bytes={max_bytes}") from error
    except OSError as error:
        raise CheckpointError(f"cannot open checkpoint {str(path)!r}: {error}") from error


def read_checkpoint(directory: str | os.PathLike[str], *, limits: CheckpointLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`write_checkpoint` (a folder or the file itself).

    Raises :class:`CheckpointNotFoundError` when there is no file, :class:`CheckpointError`
    when it is a link or special file, too large, damaged, or malformed.
    """
    path = Path(directory)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    return decode_state(_read_bounded(path, limits.max_bytes), limits=limits, source=repr(str(path)))
