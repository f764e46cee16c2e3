from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from helpers import batch, snapshot
from helpers import fake_hardware as install_fake_hardware
from torch import nn
from zoo import ZOO

from taste_cl import InvalidBatchError, OnlineLearner, ReservoirReplay
from taste_cl.learner import ObserveStats
from taste_cl.testing import states_equal
from taste_cl.tuning.cache import CachedSurface
from taste_cl.tuning.probe import ProbeRunner
from taste_cl.tuning.search import GridSearch
from taste_cl.tuning.tuner import (
    BatchSizeTuner,
    SurrogateCache,
    TunerCacheWarning,
    TuningError,
    TuningWarning,
    candidate_batch_sizes,
    lr_scale_for,
    max_batch_for_memory,
    measure_throughput,
)


def synthetic_throughput(batch_size: int) -> float:
    """A TASTE-shaped curve: rises to a ceiling near batch 90, then falls (no noise)."""
    return 2000.0 * batch_size / (batch_size + 8) / (1 + (batch_size / 300) ** 2)


@pytest.fixture
def fake_hardware(monkeypatch):
    return install_fake_hardware(monkeypatch, synthetic_throughput)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _tune(tuner: BatchSizeTuner, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
    model = model or _mlp()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    return tuner.tune(model, optimizer, nn.CrossEntropyLoss(), batch(16), foreign_load=0.0)


def _quick(tmp_path, **kwargs) -> BatchSizeTuner:
    """Real probes, kept short."""
    return BatchSizeTuner(cache_dir=tmp_path, **{"max_batch_size": 32, "n_calls": 4, "n_initial_points": 2, "min_probe_time": 0.005, **kwargs})


# ------------------------------------------------------------------ search
def test_candidates_are_log_spaced_distinct_and_bounded():
    sizes = candidate_batch_sizes(1024)
    assert sizes[0] == 1 and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    assert 30 <= len(sizes) <= 41
    assert candidate_batch_sizes(100, per_octave=1) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert candidate_batch_sizes(16, per_octave=1, min_batch_size=2) == [2, 4, 8, 16]
    with pytest.raises(ValueError, match="min_batch_size"):
        candidate_batch_sizes(0)


def _search_with(rates: dict[int, float]) -> GridSearch:
    search = GridSearch([1, 2, 4, 8, 16, 32, 64], [1], per_octave=1)
    for size, rate in rates.items():
        search.record((size, 1), lambda rate=rate: rate)
    return search


def test_search_answer_is_the_posterior_best_not_one_lucky_probe():
    search = _search_with({2: 50.0, 4: 115.0, 8: 55.0, 16: 100.0, 32: 104.0, 64: 101.0})  # 4: a lone spike
    assert search.best() in {(16, 1), (32, 1), (64, 1)}
    assert search.best_rate() == 115.0  # the raw maximum, which only decides when probes stop early


def test_search_suggests_cheap_promising_points_and_stops_when_converged():
    rising = _search_with({1: 10.0, 2: 20.0, 4: 40.0})
    cost = lambda point, rate: point[0] / rate  # noqa: E731 - seconds per step
    assert rising.suggest(cost, min_gain=0.02) in {(8, 1), (16, 1), (32, 1), (64, 1)}  # still rising: look further up
    flat = _search_with({1: 10.0, 2: 20.0, 4: 40.0, 8: 60.0, 16: 61.0, 32: 60.0, 64: 59.0})
    assert flat.suggest(cost, min_gain=0.02) is None  # every size measured
    plateau = _search_with({1: 10.0, 4: 60.0, 8: 61.0, 16: 60.0, 64: 60.0})
    assert plateau.suggest(cost, min_gain=0.5) is None  # nothing left expected to gain 50 %


def test_search_marks_failures_and_memory_errors_infeasible():
    search = _search_with({1: 10.0, 2: 20.0})

    def oom() -> float:
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate")

    assert search.record((16, 1), oom) is None
    assert {b for b, _ in search.infeasible} == {16, 32, 64}
    assert search.suggest(lambda p, r: 1.0, min_gain=0.0) in {(4, 1), (8, 1)}  # never an infeasible size


def test_warm_calls_probe_the_cached_best_neighbours(tmp_path, fake_hardware):
    cold = _tune(BatchSizeTuner(cache_dir=tmp_path))
    fake_hardware.clear()
    warm = _tune(BatchSizeTuner(cache_dir=tmp_path, warm_calls=3))
    candidates = cold.candidates
    best = candidates.index(cold.batch_size)
    assert warm.warm and len(fake_hardware) == 3  # the check, then two probes next to the cached best (or the best again)
    assert all(abs(candidates.index(b) - best) <= 2 for b in fake_hardware[1:])
    assert synthetic_throughput(warm.batch_size) >= 0.95 * synthetic_throughput(cold.batch_size)


def test_cold_tune_finds_the_peak_with_few_probes(tmp_path, fake_hardware):
    result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    oracle = max(candidate_batch_sizes(1024), key=synthetic_throughput)
    assert 3 <= len(result.probes) <= 10 and len(fake_hardware) == len(result.probes)  # cheap probes: the budget allows n_calls
    assert synthetic_throughput(result.batch_size) >= 0.95 * synthetic_throughput(oracle)
    assert not result.warm and result.seconds > 0 and result.min_batch_size == 1


def test_cache_hit_warm_starts_with_one_cheap_check_and_the_same_answer(tmp_path, fake_hardware):
    cold = _tune(BatchSizeTuner(cache_dir=tmp_path))
    fake_hardware.clear()
    warm = _tune(BatchSizeTuner(cache_dir=tmp_path))
    (checked,) = fake_hardware  # one probe: a cached size within 4x of the best's rate, and no larger (cheaper to step)
    assert checked in {b for b, _, _ in cold.probes} and checked <= cold.batch_size
    assert synthetic_throughput(checked) >= synthetic_throughput(cold.batch_size) / 4
    assert warm.warm and warm.key == cold.key and warm.batch_size == cold.batch_size


def test_cache_misses_for_another_model_trainable_set_or_optimizer(tmp_path, fake_hardware):
    first = _tune(BatchSizeTuner(cache_dir=tmp_path))
    wider = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 3))
    assert not _tune(BatchSizeTuner(cache_dir=tmp_path), wider).warm
    frozen = _mlp()
    frozen[0].weight.requires_grad_(False)
    assert _tune(BatchSizeTuner(cache_dir=tmp_path), frozen).key != first.key
    model = _mlp()
    adam = _tune(BatchSizeTuner(cache_dir=tmp_path), model, torch.optim.Adam(model.parameters()))
    assert not adam.warm and adam.key != first.key


