"""Read what the device learner must check in an ONNX model, without ``onnx`` or ``torch``.

Two readers over the protobuf wire format of a serialized ``ModelProto``, pure Python over a
``memoryview`` (weight bytes are skipped, not copied):

- :func:`check_no_external_data` refuses a model any of whose tensors points at external data.
  An ONNX tensor may say ``data_location = EXTERNAL`` with ``location = "/etc/passwd"``; ONNX
  Runtime then reads that file into the model. Artifact folders are self-contained, so every
  tensor is visited (graphs, subgraphs in attributes, functions, training info) and one with
  ``external_data`` entries or ``data_location = EXTERNAL`` raises :class:`ArtifactError`.
- :func:`read_signature` returns the main graph's inputs, outputs and initializers (names,
  element types, dimensions) and, for the node types asked for, their numeric attributes, so
  the device learner can check the manifest and the checkpoint against the graphs before ONNX
  Runtime loads anything.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from taste_cl.adapters.device.artifacts import ArtifactError

__all__ = ["ONNX_DTYPES", "GraphNode", "Signature", "ValueInfo", "check_no_external_data", "read_signature"]

_MAX_DEPTH = 64
# message -> {field number: message kind} for the fields that can hold tensors
_MODEL, _GRAPH, _NODE, _ATTRIBUTE, _TENSOR, _SPARSE, _FUNCTION, _TRAINING = range(8)
_CHILDREN = {
    _MODEL: {7: _GRAPH, 25: _FUNCTION, 20: _TRAINING},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTRIBUTE},
    _ATTRIBUTE: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
    _FUNCTION: {7: _NODE, 11: _ATTRIBUTE},
    _TENSOR: {},
}
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION, _EXTERNAL = 13, 14, 1
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
               11: "float64", 16: "bfloat16"}  # fmt: skip
"""ONNX ``TensorProto.DataType`` numbers -> numpy dtype names (others are shown as ``type N``)."""


class _Field(NamedTuple):
    number: int
    wire: int
    value: int  # the varint's value (wire 0), else where the field's bytes start
    end: int  # where the field's bytes end (wire 0: where the varint ends)


def _varint(data: memoryview, pos: int, end: int, name: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ArtifactError(f"{name}: malformed ONNX model (truncated or overlong varint)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview, pos: int, end: int, name: str) -> Iterator[_Field]:
    """The fields of the message in ``data[pos:end]``, each bounded by the message."""
    while pos < end:
        key, pos = _varint(data, pos, end, name)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(data, pos, end, name)
            yield _Field(number, wire, value, pos)
            continue
        if wire == _BYTES:
            length, pos = _varint(data, pos, end, name)
        elif wire in (_FIXED64, _FIXED32):
            length = 8 if wire == _FIXED64 else 4
        else:
            raise ArtifactError(f"{name}: malformed ONNX model (wire type {wire})")
        if pos + length > end:
            raise ArtifactError(f"{name}: malformed ONNX model (a field runs past its message)")
        yield _Field(number, wire, pos, pos + length)
        pos += length


def _walk(data: memoryview, pos: int, end: int, kind: int, depth: int, name: str) -> None:
    if depth > _MAX_DEPTH:
        raise ArtifactError(f"{name}: ONNX model nests deeper than {_MAX_DEPTH} levels")
    children = _CHILDREN[kind]
    for field in _fields(data, pos, end, name):
        if kind == _TENSOR and field.number == _TENSOR_DATA_LOCATION and field.wire == _VARINT and field.value == _EXTERNAL:
            raise ArtifactError(f"{name}: a tensor stores its data externally (data_location=EXTERNAL); refused")
        if field.wire != _BYTES:
            continue
        if kind == _TENSOR and field.number == _TENSOR_EXTERNAL_DATA:
            raise ArtifactError(f"{name}: a tensor points at external data (external_data entries); refused")
        if field.number in children:
            _walk(data, field.value, field.end, children[field.number], depth + 1, name)


def check_no_external_data(data: bytes, *, name: str = "model") -> None:
    """Raise :class:`ArtifactError` if the serialized ``ModelProto`` ``data`` references external data."""
    view = memoryview(data)
    _walk(view, 0, len(view), _MODEL, 0, name)


# ------------------------------------------------------------------ signature
@dataclass(frozen=True)
class ValueInfo:
    """A graph input, output or initializer.

    ``dtype`` is a name from :data:`ONNX_DTYPES` (``"type N"`` for others, ``"non-tensor"`` for
    sequences and maps); ``dims`` has an int per fixed dimension and None per named or unknown
    one, and is None itself when the graph gives no shape.
    """

    name: str
    dtype: str
    dims: tuple[int | None, ...] | None


@dataclass(frozen=True)
class GraphNode:
    """One node of a type asked for: its ``op_type``, input and output names, int and float attributes."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, int | float]


@dataclass(frozen=True)
class Signature:
    """The main graph's inputs, outputs and initializers in order, and the nodes asked for."""

    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    initializers: tuple[ValueInfo, ...]
    nodes: tuple[GraphNode, ...]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(data: memoryview, field: _Field) -> str:
    return bytes(data[field.value : field.end]).decode("utf-8", errors="replace")


