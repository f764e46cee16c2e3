"""The model transforms both device backends share: one FrozenBatchNorm, one disable_dropout."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from taste_cl.adapters.device import transforms as device
from taste_cl.adapters.onnxruntime import transforms as onnx


def _trained_bn_model(affine: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=affine), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.Linear(64, 2))
    model(torch.randn(16, 3, 6, 6) * 3 + 1)  # running statistics away from 0 and 1
    return model


@pytest.mark.parametrize("freeze", ["executorch", "onnxruntime"])
@pytest.mark.parametrize("affine", [True, False])
def test_both_backends_freeze_batchnorm_into_the_shared_class_keeping_the_state(freeze: str, affine: bool) -> None:
    model = _trained_bn_model(affine)
    frozen = copy.deepcopy(model)
    if freeze == "executorch":
        assert device.apply_transforms(frozen, ["freeze_batchnorm"]) == ["freeze_batchnorm"]
    else:
        assert onnx.apply_transforms(frozen) == ["1: BatchNorm2d -> FrozenBatchNorm"]
    assert type(frozen[1]) is device.FrozenBatchNorm
    assert device.needed_transforms(frozen) == ["disable_dropout"]  # the BatchNorm counts as done
    before = model.state_dict()
    assert list(frozen.state_dict()) == list(before)  # num_batches_tracked included
    assert all(torch.equal(value, before[key]) for key, value in frozen.state_dict().items())
    x = torch.randn(5, 3, 6, 6)
    model.eval()
    frozen[1].train()
    with torch.no_grad():
        torch.testing.assert_close(frozen[1](model[0](x)), model[1](model[0](x)))  # training mode == eval BatchNorm
    frozen.train()(x).sum().backward()
    assert all(torch.equal(value, before[key]) for key, value in frozen.state_dict().items())  # statistics stay
    if affine:
        assert frozen[1].weight.grad is not None and frozen[1].bias.grad is not None


def test_freeze_leaves_batchnorm_without_running_statistics_and_counts_what_it_changed() -> None:
    model = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False), nn.BatchNorm1d(4))
    assert device.freeze_batchnorm(model) == 1
    assert type(model[0]) is nn.BatchNorm1d and type(model[1]) is device.FrozenBatchNorm
    assert device.freeze_batchnorm(model) == 0  # already frozen


def test_onnxruntime_uses_the_shared_disable_dropout() -> None:
    assert onnx.disable_dropout is device.disable_dropout
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Dropout(0.0), nn.MultiheadAttention(4, 2, dropout=0.2))
    assert device.disable_dropout(model) == 2  # the p=0.3 dropout and the attention's
    assert isinstance(model[1], nn.Identity) and model[3].dropout == 0.0
