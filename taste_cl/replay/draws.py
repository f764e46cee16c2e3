"""Replay decisions from one seeded numpy generator: the same on every engine.

Which stored rows a step replays, which arriving rows a buffer keeps and which it gives up,
are decided here by index only, torch-free. The torch buffers
(:class:`~taste_cl.replay.ReservoirReplay`, :class:`~taste_cl.replay.ClassBalancedReplay`)
and the device loop's :class:`~taste_cl.engine.loop.LoopReplay` store rows their own way and
carry out the same :data:`Plan`, so the same seed gives the same buffer and the same replayed
rows on every engine, and a learner exported to a device continues with exactly the draws the
torch learner would have made: the generator's state travels in the export
(:func:`encode_rng` / :func:`decode_rng`).

The generator is numpy's PCG64 (``numpy.random.default_rng(seed)``). Each arriving row
costs one double (``Generator.random``), so adding rows one batch at a time or all at once
draws the same numbers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from taste_cl._checks import INT_LIMIT

__all__ = [
    "RNG_STATE_BYTES",
    "Append",
    "ClassQuotaIndex",
    "Keep",
    "Plan",
    "ReservoirIndex",
    "Write",
    "apply_plan",
    "decode_rng",
    "draw_rows",
    "encode_rng",
    "new_rng",
    "quotas",
]

RNG_STATE_BYTES = 37  # PCG64: state (16 bytes), increment (16), has_uint32 (1), uinteger (4)
_TORCH_STATE_BYTES = 5056  # a torch CPU generator's state, what buffers saved before they drew from numpy


@dataclass(frozen=True)
class Append:
    """Append these rows of the offered batch to the buffer's next free slots, in order."""

    rows: list[int]


@dataclass(frozen=True)
class Write:
    """Overwrite each slot with the batch row it maps to."""

    rows_by_slot: dict[int, int]


@dataclass(frozen=True)
class Keep:
    """Keep only these slots, in this order (the others are given up); slots renumber from 0."""

    slots: list[int]


Plan = list[Append | Write | Keep]


def new_rng(seed: int) -> np.random.Generator:
    """The generator every buffer draws from: PCG64 seeded with ``seed``."""
    return np.random.default_rng(seed)


def draw_rows(rng: np.random.Generator, size: int, n: int) -> np.ndarray:
    """``min(n, size)`` distinct indices of ``range(size)``, uniformly, sorted (int64)."""
    return np.sort(rng.choice(size, size=min(n, size), replace=False)).astype(np.int64)


def encode_rng(rng: np.random.Generator) -> np.ndarray:
    """The generator's state as :data:`RNG_STATE_BYTES` bytes (uint8), for a checkpoint."""
    state = rng.bit_generator.state
    if state.get("bit_generator") != "PCG64":
        raise ValueError(f"buffers draw from PCG64; got {state.get('bit_generator')!r}")
    inner = state["state"]
    data = (
        int(inner["state"]).to_bytes(16, "little")
        + int(inner["inc"]).to_bytes(16, "little")
        + bytes([int(state["has_uint32"])])
        + int(state["uinteger"]).to_bytes(4, "little")
    )
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode_rng(data: np.ndarray) -> np.random.Generator:
    """A new generator in the state :func:`encode_rng` wrote (``ValueError`` if it cannot be one).

    A torch generator state, which buffers saved before they drew from numpy, seeds a new
    generator from its bytes: the buffer resumes with the rows it held and fresh draws."""
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError("a generator state must be a 1-D uint8 array")
    if data.shape[0] == _TORCH_STATE_BYTES:
        return np.random.default_rng(np.frombuffer(hashlib.sha256(data.tobytes()).digest(), dtype=np.uint32))
    if data.shape[0] != RNG_STATE_BYTES:
        raise ValueError(f"a generator state holds {RNG_STATE_BYTES} bytes (PCG64); got {data.shape[0]}")
    raw = data.tobytes()
    inc, has_uint32 = int.from_bytes(raw[16:32], "little"), raw[32]
    if inc % 2 == 0 or has_uint32 > 1:
        raise ValueError("the generator state is not one PCG64 writes (an even increment or a bad flag)")
    rng = np.random.default_rng()
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": int.from_bytes(raw[:16], "little"), "inc": inc},
        "has_uint32": has_uint32,
        "uinteger": int.from_bytes(raw[33:], "little"),
    }
    return rng


class ReservoirIndex:
    """Reservoir sampling (Vitter's algorithm R): every row seen so far is kept with the same
    probability ``capacity / seen``, whatever its position in the stream."""

    def __init__(self, capacity: int, rng: np.random.Generator, *, seen: int = 0) -> None:
        self.capacity = capacity
        self.rng = rng
        self.seen = seen

    def offer(self, n: int) -> Plan:
        """Where ``n`` arriving rows go; counts them as seen."""
        stored = min(self.seen, self.capacity)
        free = min(n, self.capacity - stored)
        plan: Plan = [Append(list(range(free)))] if free else []
        rest = n - free
        if rest:
            # row free + i is the (seen + free + i + 1)-th of the stream: kept iff a uniform
            # position among that many lands inside the reservoir; a later row overwrites an earlier one
            positions = np.arange(self.seen + free + 1, self.seen + n + 1, dtype=np.float64)
            slots = (self.rng.random(rest) * positions).astype(np.int64)
            winners = {int(slot): free + i for i, slot in enumerate(slots) if slot < self.capacity}
            if winners:
                plan.append(Write(winners))
        self.seen += n
        return plan


