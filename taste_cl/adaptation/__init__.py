"""Test-time adaptation: learn from unlabelled batches (``OnlineLearner.adapt``), guarded against collapse.

- :mod:`~taste_cl.adaptation.methods`: BN-adapt, TENT, EATA, and the normalisation tensors they move;
- :mod:`~taste_cl.adaptation.anchor`: the copy of those tensors that a reset restores;
- :mod:`~taste_cl.adaptation.guard`: label-free collapse signals and when to reset or answer with the source;
- :mod:`~taste_cl.adaptation.estimate`: dropout inference on the classifier, for AETTA's label-free accuracy estimate;
- :mod:`~taste_cl.adaptation.adapter`: :class:`TestTimeAdapter`, which runs one batch.
"""

from taste_cl.adaptation.adapter import AdaptStats, TestTimeAdapter
from taste_cl.adaptation.anchor import NormAnchor
from taste_cl.adaptation.estimate import DropoutProbe
from taste_cl.adaptation.guard import CollapseGuard, GuardVerdict
from taste_cl.adaptation.methods import METHODS, AdaptationMethod, BNAdapt, Eata, Tent

__all__ = [
    "METHODS",
    "AdaptStats",
    "AdaptationMethod",
    "BNAdapt",
    "CollapseGuard",
    "DropoutProbe",
    "Eata",
    "GuardVerdict",
    "NormAnchor",
    "Tent",
    "TestTimeAdapter",
]
