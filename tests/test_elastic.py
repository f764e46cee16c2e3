"""Tests of taste_cl.elastic: DP selector, profiler cache, importance, the ElasticTrainer plugin."""

from __future__ import annotations

import copy
import itertools
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from taste_cl import ElasticTrainer, OnlineLearner
from taste_cl.elastic import (
    GradientImportance,
    TensorProfile,
    load_or_profile,
    profile_tensors,
    select_tensors,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _mlp(hidden: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 6)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _cost(selected: tuple[int, ...], weights: list[int], acts: list[int]) -> int:
    return sum(weights[i] for i in selected) + sum(acts[min(selected) + 1 :]) if selected else 0


# ------------------------------------------------------------------ DP selector
@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 7).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(0, 10), min_size=n, max_size=n),
            st.lists(st.integers(0, 12), min_size=n, max_size=n),
            st.lists(st.integers(0, 12), min_size=n, max_size=n),
        )
    ),
    st.integers(1, 40),
)
def test_select_tensors_is_optimal_like_brute_force(case, budget):
    importance, weights, acts = case
    n = len(importance)
    feasible = [s for r in range(1, n + 1) for s in itertools.combinations(range(n), r) if _cost(s, weights, acts) <= budget]
    chosen = select_tensors(importance, [float(w) for w in weights], [float(a) for a in acts], float(budget), resolution=budget)
    if not feasible:
        assert chosen == []
        return
    assert chosen == sorted(chosen) and _cost(tuple(chosen), weights, acts) <= budget
    best = max(sum(importance[i] for i in s) for s in feasible)
    assert sum(importance[i] for i in chosen) == pytest.approx(best, abs=1e-9)


def test_select_tensors_prefers_late_units_when_early_backward_is_expensive():
    # unit 0 is important but reaching it costs the activation gradients of 1 and 2
    times = ([1.0, 1.0, 1.0], [0.0, 4.0, 4.0])
    assert select_tensors([5.0, 1.0, 1.0], *times, 5.5) == [2]
    assert select_tensors([5.0, 1.0, 1.0], *times, 9.5) == [0]
    assert select_tensors([5.0, 1.0, 1.0], *times, 11.5) == [0, 1, 2]
    assert select_tensors([5.0, 1.0, 1.0], *times, 0.5) == []


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1.0], [1.0, 2.0], [0.0], 1.0), r"`weight_grad_s` must have one value per unit \(1\); got 2"),
        (([-1.0], [1.0], [0.0], 1.0), "`importance` must hold finite numbers >= 0; got -1.0"),
        (([1.0], [float("nan")], [0.0], 1.0), "`weight_grad_s` must hold finite"),
        (([1.0], [1.0], [0.0], 0.0), r"`budget_s == 0.0`, must be a number > 0"),
    ],
)
def test_select_tensors_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        select_tensors(*args)


# ------------------------------------------------------------------ profiler
def test_profile_lists_units_in_execution_order_and_leaves_model_untouched():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    before, x = copy.deepcopy(model.state_dict()), torch.randn(8, 1, 8, 8)
    rng = torch.get_rng_state()
    profile = profile_tensors(model, x, warmup=1, repeats=2, granularity="module")
    assert profile.units == ["0", "1", "4"]
    assert profile_tensors(model, x, warmup=0, repeats=2).units == ["0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"]
    assert all(t > 0 for t in profile.weight_grad_s) and profile.forward_s > 0 and profile.backward_s > 0
    assert profile.act_grad_s[2] > 0  # linear + flatten + relu backward, spent when anything earlier trains
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm stats restored
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert profile.step_s([2]) < profile.full_step_s
    assert TensorProfile.from_dict(profile.to_dict()) == profile


def test_profile_cache_hits_and_invalidates_when_model_or_batch_changes(tmp_path):
    x = torch.randn(8, 6)
    _, cached = load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2)
    assert not cached
    profile, cached = load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2)
    assert cached and profile.units == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert not load_or_profile(_mlp(hidden=17), x, cache_dir=tmp_path, warmup=0, repeats=2)[1]
    assert not load_or_profile(_mlp(), torch.randn(9, 6), cache_dir=tmp_path, warmup=0, repeats=2)[1]
    assert load_or_profile(_mlp(hidden=17), x, cache_dir=tmp_path, warmup=0, repeats=2)[1]
    assert not load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2, refresh=True)[1]


