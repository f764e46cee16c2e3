"""The replay buffer of an ExecuTorch artifact folder: plain arrays in ``replay.npz``, checked on load.

The ExecuTorch Python runtime imports torch anyway, so the device keeps a
:class:`~taste_cl.ReservoirReplay`. A buffer of another strategy continues as a reservoir
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

from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.executorch.runtime import IOSpec
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay import ReplayStrategy, ReservoirReplay

__all__ = ["load_replay", "save_replay"]


def save_replay(path: Path, replay: ReplayStrategy) -> dict[str, Any]:
    """Write ``replay``'s samples, capacity, seed, seen count and generator; return the manifest entry."""
    state = replay.state_dict()
    storage = state.get("storage")
    if not isinstance(storage, dict) or "size" not in storage:
        raise ExportError(
            f"cannot export a {type(replay).__name__} buffer: its state_dict() has no 'storage' (a BufferStorage state); pass include_replay=False"
        )
    size = int(storage["size"])
    if size and not isinstance(storage["x"], torch.Tensor):
        raise ExportError("the ExecuTorch backend ships buffers of single-tensor inputs only; pass include_replay=False")
    seen = state.get("seen")
    arrays: dict[str, Any] = {
        "x": storage["x"].cpu().numpy() if size else np.zeros((0,), np.float32),
        "y": storage["y"].cpu().numpy() if size else np.zeros((0,), np.int64),
        "capacity": np.int64(replay.capacity),
        "seed": np.int64(int(state.get("seed", 0))),
        "seen": np.int64(seen if isinstance(seen, int) else size),
    }
    if isinstance(replay, ReservoirReplay):
        arrays["generator"] = state["generator"].numpy()
    np.savez(path, **arrays)
    return {"file": path.name, "strategy": type(replay).__name__, "capacity": replay.capacity, "size": size}


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
            x = spec.flat_inputs(arrays["x"])[0] if spec.keys is None else None
            if x is None:
                raise ValueError("a buffer of dict inputs cannot be read by this version")
            storage.update(x=x, y=spec.targets(arrays["y"], size))
        generator = torch.from_numpy(arrays["generator"]) if "generator" in arrays else torch.Generator().manual_seed(seed).get_state()
        replay.load_state_dict({"capacity": capacity, "storage": storage, "generator": generator, "seen": seen})
    except (KeyError, ValueError, TypeError, RuntimeError, OSError, zipfile.BadZipFile, InvalidBatchError) as error:
        raise ArtifactError(f"replay.npz is not a valid replay buffer for this program: {error}") from None
    return replay
