"""Validation and coercion of user batches at the library boundary.

Everything that comes from the app passes through here before any state is touched,
so a bad batch raises :class:`~taste_cl.exceptions.InvalidBatchError` and leaves the
learner exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch

from taste_cl.exceptions import InvalidBatchError

ArrayLike = Union[torch.Tensor, np.ndarray]
BatchLike = Union[tuple[ArrayLike, ArrayLike], Sequence[ArrayLike], Mapping[str, ArrayLike]]

__all__ = ["ArrayLike", "BatchLike", "count_nonfinite", "label_range", "split_batch", "to_features", "to_labels"]

# Dtypes whose CPU tensors share memory with a numpy array: there a check is one numpy
# call (about a microsecond) instead of two torch ops with their dispatch cost.
_NUMPY_DTYPES = frozenset(
    {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)


def _numpy_view(t: torch.Tensor) -> np.ndarray | None:
    if t.is_cpu and t.dtype in _NUMPY_DTYPES and not t.requires_grad:
        return t.numpy()
    return None


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN or infinite entries of a floating tensor (0 for integer ones)."""
    if not x.is_floating_point():
        return 0
    view = _numpy_view(x)
    if view is not None:
        return 0 if np.isfinite(view).all() else int(x.numel() - np.count_nonzero(np.isfinite(view)))
    return 0 if bool(torch.isfinite(x).all()) else int((~torch.isfinite(x)).sum())


def label_range(y: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest entry of a non-empty integer tensor."""
    view = _numpy_view(y)
    if view is not None:
        return int(view.min()), int(view.max())
    return int(y.min()), int(y.max())


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Return ``(x, y)`` from an ``(x, y)`` pair or a ``{"x": ..., "y": ...}`` mapping."""
    if isinstance(batch, Mapping):
        missing = [key for key in ("x", "y") if key not in batch]
        if missing:
            raise InvalidBatchError(
                f"batch mapping must have keys 'x' and 'y'; missing {missing}, got keys {sorted(map(str, batch))}"
            )
        return batch["x"], batch["y"]
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise InvalidBatchError(f"batch must be a pair (x, y); got a {type(batch).__name__} of length {len(batch)}")
        return batch[0], batch[1]
    raise InvalidBatchError(
        f"batch must be an (x, y) pair or a mapping with keys 'x' and 'y'; got {type(batch).__name__}"
    )


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise InvalidBatchError(f"{name} must have a numeric dtype; got numpy dtype object")
        return torch.from_numpy(np.ascontiguousarray(value))
    raise InvalidBatchError(f"{name} must be a torch.Tensor or numpy.ndarray; got {type(value).__name__}")


def to_features(
    value: Any,
    *,
    feature_shape: tuple[int, ...] | None,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "x",
) -> torch.Tensor:
    """Validate a feature batch of shape ``(n, *feature_shape)`` and return a fresh tensor.

    The result never aliases the caller's memory, so storing it in a buffer cannot be
    changed behind the learner's back.
    """
    x = _as_tensor(value, name)
    if x.dtype == torch.bool or x.is_complex() or not (x.is_floating_point() or _is_integer(x.dtype)):
        raise InvalidBatchError(f"{name} must be a real floating or integer tensor; got dtype {x.dtype}")
    if x.dim() < 2:
        raise InvalidBatchError(
            f"{name} must have shape (batch, *features) with at least 2 dimensions; got shape {tuple(x.shape)}"
        )
    if x.shape[0] == 0:
        raise InvalidBatchError(f"{name} is an empty batch (shape {tuple(x.shape)}); give at least one sample")
    if feature_shape is not None and tuple(x.shape[1:]) != tuple(feature_shape):
        raise InvalidBatchError(
            f"{name} has feature shape {tuple(x.shape[1:])}, expected {tuple(feature_shape)} "
            f"(full shape got {tuple(x.shape)})"
        )
    x = x.to(device=device, dtype=dtype, copy=True).contiguous()
    bad = count_nonfinite(x)
    if bad:
        raise InvalidBatchError(f"{name} contains {bad} non-finite value(s) (NaN or inf)")
    return x


def to_labels(value: Any, *, n: int, num_classes: int | None, device: torch.device, name: str = "y") -> torch.Tensor:
    """Validate a label batch: integer dtype, shape ``(n,)``, values in ``[0, num_classes)``."""
    y = _as_tensor(value, name)
    if not _is_integer(y.dtype):
        raise InvalidBatchError(f"{name} must hold integer class labels; got dtype {y.dtype}")
    if y.dim() != 1:
        raise InvalidBatchError(f"{name} must be 1-D of shape ({n},); got shape {tuple(y.shape)}")
    if y.shape[0] != n:
        raise InvalidBatchError(f"x and {name} lengths differ: x has {n} samples, {name} has {y.shape[0]}")
    if y.numel() and num_classes is not None:
        low, high = label_range(y)
        if low < 0 or high >= num_classes:
            offending = low if low < 0 else high
            raise InvalidBatchError(
                f"{name} has label {offending} out of range; labels must be in [0, {num_classes - 1}]"
            )
    return y.to(device=device, dtype=torch.long, copy=True)


def _is_integer(dtype: torch.dtype) -> bool:
    return dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