def test_cpu_clock_profiles_are_their_own_cache_entries_and_old_profiles_read_as_wall(tmp_path):
    x = torch.randn(8, 6)
    wall, _ = load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2)
    cpu, cached = load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2, clock="cpu")
    assert (wall.clock, cpu.clock, cached) == ("wall", "cpu", False)
    assert load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2, clock="cpu") == (cpu, True)
    assert all(t > 0 for t in (cpu.forward_s, cpu.backward_s))
    state = wall.to_dict()
    del state["clock"]  # a checkpoint written before profiles named their clock
    assert TensorProfile.from_dict(state) == wall
    with pytest.raises(ValueError, match=r"`clock == 'sundial'`"):
        profile_tensors(_mlp(), x, clock="sundial")


def test_closed_loop_times_the_forward_of_every_step_and_leaves_no_hook(tmp_path, monkeypatch):
    from taste_cl.elastic import StepTimeModel

    seen = []
    monkeypatch.setattr(StepTimeModel, "observe_forward", lambda self, s: seen.append(s))
    learner, elastic = _learner(tmp_path, rho=0.7, reselect_every=3)
    for _ in range(5):
        learner.observe(_batch())
    assert len(seen) == 5 and all(s > 0 for s in seen)
    assert not learner.model._forward_hooks  # removed as soon as it fired: a deep copy of the model stays plain
    copy.deepcopy(learner.model)


def test_profile_cache_default_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TASTE_CL_CACHE_DIR", str(tmp_path / "cache"))
    elastic = ElasticTrainer(reselect_every=3)  # cache_dir="default"
    learner = OnlineLearner(_mlp(), plugins=[elastic])
    learner.observe(_batch())
    assert (tmp_path / "cache" / "elastic_profiles.json").is_file()


# ------------------------------------------------------------------ importance
def test_gradient_importance_is_grad_times_update_and_zero_for_unused_units():
    torch.manual_seed(1)
    used, unused = nn.Linear(4, 2), nn.Linear(4, 2)
    optimizer = torch.optim.SGD([*used.parameters(), *unused.parameters()], lr=0.5)
    estimator = GradientImportance([list(used.parameters()), list(unused.parameters())])
    estimator.arm()
    x = torch.randn(8, 4)
    loss = (used(x) ** 2).mean() + 0.0 * unused(x).sum()
    loss.backward()
    grads = [p.grad.clone() for p in used.parameters()]
    optimizer.step()
    scores = estimator.collect()
    assert scores[1] == 0.0
    assert scores[0] == pytest.approx(sum(float((0.5 * g * g).sum()) for g in grads), rel=1e-5)
    assert estimator.collect() is None and not estimator.armed  # hooks removed


# ------------------------------------------------------------------ plugin
def _learner(tmp_path, **kwargs) -> tuple[OnlineLearner, ElasticTrainer]:
    model = _mlp()
    elastic = ElasticTrainer(cache_dir=tmp_path, warmup=0, repeats=2, **{"granularity": "module", "tolerance": 1e9, **kwargs})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return OnlineLearner(model, optimizer=optimizer, plugins=[elastic]), elastic


def test_removed_and_readded_unit_resumes_with_its_optimizer_state(tmp_path):
    learner, elastic = _learner(tmp_path, rho=1.0, reselect_every=1000)
    learner.observe(_batch())
    learner.observe(_batch())
    first = learner.model[0].weight
    buffer = learner.optimizer.state[first]["momentum_buffer"]
    kept_buffer, kept_weight = buffer.clone(), first.detach().clone()
    elastic.apply_selection(["4"])
    for _ in range(3):
        learner.observe(_batch())
    assert torch.equal(learner.optimizer.state[first]["momentum_buffer"], kept_buffer)
    assert torch.equal(first.detach(), kept_weight)
    assert learner.model[4].weight.requires_grad and not first.requires_grad
    elastic.apply_selection(["0", "2", "4"])
    x, y = _batch()
    reference = copy.deepcopy(learner.model)
    nn.functional.cross_entropy(reference(x), y).backward()
    learner.observe((x, y))
    state = learner.optimizer.state[first]["momentum_buffer"]
    assert state is buffer  # the same buffer, not rebuilt
    assert torch.allclose(state, 0.9 * kept_buffer + reference[0].weight.grad, atol=1e-6)


