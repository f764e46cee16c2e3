"""``taste-cl bench adapt``: the quick run's tables and JSON, the sequence model and the refused options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taste_cl.adaptation.corruptions import SEQUENCE_CORRUPTIONS, corrupt
from taste_cl.benchmarks.recorded import adapt


def test_quick_run_reports_every_setting_and_the_long_streams_worst_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("aeon")
    assert adapt.main(["--quick", "--no-device", "--out", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "worst window vs source" in printed and "class-sorted bs=64" in printed
    result = json.loads((tmp_path / "adapt.json").read_text())
    assert set(result["errors"]) == {"episodic", "continual bs=64", "long bs=4"}
    assert result["default"] == adapt.DEFAULT and adapt.DEFAULT in adapt.METHOD_NAMES
    for by_method in result["errors"].values():
        assert set(by_method) == set(adapt.METHOD_NAMES) and all(0 <= e <= 1 for e in by_method.values())
    assert len(result["long_windows"]["long bs=4"]["source"]) == 2  # 2000 rows in windows of 1000
    assert result["worst_window_vs_source"]["long bs=4"]["bn"] < 0  # BN-adapt helps on every window of the quick stream
    assert set(result["sequences"]["errors"]) == {"continual bs=64", "class-sorted bs=64"}
    assert "label-free accuracy estimate (AETTA)" in printed
    for setting, by_method in result["estimates"].items():  # the estimate beside the true accuracy, per window
        for method, est in by_method.items():
            windows = len(result["long_windows"][setting][method]) if setting.startswith("long") else (35 if setting == "episodic" else 7)
            assert len(est["estimated"]) == len(est["true"]) == windows
            assert all(0 <= a <= 1 for a in est["estimated"]) and est["mae"] == pytest.approx(
                sum(abs(e - t) for e, t in zip(est["estimated"], est["true"])) / windows
            )
    # on the continual stream the estimate follows the corruptions' accuracies (seven windows, one per corruption)
    assert result["estimates"]["continual bs=64"][adapt.DEFAULT]["corr"] > 0.5
    assert set(result["sequences"]["estimates"]["class-sorted bs=64"]) == set(adapt.METHOD_NAMES)


def test_the_sequence_model_takes_corrupted_recorded_sequences() -> None:
    pytest.importorskip("aeon")
    train_x, train_y, test_x, _, classes = adapt.sequence_data()
    assert train_x.shape[1:] == test_x.shape[1:] and classes == int(train_y.max()) + 1
    model = adapt.bn_cnn_1d(train_x.shape[1], classes, 0)
    for i, name in enumerate(SEQUENCE_CORRUPTIONS):
        assert model(corrupt(test_x[:8], name, 5, seed=i)).shape == (8, classes)
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in model.modules())


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--long-samples", "1500"], "multiple of 1000"), (["--batch-sizes", "0"], "batch-sizes must be >= 1"), (["--long-batch-sizes", "0"], ">= 1")],
)
def test_bad_options_are_refused(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        adapt.main(argv)
    assert match in capsys.readouterr().err
