"""The fixed-capacity tensor store the built-in replay buffers share, and its checked state.

User buffers may use :class:`BufferStorage` too (see ``examples/custom_replay.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from taste_cl._batch import Spec, count_nonfinite, describe, index_batch, leaves, spec_mismatch, to_like, unflatten
from taste_cl.exceptions import InvalidBatchError

__all__ = ["BufferStorage", "State", "check_capacity", "describe_key", "is_int", "state_int"]

State = dict[str, Any]


def check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int; got {type(capacity).__name__}")
    if capacity < 1:
        raise ValueError(f"`capacity == {capacity}`, must be >= 1")
    return capacity


class BufferStorage:
    """Fixed-capacity store of samples ``(x, y, **fields)`` in contiguous slots ``0 .. len-1``.

    ``x`` is a tensor or a dict/tuple/list of tensors (stored leaf by leaf, each leaf in
    its own dtype); ``y`` is a tensor ``(n, ...)``; ``fields`` are optional named
    per-sample tensors a strategy needs later (stored logits, a timestamp, a loss).
    Memory is allocated once, on the first append, from the first batch's structure,
    shapes, dtypes and device. Later batches must have the same structure and per-leaf
    feature shapes and kinds (float, integer, bool); they are converted to the stored
    dtype and device, so a model moved to another dtype or device mid-stream keeps its buffer.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self._spec: Spec | None = None
        self._x: list[torch.Tensor] = []
        self._y: torch.Tensor | None = None
        self._fields: dict[str, torch.Tensor] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def feature_shape(self) -> tuple[int, ...] | None:
        """Feature shape of a single-tensor ``x`` (None before the first append or for structured ``x``)."""
        return self._spec.shape if self._spec is not None and self._spec.is_tensor else None

    @property
    def field_names(self) -> tuple[str, ...]:
        """Names of the extra per-sample fields stored."""
        return tuple(self._fields)

    @property
    def labels(self) -> torch.Tensor:
        """Targets of the stored samples (a read-only view; do not modify)."""
        if self._y is None:
            return torch.empty(0, dtype=torch.long)
        return self._y[: self._size]

    def check_batch(self, x: Any, y: Any, **fields: Any) -> None:
        """Raise :class:`InvalidBatchError` unless ``(x, y, **fields)`` fits this store."""
        try:
            x_leaves = leaves(x)
        except TypeError:
            x_leaves = []
        if not x_leaves or not all(isinstance(t, torch.Tensor) for t in x_leaves) or not isinstance(y, torch.Tensor):
            raise InvalidBatchError(
                f"x and y must be torch tensors (x may be a dict/tuple/list of them); got {type(x).__name__} and {type(y).__name__}"
            )
        named = {"y": y, **{f"field {k!r}": v for k, v in fields.items()}}
        if not all(isinstance(v, torch.Tensor) for v in named.values()):
            raise InvalidBatchError(f"fields must be torch tensors; got {sorted(fields)}")
        n = y.shape[0] if y.dim() else -1
        if any(t.dim() < 1 or t.shape[0] != n for t in [*x_leaves, *named.values()]):
            shapes = [tuple(t.shape) for t in x_leaves]
            raise InvalidBatchError(
                f"x must be (n, *features) and y (n, ...) with the same n; got {shapes if len(shapes) > 1 else shapes[0]} and {tuple(y.shape)}"
            )
        for t in x_leaves:
            if count_nonfinite(t):
                raise InvalidBatchError("x contains non-finite values (NaN or inf)")
        if self._spec is None or self._y is None:
            return
        problem = spec_mismatch(self._spec, describe(x))
        if problem:
            stored = self._spec.shape if self._spec.is_tensor else "its first structure"
            dtypes = [t.dtype for t in x_leaves]
            raise InvalidBatchError(
                f"{problem} and dtype {dtypes[0] if len(dtypes) == 1 else dtypes}; this buffer stores {stored} "
                f"and {self._x[0].dtype if len(self._x) == 1 else [t.dtype for t in self._x]}"
            )
        if set(fields) != set(self._fields):
            raise InvalidBatchError(f"fields {sorted(fields)} differ from the stored fields {sorted(self._fields)}")
        for name, value, stored_t in [("y", y, self._y), *((f"field {k!r}", fields[k], self._fields[k]) for k in fields)]:
            if tuple(value.shape[1:]) != tuple(stored_t.shape[1:]) or _kind(value) != _kind(stored_t):
                raise InvalidBatchError(
                    f"{name} has shape {tuple(value.shape[1:])} per sample and dtype {value.dtype}; "
                    f"this buffer stores {tuple(stored_t.shape[1:])} and {stored_t.dtype}"
                )

    def _allocate(self, x: Any, y: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        def empty(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((self.capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)

        self._spec = describe(x)
        self._x = [empty(t) for t in leaves(x)]
        self._y = empty(y)
        self._fields = {name: empty(t) for name, t in fields.items()}

    def _columns(self, x: Any, y: torch.Tensor, fields: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(store, batch) pairs for every stored tensor."""
        assert self._y is not None
        pairs = [*zip(self._x, leaves(x)), (self._y, y)]
        return pairs + [(self._fields[name], fields[name]) for name in self._fields]

    def append(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        """Store ``x``/``y``/``fields`` (a batch) in the next free slots."""
        n = y.shape[0]
        if self._size + n > self.capacity:
            raise RuntimeError(f"append of {n} samples overflows capacity {self.capacity} (size {self._size})")
        if self._y is None:
            self._allocate(x, y, fields)
        for store, batch in self._columns(x, y, fields):
            store[self._size : self._size + n] = batch
        self._size += n

    def write(self, slots: torch.Tensor, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        """Overwrite the given (distinct, filled) slots."""
        assert self._y is not None
        slots = _on(slots, self._y)
        for store, batch in self._columns(x, y, fields):
            store.index_copy_(0, slots, to_like(batch, store))

    def write_rows(self, x: Any, y: torch.Tensor, rows_by_slot: dict[int, int], **fields: torch.Tensor) -> None:
        """Overwrite each (filled) slot with row ``rows_by_slot[slot]`` of the batch."""
        if len(rows_by_slot) == 1:  # the usual replacement: row copies, no index tensors to build
            ((slot, row),) = rows_by_slot.items()
            for store, batch in self._columns(x, y, fields):
                store[slot] = batch[row]
            return
        slots, rows = torch.tensor([list(rows_by_slot), list(rows_by_slot.values())], device=y.device)
        picked = {name: value.index_select(0, rows) for name, value in fields.items()}
        self.write(slots, index_batch(x, rows), y.index_select(0, rows), **picked)

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only the samples at ``slots`` (distinct, filled), packed into slots
        ``0 .. len(slots) - 1`` in that order; the rest are dropped."""
        assert self._y is not None
        n = slots.shape[0]
        slots = _on(slots, self._y)
        for store in [*self._x, self._y, *self._fields.values()]:
            store[:n] = store.index_select(0, slots)  # a copy first, so overlapping slots are safe
        self._size = n

    def gather(self, slots: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Return copies of ``(x, y)`` at ``slots``."""
        assert self._spec is not None and self._y is not None
        slots = _on(slots, self._y)
        x = [t.index_select(0, slots) for t in self._x]
        return x[0] if self._spec.is_tensor else unflatten(self._spec, x), self._y.index_select(0, slots)

    def contents(self) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
        """Views of every stored ``(x, y, fields)`` in slot order (no copy: read, never modify)."""
        assert self._spec is not None and self._y is not None
        x = [t[: self._size] for t in self._x]
        fields = {name: t[: self._size] for name, t in self._fields.items()}
        return x[0] if self._spec.is_tensor else unflatten(self._spec, x), self._y[: self._size], fields

    def widen_field(self, name: str, columns: torch.Tensor) -> None:
        """Append ``columns`` ``(len, k)`` to the per-sample rows of field ``name`` (DER++'s
        logits when the classifier grows; see :mod:`taste_cl.learner.heads`)."""
        store = self._fields[name]
        wide = store.new_zeros((self.capacity, store.shape[1] + columns.shape[1]))
        wide[:, : store.shape[1]] = store
        wide[: self._size, store.shape[1] :] = columns
        self._fields[name] = wide

    def gather_fields(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return copies of the extra fields at ``slots``."""
        return {name: t.index_select(0, _on(slots, t)) for name, t in self._fields.items()}

    def state_dict(self) -> State:
        """Plain values and tensors: ``x`` (one tensor, or a list of leaves with ``x_spec``), ``y``, ``fields``."""
        if self._spec is None or self._y is None:
            return {"capacity": self.capacity, "size": 0}
        stored = [t[: self._size].clone() for t in self._x]
        state: State = {"capacity": self.capacity, "size": self._size, "y": self._y[: self._size].clone()}
        if self._spec.is_tensor:
            state["x"] = stored[0]
        else:
            state.update(x=stored, x_spec=self._spec.to_json())
        if self._fields:
            state["fields"] = {name: t[: self._size].clone() for name, t in self._fields.items()}
        return state

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        if not isinstance(state, dict) or not is_int(state.get("capacity"), self.capacity):
            raise ValueError(f"storage state must be a dict with capacity {self.capacity}; got {describe_key(state, 'capacity')}")
        size = state_int(state, "size", 0, self.capacity)
        if not size:
            self.__dict__.update(BufferStorage(self.capacity).__dict__)
            return
        fields = state.get("fields", {})
        if not isinstance(fields, dict) or not all(isinstance(name, str) for name in fields):
            raise ValueError("storage state `fields` must map names to tensors")
        try:
            spec = Spec.from_json(state["x_spec"]) if "x_spec" in state else None
            x = state.get("x") if spec is None else unflatten(spec, list(state["x"]))
            x_leaves = leaves(x)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"storage state must hold tensors for x: {error}") from error
        named = [*((f"x[{i}]" if spec else "x", t) for i, t in enumerate(x_leaves)), ("y", state.get("y"))]
        for name, t in [*named, *((f"fields.{k}", v) for k, v in fields.items())]:
            _check_stored(name, t, size)
        fresh = BufferStorage(self.capacity)
        fresh.append(x, state["y"], **fields)
        self.__dict__.update(fresh.__dict__)


def _check_stored(name: str, value: Any, size: int) -> None:
    """A tensor of a storage state: ``size`` rows of finite, real values (ValueError naming it otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"storage `{name}` must be a tensor; got {type(value).__name__}")  # noqa: TRY004
    rows = value.shape[0] if value.dim() else 0
    if rows != size:
        raise ValueError(f"storage `{name}` holds {rows} rows; the storage state claims {size} samples")
    if value.is_complex():
        raise ValueError(f"storage `{name}` holds complex values")
    bad = count_nonfinite(value)
    if bad:
        raise ValueError(f"storage `{name}` holds {bad} non-finite values")


def _kind(t: torch.Tensor) -> str:
    return "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int"


def is_int(value: Any, expected: int) -> bool:
    """``value == expected`` for a plain int (a tensor or float never compares)."""
    return type(value) is int and value == expected


def describe_key(state: Any, key: str) -> str:
    return repr(state.get(key)) if isinstance(state, dict) else type(state).__name__


def state_int(state: State, key: str, low: int, high: int | None = None) -> int:
    """``state[key]`` as an int in ``[low, high]``, or ValueError naming the key, rule and value."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"`{key} == {value!r}` in the state, must be an int {bound}")
    return int(value)


def _on(index: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """``index`` on ``store``'s device (without a dispatch when it is there already: the hot path)."""
    return index if index.device == store.device else index.to(store.device)
