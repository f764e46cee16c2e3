"""ProbeGuard: bit-identical rollback of a harmful update window; personalization metrics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from zoo import ZOO

from taste_cl import OnlineLearner, ReservoirReplay, StabilityPlasticityMonitor
from taste_cl.guards.probe import ProbeGuard


def _guarded(guard: ProbeGuard, lr: float = 0.05) -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    return OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters(), lr=lr), replay=ReservoirReplay(50),
                         replay_batch_size=4, train_iterations=5, plugins=[guard])


def _clean(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    y = torch.arange(n) % 3
    return torch.eye(3, 4)[y] * 3 + 0.1 * torch.randn(n, 4, generator=generator), y


def test_rollback_restores_parameters_optimizer_and_buffer_bit_identically() -> None:
    x, y = _clean()
    guard = ProbeGuard(window=1, max_drop=0.0, max_flip_rate=None, probe=(x, y), lr_factor=0.9)
    learner = _guarded(guard)
    for _ in range(3):  # accepted windows: the probe score only rises on its own samples
        learner.observe((x, y))
    assert guard.rollbacks == 0
    params = copy.deepcopy(learner.model.state_dict())
    optimizer_state = copy.deepcopy(learner.optimizer.state_dict()["state"])
    replay_state = copy.deepcopy(learner.replay.state_dict())
    learner.optimizer.param_groups[0]["lr"] = lr = 0.5  # a harmful update: wrong labels at a large step size
    heard: list[Any] = []
    learner.monitor.subscribe(heard.append, "update_rolled_back")
    for rollbacks in (1, 2):  # twice from the same snapshot: the snapshot must not have been aliased
        learner.observe((x, (y + 1) % 3))  # every label wrong
        assert guard.rollbacks == rollbacks
        for name, value in learner.model.state_dict().items():
            assert torch.equal(value, params[name]), name
        for index, state in learner.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                assert torch.equal(value, optimizer_state[index][key]), (index, key)
        assert torch.equal(learner.replay.state_dict()["storage"]["y"], replay_state["storage"]["y"])
        assert learner.replay.state_dict()["generator"].equal(replay_state["generator"])
        assert all(p.grad is None for p in learner.model.parameters())
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.81)
    assert [event.name for event in heard] == ["update_rolled_back"] * 2
    assert heard[0].details["drop"] > 0
    assert torch.equal(guard.predict(x), learner.predict(x))  # the served model is the accepted one


def test_accepted_windows_feed_the_probe_and_the_served_model() -> None:
    guard = ProbeGuard(window=2)
    learner = _guarded(guard)
    x, y = _clean()
    for _ in range(4):
        learner.observe((x, y))
    assert guard.windows == 2 and guard.rollbacks == 0
    assert len(guard.probe) == 96  # 4 batches of 24, all in accepted windows
    assert torch.equal(guard.predict(x), learner.predict(x))
    learner.observe((x, y))  # mid-window: the served model stays the accepted one
    assert not torch.equal(guard.predict(x), learner.predict(x))


def test_guard_state_round_trips_through_a_checkpoint(tmp_path: Any) -> None:
    guard = ProbeGuard(window=2)
    learner = _guarded(guard)
    x, y = _clean()
    for _ in range(5):
        learner.observe((x, y))
    learner.save(tmp_path)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    again = ProbeGuard(window=2)
    OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.Adam(model.parameters()), plugins=[again])
    assert (again.windows, again.rollbacks, len(again.probe), len(again._pending)) == (2, 0, 96, 1)
    assert torch.equal(again.predict(x), guard.predict(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "`window == 0`"),
        ({"max_drop": -0.1}, "`max_drop == -0.1`"),
        ({"max_flip_rate": 2}, "`max_flip_rate == 2`"),
        ({"lr_factor": 0}, "`lr_factor == 0`"),
        ({"warmup": -1}, "`warmup == -1`"),
        ({"probe": torch.zeros(3)}, "probe must be a pair"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProbeGuard(**kwargs)


def test_guard_refuses_token_tagging() -> None:
    model, loss_fn, optimizer = ZOO["token_tagger"].build(0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[ProbeGuard()])
    with pytest.raises(ValueError, match="token_classification task has neither"):
        learner.observe(ZOO["token_tagger"].batch(4, 0))


def test_guard_judges_regression_by_squared_error() -> None:
    model, loss_fn, optimizer = ZOO["regression_mlp"].build(0)
    guard = ProbeGuard(window=1)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[guard])
    for seed in range(4):
        learner.observe(ZOO["regression_mlp"].batch(8, seed))
    assert guard.windows == 4 and len(guard.probe) > 0


def test_monitor_anytime_score_negative_flips_and_update_regressed() -> None:
    monitor = StabilityPlasticityMonitor(eval_every=1, regression_threshold=0.2)
    x, y = torch.arange(4.0).unsqueeze(1), torch.tensor([0, 1, 2, 3])  # sample i has class i
    monitor.record(x, y, torch.zeros(4, 4))

    def right(px: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(px.long().squeeze(1), 4).float()

    def two_wrong(px: torch.Tensor) -> torch.Tensor:  # samples of class 0 and 1 now wrong
        return right(px)[:, [1, 0, 2, 3]]

    monitor.evaluate(right)
    assert monitor.negative_flip_rate is None and monitor.stability == 1.0
    monitor.evaluate(two_wrong)
    assert monitor.negative_flip_rate == pytest.approx(0.5)
    assert monitor.flip_impact == pytest.approx(1.0)
    assert monitor.anytime_score == pytest.approx(0.75)
    events = monitor.dispatch()
    assert [e.name for e in events] == ["update_regressed", "forgetting_rising"]
    assert events[0].details["drop"] == pytest.approx(0.5) and events[0].details["negative_flip_rate"] == pytest.approx(0.5)
    restored = StabilityPlasticityMonitor(eval_every=1)
    restored.load_state_dict(monitor.state_dict())
    assert (restored.anytime_score, restored.negative_flip_rate, restored.flip_impact) == (0.75, 0.5, 1.0)
    assert monitor.report()["negative_flip_rate"] == 0.5