def test_reset_drops_a_leaving_units_optimizer_state_and_it_rejoins_fresh(tmp_path):
    learner, elastic = _learner(tmp_path, rho=1.0, reselect_every=1000, optimizer_state="reset")
    learner.observe(_batch())
    learner.observe(_batch())
    first, last = learner.model[0].weight, learner.model[4].weight
    kept = learner.optimizer.state[last]["momentum_buffer"].clone()
    elastic.apply_selection(["4"])
    assert first not in learner.optimizer.state and last in learner.optimizer.state  # freed as it left
    elastic.apply_selection(["4"])  # staying out, or staying in, changes nothing
    learner.observe(_batch())
    assert first not in learner.optimizer.state and not torch.equal(learner.optimizer.state[last]["momentum_buffer"], kept)
    elastic.apply_selection(["0", "2", "4"])
    x, y = _batch()
    reference = copy.deepcopy(learner.model)
    nn.functional.cross_entropy(reference(x), y).backward()
    before = first.detach().clone()
    learner.observe((x, y))
    # rejoined as a fresh parameter: SGD's buffer starts at the gradient, the step is lr * grad
    assert torch.allclose(learner.optimizer.state[first]["momentum_buffer"], reference[0].weight.grad, atol=1e-6)
    assert torch.allclose(first.detach(), before - 0.1 * reference[0].weight.grad, atol=1e-6)


def test_optimizer_state_policy_is_checked():
    with pytest.raises(ValueError, match="optimizer_state == 'drop'.*'keep', 'reset'"):
        ElasticTrainer(optimizer_state="drop")


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_backward_stops_at_the_earliest_trainable_unit(tmp_path):
    learner, elastic = _learner(tmp_path, rho=1.0, reselect_every=1000)
    learner.observe(_batch())
    calls = dict.fromkeys(("0", "2", "4"), 0)
    for name in list(calls):
        learner.model[int(name)].register_full_backward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
    elastic.apply_selection(["4"])
    learner.observe(_batch())
    assert calls == {"0": 0, "2": 0, "4": 1}
    elastic.apply_selection(["2"])
    learner.observe(_batch())
    assert calls == {"0": 0, "2": 1, "4": 2}


def test_plugin_selects_within_budget_trains_and_survives_checkpoints(tmp_path):
    learner, elastic = _learner(tmp_path, rho=0.7, reselect_every=5)
    accuracies = [learner.observe(_batch()).accuracy for _ in range(60)]
    assert sum(accuracies[-10:]) / 10 > sum(accuracies[:10]) / 10 + 0.15
    assert elastic.probes_ == 12 and elastic.importance_ is not None
    timing = elastic.timing_
    index = [elastic.profile_.units.index(n) for n in elastic.selected]
    overhead = timing.corrected_costs()[0]  # optimizer and bookkeeping: not part of the budget
    assert timing.predict(index) - overhead <= 0.7 * (timing.predict(range(3)) - overhead) + 1e-12
    assert elastic.predicted_speedup() > 1
    learner.save(tmp_path / "ckpt")
    model = _mlp()
    restored = ElasticTrainer(cache_dir=tmp_path, rho=0.7, reselect_every=5, granularity="module")
    loaded = OnlineLearner.load(
        tmp_path / "ckpt", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        plugins=[restored],
    )
    assert restored.selected == elastic.selected and restored.importance_ == elastic.importance_
    assert restored.profile_ == elastic.profile_
    trainable = {name for name, m in loaded.model.named_children() if any(p.requires_grad for p in m.parameters())}
    assert trainable == set(elastic.selected)
    loaded.observe(_batch())


