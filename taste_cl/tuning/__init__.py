"""Throughput-aware batch-size tuning (TASTE): the tuner plugin and what it is built from.

- :mod:`.tuner`: :class:`BatchSizeTuner`, the learner plugin (plan, retune on shifts, state);
- :mod:`.searcher`: its search side: which probes a tune runs and what they decide;
- :mod:`.probe`: timed training steps on a private copy of the user's setup;
- :mod:`.search`: the Gaussian-process surrogate over (batch size, threads);
- :mod:`.cache`: measurements cached per model and hardware, validated on read;
- :mod:`.load`: how busy the machine is with other work, and whether that shifted;
- :mod:`.fingerprint`: stable keys for the caches (model, hardware, load).
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "BatchSizeTuner",
    "LoadMeter",
    "SurrogateCache",
    "TunerCacheWarning",
    "TuningError",
    "TuningResult",
    "TuningWarning",
    "candidate_batch_sizes",
    "load_bucket",
    "lr_scale_for",
    "max_batch_for_memory",
    "measure_throughput",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "BatchSizeTuner": "taste_cl.tuning.tuner",
        "SurrogateCache": "taste_cl.tuning.tuner",
        "TunerCacheWarning": "taste_cl.tuning.tuner",
        "TuningError": "taste_cl.tuning.searcher",
        "TuningResult": "taste_cl.tuning.searcher",
        "TuningWarning": "taste_cl.tuning.searcher",
        "candidate_batch_sizes": "taste_cl.tuning.searcher",
        "lr_scale_for": "taste_cl.tuning.tuner",
        "max_batch_for_memory": "taste_cl.tuning.tuner",
        "measure_throughput": "taste_cl.tuning.tuner",
        "LoadMeter": "taste_cl.tuning.load",
        "load_bucket": "taste_cl.tuning.load",
    },
)
