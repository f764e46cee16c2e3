# The package's public names, each once: type checkers read them here, and __init__.py imports each on first use.
from .drift import PageHinkley as PageHinkley
from .evaluation import accuracy as accuracy
from .evaluation import average_forgetting as average_forgetting
from .evaluation import backward_transfer as backward_transfer
from .monitor import MonitorEvent as MonitorEvent
from .monitor import StabilityPlasticityMonitor as StabilityPlasticityMonitor
from .monitor import sample_correct as sample_correct
