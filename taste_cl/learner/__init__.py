"""The online learner, split by concept; ``from taste_cl.learner import OnlineLearner`` as before.

- :mod:`.learner`: :class:`OnlineLearner`, which orchestrates validate -> plan -> step -> store;
- :mod:`.batching`: :class:`BatchPlan` and the micro-batches and accumulation window it plans;
- :mod:`.checks`: the argument checks and what the first batch settles (task, input spec, output shape);
- :mod:`.frozen`: which normalisation modules sit in frozen parts, kept in eval mode while the learner trains;
- :mod:`.heads`: growing the classifier for a class the model never saw (``max_classes``);
- :mod:`.stats`: :class:`ObserveStats`, what ``observe`` returns here and on devices (no torch);
- :mod:`.learner_state`, :mod:`.sections`, :mod:`.restore`: what a learner's state holds, how each section is
  checked against the live learner, and how all of them are restored or none.

Importing this package imports nothing heavy (the torch-free device runtime imports
:mod:`.stats`): its names are listed once, in ``__init__.pyi``, and each loads its module on
first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