def test_drift_raises_the_budget_for_a_while_then_returns(tmp_path):
    learner, elastic = _learner(tmp_path, rho=0.5, drift_rho=0.9, drift_steps=2, reselect_every=100)
    learner.observe(_batch())
    learner.observe(_batch())
    probes = elastic.probes_
    learner.monitor.emit("drift_detected", loss=9.0)
    learner.monitor.dispatch()
    assert elastic.current_rho == 0.9
    learner.observe(_batch())  # probe at the raised budget
    assert elastic.probes_ == probes + 1
    learner.observe(_batch())
    assert elastic.current_rho == 0.5
    learner.observe(_batch())  # probe again, back at rho
    assert elastic.probes_ == probes + 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rho": 0.0}, r"`rho == 0.0`, must be a number > 0 and <= 1.0"),
        ({"rho": 1.5}, r"`rho == 1.5`, must be a number > 0 and <= 1.0"),
        ({"reselect_every": 0}, r"`reselect_every == 0`, must be an int >= 1"),
        ({"rho": 0.6, "drift_rho": 0.5}, r"`drift_rho == 0.5`, must be >= rho \(0.6\)"),
        ({"warmup": -1}, r"`warmup == -1`, must be an int >= 0"),
        ({"clock": "sundial"}, r"`clock == 'sundial'`, must be one of \('wall', 'cpu'\)"),
    ],
)
def test_elastic_trainer_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElasticTrainer(**kwargs)


def test_apply_selection_rejects_unknown_units(tmp_path):
    learner, elastic = _learner(tmp_path)
    with pytest.raises(RuntimeError, match="no profile yet"):
        elastic.apply_selection(["0"])
    learner.observe(_batch())
    with pytest.raises(ValueError, match=r"unknown units \['9'\]"):
        elastic.apply_selection(["9"])


def test_elastic_reprofiles_at_the_tuned_batch_after_each_retune(tmp_path, monkeypatch):
    from helpers import fake_hardware

    from taste_cl.tuning.tuner import BatchSizeTuner

    fake_hardware(monkeypatch, lambda b: 1000.0 * b / (b + 8) / (1 + (b / 40) ** 2))
    elastic = ElasticTrainer(rho=0.5, cache_dir=tmp_path)
    tuner = BatchSizeTuner(max_batch_size=128, cache_dir=tmp_path)
    sizes = []
    original = elastic.reprofile
    monkeypatch.setattr(elastic, "reprofile", lambda batch_size=None, **k: sizes.append(batch_size) or original(batch_size, **k))
    model = _mlp()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic, tuner])
    learner.observe(_batch())
    assert sizes[-1] == tuner.history_[-1]["batch_size"]  # the micro-batch now trained on
    learner.monitor.emit("drift_detected")
    learner.monitor.dispatch()
    for _ in range(3):
        learner.observe(_batch())
    assert len(tuner.history_) == 2 and sizes[-1] == tuner.history_[-1]["batch_size"]


# ------------------------------------------------------------------ robust profiling
def test_robust_estimate_rejects_outliers_and_gives_a_confidence_interval():
    from taste_cl.elastic.profiling import robust_estimate

    estimate, ci = robust_estimate([1.0, 1.02, 0.98, 1.01, 0.99, 50.0, 1.0])
    assert estimate == pytest.approx(1.0, abs=0.011) and 0 < ci < 0.05
    assert robust_estimate([2.0, 2.0, 2.0]) == (2.0, 0.0)


