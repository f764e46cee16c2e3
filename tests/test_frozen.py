"""Frozen parameters are the user's decision: ElasticTrainer selects among what the user
trains, never unfreezes anything, and its checkpoints keep the frozen set.

Pretrained personalization freezes most of a model: a backbone with only the head in the
optimizer, or LoRA adapters beside frozen base weights. The learning tests here give the
elastic trainer a fixed timing profile of the shape such models have on a real device
(the forward pass through the frozen part outweighs the backward the trainable part
needs) and keep its time model at that profile, so what it selects depends on the model
and its gradients, never on how busy this machine is.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from helpers import quadrant_images
from torch import nn

from taste_cl import CheckpointError, ElasticTrainer, OnlineLearner
from taste_cl.elastic import StepTimeModel, TensorProfile, load_or_profile, profile_tensors, unit_names
from taste_cl.elastic.profiling import _capture, trainable_ids
from taste_cl.plugins import LearnerPlugin

OVER_BUDGET = "no selection of the trainable units fits rho="


class LoRALinear(nn.Module):
    """``nn.Linear`` with a frozen base weight and bias plus a trainable low-rank update ``B @ A``
    (``B`` starts at zero, so the layer starts as the base, as in LoRA)."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.b = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _lora_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(16, 64), nn.ReLU(), LoRALinear(64, 64), nn.ReLU(), LoRALinear(64, 4))


def _frozen_cnn() -> nn.Sequential:
    """A conv backbone (frozen) and a linear head (trained)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 4),
    )  # fmt: skip
    model[:6].requires_grad_(False)
    return model


def _features(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class = the signs of the first two features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()


Costs = Callable[[list[str]], tuple[list[float], list[float], float]]


@pytest.fixture
def fixed_timing(monkeypatch: pytest.MonkeyPatch) -> Callable[[float, Costs], None]:
    """Profile with ``forward_s`` and ``costs(units) -> (weight_grad_s, act_grad_s, tail_grad_s)``
    over the real units, and keep the time model at that profile (no measured corrections)."""

    def install(forward_s: float, costs: Costs) -> None:
        def profile(model: nn.Module, example: Any, *, granularity: str = "tensor", trainable: Any = None, clock: str = "wall", **_: Any) -> Any:
            units = unit_names(model, example, granularity=granularity, trainable=trainable)  # type: ignore[arg-type]
            weight, act, tail = costs(units)
            zeros, ones = [0.0] * len(units), [1] * len(units)
            return TensorProfile(
                units=units, weight_grad_s=weight, act_grad_s=act, forward_s=forward_s, backward_s=sum(weight) + sum(act[1:]) + tail,
                weight_grad_ci=zeros, act_grad_ci=zeros, forward_ci=0.0, param_bytes=ones, input_bytes=ones, act_bytes=ones,
                granularity=granularity, clock=clock, tail_grad_s=tail,
            )  # fmt: skip

        monkeypatch.setattr("taste_cl.elastic.trainer.profile_tensors", profile)
        for method in ("observe", "observe_full", "observe_forward"):
            monkeypatch.setattr(StepTimeModel, method, lambda *args, **kwargs: None)

    return install


class FlagSpy(LearnerPlugin):
    """Records, before every step (after the elastic trainer has set its selection), the
    ``requires_grad`` flags and gradients of the parameters ``watched`` names."""

    name = "flag_spy"

    def __init__(self, watched: Sequence[str]) -> None:
        self.watched = set(watched)
        self.seen: list[dict[str, tuple[bool, bool]]] = []

    def before_step(self, learner: OnlineLearner, **kwargs: Any) -> None:
        self.seen.append({n: (p.requires_grad, p.grad is not None) for n, p in learner.model.named_parameters() if n in self.watched})


Batches = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def _train(model: nn.Module, batches: Batches, steps: int, plugins: Sequence[LearnerPlugin] = ()) -> float:
    """Train with Adam over the trainable parameters; accuracy on held-out rows."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.02)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=list(plugins))
    for step in range(steps):
        learner.observe(batches(32, step))
    x, y = batches(400, 10_000)
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


def _frozen_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    params = dict(model.named_parameters())
    return all(not params[n].requires_grad and params[n].grad is None and torch.equal(params[n], v) for n, v in before.items())


