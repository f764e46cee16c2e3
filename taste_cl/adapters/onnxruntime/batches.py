"""A device batch checked against the manifest: numpy arrays of the graph's dtypes and shapes, labels in range.

Torch-free; :class:`~taste_cl.exceptions.InvalidBatchError` says what is wrong before
anything reaches ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from taste_cl.adapters.onnxruntime.manifest import DeviceSpec, TensorSpec
from taste_cl.exceptions import InvalidBatchError

__all__ = ["bad_ids", "bad_labels", "features", "split_batch", "targets"]

_KINDS = {"float32": "fiu", "int64": "iu", "int32": "iu", "bool": "b"}


def _array(value: Any, spec: TensorSpec, what: str, n: int | None) -> np.ndarray:
    """``value`` as a C-contiguous array of ``spec``'s dtype and shape; :class:`InvalidBatchError` otherwise."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. a tensor on an accelerator, ragged lists
        raise InvalidBatchError(f"{what} could not be read as an array: {error}") from None
    kinds = _KINDS.get(spec.dtype, "fiu")
    if array.dtype.kind not in kinds or (array.dtype.kind == "f" and array.dtype.itemsize > 8):
        raise InvalidBatchError(f"{what} has dtype {array.dtype}, must be convertible to {spec.dtype} (kinds {kinds!r})")
    if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
        raise InvalidBatchError(f"{what} has shape {tuple(array.shape)}, must be (n, {', '.join(map(str, spec.shape))})")
    if array.shape[0] < 1 or (n is not None and array.shape[0] != n):
        raise InvalidBatchError(f"{what} has {array.shape[0]} rows, must have {n if n is not None else 'at least 1'}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidBatchError(f"{what} holds NaN or infinite values")
    problem = bad_ids(array, spec)
    if problem:
        raise InvalidBatchError(f"{what} holds {problem}")
    return np.ascontiguousarray(array, dtype=spec.dtype)


def bad_ids(array: np.ndarray, spec: TensorSpec) -> str | None:
    """Why embedding ids are outside their table (ONNX Runtime's Gather wraps negative ids), or None."""
    if spec.bound is None or not array.size or 0 <= array.min() <= array.max() < spec.bound:
        return None
    return f"ids in [{array.min()}, {array.max()}], must be in [0, {spec.bound - 1}] (the embedding table's rows)"


def _leaves(x: Any, spec: DeviceSpec) -> list[Any]:
    if spec.structure == "tensor":
        return [x]
    if spec.structure == "dict":
        names = [item.name for item in spec.inputs]
        if not isinstance(x, Mapping) or set(x) != set(names):
            got = sorted(map(str, x)) if isinstance(x, Mapping) else type(x).__name__
            raise InvalidBatchError(f"x must be a dict with keys {sorted(names)}; got {got}")
        return [x[name] for name in names]
    if not isinstance(x, (list, tuple)) or len(x) != len(spec.inputs):
        raise InvalidBatchError(f"x must be a list or tuple of {len(spec.inputs)} arrays; got {type(x).__name__}")
    return list(x)


def features(x: Any, spec: DeviceSpec) -> list[np.ndarray]:
    arrays: list[np.ndarray] = []
    for leaf, item in zip(_leaves(x, spec), spec.inputs):
        arrays.append(_array(leaf, item, f"x[{item.name!r}]", arrays[0].shape[0] if arrays else None))
    return arrays


def bad_labels(labels: np.ndarray, spec: DeviceSpec) -> str | None:
    """Why class labels are out of range (the loss's ``ignore_index`` is allowed), or None."""
    if spec.num_classes is None:
        return None
    kept = labels[labels != spec.ignore_index] if spec.ignore_index is not None else labels
    if kept.size and (kept.min() < 0 or kept.max() >= spec.num_classes):
        ignored = f" (or {spec.ignore_index}, ignored)" if spec.ignore_index is not None else ""
        return f"labels in [{kept.min()}, {kept.max()}], must be in [0, {spec.num_classes - 1}]{ignored}"
    return None


def targets(y: Any, spec: DeviceSpec, n: int) -> np.ndarray:
    if spec.labels.dtype == "float32" and spec.labels.shape == (1,) and np.ndim(y) == 1:
        y = np.reshape(y, (-1, 1))  # like the learner: a regression target (n,) for an (n, 1) output
    labels = _array(y, spec.labels, "y", n)
    problem = bad_labels(labels, spec)
    if problem:
        raise InvalidBatchError(f"y holds {problem}")
    return labels


def split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, Mapping) and set(batch) == {"x", "y"}:
        return batch["x"], batch["y"]
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise InvalidBatchError(f"batch must be (x, y) or {{'x': x, 'y': y}}; got {type(batch).__name__}")
