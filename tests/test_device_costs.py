"""ElasticTrainer selecting with a device runtime's own step costs: ``measure_step_costs``
(ONNX Runtime's per-node profile of two exports) and ``ElasticTrainer.selection_for``.

Measured times follow the machine's load, so nothing here selects on them: the learners'
ElasticTrainers train every unit (``rho=1.0``), and selections are made on injected costs
over the measured units (:func:`_injected`). The measurement itself is checked for sane
values (finite, non-negative, the units it profiles), never for speed."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn


from taste_cl import OnlineLearner
from taste_cl.adapters.onnxruntime.step_costs import _parameter_owners, measure_step_costs
from taste_cl.elastic import ElasticTrainer
from taste_cl.elastic.tensor_profile import TensorProfile

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _batch(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 12, 12, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def _learner(*, granularity: str = "tensor", frozen_first: bool = False) -> tuple[OnlineLearner, ElasticTrainer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 12 * 12, 4),
    )  # fmt: skip
    if frozen_first:
        model[0].requires_grad_(False)
    elastic = _elastic(granularity=granularity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=[elastic], input_shape=(3, 12, 12), num_classes=4)
    _observe(learner, [_batch(step) for step in range(3)])
    assert elastic.importance_ is not None
    return learner, elastic


def _elastic(granularity: str = "tensor") -> ElasticTrainer:
    """An ElasticTrainer that trains every unit (``rho=1.0``: its own selection never follows measured times)
    and profiles in few rounds: the tests select with :meth:`ElasticTrainer.selection_for` on injected costs."""
    return ElasticTrainer(
        rho=1.0, reselect_every=2, cache_dir=None, warmup=1, repeats=2, max_rounds=4, check_steps=1, clock="cpu", granularity=granularity
    )


def _observe(learner: OnlineLearner, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a profile of so few rounds may be "too noisy": nothing here selects on it
        for batch in batches:
            learner.observe(batch)


def _synthetic(profile: TensorProfile, weight: list[float], act: list[float]) -> TensorProfile:
    return dataclasses.replace(profile, weight_grad_s=weight, act_grad_s=act, forward_s=1.0, tail_grad_s=0.0)


def _injected(costs: TensorProfile) -> TensorProfile:
    """``costs`` (its units, granularity and memory fields) with fixed times in place of the measured ones:
    the forward pass 1 s, every weight and input gradient 1/n s, so rho=0.8 or 0.9 fits some units whatever the machine's load."""
    n = len(costs.units)
    return _synthetic(costs, [1.0 / n] * n, [1.0 / n] * n)


def _sane(costs: TensorProfile) -> bool:
    """Measured times are finite and non-negative (their size follows the machine: not checked)."""
    return all(math.isfinite(v) and v >= 0 for v in [costs.forward_s, costs.tail_grad_s, *costs.weight_grad_s, *costs.act_grad_s])


def test_onnxruntime_costs_profile_the_same_units_and_leave_the_learner_alone(tmp_path: Path) -> None:
    learner, elastic = _learner()
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    flags = [p.requires_grad for p in learner.model.parameters()]
    selected = list(elastic.selected)
    costs = measure_step_costs(learner, elastic, _batch(9), steps=3, threads=1, workdir=tmp_path)
    assert costs.units == elastic.profile_.units and costs.granularity == "tensor" and costs.rounds == 3
    assert _sane(costs) and costs.forward_s > 0
    # the first conv's weight gradient is timed; each later conv passes the input gradient back (convolutions:
    # microseconds at least, on any machine, so a zero here means a node was not matched to its unit)
    assert costs.weight_grad_s[0] > 0 and costs.act_grad_s[2] > 0 and costs.act_grad_s[4] > 0
    assert costs.param_bytes == elastic.profile_.param_bytes
    # the two exports are kept in workdir; the learner is as it was
    assert json.loads((tmp_path / "first" / "manifest.json").read_text())["trainable"] == ["model.0.weight"]
    assert all(torch.equal(p, before[name]) for name, p in learner.model.named_parameters())
    assert [p.requires_grad for p in learner.model.parameters()] == flags and elastic.selected == selected
    chosen = elastic.selection_for(_injected(costs), rho=0.8)
    folder = learner.export(tmp_path / "chosen", backend="onnxruntime", trainable=chosen)  # parity-gated
    assert json.loads((folder / "manifest.json").read_text())["trainable"] == ["model." + name for name in chosen]