# ------------------------------------------------------------------ learning with frozen parts
def test_frozen_backbone_head_learns_as_plain_observe_does(fixed_timing):
    # the backbone's forward pass outweighs the head's backward: no selection meets rho=0.5,
    # so the trainer trains the whole head and says so (it trained the head's bias alone,
    # the cheapest unit, and stayed at the untrained accuracy)
    fixed_timing(10.0, lambda units: ([0.02 if u.endswith("weight") else 0.01 for u in units], [0.0] * len(units), 0.0))
    plain_model, elastic_model = _frozen_cnn(), _frozen_cnn()
    plain = _train(plain_model, quadrant_images, 40)
    before = _frozen_values(elastic_model)
    elastic = ElasticTrainer(rho=0.5, reselect_every=10, cache_dir=None)
    with pytest.warns(RuntimeWarning, match=r"rho=0\.5 .*4 frozen parameter tensor\(s\).*training all 2 trainable unit\(s\): 6\.weight, 6\.bias"):
        accuracy = _train(elastic_model, quadrant_images, 40, [elastic])
    assert plain > 0.6 and accuracy == plain
    assert elastic.selected == ["6.weight", "6.bias"] and elastic.profile_.units == ["6.weight", "6.bias"]
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), elastic_model.parameters()))
    assert _unchanged(elastic_model, before)


def test_lora_adapters_learn_as_plain_observe_does(fixed_timing):
    # LoRA on a device: the backward through each frozen base weight costs about its forward,
    # A and B are cheap; rho=0.5 cannot be met. The cheapest unit was a lone A, whose gradient
    # stays zero while its B is zero: nothing ever trained
    def lora_costs(units: list[str]) -> tuple[list[float], list[float], float]:
        return [0.05] * len(units), [0.9 if u.endswith(".a") else 0.0 for u in units], 0.0

    fixed_timing(3.0, lora_costs)
    plain = _train(_lora_mlp(), _features, 60)
    model = _lora_mlp()
    before = _frozen_values(model)
    elastic = ElasticTrainer(rho=0.5, reselect_every=10, cache_dir=None)
    with pytest.warns(RuntimeWarning, match=OVER_BUDGET):
        accuracy = _train(model, _features, 60, [elastic])
    assert plain > 0.85 and accuracy == plain
    assert elastic.profile_.units == ["0.a", "0.b", "2.a", "2.b", "4.a", "4.b"]
    assert _unchanged(model, before)


def test_lora_adapters_are_selected_alone_and_no_base_weight_ever_trains(fixed_timing):
    # a budget that fits: only adapters are candidates, the frozen bases never get a gradient
    fixed_timing(1.0, lambda units: ([0.05] * len(units), [0.2 if u.endswith(".a") else 0.0 for u in units], 0.0))
    model = _lora_mlp()
    before = _frozen_values(model)
    spy = FlagSpy(before)
    elastic = ElasticTrainer(rho=0.8, reselect_every=5, cache_dir=None)
    accuracy = _train(model, _features, 60, [elastic, spy])
    assert 0 < len(elastic.selected) < 6 and set(elastic.selected) <= {"0.a", "0.b", "2.a", "2.b", "4.a", "4.b"}
    assert accuracy > 0.6
    assert all(flags == dict.fromkeys(before, (False, False)) for flags in spy.seen) and len(spy.seen) == 60
    assert _unchanged(model, before)


def test_trainable_parameters_outside_the_optimizer_are_refused_and_never_units():
    model = _frozen_cnn()
    model[0].requires_grad_(True)  # trainable, but the optimizer below holds only the head
    with pytest.raises(ValueError, match=r"2 trainable parameter\(s\) are in no optimizer group: 0\.weight, 0\.bias"):
        OnlineLearner(model, optimizer=torch.optim.SGD(model[6].parameters(), lr=0.1))
    model[0].requires_grad_(False)
    elastic = ElasticTrainer(rho=0.9, reselect_every=3, cache_dir=None, warmup=0, repeats=2, max_rounds=2)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model[6].parameters(), lr=0.1), plugins=[elastic])
    model[2].requires_grad_(True)  # unfrozen after the learner was built: still in no optimizer group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # timing noise and the budget are not this test's subject
        for step in range(4):
            learner.observe(quadrant_images(8, step))
    assert [n for n, p in model.named_parameters() if any(p is c for c in elastic.candidates())] == ["6.weight", "6.bias"]
    assert elastic.profile_.units == ["6.weight", "6.bias"]
    assert "2.weight" in elastic.frozen_names() and model[2].weight.requires_grad  # the user's flag, untouched


