"""Throughput-aware batch-size tuning (TASTE): the tuner plugin and what it is built from.

- :mod:`.tuner`: :class:`BatchSizeTuner`, the learner plugin (plan, retune on shifts, state);
- :mod:`.searcher`: its search side: which probes a tune runs and what they decide;
- :mod:`.probe`: timed training steps on a private copy of the user's setup;
- :mod:`.search`: the Gaussian-process surrogate over (batch size, threads);
- :mod:`.cache`: measurements cached per model and hardware, validated on read;
- :mod:`.load`: how busy the machine is with other work, and whether that shifted;
- :mod:`.fingerprint`: stable keys for the caches (model, hardware, load).

The torch-free device runtime imports this package: its names are listed once, in
``__init__.pyi``, and each loads its module on first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
