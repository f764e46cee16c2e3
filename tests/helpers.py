"""Shared test helpers: snapshots that compare learner state bit for bit."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay


def tiny_learner(*, replay_capacity: int = 20, lr: float = 0.1, momentum: float = 0.9, **kwargs: Any) -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        replay=ReservoirReplay(replay_capacity) if replay_capacity else None,
        **{"replay_batch_size": 4, **kwargs},
    )


def batch(n: int = 8, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def snapshot(learner: OnlineLearner) -> bytes:
    """Serialized learner state (model, optimizer, buffer, monitor, RNG): equal bytes = identical state."""
    buffer = io.BytesIO()
    torch.save(learner.state_dict(), buffer)
    return buffer.getvalue()