def test_over_budget_warning_names_rho_and_the_selection_and_respects_memory(fixed_timing):
    # only the first layer trains and its gradients are expensive; the backward through the
    # frozen layers after it is paid whatever trains
    fixed_timing(1.0, lambda units: ([5.0, 5.0], [0.0, 0.0], 4.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model[2:].requires_grad_(False)
    elastic = ElasticTrainer(rho=0.5, reselect_every=3, cache_dir=None)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1), plugins=[elastic])
    message = r"fits rho=0\.5 .*4 frozen parameter tensor\(s\).* 33% of a full step\); training all 2 trainable unit\(s\): 0\.weight, 0\.bias"
    with pytest.warns(RuntimeWarning, match=message):
        for step in range(2):
            learner.observe(_features(8, step))
    assert elastic.selected == ["0.weight", "0.bias"]
    assert [p.requires_grad for p in model.parameters()] == [True, True, False, False, False, False]
    # with a memory budget that holds one unit: the more important one, named
    budget = ElasticTrainer(rho=0.5, reselect_every=3, cache_dir=None, memory_budget_bytes=4)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1), plugins=[budget])
    with pytest.warns(RuntimeWarning, match=r"training 1 of 2 trainable unit\(s\) within memory_budget_bytes=4: 0\.weight"):
        for step in range(2):
            learner.observe(_features(8, step))
    assert budget.selected == ["0.weight"] and not model[0].bias.requires_grad


# ------------------------------------------------------------------ flags
def test_elastic_never_unfreezes_and_restores_exactly_the_users_flags(fixed_timing):
    fixed_timing(1.0, lambda units: ([0.1] * len(units), [0.0] + [0.3] * (len(units) - 1), 0.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model[2].requires_grad_(False)
    users = {n: p.requires_grad for n, p in model.named_parameters()}
    spy = FlagSpy(["2.weight", "2.bias", "4.weight"])
    elastic = ElasticTrainer(rho=0.6, reselect_every=3, cache_dir=None)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=[elastic, spy])
    for step in range(4):
        learner.observe(_features(8, step))
    assert "2.weight" not in elastic.profile_.units and "4.weight" in elastic.profile_.units
    elastic.apply_selection(elastic.profile_.units)  # every unit: exactly the user's flags
    assert {n: p.requires_grad for n, p in model.named_parameters()} == users
    model[4].weight.requires_grad_(False)  # the user freezes a unit mid-run: it stays frozen
    for step in range(4, 12):
        learner.observe(_features(8, step))  # probes at steps 7 and 10 train "every" unit
    assert all(not seen["2.weight"][0] and not seen["2.bias"][0] for seen in spy.seen)
    assert all(not seen["4.weight"][0] for seen in spy.seen[4:]) and len(spy.seen) == 12
    assert "4.weight" in elastic.frozen_names()
    elastic.apply_selection(elastic.profile_.units)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == {**users, "4.weight": False}


# ------------------------------------------------------------------ profiling
def test_profile_times_frozen_layers_where_the_backward_crosses_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    model[2].requires_grad_(False)
    model[6].requires_grad_(False)  # a frozen head: every selection pays the backward through it and the Tanh
    model[0].weight.grad = torch.ones_like(model[0].weight)  # a gradient the profile must keep
    x = torch.randn(16, 8)
    profile = profile_tensors(model, x, warmup=0, repeats=2, max_rounds=2)
    assert profile.units == ["0.weight", "0.bias", "4.weight", "4.bias"]
    assert profile.act_grad_s[2] > 0 and profile.tail_grad_s > 0 and profile.tail_bytes > 0
    assert profile.step_s([3]) == pytest.approx(profile.forward_s + profile.weight_grad_s[3] + profile.tail_grad_s)
    assert [p.requires_grad for p in model.parameters()] == [True, True, False, False, True, True, False, False]
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in [*model[2].parameters(), *model[4].parameters(), *model[6].parameters()])
    assert TensorProfile.from_dict(profile.to_dict()) == profile
    old = {k: v for k, v in profile.to_dict().items() if not k.startswith("tail")}  # a profile from before tails
    assert TensorProfile.from_dict(old).tail_grad_s == 0.0
    # ``trainable`` overrides the flags: the frozen layer as a unit, and the flags left as they were
    only = profile_tensors(model, x, warmup=0, repeats=2, max_rounds=2, trainable=[model[2].weight])
    assert only.units == ["2.weight"] and not model[2].weight.requires_grad


