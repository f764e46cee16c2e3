"""The replay buffer of an ExecuTorch artifact folder: plain arrays in ``replay.npz``, checked on load.

The ExecuTorch Python runtime imports torch anyway, so the device keeps a
:class:`~taste_cl.ReservoirReplay`, of a tensor or a flat dict of tensors (one array per key;
integer ids are checked against their embedding table like every batch). A buffer of another strategy continues as a reservoir
(its class-wise bookkeeping has no meaning there); the reservoir's random stream is saved
and resumed when the strategy was a reservoir. ``np.load(allow_pickle=False)`` reads it, once every
array's header is bounded: ``size`` rows of the program's inputs and target, a capacity of at most
``MAX_CAPACITY`` whose buffer fits ``MAX_REPLAY_BYTES`` (the ONNX Runtime side's bounds), and a
generator state of :data:`~taste_cl.replay.draws.RNG_STATE_BYTES` bytes (or of a torch generator's
length: folders written before the buffers drew from numpy, whose draws then start afresh).
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl._batch import Spec, describe, unflatten
from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.executorch.runtime import IOSpec, LeafSpec
from taste_cl.adapters.onnxruntime.manifest import MAX_CAPACITY
from taste_cl.adapters.onnxruntime.replay import check_replay_memory, npz_headers
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay import ReplayStrategy, ReservoirReplay
from taste_cl.replay.draws import RNG_STATE_BYTES, encode_rng, new_rng

__all__ = ["load_replay", "save_replay"]


def save_replay(path: Path, replay: ReplayStrategy) -> dict[str, Any]:
    """Write ``replay``'s samples, capacity, seed, seen count and generator; return the manifest entry.

    A single-tensor ``x`` is the array ``x``; a dict ``x`` is one array per key, ``x0``, ``x1``, ...,
    with the keys in the string array ``keys``.
    """
    state = replay.state_dict()
    storage = state.get("storage")
    if not isinstance(storage, dict) or "size" not in storage:
        raise ExportError(
            f"cannot export a {type(replay).__name__} buffer: its state_dict() has no 'storage' (a BufferStorage state); pass include_replay=False"
        )
    size = int(storage["size"])
    seen = state.get("seen")
    arrays: dict[str, Any] = {
        "y": storage["y"].cpu().numpy() if size else np.zeros((0,), np.int64),
        "capacity": np.int64(replay.capacity),
        "seed": np.int64(int(state.get("seed", 0))),
        "seen": np.int64(seen if isinstance(seen, int) else size),
    }
    if not size:
        arrays["x"] = np.zeros((0,), np.float32)
    elif isinstance(storage["x"], torch.Tensor):
        arrays["x"] = storage["x"].cpu().numpy()
    else:
        x = unflatten(Spec.from_json(storage["x_spec"]), storage["x"])
        if not isinstance(x, dict) or not all(isinstance(leaf, torch.Tensor) for leaf in x.values()):
            raise ExportError("the ExecuTorch backend ships buffers of a tensor or a flat dict of tensors; pass include_replay=False")
        arrays["keys"] = np.array(list(x), dtype=str)
        arrays.update({f"x{i}": leaf.cpu().numpy() for i, leaf in enumerate(x.values())})
    if isinstance(replay, ReservoirReplay):
        arrays["generator"] = state["generator"].numpy()
    np.savez(path, **arrays)
    return {"file": path.name, "strategy": type(replay).__name__, "capacity": replay.capacity, "size": size}


def _stored_x(arrays: dict[str, np.ndarray], spec: IOSpec) -> list[torch.Tensor]:
    """The stored inputs validated against the program's ``spec`` (shapes, dtypes, id bounds), in its order."""
    if spec.keys is None:
        return spec.flat_inputs(arrays["x"])
    keys = [str(key) for key in arrays["keys"].tolist()] if "keys" in arrays and arrays["keys"].ndim == 1 else None
    if keys is None or sorted(keys) != sorted(spec.keys):
        raise ValueError(f"the buffer's input keys {keys} are not the program's {list(spec.keys)}")
    return spec.flat_inputs({key: arrays[f"x{i}"] for i, key in enumerate(keys)})


_Rule = tuple[str, Callable[[np.dtype, tuple[int, ...]], bool]]  # what an array must be, and a test of its header


