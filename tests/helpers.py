"""Shared test helpers: snapshots that compare learner state bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.state.checkpoint import decode_state, encode_state
from taste_cl.testing import states_equal


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


class Snapshot:
    """A deep copy of learner state (model, optimizer, buffer, monitor, RNG); == compares bit for bit."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Snapshot) and states_equal(self.state, other.state)


def snapshot(learner: OnlineLearner) -> Snapshot:
    # Through the checkpoint codec: a deep copy that shares no memory with the learner.
    return Snapshot(decode_state(encode_state(learner.state_dict())))


def fake_hardware(monkeypatch: Any, curve: Callable[[int], float]) -> list[int]:
    """Replace the tuner's throughput measurement by ``curve(batch_size)`` on a quiet machine.

    Returns the list the probed batch sizes are appended to. The foreign-load reading is
    pinned to 0, since the cache key holds the load bucket and a busy test machine would
    otherwise change it between tunes.
    """
    from taste_cl.tuning import tuner as tuning

    probes: list[int] = []

    def measure(self: Any, batch_size: int, **kwargs: Any) -> float:
        probes.append(batch_size)
        return curve(batch_size)

    monkeypatch.setattr(tuning.ProbeRunner, "measure", measure)
    monkeypatch.setattr(tuning.LoadMeter, "read", lambda self: 0.0)
    return probes

