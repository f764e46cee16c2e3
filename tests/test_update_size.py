"""The update guard's step-size check: one absurd step is refused by default, bit for bit.

A step at LR 1e6 (Adam or SGD) or on a batch of huge inputs changes the parameters by
orders of magnitude more than any step before it; the default guard undoes it, leaves model
and optimizer state (Adam moments, momentum buffers) bit-identical and says why. Healthy
training (the zoo, hypothesis-drawn learning rates, a 100x LR change) is never refused.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import batch, state_copy, tiny_learner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn
from zoo import ZOO

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.guards.update import UpdateGuard
from taste_cl.state.checkpoint import decode_state, encode_state
from taste_cl.testing import states_equal

SIZE_CAUSE = r"step changed the parameters by (\S+) times their norm, over the limit of (\S+) \(rolled back\)"
IMAGE_CASES = {"resnet18", "mobilenet_v2", "mobilenet_v3_small"}


def _adam_learner(guard: str | UpdateGuard = "auto") -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    return OnlineLearner(
        model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), replay=ReservoirReplay(20), replay_batch_size=4, guard_updates=guard
    )


LEARNERS: dict[str, tuple[Callable[..., OnlineLearner], float]] = {
    "adam": (_adam_learner, 1e-3),
    "sgd-momentum": (lambda guard="auto": tiny_learner(guard_updates=guard), 0.1),
}


def _set_lr(learner: OnlineLearner, lr: float) -> None:
    for group in learner.optimizer.param_groups:
        group["lr"] = lr


def _faults(learner: OnlineLearner) -> list[str]:
    causes: list[str] = []
    learner.monitor.subscribe(lambda event: causes.append(event.details["cause"]), event="numerical_fault")
    return causes


def _one_batch_at_lr_1e6(name: str, guard: str) -> tuple[OnlineLearner, list[float], bool, list[float]]:
    """20 healthy batches, one at LR 1e6, the healthy LR again for 150: (learner, losses before, skipped, losses after)."""
    make, healthy_lr = LEARNERS[name]
    learner = make(guard)
    before = [learner.observe(batch(seed=seed)).loss for seed in range(20)]
    _set_lr(learner, 1e6)
    skipped = learner.observe(batch(seed=20)).skipped
    _set_lr(learner, healthy_lr)
    after = [learner.observe(batch(seed=21 + i % 20)).loss for i in range(150)]
    return learner, before, skipped, after


@pytest.mark.parametrize("name", list(LEARNERS))
def test_one_batch_at_lr_1e6_is_refused_by_default_bit_for_bit_with_the_reason(name):
    make, _ = LEARNERS[name]
    learner = make()  # the default guard
    for seed in range(20):
        learner.observe(batch(seed=seed))
    causes = _faults(learner)
    model, optimizer = state_copy(learner.model), state_copy(learner.optimizer)["state"]
    assert optimizer  # Adam moments / momentum buffers exist: their restoration is tested
    _set_lr(learner, 1e6)
    assert learner.observe(batch(seed=20)).skipped
    assert states_equal(state_copy(learner.model), model)
    assert states_equal(state_copy(learner.optimizer)["state"], optimizer)
    assert len(causes) == 1, causes
    match = re.fullmatch(SIZE_CAUSE, causes[0])
    assert match and float(match[1]) > 1e3 * float(match[2])  # orders of magnitude over the limit


@pytest.mark.parametrize("name", list(LEARNERS))
def test_after_a_refused_lr_1e6_batch_the_loss_stays_at_its_level(name):
    learner, before, skipped, after = _one_batch_at_lr_1e6(name, "auto")
    assert skipped
    assert statistics.mean(after) < 1.5 * statistics.mean(before[-10:])
    assert learner.monitor.report()["events"].get("numerical_fault") == 1  # nothing healthy was refused


@pytest.mark.parametrize("name", list(LEARNERS))
def test_without_the_guard_one_batch_at_lr_1e6_destroys_the_model(name):
    """The control: the fault injected above is real (the red team saw the loss stay near 6e10)."""
    _, before, skipped, after = _one_batch_at_lr_1e6(name, "never")
    assert not skipped
    assert statistics.mean(after) > 1e3 * statistics.mean(before[-10:])


def _clean_loss(learner: OnlineLearner) -> float:
    xs, ys = zip(*(batch(seed=500 + i) for i in range(5)))
    return float(nn.functional.cross_entropy(learner.predict(torch.cat(xs)), torch.cat(ys)))


@pytest.mark.parametrize("guard", ["auto", "never"])
def test_a_batch_of_huge_inputs_is_refused_and_its_replayed_samples_harm_nothing(guard):
    learner = tiny_learner(guard_updates=guard)  # SGD, momentum 0.9, replay on
    for seed in range(20):
        learner.observe(batch(seed=seed))
    causes = _faults(learner)
    clean = _clean_loss(learner)
    x, y = batch(seed=99)
    poisoned = learner.observe((x * 1e4, y))  # finite inputs and loss: stored in replay
    later = []
    for i in range(100):
        learner.observe(batch(seed=21 + i % 20))
        later.append(_clean_loss(learner))
    if guard == "never":  # the control
        assert not poisoned.skipped and statistics.mean(later) > 1e3 * clean
        return
    assert poisoned.skipped and re.fullmatch(SIZE_CAUSE, causes[0])
    assert all(re.fullmatch(SIZE_CAUSE, cause) for cause in causes)  # replay draws of the poisoned samples
    assert max(later) < 1.5 * clean


def test_the_first_step_is_judged_against_the_parameters_own_norm():
    """No history yet: a step over ``update_jump`` times the parameters' norm is refused."""
    learner = _adam_learner()
    causes = _faults(learner)
    _set_lr(learner, 1e6)
    assert learner.observe(batch()).skipped
    match = re.fullmatch(SIZE_CAUSE, causes[0])
    assert match and match[2] == "1e+03"
    assert not learner.optimizer.state  # Adam's moments were created by the step, and removed with it


