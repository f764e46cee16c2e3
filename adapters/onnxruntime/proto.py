"""Refuse ONNX models whose tensors point at external data, without ``onnx`` or ``torch``.

An ONNX tensor may say ``data_location = EXTERNAL`` with ``location = "/etc/passwd"``;
ONNX Runtime then reads that file into the model. Artifact folders are self-contained, so
:func:`check_no_external_data` walks the protobuf wire format of a ``ModelProto`` (graphs,
subgraphs in attributes, functions, training info) and raises :class:`ArtifactError` if any
tensor has ``external_data`` entries or ``data_location = EXTERNAL``. Pure Python over a
``memoryview``: weight bytes are skipped, not copied.
"""

from __future__ import annotations

from taste_cl.adapters.device.artifacts import ArtifactError

__all__ = ["check_no_external_data"]

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


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ArtifactError("malformed ONNX model: truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _walk(data: memoryview, pos: int, end: int, kind: int, depth: int, name: str) -> None:
    if depth > _MAX_DEPTH:
        raise ArtifactError(f"{name}: ONNX model nests deeper than {_MAX_DEPTH} levels")
    children = _CHILDREN[kind]
    while pos < end:
        key, pos = _varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos, end)
            if kind == _TENSOR and field == _TENSOR_DATA_LOCATION and value == _EXTERNAL:
                raise ArtifactError(f"{name}: a tensor stores its data externally (data_location=EXTERNAL); refused")
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(data, pos, end)
            if pos + length > end:
                raise ArtifactError(f"{name}: malformed ONNX model (a field runs past its message)")
            if kind == _TENSOR and field == _TENSOR_EXTERNAL_DATA:
                raise ArtifactError(f"{name}: a tensor points at external data (external_data entries); refused")
            if field in children:
                _walk(data, pos, pos + length, children[field], depth + 1, name)
            pos += length
        else:
            raise ArtifactError(f"{name}: malformed ONNX model (wire type {wire})")
    if pos != end:
        raise ArtifactError(f"{name}: malformed ONNX model (a field runs past its message)")


def check_no_external_data(data: bytes, *, name: str = "model") -> None:
    """Raise :class:`ArtifactError` if the serialized ``ModelProto`` ``data`` references external data."""
    view = memoryview(data)
    _walk(view, 0, len(view), _MODEL, 0, name)
