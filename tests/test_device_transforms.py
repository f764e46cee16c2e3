"""The model transforms both device backends share: one FrozenBatchNorm, one disable_random_layers."""

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
    assert device.needed_transforms(frozen) == ["disable_random_layers"]  # the BatchNorm counts as done
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


def test_onnxruntime_uses_the_shared_disable_random_layers() -> None:
    assert onnx.disable_random_layers is device.disable_random_layers
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Dropout(0.0), nn.MultiheadAttention(4, 2, dropout=0.2))
    assert device.disable_random_layers(model) == 2  # the p=0.3 dropout and the attention's
    assert isinstance(model[1], nn.Identity) and model[3].dropout == 0.0


class _Residual(nn.Module):
    """A residual conv block whose branch torchvision's stochastic depth drops per sample, as in EfficientNet."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.branch = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.drop = StochasticDepth(0.5, "row")
        self.off = StochasticDepth(0.0, "row")  # drops nothing: left as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.off(self.drop(self.branch(x)))


def _stochastic_depth_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _Residual(), nn.Dropout(0.2), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_disable_random_layers_turns_off_stochastic_depth_and_keeps_the_old_name() -> None:
    pytest.importorskip("torchvision")
    model = _stochastic_depth_model()
    assert device.needed_transforms(model) == ["freeze_batchnorm", "disable_random_layers"]
    x = torch.randn(16, 3, 6, 6)
    model.train()
    assert not torch.equal(model(x), model(x))  # random in training
    before = model.state_dict()
    assert device.apply_transforms(model, ["disable_dropout"]) == ["disable_random_layers"]  # the former name
    assert isinstance(model[1].drop, nn.Identity) and isinstance(model[2], nn.Identity)
    assert type(model[1].off).__name__ == "StochasticDepth"
    assert torch.equal(model(x), model(x))  # deterministic now
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert device.needed_transforms(model) == ["freeze_batchnorm"]
    with pytest.raises(ValueError, match="unknown names \\['disable_droput'\\]; known: \\['disable_random_layers', 'freeze_batchnorm'\\]"):
        device.apply_transforms(model, ["disable_droput"])


def test_onnxruntime_export_removes_stochastic_depth_and_keeps_dropout() -> None:
    pytest.importorskip("torchvision")
    model = _stochastic_depth_model()
    done = onnx.apply_transforms(model, batchnorm="batch")
    assert "1.drop: StochasticDepth -> Identity" in done and not any(line.startswith("2:") for line in done)
    assert type(model[1].drop) is nn.Identity and type(model[2]) is nn.Dropout  # the gate zeroes dropout's ratio itself


@pytest.mark.parametrize(
    "options",
    [
        {"padding": 1},
        {"stride": 2, "padding": 2, "dilation": 2},
        {"padding": "same"},
        {"padding": 1, "padding_mode": "reflect"},
        {"groups": 2, "bias": False},
    ],
)
def test_conv1d_as_conv2d_is_exact_in_outputs_and_gradients(options: dict) -> None:
    model = nn.Sequential(nn.Conv1d(4, 6, 3, **options))
    rewritten = copy.deepcopy(model)
    assert device.conv1d_as_conv2d(rewritten) == 1 and type(rewritten[0]) is device.Conv1dAs2d
    assert [(k, v.shape) for k, v in rewritten.state_dict().items()] == [(k, v.shape) for k, v in model.state_dict().items()]
    x = torch.randn(5, 4, 17, requires_grad=True)
    for net in (model, rewritten):
        net(x).square().sum().backward()
    torch.testing.assert_close(rewritten(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(rewritten[0].weight.grad, model[0].weight.grad, rtol=1e-6, atol=1e-6)
    assert device.conv1d_as_conv2d(rewritten) == 0  # already rewritten


@pytest.mark.parametrize(
    ("size", "options", "rewritten"),
    [
        (1, {"padding": 1}, "ExportConv2d"),  # only the centre tap reads the 1x1 map
        (2, {"stride": 2, "padding": 1}, "ExportConv2d"),  # 2x2 of the 3x3 taps read it
        (1, {"padding": 1, "groups": 6}, "ExportConv2d"),  # depthwise on one position: a product per channel
        (2, {"padding": 1, "groups": 6, "bias": False}, "ExportConv2d"),  # depthwise on a 2x2 map: per-channel matrices
        (2, {"stride": 2, "padding": 1, "groups": 6}, "ExportConv2d"),
        (4, {"padding": 1, "groups": 6}, "ExportConv2d"),  # 16 x 16 positions: per-channel matrices still pay
        (8, {"stride": 2, "padding": 1, "groups": 6}, "ExportConv2d"),  # 16 x 64: the largest that does
        (8, {"stride": 1, "padding": 1, "groups": 6}, None),  # 64 x 64 positions: the convolution (no faster as matrices)
        (2, {"padding": 1, "bias": False}, None),  # every tap reads the 2x2 map: kept
        (1, {"kernel_size": 5, "padding": 2, "groups": 2}, "ExportConv2d"),
        (3, {"padding": 1, "dilation": 2}, None),  # dilated: kept
        (2, {"stride": 2, "padding": 1, "padding_mode": "reflect"}, None),
        (1, {"padding": "same"}, None),
    ],
)
def test_convolutions_on_small_maps_drop_taps_that_read_only_padding_exactly(size: int, options: dict, rewritten: str | None) -> None:
    torch.manual_seed(0)
    options = {"kernel_size": 3, **options}
    model = nn.Sequential(nn.Conv2d(6, 6, **options))
    work = copy.deepcopy(model)
    x = torch.randn(4, 6, size, size, requires_grad=True)
    done = onnx.apply_transforms(work, run=lambda: work(x))
    assert done == ([f"0: Conv2d -> {rewritten}"] if rewritten else [])
    assert list(work.state_dict()) == list(model.state_dict())
    grads = []
    for net in (model, work):
        x.grad = None
        out = net(x)
        out.square().sum().backward()
        grads.append((out.detach(), x.grad.clone(), net[0].weight.grad.clone()))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work(torch.ones(2, 6, 5, 5)), model(torch.ones(2, 6, 5, 5)))  # another size: PyTorch's own conv
    assert onnx.apply_transforms(copy.deepcopy(model)) == []  # without an example run nothing is rewritten
