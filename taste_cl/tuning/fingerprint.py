"""Stable keys for on-disk caches: what model, on what hardware, under what load.

The batch-size tuner and the elastic profiler both cache measurements; a cached
measurement is reusable only for the same model signature on the same hardware.
Importing this module needs no torch (the device tuner keys its cache with
:func:`runtime_fingerprint`); the torch keys import it when called.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["default_cache_dir", "hardware_fingerprint", "model_signature", "runtime_fingerprint"]


def default_cache_dir() -> Path:
    """``$TASTE_CL_CACHE_DIR`` if set (and not empty), else ``~/.cache/taste_cl``."""
    return Path(os.environ.get("TASTE_CL_CACHE_DIR") or Path.home() / ".cache" / "taste_cl")


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def model_signature(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype) -> str:
    """Hash of the architecture (module tree), parameter names, shapes and dtypes, input shape and dtype.

    Trainability (``requires_grad``) is not part of it; callers whose measurements depend on it add it.
    """
    payload = {
        "modules": [f"{name}:{type(module).__name__}:{module.extra_repr()}" for name, module in model.named_modules()],
        "parameters": [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()],
        "input_shape": [int(d) for d in input_shape],
        "dtype": str(dtype),
    }
    return _digest(payload)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine() -> dict[str, object]:
    return {"cpu": _cpu_model(), "machine": platform.machine(), "cores": psutil.cpu_count(logical=True)}


def hardware_fingerprint(*, load: str | None = None) -> str:
    """Hash of CPU model, core and torch thread counts, torch version and (optionally) a load bucket."""
    import torch

    payload = {
        **_machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load": load,
    }
    return _digest(payload)


def runtime_fingerprint(runtime: str, *, load: str | None = None) -> str:
    """Hash of CPU model, core count, a device runtime's name and version (``"onnxruntime 1.19.2"``)
    and (optionally) a load bucket; no torch."""
    return _digest({**_machine(), "runtime": runtime, "load": load})
