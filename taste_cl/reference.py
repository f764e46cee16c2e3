"""The reference setup on sklearn's digits: the learner the demo, the fleet, the examples and the
benchmarks share, so that their numbers are comparable.
"""

from __future__ import annotations

import torch

from taste_cl.datasets import make_mlp
from taste_cl.learner import OnlineLearner
from taste_cl.replay import ReplayStrategy, ReservoirReplay

__all__ = ["build_digits_learner"]


def build_digits_learner(
    *,
    replay_capacity: int = 200,
    replay: ReplayStrategy | None = None,
    lr: float = 0.1,
    seed: int = 0,
    replay_batch_size: int = 10,
    train_iterations: int = 3,
) -> OnlineLearner:
    """The reference setup: 64-128-128-10 MLP, SGD, replay, 3 rehearsal steps per batch.

    Each stream batch is trained ``train_iterations`` times, each time with
    ``replay_batch_size`` replayed samples. ``replay`` overrides the default
    ``ReservoirReplay(replay_capacity)`` (0 = no replay).
    """
    model = make_mlp(seed=seed)
    if replay is None and replay_capacity:
        replay = ReservoirReplay(replay_capacity, seed=seed)
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        replay=replay,
        replay_batch_size=replay_batch_size,
        train_iterations=train_iterations,
    )
