"""One loader for every artifact folder, and exports of a learner that has not observed yet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")

from taste_cl import OnlineLearner
from taste_cl.adapters.device import load_learner
from taste_cl.adapters.device.artifacts import ArtifactError, read_manifest
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.datasets import split_digits


def _fresh_learner() -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), input_shape=(64,), num_classes=10)


@pytest.mark.training_build
def test_a_learner_built_with_shapes_exports_before_it_observes_and_the_device_learns(tmp_path: Path) -> None:
    learner = _fresh_learner()
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    folder = learner.export(tmp_path / "fresh", backend="onnxruntime")
    assert all(torch.equal(v, learner.model.state_dict()[k]) for k, v in before.items())  # the export changed nothing
    device = load_learner(folder)
    assert isinstance(device, OrtOnlineLearner)
    task = split_digits(5)[0]
    x, y = task.x_train.numpy(), task.y_train.numpy()
    start = float(np.mean(device.predict(x).argmax(1) == y))
    for i in range(0, 200, 10):
        device.observe((x[i : i + 10], y[i : i + 10]))
    assert float(np.mean(device.predict(x).argmax(1) == y)) > max(start, 0.8)


def test_a_learner_without_shapes_or_rows_asks_for_an_example(tmp_path: Path) -> None:
    model = nn.Linear(4, 3)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"input_shape= and num_classes=.*pass example=\(x, y\)"):
        learner.export(tmp_path / "x", backend="onnxruntime")
    assert not (tmp_path / "x").exists()


@pytest.mark.training_build
def test_load_learner_refuses_what_is_not_an_artifact_folder_or_names_another_backend(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not an artifact folder"):
        load_learner(tmp_path)
    folder = _fresh_learner().export(tmp_path / "a", backend="onnxruntime")
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["backend"] = "tflite"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="backend 'tflite'"):
        load_learner(folder)
    with pytest.raises(TypeError):
        load_learner(_fresh_learner().export(tmp_path / "b", backend="onnxruntime"), no_such_option=1)
    assert read_manifest(tmp_path / "b")  # the refused option left the folder as it was


@pytest.mark.slow
def test_load_learner_opens_an_executorch_folder(tmp_path: Path) -> None:
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch import EtOnlineLearner

    learner = _fresh_learner()
    folder = learner.export(tmp_path / "et", backend="executorch")
    device = load_learner(folder)
    assert isinstance(device, EtOnlineLearner)
    task = split_digits(5)[0]
    stats = device.observe((task.x_train[:10], task.y_train[:10]))
    assert stats.samples == 10


@pytest.mark.training_build
def test_exporting_prints_no_line_about_torchs_cuda_build(tmp_path: Path) -> None:
    """onnxruntime.training imports torch.utils.cpp_extension, which warns on CPU machines."""
    import subprocess
    import sys

    code = (
        "import torch; from torch import nn; from taste_cl import OnlineLearner; import taste_cl.adapters.onnxruntime.learner_export; "
        "m = nn.Linear(4, 3); l = OnlineLearner(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), input_shape=(4,), num_classes=3); "
        f"l.export({str(tmp_path / 'a')!r}, backend='onnxruntime')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cpp_extension" not in result.stderr and "CUDA" not in result.stderr, result.stderr