def test_a_frozen_layer_inside_a_lora_wrapper_is_timed_once():
    model, x = _lora_mlp(), torch.randn(4, 16)
    calls = _capture(model, x, trainable_ids(model, None), "auto")
    assert [(c.name, c.nested) for c in calls] == [("0", False), ("1", False), ("2", False), ("3", False), ("4", False)]
    assert unit_names(model, x) == ["0.a", "0.b", "2.a", "2.b", "4.a", "4.b"]
    assert unit_names(model, x, granularity="module") == ["0", "2", "4"]


def test_profile_cache_keys_the_frozen_set(tmp_path):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(4, 6)
    full, cached = load_or_profile(model, x, cache_dir=tmp_path, warmup=0, repeats=2)
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other frozen set is another entry, not an invalid one
        head, head_cached = load_or_profile(model, x, cache_dir=tmp_path, warmup=0, repeats=2)
    assert (cached, head_cached, head.units) == (False, False, ["2.weight", "2.bias"])
    assert load_or_profile(model, x, cache_dir=tmp_path, warmup=0, repeats=2) == (head, True)
    model[0].requires_grad_(True)
    assert load_or_profile(model, x, cache_dir=tmp_path, warmup=0, repeats=2) == (full, True)


# ------------------------------------------------------------------ checkpoints
def _checkpointed(tmp_path: Any, fixed_timing: Callable[[float, Costs], None]) -> tuple[OnlineLearner, ElasticTrainer]:
    fixed_timing(1.0, lambda units: ([0.1] * len(units), [0.0] + [0.3] * (len(units) - 1), 0.0))
    model = _lora_mlp()
    elastic = ElasticTrainer(rho=0.8, reselect_every=3, cache_dir=None)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), plugins=[elastic])
    for step in range(5):
        learner.observe(_features(8, step))
    assert 0 < len(elastic.selected) < 6
    learner.save(tmp_path / "ckpt")
    return learner, elastic


def _load(tmp_path: Any, model: nn.Module) -> tuple[OnlineLearner, ElasticTrainer]:
    elastic = ElasticTrainer(rho=0.8, reselect_every=3, cache_dir=None)
    optimizer = torch.optim.SGD([p for n, p in model.named_parameters() if ".base." not in n], lr=0.1)  # the adapters
    return OnlineLearner.load(tmp_path / "ckpt", model=model, optimizer=optimizer, plugins=[elastic]), elastic


def test_checkpoint_round_trips_the_selection_and_the_frozen_set(tmp_path, fixed_timing):
    learner, elastic = _checkpointed(tmp_path, fixed_timing)
    state = elastic.state_dict()
    assert state["frozen"] == ["0.base.weight", "0.base.bias", "2.base.weight", "2.base.bias", "4.base.weight", "4.base.bias"]
    loaded, restored = _load(tmp_path, _lora_mlp())
    before, after = elastic.state_dict(), restored.state_dict()
    assert torch.equal(before.pop("example"), after.pop("example")) and after == before
    flags = {n: p.requires_grad for n, p in loaded.model.named_parameters()}
    assert flags == {n: p.requires_grad for n, p in learner.model.named_parameters()}
    loaded.observe(_features(8, 99))
    old = {k: v for k, v in state.items() if k != "frozen"}  # a checkpoint from before the frozen set was kept
    restored.load_state_dict(old)
    assert restored.selected == elastic.selected


