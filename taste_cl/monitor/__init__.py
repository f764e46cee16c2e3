"""Stability-plasticity monitoring: does the model keep old knowledge while learning new data?

- :mod:`.monitor`: :class:`StabilityPlasticityMonitor`, its probe buffer and events;
- :mod:`.drift`: Page-Hinkley change detection on the loss stream;
- :mod:`.evaluation`: task-sequence metrics (accuracy matrix, forgetting, backward transfer).
"""

from taste_cl.monitor.drift import PageHinkley
from taste_cl.monitor.evaluation import accuracy, average_forgetting, backward_transfer
from taste_cl.monitor.monitor import MonitorEvent, StabilityPlasticityMonitor, sample_correct

__all__ = [
    "MonitorEvent",
    "PageHinkley",
    "StabilityPlasticityMonitor",
    "accuracy",
    "average_forgetting",
    "backward_transfer",
    "sample_correct",
]
