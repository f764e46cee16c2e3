"""Every zoo architecture, as a new user would plug it in: it learns, predicts, survives a
save/load into a fresh model, and a malformed batch changes nothing.

Small batches and one intra-op thread keep the whole file to about a minute on 2 cores.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import torch
from helpers import snapshot
from torch import nn
from zoo import ZOO, ZooCase

from taste_cl import (
    InvalidBatchError,
    OnlineLearner,
    ReservoirReplay,
    StabilityPlasticityMonitor,
)
from taste_cl.tasks import Classification, MultiLabel, Regression, TokenClassification

STEPS = 30
IMAGE_CASES = {"resnet18", "mobilenet_v2", "mobilenet_v3_small"}
EXPECTED_TASK = {
    "token_tagger": TokenClassification(-100),
    "regression_mlp": Regression(),
    "multilabel_mlp": MultiLabel(logits=True),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch_size(case: ZooCase) -> int:
    return 6 if case.name in IMAGE_CASES else 16


def _learner(case: ZooCase, seed: int = 0) -> OnlineLearner:
    model, loss_fn, optimizer = case.build(seed)
    return OnlineLearner(
        model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        replay=ReservoirReplay(24, seed=seed),
        replay_batch_size=4,
        monitor=StabilityPlasticityMonitor(probe_capacity=12, eval_every=10),
    )


def _malformed(case: ZooCase, x: Any, y: torch.Tensor) -> list[tuple[Any, str]]:
    """Bad batches for this case, with the message each must raise."""
    bad: list[tuple[Any, str]] = [((x, y[:-1]), "lengths differ")]
    if isinstance(x, dict):
        bad.append((({"input_ids": x["input_ids"]}, y), "keys"))
        bad.append((({**x, "input_ids": x["input_ids"].float()}, y), "dtype torch.float32"))
    elif not x.is_floating_point():
        bad.append(((x[:, :-1], y), "feature shape"))
    else:
        spoiled = x.clone()
        spoiled.view(-1)[3] = float("nan")
        bad.append(((spoiled, y), "non-finite"))
    if y.is_floating_point():
        bad.append(((x, y.double().fill_(float("inf"))), "non-finite|range"))
    return bad


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_case_learns_predicts_round_trips_and_refuses_bad_batches(name, tmp_path):
    case = ZOO[name]
    learner = _learner(case)
    n = _batch_size(case)
    losses = [learner.observe(case.batch(n, seed=step)).loss for step in range(STEPS)]
    assert learner.task == EXPECTED_TASK.get(name, Classification())
    # medians: tiny batches with BatchNorm and momentum SGD give a few spiky steps (resnet18)
    assert statistics.median(losses[-10:]) < statistics.median(losses[:10]), f"{name} did not learn: {losses}"
    report = learner.monitor.report()
    assert report["metric"] == learner.task.primary and report["stability"] is not None
    assert "numerical_fault" not in report["events"]  # the default update guard refused no step

    x_new, _ = case.batch(5, seed=999)
    out = learner.predict(x_new)
    assert out.shape == (5, *learner.output_shape) and torch.isfinite(out).all()  # a dict output's logits are picked

    learner.save(tmp_path / "ckpt")
    model, loss_fn, optimizer = case.build(seed=1)  # other weights: the checkpoint must replace them
    loaded = OnlineLearner.load(tmp_path / "ckpt", model=model, optimizer=optimizer, loss_fn=loss_fn)
    assert torch.equal(loaded.predict(x_new), out)
    assert loaded.task == learner.task and loaded.input_spec == learner.input_spec and loaded.output == learner.output

    x, y = case.batch(n, seed=STEPS)
    before = snapshot(learner)  # model, optimizer, replay, monitor, RNG
    for bad, message in _malformed(case, x, y):
        with pytest.raises(InvalidBatchError, match=message):
            learner.observe(bad)
    assert snapshot(learner) == before
    learner.observe((x, y))  # and it keeps learning


def test_text_classifier_takes_a_dict_and_integer_targets_with_no_other_argument():
    model = ZOO["text_transformer"].make_model()
    learner = OnlineLearner(model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    x, y = ZOO["text_transformer"].batch(8)
    stats = learner.observe((x, y))
    assert learner.task == Classification() and learner.input_spec.kind == "dict"
    assert learner.input_spec.keys == ("input_ids", "attention_mask") and 0 <= stats.accuracy <= 1
    assert learner.replay is None and learner.predict(x).shape == (8, 4)


def test_regression_mlp_takes_float_targets_with_mse_and_no_other_argument():
    learner = OnlineLearner(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), loss_fn=nn.MSELoss())
    for seed in range(12):
        stats = learner.observe(ZOO["regression_mlp"].batch(8, seed=seed))
    assert learner.task == Regression() and learner.num_classes is None
    assert set(stats.metrics) == {"mse", "mae"} and stats.metrics["mse"] >= 0
    assert learner.monitor.report()["metric"] == "mse" and learner.monitor.plasticity is not None


def test_multilabel_mlp_takes_float_01_targets_with_bce_and_no_other_argument():
    learner = OnlineLearner(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)), loss_fn=nn.BCEWithLogitsLoss())
    for seed in range(12):
        stats = learner.observe(ZOO["multilabel_mlp"].batch(8, seed=seed))
    assert learner.task == MultiLabel() and set(stats.metrics) == {"micro_f1", "exact_match"}
    assert 0 <= learner.monitor.plasticity <= 1


def test_mobilenet_v2_plasticity_agrees_with_predict_on_the_same_samples():
    """BatchNorm makes train-mode outputs differ from predict(); the monitor must score like predict()."""
    case = ZOO["mobilenet_v2"]
    model, loss_fn, optimizer = case.build()
    window = 8
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, monitor=StabilityPlasticityMonitor(window=window))
    for step in range(8):
        learner.observe(case.batch(6, seed=step))
    correct = total = 0
    for step in range(8, 8 + window):
        x, y = case.batch(6, seed=step)
        correct += int((learner.predict(x).argmax(1) == y).sum())
        total += y.shape[0]
        learner.observe((x, y))
    assert learner._score_eval
    assert abs(learner.monitor.plasticity - correct / total) <= 0.05


@pytest.mark.parametrize("name", [n for n in ZOO if n not in IMAGE_CASES] + ["mobilenet_v3_small"])
def test_zoo_probe_gets_the_same_samples_when_batches_wait(name):
    """Dict token inputs, token tags, an AdamW LSTM, regression, multi-label, BatchNorm: the
    monitor's batched offers to its probe equal one offer per batch (state_dict offers)."""
    from taste_cl.testing import states_equal

    case, states = ZOO[name], []
    for offer_each in (False, True):
        learner = _learner(case)
        for step in range(12):
            learner.observe(case.batch(_batch_size(case), seed=step))
            if offer_each:
                learner.monitor.state_dict()
        states.append(learner.monitor.state_dict())
    assert states_equal(states[0], states[1])


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_tuner_probes_train_on_the_learners_targets(name):
    from taste_cl.tuning.probe import ProbeRunner

    case = ZOO[name]
    model, loss_fn, optimizer = case.build()
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer)
    x, y = case.batch(4)
    learner.observe((x, y))
    _, targets = learner._validate((x, y))
    runner = ProbeRunner(model, optimizer, loss_fn, (x, y), output=learner.output)
    assert torch.equal(runner.samples[1], targets) and runner.samples[1].dtype == targets.dtype