def _rules(spec: IOSpec, size: int) -> dict[str, _Rule]:
    """What each array of the archive must be for ``size`` samples of the program's inputs and target."""

    def numbers(leaf: LeafSpec) -> _Rule:
        count = size * math.prod(leaf.shape)
        return (f"numbers for {size} samples of {leaf.dtype} {list(leaf.shape)}",
                lambda dtype, shape: dtype.kind in "biuf" and dtype.itemsize <= 8 and math.prod(shape) == count)  # fmt: skip

    rules = {name: ("one integer", lambda dtype, shape: dtype.kind in "iu" and shape == ()) for name in ("capacity", "seed", "seen")}
    rules["y"] = numbers(spec.target)
    if spec.keys is None or not size:  # an empty buffer stores an empty 'x' whatever the inputs
        return {**rules, "x": numbers(spec.inputs[0])}
    longest, count = max(map(len, spec.keys)), len(spec.keys)
    rules["keys"] = (f"{count} strings of at most {longest} characters",
                     lambda dtype, shape: dtype.kind == "U" and dtype.itemsize <= 4 * longest and shape == (count,))  # fmt: skip
    return {**rules, **{f"x{i}": numbers(leaf) for i, leaf in enumerate(spec.inputs)}}


def _check_headers(headers: dict[str, tuple[np.dtype, tuple[int, ...]]], spec: IOSpec, entry: tuple[int, int] | None) -> int:
    """Bound every array of the archive by its header, before any is read; return the number of samples."""
    y_shape = headers["y"][1] if "y" in headers else ()
    size = y_shape[0] if y_shape else 0
    if entry is not None and size != entry[1]:
        raise ValueError(f"array 'y' holds {size} samples; the manifest's replay.size is {entry[1]}")
    rules = _rules(spec, size)
    states = {(RNG_STATE_BYTES,), tuple(torch.Generator().get_state().shape)}
    generator: _Rule = (f"a generator state, uint8 of a shape in {sorted(states)}", lambda dtype, shape: dtype == np.uint8 and shape in states)
    if not set(rules) <= set(headers) <= {*rules, "generator"}:
        raise ValueError(f"the archive holds arrays {sorted(headers)}, expected {sorted(rules)} and maybe 'generator'")
    for name, (dtype, shape) in headers.items():
        rule, holds = rules.get(name, generator)
        if not holds(dtype, shape):
            raise ValueError(f"array {name!r} is {dtype} {shape}, must be {rule}")
    return size


def load_replay(data: bytes, spec: IOSpec, entry: tuple[int, int] | None = None) -> ReservoirReplay:
    """Rebuild the buffer from ``replay.npz`` bytes; samples are validated against the program's spec.

    Every array is bounded by its header before anything is read or allocated (see the module's
    docstring). ``entry``: the manifest's ``(capacity, size)``, which the archive must hold.
    """
    try:
        headers = npz_headers(data)
        size = _check_headers(headers, spec, entry)
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            capacity, seed, seen = (int(archive[key]) for key in ("capacity", "seed", "seen"))
            if entry is not None and capacity != entry[0]:
                raise ValueError(f"array 'capacity' is {capacity}; the manifest's replay.capacity is {entry[0]}")
            if not 1 <= capacity <= MAX_CAPACITY or size > capacity or seen < size:
                raise ValueError(f"{size} samples for capacity {capacity} (at most {MAX_CAPACITY}) and {seen} seen")
            leaves = [*spec.inputs, spec.target]
            check_replay_memory(capacity, [math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves])
            arrays = {key: archive[key] for key in archive.files}
        replay = ReservoirReplay(capacity, seed=seed)
        storage: dict[str, Any] = {"capacity": capacity, "size": size}
        if size:
            x = _stored_x(arrays, spec)
            if spec.keys is None:
                storage.update(x=x[0])
            else:
                storage.update(x=x, x_spec=describe(dict(zip(spec.keys, x))).to_json())
            storage.update(y=spec.targets(arrays["y"], size))
        generator = torch.from_numpy(arrays["generator"] if "generator" in arrays else encode_rng(new_rng(seed)))
        replay.load_state_dict({"capacity": capacity, "storage": storage, "generator": generator, "seen": seen})
    except (KeyError, ValueError, TypeError, RuntimeError, OSError, zipfile.BadZipFile, InvalidBatchError) as error:
        raise ArtifactError(f"replay.npz is not a valid replay buffer for this program: {error}") from None
    return replay
