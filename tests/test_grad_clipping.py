"""``OnlineLearner(max_grad_norm=...)``: each step's gradient clipped to a global L2 norm, as
``torch.nn.utils.clip_grad_norm_`` clips it; saved in checkpoints; refused by device export."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from taste_cl import OnlineLearner


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _reference_steps(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float | None) -> nn.Module:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return model


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_steps_match_clip_grad_norm(max_norm: float) -> None:
    model = _model()
    start = copy.deepcopy(model)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_grad_norm=max_norm)
    batches = [_batch(i, scale=20.0) for i in range(4)]
    for batch in batches:
        learner.observe(batch)
    expected = _reference_steps(start, batches, max_norm)
    unclipped = _reference_steps(start, batches, None)
    for (name, p), q, u in zip(model.named_parameters(), expected.parameters(), unclipped.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
        # a bound of 0.05 binds on these large inputs, one of 1000 never does
        assert torch.allclose(p, u, atol=1e-6) == (max_norm > 1.0), name


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1"])
def test_a_bad_bound_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        OnlineLearner(_model(), max_grad_norm=value)  # type: ignore[arg-type]


def test_checkpoints_keep_the_bound(tmp_path: Path) -> None:
    model = _model()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.5)
    learner.observe(_batch(0))
    learner.save(tmp_path / "ckpt")
    fresh = _model()
    restored = OnlineLearner.load(tmp_path / "ckpt", model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert restored.max_grad_norm == 0.5
    other = _model()
    plain = OnlineLearner(other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    plain.load_state_dict(learner.state_dict())
    assert plain.max_grad_norm == 0.5
    learner.observe(_batch(1, scale=20.0))
    restored.observe(_batch(1, scale=20.0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_a_corrupt_bound_in_a_checkpoint_is_refused_and_changes_nothing() -> None:
    from taste_cl.exceptions import CheckpointError

    model = _model()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.5)
    learner.observe(_batch(0))
    state = learner.state_dict()
    state["config"]["max_grad_norm"] = -3.0
    other = _model()
    target = OnlineLearner(other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match="max_grad_norm"):
        target.load_state_dict(state)
    assert target.max_grad_norm is None and all(torch.equal(p, q) for p, q in zip(other.parameters(), before))


@pytest.mark.parametrize("backend", [pytest.param("onnxruntime", marks=pytest.mark.training_build), "executorch"])
def test_device_export_refuses_a_clipping_learner(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("onnxruntime" if backend == "onnxruntime" else "executorch")
    from taste_cl.adapters.device.artifacts import ExportError

    model = _model()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0)
    learner.observe(_batch(0))
    with pytest.raises(ExportError, match=r"max_grad_norm=1\) and the device runtimes do not"):
        learner.export(tmp_path / "out", backend=backend)
    assert not (tmp_path / "out").exists() and learner.max_grad_norm == 1.0
    learner.max_grad_norm = None  # accepting that the device trains unclipped
    assert (learner.export(tmp_path / "out", backend=backend) / "manifest.json").exists()


def _record_step_norms(learner: OnlineLearner) -> list[float]:
    """The global gradient norm each optimizer step of ``learner`` is taken with."""
    norms: list[float] = []
    step = learner.optimizer.step

    def recorded(*args: object, **kwargs: object) -> object:
        grads = [p.grad for group in learner.optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(*args, **kwargs)

    learner.optimizer.step = recorded  # type: ignore[method-assign]
    return norms


def _assert_clipped_training(learner: OnlineLearner, batches: list[tuple[object, torch.Tensor]], bound: float) -> None:
    norms = _record_step_norms(learner)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    for batch in batches:
        learner.observe(batch)
    assert norms and all(n <= bound * (1 + 1e-4) for n in norms), norms
    assert any(not torch.equal(p, before[name]) for name, p in learner.model.named_parameters())  # it still trains


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "keyword_spotter", "text_transformer", "text_transformer_dict", "token_tagger",
                                  "lstm", "regression_mlp", "multilabel_mlp", "batchnorm_mlp"])  # fmt: skip
def test_every_step_is_clipped_on_the_zoo(name: str) -> None:
    """BatchNorm CNNs, token and dict inputs, AdamW, regression and multi-label: each step's gradient is within the bound."""
    from zoo import ZOO

    model, loss_fn, optimizer = ZOO[name].build()
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=1e-2)
    _assert_clipped_training(learner, [ZOO[name].batch(8, seed=seed) for seed in range(3)], 1e-2)


def test_clipping_under_elastic_selection_counts_only_what_trains() -> None:
    from zoo import ZOO

    from taste_cl import ElasticTrainer

    model, loss_fn, optimizer = ZOO["resnet18"].build()
    elastic = ElasticTrainer(rho=0.5, reselect_every=2, cache_dir=None, warmup=0, repeats=2, max_rounds=2, check_steps=1)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[elastic], max_grad_norm=1e-2)
    _assert_clipped_training(learner, [ZOO["resnet18"].batch(8, seed=seed) for seed in range(4)], 1e-2)


class _DictOutput(nn.Module):
    """A Hugging Face-style model: a dict of outputs with a ``logits`` entry."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(6, 16), nn.ReLU()), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(x)
        return {"logits": self.head(hidden), "hidden_states": hidden}


@pytest.mark.parametrize("setup", ["frozen_backbone", "peft_lora", "dict_outputs"])
def test_pretrained_setups_are_clipped_and_frozen_tensors_stay(setup: str) -> None:
    torch.manual_seed(0)
    if setup == "peft_lora":
        peft = pytest.importorskip("peft")
        model: nn.Module = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["0"], modules_to_save=["2"]))
    elif setup == "dict_outputs":
        model = _DictOutput()
    else:
        model = _model()
        model[0].requires_grad_(False)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, max_grad_norm=0.05)
    _assert_clipped_training(learner, [_batch(seed, scale=20.0) for seed in range(3)], 0.05)
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
