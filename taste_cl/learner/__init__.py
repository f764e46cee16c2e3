"""The online learner, split by concept; ``from taste_cl.learner import OnlineLearner`` as before.

- :mod:`.learner`: :class:`OnlineLearner`, which orchestrates validate -> plan -> step -> store;
- :mod:`.batching`: :class:`BatchPlan` and the micro-batches and accumulation window it plans;
- :mod:`.checks`: the argument checks and what the first batch settles (task, input spec, output shape);
- :mod:`.heads`: growing the classifier for a class the model never saw (``max_classes``);
- :mod:`.stats`: :class:`ObserveStats`, what ``observe`` returns here and on devices (no torch).

Importing this package imports nothing heavy (the torch-free device runtime imports
:mod:`.stats`); each name loads its module on first use.
"""

from typing import TYPE_CHECKING

from taste_cl._lazy import lazy_getattr

if TYPE_CHECKING:
    from taste_cl.learner.batching import BatchPlan
    from taste_cl.learner.learner import OnlineLearner
    from taste_cl.learner.stats import ObserveStats

__all__ = ["BatchPlan", "ObserveStats", "OnlineLearner"]

__getattr__ = lazy_getattr(
    __name__,
    {
        "BatchPlan": "taste_cl.learner.batching",
        "ObserveStats": "taste_cl.learner.stats",
        "OnlineLearner": "taste_cl.learner.learner",
    },
)
