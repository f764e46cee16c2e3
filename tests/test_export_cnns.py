"""Export coverage for real CNNs and both BatchNorm modes, and how the parity gate tells why one fails.

Stochastic depth (torchvision's ``StochasticDepth`` in EfficientNet) draws its masks inside the
graph, where the gate cannot turn them off: exports remove it, so the device trains without it.
A training that amplifies rounding (batch statistics over a handful of values per channel, as
torchvision's CNNs on 32x32 inputs have in their last stages) departs from its own float64 run
as far as any runtime does: the gate says so (:class:`UnstableTrainingError`) and which
BatchNorm mode keeps torch within the tolerance, instead of blaming the runtime. Under
``backend="auto"`` a refusal that blames the training stops the search.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from taste_cl import OnlineLearner
from taste_cl.adapters.device.parity import ParityError, TrainingDivergesError, UnstableTrainingError, check_parity

pytestmark = pytest.mark.usefixtures("one_thread")


class _Offset:
    """A trainer whose losses, outputs and parameters are exactly 1 plus ``offset``: a stand-in for a run
    that rounding moved by ``offset`` from the exact one."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def train_step(self, x: Any, y: np.ndarray) -> float:
        return 1.0 + self.offset

    def parameters(self) -> dict[str, np.ndarray]:
        return {"w": np.array([1.0 + self.offset])}

    def predict(self, x: Any) -> np.ndarray:
        return np.full((len(x), 2), 1.0 + self.offset, np.float32)


BATCHES = [(np.zeros((3, 1), np.float32), np.zeros(3, np.int64))] * 3


def _alternative(float32_offset: float) -> Any:
    """A setting whose float32 run is ``float32_offset`` from its float64 one."""
    return lambda dtype=None: _Offset(0.0 if dtype == "float64" else float32_offset)


def test_a_training_that_amplifies_rounding_is_not_blamed_on_the_runtime() -> None:
    alternatives = {"batchnorm='frozen'": _alternative(1e-6), "lr=0.001": _alternative(1e-2)}
    with pytest.raises(UnstableTrainingError) as caught:
        check_parity(_Offset(1e-3), _Offset(-1e-3), BATCHES, backend="rt", alternatives=alternatives, precise=lambda: _Offset(0.0))
    error = caught.value
    assert not isinstance(error, ParityError) and error.torch_departure == pytest.approx(1e-3, rel=1e-3)
    assert error.runtime_departure == pytest.approx(1e-3, rel=1e-3) and error.alternatives["lr=0.001"] == pytest.approx(1e-2, rel=1e-3)
    message = str(error)
    assert "the training amplifies rounding, so parity cannot be checked: torch's own float32 training" in message
    assert "departs from the same training in float64 by 0.001 over 3 steps (tolerance 0.0001) and rt by 0.001, as rounding does" in message
    assert "batchnorm='frozen' keeps float32 within the tolerance of float64: export with batchnorm='frozen'." in message


def test_a_runtime_farther_from_float64_than_rounding_explains_fails_parity() -> None:
    with pytest.raises(ParityError, match="rt parity FAILED"):
        check_parity(_Offset(1e-3), _Offset(0.5), BATCHES, backend="rt", precise=lambda: _Offset(0.0))
    with pytest.raises(ParityError):  # torch's float32 agrees with float64: the runtime is wrong
        check_parity(_Offset(0.0), _Offset(1e-3), BATCHES, backend="rt", precise=lambda: _Offset(0.0))
    with pytest.raises(UnstableTrainingError, match=r"With lr=0.001 \(0.01\) torch's float32 departs from float64 too"):
        check_parity(
            _Offset(1e-3), _Offset(-5e-4), BATCHES, backend="rt", alternatives={"lr=0.001": _alternative(1e-2)}, precise=lambda: _Offset(0.0)
        )


def test_a_runtime_within_the_tolerance_of_float64_passes_though_torch_departs() -> None:
    """Torch's float32 1e-3 from float64, the runtime on it: the runtime computes the training, torch rounds it."""
    report = check_parity(_Offset(1e-3), _Offset(0.0), BATCHES, backend="rt", precise=lambda: _Offset(0.0))
    assert report.passed and report.max_output_diff == pytest.approx(1e-3, rel=1e-3) and report.exact_departure == 0.0


