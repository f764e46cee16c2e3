"""A frozen backbone stays frozen on the device: only the head trains, and only the head has optimizer state.

A parameter is frozen when it has ``requires_grad=False`` or when the optimizer does not
hold it (the learner never steps it). Each backend's artifacts must then train exactly the
head: ONNX Runtime lists the backbone as frozen parameters (no gradient buffers, no AdamW
moments or SGD momentum for it in the checkpoint), ExecuTorch's program has no gradient for
it (its SGD never sees it), and the device's training matches torch training the head alone.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn


from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.onnxruntime.build import export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.adapters.onnxruntime.ort_checkpoint import read_checkpoint

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]

HEAD = ["7.weight", "7.bias"]


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )  # fmt: skip


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def _frozen(mode: str, make: Callable[..., torch.optim.Optimizer]) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """The CNN with its backbone frozen by ``requires_grad=False`` or by leaving it out of the optimizer."""
    model = _cnn()
    if mode == "requires_grad":
        model[:-1].requires_grad_(False)
        return model, make(model.parameters())
    return model, make(model[-1].parameters())


def _train_torch(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    """Torch training the head (eval mode: the device's BatchNorm is frozen, as eval mode normalises)."""
    model.eval()
    for seed in seeds:
        x, y = _batch(seed)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _check_device_trains_only_the_head(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    device = OrtOnlineLearner.from_artifacts(folder)
    before = device.parameters()
    for seed in range(10, 15):
        x, y = _batch(seed)
        assert not device.observe((x.numpy(), y.numpy())).skipped
    after = device.parameters()
    changed = sorted(name for name in before if not np.array_equal(before[name], after[name]))
    assert changed == sorted(HEAD)
    _train_torch(model, optimizer, range(10, 15))
    for name, value in model.state_dict().items():
        if value.is_floating_point():  # every parameter and running statistic
            np.testing.assert_allclose(after[name], value.numpy(), rtol=0, atol=1e-5, err_msg=name)
    held_out, _ = _batch(99)
    with torch.no_grad():
        expected = model(held_out).numpy()
    np.testing.assert_allclose(device.predict(held_out.numpy()), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["requires_grad", "absent_from_optimizer"])
def test_onnxruntime_adamw_trains_and_keeps_moments_for_the_head_only(tmp_path: Path, mode: str) -> None:
    model, optimizer = _frozen(mode, lambda params: torch.optim.AdamW(params, lr=0.01))
    _train_torch(model, optimizer, range(2))  # AdamW state to carry to the device
    reference = copy.deepcopy((model, optimizer))
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, _batch(0), tmp_path / "art")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trainable"] == ["model." + name for name in HEAD]
    checkpoint = read_checkpoint((folder / "checkpoint").read_bytes())
    assert sorted(checkpoint.trainable) == sorted(manifest["trainable"])
    assert sorted(checkpoint.optimizer) == sorted(manifest["trainable"])  # moments only for the head
    assert {"model.0.weight", "model.1.weight", "model.1.running_mean", "model.3.weight"} <= set(checkpoint.frozen)
    _check_device_trains_only_the_head(folder, *reference)


def test_onnxruntime_learner_export_with_sgd_momentum_keeps_the_backbone_frozen(tmp_path: Path) -> None:
    model, optimizer = _frozen("requires_grad", lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    model.eval()  # BatchNorm as the device's frozen BatchNorm; the learner keeps the mode it is given
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(16), replay_batch_size=0)
    for seed in range(2):
        learner.observe(_batch(seed))
    reference = copy.deepcopy((learner.model, learner.optimizer))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trainable"] == manifest["sgd_state"] == ["model." + name for name in HEAD]
    _check_device_trains_only_the_head(folder, *reference)
    # a fresh device optimizer of another kind trains what the learner trains, too
    folder = learner.export(tmp_path / "adamw", backend="onnxruntime", optimizer="adamw")
    assert json.loads((folder / "manifest.json").read_text())["trainable"] == ["model." + name for name in HEAD]


@pytest.mark.parametrize("mode", ["requires_grad", "absent_from_optimizer"])
def test_executorch_trains_the_head_only(tmp_path: Path, mode: str) -> None:
    pytest.importorskip("executorch.extension.training")
    from taste_cl.adapters.executorch.build import export_model as et_export_model
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    model, optimizer = _frozen(mode, lambda params: torch.optim.SGD(params, lr=0.05))
    reference = copy.deepcopy((model, optimizer))
    example = tuple(torch.cat(parts) for parts in zip(_batch(0), _batch(1)))
    folder = et_export_model(model, nn.CrossEntropyLoss(), optimizer, example, tmp_path / "art", transforms=("freeze_batchnorm",))
    device = EtOnlineLearner.from_artifacts(folder)
    assert sorted(device.parameters()) == sorted(HEAD)  # the device's SGD steps the head alone
    for seed in range(10, 15):
        x, y = _batch(seed)
        device.observe((x.numpy(), y.numpy()))
    _train_torch(*reference, range(10, 15))
    for name in HEAD:
        np.testing.assert_allclose(device.parameters()[name], reference[0].state_dict()[name].numpy(), rtol=0, atol=1e-5)
    held_out, _ = _batch(99)
    with torch.no_grad():
        expected = reference[0](held_out).numpy()
    np.testing.assert_allclose(device.predict(held_out.numpy()), expected, rtol=0, atol=1e-5)
