"""`taste-cl export --backend`: the digits learner exported to the maintained engine, loadable without the training build."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from taste_cl.adapters.device.loader import load_learner  # noqa: E402
from taste_cl.cli import main  # noqa: E402


def test_export_to_the_onnx_engine_writes_a_folder_the_device_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "art"
    assert main(["export", "--backend", "onnx_engine", "--out", str(out), "--tasks", "1", "--last-layer-only"]) == 0
    printed = capsys.readouterr().out
    assert "(onnx_engine)" in printed and "forward.onnx" in printed
    device = load_learner(out)
    assert device.engine.trainable == ("4.weight", "4.bias")  # the output layer only
    assert len(device.replay) == 200


def test_optimizer_options_without_the_training_backend_are_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--backend", "onnx_engine", "--lr", "0.01", "--out", str(tmp_path / "art")])
    assert exit_info.value.code == 2
    assert "pass --backend onnxruntime" in capsys.readouterr().err
    assert not (tmp_path / "art").exists()
