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

from taste_cl._batch import count_nonfinite
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
    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Offer a batch ``x`` of shape ``(n, *features)`` with labels ``y`` of shape ``(n,)``."""

    def add_validated(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Offer a batch the learner has already validated (finite ``x`` of the learner's
        feature shape and dtype, int64 ``y`` in range). The learner calls this instead of
        :meth:`add`; override it to skip checks ``add`` makes. Default: ``add``."""
        self.add(x, y)

    @abstractmethod
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return up to ``n`` stored samples as fresh tensors (never views of the store)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples stored now."""

    def state_dict(self) -> State:
        """Everything needed to resume: tensors, ints, floats, strings, lists and dicts only."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement state_dict(); learner checkpoints need it"
        )

    def load_state_dict(self, state: State) -> None:
        """Restore what :meth:`state_dict` returned."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement load_state_dict(); learner checkpoints need it"
        )


class BufferStorage:
    """Fixed-capacity tensor store with contiguous slots ``0 .. len-1``.

    Memory is allocated once, on the first append, from the first sample's shape, dtype
    and device. Later batches must have the same feature shape (and be floating point
    if the first was); they are converted to the stored dtype and device, so a model
    moved to another dtype or device mid-stream keeps its buffer.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_capacity(capacity)
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def feature_shape(self) -> tuple[int, ...] | None:
        return None if self._x is None else tuple(self._x.shape[1:])

    @property
    def labels(self) -> torch.Tensor:
        """Labels of the stored samples (a read-only view; do not modify)."""
        if self._y is None:
            return torch.empty(0, dtype=torch.long)
        return self._y[: self._size]

    def check_batch(self, x: Any, y: Any) -> None:
        """Raise :class:`InvalidBatchError` unless ``(x, y)`` fits this store."""
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise InvalidBatchError(
                f"x and y must be torch tensors; got {type(x).__name__} and {type(y).__name__}"
            )
        if x.dim() < 1 or y.dim() != 1 or x.shape[0] != y.shape[0]:
            raise InvalidBatchError(
                f"x must be (n, *features) and y (n,) with the same n; got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if y.dtype != torch.long:
            raise InvalidBatchError(f"y must have dtype torch.int64; got {y.dtype}")
        if count_nonfinite(x):
            raise InvalidBatchError("x contains non-finite values (NaN or inf)")
        if self._x is not None and (
            tuple(x.shape[1:]) != self.feature_shape or x.is_floating_point() != self._x.is_floating_point()
        ):
            raise InvalidBatchError(
                f"x has feature shape {tuple(x.shape[1:])} and dtype {x.dtype}; "
                f"this buffer stores {self.feature_shape} and {self._x.dtype}"
            )

    def _allocate(self, x: torch.Tensor) -> None:
        self._x = torch.empty((self.capacity, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self._y = torch.empty(self.capacity, dtype=torch.long, device=x.device)

    def append(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Store ``x``/``y`` (a batch) in the next free slots."""
        n = x.shape[0]
        if self._size + n > self.capacity:
            raise RuntimeError(f"append of {n} samples overflows capacity {self.capacity} (size {self._size})")
        if self._x is None:
            self._allocate(x)
        assert self._x is not None and self._y is not None
        self._x[self._size : self._size + n] = x
        self._y[self._size : self._size + n] = y
        self._size += n

    def write(self, slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """Overwrite the given (distinct, filled) slots."""
        assert self._x is not None and self._y is not None
        slots = slots.to(self._x.device)
        self._x.index_copy_(0, slots, x.to(self._x))
        self._y.index_copy_(0, slots, y.to(self._y.device))

    def write_rows(self, x: torch.Tensor, y: torch.Tensor, rows_by_slot: dict[int, int]) -> None:
        """Overwrite each (filled) slot with row ``rows_by_slot[slot]`` of the batch ``x``/``y``."""
        slots, rows = torch.tensor([list(rows_by_slot), list(rows_by_slot.values())], device=x.device)
        self.write(slots, x.index_select(0, rows), y.index_select(0, rows))

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only the samples at ``slots`` (distinct, filled), packed into slots
        ``0 .. len(slots) - 1`` in that order; the rest are dropped."""
        assert self._x is not None and self._y is not None
        n = slots.shape[0]
        slots = slots.to(self._x.device)
        self._x[:n] = self._x.index_select(0, slots)  # a copy first, so overlapping slots are safe
        self._y[:n] = self._y.index_select(0, slots)
        self._size = n

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies of the samples at ``slots``."""
        assert self._x is not None and self._y is not None
        slots = slots.to(self._x.device)
        return self._x.index_select(0, slots), self._y.index_select(0, slots)

    def state_dict(self) -> State:
        if self._x is None or self._y is None:
            return {"capacity": self.capacity, "size": 0}
        return {
            "capacity": self.capacity,
            "size": self._size,
            "x": self._x[: self._size].clone(),
            "y": self._y[: self._size].clone(),
        }

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        if not isinstance(state, dict) or not _is_int(state.get("capacity"), self.capacity):
            raise ValueError(f"storage state must be a dict with capacity {self.capacity}; got {_describe(state, 'capacity')}")
        size = _state_int(state, "size", 0, self.capacity)
        if not size:
            self._x = self._y = None
            self._size = 0
            return
        x, y = state.get("x"), state.get("y")
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise ValueError("storage state must hold tensors `x` and `y`")  # noqa: TRY004 (a bad state is a ValueError)
        if x.dim() < 1 or x.shape[0] != size or y.shape != (size,) or y.dtype != torch.long:
            raise ValueError(
                f"storage state claims {size} samples; needs x of shape ({size}, ...) and int64 y of shape ({size},), "
                f"got {tuple(x.shape)} and {y.dtype} {tuple(y.shape)}"
            )
        if x.is_complex() or count_nonfinite(x):
            raise ValueError("storage state holds complex or non-finite features")
        new_x = torch.empty((self.capacity, *x.shape[1:]), dtype=x.dtype, device=x.device)
        new_y = torch.empty(self.capacity, dtype=torch.long, device=x.device)
        new_x[:size], new_y[:size] = x, y
        self._x, self._y, self._size = new_x, new_y, size


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


class _SeededStrategy(ReplayStrategy):
    """Shared plumbing of the built-in strategies: storage, seed and uniform sampling."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = _check_capacity(capacity)
        self.seed = seed
        self._storage = BufferStorage(capacity)
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self._storage)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._storage.check_batch(x, y)
        self.add_validated(x, y)

    @abstractmethod
    def add_validated(self, x: torch.Tensor, y: torch.Tensor) -> None: ...

    @property
    def labels(self) -> torch.Tensor:
        """Labels of the stored samples."""
        return self._storage.labels.clone()

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"`n == {n!r}`, must be an int >= 0")
        size = len(self._storage)
        if size == 0:
            raise ValueError(f"cannot sample from an empty {type(self).__name__}; check len() first")
        picks = torch.randperm(size, generator=self._generator)[: min(n, size)]
        return self._storage.gather(picks)

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
            raise ValueError(
                f"checkpointed {type(self).__name__} has capacity {_describe(state, 'capacity')}, this one has {self.capacity}"
            )
        storage = BufferStorage(self.capacity)
        storage.load_state_dict(state.get("storage", {}))
        return storage, _parse_generator(state.get("generator"))

    def _load_base_state(self, state: State) -> None:
        """Parse and assign the shared part; for subclasses that validate their own fields first."""
        self._storage, self._generator = self._parse_base_state(state)


class ReservoirReplay(_SeededStrategy):
    """Reservoir sampling (Vitter's algorithm R): every sample seen so far is retained
    with the same probability ``capacity / seen``, whatever its position in the stream.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self.seen = 0

    def add_validated(self, x: torch.Tensor, y: torch.Tensor) -> None:
        n = x.shape[0]
        free = min(n, self.capacity - len(self._storage))
        if free:
            self._storage.append(x[:free], y[:free])
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
                self._storage.write_rows(x, y, winner)
        self.seen += n

    def state_dict(self) -> State:
        return {**self._base_state(), "seen": self.seen}

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        storage, generator = self._parse_base_state(state)
        seen = _state_int(state, "seen", len(storage))
        if len(storage) != min(seen, self.capacity):
            raise ValueError(f"a reservoir that has seen {seen} samples holds {min(seen, self.capacity)}; state holds {len(storage)}")
        self._storage, self._generator, self.seen = storage, generator, seen


class ClassBalancedReplay(_SeededStrategy):
    """Capacity split evenly across the classes seen so far (quotas differ by at most one).

    Within a class, samples are kept by reservoir sampling, so every seen sample of a
    class is equally likely to be retained. When a new class arrives, the older classes
    give up uniformly random samples until they fit their new quota.
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
        k = len(self._classes)
        self._quotas = {label: self.capacity // k + (rank < self.capacity % k) for rank, label in enumerate(self._classes)}

    def class_counts(self) -> dict[int, int]:
        """Stored samples per class."""
        return {label: len(self._slots[label]) for label in self._classes}

    def add_validated(self, x: torch.Tensor, y: torch.Tensor) -> None:
        draws = self._uniform(x.shape[0]).tolist()
        appends: list[int] = []  # batch rows going to the next free slots, in order
        writes: dict[int, int] = {}  # slot -> batch row replacing it (the last one wins)
        for i, label in enumerate(y.tolist()):
            if label not in self._seen:
                self._flush(x, y, appends, writes)  # registering may evict and move slots
                self._register(label)
            self._seen[label] += 1
            slots = self._slots[label]
            if len(slots) < self._quotas[label]:
                slots.append(len(self._storage) + len(appends))
                appends.append(i)
                continue
            j = int(draws[i] * self._seen[label])
            if j < len(slots):
                writes[slots[j]] = i
        self._flush(x, y, appends, writes)

    def _flush(self, x: torch.Tensor, y: torch.Tensor, appends: list[int], writes: dict[int, int]) -> None:
        """Apply the decisions made so far, appends first (a write may target a slot just appended)."""
        if appends:
            first, last = appends[0], appends[-1]
            if last - first + 1 == len(appends):  # the usual case: a run of rows, a view is enough
                self._storage.append(x[first : last + 1], y[first : last + 1])
            else:
                rows = torch.tensor(appends, device=x.device)
                self._storage.append(x.index_select(0, rows), y.index_select(0, rows))
            appends.clear()
        if writes:
            self._storage.write_rows(x, y, writes)
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
        slot_lists = [[int(i) for i in (s.tolist() if isinstance(s, torch.Tensor) and s.dim() == 1 and not s.is_floating_point() else [])] for s in slots]
        if sorted(i for lst in slot_lists for i in lst) != list(range(len(storage))):
            raise ValueError(f"`slots` must list each of the {len(storage)} stored slots exactly once")
        labels = storage.labels.tolist()
        staged = ClassBalancedReplay(self.capacity, seed=self.seed)
        staged._classes = [int(c) for c in classes]
        staged._set_quotas()
        for label, count, class_slots in zip(staged._classes, seen, slot_lists):
            if isinstance(count, bool) or not isinstance(count, int) or count < len(class_slots):
                raise ValueError(f"class {label} has seen {count!r} samples but holds {len(class_slots)}")
            if len(class_slots) > staged._quotas[label] or any(labels[i] != label for i in class_slots):
                raise ValueError(f"class {label}'s slots exceed its quota or hold other labels")
        self._storage, self._generator = storage, generator
        self._classes = staged._classes
        self._seen = {c: int(s) for c, s in zip(self._classes, seen)}
        self._slots = dict(zip(self._classes, slot_lists))
        self._set_quotas()
