"""Replay buffers: what the learner rehearses so it does not forget.

A strategy decides *which* past samples to keep (``add``) and *which* to rehearse
(``sample``). :class:`BufferStorage` is the fixed-capacity tensor store the built-in
strategies share; user strategies may use it too (see ``examples/custom_replay.py``).

>>> import torch
>>> from taste_cl import ReservoirReplay
>>> buffer = ReservoirReplay(capacity=3, seed=0)
>>> buffer.add(torch.randn(10, 4), torch.arange(10))
>>> len(buffer), buffer.seen
(3, 10)
>>> x, y = buffer.sample(2)
>>> tuple(x.shape), tuple(y.shape)
((2, 4), (2,))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from taste_cl._batch import (
    Spec,
    cat_batches,
    count_nonfinite,
    describe,
    index_batch,
    leaves,
    spec_mismatch,
    to_like,
    unflatten,
)
from taste_cl._checks import INT_LIMIT, check_int
from taste_cl.exceptions import InvalidBatchError

__all__ = ["BufferStorage", "ClassBalancedReplay", "ReplayStrategy", "ReservoirReplay"]

State = dict[str, Any]


def _check_capacity(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int; got {type(capacity).__name__}")
    if capacity < 1:
        raise ValueError(f"`capacity == {capacity}`, must be >= 1")
    return capacity


class ReplayStrategy(ABC):
    """Base class of replay strategies: keep some past samples, hand some back.

    Implement ``add``, ``sample`` and ``__len__``; implement ``state_dict`` and
    ``load_state_dict`` too so learner checkpoints can hold the buffer. Run
    :func:`taste_cl.testing.check_replay_strategy` on your strategy to check the contract.
    """

    capacity: int

    @abstractmethod
    def add(self, x: Any, y: torch.Tensor) -> None:
        """Offer a batch: ``x`` of shape ``(n, *features)`` (or a dict/tuple/list of such
        tensors), targets ``y`` of shape ``(n, ...)`` (class labels ``(n,)`` for classification)."""

    def add_validated(self, x: Any, y: torch.Tensor) -> None:
        """Offer a batch the learner has already validated (finite floating leaves in the
        model's dtype, the learner's structure and shapes, targets checked by its task).
        The learner calls this instead of :meth:`add`; override it to skip checks ``add``
        makes. Default: ``add``."""
        self.add(x, y)

    @abstractmethod
    def sample(self, n: int) -> tuple[Any, torch.Tensor]:
        """Return up to ``n`` stored samples ``(x, y)`` as fresh tensors (never views of the store)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples stored now."""

    def state_dict(self) -> State:
        """Everything needed to resume: tensors, ints, floats, strings, lists and dicts only."""
        raise NotImplementedError(f"{type(self).__name__} does not implement state_dict(); learner checkpoints need it")

    def load_state_dict(self, state: State) -> None:
        """Restore what :meth:`state_dict` returned."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_state_dict(); learner checkpoints need it")


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
        self.capacity = _check_capacity(capacity)
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
        if not isinstance(state, dict) or not _is_int(state.get("capacity"), self.capacity):
            raise ValueError(f"storage state must be a dict with capacity {self.capacity}; got {_describe(state, 'capacity')}")
        size = _state_int(state, "size", 0, self.capacity)
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


def _is_int(value: Any, expected: int) -> bool:
    """``value == expected`` for a plain int (a tensor or float never compares)."""
    return type(value) is int and value == expected


def _describe(state: Any, key: str) -> str:
    return repr(state.get(key)) if isinstance(state, dict) else type(state).__name__


