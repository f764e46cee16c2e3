# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .batching import BatchPlan as BatchPlan
from .learner import OnlineLearner as OnlineLearner
from .stats import ObserveStats as ObserveStats
