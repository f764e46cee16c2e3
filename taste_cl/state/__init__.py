"""A learner's state on disk: the checkpoint format and the validate-then-apply restore.

- :mod:`.checkpoint`: JSON header plus safetensors buffers, no pickle; :mod:`.files`: atomic writes (no torch);
- :mod:`.restore`: parse every section of a decoded state (each part checks its own), then apply all of it or nothing;
  it imports no part: the learner (:mod:`taste_cl.learner.restore`) passes the parsers in.

The torch-free device runtime imports this package: its names are listed once, in
``__init__.pyi``, and each loads its module on first use (``lazy_loader``).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
