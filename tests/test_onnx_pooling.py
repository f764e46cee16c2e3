"""Average pooling on ONNX Runtime: the models whose export used to kill the process train with parity or are refused.

ONNX Runtime 1.19's ``AveragePoolGrad`` reads its output shape from the graph, where the
batch axis is dynamic, and dies with SIGFPE on the first training step (a raw broadcast
``RuntimeError`` when a BatchNorm precedes the pool). Every export here runs inside the test
process itself: a regression would kill the test run, not fail one assertion quietly.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn


from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ExportError
from taste_cl.adapters.onnxruntime import build
from taste_cl.adapters.onnxruntime.build import UnsupportedOperatorError, export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.adapters.onnxruntime.transforms import _avg_pool
from taste_cl.adapters.onnxruntime.trial import TrialFailure

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _lenet5() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.Tanh(), nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, 10),
    )  # fmt: skip


RED_TEAM = {
    "lenet5": _lenet5,
    "conv_relu_avgpool4": lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(4), nn.Flatten(), nn.Linear(8 * 7 * 7, 10)),
    "adaptive2_linear": lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10)),
    "batchnorm_then_pool": lambda: nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)
    ),
}


def _learner(model: nn.Module) -> OnlineLearner:
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                            loss_fn=nn.CrossEntropyLoss(), replay=ReservoirReplay(capacity=32))  # fmt: skip
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        learner.observe((torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)))
    return learner


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.mark.parametrize("name", list(RED_TEAM))
def test_red_team_pooling_models_export_with_parity_and_train_at_other_batch_sizes(tmp_path: Path, name: str) -> None:
    folder = _learner(RED_TEAM[name]()).export(tmp_path / "art", backend="auto")
    manifest = _manifest(folder)
    assert manifest["selection"]["backend"] == "onnxruntime" and manifest["parity"]["max_param_diff"] < 1e-4
    assert any("AvgPool2d -> Export" in line for line in manifest["transforms"])  # the pool was rewritten
    graph = onnx.load(str(folder / "training_model.onnx"))
    assert not {"AveragePool", "AveragePoolGrad"} & {node.op_type for node in graph.graph.node}
    device = OrtOnlineLearner.from_artifacts(folder)
    for rows in (3, 17):  # the batch sizes AveragePoolGrad died on: any but the exported one's static shape
        g = np.random.default_rng(rows)
        stats = device.observe((g.standard_normal((rows, 1, 28, 28), np.float32), g.integers(0, 10, rows)))
        assert np.isfinite(stats.loss)


def test_batchnorm_then_pool_with_batch_statistics_exports_with_parity(tmp_path: Path) -> None:
    folder = _learner(RED_TEAM["batchnorm_then_pool"]()).export(tmp_path / "art", backend="onnxruntime", batchnorm="batch")
    assert _manifest(folder)["parity"]["max_output_diff"] < 1e-4 and _manifest(folder)["running_stats"]


def test_global_pooling_is_kept_and_exports(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    folder = _learner(model).export(tmp_path / "art", backend="auto")
    graph = onnx.load(str(folder / "training_model.onnx"))
    assert "GlobalAveragePool" in {node.op_type for node in graph.graph.node}
    assert _manifest(folder)["selection"]["backend"] == "onnxruntime"


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_convolution_pooling_equals_pytorch_over_padding_ceil_mode_and_divisors(dims: int) -> None:
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[dims]
    sizes = {1: (5, 8, 11), 2: (5, 8), 3: (5, 6)}[dims]
    checked = 0
    for size, kernel, stride, pad, ceil_mode, include_pad in itertools.product(sizes, (1, 2, 3), (1, 2, 3), (0, 1), (False, True), (False, True)):
        if pad > kernel // 2:
            continue
        x = torch.randn(2, 3, *[size + axis for axis in range(dims)])
        args = ((kernel,) * dims, (stride,) * dims, (pad,) * dims)
        expected = pool(x, *args, ceil_mode=ceil_mode, count_include_pad=include_pad)
        got = _avg_pool(x, *args, ceil_mode=ceil_mode, count_include_pad=include_pad)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        checked += 1
    assert checked > 100
    if dims > 1:  # divisor_override: AvgPool2d/3d only
        x = torch.randn(2, 3, *(7,) * dims)
        expected = pool(x, 3, 2, 1, ceil_mode=True, divisor_override=5)  # type: ignore[call-arg]
        torch.testing.assert_close(_avg_pool(x, (3,) * dims, (2,) * dims, (1,) * dims, ceil_mode=True, divisor_override=5), expected)


def test_pooling_variants_and_dimensions_export_with_parity(tmp_path: Path) -> None:
    class Pools(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.pool = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
            self.rect = nn.AvgPool2d((2, 3), stride=(1, 2), ceil_mode=True, divisor_override=5)
            self.line = nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True)
            self.volume = nn.AdaptiveAvgPool3d((1, 13, 1))
            self.head = nn.Linear(4 * 46 + 4 * 13, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            maps = self.rect(self.pool(self.conv(x)))  # (n, 4, 13, 7)
            lines = self.line(maps.flatten(2))  # (n, 4, 46)
            volume = self.volume(maps.unsqueeze(2))  # (n, 4, 1, 13, 1)
            return self.head(torch.cat([lines.flatten(1), volume.flatten(1)], dim=1))

    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    model = Pools()
    folder = export_model(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05), (x, y), tmp_path / "art")
    manifest = _manifest(folder)
    assert manifest["parity"]["max_param_diff"] < 1e-4
    assert {line.split(" -> ")[1] for line in manifest["transforms"]} == {"ExportAvgPool2d", "ExportAvgPool1d", "ExportAdaptiveAvgPool3d"}


class FunctionalPool(nn.Module):
    """Pools with ``F.avg_pool2d`` in its forward: no module to rewrite, so ``AveragePool`` reaches the graph."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.head = nn.Linear(4 * 14 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.avg_pool2d(self.bn(torch.relu(self.conv(x))), 2).flatten(1))  # relu: the BatchNorm is not folded


