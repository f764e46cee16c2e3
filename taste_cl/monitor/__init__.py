"""Stability-plasticity monitoring: does the model keep old knowledge while learning new data?

- :mod:`.monitor`: :class:`StabilityPlasticityMonitor`, its probe buffer and events;
- :mod:`.drift`: Page-Hinkley change detection on the loss stream;
- :mod:`.evaluation`: task-sequence metrics (accuracy matrix, forgetting, backward transfer).
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "MonitorEvent",
    "PageHinkley",
    "StabilityPlasticityMonitor",
    "accuracy",
    "average_forgetting",
    "backward_transfer",
    "sample_correct",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "MonitorEvent": "taste_cl.monitor.monitor",
        "StabilityPlasticityMonitor": "taste_cl.monitor.monitor",
        "sample_correct": "taste_cl.monitor.monitor",
        "PageHinkley": "taste_cl.monitor.drift",
        "accuracy": "taste_cl.monitor.evaluation",
        "average_forgetting": "taste_cl.monitor.evaluation",
        "backward_transfer": "taste_cl.monitor.evaluation",
    },
)
