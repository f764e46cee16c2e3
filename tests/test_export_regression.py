"""Regression exports: every regression loss the README lists trains on the device, and the inference model takes inputs only.

The ONNX exporter cannot trace ``L1Loss``, ``SmoothL1Loss`` or ``HuberLoss`` and traced
``MSELoss``'s outputs through an ``Expand`` over the labels; the export now traces an equal
elementwise form (:mod:`taste_cl.adapters.onnxruntime.losses`), checked here against torch's
losses and gradients, then end to end: the parity gate passes, the device keeps training like
the learner, and ``inference_model.onnx`` runs on the inputs alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn


import onnxruntime

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ExportError
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.adapters.onnxruntime.losses import traceable_loss

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]

LOSSES: dict[str, Callable[[], nn.Module]] = {
    "mse": nn.MSELoss,
    "mse_sum": lambda: nn.MSELoss(reduction="sum"),
    "l1": nn.L1Loss,
    "l1_sum": lambda: nn.L1Loss(reduction="sum"),
    "smooth_l1": nn.SmoothL1Loss,
    "smooth_l1_beta_0.3_sum": lambda: nn.SmoothL1Loss(reduction="sum", beta=0.3),
    "smooth_l1_beta_0": lambda: nn.SmoothL1Loss(beta=0.0),
    "huber": nn.HuberLoss,
    "huber_delta_0.4_sum": lambda: nn.HuberLoss(reduction="sum", delta=0.4),
    "huber_delta_2.5": lambda: nn.HuberLoss(delta=2.5),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_traceable_loss_equals_torch_in_value_and_gradient(name: str) -> None:
    loss_fn = LOSSES[name]()
    output = torch.randn(64, 3, dtype=torch.float64) * 2
    target = torch.randn(64, 3, dtype=torch.float64)
    beta = getattr(loss_fn, "beta", getattr(loss_fn, "delta", 1.0))
    output[0] = target[0]  # d == 0: torch's gradient there is 0
    output[1] = target[1] + beta  # |d| == beta: the linear branch, as torch takes it
    output[2] = target[2] - beta
    values, grads = [], []
    for fn in (loss_fn, traceable_loss(loss_fn)):
        leaf = output.clone().requires_grad_()
        value = fn(leaf, target)
        values.append(value.detach())
        grads.append(torch.autograd.grad(value, leaf)[0])
    assert traceable_loss(loss_fn) is not loss_fn
    torch.testing.assert_close(values[1], values[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_reduction_none_and_other_losses() -> None:
    with pytest.raises(ExportError, match=r"L1Loss\(reduction='none'\) gives one loss per element.*use reduction='mean' or 'sum'"):
        traceable_loss(nn.L1Loss(reduction="none"))
    cross_entropy = nn.CrossEntropyLoss()
    assert traceable_loss(cross_entropy) is cross_entropy

    class Weighted(nn.MSELoss):  # a subclass may compute anything: traced as it is
        def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(output, target)

    weighted = Weighted()
    assert traceable_loss(weighted) is weighted


class Forecaster(nn.Module):
    """A GRU over ``(n, t, 3)`` sequences predicting the next value of channel 0: outputs ``(n, 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(x)
        return self.head(hidden[:, -1])


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(model: nn.Module, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ``(n,)`` as an app gives them, a fixed function of the input plus outliers (both loss branches)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, Forecaster):
        x = torch.randn(n, 10, 3, generator=g)
        y = x[:, -1, 0] + x[:, :, 1].mean(1)
    else:
        x = torch.randn(n, 6, generator=g)
        y = x[:, 0] - 0.5 * x[:, 1]
    return x, y + 3 * (torch.rand(n, generator=g) < 0.25)


def _learner(model: nn.Module, loss_fn: nn.Module) -> OnlineLearner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(40), replay_batch_size=0)
    for seed in range(3):
        learner.observe(_batch(model, 8, seed))
    return learner


def _check_device_trains_like_the_learner(learner: OnlineLearner, folder: Path) -> None:
    """The inference model takes the inputs alone and predicts like the learner; then both train on the same batches."""
    inference = onnxruntime.InferenceSession(str(folder / "inference_model.onnx"))
    assert [value.name for value in inference.get_inputs()] == ["input"]
    held_out, _ = _batch(learner.model, 8, 99)
    expected = learner.predict(held_out).numpy()
    np.testing.assert_allclose(inference.run(None, {"input": held_out.numpy()})[0], expected, rtol=0, atol=1e-5)
    device = OrtOnlineLearner.from_artifacts(folder)
    for seed in range(10, 14):
        x, y = _batch(learner.model, 8, seed)
        stats = device.observe((x.numpy(), y.numpy()))
        learner.observe((x, y))
        assert not stats.skipped and np.isfinite(stats.loss)
    after = learner.predict(held_out).numpy()
    assert np.abs(after - expected).max() > 1e-3  # both trained
    np.testing.assert_allclose(device.predict(held_out.numpy()), after, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["mse", "l1_sum", "smooth_l1_beta_0.3_sum", "huber_delta_0.4_sum"])
def test_onnxruntime_exports_every_regression_loss(tmp_path: Path, name: str) -> None:
    torch.manual_seed(0)
    learner = _learner(_mlp(), LOSSES[name]())
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["loss"] == type(learner.loss_fn).__name__ and manifest["task"]["name"] == "regression"
    assert manifest["parity"]["max_loss_diff"] < 1e-4
    _check_device_trains_like_the_learner(learner, folder)


def test_gru_forecaster_with_l1_loss_exports_to_onnxruntime(tmp_path: Path) -> None:
    torch.manual_seed(0)
    learner = _learner(Forecaster(), nn.L1Loss())
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    _check_device_trains_like_the_learner(learner, folder)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "name"), [("gru", "l1"), ("mlp", "smooth_l1_beta_0.3_sum"), ("mlp", "huber_delta_0.4_sum")])
def test_executorch_exports_regression_losses(tmp_path: Path, model: str, name: str) -> None:
    pytest.importorskip("executorch.extension.training")
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    torch.manual_seed(0)
    learner = _learner(Forecaster() if model == "gru" else _mlp(), LOSSES[name]())
    learner.optimizer.param_groups[0]["momentum"] = 0.0  # the device's SGD restarts without the learner's momentum
    folder = learner.export(tmp_path / "art", backend="executorch")
    device = EtOnlineLearner.from_artifacts(folder)
    held_out, _ = _batch(learner.model, 8, 99)
    np.testing.assert_allclose(device.predict(held_out.numpy()), learner.predict(held_out).numpy(), rtol=0, atol=1e-5)
    for seed in range(10, 14):
        x, y = _batch(learner.model, 8, seed)
        device.observe((x.numpy(), y.numpy()))
        learner.observe((x, y))
    np.testing.assert_allclose(device.predict(held_out.numpy()), learner.predict(held_out).numpy(), rtol=0, atol=1e-4)
