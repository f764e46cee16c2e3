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

    Memory is allocated once, on the first append, from the first sample's shape and
    dtype; every later write must match it.
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
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise InvalidBatchError("x contains non-finite values (NaN or inf)")
        if self._x is not None and (tuple(x.shape[1:]) != self.feature_shape or x.dtype != self._x.dtype):
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
        self._x[slots] = x
        self._y[slots] = y

    def remove(self, slot: int) -> int | None:
        """Free ``slot`` by moving the last sample into it; return the moved sample's old slot."""
        assert self._x is not None and self._y is not None
        last = self._size - 1
        self._size = last
        if slot == last:
            return None
        self._x[slot] = self._x[last]
        self._y[slot] = self._y[last]
        return last

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies of the samples at ``slots``."""
        assert self._x is not None and self._y is not None
        return self._x[slots].clone(), self._y[slots].clone()

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
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"state has capacity {state['capacity']}, this storage has {self.capacity}")
        size = int(state["size"])
        self._x = self._y = None
        self._size = 0
        if size:
            x, y = state["x"], state["y"]
            if x.shape[0] != size or y.shape[0] != size:
                raise ValueError(f"state claims {size} samples but holds {x.shape[0]} features, {y.shape[0]} labels")
            self._allocate(x)
            self.append(x, y)


class _SeededStrategy(ReplayStrategy):
    """Shared plumbing of the built-in strategies: storage, seed and uniform sampling."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = _check_capacity(capacity)
        self.seed = seed
        self._storage = BufferStorage(capacity)
        self._generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self._storage)

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

    def _load_base_state(self, state: State) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"checkpointed {type(self).__name__} has capacity {state['capacity']}, this one has {self.capacity}"
            )
        self._storage.load_state_dict(state["storage"])
        self._generator.set_state(state["generator"])


class ReservoirReplay(_SeededStrategy):
    """Reservoir sampling (Vitter's algorithm R): every sample seen so far is retained
    with the same probability ``capacity / seen``, whatever its position in the stream.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self.seen = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._storage.check_batch(x, y)
        n = x.shape[0]
        free = min(n, self.capacity - len(self._storage))
        if free:
            self._storage.append(x[:free], y[:free])
        rest = n - free
        if rest:
            # Sample i of the rest is the (seen + free + i + 1)-th of the stream: keep it
            # iff a uniform draw over that many positions lands inside the reservoir.
            positions = torch.arange(self.seen + free + 1, self.seen + n + 1, dtype=torch.float64)
            slots = (self._uniform(rest) * positions).floor().long()
            winner: dict[int, int] = {}
            for i, slot in enumerate(slots.tolist()):
                if slot < self.capacity:
                    winner[slot] = free + i  # a later sample overwrites an earlier one
            if winner:
                targets = torch.tensor(list(winner), dtype=torch.long)
                sources = torch.tensor(list(winner.values()), dtype=torch.long)
                self._storage.write(targets, x[sources], y[sources])
        self.seen += n

    def state_dict(self) -> State:
        return {**self._base_state(), "seen": self.seen}

    def load_state_dict(self, state: State) -> None:
        self._load_base_state(state)
        self.seen = int(state["seen"])


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

    @property
    def classes(self) -> list[int]:
        """Classes seen so far, in order of arrival."""
        return list(self._classes)

    def quota(self, label: int) -> int:
        """Number of slots class ``label`` may hold now."""
        k = len(self._classes)
        rank = self._classes.index(label)
        return self.capacity // k + (1 if rank < self.capacity % k else 0)

    def class_counts(self) -> dict[int, int]:
        """Stored samples per class."""
        return {label: len(self._slots[label]) for label in self._classes}

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._storage.check_batch(x, y)
        draws = self._uniform(x.shape[0]).tolist()
        for i, label in enumerate(y.tolist()):
            if label not in self._seen:
                self._register(label)
            self._seen[label] += 1
            slots = self._slots[label]
            if len(slots) < self.quota(label):
                slots.append(len(self._storage))
                self._storage.append(x[i : i + 1], y[i : i + 1])
                continue
            j = int(draws[i] * self._seen[label])
            if j < len(slots):
                self._storage.write(torch.tensor([slots[j]]), x[i : i + 1], y[i : i + 1])

    def _register(self, label: int) -> None:
        self._classes.append(label)
        self._seen[label] = 0
        self._slots[label] = []
        for other in self._classes:
            while len(self._slots[other]) > self.quota(other):
                victim = int(torch.randint(len(self._slots[other]), (1,), generator=self._generator))
                self._evict(other, victim)

    def _evict(self, label: int, position: int) -> None:
        slots = self._slots[label]
        slot = slots[position]
        slots[position] = slots[-1]
        slots.pop()
        moved_from = self._storage.remove(slot)
        if moved_from is not None:
            owner = self._slots[int(self._storage.labels[slot])]
            owner[owner.index(moved_from)] = slot

    def state_dict(self) -> State:
        return {
            **self._base_state(),
            "classes": list(self._classes),
            "seen": [self._seen[c] for c in self._classes],
            "slots": [torch.tensor(self._slots[c], dtype=torch.long) for c in self._classes],
        }

    def load_state_dict(self, state: State) -> None:
        self._load_base_state(state)
        self._classes = [int(c) for c in state["classes"]]
        self._seen = {c: int(s) for c, s in zip(self._classes, state["seen"])}
        self._slots = {c: [int(s) for s in slots] for c, slots in zip(self._classes, state["slots"])}
