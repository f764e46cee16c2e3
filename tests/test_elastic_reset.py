"""ElasticTrainer(optimizer_state="reset") on real models, pretrained setups and the device learner.

A unit leaving the selection drops its optimizer state; the zoo (BatchNorm CNNs, token and
dict inputs, AdamW, regression, multi-label), a frozen backbone, a peft LoRA model and a
dict-output model train with it, nothing the user froze moves or gains state, and a
learner trained this way exports to ONNX Runtime (parity gate passed) and trains there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from taste_cl import ElasticTrainer, OnlineLearner

OPTIONS = {"reselect_every": 2, "cache_dir": None, "warmup": 0, "repeats": 2, "max_rounds": 2, "check_steps": 1, "optimizer_state": "reset"}


def _no_state_left_out(learner: OnlineLearner) -> None:
    left_out = [p for p in learner.model.parameters() if not p.requires_grad]
    assert all(p not in learner.optimizer.state for p in left_out)


@pytest.mark.parametrize("name", ["keyword_spotter", "text_transformer", "text_transformer_dict", "token_tagger", "lstm",
                                  "regression_mlp", "multilabel_mlp", "batchnorm_mlp"])  # fmt: skip
def test_the_zoo_trains_with_reset_state(name: str) -> None:
    from zoo import ZOO

    case = ZOO[name]
    model, loss_fn, optimizer = case.build(0)
    elastic = ElasticTrainer(rho=0.5, **OPTIONS)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, plugins=[elastic])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no selection fits rho" on a noisy 2-round profile
        for seed in range(6):
            learner.observe(case.batch(8, seed=seed))
    assert elastic.probes_ >= 3
    _no_state_left_out(learner)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


class _DictOutput(nn.Module):
    """A Hugging Face-style model: a dict of outputs with a ``logits`` entry."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.body(x)
        return {"logits": self.head(hidden), "hidden_states": hidden}


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _pretrained(setup: str) -> nn.Module:
    if setup == "peft_lora":
        peft = pytest.importorskip("peft")
        return peft.get_peft_model(_mlp(), peft.LoraConfig(r=4, target_modules=["0", "2"], modules_to_save=["4"]))
    if setup == "dict_outputs":
        return _DictOutput()
    model = _mlp()
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("setup", ["frozen_backbone", "peft_lora", "dict_outputs"])
@pytest.mark.training_build
def test_pretrained_setups_train_with_reset_state_and_train_on_the_device(tmp_path: Path, setup: str) -> None:
    from taste_cl.adapters.onnxruntime import OrtOnlineLearner

    torch.manual_seed(0)
    model = _pretrained(setup)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    elastic = ElasticTrainer(rho=0.6, granularity="module", **OPTIONS)
    learner = OnlineLearner(model, optimizer=optimizer, plugins=[elastic])
    generator = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 6, generator=generator)
        return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(8):
            learner.observe(batch())
    _no_state_left_out(learner)
    assert all(torch.equal(p, frozen[n]) and p not in optimizer.state for n, p in model.named_parameters() if n in frozen)
    for trainable, folder in ((None, "all"), (elastic, "selection")):  # units left out export without momentum
        device = OrtOnlineLearner.from_artifacts(learner.export(tmp_path / folder, backend="onnxruntime", trainable=trainable))
        x, y = batch()
        before = device.parameters()
        assert not device.observe((x.numpy(), y.numpy())).skipped
        after = device.parameters()
        assert any(not (before[k] == after[k]).all() for k in before)