def _state_int(state: State, key: str, low: int, high: int | None = None) -> int:
    """``state[key]`` as an int in ``[low, high]``, or ValueError naming the key, rule and value."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"`{key} == {value!r}` in the state, must be an int {bound}")
    return int(value)


def _parse_generator(state: Any) -> torch.Generator:
    """A new CPU generator set to ``state``, or ValueError."""
    generator = torch.Generator()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError("generator state must be a 1-D uint8 tensor")
    try:
        generator.set_state(state.cpu())
    except RuntimeError as error:
        raise ValueError(f"generator state is invalid: {error}") from error
    return generator


class SeededStrategy(ReplayStrategy):
    """Shared plumbing of the built-in strategies: storage, seed and uniform sampling."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = _check_capacity(capacity)
        self.seed = seed
        self._storage = BufferStorage(capacity)
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self._storage)

    @property
    def storage(self) -> BufferStorage:
        """Where the samples and their extra fields are kept (read what it holds with ``contents``)."""
        return self._storage

    def add(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        """Offer a batch; ``fields`` are extra per-sample tensors stored with it (the same
        names on every call), returned by ``sample(n, with_fields=True)``."""
        self._storage.check_batch(x, y, **fields)
        self.add_validated(x, y, **fields)

    @abstractmethod
    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None: ...

    def add_batches(self, batches: list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]) -> None:
        """``add_validated(x, y, **fields)`` of each batch in order, with runs of batches joined
        into one call where that leaves the same buffer: the draws for n samples are the
        draws for their parts in turn (torch's CPU generator fills a tensor serially), so
        only a draw made between two batches' uniforms (see :meth:`_ends_run`) cuts a run."""
        ends = self._ends_run([y for _, y, _ in batches])
        run: list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]] = []
        for i, (batch, end) in enumerate(zip(batches, ends)):
            run.append(batch)
            if end or i == len(batches) - 1:
                xs, ys, fields = zip(*run)
                if len(run) == 1:
                    self.add_validated(xs[0], ys[0], **fields[0])
                else:
                    self.add_validated(cat_batches(list(xs)), torch.cat(ys), **{k: torch.cat([f[k] for f in fields]) for k in fields[0]})
                run = []

    def _ends_run(self, ys: list[torch.Tensor]) -> list[bool]:
        """For each batch of targets, whether a joined run must end with it (none here: all draws are uniforms)."""
        return [False] * len(ys)

    @property
    def labels(self) -> torch.Tensor:
        """Targets of the stored samples."""
        return self._storage.labels.clone()

    def sample(self, n: int, *, with_fields: bool = False) -> Any:
        """Up to ``n`` distinct stored samples, uniformly: ``(x, y)``, or ``(x, y, fields)``
        with ``with_fields=True`` (``fields`` maps each extra field name to its tensor)."""
        check_int("n", n, 0)
        size = len(self._storage)
        if size == 0:
            raise ValueError(f"cannot sample from an empty {type(self).__name__}; check len() first")
        picks = torch.randperm(size, generator=self._generator)[: min(n, size)]
        x, y = self._storage.gather(picks)
        return (x, y, self._storage.gather_fields(picks)) if with_fields else (x, y)

    def contents(self) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
        """Every stored ``(x, y, fields)`` in storage order, as read-only views (no copy and no
        random draw: for evaluating the whole buffer)."""
        if len(self._storage) == 0:
            raise ValueError(f"{type(self).__name__} is empty; check len() first")
        return self._storage.contents()

    def _uniform(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self._generator, dtype=torch.float64)

    def _base_state(self) -> State:
        return {
            "capacity": self.capacity,
            "seed": self.seed,
            "storage": self._storage.state_dict(),
            "generator": self._generator.get_state(),
        }

    def _parse_base_state(self, state: State) -> tuple[BufferStorage, torch.Generator]:
        """New storage and generator from ``state`` (ValueError if anything is off); ``self`` is untouched."""
        if not isinstance(state, dict) or not _is_int(state.get("capacity"), self.capacity):
            raise ValueError(f"checkpointed {type(self).__name__} has capacity {_describe(state, 'capacity')}, this one has {self.capacity}")
        storage = BufferStorage(self.capacity)
        storage.load_state_dict(state.get("storage", {}))
        return storage, _parse_generator(state.get("generator"))

    def _load_base_state(self, state: State) -> None:
        """Parse and assign the shared part; for subclasses that validate their own fields first."""
        self._storage, self._generator = self._parse_base_state(state)


