from __future__ import annotations

import pytest
import torch
from helpers import batch, tiny_learner

from taste_cl import PageHinkley, StabilityPlasticityMonitor
from taste_cl.reference import build_digits_learner
from taste_cl.experiment import run_class_incremental


@pytest.fixture(scope="module")
def digits_runs():
    from taste_cl.datasets import split_digits

    tasks = split_digits(5)
    runs = {}
    for capacity in (200, 0):
        torch.manual_seed(0)
        learner = build_digits_learner(replay_capacity=capacity)
        events = []
        learner.monitor.subscribe(events.append)
        run_class_incremental(learner, tasks, batch_size=10)
        runs[capacity] = (learner.monitor.report(), events)
    return runs


def test_replay_keeps_stability_and_no_replay_forgets(digits_runs):
    with_replay, without = digits_runs[200][0], digits_runs[0][0]
    assert with_replay["stability"] > 0.75 and without["stability"] < 0.35
    assert without["forgetting"] > 0.6 and with_replay["forgetting"] < 0.25
    # both learn the newest classes: plasticity is high either way
    assert with_replay["plasticity"] > 0.6 and without["plasticity"] > 0.6
    assert set(with_replay["per_class_accuracy"]) == set(range(10))


def test_drift_is_detected_at_the_task_boundaries(digits_runs):
    report, events = digits_runs[200]
    drift_steps = [e.step for e in events if e.name == "drift_detected"]
    boundaries = [27, 55, 82, 109]  # steps (batches of 10) where tasks 1..4 begin
    assert len(drift_steps) == 4
    assert all(0 <= d - b <= 5 for d, b in zip(drift_steps, boundaries)), drift_steps
    assert report["drift"]["count"] == 4


def test_forgetting_rising_fires_without_replay(digits_runs):
    names = [e.name for e in digits_runs[0][1]]
    assert "forgetting_rising" in names


def test_subscribe_filters_and_unsubscribes():
    monitor = StabilityPlasticityMonitor()
    heard, all_events = [], []
    stop = monitor.subscribe(heard.append, event="drift_detected")
    monitor.subscribe(all_events.append)
    monitor.emit("drift_detected", loss=1.0)
    monitor.emit("numerical_fault")
    monitor.dispatch()
    stop()
    monitor.emit("drift_detected")
    monitor.dispatch()
    assert [e.name for e in heard] == ["drift_detected"]
    assert [e.name for e in all_events] == ["drift_detected", "numerical_fault", "drift_detected"]
    with pytest.raises(ValueError, match="unknown event 'drfit'"):
        monitor.subscribe(print, event="drfit")


def test_history_is_bounded():
    monitor = StabilityPlasticityMonitor(max_events=5, window=3)
    for _ in range(20):
        monitor.emit("numerical_fault")
    monitor.dispatch()
    assert len(monitor.events) == 5 and monitor.report()["events"]["numerical_fault"] == 20
    learner = tiny_learner(monitor=monitor)
    for seed in range(10):
        learner.observe(batch(seed=seed))
    assert len(monitor.state_dict()["recent"]) == 3


def test_page_hinkley_detects_an_upward_shift_and_ignores_noise():
    generator = torch.Generator().manual_seed(0)
    detector = PageHinkley()
    calm = [detector.update(0.5 + 0.1 * float(torch.randn(1, generator=generator))) for _ in range(500)]
    assert not any(calm)
    shifted = [detector.update(2.5 + 0.1 * float(torch.randn(1, generator=generator))) for _ in range(10)]
    assert any(shifted[:3])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"min_instances": 0}, "min_instances"), ({"threshold": 0}, "threshold"), ({"alpha": 1.5}, "alpha")],
)
def test_page_hinkley_parameters_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PageHinkley(**kwargs)
    with pytest.raises(ValueError, match="non-finite"):
        PageHinkley().update(float("nan"))