def test_a_failing_probe_marks_its_size_infeasible_and_the_search_continues(tmp_path):
    class Picky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 8:
                raise RuntimeError("this accelerator takes at most 8 samples")
            return self.linear(x)

    result = _tune(_quick(tmp_path, per_octave=1, n_calls=6), Picky())
    assert result.batch_size <= 8 and all(b <= 8 for b, _, _ in result.probes)
    assert any(b > 8 and "at most 8" in why for b, _, why in result.infeasible)


def test_no_trainable_size_raises_tuning_error(tmp_path):
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken model")

    with pytest.raises(TuningError, match="broken model"):
        _tune(_quick(tmp_path), Broken())


# ------------------------------------------------------- real models, real probes
def test_batchnorm_model_tunes_from_the_smallest_trainable_batch(tmp_path):
    model, loss_fn, optimizer = ZOO["batchnorm_mlp"].build()
    result = _quick(tmp_path).tune(model, optimizer, loss_fn, ZOO["batchnorm_mlp"].batch(16), foreign_load=0.0)
    assert result.min_batch_size == 2 and result.candidates[0] == 2
    assert result.infeasible[0][0] == 1 and "more than 1 value per channel" in result.infeasible[0][2]
    assert result.batch_size >= 2 and result.samples_per_s > 0


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, amsgrad=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        lambda m: torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.01}, {"params": m[2].parameters()}], lr=0.1, momentum=0.5),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-nesterov", "two-param-groups"],
)
def test_common_optimizers_tune_and_stay_untouched(tmp_path, make_optimizer):
    model = _mlp()
    optimizer = make_optimizer(model)
    learner = OnlineLearner(model, optimizer=optimizer, replay=None)
    learner.observe(batch(8))  # the optimizer now has state (moments, momentum)
    before = snapshot(learner)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    result = _tune(_quick(tmp_path), model, optimizer)
    assert result.batch_size >= 1 and result.probes
    assert snapshot(learner) == before  # model, optimizer state and RNG untouched
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups


@pytest.mark.parametrize("name", ["token_tagger", "text_transformer", "lstm"])
def test_sequence_models_tune_on_their_own_samples(tmp_path, name):
    """Integer tokens stay integers (random normal probes would be negative ids); dict inputs are passed by keyword."""
    model, loss_fn, optimizer = ZOO[name].build()
    samples = ZOO[name].batch(12)
    x = samples[0]
    leaves = list(x.values()) if isinstance(x, dict) else [x]
    result = _quick(tmp_path, max_batch_size=16).tune(model, optimizer, loss_fn, samples, foreign_load=0.0)
    assert result.min_batch_size == 1 and result.probes and not result.infeasible
    assert [t.dtype for t in leaves] == [t.dtype for t in (list(samples[0].values()) if isinstance(x, dict) else [x])]


