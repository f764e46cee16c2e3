"""Learner-level ONNX Runtime export for every task: classification, regression, multi-label, dict inputs.

Each learner observes a few batches (its buffer fills, its task is settled), is exported
through ``learner.export(backend="onnxruntime")`` (parity gate on), and the device learner
must predict within 1e-4 of the learner, ship the buffer with the learner's target shapes,
and then keep training like the learner on the same batches (targets given as the app
gives them to the learner: a regression target ``(n,)`` for an ``(n, 1)`` output).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn


from zoo import ZOO, TextClassifier

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import ExportError
from taste_cl.adapters.onnxruntime.transforms import disable_random_layers
from taste_cl.datasets import make_mlp

Batch = tuple[Any, torch.Tensor]


pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _digits() -> tuple[OnlineLearner, Callable[[int, int], Batch]]:
    """The digits MLP (64-128-128-10) on generated 8x8 images in [0, 1] (loading sklearn's digits is slow)."""
    model = make_mlp(seed=0)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(40))
    weights = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))

    def batch(n: int, seed: int) -> Batch:
        x = torch.rand(n, 64, generator=torch.Generator().manual_seed(seed))
        return x, (x @ weights).argmax(1)

    return learner, batch


def _zoo(name: str, small: Callable[[], nn.Module] | None = None) -> Callable[[], tuple[OnlineLearner, Callable[[int, int], Batch]]]:
    """A zoo case as a learner; ``small`` builds a smaller model of the same kind (keeps the default run fast)."""

    def make() -> tuple[OnlineLearner, Callable[[int, int], Batch]]:
        case = ZOO[name]
        model, loss_fn, optimizer = case.build(0)
        if small is not None:
            torch.manual_seed(0)
            model = small()
            optimizer = type(optimizer)(model.parameters(), lr=optimizer.param_groups[0]["lr"])
        disable_random_layers(model)  # dropout is random in each backend; the comparison needs it off
        learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(40))
        return learner, lambda n, seed: case.batch(n, seed)

    return make


CASES = {
    "classification_digits_mlp": _digits,
    "regression_mse_mlp": _zoo("regression_mlp"),
    "multilabel_bce_mlp": _zoo("multilabel_mlp"),
    "dict_input_masked_transformer": _zoo("text_transformer", lambda: TextClassifier(dim=16)),
}


def _numpy(x: Any) -> Any:
    return {key: value.numpy() for key, value in x.items()} if isinstance(x, dict) else x.numpy()


@pytest.mark.parametrize("name", list(CASES))
def test_learner_export_predicts_and_trains_like_the_learner(tmp_path: Path, name: str) -> None:
    learner, batch = CASES[name]()
    learner.replay_batch_size = 0  # the device and the learner draw replay from different random streams
    for seed in range(4):
        learner.observe(batch(8, seed))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["task"] == learner.task.config() and manifest["parity"]["steps"] == 3
    device = OrtOnlineLearner.from_artifacts(folder)
    assert len(device.replay) == 32 and device.samples_seen == learner.samples_seen == 32
    assert device.spec.labels.shape == tuple(learner.replay.labels.shape[1:])  # the learner's target shape

    held_out, _ = batch(8, 9)
    np.testing.assert_allclose(device.predict(_numpy(held_out)), learner.predict(held_out).numpy(), rtol=0, atol=1e-4)
    before = device.predict(_numpy(held_out))
    for seed in range(4, 7):
        x, y = batch(8, seed)
        stats = device.observe((_numpy(x), y.numpy()))  # the targets as the app gives them to the learner
        learner.observe((x, y))
        assert not stats.skipped and np.isfinite(stats.loss)
    expected = learner.predict(held_out).numpy()
    assert np.abs(device.predict(_numpy(held_out)) - before).max() > 1e-4  # the device trained
    np.testing.assert_allclose(device.predict(_numpy(held_out)), expected, rtol=0, atol=1e-4)
    assert len(device.replay) == len(learner.replay) == 40 and device.samples_seen == 56


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.a(a) + self.b(pair[0]) * pair[1]


def test_nested_inputs_are_refused_by_name(tmp_path: Path) -> None:
    model = _Nested()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(8))
    learner.observe(({"a": torch.randn(4, 4), "pair": (torch.randn(4, 3), torch.randn(4, 1))}, torch.tensor([0, 1, 0, 1])))
    with pytest.raises(ExportError, match=r"x\['pair'\] is a tuple, not a tensor: the device runtime takes a tensor or a flat"):
        learner.export(tmp_path / "art", backend="onnxruntime")
    assert not (tmp_path / "art").exists()