@pytest.mark.parametrize(("granularity", "frozen_first"), [("module", False), ("tensor", True)])
def test_module_units_and_a_frozen_first_layer(tmp_path: Path, granularity: str, frozen_first: bool) -> None:
    learner, elastic = _learner(granularity=granularity, frozen_first=frozen_first)
    costs = measure_step_costs(learner, elastic, _batch(9), steps=2, threads=1, workdir=tmp_path)
    assert costs.units == elastic.profile_.units and costs.granularity == granularity
    # the first unit trains alone in the second export; a frozen conv before it is never trained
    first = json.loads((tmp_path / "first" / "manifest.json").read_text())["trainable"]
    assert first == (["model.2.weight"] if frozen_first else ["model.0.weight", "model.0.bias"])
    assert _sane(costs)
    chosen = elastic.selection_for(_injected(costs), rho=0.9)  # parameter names, whatever the units
    candidates = {id(p) for p in elastic.candidates()}
    every = [name for name, p in learner.model.named_parameters() if id(p) in candidates]
    assert chosen and set(chosen) <= set(every) and (not frozen_first or not any(name.startswith("0.") for name in chosen))
    learner.export(tmp_path / "chosen", backend="onnxruntime", trainable=chosen)


def test_selection_follows_the_costs_it_is_given() -> None:
    learner, elastic = _learner()
    profile = elastic.profile_
    n = len(profile.units)  # 0.weight 0.bias 2.weight 2.bias 4.weight 4.bias 7.weight 7.bias
    elastic.importance_ = [1.0] * n
    # input gradients dear, weight gradients cheap: the chain decides, so only the last units fit
    chain = elastic.selection_for(_synthetic(profile, [0.01] * n, [0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.2, 0.0]), rho=0.5)
    assert chain == ["4.weight", "4.bias", "7.weight", "7.bias"]
    assert elastic.units_holding(chain) == [4, 5, 6, 7]  # back to the profile's units, to time or score them
    # weight gradients dear, the chain cheap: one weight fits, and the most important one is the first
    elastic.importance_ = [5.0, 0.1, 1.0, 0.1, 1.0, 0.1, 1.0, 0.1]
    weights = elastic.selection_for(_synthetic(profile, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], [0.01] * n), rho=0.5)
    assert weights == ["0.weight", "0.bias", "2.bias", "4.bias", "7.bias"]
    assert elastic.selection_for(_synthetic(profile, [0.01] * n, [0.01] * n), rho=1.0) == [name for name, _ in learner.model.named_parameters()]


def test_selection_for_refuses_what_it_cannot_use() -> None:
    learner, elastic = _learner()
    profile = elastic.profile_
    with pytest.raises(ValueError, match="this ElasticTrainer's units"):
        elastic.selection_for(dataclasses.replace(profile, units=list(reversed(profile.units))))
    with pytest.raises(ValueError, match="rho"):
        elastic.selection_for(profile, rho=1.5)
    with pytest.raises(ValueError, match=r"no selection of the trainable units fits rho=0\.1"):
        elastic.selection_for(_synthetic(profile, [1.0] * len(profile.units), [1.0] * len(profile.units)), rho=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the model: 9\.weight"):
        elastic.units_holding(["0.weight", "9.weight"])
    fresh = ElasticTrainer(cache_dir=None)
    with pytest.raises(ValueError, match="no importance yet"):
        fresh.selection_for(profile)
    with pytest.raises(ValueError, match="attached to the learner"):
        measure_step_costs(learner, fresh, _batch(0))
    with pytest.raises(ValueError, match=r"batch must be \(inputs, targets\)"):
        measure_step_costs(learner, elastic, _batch(0)[0])


def test_a_peft_lora_model_is_costed_per_adapter_tensor_and_its_selection_exports(tmp_path: Path) -> None:
    """peft's lora_A['default'] is scoped by its key alone in ONNX node names; nodes are matched to
    units by the parameters they read, so every adapter tensor gets its own ONNX Runtime costs."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "2"], modules_to_save=["4"]))
    elastic = _elastic()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=[elastic])
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 16, generator=generator), torch.randint(0, 4, (16,), generator=generator))
    _observe(learner, [batch] * 3)
    costs = measure_step_costs(learner, elastic, batch, steps=2, threads=1, workdir=tmp_path / "costs")
    assert costs.units == elastic.profile_.units and all("lora_" in u or "modules_to_save" in u for u in costs.units)
    owners = _parameter_owners(tmp_path / "costs" / "all" / "training_model.onnx", model)
    assert {u.rpartition(".")[0] for u in costs.units} <= set(owners.values())  # every unit's module is found in the graph
    assert _sane(costs)  # microseconds each on this tiny MLP: their size is not checked
    names = elastic.selection_for(_injected(costs), rho=0.9)
    assert names and all("lora_" in name or "modules_to_save" in name for name in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = learner.export(tmp_path / "selected", backend="onnxruntime", trainable=names, example=batch)
    assert sorted(json.loads((folder / "manifest.json").read_text())["trainable"]) == sorted(f"model.{n}" for n in names)


def test_a_regression_learner_without_replay_or_shapes_is_costed_on_the_given_batch() -> None:
    """The batch is the exports' example: a learner with no replay rows and no input_shape= needs it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    elastic = _elastic()
    learner = OnlineLearner(model, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.01), plugins=[elastic])
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 16, generator=generator), torch.randn(16, 1, generator=generator))
    _observe(learner, [batch] * 3)
    costs = measure_step_costs(learner, elastic, batch, steps=2, threads=1)
    assert costs.units == elastic.profile_.units and _sane(costs)
