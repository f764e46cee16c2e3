"""taste_cl: continual-learning personalization for PyTorch models on edge devices.

The public API is flat; adapters (Avalanche, ONNX Runtime, Flower) live in
``taste_cl.adapters`` and are never imported from here, so ``import taste_cl`` stays light.
"""

from typing import TYPE_CHECKING, Any

from taste_cl.exceptions import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidBatchError,
    MissingDependencyError,
    TasteCLError,
)

if TYPE_CHECKING:
    from taste_cl.drift import PageHinkley
    from taste_cl.elastic import ElasticTrainer
    from taste_cl.learner import BatchPlan, ObserveStats, OnlineLearner
    from taste_cl.monitor import MonitorEvent, StabilityPlasticityMonitor
    from taste_cl.plugins import LearnerPlugin
    from taste_cl.replay import BufferStorage, ClassBalancedReplay, ReplayStrategy, ReservoirReplay
    from taste_cl.safety import UpdateGuard
    from taste_cl.tasks import Classification, MultiLabel, Regression, Task, TokenClassification
    from taste_cl.tuning import BatchSizeTuner, TunerCacheWarning, TuningError, TuningResult, TuningWarning

# Imported on first use, so the torch-free device runtime (taste_cl.adapters.onnx_device)
# can import taste_cl on a device without torch.
_LAZY = {
    "PageHinkley": "taste_cl.drift",
    "ElasticTrainer": "taste_cl.elastic",
    "BatchPlan": "taste_cl.learner",
    "ObserveStats": "taste_cl.learner",
    "OnlineLearner": "taste_cl.learner",
    "MonitorEvent": "taste_cl.monitor",
    "StabilityPlasticityMonitor": "taste_cl.monitor",
    "LearnerPlugin": "taste_cl.plugins",
    "BufferStorage": "taste_cl.replay",
    "ClassBalancedReplay": "taste_cl.replay",
    "ReplayStrategy": "taste_cl.replay",
    "ReservoirReplay": "taste_cl.replay",
    "UpdateGuard": "taste_cl.safety",
    "Classification": "taste_cl.tasks",
    "MultiLabel": "taste_cl.tasks",
    "Regression": "taste_cl.tasks",
    "Task": "taste_cl.tasks",
    "TokenClassification": "taste_cl.tasks",
    "BatchSizeTuner": "taste_cl.tuning",
    "TunerCacheWarning": "taste_cl.tuning",
    "TuningError": "taste_cl.tuning",
    "TuningResult": "taste_cl.tuning",
    "TuningWarning": "taste_cl.tuning",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'taste_cl' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "BatchSizeTuner",
    "BufferStorage",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ClassBalancedReplay",
    "Classification",
    "ElasticTrainer",
    "InvalidBatchError",
    "LearnerPlugin",
    "MissingDependencyError",
    "MonitorEvent",
    "MultiLabel",
    "ObserveStats",
    "OnlineLearner",
    "PageHinkley",
    "Regression",
    "ReplayStrategy",
    "ReservoirReplay",
    "StabilityPlasticityMonitor",
    "Task",
    "TasteCLError",
    "TokenClassification",
    "TunerCacheWarning",
    "TuningError",
    "TuningResult",
    "TuningWarning",
    "UpdateGuard",
    "__version__",
]