def _export_functional(folder: Path, batchnorm: bool = False) -> Path:
    model = FunctionalPool(batchnorm)
    example = (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    return export_model(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05), example, folder)


def test_functional_average_pool_is_refused_from_the_graph_naming_the_op(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedOperatorError, match=r"'AveragePool' \(used by module '<model>'\).*F\.avg_pool") as caught:
        _export_functional(tmp_path / "art")
    assert caught.value.op == "AveragePool"
    assert list(tmp_path.iterdir()) == []  # nothing published


def test_auto_refuses_functional_pooling_cleanly_on_both_backends(tmp_path: Path) -> None:
    pytest.importorskip("executorch.extension.training")
    with pytest.raises(ExportError, match=r"onnxruntime: UnsupportedOperatorError: .*'AveragePool'.*; executorch: .*avg_pool2d_backward"):
        _learner(FunctionalPool()).export(tmp_path / "art", backend="auto")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "win32", reason="a crash is an exit status there, not a signal")
def test_the_child_process_net_turns_a_runtime_crash_into_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # without the graph check, the crash happens for real, in the child that tries the artifacts first
    monkeypatch.setattr(build, "_refuse_crashing_gradients", lambda *args: None)
    with pytest.raises(TrialFailure, match="killed the process with SIGFPE at a training step on 8 rows") as caught:
        _export_functional(tmp_path / "crash")
    assert caught.value.signal == "SIGFPE"
    # the BatchNorm variant fails with ONNX Runtime's broadcast error instead: its node names the op and module
    with pytest.raises(UnsupportedOperatorError, match=r"'Mul' \(used by module 'bn'\).*failed at a training step") as caught:
        _export_functional(tmp_path / "error", batchnorm=True)
    assert isinstance(caught.value.__cause__, TrialFailure)
    assert list(tmp_path.iterdir()) == []