def test_prequential_mode_is_validated_and_checkpointed(tmp_path):
    with pytest.raises(ValueError, match="prequential == 'both'"):
        StabilityPlasticityMonitor(prequential="both")
    learner = tiny_learner(monitor=StabilityPlasticityMonitor(prequential="train"))
    learner.observe(batch())
    learner.save(tmp_path)
    from taste_cl import OnlineLearner

    loaded = OnlineLearner.load(tmp_path, model=learner.model)
    assert loaded.monitor.prequential == "train" and not loaded._score_eval


@pytest.mark.parametrize(
    "layers, mode, expected",
    [
        ((torch.nn.Linear(4, 3),), "auto", False),  # no mode-dependent layer: reuse the training forward
        ((torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)), "auto", True),
        ((torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)), "auto", True),
        ((torch.nn.Linear(4, 8), torch.nn.Dropout(0.0), torch.nn.Linear(8, 3)), "auto", False),  # found by behaviour
        ((torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)), "train", False),
        ((torch.nn.Linear(4, 3),), "eval", True),
    ],
)
def test_plasticity_is_scored_in_eval_mode_only_when_train_mode_changes_the_output(layers, mode, expected):
    from taste_cl import OnlineLearner

    learner = OnlineLearner(torch.nn.Sequential(*layers), monitor=StabilityPlasticityMonitor(prequential=mode))
    learner.observe(batch(8))
    assert learner._score_eval is expected
    x, y = batch(8, seed=5)
    before_step = float((learner.predict(x).argmax(1) == y).float().mean())
    stats = learner.observe((x, y))
    if expected:  # scored exactly as predict() saw the samples before the step
        assert stats.accuracy == pytest.approx(before_step)


def test_the_mode_check_changes_neither_the_random_stream_nor_the_model():
    from taste_cl import OnlineLearner

    def run(mode: str) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3))
        learner = OnlineLearner(model, monitor=StabilityPlasticityMonitor(prequential=mode))
        learner.observe(batch(8))
        return torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}

    (rng_auto, state_auto), (rng_eval, state_eval) = run("auto"), run("eval")
    assert torch.equal(rng_auto, rng_eval)
    assert all(torch.equal(state_auto[k], state_eval[k]) for k in state_auto)  # BatchNorm stats untouched by the check


@pytest.mark.parametrize("task", ["classification", "regression"])  # a class-balanced probe, a reservoir
def test_offering_stream_batches_to_the_probe_in_runs_changes_nothing(task):
    """The learner's batches wait and reach the probe every few batches, small ones
    concatenated; offering each at once (state_dict() offers what waits) must give
    bit-identical probes, scores and events."""
    from helpers import states_equal

    runs = []
    for offer_each in (False, True):
        regression = {"loss_fn": torch.nn.MSELoss()} if task == "regression" else {}
        learner = tiny_learner(monitor=StabilityPlasticityMonitor(eval_every=7, probe_capacity=12), **regression)
        for i in range(30):
            x, y = batch(5 + i % 4, seed=i)
            if i % 9 == 4:  # a batch whose loss overflows is scored, never stored: a gap in the probe's ids
                x = x * 1e38
            learner.observe((x, torch.nn.functional.one_hot(y, 3).float() + x[:, :3] if task == "regression" else y))
            if offer_each:
                learner.monitor.state_dict()
                assert not learner.monitor._unoffered
        runs.append(learner.monitor)
    assert runs[0].stability is not None and states_equal(runs[0].state_dict(), runs[1].state_dict())


def test_waiting_probe_batches_are_bounded_and_are_the_learners_copies():
    from taste_cl.monitor.monitor import _OFFER_SAMPLES

    learner = tiny_learner(monitor=StabilityPlasticityMonitor(eval_every=10**9, probe_capacity=12))
    x, y = batch(64)
    for _ in range(3 * _OFFER_SAMPLES // 64):
        learner.observe((x, y))
        assert sum(len(b[1]) for b in learner.monitor._unoffered) < _OFFER_SAMPLES
    x.fill_(float("nan"))  # the caller reuses its buffer: what waits for the probe is unaffected
    y.fill_(7)
    probe = learner.monitor.state_dict()["probe"]
    assert torch.isfinite(probe["storage"]["x"]).all() and int(probe["storage"]["y"].max()) < 3
