from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.tuning import (
    BatchSizeTuner,
    SurrogateCache,
    TunerCacheWarning,
    candidate_batch_sizes,
    max_batch_for_memory,
    measure_throughput,
)
from helpers import batch, snapshot
from helpers import fake_hardware as install_fake_hardware


def synthetic_throughput(batch_size: int) -> float:
    """A TASTE-shaped curve: rises to a ceiling near batch 90, then falls (no noise)."""
    return 2000.0 * batch_size / (batch_size + 8) / (1 + (batch_size / 300) ** 2)


@pytest.fixture
def fake_hardware(monkeypatch):
    return install_fake_hardware(monkeypatch, synthetic_throughput)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _tune(tuner: BatchSizeTuner, model: nn.Module | None = None):
    model = model or _mlp()
    return tuner.tune(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), (4,), 3, foreign_load=0.0)


def test_candidates_are_log_spaced_distinct_and_bounded():
    sizes = candidate_batch_sizes(1024)
    assert sizes[0] == 1 and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    assert 30 <= len(sizes) <= 41
    assert candidate_batch_sizes(100, per_octave=1) == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(ValueError, match="min_batch_size"):
        candidate_batch_sizes(0)


def test_cold_tune_finds_the_peak_with_few_probes(tmp_path, fake_hardware):
    result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    sizes = candidate_batch_sizes(1024)
    oracle = max(sizes, key=synthetic_throughput)
    assert 3 <= len(result.probes) <= 8 < len(sizes) / 3
    best = synthetic_throughput(oracle)
    assert synthetic_throughput(result.batch_size) >= 0.95 * best
    assert not result.warm and result.seconds > 0


def test_cache_hit_warm_starts_with_one_probe_and_the_same_answer(tmp_path, fake_hardware):
    cold = _tune(BatchSizeTuner(cache_dir=tmp_path))
    fake_hardware.clear()
    warm = _tune(BatchSizeTuner(cache_dir=tmp_path))
    assert warm.warm and len(warm.probes) == len(fake_hardware) <= 1
    assert warm.key == cold.key
    assert abs(math.log2(warm.batch_size / cold.batch_size)) <= 0.5


def test_cache_misses_for_another_model_or_trainable_set(tmp_path, fake_hardware):
    first = _tune(BatchSizeTuner(cache_dir=tmp_path))
    wider = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    assert not _tune(BatchSizeTuner(cache_dir=tmp_path), wider).warm
    frozen = _mlp()
    frozen[0].weight.requires_grad_(False)
    other = _tune(BatchSizeTuner(cache_dir=tmp_path), frozen)
    assert not other.warm and other.key != first.key


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", json.dumps({"format": 1, "key": "other", "observations": []}).encode(),
     json.dumps({"format": 1, "key": "KEY", "observations": [[8, "fast"]]}).encode(),
     json.dumps({"format": 1, "key": "KEY", "observations": [[-1, 5.0]]}).encode(), b"\x80\x04pickle"],
)
def test_corrupt_cache_file_warns_and_tunes_cold(tmp_path, fake_hardware, content):
    key = _tune(BatchSizeTuner(cache_dir=tmp_path)).key
    path = SurrogateCache(tmp_path).path(key)
    path.write_bytes(content.replace(b"KEY", key.encode()))
    fake_hardware.clear()
    with pytest.warns(TunerCacheWarning, match="ignoring corrupt tuner cache"):
        result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    assert not result.warm and len(fake_hardware) >= 3
    assert SurrogateCache(tmp_path).load(key)  # rewritten, readable again


def test_measure_throughput_leaves_the_model_and_optimizer_untouched():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    rate = measure_throughput(model, optimizer, nn.CrossEntropyLoss(), (4,), 3, 16, min_time=0.01)
    assert rate > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_memory_budget_bounds_the_batch():
    model = _mlp()
    assert max_batch_for_memory(model, (4,), budget_bytes=1e9) > 100_000
    small = max_batch_for_memory(model, (4,), budget_bytes=4 * 4 * 200 + 3 * 4 * 38 * 10)
    assert 1 <= small <= 20


# ------------------------------------------------------- accumulation and LR scaling
def _learner(**kwargs) -> OnlineLearner:
    model = _mlp()
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), replay=None, **kwargs)


def test_accumulated_micro_batches_match_one_large_step():
    x, y = batch(64, seed=5)
    large, accumulated = _learner(), _learner()
    accumulated.set_batch_plan(16, accumulation_steps=4)
    for seed in range(3):
        x, y = batch(64, seed=seed)
        a, b = large.observe((x, y)), accumulated.observe((x, y))
        assert (a.steps, b.steps, b.micro_batches, b.batch_size) == (1, 1, 4, 16)
    for p, q in zip(large.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_linear_lr_scaling_and_reset():
    learner = _learner()
    learner.set_batch_plan(32, lr_scale=0.25)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    learner.set_batch_plan(32, lr_scale=2.0)  # relative to the original lr, not compounded
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    learner.set_batch_plan(None)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="micro_batch_size == 0"):
        learner.set_batch_plan(0)


def test_stream_is_buffered_into_full_micro_batches_and_resumes_exactly(tmp_path):
    learner = _learner()
    learner.set_batch_plan(25, accumulation_steps=2)
    stats = [learner.observe(batch(10, seed=s)) for s in range(4)]  # 40 samples: one micro-batch of 25
    assert [s.micro_batches for s in stats] == [0, 0, 1, 0]
    assert sum(s.steps for s in stats) == 0 and learner.samples_seen == 40
    assert math.isnan(stats[0].loss) and math.isnan(stats[0].accuracy)
    learner.save(tmp_path)  # 15 samples pending, one micro-batch accumulated
    model = _mlp()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for s in range(4, 8):
        assert learner.observe(batch(10, seed=s)).steps == resumed.observe(batch(10, seed=s)).steps
    assert snapshot(learner) == snapshot(resumed)
    assert learner.batch_plan == resumed.batch_plan


