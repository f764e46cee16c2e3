"""Numerical faults: a step that would make the model non-finite is refused or undone, reported, survived."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import batch, snapshot, tiny_learner

from taste_cl import OnlineLearner
from taste_cl.guards.update import UpdateGuard
from taste_cl.testing import states_equal

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
    # no buffer: it would keep the spiked batch's 1e3-scaled rows and replay them afterwards, another
    # fault (outlier rows, which can wreck the model at lr 0.1) than the lr spike tested here
    learner = tiny_learner(guard_updates=UpdateGuard(guard, max_lr=NO_LR_CAP), momentum=momentum, replay_capacity=0)
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


def test_auto_mode_does_not_copy_on_healthy_steps():
    learner = tiny_learner()
    for seed in range(10):
        learner.observe(batch(seed=seed))
    assert learner.guard.protected_steps == 1  # the first step, measured to learn the typical step size
    _spike(learner, 1e5)
    learner.observe(batch(seed=10))
    assert learner.guard.protected_steps == 2


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


# ----------------------------------------------- issue 15, class 8: unsafe hyperparameters
@pytest.mark.parametrize(
    ("lr", "cause"),
    [
        (math.nan, "learning rate of param group 0 is nan, must be finite"),
        (math.inf, "learning rate of param group 0 is inf, must be finite"),
        (-0.1, r"learning rate of param group 0 is -0.1, must be in \[0, max_lr=1e\+06\]"),
        (1e30, r"learning rate of param group 0 is 1e\+30, must be in \[0, max_lr=1e\+06\]"),
        (torch.tensor(math.nan), "learning rate of param group 0 is nan"),
    ],
    ids=["nan", "inf", "negative", "1e30", "nan-tensor"],
)
def test_an_unsafe_learning_rate_skips_the_step_with_the_reason_and_training_resumes(lr, cause):
    learner = tiny_learner()
    for seed in range(3):
        learner.observe(batch(seed=seed))
    faults = []
    learner.monitor.subscribe(faults.append, event="numerical_fault")
    before = [p.detach().clone() for p in learner.model.parameters()]
    _spike(learner, lr)
    stats = learner.observe(batch(seed=3))
    assert stats.skipped and stats.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    assert len(faults) == 1 and re.match(cause, faults[0].details["cause"])
    _spike(learner, 0.1)
    assert [learner.observe(batch(seed=4 + i)).steps for i in range(3)] == [1, 1, 1]  # not stuck for ever
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())


@pytest.mark.parametrize(("key", "value"), [("momentum", math.nan), ("momentum", 1e308), ("weight_decay", -1.0), ("dampening", 2**70)])
def test_a_non_finite_or_absurd_hyperparameter_skips_the_step(key, value):
    learner = tiny_learner()
    learner.optimizer.param_groups[0][key] = value
    faults = []
    learner.monitor.subscribe(faults.append, event="numerical_fault")
    assert learner.observe(batch()).skipped
    assert faults[0].details["cause"].startswith(f"hyperparameter `{key}` of param group 0 is")


def test_a_non_finite_beta_skips_the_step():
    model = torch.nn.Linear(4, 3)
    adam = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters()))
    adam.optimizer.param_groups[0]["betas"] = (0.9, math.inf)  # the constructor would refuse it
    assert adam.observe(batch()).skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("change", ["replace", "in place"])
def test_a_hyperparameter_spoiled_after_sane_steps_is_still_caught(change):
    """The guard remembers the last sane hyperparameters to skip rechecking them; a change, even in place, is seen."""
    model = torch.nn.Linear(4, 3)
    adam = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters()))
    adam.optimizer.param_groups[0]["betas"] = [0.9, 0.999]
    assert not adam.observe(batch()).skipped and not adam.observe(batch(seed=1)).skipped
    if change == "in place":
        adam.optimizer.param_groups[0]["betas"][1] = math.nan
    else:
        adam.optimizer.param_groups[0]["betas"] = [0.9, math.nan]
    assert adam.observe(batch(seed=2)).skipped
    adam.optimizer.param_groups[0]["betas"][1] = 0.999
    assert not adam.observe(batch(seed=3)).skipped


def test_a_batch_whose_loss_overflows_is_not_stored_in_replay_or_the_probe():
    learner = tiny_learner()
    for seed in range(3):
        learner.observe(batch(seed=seed))
    replay_before, probe_before = learner.replay.state_dict(), learner.monitor._probe.state_dict()
    seen_before = learner.replay.seen
    x, y = batch(seed=9)
    stats = learner.observe((x.sign() * 3e38, y))  # finite inputs, overflowing loss
    assert stats.skipped and not math.isfinite(stats.loss)
    assert learner.replay.seen == seen_before  # (its generator moved: the step sampled replay)
    assert states_equal(learner.replay.state_dict()["storage"], replay_before["storage"])
    assert states_equal(learner.monitor._probe.state_dict(), probe_before)
    for seed in range(10, 20):  # nothing poisonous was kept: every later step applies
        assert not learner.observe(batch(seed=seed)).skipped


# ------------------------------------------------------- stuck updates and rollback
def _stuck_run(lr: float, guard: UpdateGuard, batches: int = 15) -> tuple[object, list, list]:
    learner = tiny_learner(guard_updates=guard)
    events = []
    learner.monitor.subscribe(events.append)
    for seed in range(6):
        learner.observe(batch(seed=seed))
    _spike(learner, lr)
    skipped = [learner.observe(batch(seed=10 + i)).skipped for i in range(batches)]
    return learner, [e for e in events if e.name == "updates_stuck"], skipped


@pytest.mark.parametrize(
    ("lr", "max_lr"),
    [(1e30, 1e6), (1e30, 1e38), (1e5, 1e6)],
    ids=["lr-1e30-refused", "lr-1e30-finite-huge-step", "lr-1e5-grows-to-overflow"],
)
def test_stuck_updates_emit_an_event_and_roll_back_to_the_last_good_snapshot(lr, max_lr):
    guard = UpdateGuard(rollback=True, stuck_after=3, snapshot_every=2, max_lr=max_lr)
    learner, stuck, skipped = _stuck_run(lr, guard)
    assert [e.details for e in stuck] == [{"skipped": 3, "rolled_back": True}]
    assert skipped[-6:] == [False] * 6  # it learns again after the rollback
    assert learner.optimizer.param_groups[0]["lr"] == 0.1  # the snapshot's sane learning rate
    assert all(torch.isfinite(p).all() and p.abs().max() < 100 for p in learner.model.parameters())


def test_without_rollback_a_stuck_learner_reports_once_and_stays_stuck():
    learner, stuck, skipped = _stuck_run(1e30, UpdateGuard(stuck_after=3))
    assert [e.details for e in stuck] == [{"skipped": 3, "rolled_back": False}]
    assert all(skipped) and learner.guard.skipped_in_row == 15 and not learner.guard.has_snapshot


def test_a_diverging_adam_emits_diverging_once():
    """Divergence is watched whatever the mode; ``never`` lets the spiked steps through
    (the default guard refuses them for their size, see test_update_size.py)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    learner = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), guard_updates="never")
    events = []
    learner.monitor.subscribe(events.append, event="diverging")
    for seed in range(8):
        learner.observe(batch(seed=seed))
    assert events == []  # healthy training raises no alarm
    _spike(learner, 1e6)
    for seed in range(10):
        learner.observe(batch(seed=20 + seed))
    assert len(events) == 1 and events[0].details["loss"] > 1e3 * events[0].details["best"]