def test_noisy_profile_is_remeasured_up_to_max_rounds_then_flagged_and_warned(tmp_path):
    x = torch.randn(8, 6)
    calm = profile_tensors(_mlp(), x, warmup=0, repeats=2, max_rounds=8, tolerance=1e9)
    assert calm.rounds == 2 and not calm.noisy
    noisy = profile_tensors(_mlp(), x, warmup=0, repeats=2, max_rounds=6, tolerance=1e-12)
    assert noisy.rounds == 6 and noisy.noisy  # 2 -> 4 -> 6 rounds, bounded
    assert len(noisy.weight_grad_ci) == len(noisy.units) and noisy.relative_noise() > 1e-12
    elastic = ElasticTrainer(cache_dir=None, warmup=0, repeats=2, max_rounds=2, tolerance=1e-12)
    with pytest.warns(RuntimeWarning, match="too noisy to separate units after 2 rounds"):
        OnlineLearner(_mlp(), plugins=[elastic]).observe(_batch())
    assert elastic.profile_.noisy


def test_tensor_units_train_a_bias_without_its_weight(tmp_path):
    model = _mlp()
    elastic = ElasticTrainer(cache_dir=tmp_path, warmup=0, repeats=2, rho=1.0, reselect_every=1000)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic])
    learner.observe(_batch())
    assert elastic.profile_.units == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert elastic.profile_.act_grad_s[1] == 0 and elastic.profile_.act_grad_s[3] == 0  # one act pass per module
    elastic.apply_selection(["2.bias", "4.weight"])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    learner.observe(_batch())
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())}
    assert changed == {"2.bias", "4.weight"}


# ------------------------------------------------------------------ memory
def _mem_cost(selected, weights, acts):
    return sum(weights[i] for i in selected) + sum(acts[min(selected) + 1 :]) if selected else 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(*[st.lists(st.integers(0, 6), min_size=n, max_size=n) for _ in range(5)])
    ),
    st.integers(1, 12),
    st.integers(1, 12),
)
def test_select_tensors_respects_time_and_memory_like_brute_force(case, budget, memory):
    importance, weights, acts, w_mem, a_mem = case
    chosen = select_tensors(
        [float(v) for v in importance], weights, acts, float(budget), resolution=budget,
        weight_bytes=w_mem, act_bytes=a_mem, budget_bytes=float(memory), memory_resolution=memory,
    )  # fmt: skip
    assert _mem_cost(chosen, weights, acts) <= budget and _mem_cost(chosen, w_mem, a_mem) <= memory
    n = len(importance)
    best = max(
        (sum(importance[i] for i in s) for r in range(1, n + 1) for s in itertools.combinations(range(n), r)
         if _mem_cost(s, weights, acts) <= budget and _mem_cost(s, w_mem, a_mem) <= memory),
        default=None,
    )  # fmt: skip
    assert (best is None and chosen == []) or sum(importance[i] for i in chosen) == best


def test_memory_estimate_matches_the_measured_training_memory():
    from taste_cl.elastic import measure_training_memory

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))  # fmt: skip
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = profile_tensors(model, x, warmup=0, repeats=2)
    for selected in (["7.weight", "7.bias"], ["3.weight", "7.weight"], profile.units):
        index = [profile.units.index(u) for u in selected]
        for name, p in model.named_parameters():
            p.requires_grad_(name in selected)
        measured = measure_training_memory(model, x, y, nn.functional.cross_entropy, optimizer)
        estimate = profile.memory_bytes(index, state_factor=2.0)
        assert measured["grads"] == sum(profile.param_bytes[i] for i in index)
        # the loss's own saved tensors (log-softmax, targets) are not in the estimate: a few hundred bytes here
        # conservative: a tensor two ops keep (a ReLU's output, the next conv's input) is counted twice
        assert measured["total"] - 1024 <= estimate <= 3 * measured["total"] + 1024, (selected, estimate, measured)
    assert all(p.grad is None for p in model.parameters())  # measured on a copy


def test_plugin_keeps_the_selection_within_a_memory_budget(tmp_path):
    from taste_cl.elastic import measure_training_memory

    model = _mlp(hidden=64)
    budget = 3000
    elastic = ElasticTrainer(cache_dir=tmp_path, warmup=0, repeats=2, rho=1.0, reselect_every=3, memory_budget_bytes=budget)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=[elastic])
    for _ in range(4):
        learner.observe(_batch())
    assert elastic.selected and elastic.memory_estimate() <= budget
    assert measure_training_memory(model, *_batch(), nn.functional.cross_entropy, optimizer)["total"] <= budget


