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

__all__ = ["DATA_FOLDER", "FINETUNE_FOLDER", "TRAIN_FOLDER", "DeviceData", "round_batches", "round_bounds"]

# the folder the server exports for a fleet of device runtimes (see .device_server)
TRAIN_FOLDER, FINETUNE_FOLDER, DATA_FOLDER = "train", "finetune", "data"


def round_bounds(n: int, num_rounds: int, server_round: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an ``n``-row stream that a device observes in ``server_round`` (1-based)."""
    bounds = np.linspace(0, n, num_rounds + 1).astype(int)
    return int(bounds[server_round - 1]), int(bounds[server_round])


def round_batches(x: Any, y: Any, num_rounds: int, batch_size: int, server_round: int) -> list[tuple[Any, Any]]:
    """The stream slice of ``server_round`` cut into batches (numpy arrays or tensors, in stream order)."""
    lo, hi = round_bounds(int(y.shape[0]), num_rounds, server_round)
    return [(x[s : min(s + batch_size, hi)], y[s : min(s + batch_size, hi)]) for s in range(lo, hi, batch_size)]


@dataclass(frozen=True)
class DeviceData:
    """One device's data as numpy arrays: its private stream and the held-out test set."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: np.ndarray
    num_rounds: int
    batch_size: int

    def save(self, path: Path) -> None:
        """Write the arrays to ``path`` (``.npz``, no pickle)."""
        np.savez(path, **{k: np.asarray(v) for k, v in self.__dict__.items()})  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> DeviceData:
        """Read a file written by :meth:`save` (pickled objects refused)."""
        with np.load(path, allow_pickle=False) as data:
            values = {key: data[key] for key in data.files}
        return cls(**{**values, "num_rounds": int(values["num_rounds"]), "batch_size": int(values["batch_size"])})

    def batches(self, server_round: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batches observed in ``server_round``."""
        return round_batches(self.x_train, self.y_train, self.num_rounds, self.batch_size, server_round)

    def seen(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """Everything observed in rounds ``1..server_round``."""
        hi = round_bounds(self.y_train.shape[0], self.num_rounds, server_round)[1]
        return self.x_train[:hi], self.y_train[:hi]

    def eval_sets(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Held-out digits of all classes and of the device's own classes."""
        own = np.isin(self.y_test, self.classes)
        return {"all": (self.x_test, self.y_test), "own": (self.x_test[own], self.y_test[own])}