def _dtype(number: int) -> str:
    return ONNX_DTYPES.get(number, f"type {number}")


def _children(data: memoryview, field: _Field, name: str) -> Iterator[_Field]:
    if field.wire != _BYTES:
        raise ArtifactError(f"{name}: malformed ONNX model (field {field.number} is not a message)")
    return _fields(data, field.value, field.end, name)


def _shape(data: memoryview, field: _Field, name: str) -> tuple[int | None, ...]:
    dims: list[int | None] = []
    for dim in _children(data, field, name):
        if dim.number == 1:  # TensorShapeProto.dim
            value = None
            for part in _children(data, dim, name):
                if part.number == 1 and part.wire == _VARINT:  # dim_value; dim_param (2) stays None
                    value = _signed(part.value)
            dims.append(value)
    return tuple(dims)


def _value_info(data: memoryview, field: _Field, name: str) -> ValueInfo:
    """A ``ValueInfoProto``: name (1) and type (2) -> tensor_type (1) -> elem_type (1), shape (2)."""
    value_name, dtype, dims = "", "non-tensor", None
    for part in _children(data, field, name):
        if part.number == 1 and part.wire == _BYTES:
            value_name = _text(data, part)
        elif part.number == 2:
            for kind in _children(data, part, name):
                if kind.number != 1:  # sequence, map, optional: not a tensor
                    continue
                dtype = "type 0"
                for item in _children(data, kind, name):
                    if item.number == 1 and item.wire == _VARINT:
                        dtype = _dtype(item.value)
                    elif item.number == 2:
                        dims = _shape(data, item, name)
    return ValueInfo(value_name, dtype, dims)


def _initializer(data: memoryview, field: _Field, name: str) -> ValueInfo:
    """A ``TensorProto``'s name (8), data type (2) and dims (1, packed or not); its data is skipped."""
    tensor_name, dtype, dims = "", "type 0", []
    for part in _children(data, field, name):
        if part.number == 8 and part.wire == _BYTES:
            tensor_name = _text(data, part)
        elif part.number == 2 and part.wire == _VARINT:
            dtype = _dtype(part.value)
        elif part.number == 1 and part.wire == _VARINT:
            dims.append(_signed(part.value))
        elif part.number == 1 and part.wire == _BYTES:
            pos = part.value
            while pos < part.end:
                value, pos = _varint(data, pos, part.end, name)
                dims.append(_signed(value))
    return ValueInfo(tensor_name, dtype, tuple(dims))


def _node(data: memoryview, field: _Field, name: str, ops: Collection[str]) -> GraphNode | None:
    """A ``NodeProto`` whose op_type (4) is in ``ops``: inputs (1), outputs (2), int (3) and float (2) attributes (5)."""
    op_type, attributes = "", []
    names: dict[int, list[_Field]] = {1: [], 2: []}
    for part in _children(data, field, name):
        if part.number == 4 and part.wire == _BYTES:
            op_type = _text(data, part)
        elif part.number in names and part.wire == _BYTES:
            names[part.number].append(part)
        elif part.number == 5:
            attributes.append(part)
    if op_type not in ops:
        return None
    values: dict[str, int | float] = {}
    for attribute in attributes:
        key, value = "", None
        for part in _children(data, attribute, name):
            if part.number == 1 and part.wire == _BYTES:
                key = _text(data, part)
            elif part.number == 2 and part.wire == _FIXED32:
                value = struct.unpack_from("<f", data, part.value)[0]
            elif part.number == 3 and part.wire == _VARINT:
                value = _signed(part.value)
        if value is not None:
            values[key] = value
    inputs, outputs = (tuple(_text(data, part) for part in names[key]) for key in (1, 2))
    return GraphNode(op_type, inputs, outputs, values)


def read_signature(data: bytes, *, name: str = "model", ops: Collection[str] = ()) -> Signature:
    """The main graph's inputs, outputs, initializers, and the nodes whose op_type is in ``ops``.

    Raises :class:`ArtifactError` naming ``name`` if ``data`` is not a well-formed ``ModelProto``
    with a graph.
    """
    view = memoryview(data)
    graphs = [field for field in _fields(view, 0, len(view), name) if field.number == 7]
    if len(graphs) != 1 or graphs[0].wire != _BYTES:
        raise ArtifactError(f"{name}: the ONNX model has {len(graphs)} graph fields, must have one")
    inputs, outputs, initializers, nodes = [], [], [], []
    for field in _fields(view, graphs[0].value, graphs[0].end, name):
        if field.number == 11:
            inputs.append(_value_info(view, field, name))
        elif field.number == 12:
            outputs.append(_value_info(view, field, name))
        elif field.number == 5:
            initializers.append(_initializer(view, field, name))
        elif field.number == 1 and ops:
            node = _node(view, field, name, ops)
            if node is not None:
                nodes.append(node)
    return Signature(tuple(inputs), tuple(outputs), tuple(initializers), tuple(nodes))