# ------------------------------------------------------------------ closed loop
def test_step_time_model_learns_overhead_and_scale_from_measured_steps():
    from taste_cl.elastic import StepTimeModel

    profile = TensorProfile(
        units=["a", "b", "c"], weight_grad_s=[4.0, 2.0, 1.0], act_grad_s=[0.0, 3.0, 1.0], forward_s=3.0, backward_s=11.0,
        weight_grad_ci=[0.0] * 3, act_grad_ci=[0.0] * 3, forward_ci=0.0, param_bytes=[1] * 3, input_bytes=[1] * 3,
        act_bytes=[1] * 3,
    )  # fmt: skip
    truth = lambda s: 2.0 + 1.5 * profile.step_s(s)
    model = StepTimeModel(profile)
    selections = [[2], [1, 2], [0, 1, 2], [1], [2]]
    before = [abs(model.predict(s) - truth(s)) / truth(s) for s in selections]
    model.observe_forward(1.5 * profile.forward_s)
    model.observe_full(truth([0, 1, 2]))
    for s in selections * 3:
        model.observe(s, truth(s))
    after = [abs(model.predict(s) - truth(s)) / truth(s) for s in selections]
    assert max(after) < 0.05 < min(before)
    assert model.overhead * profile.full_step_s == pytest.approx(2.0, abs=0.5)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_plugin_reports_prediction_error_before_and_after_correction(tmp_path, clock):
    learner, elastic = _learner(tmp_path, rho=0.7, reselect_every=4, check_steps=2, clock=clock)
    for _ in range(16):
        learner.observe(_batch())
    assert elastic.profile_.clock == clock
    errors = elastic.prediction_errors()
    assert errors["windows"] >= 2 and errors["raw"] >= 0 and errors["corrected"] >= 0
    row = elastic.predictions_[0]
    assert set(row) == {"units", "raw_s", "predicted_s", "measured_s", "step"} and row["measured_s"] > 0


# ------------------------------------------------------------------ untrusted cache (issue 15, class 5)
def _good_entry(tmp_path):
    x = torch.randn(8, 6)
    load_or_profile(_mlp(), x, cache_dir=tmp_path, warmup=0, repeats=2)
    path = tmp_path / "elastic_profiles.json"
    return path, json.loads(path.read_text())


def _corrupt(field, value):
    def apply(payload):
        for entry in payload["profiles"].values():
            entry[field] = value(entry[field]) if callable(value) else value
        return json.dumps(payload)

    return apply


def _deep(payload):
    return '{"format": 2, "profiles": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize(
    "corruption",
    [
        _corrupt("weight_grad_s", lambda v: [-1.0] * len(v)),
        _corrupt("forward_s", float("inf")),  # json writes Infinity
        _corrupt("act_grad_s", lambda v: ["fast"] * len(v)),
        _corrupt("units", lambda v: ["nope"] + v[1:]),
        _corrupt("units", "0.weight"),
        _corrupt("param_bytes", lambda v: [True] * len(v)),
        _corrupt("input_bytes", lambda v: v[:-1]),
        _corrupt("noisy", "no"),
        _corrupt("forward_s", 1e300),
        lambda payload: json.dumps({**payload, "profiles": dict.fromkeys(payload["profiles"])}),
        lambda payload: json.dumps({**payload, "profiles": []}),
        _deep,
        lambda payload: "{" + " " * (5 * 1024 * 1024) + "}",
        lambda payload: "\x00garbage",
    ],
    ids=[
        "negative", "infinite", "wrong-type", "unknown-unit", "units-not-list", "bool-bytes", "short-list",
        "noisy-type", "absurd", "entry-null", "profiles-list", "deep-json", "oversize", "garbage",
    ],
)
def test_corrupt_profile_cache_warns_and_recomputes(tmp_path, corruption):
    path, payload = _good_entry(tmp_path)
    path.write_text(corruption(payload))
    with pytest.warns(RuntimeWarning, match="elastic profile cache"):
        profile, cached = load_or_profile(_mlp(), torch.randn(8, 6), cache_dir=tmp_path, warmup=0, repeats=2)
    assert not cached and all(t >= 0 for t in profile.weight_grad_s)
    assert load_or_profile(_mlp(), torch.randn(8, 6), cache_dir=tmp_path, warmup=0, repeats=2)[1]  # rewritten, valid


