"""A device's data in the digits fleet, as numpy arrays (no torch): its stream by round and held-out sets.

The PyTorch fleet (:class:`taste_cl.benchmarks.federated.Fleet`) and the device-runtime
ClientApp (:mod:`.device_client`) cut the stream into rounds and batches with the same
functions, so both modes observe the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DATA_FOLDER", "FINETUNE_FOLDER", "NEW_CLASS_SHOTS", "TRAIN_FOLDER", "DeviceData", "new_class_sets", "round_batches", "round_bounds"]

# the folder the server exports for a fleet of device runtimes (see .device_server)
TRAIN_FOLDER, FINETUNE_FOLDER, DATA_FOLDER = "train", "finetune", "data"
NEW_CLASS_SHOTS = 5
"""How many examples of a class new to it a device gets before it is scored on that class (``accuracy-new``)."""


def round_bounds(n: int, num_rounds: int, server_round: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an ``n``-row stream that a device observes in ``server_round`` (1-based)."""
    bounds = np.linspace(0, n, num_rounds + 1).astype(int)
    return int(bounds[server_round - 1]), int(bounds[server_round])


def round_batches(x: Any, y: Any, num_rounds: int, batch_size: int, server_round: int) -> list[tuple[Any, Any]]:
    """The stream slice of ``server_round`` cut into batches (numpy arrays or tensors, in stream order)."""
    lo, hi = round_bounds(int(y.shape[0]), num_rounds, server_round)
    return [(x[s : min(s + batch_size, hi)], y[s : min(s + batch_size, hi)]) for s in range(lo, hi, batch_size)]


def new_class_sets(
    seen: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    classes: Any,
    new_class: int,
    *,
    seed: int,
    partition: int,
    shots: int = NEW_CLASS_SHOTS,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``(refit set, evaluation set)`` for a device that meets ``new_class`` after the rounds, a class it never saw.

    The class comes with ``shots`` held-out examples (drawn from ``seed`` and ``partition``).
    The refit set is everything the device has ``seen`` plus those examples, repeated until
    the new class has about as many rows as one of its own; the evaluation set is the rest of
    the held-out digits of its own ``classes`` and of the new one.
    """
    x_seen, y_seen = seen
    x_test, y_test = test
    own = [int(c) for c in np.asarray(classes).ravel()]
    rows = np.random.default_rng([seed, partition, 1]).permutation(np.flatnonzero(y_test == new_class))
    shots_x, shots_y = x_test[rows[:shots]], y_test[rows[:shots]]
    repeat = max(1, y_seen.shape[0] // (len(own) * max(shots_y.shape[0], 1)))
    refit_x = np.concatenate([x_seen, np.repeat(shots_x, repeat, axis=0)])
    refit_y = np.concatenate([y_seen, np.repeat(shots_y, repeat, axis=0)])
    scored = np.isin(y_test, [*own, new_class])
    scored[rows[:shots]] = False
    return (refit_x, refit_y), (x_test[scored], y_test[scored])


@dataclass(frozen=True)
class DeviceData:
    """One device's data as numpy arrays: its private stream and the held-out test set.

    ``new_class`` is the class the benchmark has it meet after the rounds (``accuracy-new``,
    :func:`new_class_sets`), chosen by the fleet (:meth:`~taste_cl.benchmarks.federated.Fleet.new_class`).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: np.ndarray
    num_rounds: int
    batch_size: int
    new_class: int

    def save(self, path: Path) -> None:
        """Write the arrays to ``path`` (``.npz``, no pickle)."""
        np.savez(path, **{k: np.asarray(v) for k, v in self.__dict__.items()})  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> DeviceData:
        """Read a file written by :meth:`save` (pickled objects refused)."""
        with np.load(path, allow_pickle=False) as data:
            values = {key: data[key] for key in data.files}
        return cls(**{**values, **{key: int(values[key]) for key in ("num_rounds", "batch_size", "new_class")}})

    def batches(self, server_round: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batches observed in ``server_round``."""
        return round_batches(self.x_train, self.y_train, self.num_rounds, self.batch_size, server_round)

    def seen(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """Everything observed in rounds ``1..server_round``."""
        hi = round_bounds(self.y_train.shape[0], self.num_rounds, server_round)[1]
        return self.x_train[:hi], self.y_train[:hi]

    def new_class_sets(self, server_round: int, *, seed: int, partition: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """:func:`new_class_sets` after ``server_round``: the refit and evaluation sets for :attr:`new_class`."""
        test = (self.x_test, self.y_test)
        return new_class_sets(self.seen(server_round), test, self.classes, self.new_class, seed=seed, partition=partition)

    def eval_sets(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Held-out digits of all classes and of the device's own classes."""
        own = np.isin(self.y_test, self.classes)
        return {"all": (self.x_test, self.y_test), "own": (self.x_test[own], self.y_test[own])}
