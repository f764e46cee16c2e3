"""Replay buffers: what the learner rehearses so it does not forget.

A strategy decides *which* past samples to keep (``add``) and *which* to rehearse
(``sample``). The built-in ones keep their samples in a
:class:`~taste_cl.replay.storage.BufferStorage` and take every decision from
:mod:`taste_cl.replay.draws`, as the device loop does.

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

import numpy as np
import torch

from taste_cl._batch import cat_batches, index_batch
from taste_cl._checks import INT_LIMIT, check_int
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay.draws import Append, ClassQuotaIndex, Plan, ReservoirIndex, Write, decode_rng, draw_rows, encode_rng, new_rng
from taste_cl.replay.storage import BufferStorage, State, check_capacity, describe_key, is_int, state_int

__all__ = ["ClassBalancedReplay", "ReplayStrategy", "ReservoirReplay", "SeededStrategy"]


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


def _parse_generator(state: Any) -> np.random.Generator:
    """A new generator set to a saved ``state`` (a 1-D uint8 tensor, :func:`~taste_cl.engine.draws.encode_rng`), or ValueError."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise ValueError("generator state must be a 1-D uint8 tensor")
    try:
        return decode_rng(state.cpu().numpy())
    except ValueError as error:
        raise ValueError(f"generator state is invalid: {error}") from error


