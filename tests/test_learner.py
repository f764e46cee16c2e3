from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import batch, snapshot, tiny_learner

from taste_cl import ObserveStats, OnlineLearner, StabilityPlasticityMonitor
from taste_cl.reference import build_digits_learner
from taste_cl.experiment import run_class_incremental


def test_reservoir_replay_reaches_080_on_split_digits_and_no_replay_stays_near_chance(digits_tasks):
    """The core issue's acceptance check: 5 tasks x 2 classes, one pass, stream batch 10."""
    with_replay = run_class_incremental(build_digits_learner(replay_capacity=200), digits_tasks, batch_size=10)
    without = run_class_incremental(build_digits_learner(replay_capacity=0), digits_tasks, batch_size=10)
    assert with_replay.final_accuracy >= 0.80
    assert without.final_accuracy <= 0.30
    assert with_replay.forgetting < without.forgetting - 0.5
    assert len(with_replay.accuracy_matrix) == 5


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: (x, y),
        lambda x, y: [x, y],
        lambda x, y: {"x": x, "y": y},
        lambda x, y: (x.numpy(), y.numpy()),
        lambda x, y: (x.double().numpy(), y.int().numpy()),
        lambda x, y: (x.t().contiguous().t(), y),  # non-contiguous after the transposes? make sure both work
        lambda x, y: (torch.cat([x, x], 1)[:, ::2], y),  # a strided view
    ],
)
def test_observe_accepts_tuples_dicts_numpy_and_views(make):
    learner = tiny_learner()
    x, y = batch()
    stats = learner.observe(make(x, y))
    assert isinstance(stats, ObserveStats)
    assert stats.samples == 8 and stats.steps == 1 and not stats.skipped
    assert np.isfinite(stats.loss) and 0 <= stats.accuracy <= 1 and stats.step_time_s > 0


def test_observe_does_not_alias_caller_memory():
    learner = tiny_learner()
    x, y = batch()
    learner.observe((x, y))
    x.fill_(1e6)
    stored, _ = learner.replay.sample(len(learner.replay))
    assert stored.abs().max() < 100


def test_stats_report_replay_use_and_steps():
    learner = tiny_learner(train_iterations=3)
    first = learner.observe(batch(seed=0))
    second = learner.observe(batch(seed=1))
    assert (first.replay_samples, first.batch_size, first.steps) == (0, 8, 3)
    assert (second.replay_samples, second.batch_size) == (12, 12)  # 4 replayed in each of 3 steps
    assert learner.samples_seen == 16 and learner.steps == 2


def test_training_lowers_loss_on_a_learnable_stream():
    learner = tiny_learner(replay_capacity=0, momentum=0.0)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(4, 3, generator=generator)
    losses = []
    for _ in range(150):
        x = torch.randn(16, 4, generator=generator)
        losses.append(learner.observe((x, (x @ weights).argmax(1))).loss)
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:20])


def test_predict_has_no_side_effects_and_restores_train_mode():
    learner = tiny_learner()
    learner.observe(batch())
    learner.model.train()
    before = snapshot(learner)
    out1 = learner.predict(batch(seed=2)[0])
    out2 = learner.predict(batch(seed=2)[0].numpy())
    assert torch.equal(out1, out2)  # eval mode: dropout off
    assert learner.model.training
    assert snapshot(learner) == before


def test_non_finite_loss_skips_the_update_and_reports_a_fault():
    learner = tiny_learner(replay_capacity=0)
    learner.observe(batch())
    events = []
    learner.monitor.subscribe(events.append, event="numerical_fault")
    params = [p.detach().clone() for p in learner.model.parameters()]
    huge = torch.full((8, 4), 3e38)
    stats = learner.observe((huge, batch()[1]))
    assert stats.skipped and stats.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(params, learner.model.parameters()))
    assert [e.name for e in events] == ["numerical_fault"]
    assert not learner.observe(batch(seed=3)).skipped  # keeps learning afterwards


def test_learner_without_optimizer_uses_sgd():
    model = torch.nn.Linear(4, 3)
    learner = OnlineLearner(model)
    assert isinstance(learner.optimizer, torch.optim.SGD)
    learner.observe(batch())


def test_a_model_moved_to_float64_mid_stream_keeps_learning_with_its_buffers():
    learner = tiny_learner(replay_capacity=8, monitor=StabilityPlasticityMonitor(probe_capacity=8, eval_every=1))
    for seed in range(4):  # both buffers full: later batches overwrite slots
        learner.observe(batch(seed=seed))
    learner.model.double()
    assert learner.dtype == torch.float64
    for seed in range(4, 8):
        stats = learner.observe(batch(seed=seed))
        assert np.isfinite(stats.loss) and stats.replay_samples == 4
    assert learner.predict(batch()[0]).dtype == torch.float64
    assert learner.monitor.stability is not None


def test_the_stream_accuracy_in_stats_counts_predictions_made_before_training():
    torch.manual_seed(0)
    learner = OnlineLearner(torch.nn.Linear(4, 3))  # no dropout: training-mode logits equal predict's
    for seed in range(5):
        x, y = batch(seed=seed)
        expected = float((learner.predict(x).argmax(1) == y).float().mean())
        assert learner.observe((x, y)).accuracy == pytest.approx(expected)
