"""Elastic trainable-tensor selection: train only the part of the network worth its time.

After ElasticTrainer (Huang, Zhang, Gao; MobiSys 2023, arXiv:2312.14227):

- :func:`profile_tensors` (``profiling``) times the forward pass and, for every unit (a
  parameter tensor, or a module), its weight-gradient and activation-gradient time, in
  interleaved rounds with outlier rejection and a confidence interval per unit, plus the
  memory autograd keeps for each: a :class:`TensorProfile` (``tensor_profile``, with its
  validating parser); :func:`load_or_profile` (``cache``) caches that as JSON,
  validating every field of a cached entry before use;
- :class:`GradientImportance` (``selection``) scores each unit by ``sum |grad * delta_w|``
  over one full-backward probe step; :func:`select_tensors` picks, by dynamic
  programming, the units of maximal total importance within a time budget and an
  optional memory budget;
- :class:`~taste_cl.elastic.calibration.StepTimeModel` closes the loop: measured step
  times correct the profile online;
- :class:`~taste_cl.elastic.cycle.SelectionCycle` (``cycle``) runs them in a loop: probe,
  select, measure, correct; :class:`ElasticTrainer` (``trainer``) is that cycle as a
  :class:`~taste_cl.plugins.LearnerPlugin` (hooks, events, profile, checkpoints);
  :func:`measure_training_memory` (``memory``) checks the memory estimate on a real step.

>>> import torch
>>> from torch import nn
>>> from taste_cl import ElasticTrainer, OnlineLearner
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
>>> elastic = ElasticTrainer(rho=0.6, reselect_every=5, cache_dir=None, warmup=0, repeats=2)
>>> learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic])
>>> for _ in range(6):
...     _ = learner.observe((torch.randn(16, 8), torch.randint(0, 3, (16,))))
>>> len(elastic.selected) >= 1 and elastic.selected[-1].startswith("4.")
True
"""

from taste_cl.elastic.cache import CACHE_FILE, load_or_profile
from taste_cl.elastic.calibration import StepTimeModel
from taste_cl.elastic.memory import measure_training_memory, optimizer_state_factor
from taste_cl.elastic.profiling import profile_tensors, unit_names
from taste_cl.elastic.selection import GradientImportance, select_tensors
from taste_cl.elastic.tensor_profile import TensorProfile
from taste_cl.elastic.trainer import ElasticTrainer

__all__ = [
    "CACHE_FILE",
    "ElasticTrainer",
    "GradientImportance",
    "StepTimeModel",
    "TensorProfile",
    "load_or_profile",
    "measure_training_memory",
    "optimizer_state_factor",
    "profile_tensors",
    "select_tensors",
    "unit_names",
]
