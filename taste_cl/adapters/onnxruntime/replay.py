"""The device's replay buffer: a seeded reservoir of numpy rows that saves to and loads from ``replay.npz``.

A loaded buffer is bounded before anything is allocated for it: its memory (capacity times the
bytes of a row) is at most :data:`MAX_REPLAY_BYTES`, and every array of the archive is checked
by its ``.npy`` header (:func:`npz_headers`), which may claim any shape whatever the file's size.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.onnxruntime.batches import bad_ids, bad_labels
from taste_cl.adapters.onnxruntime.manifest import REPLAY_FILE, DeviceSpec, manifest_error
from taste_cl.replay.draws import ReservoirIndex, apply_plan, draw_rows, new_rng

__all__ = ["MAX_REPLAY_BYTES", "NumpyReplay", "check_replay_memory", "npz_headers"]

MAX_REPLAY_BYTES = 1 << 30  # a replay buffer's memory (capacity x bytes per row), and the largest replay.npz the ExecuTorch device reads


def check_replay_memory(capacity: int, row_bytes: Sequence[int]) -> None:
    """Refuse a buffer of ``capacity`` rows of ``row_bytes`` (per stored array) over :data:`MAX_REPLAY_BYTES`,
    before it is allocated."""
    row = sum(row_bytes)
    if capacity * row > MAX_REPLAY_BYTES:
        raise manifest_error("replay.capacity", capacity, f"at most {MAX_REPLAY_BYTES // row}: rows of {row} bytes, {MAX_REPLAY_BYTES} bytes in all")


def npz_headers(data: bytes) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``{key: (dtype, shape)}`` of every array in the ``np.savez`` bytes ``data``, read from the ``.npy`` headers only.

    A loader bounds each array with it before ``np.load`` allocates what the header claims (any
    shape, whatever the file's size). ``ValueError`` for a malformed archive, a member that is
    compressed (``np.savez`` stores them: the file's size bounds the data), listed twice or not a
    ``.npy`` array, and an object dtype.
    """
    headers: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for member in archive.infolist():
                key = member.filename.removesuffix(".npy")
                if key == member.filename or key in headers or member.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"member {member.filename!r} is not an uncompressed .npy array listed once")
                with archive.open(member) as file:
                    version = np.lib.format.read_magic(file)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f"array {key!r} has .npy format {version}, must be (1, 0) or (2, 0)")
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(file)
                if dtype.hasobject:
                    raise ValueError(f"array {key!r} has dtype {dtype}, which holds Python objects")
                headers[key] = (dtype, tuple(shape))
    except (OSError, RuntimeError, zipfile.BadZipFile) as error:  # RuntimeError: an encrypted member
        raise ValueError(str(error)) from None
    return headers


class NumpyReplay:
    """A reservoir buffer of numpy rows (one array per graph input, plus targets), seeded."""

    def __init__(self, capacity: int, spec: DeviceSpec, *, seed: int = 0) -> None:
        self.capacity, self.seed, self.size = capacity, seed, 0
        self._spec = spec
        self._x = [np.zeros((capacity, *item.shape), item.dtype) for item in spec.inputs]
        self._y = np.zeros((capacity, *spec.labels.shape), spec.labels.dtype)
        self._rng = new_rng(seed)
        self._index = ReservoirIndex(capacity, self._rng)  # the torch ReservoirReplay's decisions (taste_cl.replay.draws)

    def __len__(self) -> int:
        return self.size

    @property
    def seen(self) -> int:
        """Rows offered so far."""
        return self._index.seen

    def add(self, x: list[np.ndarray], y: np.ndarray) -> None:
        """Offer every row of a validated batch to the reservoir."""
        self.size = apply_plan(self._index.offer(y.shape[0]), [*self._x, self._y], [*x, y], self.size)

    def sample(self, n: int) -> tuple[list[np.ndarray], np.ndarray]:
        """``n`` distinct stored rows, drawn at random."""
        idx = draw_rows(self._rng, self.size, n)
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
        """Rebuild a buffer from ``replay.npz`` bytes and its validated manifest entry ``info``.

        Bounded before anything is allocated: the buffer's memory (:func:`check_replay_memory`), then
        each array's header (its dtype, and ``size`` rows of the spec's shape); then the values:
        finiteness, embedding ids and labels.
        """
        size = info["size"]
        expected = {f"x{i}": (item.dtype, item.shape) for i, item in enumerate(spec.inputs)}
        expected["y"] = (spec.labels.dtype, spec.labels.shape)
        check_replay_memory(info["capacity"], [np.dtype(dtype).itemsize * math.prod(shape) for dtype, shape in expected.values()])
        try:
            headers = npz_headers(data)
            if sorted(headers) != sorted(expected):
                raise ArtifactError(f"{REPLAY_FILE} holds arrays {sorted(headers)}, expected {sorted(expected)}")
            for key, (dtype, shape) in expected.items():
                if headers[key] != (np.dtype(dtype), (size, *shape)):
                    got_dtype, got_shape = headers[key]
                    raise ArtifactError(f"{REPLAY_FILE}: array {key!r} is {got_dtype} {got_shape}, must be {dtype} {(size, *shape)}")
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in expected}
        except (ValueError, OSError, zipfile.BadZipFile) as error:
            if isinstance(error, ArtifactError):
                raise
            raise ArtifactError(f"{REPLAY_FILE} is not a valid replay archive: {error}") from None
        for key, array in arrays.items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise ArtifactError(f"{REPLAY_FILE}: array {key!r} holds NaN or infinite values")
        bad = [f"{key!r} holds {problem}" for key, item in zip(expected, spec.inputs) if (problem := bad_ids(arrays[key], item))]
        if bad:
            raise ArtifactError(f"{REPLAY_FILE}: array {bad[0]}")
        y = arrays["y"]
        problem = bad_labels(y, spec)
        if problem:
            raise ArtifactError(f"{REPLAY_FILE}: {problem}")
        replay = cls(info["capacity"], spec, seed=info["seed"])
        replay.load_rows([arrays[f"x{i}"] for i in range(len(spec.inputs))], y, seen=info["seen"], rng=info.get("rng"))
        return replay

    def load_rows(self, x: list[np.ndarray], y: np.ndarray, *, seen: int, rng: dict[str, Any] | None) -> None:
        """Hold the rows ``x`` (one array per graph input) and ``y``, checked by :meth:`from_bytes`, as an
        empty buffer that has seen ``seen`` samples; ``rng``: the PCG64 state :meth:`info` wrote (None: kept)."""
        size = y.shape[0]
        for store, rows in zip(self._x, x):
            store[:size] = rows
        self._y[:size] = y
        self.size, self._index.seen = size, seen
        if rng is not None:
            self._rng.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(rng["state"]), "inc": int(rng["inc"])},
                "has_uint32": rng["has_uint32"],
                "uinteger": rng["uinteger"],
            }
