"""Shared test helpers: snapshots that compare learner state bit for bit, and edits of decoded checkpoint states."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.state.checkpoint import decode_state, encode_state
from taste_cl.testing import states_equal


def tiny_learner(*, replay_capacity: int = 20, lr: float = 0.1, momentum: float = 0.9, **kwargs: Any) -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        replay=ReservoirReplay(replay_capacity) if replay_capacity else None,
        **{"replay_batch_size": 4, **kwargs},
    )


def batch(n: int = 8, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


class Snapshot:
    """A deep copy of learner state (model, optimizer, buffer, monitor, RNG); == compares bit for bit."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Snapshot) and states_equal(self.state, other.state)


def snapshot(learner: OnlineLearner) -> Snapshot:
    # Through the checkpoint codec: a deep copy that shares no memory with the learner.
    return Snapshot(decode_state(encode_state(learner.state_dict())))


Edit = Callable[[dict[str, Any]], None]


def state_copy(obj: Any) -> Any:
    """``obj.state_dict()`` through the checkpoint codec: a copy sharing no memory with ``obj``."""
    return decode_state(encode_state({"s": obj.state_dict()}))["s"]


def _key(node: Any, key: str) -> Any:
    """``key`` as ``node`` indexes it: list positions and the optimizer's int state keys are ints."""
    return int(key) if isinstance(node, list) or (key.isdigit() and int(key) in node) else key


def _parent(state: dict[str, Any], path: str | tuple[str, ...]) -> tuple[Any, Any]:
    keys = path.split(".") if isinstance(path, str) else path
    node: Any = state
    for key in keys[:-1]:
        node = node[_key(node, key)]
    return node, _key(node, keys[-1])


def set_at(path: str | tuple[str, ...], value: Any) -> Edit:
    """An edit that sets ``state[a][b]...`` (path ``"a.b"``, or a tuple when keys hold dots) to
    ``value``, or to ``value(old)`` when it is callable."""

    def edit(state: dict[str, Any]) -> None:
        node, key = _parent(state, path)
        node[key] = value(node[key]) if callable(value) else value

    return edit


def delete_at(path: str | tuple[str, ...]) -> Edit:
    """An edit that deletes ``state[a][b]...`` (path as for :func:`set_at`)."""

    def edit(state: dict[str, Any]) -> None:
        node, key = _parent(state, path)
        del node[key]

    return edit


def nan_first(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its first entry NaN."""
    t = t.clone()
    t.view(-1)[0] = math.nan
    return t


def fake_hardware(monkeypatch: Any, curve: Callable[[int], float]) -> list[int]:
    """Replace the tuner's throughput measurement by ``curve(batch_size)`` on a quiet machine.

    Returns the list the probed batch sizes are appended to. The foreign-load reading is
    pinned to 0, since the cache key holds the load bucket and a busy test machine would
    otherwise change it between tunes.
    """
    from taste_cl.tuning import tuner as tuning

    probes: list[int] = []

    def measure(self: Any, batch_size: int, **kwargs: Any) -> float:
        probes.append(batch_size)
        return curve(batch_size)

    monkeypatch.setattr(tuning.ProbeRunner, "measure", measure)
    monkeypatch.setattr(tuning.LoadMeter, "read", lambda self: 0.0)
    return probes


def rehash(folder: Path, edit: Callable[[dict], None] | None = None) -> None:
    """Apply ``edit`` to an artifact folder's manifest and re-sign every file (what an attacker would do)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if edit is not None:
        edit(manifest)
    names = [p.name for p in folder.iterdir() if p.name != "manifest.json"]
    manifest["files"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names}
    (folder / "manifest.json").write_text(json.dumps(manifest))


_NO_TORCH_HOOK = '''
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
'''


def run_without_torch(
    script: str, *args: str, python: str | Path = sys.executable, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (dedented) in a fresh interpreter (``python``, default this one) where any
    ``import torch`` fails, as on a device with only numpy and ONNX Runtime; ``args`` are its
    ``sys.argv[1:]``, and the repository root is on its path."""
    root = Path(__file__).resolve().parents[1]
    code = _NO_TORCH_HOOK + textwrap.dedent(script)
    environment = {**os.environ, "PYTHONPATH": str(root), **env}
    return subprocess.run([str(python), "-c", code, *args], env=environment, capture_output=True, text=True, timeout=timeout, check=False)


PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "taste_cl"


def public_modules() -> list[str]:
    """Every module of the package whose dotted path has no private part, the package itself included."""
    names = ["taste_cl"]
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[-1] != "__main__" and not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return sorted(set(names))


def quadrant_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` 8x8 one-channel images whose class (0-3) is the brightest quadrant."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.5
    for i, label in enumerate(y.tolist()):
        row, col = divmod(label, 2)
        x[i, :, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4] += 1.5
    return x, y



def edit_manifest(folder: Path, path: str, value: Any) -> None:
    """Set the device folder's manifest value at dotted ``path`` and re-hash, as an attacker who can write the folder would."""
    from taste_cl.adapters.device.artifacts import MANIFEST_FILE, write_manifest

    manifest = {k: v for k, v in json.loads((folder / MANIFEST_FILE).read_text()).items() if k != "files"}
    *parents, key = path.split(".")
    node = manifest
    for part in parents:
        node = node[part]
    node[key] = value
    write_manifest(folder, manifest)
