from __future__ import annotations

import json

from taste_cl.cli import main


def test_demo_prints_the_accuracy_table_and_saves_a_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    assert main(["demo", "--no-progress", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "after task" in out and "forgetting" in out
    final = float(out.split("final accuracy (all 10 classes):")[1].split()[0])
    assert final >= 0.8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_online_digits_writes_json(tmp_path, capsys):
    assert main(["bench", "online-digits", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "online_digits.json").read_text())
    assert result["runs"]["reservoir"]["final_accuracy"] >= 0.8
    assert result["runs"]["no_replay"]["final_accuracy"] <= 0.3
    assert result["runs"]["reservoir"]["samples_per_s"] > 0
    assert "samples/s" in capsys.readouterr().out


def test_unknown_or_missing_command_prints_usage(capsys):
    assert main([]) == 2
    assert main(["bench"]) == 2
    assert "online-digits" in capsys.readouterr().out
