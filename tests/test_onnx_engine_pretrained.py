"""Pretrained setups on the standard-ONNX device learner: a frozen backbone (BatchNorm included) and a model
returning a dict of outputs export with ``backend="onnx_engine"``, train only what torch trains, and keep
learning on the device as the torch learner does on the same stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from taste_cl import OnlineLearner, ReservoirReplay  # noqa: E402
from taste_cl.adapters.device import load_learner  # noqa: E402
from taste_cl.datasets import split_digits  # noqa: E402

TASKS = split_digits(5)


class DictOutputs(nn.Module):
    """A backbone and a head whose forward returns ``{"logits", "features"}`` (the learner trains on ``output="logits"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.body(x)
        return {"logits": self.head(features), "features": features}


class ConvBackbone(nn.Module):
    """An 8x8 digit as an image through conv + BatchNorm (the frozen, pretrained part), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x.view(-1, 1, 8, 8)))


def _frozen(model: nn.Module, part: nn.Module) -> OnlineLearner:
    for parameter in part.parameters():
        parameter.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    return OnlineLearner(model, optimizer=torch.optim.SGD(trained, lr=0.05, momentum=0.9), replay=ReservoirReplay(60, seed=1), replay_batch_size=10)


def frozen_mlp() -> tuple[OnlineLearner, tuple[str, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return _frozen(model, model[0]), ("2.weight", "2.bias")


def frozen_conv_batchnorm() -> tuple[OnlineLearner, tuple[str, ...]]:
    torch.manual_seed(0)
    model = ConvBackbone()
    model.train()
    with torch.no_grad():  # "pretrained" statistics, which the frozen backbone keeps
        model(torch.as_tensor(TASKS[2].x_train))
    return _frozen(model, model.backbone), ("head.weight", "head.bias")


def dict_outputs() -> tuple[OnlineLearner, tuple[str, ...]]:
    torch.manual_seed(0)
    model = DictOutputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(60, seed=1), replay_batch_size=10, output="logits")
    return learner, ("body.0.weight", "body.0.bias", "head.weight", "head.bias")


def _logits(outputs: torch.Tensor | dict[str, torch.Tensor]) -> np.ndarray:
    return (outputs["logits"] if isinstance(outputs, dict) else outputs).numpy()


@pytest.mark.parametrize("build", [frozen_mlp, frozen_conv_batchnorm, dict_outputs], ids=["frozen-mlp", "frozen-conv-batchnorm", "dict-outputs"])
def test_pretrained_setups_train_on_the_device_as_in_torch(build: Callable[[], tuple[OnlineLearner, tuple[str, ...]]], tmp_path: Path) -> None:
    learner, trained = build()
    frozen_before = {name: p.detach().clone() for name, p in learner.model.named_parameters() if not p.requires_grad}
    statistics = {name: b.clone() for name, b in learner.model.named_buffers() if "running" in name}
    x, y = TASKS[0].x_train, TASKS[0].y_train
    for start in range(0, 80, 10):
        learner.observe((x[start : start + 10], y[start : start + 10]))
    device = load_learner(learner.export(tmp_path / "art", backend="onnx_engine"))
    assert device.engine.trainable == trained  # only what the torch optimizer trains
    x, y = TASKS[1].x_train, TASKS[1].y_train
    for start in range(0, 100, 10):  # the same stream on both sides, after the export
        learner.observe((x[start : start + 10], y[start : start + 10]))
        device.observe(np.asarray(x[start : start + 10], np.float32), np.asarray(y[start : start + 10]))
    rows = TASKS[1].x_test
    np.testing.assert_allclose(device.predict(np.asarray(rows, np.float32)), _logits(learner.predict(torch.as_tensor(rows))), atol=1e-4, rtol=0)
    for name, value in frozen_before.items():  # the backbone never moved in torch
        assert torch.equal(dict(learner.model.named_parameters())[name], value)
    for name, value in statistics.items():  # nor did a frozen backbone's BatchNorm statistics (they are baked into the device's graphs)
        assert torch.equal(dict(learner.model.named_buffers())[name], value)
    assert set(device.engine.parameters()) == set(trained)