def test_a_weight_decay_raised_to_its_cap_is_measured_and_refused():
    """A changed hyperparameter other than the LR makes the next step protected: SGD weight
    decay 1e3 at LR 0.1 would flip and scale every weight by -99."""
    learner = tiny_learner(momentum=0.0)
    for seed in range(10):
        learner.observe(batch(seed=seed))
    causes = _faults(learner)
    protected = learner.guard.protected_steps
    learner.optimizer.param_groups[0]["weight_decay"] = 1e3
    assert learner.observe(batch(seed=10)).skipped
    assert learner.guard.protected_steps == protected + 1 and re.fullmatch(SIZE_CAUSE, causes[0])


def test_rollback_after_refused_steps_restores_the_last_applied_learning_rate():
    """LR 1e3 is an ordinary size bound (<= update_bound) but a refused step: the snapshot
    taken before it is dropped, so the rollback gets LR 0.1 back, not the spike."""
    guard = UpdateGuard(rollback=True, stuck_after=3, snapshot_every=1)
    learner = tiny_learner(guard_updates=guard)
    for seed in range(6):
        learner.observe(batch(seed=seed))
    _set_lr(learner, 1e3)
    skipped = [learner.observe(batch(seed=10 + i)).skipped for i in range(6)]
    assert skipped == [True, True, True, False, False, False]
    assert learner.optimizer.param_groups[0]["lr"] == 0.1
    assert learner.monitor.report()["events"]["updates_stuck"] == 1


def test_auto_mode_measures_a_healthy_run_once_every_50_steps():
    learner = tiny_learner()
    for seed in range(120):
        learner.observe(batch(seed=seed))
    assert learner.guard.protected_steps == 3  # steps 1, 51 and 101
    assert learner.monitor.report()["events"].get("numerical_fault") is None


ZOO_STEPS = 15
HEALTHY_STEPS = 12


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_never_see_a_step_refused_even_at_a_tenth_of_the_limit(name):
    """Every step judged (``always``) with ``update_jump=100``: 10x stricter than the default."""
    case = ZOO[name]
    model, loss_fn, optimizer = case.build()
    guard = UpdateGuard("always", update_jump=100.0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(24), replay_batch_size=4, guard_updates=guard)
    causes = _faults(learner)
    n = 6 if name in IMAGE_CASES else 16
    for step in range(ZOO_STEPS):
        learner.observe(case.batch(n, seed=step))
    assert causes == [] and guard.protected_steps == ZOO_STEPS


OPTIMIZERS: dict[str, tuple[Callable[[Any, float], torch.optim.Optimizer], float, float]] = {
    # name: (make, lowest LR, highest LR); SGD with momentum 0.9 up to an effective LR of 1
    "sgd": (lambda params, lr: torch.optim.SGD(params, lr=lr), 1e-4, 1.0),
    "sgd-momentum": (lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9), 1e-5, 0.1),
    "adam": (lambda params, lr: torch.optim.Adam(params, lr=lr), 1e-5, 3e-2),
    "adamw": (lambda params, lr: torch.optim.AdamW(params, lr=lr), 1e-5, 3e-2),
}


