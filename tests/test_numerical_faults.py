"""Numerical faults: a step that would make the model non-finite is refused or undone, reported, survived."""

from __future__ import annotations

import math

import pytest
import torch

from taste_cl.safety import UpdateGuard
from helpers import batch, snapshot, tiny_learner

NO_LR_CAP = 1e38  # lets a 1e37 spike reach the optimizer, to test the copy-protected step


def _spike(learner, lr: float) -> None:
    for group in learner.optimizer.param_groups:
        group["lr"] = lr


def _spiked_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Large but finite inputs: with lr 1e37 the gradient is finite, the updated weights are not."""
    x, y = batch(seed=5)
    return x * 1e3, y


@pytest.mark.parametrize("guard", ["auto", "always"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_lr_spike_that_overflows_the_parameters_is_rolled_back_and_reported(guard, momentum):
    learner = tiny_learner(guard_updates=UpdateGuard(guard, max_lr=NO_LR_CAP), momentum=momentum)
    for seed in range(5):
        learner.observe(batch(seed=seed))
    faults = []
    learner.monitor.subscribe(faults.append, event="numerical_fault")
    before = snapshot(learner)
    healthy_lr = learner.optimizer.param_groups[0]["lr"]
    _spike(learner, 1e37)
    stats = learner.observe(_spiked_batch())
    assert stats.skipped and stats.steps == 0 and math.isfinite(stats.loss)
    params = dict(learner.model.named_parameters())
    saved = before.state["model"]
    assert all(torch.equal(params[name], saved[name]) for name in params)  # bit-identical rollback
    assert all(torch.isfinite(t).all() for s in learner.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    assert [e.details["cause"] for e in faults] == ["non-finite parameters after the step (rolled back)"]
    assert learner.monitor.report()["events"]["numerical_fault"] == 1

    _spike(learner, healthy_lr)
    losses = [learner.observe(batch(seed=6 + i % 3)).loss for i in range(30)]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-5:]) < sum(losses[:5])  # it keeps learning afterwards
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())


def test_without_the_guard_the_same_spike_destroys_the_model():
    """The control: shows the fault injected above is real."""
    learner = tiny_learner(guard_updates=UpdateGuard("never", max_lr=NO_LR_CAP))
    for seed in range(5):
        learner.observe(batch(seed=seed))
    _spike(learner, 1e37)
    learner.observe(_spiked_batch())
    assert not all(torch.isfinite(p).all() for p in learner.model.parameters())


def test_auto_mode_does_not_copy_on_healthy_steps(monkeypatch):
    learner = tiny_learner()
    calls = []
    monkeypatch.setattr(UpdateGuard, "_protected_step", staticmethod(lambda optimizer, params: calls.append(1) or True))
    for seed in range(10):
        learner.observe(batch(seed=seed))
    assert calls == []
    _spike(learner, 1e5)
    learner.observe(batch(seed=10))
    assert calls == [1]


def test_guarded_healthy_steps_equal_unguarded_ones():
    runs = []
    for guard in ("always", "never"):
        learner = tiny_learner(guard_updates=guard)  # seeds the global RNG (dropout) the same way
        for seed in range(10):
            learner.observe(batch(seed=seed))
        runs.append(snapshot(learner))
        del runs[-1].state["guard"]  # its config names the mode
    assert runs[0] == runs[1]


def test_non_finite_gradient_from_a_finite_loss_is_skipped():
    learner = tiny_learner(replay_capacity=0)
    learner.observe(batch())
    faults = []
    learner.monitor.subscribe(faults.append, event="numerical_fault")
    before = snapshot(learner)
    learner.model[0].weight.register_hook(lambda grad: grad * float("inf"))
    stats = learner.observe(batch(seed=1))
    assert stats.skipped and math.isfinite(stats.loss)
    assert snapshot(learner).state["model"].keys() == before.state["model"].keys()
    assert all(torch.equal(a, b) for a, b in zip(learner.model.state_dict().values(), before.state["model"].values()))
    assert [e.details["cause"] for e in faults] == ["non-finite loss or gradient"]


def test_bad_guard_mode_is_rejected():
    with pytest.raises(ValueError, match="guard_updates == 'yes'"):
        tiny_learner(guard_updates="yes")