def test_replay_share_is_kept_inside_micro_batches():
    model = _mlp()
    learner = OnlineLearner(model, replay=ReservoirReplay(50), replay_batch_size=10)
    learner.observe(batch(10, seed=0))  # stream batch 10 + replay 10: half the micro-batch is replay
    learner.set_batch_plan(20)
    stats = learner.observe(batch(10, seed=1))
    assert (stats.micro_batches, stats.batch_size, stats.replay_samples) == (1, 20, 10)


# -------------------------------------------------------------- the plugin
def test_plugin_tunes_on_the_first_batch_and_retunes_on_drift(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=256, effective_batch_size=128)
    model = _mlp()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(100), plugins=[tuner])
    events = []
    learner.monitor.subscribe(events.append, event="retuned")
    learner.observe(batch(10, seed=0))
    plan = learner.batch_plan
    assert plan is not None and plan.micro_batch_size == tuner.result_.batch_size
    assert plan.accumulation_steps == math.ceil(128 / plan.micro_batch_size)
    # LR scaled linearly from the reference batch (stream 10 + replay 10) to the effective batch
    assert plan.lr_scale == pytest.approx(plan.accumulation_steps * plan.micro_batch_size / 20)
    learner.monitor.emit("drift_detected")
    learner.monitor.dispatch()
    fake_hardware.clear()
    learner.observe(batch(10, seed=1))
    assert [h["reason"] for h in tuner.history_][-1].startswith("stream drift")
    assert tuner.history_[-1]["warm"] and len(fake_hardware) <= 1  # bounded retune cost
    assert [e.name for e in events] == ["retuned", "retuned"]


def test_plugin_detects_a_load_shift_from_step_times(tmp_path, fake_hardware, monkeypatch):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=64, calibration_window=4, retune_on_drift=False, min_retune_interval=0)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    monkeypatch.setattr(tuner._load_meter, "read", lambda: 0.0)
    learner.observe(batch(10, seed=0))
    micro = learner.batch_plan.micro_batch_size

    from taste_cl.learner import ObserveStats

    def fake(seconds: float) -> ObserveStats:
        return ObserveStats(loss=0.1, accuracy=1.0, samples=micro, replay_samples=0, batch_size=micro, steps=1, step_time_s=seconds)

    for _ in range(8):  # calibrate at a steady rate
        tuner.after_observe(learner, fake(0.01))
    assert len(tuner.history_) == 1
    for _ in range(4):  # another process now takes the CPU: steps take 3x as long
        tuner.after_observe(learner, fake(0.03))
    assert len(tuner.history_) == 2 and tuner.history_[-1]["reason"].startswith("load shift")
    learner.monitor.dispatch()
    assert learner.monitor.report()["events"]["load_shift"] == 1


def test_tuner_state_survives_learner_checkpoints(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path / "cache")
    learner = OnlineLearner(_mlp(), plugins=[tuner])
    learner.observe(batch(10))
    learner.save(tmp_path / "ckpt")
    (tmp_path / "cache").rename(tmp_path / "lost")  # the cache is gone on the new device
    restored = BatchSizeTuner(cache_dir=tmp_path / "cache")
    OnlineLearner.load(tmp_path / "ckpt", model=_mlp(), plugins=[restored])
    assert restored.result_ == tuner.result_ and list(restored.history_) == list(tuner.history_)
    assert SurrogateCache(tmp_path / "cache").load(tuner.result_.key)  # cache rebuilt from the checkpoint


@pytest.mark.parametrize(
    "kwargs, message",
    [({"n_calls": 0}, "n_calls == 0"), ({"max_batch_size": 0}, "max_batch_size"), ({"effective_batch_size": 0}, "effective_batch_size"),
     ({"load_tolerance": 0}, "load_tolerance")],
)
def test_bad_tuner_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchSizeTuner(**kwargs)


def test_warm_tune_with_every_candidate_cached_re_measures_instead_of_crashing(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=8, per_octave=1, warm_calls=2)
    cold = _tune(tuner)
    assert sorted(b for b, _ in SurrogateCache(tmp_path).load(cold.key)) == [1, 2, 4, 8]  # all cached
    fake_hardware.clear()
    warm = _tune(tuner)  # found by the soak: every suggestion was cached and min() got an empty list
    assert warm.warm and len(fake_hardware) == 2 and warm.batch_size == cold.batch_size


def test_load_shift_retunes_are_spaced_by_min_retune_interval(tmp_path, fake_hardware, monkeypatch):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=64, calibration_window=4, retune_on_drift=False, min_retune_interval=30)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    learner.observe(batch(10, seed=0))
    micro = learner.batch_plan.micro_batch_size

    from taste_cl.learner import ObserveStats

    def feed(seconds: float, times: int) -> None:
        for _ in range(times):
            tuner.after_observe(learner, ObserveStats(0.1, 1.0, micro, 0, micro, 1, seconds))

    feed(0.01, 4)  # baseline
    feed(0.03, 10)  # a shift, but inside the interval after the first tune: no retune yet
    assert len(tuner.history_) == 1
    feed(0.03, 20)  # the interval has passed: now it retunes, once
    assert len(tuner.history_) == 2 and tuner.history_[-1]["reason"].startswith("load shift")
