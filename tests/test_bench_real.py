"""``taste-cl bench real``: its networks ignore padding, and a quick run reports every part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taste_cl.cli import main as cli_main

pytest.importorskip("aeon")
pytest.importorskip("avalanche")
pytest.importorskip("onnxruntime")

from taste_cl.benchmarks.recorded import real
from taste_cl.recorded import load_recorded


@pytest.mark.parametrize("kind", real.MODELS)
def test_networks_ignore_what_lies_in_the_padding(kind: str) -> None:
    vowels = load_recorded("JapaneseVowels", standardize=True)
    model = real.build_model(kind, vowels, seed=0).eval()
    x = torch.from_numpy(vowels.test.with_mask_channel()[:16])
    noisy = x.clone()
    padding = noisy[:, -1:].expand_as(noisy[:, :-1]) == 0
    noisy[:, :-1][padding] = torch.randn(int(padding.sum()))
    with torch.no_grad():
        torch.testing.assert_close(model(noisy), model(x), rtol=1e-5, atol=1e-5)


def test_quick_run_reports_streams_offline_bound_and_enrolment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert real.main(["--quick", "--datasets", "BasicMotions", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("acc taste_cl", "acc avalanche", "x faster", "offline bound", "ONNX Runtime device"))
    result = json.loads((tmp_path / "real.json").read_text())
    entry = result["datasets"]["BasicMotions"]
    streams = entry["streams"]["cnn"]
    assert set(streams["taste_cl"]) == set(streams["avalanche"]) == {"replay", "ER-ACE"}
    for runs in streams.values():
        for summary in runs.values():
            assert 0 <= summary["final_accuracy"] <= 1 and summary["train_seconds"] > 0
    assert 0 <= entry["offline"]["network"]["cnn"]["accuracy"] <= 1
    assert entry["offline"]["published"]["accuracy"] == real.PUBLISHED["BasicMotions"][0]
    enrolment = entry["enrolment"]["cnn"]["summary"]
    assert "torch" in enrolment and ("device" in enrolment or enrolment["refused"])
    assert enrolment["tolerance"] == 2 / 40 and "2 test samples" in enrolment["tolerance_rule"]  # 1 point of 40 is < 2 samples


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "real", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: taste-cl bench real") and "--quick" in out and "--enrol-samples" in out
