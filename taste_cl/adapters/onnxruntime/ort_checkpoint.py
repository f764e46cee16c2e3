"""Read an ONNX Runtime training checkpoint's tensors without torch, onnx or ORT's Python tools.

The checkpoint is a FlatBuffer (ORT's ``ort_training_checkpoint.fbs``, format versions 1 and
2): the module state (parameters that train, frozen parameters, whether tensor data lives in
an external file) and optimizer groups holding each parameter's state (momentum tensors).
:func:`read_checkpoint` reads names, data types and dimensions, and checks that each tensor's
data fits its dimensions, so the device learner can compare the checkpoint with the training
graph before ONNX Runtime loads anything (``onnxruntime.tools`` has generated readers, but
importing it imports torch and onnx). Every offset is bounds-checked: a malformed buffer
raises :class:`ArtifactError`, never an ``IndexError`` or a read outside the buffer.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.proto import ONNX_DTYPES

__all__ = ["CheckpointInfo", "CheckpointTensor", "read_checkpoint"]

_ITEM_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}  # fmt: skip
# table field indices (declaration order in ort_training_checkpoint.fbs)
_CKPT_MODULE, _CKPT_GROUPS = 1, 2
_MODULE_TRAINABLE, _MODULE_FROZEN, _MODULE_EXTERNAL = 0, 1, 3
_GROUP_STATES = 3
_STATE_PARAM, _STATE_MOMENTS = 0, 1
_TENSOR_NAME, _TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_RAW = 0, 2, 3, 4


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the checkpoint: its name, data type name and dimensions."""

    name: str
    dtype: str
    dims: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype} {self.dims}"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint holds: parameters by name (trained ones, frozen ones) and per-parameter
    optimizer state (moment name -> tensor)."""

    trainable: dict[str, CheckpointTensor]
    frozen: dict[str, CheckpointTensor]
    optimizer: dict[str, dict[str, CheckpointTensor]]

    @property
    def parameters(self) -> dict[str, CheckpointTensor]:
        return {**self.trainable, **self.frozen}


class _Reader:
    """Bounds-checked FlatBuffer reads over one buffer."""

    def __init__(self, data: bytes, name: str) -> None:
        self.data, self.name = data, name

    def fail(self, why: str) -> ArtifactError:
        return ArtifactError(f"{self.name}: malformed ONNX Runtime checkpoint ({why})")

    def unpack(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise self.fail(f"offset {pos} is outside the {len(self.data)}-byte buffer")
        return int(struct.unpack_from(fmt, self.data, pos)[0])

    def target(self, pos: int) -> int:
        """Follow the unsigned offset stored at ``pos``."""
        return pos + self.unpack("<I", pos)

    def field(self, table: int, index: int) -> int | None:
        """Where field ``index`` of the table at ``table`` is stored, or None when absent."""
        vtable = table - self.unpack("<i", table)
        size = self.unpack("<H", vtable)
        slot = 4 + 2 * index
        if size < 4 or slot + 2 > size:
            return None
        offset = self.unpack("<H", vtable + slot)
        return table + offset if offset else None

    def vector(self, table: int, index: int, item: int) -> tuple[int, int]:
        """(start, length) of a vector field of ``item``-byte elements; (0, 0) when absent."""
        pos = self.field(table, index)
        if pos is None:
            return 0, 0
        start = self.target(pos)
        length = self.unpack("<I", start)
        if start + 4 + length * item > len(self.data):
            raise self.fail(f"a vector of {length} elements runs past the buffer")
        return start + 4, length

    def tables(self, table: int, index: int) -> list[int]:
        start, length = self.vector(table, index, 4)
        return [self.target(start + 4 * i) for i in range(length)]

    def string(self, table: int, index: int) -> str:
        start, length = self.vector(table, index, 1)
        return self.data[start : start + length].decode("utf-8", errors="replace")

    def tensor(self, table: int) -> CheckpointTensor:
        start, rank = self.vector(table, _TENSOR_DIMS, 8)
        dims = tuple(self.unpack("<q", start + 8 * i) for i in range(rank))
        pos = self.field(table, _TENSOR_TYPE)
        dtype = ONNX_DTYPES.get(self.unpack("<i", pos), "other") if pos is not None else "undefined"
        name = self.string(table, _TENSOR_NAME)
        if any(d < 0 for d in dims) or dtype not in _ITEM_SIZES:
            raise self.fail(f"tensor {name!r} is {dtype} with dimensions {dims}")
        _, size = self.vector(table, _TENSOR_RAW, 1)
        if size != math.prod(dims) * _ITEM_SIZES[dtype]:
            raise self.fail(f"tensor {name!r} holds {size} bytes, not the {math.prod(dims)} {dtype} values of {dims}")
        return CheckpointTensor(name, dtype, dims)

    def flag(self, table: int, index: int) -> bool:
        pos = self.field(table, index)
        return pos is not None and self.unpack("<B", pos) != 0


def _by_name(tensors: list[CheckpointTensor], reader: _Reader, what: str) -> dict[str, CheckpointTensor]:
    named = {tensor.name: tensor for tensor in tensors}
    if len(named) != len(tensors):
        raise reader.fail(f"{what} repeat a name")
    return named


def read_checkpoint(data: bytes, *, name: str = "checkpoint") -> CheckpointInfo:
    """The parameters and optimizer state of the serialized checkpoint ``data``.

    Raises :class:`ArtifactError` naming ``name`` for a malformed buffer, a tensor whose data
    does not fit its dimensions, a name used twice, or tensors kept in an external file (an
    artifact folder is self-contained).
    """
    reader = _Reader(data, name)
    root = reader.target(0)
    module_pos = reader.field(root, _CKPT_MODULE)
    if module_pos is None:
        raise reader.fail("no module state")
    module = reader.target(module_pos)
    if reader.flag(module, _MODULE_EXTERNAL):
        raise ArtifactError(f"{name}: the checkpoint keeps its tensors in an external data file; refused")
    trainable = _by_name([reader.tensor(t) for t in reader.tables(module, _MODULE_TRAINABLE)], reader, "parameters")
    frozen = _by_name([reader.tensor(t) for t in reader.tables(module, _MODULE_FROZEN)], reader, "parameters")
    if trainable.keys() & frozen.keys():
        raise reader.fail(f"parameters {sorted(trainable.keys() & frozen.keys())} are both trained and frozen")
    optimizer: dict[str, dict[str, CheckpointTensor]] = {}
    for group in reader.tables(root, _CKPT_GROUPS):
        for state in reader.tables(group, _GROUP_STATES):
            param = reader.string(state, _STATE_PARAM)
            if param in optimizer:
                raise reader.fail(f"optimizer state of {param!r} appears twice")
            optimizer[param] = _by_name([reader.tensor(t) for t in reader.tables(state, _STATE_MOMENTS)], reader, f"moments of {param!r}")
    return CheckpointInfo(trainable, frozen, optimizer)
