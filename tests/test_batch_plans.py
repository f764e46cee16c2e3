"""A batch plan that covers one stream batch with its replay takes exactly the learner's own steps,
also when it does not tile the batch (a rounded replay share, a micro-batch rounded up): no second,
smaller step, and no stream sample left waiting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay

ITERATIONS = 2


def _learner(replay_batch_size: int) -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    replay = ReservoirReplay(50, seed=0) if replay_batch_size else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return OnlineLearner(model, optimizer=optimizer, replay=replay, replay_batch_size=replay_batch_size, train_iterations=ITERATIONS)


def _covering_plans(stream: int, replay: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) whose window holds one observe's rows, rounded up to whole micro-batches
    (the tuner's split of the learner's own step: 20 rows as 3 x 7); a larger window is a larger effective
    batch, which accumulates across observes by design."""
    rows = stream + replay
    return [(micro, steps) for steps in (1, 2, 3, 4) for micro in range(2, rows + 1) if rows <= micro * steps < rows + steps]


@pytest.mark.parametrize(("stream", "replay"), [(10, 0), (10, 10), (16, 4), (7, 10)])
def test_a_plan_covering_one_observe_takes_the_learners_own_steps(stream: int, replay: int) -> None:
    x, y = torch.randn(stream, 4), torch.randint(0, 3, (stream,))
    plans = _covering_plans(stream, replay)
    assert len(plans) >= 4
    for micro, steps in plans:
        learner = _learner(replay)
        for _ in range(2):  # the buffer fills; the plan keeps the learner's stream:replay ratio
            learner.observe((x, y))
        learner.set_batch_plan(micro_batch_size=micro, accumulation_steps=steps)
        for _ in range(3):
            stats = learner.observe((x, y))
            assert (stats.steps, stats.pending) == (ITERATIONS, 0), (micro, steps)
