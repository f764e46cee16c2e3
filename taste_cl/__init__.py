"""taste_cl: continual-learning personalization for PyTorch models on edge devices.

The public API is flat; adapters (Avalanche, ONNX Runtime, Flower) live in
``taste_cl.adapters`` and are never imported from here, so ``import taste_cl`` stays light.
"""

from taste_cl.drift import PageHinkley
from taste_cl.elastic import ElasticTrainer
from taste_cl.exceptions import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidBatchError,
    MissingDependencyError,
    TasteCLError,
)
from taste_cl.learner import BatchPlan, ObserveStats, OnlineLearner
from taste_cl.monitor import MonitorEvent, StabilityPlasticityMonitor
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import BufferStorage, ClassBalancedReplay, ReplayStrategy, ReservoirReplay
from taste_cl.safety import UpdateGuard
from taste_cl.tasks import Classification, MultiLabel, Regression, Task, TokenClassification
from taste_cl.tuning import BatchSizeTuner, TunerCacheWarning, TuningResult

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
    "TuningResult",
    "UpdateGuard",
    "__version__",
]