def test_guard_config_and_state_travel_in_checkpoints(tmp_path):
    guard = UpdateGuard("always", max_lr=5.0, stuck_after=4, rollback=True, snapshot_every=7, divergence_factor=50.0)
    learner = tiny_learner(guard_updates=guard)
    _spike(learner, 10.0)  # above max_lr: skipped
    learner.observe(batch())
    learner.save(tmp_path)
    loaded = OnlineLearner.load(tmp_path, model=tiny_learner().model)
    assert loaded.guard.config == guard.config and loaded.guard.skipped_in_row == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_lr": math.nan}, "max_lr == nan"),
        ({"stuck_after": 0}, "stuck_after == 0"),
        ({"rollback": "yes"}, "rollback must be a bool"),
        ({"divergence_factor": -1.0}, "divergence_factor == -1.0"),
    ],
)
def test_bad_guard_settings_are_rejected(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        UpdateGuard(**kwargs)


@pytest.mark.parametrize("count", [3, 40])  # read one by one, and stacked (more than _FEW_TENSORS)
def test_gradient_norm_is_the_norm_of_all_tensors_and_flags_nan_and_inf(count):
    from taste_cl.learner.batching import _FEW_TENSORS
    from taste_cl.learner.batching import total_norm as _total_norm

    assert (count <= _FEW_TENSORS) == (count == 3)
    tensors = [torch.randn(4, i + 1, generator=torch.Generator().manual_seed(i)) for i in range(count)]
    expected = float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors]).double()))
    assert _total_norm(tensors) == pytest.approx(expected, rel=1e-6)
    for bad in (float("nan"), float("inf")):
        poisoned = [t.clone() for t in tensors]
        poisoned[-1][0, 0] = bad
        assert not math.isfinite(_total_norm(poisoned))