class SeededStrategy(ReplayStrategy):
    """Shared plumbing of the built-in strategies: storage, seed and uniform sampling.

    Every decision (which rows to keep, which to replay) comes from one numpy generator
    seeded with ``seed`` through :mod:`taste_cl.engine.draws`, the same decisions the device
    loop makes, so an exported learner continues with the same draws."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.capacity = check_capacity(capacity)
        self.seed = seed
        self._storage = BufferStorage(capacity)
        self._rng = new_rng(seed)

    def __len__(self) -> int:
        return len(self._storage)

    @property
    def storage(self) -> BufferStorage:
        """Where the samples and their extra fields are kept (read what it holds with ``contents``)."""
        return self._storage

    @property
    def rng(self) -> np.random.Generator:
        """The generator every draw comes from (its state is what a checkpoint or an export carries)."""
        return self._rng

    def add(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        """Offer a batch; ``fields`` are extra per-sample tensors stored with it (the same
        names on every call), returned by ``sample(n, with_fields=True)``."""
        self._storage.check_batch(x, y, **fields)
        self.add_validated(x, y, **fields)

    @abstractmethod
    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None: ...

    def add_batches(self, batches: list[tuple[Any, torch.Tensor, dict[str, torch.Tensor]]]) -> None:
        """``add_validated(x, y, **fields)`` of each batch in order, with runs of batches joined
        into one call where that leaves the same buffer: each row costs one uniform draw, so
        the draws for n rows are the draws for their parts in turn, and only a draw made
        between two batches' uniforms (see :meth:`_ends_run`) cuts a run."""
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

    def _carry_out(self, plan: Plan, x: Any, y: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        """Apply the index's decisions for batch ``(x, y, fields)`` to the storage."""
        for step in plan:
            if isinstance(step, Append):
                first, last = step.rows[0], step.rows[-1]
                # the usual case is a run of rows, where a view is enough
                rows: Any = slice(first, last + 1) if last - first + 1 == len(step.rows) else torch.tensor(step.rows, device=y.device)
                y_rows, field_rows = index_batch((y, fields), rows)
                self._storage.append(index_batch(x, rows), y_rows, **field_rows)
            elif isinstance(step, Write):
                self._storage.write_rows(x, y, step.rows_by_slot, **fields)
            else:
                self._storage.keep(torch.tensor(step.slots, dtype=torch.long))

    @property
    def labels(self) -> torch.Tensor:
        """Targets of the stored samples."""
        return self._storage.labels.clone()

    def sample(self, n: int, *, with_fields: bool = False) -> Any:
        """Up to ``n`` distinct stored samples, uniformly, in storage order: ``(x, y)``, or
        ``(x, y, fields)`` with ``with_fields=True`` (``fields`` maps each extra field name to its tensor)."""
        check_int("n", n, 0)
        size = len(self._storage)
        if size == 0:
            raise ValueError(f"cannot sample from an empty {type(self).__name__}; check len() first")
        picks = torch.from_numpy(draw_rows(self._rng, size, n))
        x, y = self._storage.gather(picks)
        return (x, y, self._storage.gather_fields(picks)) if with_fields else (x, y)

    def contents(self) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
        """Every stored ``(x, y, fields)`` in storage order, as read-only views (no copy and no
        random draw: for evaluating the whole buffer)."""
        if len(self._storage) == 0:
            raise ValueError(f"{type(self).__name__} is empty; check len() first")
        return self._storage.contents()

    def _base_state(self) -> State:
        return {
            "capacity": self.capacity,
            "seed": self.seed,
            "storage": self._storage.state_dict(),
            "generator": torch.from_numpy(encode_rng(self._rng)),
        }

    def _parse_base_state(self, state: State) -> tuple[BufferStorage, np.random.Generator]:
        """New storage and generator from ``state`` (ValueError if anything is off); ``self`` is untouched."""
        if not isinstance(state, dict) or not is_int(state.get("capacity"), self.capacity):
            raise ValueError(f"checkpointed {type(self).__name__} has capacity {describe_key(state, 'capacity')}, this one has {self.capacity}")
        storage = BufferStorage(self.capacity)
        storage.load_state_dict(state.get("storage", {}))
        return storage, _parse_generator(state.get("generator"))

    def _load_base_state(self, state: State) -> None:
        """Parse and assign the shared part; for subclasses that validate their own fields first."""
        self._storage, generator = self._parse_base_state(state)
        self._set_rng(generator)

    def _set_rng(self, rng: np.random.Generator) -> None:
        """Continue from ``rng``'s state, keeping the generator object the index shares."""
        self._rng.bit_generator.state = rng.bit_generator.state


class ReservoirReplay(SeededStrategy):
    """Reservoir sampling (Vitter's algorithm R): every sample seen so far is retained
    with the same probability ``capacity / seen``, whatever its position in the stream.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self._index = ReservoirIndex(self.capacity, self._rng)

    @property
    def seen(self) -> int:
        """Samples offered so far."""
        return self._index.seen

    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        self._carry_out(self._index.offer(y.shape[0]), x, y, fields)

    def state_dict(self) -> State:
        return {**self._base_state(), "seen": self.seen}

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        storage, generator = self._parse_base_state(state)
        seen = state_int(state, "seen", len(storage), INT_LIMIT)  # at least what it holds; a corrupt huge count freezes the reservoir
        if len(storage) != min(seen, self.capacity):
            raise ValueError(f"a reservoir that has seen {seen} samples holds {min(seen, self.capacity)}; state holds {len(storage)}")
        self._storage, self._index.seen = storage, seen
        self._set_rng(generator)


class ClassBalancedReplay(SeededStrategy):
    """Capacity split evenly across the classes seen so far (quotas differ by at most one).

    Within a class, samples are kept by reservoir sampling, so every seen sample of a
    class is equally likely to be retained. When a new class arrives, the older classes
    give up uniformly random samples until they fit their new quota
    (:class:`~taste_cl.engine.draws.ClassQuotaIndex`, the device loop's policy too).

    Targets must be integer class labels ``(n,)``: it balances on them, so tasks without
    one class per sample (regression, multi-label, token tagging) cannot use it.
    """

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self._index = ClassQuotaIndex(self.capacity, self._rng)

    @property
    def classes(self) -> list[int]:
        """Classes seen so far, in order of arrival."""
        return list(self._index.classes)

    def quota(self, label: int) -> int:
        """Number of slots class ``label`` may hold now (KeyError for a class not seen yet)."""
        if label not in self._index.quotas:
            raise KeyError(f"class {label!r} has not been seen; seen classes: {self._index.classes}")
        return self._index.quotas[label]

    def class_counts(self) -> dict[int, int]:
        """Stored samples per class."""
        return {label: len(self._index.slots[label]) for label in self._index.classes}

    def add(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        if isinstance(y, torch.Tensor) and (y.dim() != 1 or y.is_floating_point() or y.dtype == torch.bool):
            raise InvalidBatchError(
                f"ClassBalancedReplay balances on integer class labels y of shape (n,); got dtype {y.dtype}, "
                f"shape {tuple(y.shape)} (use ReservoirReplay for other targets)"
            )
        super().add(x, y, **fields)

    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        self._carry_out(self._index.offer(y.tolist()), x, y, fields)

    def _ends_run(self, ys: list[torch.Tensor]) -> list[bool]:
        """A batch with a class not registered before it ends a run: registering may evict
        with a draw from the generator, which must come after that batch's uniforms only."""
        known = set(self._index.seen)
        ends = []
        for labels in (set(y.tolist()) for y in ys):
            ends.append(not labels <= known)
            known |= labels
        return ends

    def state_dict(self) -> State:
        index = self._index
        return {
            **self._base_state(),
            "classes": list(index.classes),
            "seen": [index.seen[c] for c in index.classes],
            "slots": [torch.tensor(index.slots[c], dtype=torch.long) for c in index.classes],
        }

    def load_state_dict(self, state: State) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        storage, generator = self._parse_base_state(state)
        if len(storage) and (storage.labels.dtype != torch.long or storage.labels.dim() != 1):
            raise ValueError(f"class-balanced labels must be int64 of shape (n,); got {storage.labels.dtype} {tuple(storage.labels.shape)}")
        slots = state.get("slots")
        slot_lists = [_slot_list(s) for s in slots] if isinstance(slots, list) else slots
        classes, seen = state.get("classes"), state.get("seen")
        self._index.check_state(classes, seen, slot_lists, storage.labels.tolist() if len(storage) else [])
        self._storage = storage
        self._index.load_state(classes, seen, slot_lists)  # type: ignore[arg-type]  # check_state accepted them
        self._set_rng(generator)


def _slot_list(slots: Any) -> Any:
    """Slots of one class from a checkpoint as a list of ints: a 1-D integer tensor, else as it was (the check refuses it)."""
    if isinstance(slots, torch.Tensor) and slots.dim() == 1 and not slots.is_floating_point():
        return [int(i) for i in slots.tolist()]
    return slots