# deterministic (no dropout, no BatchNorm) with a loss that is a mean over rows: a plan computes the learner's steps
EXACT_UNDER_PLANS = {"regression_mlp", "multilabel_mlp", "lstm"}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_case_trains_under_a_per_observe_plan_with_short_batches(name):
    """A plan for the learner's own step (micro-batches of 5 at the learner's stream:replay ratio, as many as
    one stream batch fills), short batches included: every architecture trains the same steps as without
    it, and the deterministic ones with a mean loss end with the same parameters."""
    from taste_cl.learner.batching import replay_part

    case = ZOO[name]
    own, planned = _learner(case), _learner(case)
    planned.train_iterations = own.train_iterations = 2
    n = _batch_size(case)
    stream_part = 5 - replay_part(5, own.replay_rows / (n + own.replay_rows))
    assert n % stream_part == 0  # the plan tiles a whole stream batch
    for step in range(6):
        batch = case.batch(n if step % 3 != 2 else 3, seed=step)  # every third batch short, as a task's last
        if step == 1:
            planned.set_batch_plan(5, accumulation_steps=n // stream_part)
        stats = planned.observe(batch)
        assert stats.steps == own.observe(batch).steps == 2 and stats.pending == 0, stats
    for (key, a), b in zip(own.model.named_parameters(), planned.model.parameters()):
        assert torch.isfinite(b).all(), key
        if name in EXACT_UNDER_PLANS:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)