@pytest.mark.usefixtures("one_thread")
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["batchnorm_mlp", "regression_mlp", "multilabel_mlp", "lstm", "token_tagger"]),
    optimizer=st.sampled_from(list(OPTIMIZERS)),
    position=st.floats(0.0, 1.0),
    change=st.floats(-2.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_healthy_learning_rates_from_scratch_are_never_refused(name, optimizer, position, change, seed):
    """From scratch at an LR drawn log-uniformly from the optimizer's range, changed up to
    100x (within the range) halfway: when the run trains without a guard (no fault, the loss
    does not grow 10x), the guarded runs equal it bit for bit (SGD at LR 1 on the regression
    MLP diverges without a guard: such draws are left out)."""
    make, low, high = OPTIMIZERS[optimizer]
    lr = math.exp(math.log(low) + position * (math.log(high) - math.log(low)))
    case = ZOO[name]
    parameters = []
    for guard in ("never", "auto", "always"):
        model, loss_fn, _ = case.build(seed)
        learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=make(model.parameters(), lr), guard_updates=guard)
        causes = _faults(learner)
        losses = []
        for step in range(HEALTHY_STEPS):
            if step == HEALTHY_STEPS // 2:
                _set_lr(learner, min(max(lr * 10**change, low), high))
            losses.append(learner.observe(case.batch(16, seed=seed + step)).loss)
        if guard == "never":
            assume(causes == [] and max(losses) < 10 * losses[0])
        assert causes == [], (guard, causes)
        parameters.append(state_copy(learner.model))
    assert states_equal(parameters[0], parameters[1]) and states_equal(parameters[0], parameters[2])


# ---------------------------------------------------------------- checkpoints
def test_the_size_history_travels_in_checkpoints_and_resumes_identically(tmp_path):
    learner = _adam_learner()
    for seed in range(12):
        learner.observe(batch(seed=seed))
    state = learner.guard.state_dict()
    assert state["log_size"] is not None and state["log_proxy"] is not None and state["since_measure"] == 11
    learner.save(tmp_path)
    fresh = _adam_learner()
    loaded = OnlineLearner.load(tmp_path, model=fresh.model, optimizer=fresh.optimizer)
    assert loaded.guard.state_dict() == state and loaded.guard.config == learner.guard.config
    for runner in (learner, loaded):
        _set_lr(runner, 1e6)
        assert runner.observe(batch(seed=12)).skipped
    assert learner.guard.state_dict() == loaded.guard.state_dict()


def test_a_checkpoint_written_before_the_size_check_loads_with_defaults():
    learner = _adam_learner()
    for seed in range(3):
        learner.observe(batch(seed=seed))
    state = decode_state(encode_state(learner.state_dict()))
    for key in ("log_proxy", "log_size", "since_measure"):
        del state["guard"][key]
    del state["guard"]["config"]["update_jump"]
    fresh = _adam_learner()
    fresh.load_state_dict(state)
    assert fresh.guard.config.update_jump == 1e3
    assert fresh.guard.state_dict()["log_size"] is None and fresh.guard.state_dict()["since_measure"] == 0
    _set_lr(fresh, 1e6)
    assert fresh.observe(batch(seed=3)).skipped  # judged against the parameters' own norm


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("log_size", math.nan, "log_size == nan"),
        ("log_proxy", 1e308, "log_proxy == 1e+308"),
        ("log_size", "big", "log_size == 'big'"),
        ("since_measure", -1, "since_measure == -1"),
        ("unknown", 1, "guard state must be a dict with keys"),
    ],
)
def test_a_bad_size_history_is_refused_and_changes_nothing(key, value, match):
    guard = UpdateGuard()
    state = {**guard.state_dict(), key: value}
    before = guard.state_dict()
    with pytest.raises(ValueError, match=re.escape(match)):
        guard.load_state_dict(state)
    assert guard.state_dict() == before


def test_bad_update_jump_is_rejected():
    with pytest.raises(ValueError, match="update_jump == 0"):
        UpdateGuard(update_jump=0)


def test_a_resumed_run_protects_and_measures_the_same_steps_as_an_uninterrupted_one(tmp_path):
    """Which steps are copy-protected (and measured) depends on whether the optimizer's
    hyperparameters are those of the last applied step; a resumed run used to forget it,
    protect its first step and drift from the uninterrupted run's size history."""
    learner = _adam_learner()
    for seed in range(6):
        learner.observe(batch(seed=seed))
    learner.save(tmp_path)
    protected_at_save = learner.guard.protected_steps
    fresh = _adam_learner()
    resumed = OnlineLearner.load(tmp_path, model=fresh.model, optimizer=fresh.optimizer)
    assert resumed.guard.state_dict(resumed.optimizer.param_groups) == learner.guard.state_dict(learner.optimizer.param_groups)
    for seed in range(6, 70):
        for runner in (learner, resumed):
            runner.observe(batch(seed=seed))
    assert resumed.guard.state_dict(resumed.optimizer.param_groups) == learner.guard.state_dict(learner.optimizer.param_groups)
    assert resumed.guard.protected_steps == learner.guard.protected_steps - protected_at_save
    assert states_equal(state_copy(resumed.model), state_copy(learner.model))