class StepClock:
    """A clock on which a training step at ``t`` threads takes ``seconds[t]``: every reading advances
    it by that much, so a step (read at its start and end) lasts exactly that long. Probes and
    fixed-work windows still run the real model; only what they measure no longer depends on
    how busy the machine is."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.now = seconds, 0.0

    def __call__(self) -> float:
        self.now += self.seconds[torch.get_num_threads()]
        return self.now


@pytest.mark.parametrize("name", ["text_transformer", "lstm", "batchnorm_mlp", "regression_mlp", "mobilenet_v3_small"])
def test_thread_confirmation_trains_real_models_on_copies(tmp_path, monkeypatch, restore_threads, name):
    """Dict token inputs, AdamW, BatchNorm, regression, a torchvision net: the fixed-work windows run the real model.

    Two threads step 4x faster on the injected clock, so the probes favour them and the
    confirmation runs whatever the load (on a busy machine two real threads can be 100x slower)."""
    monkeypatch.setattr("taste_cl.tuning.tuner.thread_options", lambda: [1, 2])
    model, loss_fn, optimizer = ZOO[name].build()
    before = [p.detach().clone() for p in model.parameters()]
    real_work, windows = ProbeRunner.work, []

    def work(self, batch_size, steps, *, threads=None, **kwargs):
        done, seconds = real_work(self, batch_size, steps, threads=threads, **kwargs)
        trained = any(not torch.equal(a, b) for a, b in zip(self.model.parameters(), before))  # the copy moved
        windows.append((threads, done == steps, trained))
        return done, seconds

    monkeypatch.setattr(ProbeRunner, "work", work)
    tuner = BatchSizeTuner(cache_dir=tmp_path, tune_threads=True, max_batch_size=8, min_probe_time=0.005, clock=StepClock({1: 0.01, 2: 0.0025}))
    x, y = ZOO[name].batch(8)
    y = y.view(-1, 1) if name == "regression_mlp" else y  # the (n, 1) targets a learner passes its plugins
    result = tuner.tune(model, optimizer, loss_fn, (x, y), foreign_load=0.0)
    assert windows == [(2, True, True), (1, True, True)] * 3  # interleaved windows, every step asked for run
    assert result.threads == 2 and result.samples_per_s == pytest.approx(result.batch_size / 0.0025)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not optimizer.state


def test_measure_throughput_leaves_the_model_and_optimizer_untouched():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    rate = measure_throughput(model, optimizer, nn.CrossEntropyLoss(), batch(8), 16, min_time=0.01)
    assert rate > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_fixed_work_runs_the_steps_asked_or_stops_at_max_seconds_on_copies_and_restores_the_thread_count():
    model = _mlp()
    runner = ProbeRunner(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), batch(8))
    calls = []
    step = runner._step
    runner._step = lambda x, y: calls.append(len(y)) or step(x, y)  # type: ignore[method-assign]
    threads = torch.get_num_threads()
    steps, seconds = runner.work(16, 5, threads=1)
    assert steps == 5 and seconds > 0 and calls == [16] * 6  # one untimed start-up step, then the five timed
    assert torch.get_num_threads() == threads
    assert all(p.grad is None for p in model.parameters())
    calls.clear()
    steps, seconds = runner.work(16, 5, max_seconds=0.0)
    assert steps == 1 and seconds > 0 and calls == [16] * 2  # cut after the first timed step


def test_memory_budget_bounds_the_batch():
    model = _mlp()
    x = batch(4)[0]
    assert max_batch_for_memory(model, x, budget_bytes=1e9) > 100_000
    assert 1 <= max_batch_for_memory(model, x, budget_bytes=4 * 4 * 200 + 3 * 4 * 38 * 10) <= 20
    assert model.training  # modes restored


# ------------------------------------------------------------------ the cache
def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b"\x80\x04pickle",
        _nested(100_000),
        json.dumps({"format": 2, "key": "other", "min_batch_size": 1, "observations": []}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": 1, "observations": [[8, 1, "fast"]]}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": 1, "observations": [[-1, 1, 5.0]]}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": 1, "observations": [[8, 1, 1e300]]}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": 1, "observations": [[8, 1, 5.0]] * 2000}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": True, "observations": []}).encode(),
        json.dumps({"format": 2, "key": "KEY", "min_batch_size": 1, "observations": [], "extra": 1}).encode(),
    ],
    ids=[
        "not-json",
        "list",
        "pickle",
        "deeply-nested",
        "other-key",
        "string-rate",
        "negative-batch",
        "rate-1e300",
        "2000-points",
        "bool-min-batch",
        "unknown-field",
    ],
)
def test_corrupt_cache_file_warns_and_tunes_cold(tmp_path, fake_hardware, content):
    key = _tune(BatchSizeTuner(cache_dir=tmp_path)).key
    SurrogateCache(tmp_path).path(key).write_bytes(content.replace(b"KEY", key.encode()))
    fake_hardware.clear()
    with pytest.warns(TunerCacheWarning, match="ignoring corrupt tuner cache"):
        result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    assert not result.warm and len(fake_hardware) >= 3
    assert synthetic_throughput(result.batch_size) >= 0.9 * max(map(synthetic_throughput, result.candidates))
    assert SurrogateCache(tmp_path).load(key) is not None  # rewritten, readable again


def test_a_plausible_but_stale_cached_rate_does_not_pin_the_batch(tmp_path, fake_hardware):
    key = _tune(BatchSizeTuner(cache_dir=tmp_path)).key
    SurrogateCache(tmp_path).save(key, CachedSurface(1, [(4, 1, 9e8)]))  # passes validation, wildly wrong
    fake_hardware.clear()
    result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    assert not result.warm and result.batch_size != 4 and len(fake_hardware) >= 3
    assert all(rate < 1e6 for _, _, rate in SurrogateCache(tmp_path).load(key).observations)


@pytest.mark.parametrize("slow_checks, warm", [(1, True), (2, False)], ids=["burst", "lasting"])
def test_one_slow_check_is_rechecked_before_the_cache_is_dropped(tmp_path, monkeypatch, slow_checks, warm):
    probes = install_fake_hardware(monkeypatch, synthetic_throughput)
    cold = _tune(BatchSizeTuner(cache_dir=tmp_path))
    probes.clear()
    calls = []

    def measure(self, batch_size, **kwargs):  # the first ``slow_checks`` probes see a 4x slowdown
        calls.append(batch_size)
        return synthetic_throughput(batch_size) / (4 if len(calls) <= slow_checks else 1)

    monkeypatch.setattr(ProbeRunner, "measure", measure)
    result = _tune(BatchSizeTuner(cache_dir=tmp_path))
    assert result.warm == warm and calls[0] == calls[1]  # the same cached size checked twice
    assert len(calls) == 2 if warm else len(calls) >= 4  # a lasting change tunes cold
    assert synthetic_throughput(result.batch_size) >= 0.9 * synthetic_throughput(cold.batch_size)


def test_cache_path_that_is_a_folder_warns_and_tunes(tmp_path, fake_hardware):
    key = _tune(BatchSizeTuner(cache_dir=tmp_path / "a")).key
    SurrogateCache(tmp_path / "b").path(key).mkdir(parents=True)
    with pytest.warns(TunerCacheWarning) as record:
        result = _tune(BatchSizeTuner(cache_dir=tmp_path / "b"))
    assert result.batch_size >= 1 and not result.warm
    assert {"ignoring corrupt", "cannot write"} <= {" ".join(str(w.message).split()[:2]) for w in record}


@pytest.mark.parametrize("how", ["file-instead-of-folder", "unwritable"])
def test_unusable_cache_folder_warns_and_the_learner_still_tunes(tmp_path, fake_hardware, monkeypatch, how):
    cache_dir = tmp_path / "cache"
    if how == "file-instead-of-folder":
        cache_dir.write_text("not a folder")
    else:
        from taste_cl.tuning import cache as _tuner_cache

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(_tuner_cache, "atomic_write_bytes", refuse)
    learner = OnlineLearner(_mlp(), plugins=[BatchSizeTuner(cache_dir=cache_dir)])
    with pytest.warns(TunerCacheWarning, match="cannot write tuner cache"):
        stats = learner.observe(batch(10))
    assert learner.plugins[0].result_ is not None and stats.samples == 10


# ------------------------------------------------- learner: plan, LR, freshness
def _learner(**kwargs) -> OnlineLearner:
    model = _mlp()
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), replay=None, **kwargs)


def test_accumulated_micro_batches_match_one_large_step():
    large, accumulated = _learner(), _learner()
    accumulated.set_batch_plan(16, accumulation_steps=4)
    for seed in range(3):
        x, y = batch(64, seed=seed)
        a, b = large.observe((x, y)), accumulated.observe((x, y))
        assert (a.steps, b.steps, b.micro_batches, b.batch_size, b.pending) == (1, 1, 4, 16, 0)
    for p, q in zip(large.model.parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_lr_scale_is_applied_to_the_live_learning_rates():
    learner = _learner()
    learner.set_batch_plan(32, lr_scale=0.25)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    learner.set_batch_plan(32, lr_scale=2.0)  # the ratio of new to old factor, not compounded
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    learner.optimizer.param_groups[0]["lr"] = 0.05  # a scheduler decayed it meanwhile
    learner.set_batch_plan(None)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # decay kept, factor removed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_batch_size": 0}, "micro_batch_size == 0"),
        ({"micro_batch_size": 4, "accumulation_steps": 0}, "accumulation_steps == 0"),
        ({"micro_batch_size": 4, "lr_scale": math.inf}, "lr_scale == inf"),
        ({"micro_batch_size": 4, "lr_scale": -1.0}, "lr_scale"),
        ({"micro_batch_size": 4, "max_wait_samples": 0}, "max_wait_samples == 0"),
        ({"micro_batch_size": 4, "max_wait_s": math.nan}, "max_wait_s"),
    ],
)
def test_bad_batch_plans_change_nothing(kwargs, message):
    learner = _learner()
    learner.observe(batch(8))
    before = snapshot(learner)
    with pytest.raises(ValueError, match=message):
        learner.set_batch_plan(**kwargs)
    assert snapshot(learner) == before and learner.batch_plan is None


def test_stream_is_buffered_into_full_micro_batches_and_resumes_exactly(tmp_path):
    learner = _learner()
    learner.set_batch_plan(25, accumulation_steps=2)
    stats = [learner.observe(batch(10, seed=s)) for s in range(4)]  # 40 samples: one micro-batch of 25
    assert [s.micro_batches for s in stats] == [0, 0, 1, 0]
    assert [s.pending for s in stats] == [10, 20, 5, 15]
    assert sum(s.steps for s in stats) == 0 and learner.samples_seen == 40
    assert stats[0].loss is None and stats[0].accuracy is None and stats[2].loss is not None
    learner.save(tmp_path)  # 15 samples pending, one micro-batch accumulated
    model = _mlp()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for s in range(4, 8):
        assert learner.observe(batch(10, seed=s)).steps == resumed.observe(batch(10, seed=s)).steps
    assert snapshot(learner) == snapshot(resumed)
    assert learner.batch_plan == resumed.batch_plan


def test_freshness_bound_in_samples_forces_a_step_weighted_by_its_share():
    """A slow stream is not buffered into one giant step: after 20 waiting samples the learner
    steps on them, with the gradient weighted 20/100 of a full step (linear LR semantics)."""
    learner, reference = _learner(), _learner()
    reference.optimizer = torch.optim.SGD(reference.model.parameters(), lr=0.1 * 20 / 100, momentum=0.9)
    learner.set_batch_plan(100, max_wait_samples=20)
    first, second = learner.observe(batch(10, seed=0)), learner.observe(batch(10, seed=1))
    assert (first.steps, first.pending, second.steps, second.pending, second.batch_size) == (0, 10, 1, 0, 20)
    reference.observe((torch.cat([batch(10, seed=0)[0], batch(10, seed=1)[0]]), torch.cat([batch(10, seed=0)[1], batch(10, seed=1)[1]])))
    for p, q in zip(learner.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(p, q)


def test_freshness_bound_in_seconds(monkeypatch):
    from taste_cl.learner import batching

    now = [100.0]
    monkeypatch.setattr(batching.time, "monotonic", lambda: now[0])
    learner = _learner()
    learner.set_batch_plan(100, max_wait_s=5.0)
    assert learner.observe(batch(10, seed=0)).steps == 0
    now[0] += 4.0
    assert learner.observe(batch(10, seed=1)).steps == 0
    now[0] += 1.5  # the first samples have now waited 5.5 s
    stats = learner.observe(batch(10, seed=2))
    assert (stats.steps, stats.pending, stats.batch_size) == (1, 0, 30)


def test_replay_share_is_kept_inside_micro_batches():
    model = _mlp()
    learner = OnlineLearner(model, replay=ReservoirReplay(50), replay_batch_size=10)
    learner.observe(batch(10, seed=0))  # stream batch 10 + replay 10: half the micro-batch is replay
    learner.set_batch_plan(20)
    stats = learner.observe(batch(10, seed=1))
    assert (stats.micro_batches, stats.batch_size, stats.replay_samples) == (1, 20, 10)


def test_lr_rules():
    model = _mlp()
    sgd, adam = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())
    assert lr_scale_for(sgd, 4.0) == 4.0 and lr_scale_for(adam, 4.0) == 2.0
    assert lr_scale_for(adam, 4.0, "linear") == 4.0 and lr_scale_for(sgd, 4.0, "none") == 1.0
    assert lr_scale_for(sgd, 4.0, lambda r: r**0.25) == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="lr_rule returned"):
        lr_scale_for(sgd, 4.0, lambda r: -r)


# -------------------------------------------------------------- the plugin
def test_plugin_keeps_the_step_size_by_default_and_never_exceeds_the_effective_batch(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path)
    learner = OnlineLearner(_mlp(), replay=ReservoirReplay(100), plugins=[tuner])
    learner.observe(batch(10))
    assert learner.batch_plan is None  # its own step (10 stream + 10 replay) is also the fastest: nothing to change
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert tuner.history_[-1]["batch_size"] == 20 and tuner.result_.candidates[-1] == 20
    tuner = BatchSizeTuner(cache_dir=tmp_path, effective_batch_size=64)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    learner.observe(batch(10))
    assert tuner.result_.candidates[-1] == 64 and learner.batch_plan.micro_batch_size == 64  # peak near 80: capped
    assert learner.batch_plan.lr_scale == pytest.approx(6.4)  # SGD: linear from the reference batch 10


def test_plugin_splits_the_effective_batch_only_when_micro_batches_pay(tmp_path, monkeypatch):
    install_fake_hardware(monkeypatch, lambda b: 1000.0 * b / (b + 4) / (1 + (b / 32) ** 2))  # peaks near 12, falls after
    model = _mlp()
    tuner = BatchSizeTuner(cache_dir=tmp_path, effective_batch_size=256)
    learner = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), replay=None, plugins=[tuner])
    learner.observe(batch(10))
    micro, steps = learner.batch_plan.micro_batch_size, learner.batch_plan.accumulation_steps
    assert 8 <= micro <= 20 and 256 <= micro * steps < 256 + steps  # balanced micro-batches adding up to the effective batch
    assert learner.batch_plan.lr_scale == pytest.approx(math.sqrt(micro * steps / 10))  # Adam: square-root rule


def test_plugin_tunes_on_the_first_batch_and_retunes_on_drift(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=256, effective_batch_size=128)
    model = _mlp()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(100), plugins=[tuner])
    events = []
    learner.monitor.subscribe(events.append, event="retuned")
    learner.observe(batch(10, seed=0))
    plan = learner.batch_plan
    assert (plan.micro_batch_size, plan.accumulation_steps) == (128, 1)  # the curve's best (~80) is not 10 % faster than 128
    assert plan.lr_scale == pytest.approx(128 / 20)
    assert plan.max_wait_s == 1.0
    learner.monitor.emit("drift_detected")
    learner.monitor.dispatch()
    fake_hardware.clear()
    learner.observe(batch(10, seed=1))
    assert [h["reason"] for h in tuner.history_][-1].startswith("stream drift")
    assert tuner.history_[-1]["warm"] and len(fake_hardware) <= 1  # bounded retune cost
    assert [e.name for e in events] == ["retuned", "retuned"]


def test_step_lr_decay_survives_retunes(tmp_path, fake_hardware):
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    tuner = BatchSizeTuner(cache_dir=tmp_path, effective_batch_size=40, retune_every=2, min_retune_interval=0)
    learner = OnlineLearner(model, optimizer=optimizer, replay=None, plugins=[tuner])
    for i in range(6):
        learner.observe(batch(10, seed=i))
        scheduler.step()
    assert len(tuner.history_) == 4  # the first batch, then every 2 observes
    assert learner.batch_plan.lr_scale == pytest.approx(4.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 4.0 * 0.5**6)


def test_a_failing_tune_leaves_the_learner_unchanged_and_retries(tmp_path, monkeypatch):
    def broken(self, batch_size, **kwargs):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(ProbeRunner, "measure", broken)
    tuner = BatchSizeTuner(cache_dir=tmp_path)
    tuned, plain = _learner(plugins=[tuner]), _learner()
    rng = torch.get_rng_state()
    with pytest.warns(TuningWarning, match="probe exploded"):
        tuned.observe(batch(10, seed=0))
    assert torch.equal(torch.get_rng_state(), rng)  # this MLP draws no random numbers; the probes' draws were undone
    plain.observe(batch(10, seed=0))
    assert tuned.batch_plan is None and tuner.result_ is None
    mine, theirs = snapshot(tuned).state, snapshot(plain).state
    for part in ("model", "optimizer", "training", "counters", "rng"):
        assert states_equal(mine[part], theirs[part]), part
    monkeypatch.undo()
    install_fake_hardware(monkeypatch, synthetic_throughput)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        for seed in range(1, 4):
            tuned.observe(batch(10, seed=seed))
    assert tuner.result_ is not None and len(tuner.history_) == 2
    assert tuner.history_[0]["failed"].startswith("TuningError") and tuner.history_[-1]["reason"].startswith("retry")


def test_tune_threads_applies_the_fastest_thread_count(tmp_path, monkeypatch, restore_threads):
    from taste_cl.tuning import probe as _probe

    monkeypatch.setattr(_probe, "thread_options", lambda: [1, 2, 4])
    monkeypatch.setattr("taste_cl.tuning.tuner.thread_options", lambda: [1, 2, 4])
    seen = []

    def rate(batch_size, threads):
        return synthetic_throughput(batch_size) * {1: 1.0, 2: 1.6, 4: 0.7}[threads]

    def measure(self, batch_size, *, threads=None, **kwargs):
        seen.append(threads)
        return rate(batch_size, threads)

    def work(self, batch_size, steps, *, threads=None, **kwargs):  # the confirmation agrees with the probes
        return steps, steps * batch_size / rate(batch_size, threads)

    monkeypatch.setattr(ProbeRunner, "measure", measure)
    monkeypatch.setattr(ProbeRunner, "work", work)
    monkeypatch.setattr("taste_cl.tuning.tuner.LoadMeter.read", lambda self: 0.0)
    torch.set_num_threads(1)
    tuner = BatchSizeTuner(cache_dir=tmp_path, tune_threads=True, n_calls=12)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    learner.observe(batch(10))
    assert set(seen) == {1, 2, 4} and tuner.result_.threads == 2 and torch.get_num_threads() == 2
    seen.clear()
    warm = tuner.tune(learner.model, learner.optimizer, learner.loss_fn, batch(10), foreign_load=0.0)
    assert warm.warm and seen == [2]  # the cache key does not depend on the count the tuner set


def test_more_threads_with_slow_spells_lose_to_one_thread_over_the_same_work(tmp_path, monkeypatch, restore_threads):
    monkeypatch.setattr("taste_cl.tuning.tuner.thread_options", lambda: [1, 2])
    windows = []

    def measure(self, batch_size, *, threads=None, **kwargs):  # probes catch 2 threads in a good moment
        return synthetic_throughput(batch_size) * {1: 1.0, 2: 1.6}[threads]

    def work(self, batch_size, steps, *, threads=None, **kwargs):  # ... but one window in three is 100x slower
        windows.append(threads)
        slow = 100.0 if threads == 2 and windows.count(2) == 2 else 1.0
        return steps, slow * steps * batch_size / measure(self, batch_size, threads=threads)

    monkeypatch.setattr(ProbeRunner, "measure", measure)
    monkeypatch.setattr(ProbeRunner, "work", work)
    torch.set_num_threads(1)
    model = _mlp()
    tuner = BatchSizeTuner(cache_dir=tmp_path, tune_threads=True, n_calls=12)
    result = tuner.tune(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), batch(10), foreign_load=0.0)
    assert result.threads == 1 and windows.count(1) == windows.count(2) == 3
    assert result.samples_per_s == pytest.approx(synthetic_throughput(result.batch_size))


def test_plugin_detects_a_load_shift_from_step_times(tmp_path, fake_hardware, monkeypatch):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=64, calibration_window=4, retune_on_drift=False, min_retune_interval=0)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    monkeypatch.setattr(tuner._load_meter, "read", lambda: 0.0)
    learner.observe(batch(10, seed=0))
    micro = tuner.history_[-1]["batch_size"]

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


def test_load_shift_retunes_are_spaced_by_min_retune_interval(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=64, calibration_window=4, retune_on_drift=False, min_retune_interval=30)
    learner = OnlineLearner(_mlp(), replay=None, plugins=[tuner])
    learner.observe(batch(10, seed=0))
    micro = tuner.history_[-1]["batch_size"]

    def feed(seconds: float, times: int) -> None:
        for _ in range(times):
            tuner.after_observe(learner, ObserveStats(0.1, 1.0, micro, 0, micro, 1, seconds))

    feed(0.01, 4)  # baseline
    feed(0.03, 10)  # a shift, but inside the interval after the first tune: no retune yet
    assert len(tuner.history_) == 1
    feed(0.03, 20)  # the interval has passed: now it retunes, once
    assert len(tuner.history_) == 2 and tuner.history_[-1]["reason"].startswith("load shift")


def test_tuner_state_survives_learner_checkpoints(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path / "cache")
    learner = OnlineLearner(_mlp(), plugins=[tuner])
    learner.observe(batch(10))
    learner.save(tmp_path / "ckpt")
    (tmp_path / "cache").rename(tmp_path / "lost")  # the cache is gone on the new device
    restored = BatchSizeTuner(cache_dir=tmp_path / "cache")
    OnlineLearner.load(tmp_path / "ckpt", model=_mlp(), plugins=[restored])
    assert restored.result_ == tuner.result_ and list(restored.history_) == list(tuner.history_)
    assert restored.reference_ == 10
    assert SurrogateCache(tmp_path / "cache").load(tuner.result_.key) is not None  # cache rebuilt from the checkpoint


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"result": {"batch_size": 0}}, "exactly the keys"),
        ({"observes": -1}, "observes == -1"),
        ({"reference": 1.5}, "reference"),
        ({"history": "x"}, "history"),
        ({"extra": 1}, "must have keys"),
    ],
)
def test_bad_tuner_state_is_refused_before_anything_changes(tmp_path, fake_hardware, bad, message):
    tuner = BatchSizeTuner(cache_dir=tmp_path)
    OnlineLearner(_mlp(), plugins=[tuner]).observe(batch(10))
    state, before = tuner.state_dict(), tuner.state_dict()
    with pytest.raises(ValueError, match=message):
        tuner.load_state_dict({**state, **bad})
    assert tuner.state_dict() == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_calls": 0}, "n_calls == 0"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"effective_batch_size": 0}, "effective_batch_size"),
        ({"load_tolerance": 0}, "load_tolerance"),
        ({"lr_rule": "cubic"}, "lr_rule"),
        ({"max_wait_s": -1.0}, "max_wait_s"),
        ({"max_wait_samples": 1.5}, "max_wait_samples"),
    ],
)
def test_bad_tuner_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchSizeTuner(**kwargs)


def test_warm_tune_with_every_candidate_cached_re_measures_instead_of_crashing(tmp_path, fake_hardware):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=8, per_octave=1, warm_calls=2)
    cold = _tune(tuner)
    threads = torch.get_num_threads()
    SurrogateCache(tmp_path).save(cold.key, CachedSurface(1, [(b, threads, synthetic_throughput(b)) for b in (1, 2, 4, 8)]))
    fake_hardware.clear()
    warm = _tune(tuner)
    assert warm.warm and len(fake_hardware) == 2 and warm.batch_size == cold.batch_size


# ---------------------------------------------- the README quick-start stream
def _readme_accuracy(seed: int, tuner: BatchSizeTuner | None, tasks) -> float:
    from taste_cl.monitor.evaluation import accuracy

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    learner = OnlineLearner(
        model,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        replay=ReservoirReplay(capacity=200, seed=seed),
        replay_batch_size=10,
        train_iterations=3,
        plugins=[tuner] if tuner else [],
    )
    for task in tasks:
        for start in range(0, len(task.y_train), 10):
            learner.observe((task.x_train[start : start + 10], task.y_train[start : start + 10]))
    x = torch.cat([t.x_test for t in tasks])
    y = torch.cat([t.y_test for t in tasks])
    return accuracy(learner.predict, x, y)


README_MACHINES = {  # samples/s per batch size: the fastest is the learner's own step (20), half of it, or one sample
    "own-step-fastest": lambda b: 1000.0 * b / (b + 8),
    "halves-fastest": lambda b: 1000.0 / (1 + math.log2(b / 10) ** 2),
    "singles-fastest": lambda b: 1000.0 / math.sqrt(b),
}


@pytest.fixture(scope="module")
def readme_plain(digits_tasks):
    return [_readme_accuracy(seed, None, digits_tasks) for seed in range(4)]


@pytest.mark.parametrize(
    "machine, plan",
    [
        ("own-step-fastest", (None, 1)),
        ("halves-fastest", (10, 2)),
        ("singles-fastest", (2, 10)),  # a micro-batch of 1 would hold no replayed sample: 2 is the smallest that does
    ],
)
def test_readme_stream_with_the_tuner_stays_within_one_point_of_no_tuner(tmp_path, monkeypatch, digits_tasks, readme_plain, machine, plan):
    """The tuner changes how a step is computed, not what it is: whichever plan the machine makes fastest, the
    README's stream learns as well as without it. The probes'
    rates are injected, so the plan does not depend on how busy the test machine is: with real probes an idle
    machine keeps the learner's own step, a loaded one has made micro-batches of 10 or 1 fastest."""
    install_fake_hardware(monkeypatch, README_MACHINES[machine])
    tuners = [BatchSizeTuner(cache_dir=tmp_path, min_retune_interval=10_000) for _ in range(4)]  # no retune from real step times
    tuned = [_readme_accuracy(seed, tuner, digits_tasks) for seed, tuner in enumerate(tuners)]
    assert {(h["micro_batch_size"], h["accumulation_steps"]) for t in tuners for h in t.history_} == {plan}
    if plan == (None, 1):  # the learner's own step, and probes on copies with the RNG restored: bit for bit the same learning
        assert tuned == readme_plain
    assert abs(sum(tuned) / 4 - sum(readme_plain) / 4) <= 0.01, (readme_plain, tuned)
    assert all(abs(t - p) <= 0.02 for t, p in zip(tuned, readme_plain)), (readme_plain, tuned)