class ReservoirReplay(SeededStrategy):
    """Reservoir sampling (Vitter's algorithm R): every sample seen so far is retained
    with the same probability ``capacity / seen``, whatever its position in the stream.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self.seen = 0

    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        n = y.shape[0]
        free = min(n, self.capacity - len(self._storage))
        if free:
            head_x, head_y, head_fields = index_batch((x, y, fields), slice(0, free))
            self._storage.append(head_x, head_y, **head_fields)
        rest = n - free
        if rest:
            # Sample i of the rest is the (seen + free + i + 1)-th of the stream: keep it
            # iff a uniform draw over that many positions lands inside the reservoir
            # (Python floats are the same doubles torch would multiply).
            draws = self._uniform(rest).tolist()
            winner: dict[int, int] = {}
            for i, draw in enumerate(draws):
                slot = int(draw * (self.seen + free + i + 1))
                if slot < self.capacity:
                    winner[slot] = free + i  # a later sample overwrites an earlier one
            if winner:
                self._storage.write_rows(x, y, winner, **fields)
        self.seen += n

    def state_dict(self) -> State:
        return {**self._base_state(), "seen": self.seen}

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        storage, generator = self._parse_base_state(state)
        seen = _state_int(state, "seen", len(storage), INT_LIMIT)  # at least what it holds; a corrupt huge count freezes the reservoir
        if len(storage) != min(seen, self.capacity):
            raise ValueError(f"a reservoir that has seen {seen} samples holds {min(seen, self.capacity)}; state holds {len(storage)}")
        self._storage, self._generator, self.seen = storage, generator, seen


class ClassBalancedReplay(SeededStrategy):
    """Capacity split evenly across the classes seen so far (quotas differ by at most one).

    Within a class, samples are kept by reservoir sampling, so every seen sample of a
    class is equally likely to be retained. When a new class arrives, the older classes
    give up uniformly random samples until they fit their new quota.

    Targets must be integer class labels ``(n,)``: it balances on them, so tasks without
    one class per sample (regression, multi-label, token tagging) cannot use it.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self._classes: list[int] = []  # arrival order decides who gets the remainder
        self._seen: dict[int, int] = {}
        self._slots: dict[int, list[int]] = {}
        self._quotas: dict[int, int] = {}

    @property
    def classes(self) -> list[int]:
        """Classes seen so far, in order of arrival."""
        return list(self._classes)

    def quota(self, label: int) -> int:
        """Number of slots class ``label`` may hold now (KeyError for a class not seen yet)."""
        if label not in self._quotas:
            raise KeyError(f"class {label!r} has not been seen; seen classes: {self._classes}")
        return self._quotas[label]

    def _set_quotas(self) -> None:
        self._quotas = _quotas(self.capacity, self._classes)

    def class_counts(self) -> dict[int, int]:
        """Stored samples per class."""
        return {label: len(self._slots[label]) for label in self._classes}

    def add(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        if isinstance(y, torch.Tensor) and (y.dim() != 1 or y.is_floating_point() or y.dtype == torch.bool):
            raise InvalidBatchError(
                f"ClassBalancedReplay balances on integer class labels y of shape (n,); got dtype {y.dtype}, "
                f"shape {tuple(y.shape)} (use ReservoirReplay for other targets)"
            )
        super().add(x, y, **fields)

    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        draws = self._uniform(y.shape[0]).tolist()
        appends: list[int] = []  # batch rows going to the next free slots, in order
        writes: dict[int, int] = {}  # slot -> batch row replacing it (the last one wins)
        # the per-sample loop is the hot path: its lookups are bound once (rebound after a registration)
        seen, slots_of, quotas, stored = self._seen, self._slots, self._quotas, len(self._storage)
        for i, (label, draw) in enumerate(zip(y.tolist(), draws)):
            if label not in seen:
                self._flush(x, y, fields, appends, writes)  # registering may evict and move slots
                self._register(label)
                quotas, stored = self._quotas, len(self._storage)
            count = seen[label] = seen[label] + 1
            slots = slots_of[label]
            if len(slots) < quotas[label]:
                slots.append(stored + len(appends))
                appends.append(i)
                continue
            j = int(draw * count)
            if j < len(slots):
                writes[slots[j]] = i
        self._flush(x, y, fields, appends, writes)

    def _ends_run(self, ys: list[torch.Tensor]) -> list[bool]:
        """A batch with a class not registered before it ends a run: registering may evict
        with a draw from the generator, which must come after that batch's uniforms only."""
        known = set(self._seen)
        ends = []
        for labels in (set(y.tolist()) for y in ys):
            ends.append(not labels <= known)
            known |= labels
        return ends

    def _flush(self, x: Any, y: torch.Tensor, fields: dict[str, torch.Tensor], appends: list[int], writes: dict[int, int]) -> None:
        """Apply the decisions made so far, appends first (a write may target a slot just appended)."""
        if appends:
            first, last = appends[0], appends[-1]
            # the usual case is a run of rows, where a view is enough
            rows: Any = slice(first, last + 1) if last - first + 1 == len(appends) else torch.tensor(appends, device=y.device)
            y_rows, field_rows = index_batch((y, fields), rows)
            self._storage.append(index_batch(x, rows), y_rows, **field_rows)
            appends.clear()
        if writes:
            self._storage.write_rows(x, y, writes, **fields)
            writes.clear()

    def _register(self, label: int) -> None:
        """Give ``label`` a quota: older classes drop uniformly random samples down to theirs."""
        self._classes.append(label)
        self._seen[label] = 0
        self._slots[label] = []
        self._set_quotas()
        dropped: set[int] = set()
        for other in self._classes:
            slots = self._slots[other]
            excess = len(slots) - self._quotas[other]
            if excess > 0:
                victims = set(torch.randperm(len(slots), generator=self._generator)[:excess].tolist())
                dropped.update(slots[position] for position in victims)
                self._slots[other] = [slot for position, slot in enumerate(slots) if position not in victims]
        if dropped:  # one compaction for all classes
            kept = [slot for slot in range(len(self._storage)) if slot not in dropped]
            self._storage.keep(torch.tensor(kept, dtype=torch.long))
            new_slot = {old: new for new, old in enumerate(kept)}
            for other in self._classes:
                self._slots[other] = [new_slot[slot] for slot in self._slots[other]]

    def state_dict(self) -> State:
        return {
            **self._base_state(),
            "classes": list(self._classes),
            "seen": [self._seen[c] for c in self._classes],
            "slots": [torch.tensor(self._slots[c], dtype=torch.long) for c in self._classes],
        }

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        storage, generator = self._parse_base_state(state)
        classes, seen, slots = state.get("classes"), state.get("seen"), state.get("slots")
        if not (isinstance(classes, list) and isinstance(seen, list) and isinstance(slots, list)):
            raise ValueError("class-balanced state must hold lists `classes`, `seen` and `slots`")  # noqa: TRY004
        if not len(classes) == len(seen) == len(slots) or len(set(map(repr, classes))) != len(classes):
            raise ValueError("`classes` must be distinct and as long as `seen` and `slots`")
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in classes):
            raise ValueError("`classes` must be ints")
        slot_lists = [_slot_list(s) for s in slots]
        if sorted(i for lst in slot_lists for i in lst) != list(range(len(storage))):
            raise ValueError(f"`slots` must list each of the {len(storage)} stored slots exactly once")
        if len(storage) and (storage.labels.dtype != torch.long or storage.labels.dim() != 1):
            raise ValueError(f"class-balanced labels must be int64 of shape (n,); got {storage.labels.dtype} {tuple(storage.labels.shape)}")
        labels = storage.labels.tolist()
        staged_classes = [int(c) for c in classes]
        quotas = _quotas(self.capacity, staged_classes)
        for label, count, class_slots in zip(staged_classes, seen, slot_lists):
            held = len(class_slots)
            if isinstance(count, bool) or not isinstance(count, int) or not held <= count <= INT_LIMIT:
                raise ValueError(f"class {label} has seen {count!r} samples, must be an int in [{held}, {INT_LIMIT}] (at least the {held} it holds)")
            if len(class_slots) > quotas[label] or any(labels[i] != label for i in class_slots):
                raise ValueError(f"class {label}'s slots exceed its quota or hold other labels")
        self._storage, self._generator = storage, generator
        self._classes = staged_classes
        self._seen = {c: int(s) for c, s in zip(self._classes, seen)}
        self._slots = dict(zip(self._classes, slot_lists))
        self._set_quotas()


def _quotas(capacity: int, classes: list[int]) -> dict[int, int]:
    """Each class's share of ``capacity`` slots, the first ``capacity % k`` classes one more."""
    k = len(classes)
    return {label: capacity // k + (rank < capacity % k) for rank, label in enumerate(classes)}


def _on(index: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """``index`` on ``store``'s device (without a dispatch when it is there already: the hot path)."""
    return index if index.device == store.device else index.to(store.device)


def _slot_list(slots: Any) -> list[int]:
    """Slots of one class from a checkpoint: a 1-D integer tensor, else none (the count check refuses it)."""
    if isinstance(slots, torch.Tensor) and slots.dim() == 1 and not slots.is_floating_point():
        return [int(i) for i in slots.tolist()]
    return []
