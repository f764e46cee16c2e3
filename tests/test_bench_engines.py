"""`taste-cl bench engines`: the quick run finishes, and torch eager and the standard-ONNX engine agree."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("onnxscript")

from taste_cl.benchmarks.parity import engines  # noqa: E402


def test_the_quick_run_shows_both_engines_replaying_alike_and_refusing_the_same_poisoned_steps(tmp_path, capsys):
    assert engines.main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "engines.json").read_text())["results"]
    assert set(results) == {"digits MLP / replay", "digits MLP / er_ace"}
    for row in results.values():
        assert row["same_replay_draws"]
        assert abs(row["gap_points"]) <= 1.0
        assert row["refused_torch"] == row["refused_onnxruntime"] == [20, 21, 22]
        if importlib.util.find_spec("executorch") is not None:  # the ExecuTorch engine, on the same stream
            assert row["refused_executorch"] == [20, 21, 22]
            assert abs(row["executorch_gap_points"]) <= 1.0
    assert "ORT engine acc" in capsys.readouterr().out
