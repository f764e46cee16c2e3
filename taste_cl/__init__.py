"""taste_cl: continual-learning personalization for PyTorch models on edge devices.

The public API is flat; adapters (Avalanche, ONNX Runtime, Flower) live in
``taste_cl.adapters`` and are never imported from here, so ``import taste_cl`` stays light.
"""

from typing import TYPE_CHECKING

from taste_cl._lazy import lazy_getattr
from taste_cl._moved import install as install_moved_module_aliases
from taste_cl.exceptions import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidBatchError,
    MissingDependencyError,
    TasteCLError,
)

if TYPE_CHECKING:
    from taste_cl.elastic import ElasticTrainer
    from taste_cl.guards.update import UpdateGuard
    from taste_cl.learner import BatchPlan, ObserveStats, OnlineLearner
    from taste_cl.monitor.drift import PageHinkley
    from taste_cl.monitor.monitor import MonitorEvent, StabilityPlasticityMonitor
    from taste_cl.plugins import LearnerPlugin
    from taste_cl.replay import BufferStorage, ClassBalancedReplay, ReplayStrategy, ReservoirReplay
    from taste_cl.tasks import Classification, MultiLabel, Regression, Task, TokenClassification
    from taste_cl.tuning.tuner import BatchSizeTuner, TunerCacheWarning, TuningError, TuningResult, TuningWarning

# Imported on first use, so the torch-free device runtime (taste_cl.adapters.onnxruntime.runtime)
# can import taste_cl on a device without torch.
_LAZY = {
    "PageHinkley": "taste_cl.monitor.drift",
    "ElasticTrainer": "taste_cl.elastic",
    "BatchPlan": "taste_cl.learner",
    "ObserveStats": "taste_cl.learner",
    "OnlineLearner": "taste_cl.learner",
    "MonitorEvent": "taste_cl.monitor.monitor",
    "StabilityPlasticityMonitor": "taste_cl.monitor.monitor",
    "LearnerPlugin": "taste_cl.plugins",
    "BufferStorage": "taste_cl.replay",
    "ClassBalancedReplay": "taste_cl.replay",
    "ReplayStrategy": "taste_cl.replay",
    "ReservoirReplay": "taste_cl.replay",
    "UpdateGuard": "taste_cl.guards.update",
    "Classification": "taste_cl.tasks",
    "MultiLabel": "taste_cl.tasks",
    "Regression": "taste_cl.tasks",
    "Task": "taste_cl.tasks",
    "TokenClassification": "taste_cl.tasks",
    "BatchSizeTuner": "taste_cl.tuning.tuner",
    "TunerCacheWarning": "taste_cl.tuning.tuner",
    "TuningError": "taste_cl.tuning.tuner",
    "TuningResult": "taste_cl.tuning.tuner",
    "TuningWarning": "taste_cl.tuning.tuner",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
install_moved_module_aliases()


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