def _line_learner() -> OnlineLearner:
    """``w x`` fitted to 1 from ``w = 0`` at lr 1.6: torch's loss grows 4.84x per step (see test_parity_divergence)."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    return OnlineLearner(model, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=1.6))


@pytest.mark.training_build
def test_auto_stops_at_a_training_that_diverges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from taste_cl.adapters.device import backends

    tried = []
    exporter = backends._exporter_or_none

    def recording(name: str) -> Any:
        function = exporter(name)
        if function is None:
            return None

        @functools.wraps(function)  # keeps the signature the options are matched against
        def export(*args: Any, **kwargs: Any) -> Any:
            tried.append(name)
            return function(*args, **kwargs)

        return export

    monkeypatch.setattr(backends, "_exporter_or_none", recording)
    with pytest.raises(TrainingDivergesError, match="onnxruntime diverged too"):
        _line_learner().export(tmp_path / "art", backend="auto", example=(torch.ones(8, 1), torch.ones(8, 1)))
    assert tried == ["onnxruntime"] and not (tmp_path / "art").exists()


def _stochastic_depth_cnn() -> nn.Module:
    from test_device_transforms import _stochastic_depth_model

    return _stochastic_depth_model()


@pytest.mark.training_build
def test_onnxruntime_exports_stochastic_depth_with_batch_statistics(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    from taste_cl.adapters.onnxruntime.build import export_model

    model = _stochastic_depth_cnn()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, batches[0], tmp_path / "art", parity_batches=batches, batchnorm="batch")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "1.drop: StochasticDepth -> Identity" in manifest["transforms"] and manifest["parity"]["max_loss_diff"] < 1e-5
    assert type(model[1].drop).__name__ == "StochasticDepth"  # the user's model keeps it


# ------------------------------------------------------------ real models (slow)
def _cnn_export(tmp_path: Path, name: str, batchnorm: str, lr: float = 0.01) -> Path:
    """A random-init torchvision CNN (4 classes, 32x32 zoo images, SGD with momentum) through the ONNX Runtime gate."""
    torchvision = pytest.importorskip("torchvision")
    from zoo import _image_batch

    from taste_cl.adapters.onnxruntime.build import export_model

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=4)
    g = torch.Generator().manual_seed(0)
    batches = [_image_batch(8, g) for _ in range(3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return export_model(model, nn.CrossEntropyLoss(), optimizer, batches[0], tmp_path / batchnorm, parity_batches=batches, batchnorm=batchnorm)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficientnet_b0", "shufflenet_v2_x0_5"])
@pytest.mark.training_build
def test_cnn_exports_with_frozen_batchnorm_and_batch_statistics_are_refused_as_unstable(tmp_path: Path, name: str) -> None:
    """EfficientNet-B0 (stochastic depth removed) and ShuffleNetV2 pass with frozen BatchNorm; with batch
    statistics torch's own float32 departs from float64 as far as ONNX Runtime does, and the gate says so."""
    with pytest.raises(UnstableTrainingError) as caught:
        _cnn_export(tmp_path, name, "batch")
    error = caught.value
    assert error.torch_departure > 1e-2 and error.runtime_departure <= 10 * error.torch_departure
    assert error.alternatives["batchnorm='frozen'"] <= 1e-4
    assert "In torch on the same batches, batchnorm='frozen'" in str(error) and "export with batchnorm='frozen'." in str(error)
    assert not (tmp_path / "batch").exists()
    manifest = json.loads((_cnn_export(tmp_path, name, "frozen") / "manifest.json").read_text())
    assert manifest["parity"]["max_loss_diff"] < 1e-4
    removed = [line for line in manifest["transforms"] if line.endswith("StochasticDepth -> Identity")]
    assert len(removed) == (15 if name == "efficientnet_b0" else 0)


@pytest.mark.slow
@pytest.mark.training_build
def test_resnet18_with_batch_statistics_is_refused_as_unstable(tmp_path: Path) -> None:
    """At 32x32 its last stage normalises 1x1 maps over a batch of 8: rounding grows a hundredfold per step.
    (MobileNetV2 is refused the same way, docs/onnx.md; left out here for time.)"""
    with pytest.raises(UnstableTrainingError, match="export with batchnorm='frozen'") as caught:
        _cnn_export(tmp_path, "resnet18", "batch")
    assert caught.value.torch_departure > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("batchnorm", ["batch", "frozen"])
@pytest.mark.training_build
def test_keyword_spotter_trains_on_onnxruntime_with_either_batchnorm_mode(tmp_path: Path, batchnorm: str) -> None:
    """Conv1d + BatchNorm1d over 40 x 98 MFCC-like frames: batch statistics over 8 x 49+ values per channel."""
    from zoo import ZOO

    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    case = ZOO["keyword_spotter"]
    model, loss_fn, optimizer = case.build(0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer)
    for step in range(3):
        learner.observe(case.batch(8, step))
    folder = learner.export(tmp_path / "art", backend="onnxruntime", batchnorm=batchnorm, example=case.batch(8, 5))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["batchnorm"] == batchnorm and manifest["parity"]["max_loss_diff"] < 1e-5
    assert len(manifest["running_stats"]) == (6 if batchnorm == "batch" else 0)
    device = OrtOnlineLearner.from_artifacts(folder)
    x, y = case.batch(8, 6)
    assert not device.observe((x.numpy(), y.numpy())).skipped


@pytest.mark.slow
def test_keyword_spotter_trains_on_executorch_with_frozen_batchnorm(tmp_path: Path) -> None:
    """ExecuTorch 1.5's 1-D convolution backward refuses to run; the export computes Conv1d as a 2-D convolution."""
    pytest.importorskip("executorch.extension.training")
    from zoo import ZOO

    case = ZOO["keyword_spotter"]
    model, loss_fn, optimizer = case.build(0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer)
    learner.observe(case.batch(8, 0))
    folder = learner.export(tmp_path / "art", backend="executorch", transforms=["freeze_batchnorm"], example=case.batch(16, 1))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["transforms"] == ["conv1d_as_conv2d", "freeze_batchnorm"] and manifest["parity"]["max_param_diff"] < 1e-4
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    x, y = case.batch(8, 2)
    assert np.isfinite(EtOnlineLearner.from_artifacts(folder).observe((x.numpy(), y.numpy())).loss)
