"""The export's BatchNorm mode follows what the learner does: batch statistics where torch trains with
them, the frozen parts' running statistics fixed on the device as in torch, and a stable fallback
that says which mode was chosen and why."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.training_build

import taste_cl.adapters.onnxruntime.learner_export as learner_export
from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.parity import ParityReport
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import BatchNormModeWarning, UnstableTrainingError


def _model() -> nn.Module:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
    head = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    return nn.Sequential(backbone, head)


def _learner(model: nn.Module) -> OnlineLearner:
    trained = [p for p in model.parameters() if p.requires_grad]
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(trained, lr=0.05), replay=ReservoirReplay(40, seed=0), replay_batch_size=4)
    rng = np.random.default_rng(0)
    for _ in range(4):
        learner.observe((torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, 8))))
    return learner


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_a_learner_that_trains_batchnorm_exports_batch_statistics(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormModeWarning)
        folder = _learner(_model()).export(tmp_path / "art", backend="onnxruntime")
    manifest = _manifest(folder)
    assert manifest["batchnorm"] == "batch"
    assert manifest["batchnorm_choice"]["asked"] == "auto" and "'0.1', '1.1'" in manifest["batchnorm_choice"]["why"]
    assert {stat["parameter"] for stat in manifest["running_stats"]} == {f"model.{m}.running_{s}" for m in ("0.1", "1.1") for s in ("mean", "var")}


def test_a_frozen_backbone_keeps_its_statistics_on_the_device_while_the_head_uses_batch_statistics(tmp_path: Path) -> None:
    model = _model()
    model[0].requires_grad_(False)
    learner = _learner(model)
    assert learner.frozen_norms == ["0.1"]
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    manifest = _manifest(folder)
    assert manifest["batchnorm"] == "batch"
    assert {stat["parameter"] for stat in manifest["running_stats"]} == {"model.1.1.running_mean", "model.1.1.running_var"}
    device = OrtOnlineLearner.from_artifacts(folder)
    frozen = {name: device.session.state.get_parameter(name).data.numpy().copy() for name in ("model.0.1.running_mean", "model.0.1.running_var")}
    rng = np.random.default_rng(1)
    for _ in range(5):
        device.observe((rng.standard_normal((8, 6)).astype(np.float32) + 3, rng.integers(0, 3, 8)))
        learner.observe((torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32) + 3), torch.from_numpy(rng.integers(0, 3, 8))))
    for name, value in frozen.items():
        np.testing.assert_array_equal(device.session.state.get_parameter(name).data.numpy(), value)
    assert torch.equal(learner.model[0][1].running_mean, torch.from_numpy(frozen["model.0.1.running_mean"]))


def test_a_learner_without_batch_statistics_exports_frozen_ones(tmp_path: Path) -> None:
    model = _model()
    model.requires_grad_(False)
    model[1][3].requires_grad_(True)  # only the last layer trains: both BatchNorms are in frozen parts
    folder = _learner(model).export(tmp_path / "art", backend="onnxruntime")
    manifest = _manifest(folder)
    assert manifest["batchnorm"] == "frozen" and manifest["running_stats"] == []
    assert manifest["batchnorm_choice"]["why"] == "the learner trains no BatchNorm with batch statistics"


def test_an_explicit_mode_is_kept(tmp_path: Path) -> None:
    folder = _learner(_model()).export(tmp_path / "art", backend="onnxruntime", batchnorm="frozen")
    assert _manifest(folder)["batchnorm_choice"] == {"asked": "frozen", "chosen": "frozen", "why": "asked for"}
    with pytest.raises(ValueError, match=r"`batchnorm == 'sometimes'`, must be one of 'auto', 'frozen', 'batch'"):
        _learner(_model()).export(tmp_path / "bad", backend="onnxruntime", batchnorm="sometimes")


def test_batch_statistics_the_gate_finds_unstable_fall_back_to_frozen_ones_and_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    export_model = learner_export.export_model

    def unstable_in_batch_mode(*args, batchnorm: str, **kwargs):  # what the gate raises on few values per channel
        if batchnorm == "batch":
            report = ParityReport("onnxruntime", 3, 0.5, 0.1, 0.1, 1e-4, 1e-4, 1e-4)
            raise UnstableTrainingError("refusing to publish: ...", report=report, torch_departure=0.5, runtime_departure=0.5, alternatives={})
        return export_model(*args, batchnorm=batchnorm, **kwargs)

    monkeypatch.setattr(learner_export, "export_model", unstable_in_batch_mode)
    with pytest.warns(BatchNormModeWarning, match=r"trains BatchNorm '0.1', '1.1' with batch statistics, but .* amplifies rounding"):
        folder = _learner(_model()).export(tmp_path / "art", backend="onnxruntime")
    choice = _manifest(folder)["batchnorm_choice"]
    assert (choice["chosen"], _manifest(folder)["batchnorm"]) == ("frozen", "frozen") and "UnstableTrainingError" in choice["why"]
