"""Tests of taste_cl.elastic: DP selector, profiler cache, importance, the ElasticTrainer plugin."""

from __future__ import annotations

import copy
import itertools

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
    elastic = ElasticTrainer(cache_dir=tmp_path, warmup=0, repeats=2, **{"granularity": "module", **kwargs})
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


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_backward_stops_at_the_earliest_trainable_unit(tmp_path):
    learner, elastic = _learner(tmp_path, rho=1.0, reselect_every=1000)
    learner.observe(_batch())
    calls = {name: 0 for name in ("0", "2", "4")}
    for name in calls:
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
    assert sum(accuracies[-10:]) / 10 > sum(accuracies[:10]) / 10 + 0.2
    assert elastic.probes_ == 12 and elastic.importance_ is not None
    timing = elastic.timing_
    index = [elastic.profile_.units.index(n) for n in elastic.selected]
    assert timing.predict(index) <= 0.7 * timing.predict(range(3)) + 1e-12  # the corrected model meets rho
    assert elastic.predicted_speedup() >= 1 / 0.7 - 1e-9
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

    from taste_cl.tuning import BatchSizeTuner

    fake_hardware(monkeypatch, lambda b: 1000.0 * b / (b + 8) / (1 + (b / 40) ** 2))
    elastic = ElasticTrainer(rho=0.5, cache_dir=tmp_path)
    tuner = BatchSizeTuner(max_batch_size=128, cache_dir=tmp_path)
    sizes = []
    original = elastic.reprofile
    monkeypatch.setattr(elastic, "reprofile", lambda batch_size=None, **k: sizes.append(batch_size) or original(batch_size, **k))
    model = _mlp()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic, tuner])
    learner.observe(_batch())
    assert sizes[-1] == tuner.result_.batch_size == learner.batch_plan.micro_batch_size
    learner.monitor.emit("drift_detected")
    learner.monitor.dispatch()
    for _ in range(3):
        learner.observe(_batch())
    assert len(tuner.history_) == 2 and sizes[-1] == tuner.history_[-1]["batch_size"]
