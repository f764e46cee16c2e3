# The public API: each name once, imported on first use (see __init__.py).
from .elastic import ElasticTrainer as ElasticTrainer
from .exceptions import CheckpointError as CheckpointError
from .exceptions import CheckpointNotFoundError as CheckpointNotFoundError
from .exceptions import ExportError as ExportError
from .exceptions import InvalidBatchError as InvalidBatchError
from .exceptions import MissingDependencyError as MissingDependencyError
from .exceptions import TasteCLError as TasteCLError
from .exceptions import TasteCLWarning as TasteCLWarning
from .exceptions import TunerCacheWarning as TunerCacheWarning
from .exceptions import TuningError as TuningError
from .exceptions import TuningWarning as TuningWarning
from .guards.update import UpdateGuard as UpdateGuard
from .learner import BatchPlan as BatchPlan
from .learner import ObserveStats as ObserveStats
from .learner import OnlineLearner as OnlineLearner
from .monitor.drift import PageHinkley as PageHinkley
from .monitor.monitor import MonitorEvent as MonitorEvent
from .monitor.monitor import StabilityPlasticityMonitor as StabilityPlasticityMonitor
from .plugins import LearnerPlugin as LearnerPlugin
from .replay import BufferStorage as BufferStorage
from .replay import ClassBalancedReplay as ClassBalancedReplay
from .replay import ReplayStrategy as ReplayStrategy
from .replay import ReservoirReplay as ReservoirReplay
from .tasks import Classification as Classification
from .tasks import MultiLabel as MultiLabel
from .tasks import Regression as Regression
from .tasks import Task as Task
from .tasks import TokenClassification as TokenClassification
from .tuning.searcher import TuningResult as TuningResult
from .tuning.tuner import BatchSizeTuner as BatchSizeTuner

__version__: str
__all__: list[str]