def test_checkpoint_of_another_frozen_set_is_refused_and_changes_nothing(tmp_path, fixed_timing):
    _, elastic = _checkpointed(tmp_path, fixed_timing)
    model = _lora_mlp()
    model[2].a.requires_grad_(False)  # frozen here, though the optimizer holds it
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    values = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"frozen here \(requires_grad=False, or in no optimizer group\), trainable there: 2\.a"):
        _load(tmp_path, model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    state = elastic.state_dict()
    with pytest.raises(CheckpointError, match=r"frozen there, trainable here: 2\.a$"):
        elastic.load_state_dict({**state, "frozen": [*state["frozen"], "2.a"]})
    assert elastic.state_dict()["frozen"] == state["frozen"]


def test_elastic_state_selecting_a_frozen_parameter_is_a_checkpoint_error(tmp_path, fixed_timing):
    learner, elastic = _checkpointed(tmp_path, fixed_timing)
    state = elastic.state_dict()
    profile = {**state["profile"], "units": ["0.base.weight", *state["profile"]["units"][1:]]}
    before = copy.deepcopy(elastic.state_dict()), {n: p.requires_grad for n, p in learner.model.named_parameters()}
    bad = [
        ({**state, "profile": profile, "selected": ["0.base.weight"]}, r"`selected` names a unit this model does not train: unit '0\.base\.weight'"),
        ({**state, "profile": profile, "selected": []}, r"profile does not fit this model: unit '0\.base\.weight' is frozen"),
        ({**state, "frozen": "all"}, "`frozen` must be a list of parameter names"),
    ]
    for changed, match in bad:
        with pytest.raises(CheckpointError, match=match):
            elastic.load_state_dict(changed)
        after = elastic.state_dict(), {n: p.requires_grad for n, p in learner.model.named_parameters()}
        assert after[1] == before[1] and after[0]["selected"] == before[0]["selected"] and after[0]["profile"] == before[0]["profile"]
    assert not learner.model[0].base.weight.requires_grad


# ------------------------------------------------------------------ the zoo
@pytest.mark.usefixtures("one_thread")
def test_mobilenet_v3_small_with_frozen_features_learns_and_never_touches_them():
    """torchvision MobileNetV3-small (``weights=None``, pretrained here on the zoo's quadrant
    task), features frozen, classifier trained on a new label arrangement, elastic at rho 0.5
    on real timing: it learns, and no frozen parameter gets a gradient or changes a bit."""
    from zoo import ZOO

    case = ZOO["mobilenet_v3_small"]
    model, loss_fn, optimizer = case.build()
    for step in range(60):  # a short pretraining of the whole network
        x, y = case.batch(16, seed=100 + step)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    # settle BatchNorm's running statistics: torchvision's MobileNetV3 averages them with momentum
    # 0.01, so after 60 steps they are half the init's and the pretrained model is at chance in eval
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a cumulative average over the passes below
        for step in range(20):
            model(case.batch(16, seed=100 + step)[0])
        for norm in norms:
            norm.momentum = 0.01
    model.zero_grad(set_to_none=True)
    model.features.requires_grad_(False)
    model.classifier[3].reset_parameters()
    before = _frozen_values(model)
    spy = FlagSpy(before)
    elastic = ElasticTrainer(rho=0.5, reselect_every=5, cache_dir=None, warmup=0, repeats=2, max_rounds=2, check_steps=1)
    optimizer = torch.optim.SGD(model.classifier.parameters(), lr=0.02, momentum=0.9)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[elastic, spy])
    arrangement = lambda y: (y + 1) % 4  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a noisy 2-round profile on a shared machine
        for step in range(30):
            x, y = case.batch(16, seed=step)
            learner.observe((x, arrangement(y)))
    x, y = case.batch(64, seed=999)
    with torch.no_grad():
        accuracy = float((model.eval()(x).argmax(1) == arrangement(y)).float().mean())
    assert accuracy > 0.8  # chance: 0.25
    assert set(elastic.profile_.units) == {"classifier.0.weight", "classifier.0.bias", "classifier.3.weight", "classifier.3.bias"}
    assert len(spy.seen) == 30 and all(flags == dict.fromkeys(before, (False, False)) for flags in spy.seen)
    assert _unchanged(model, before)


class _Refuses(LearnerPlugin):
    """A plugin whose checkpoint state never loads (loaded after the elastic trainer)."""

    name = "refuses"

    def state_dict(self) -> dict[str, Any]:
        return {"ok": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != {"ok": True}:
            raise ValueError("refused")


def test_a_checkpoint_refused_after_the_elastic_state_loaded_gives_the_users_flags_back(tmp_path, fixed_timing):
    learner, _ = _checkpointed(tmp_path, fixed_timing)
    model = _lora_mlp()
    elastic = ElasticTrainer(rho=0.8, reselect_every=3, cache_dir=None)
    fresh = OnlineLearner(model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), plugins=[elastic, _Refuses()])
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    state = {**learner.state_dict(), "plugins": {**learner.state_dict()["plugins"], "refuses": {"ok": False}}}
    with pytest.raises(CheckpointError, match="plugin 'refuses': refused"):
        fresh.load_state_dict(state)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags and elastic.profile_ is None