def test_probes_train_on_targets_shaped_like_the_learners_and_refuse_broadcasting(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(12, 4), torch.randn(12)
    runner = ProbeRunner(model, optimizer, nn.MSELoss(), (x, y))
    assert runner.samples[1].shape == (12, 1) and torch.equal(runner.samples[1][:, 0], y) and y.shape == (12,)
    assert runner.model.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no broadcast warning from the probes' loss
        result = _quick(tmp_path, max_batch_size=8).tune(model, optimizer, nn.MSELoss(), (x, y))
    assert 1 <= result.batch_size <= 8
    with pytest.raises(InvalidBatchError, match="no broadcasting"):
        BatchSizeTuner(cache_dir=tmp_path).tune(model, optimizer, nn.MSELoss(), (x, torch.randn(12, 3)))
    classifier = nn.Linear(4, 3)
    with pytest.raises(InvalidBatchError, match="out of range"):  # class labels are checked too
        ProbeRunner(classifier, torch.optim.SGD(classifier.parameters(), lr=0.1), nn.CrossEntropyLoss(), (x, torch.full((12,), 5)))


@pytest.mark.parametrize(("replay_batch_size", "plan"), [(0, (5, 2)), (10, (10, 2)), (10, (2, 10)), (30, (4, 10)), (4, (4, 3)), (10, (7, 3))])
def test_plan_passes_take_the_learners_own_steps(replay_batch_size: int, plan: tuple[int, int]) -> None:
    """With ``train_iterations=3`` each pass over an observe's micro-batches is one optimizer step, as the
    learner's own step: the plan draws the pass's replayed rows at once, as the learner does, so its
    parameters equal the unplanned learner's up to float rounding, short batches included. The plan
    (4, 3) beside replay 4 does not tile the stream batch of 10 (3 stream + 1 replayed per micro-batch:
    4 micro-batches, the last 1 + 1): its 4 micro-batches are still one window, not a window of 3 and
    a second, smaller step. The plan (7, 3) is the tuner's split of 20 rows (``split_plan`` rounds the
    micro-batch up to 3 x 7 = 21): still one observe's window, not samples left waiting."""

    def learner() -> OnlineLearner:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        replay = ReservoirReplay(capacity=100, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return OnlineLearner(model, optimizer=optimizer, replay=replay, replay_batch_size=replay_batch_size, train_iterations=3)

    own, planned = learner(), learner()
    data = torch.Generator().manual_seed(1)
    for i in range(30):
        n = 3 if i % 7 == 6 else 10  # a short batch (a task's last) is stepped on in its own observe
        batch = (torch.randn(n, 8, generator=data), torch.randint(0, 4, (n,), generator=data))
        if i == 1:  # once the buffer holds rows: the plan's micro-batches keep the learner's stream:replay ratio
            planned.set_batch_plan(plan[0], accumulation_steps=plan[1])
        assert own.observe(batch).steps == planned.observe(batch).steps == 3
    for (name, a), b in zip(own.model.named_parameters(), planned.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_tuner_never_plans_a_micro_batch_without_replay() -> None:
    from taste_cl.learner.batching import replaying_micro_batch

    assert [replaying_micro_batch(10, r) for r in (0, 10, 5, 2)] == [1, 2, 2, 4]  # shares 0, 1/2, 1/3, 1/6 (3 x 1/6 rounds to 0)
