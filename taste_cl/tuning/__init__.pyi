# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .load import LoadMeter as LoadMeter
from .load import load_bucket as load_bucket
from .searcher import TuningError as TuningError
from .searcher import TuningResult as TuningResult
from .searcher import TuningWarning as TuningWarning
from .searcher import candidate_batch_sizes as candidate_batch_sizes
from .tuner import BatchSizeTuner as BatchSizeTuner
from .tuner import SurrogateCache as SurrogateCache
from .tuner import TunerCacheWarning as TunerCacheWarning
from .tuner import lr_scale_for as lr_scale_for
from .tuner import max_batch_for_memory as max_batch_for_memory
from .tuner import measure_throughput as measure_throughput
