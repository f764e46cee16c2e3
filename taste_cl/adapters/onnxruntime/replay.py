"""The device's replay buffer: a seeded reservoir of numpy rows that saves to and loads from ``replay.npz``."""

from __future__ import annotations

import io
import math
import zipfile
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.batches import bad_ids, bad_labels
from taste_cl.adapters.onnxruntime.manifest import REPLAY_FILE, DeviceSpec

__all__ = ["NumpyReplay"]


class NumpyReplay:
    """A reservoir buffer of numpy rows (one array per graph input, plus targets), seeded."""

    def __init__(self, capacity: int, spec: DeviceSpec, *, seed: int = 0) -> None:
        self.capacity, self.seed, self.seen, self.size = capacity, seed, 0, 0
        self._spec = spec
        self._x = [np.zeros((capacity, *item.shape), item.dtype) for item in spec.inputs]
        self._y = np.zeros((capacity, *spec.labels.shape), spec.labels.dtype)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def __len__(self) -> int:
        return self.size

    def add(self, x: list[np.ndarray], y: np.ndarray) -> None:
        """Offer every row of a validated batch to the reservoir."""
        for i in range(y.shape[0]):
            self.seen += 1
            if self.size < self.capacity:
                slot = self.size
                self.size += 1
            else:
                slot = int(self._rng.integers(0, self.seen))
                if slot >= self.capacity:
                    continue
            for store, leaf in zip(self._x, x):
                store[slot] = leaf[i]
            self._y[slot] = y[i]

    def sample(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """``n`` distinct stored rows, drawn at random."""
        idx = np.sort(self._rng.choice(self.size, size=min(n, self.size), replace=False))
        return [store[idx] for store in self._x], self._y[idx]

    def rows(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Copies of the first ``n`` stored rows, without a random draw (the tuner's probes)."""
        n = min(n, self.size)
        return [store[:n].copy() for store in self._x], self._y[:n].copy()

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        arrays = {f"x{i}": store[: self.size] for i, store in enumerate(self._x)}
        np.savez(buffer, y=self._y[: self.size], **arrays)  # type: ignore[arg-type]
        return buffer.getvalue()

    def info(self) -> dict[str, Any]:
        state = self._rng.bit_generator.state
        rng = {"state": str(state["state"]["state"]), "inc": str(state["state"]["inc"]),
               "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}  # fmt: skip
        return {"file": REPLAY_FILE, "capacity": self.capacity, "size": self.size, "seen": self.seen, "seed": self.seed,
                "rng": rng}  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes, info: dict[str, Any], spec: DeviceSpec) -> NumpyReplay:
        """Rebuild a buffer from ``replay.npz`` bytes, checking keys, dtypes, shapes, finiteness and labels."""
        replay = cls(info["capacity"], spec, seed=info["seed"])
        size = info["size"]
        expected = {f"x{i}": (item.dtype, item.shape) for i, item in enumerate(spec.inputs)}
        expected["y"] = (spec.labels.dtype, spec.labels.shape)
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                if sorted(archive.files) != sorted(expected):
                    raise ArtifactError(f"{REPLAY_FILE} holds arrays {sorted(archive.files)}, expected {sorted(expected)}")
                for key, (dtype, shape) in expected.items():  # bound every array before reading it
                    declared = archive.zip.getinfo(f"{key}.npy").file_size
                    if declared > size * np.dtype(dtype).itemsize * max(1, math.prod(shape)) + 4096:
                        raise ArtifactError(f"{REPLAY_FILE}: array {key!r} is larger than {size} rows of {shape}")
                arrays = {key: archive[key] for key in expected}
        except (ValueError, OSError, KeyError, zipfile.BadZipFile) as error:
            if isinstance(error, ArtifactError):
                raise
            raise ArtifactError(f"{REPLAY_FILE} is not a valid replay archive: {error}") from None
        for key, (dtype, shape) in expected.items():
            array = arrays[key]
            if array.dtype != np.dtype(dtype) or array.shape != (size, *shape):
                raise ArtifactError(f"{REPLAY_FILE}: array {key!r} is {array.dtype} {array.shape}, must be {dtype} {(size, *shape)}")
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ArtifactError(f"{REPLAY_FILE}: array {key!r} holds NaN or infinite values")
        bad = [f"{key!r} holds {problem}" for key, item in zip(expected, spec.inputs) if (problem := bad_ids(arrays[key], item))]
        if bad:
            raise ArtifactError(f"{REPLAY_FILE}: array {bad[0]}")
        y = arrays["y"]
        problem = bad_labels(y, spec)
        if problem:
            raise ArtifactError(f"{REPLAY_FILE}: {problem}")
        for i in range(len(spec.inputs)):
            replay._x[i][:size] = arrays[f"x{i}"]
        replay._y[:size] = y
        replay.size, replay.seen = size, info["seen"]
        if info.get("rng") is not None:
            replay._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(info["rng"]["state"]), "inc": int(info["rng"]["inc"])},
                "has_uint32": info["rng"]["has_uint32"],
                "uinteger": info["rng"]["uinteger"],
            }
        return replay