def test_observe_survives_a_corrupt_cache_and_unusable_cache_paths(tmp_path):
    _learner(tmp_path)[0].observe(_batch())
    path = tmp_path / "elastic_profiles.json"
    path.write_text(_corrupt("weight_grad_s", lambda v: [-5.0] * len(v))(json.loads(path.read_text())))
    learner, elastic = _learner(tmp_path)
    with pytest.warns(RuntimeWarning, match="invalid"):
        learner.observe(_batch())
    assert all(t >= 0 for t in elastic.profile_.weight_grad_s)
    (tmp_path / "as_dir").mkdir()
    (tmp_path / "as_dir" / "elastic_profiles.json").mkdir()  # the cache file is a directory
    (tmp_path / "a_file").write_text("x")  # the cache dir is a file
    for cache_dir in (tmp_path / "as_dir", tmp_path / "a_file"):
        learner, elastic = _learner(cache_dir)
        with pytest.warns(RuntimeWarning, match="elastic profile cache"):
            learner.observe(_batch())
        assert elastic.profile_ is not None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"steps": -1}, r"`steps == -1`, must be an int >= 0"),
        ({"selected": ["9"]}, "`selected` must name units"),
        ({"importance": [1.0]}, "`importance` must be 3 finite"),
        ({"profile": {"units": ["0"]}}, "profile field"),
        ({"probe_now": "yes"}, "`probe_now` must be a bool"),
        ({"profile": "cpu clock"}, "a 'cpu'-clock profile, this trainer clock 'wall'"),
    ],
)
def test_load_state_dict_validates_everything_before_changing_anything(tmp_path, change, match):
    learner, elastic = _learner(tmp_path, rho=0.7, reselect_every=2)
    for _ in range(3):
        learner.observe(_batch())
    state = elastic.state_dict()
    if change.get("profile") == "cpu clock":
        change = {"profile": {**state["profile"], "clock": "cpu"}}
    before = (copy.deepcopy(elastic.state_dict()), [p.requires_grad for p in learner.model.parameters()])
    with pytest.raises(ValueError, match=match):
        elastic.load_state_dict({**state, **change})
    after = (elastic.state_dict(), [p.requires_grad for p in learner.model.parameters()])
    assert after[1] == before[1] and after[0]["selected"] == before[0]["selected"] and after[0]["profile"] == before[0]["profile"]


# ------------------------------------------------------------------ the zoo
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "batchnorm_mlp", "lstm"])
def test_elastic_trains_zoo_models_within_budget(name):
    from zoo import ZOO

    model, loss_fn, optimizer = ZOO[name].build()
    elastic = ElasticTrainer(rho=0.5, reselect_every=2, cache_dir=None, warmup=0, repeats=2, max_rounds=2, check_steps=1)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[elastic])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(4):
            learner.observe(ZOO[name].batch(8, seed=seed))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert elastic.selected and trainable == set(elastic.selected) and elastic.memory_estimate() > 0
    if len(elastic.selected) == len(elastic.profile_.units):
        # on 8-row batches the forward pass can take over half a step: no selection can meet
        # rho, so every trainable unit trains, and the trainer says so
        assert any("no selection of the trainable units fits rho=0.5" in str(w.message) for w in caught)
    else:
        assert elastic.predicted_speedup() > 1


def test_profile_takes_dict_inputs_of_the_text_transformer():
    from zoo import ZOO

    model, _, _ = ZOO["text_transformer"].build()
    x, _ = ZOO["text_transformer"].batch(4)
    profile = profile_tensors(model, x, warmup=0, repeats=2)
    assert profile.units[0] == "embed.weight" and profile.units[-1] == "head.bias"
    assert all(t >= 0 for t in profile.weight_grad_s) and profile.forward_s > 0
