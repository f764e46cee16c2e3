"""The replay buffer of an ExecuTorch artifact folder: plain arrays in ``replay.npz``, checked on load.

The ExecuTorch Python runtime imports torch anyway, so the device keeps a
:class:`~taste_cl.ReservoirReplay`, of a tensor or a flat dict of tensors (one array per key;
integer ids are checked against their embedding table like every batch). A buffer of another strategy continues as a reservoir
(its class-wise bookkeeping has no meaning there); the reservoir's random stream is saved
and resumed when the strategy was a reservoir. ``np.load(allow_pickle=False)`` reads it.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl._batch import Spec, describe, unflatten
from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.executorch.runtime import IOSpec
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay import ReplayStrategy, ReservoirReplay

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


def load_replay(data: bytes, spec: IOSpec) -> ReservoirReplay:
    """Rebuild the buffer from ``replay.npz`` bytes; samples are validated against the program's spec."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
        capacity, seed, seen = (int(arrays[key]) for key in ("capacity", "seed", "seen"))
        replay = ReservoirReplay(capacity, seed=seed)
        size = int(arrays["y"].shape[0])
        if size > capacity or seen < size:
            raise ValueError(f"{size} samples for capacity {capacity} and {seen} seen")
        storage: dict[str, Any] = {"capacity": capacity, "size": size}
        if size:
            x = _stored_x(arrays, spec)
            if spec.keys is None:
                storage.update(x=x[0])
            else:
                storage.update(x=x, x_spec=describe(dict(zip(spec.keys, x))).to_json())
            storage.update(y=spec.targets(arrays["y"], size))
        generator = torch.from_numpy(arrays["generator"]) if "generator" in arrays else torch.Generator().manual_seed(seed).get_state()
        replay.load_state_dict({"capacity": capacity, "storage": storage, "generator": generator, "seen": seen})
    except (KeyError, ValueError, TypeError, RuntimeError, OSError, zipfile.BadZipFile, InvalidBatchError) as error:
        raise ArtifactError(f"replay.npz is not a valid replay buffer for this program: {error}") from None
    return replay