def quotas(capacity: int, classes: Sequence[int]) -> dict[int, int]:
    """Each class's share of ``capacity`` slots, the first ``capacity % k`` classes one more."""
    k = len(classes)
    return {label: capacity // k + (rank < capacity % k) for rank, label in enumerate(classes)}


class ClassQuotaIndex:
    """Capacity split evenly across the classes seen so far (quotas differ by at most one).

    Within a class rows are kept by reservoir sampling. When a new class arrives, the older
    classes give up uniformly random rows until they fit their new quota.
    """

    def __init__(self, capacity: int, rng: np.random.Generator) -> None:
        self.capacity = capacity
        self.rng = rng
        self.classes: list[int] = []  # arrival order decides who gets the remainder
        self.seen: dict[int, int] = {}
        self.slots: dict[int, list[int]] = {}
        self.quotas: dict[int, int] = {}

    @property
    def size(self) -> int:
        return sum(len(s) for s in self.slots.values())

    def offer(self, labels: Sequence[int]) -> Plan:
        """Where arriving rows with these labels go; counts them as seen."""
        draws = self.rng.random(len(labels))
        plan: Plan = []
        appends: list[int] = []
        writes: dict[int, int] = {}
        stored = self.size
        for i, label in enumerate(labels):
            if label not in self.seen:
                plan += _flush(appends, writes)  # registering may evict and renumber slots
                plan += self._register(label)
                stored = self.size
            count = self.seen[label] = self.seen[label] + 1
            slots = self.slots[label]
            if len(slots) < self.quotas[label]:
                slots.append(stored + len(appends))
                appends.append(i)
                continue
            j = int(draws[i] * count)
            if j < len(slots):
                writes[slots[j]] = i
        return plan + _flush(appends, writes)

    def _register(self, label: int) -> Plan:
        """Give ``label`` a quota: older classes drop uniformly random rows down to theirs."""
        self.classes.append(label)
        self.seen[label], self.slots[label] = 0, []
        self.quotas = quotas(self.capacity, self.classes)
        dropped: set[int] = set()
        for other in self.classes:
            slots = self.slots[other]
            excess = len(slots) - self.quotas[other]
            if excess > 0:
                victims = set(draw_rows(self.rng, len(slots), excess).tolist())
                dropped.update(slots[position] for position in victims)
                self.slots[other] = [slot for position, slot in enumerate(slots) if position not in victims]
        if not dropped:
            return []
        kept = [slot for slot in range(self.size + len(dropped)) if slot not in dropped]
        renumber = {old: new for new, old in enumerate(kept)}
        for other in self.classes:
            self.slots[other] = [renumber[slot] for slot in self.slots[other]]
        return [Keep(kept)]

    def check_state(self, classes: object, seen: object, slots: object, labels: Sequence[int]) -> None:
        """``ValueError`` naming what in a saved ``classes``/``seen``/``slots`` cannot describe a buffer
        holding rows with ``labels`` (in slot order); nothing changes."""
        if not (isinstance(classes, list) and isinstance(seen, list) and isinstance(slots, list)):
            raise ValueError("class-balanced state must hold lists `classes`, `seen` and `slots`")  # noqa: TRY004
        if not len(classes) == len(seen) == len(slots) or len(set(map(repr, classes))) != len(classes):
            raise ValueError("`classes` must be distinct and as long as `seen` and `slots`")
        if not all(type(c) is int for c in classes):
            raise ValueError("`classes` must be ints")
        if not all(isinstance(s, list) and all(type(i) is int for i in s) for s in slots):
            raise ValueError("`slots` must be lists of ints")
        if sorted(i for lst in slots for i in lst) != list(range(len(labels))):
            raise ValueError(f"`slots` must list each of the {len(labels)} stored slots exactly once")
        shares = quotas(self.capacity, classes)
        for label, count, class_slots in zip(classes, seen, slots):
            held = len(class_slots)
            if type(count) is not int or not held <= count <= INT_LIMIT:
                raise ValueError(f"class {label} has seen {count!r} samples, must be an int in [{held}, {INT_LIMIT}] (at least the {held} it holds)")
            if held > shares[label] or any(labels[i] != label for i in class_slots):
                raise ValueError(f"class {label}'s slots exceed its quota or hold other labels")

    def load_state(self, classes: list[int], seen: list[int], slots: list[list[int]]) -> None:
        """Apply what :meth:`check_state` accepted."""
        self.classes = list(classes)
        self.seen = dict(zip(classes, seen))
        self.slots = {label: list(s) for label, s in zip(classes, slots)}
        self.quotas = quotas(self.capacity, self.classes)


def apply_plan(plan: Plan, stores: Sequence[np.ndarray], batch: Sequence[np.ndarray], size: int) -> int:
    """Carry out a plan on numpy stores (one per batch array, rows in slots
    ``0 .. size-1``) and return the new size: what the device loop's replay buffer and its monitor's probe both do."""
    for step in plan:
        if isinstance(step, Append):
            rows = np.asarray(step.rows)
            for store, values in zip(stores, batch):
                store[size : size + rows.size] = values[rows]
            size += rows.size
        elif isinstance(step, Write):
            slots, rows = np.asarray(list(step.rows_by_slot)), np.asarray(list(step.rows_by_slot.values()))
            for store, values in zip(stores, batch):
                store[slots] = values[rows]
        else:
            kept = np.asarray(step.slots, dtype=np.int64)
            for store in stores:
                store[: kept.size] = store[kept]
            size = kept.size
    return size


def _flush(appends: list[int], writes: dict[int, int]) -> Plan:
    """The decisions made so far as plan steps (appends first: a write may target a slot just appended); clears them."""
    plan: Plan = []
    if appends:
        plan.append(Append(list(appends)))
        appends.clear()
    if writes:
        plan.append(Write(dict(writes)))
        writes.clear()
    return plan
