"""The ``taste-cl`` command: every command's and benchmark's ``--help``, ``--version``, usage
errors, the demo, a benchmark and the generated README performance table."""

from __future__ import annotations

import json

import pytest

from taste_cl import __version__
from taste_cl.benchmarks.report import BEGIN, END, replace_table
from taste_cl.cli import BENCHMARKS, COMMANDS, build_parser, main


def _every_command() -> list[list[str]]:
    """Walk the parser: each sub-command, and each benchmark under ``bench``."""
    parser, bench = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = [[name] for name in sub.choices if name != "bench"]
    benchmarks = [["bench", name] for name in next(a for a in bench._actions if a.dest == "name").choices]
    return [[], ["bench"], *commands, *benchmarks]


def test_the_walk_covers_every_command_and_benchmark() -> None:
    walked = _every_command()
    assert {tuple(c) for c in walked} >= {(n,) for n in COMMANDS} | {("bench", n) for n in BENCHMARKS}


@pytest.mark.parametrize("command", _every_command(), ids=lambda c: " ".join(c) or "taste-cl")
def test_every_help_exits_0_with_usage_and_option_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: taste-cl")
    assert "``" not in out and ":class:" not in out  # no reST markup in descriptions
    lines = out.splitlines()
    for i, line in enumerate(lines):  # every option has a help text, on its line or the next
        if line.startswith("  --"):
            words = line.split()
            takes_value = len(words) > 1 and words[1].isupper()
            own_help = words[2:] if takes_value else words[1:]
            indented = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8)
            assert own_help or indented, f"{words[0]} has no help text"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"taste-cl {__version__}"


def test_missing_or_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["bench"]) == 2
    assert "taste-cl bench --help" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "no-such-benchmark"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_prints_the_accuracy_table_and_saves_a_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    assert main(["demo", "--no-progress", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "after task" in out and "forgetting" in out
    final = float(out.split("final accuracy (all 10 classes):")[1].split()[0])
    assert final >= 0.8
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_online_digits_writes_json_and_the_report_table(tmp_path, capsys):
    assert main(["bench", "online-digits", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "online_digits.json").read_text())
    assert result["runs"]["reservoir"]["final_accuracy"] >= 0.8
    assert result["runs"]["no_replay"]["final_accuracy"] <= 0.3
    assert result["runs"]["reservoir"]["samples_per_s"] > 0
    assert "samples/s" in capsys.readouterr().out

    readme = tmp_path / "README.md"
    kept = "| `taste-cl bench soak` | long stream | RSS growth 0.06 MB |"
    earlier = f"| `taste-cl bench online-digits` | stale | 0.1 |\n{kept}\n\nMeasured on: 2020-01-01, x86_64."
    readme.write_text(f"# x\n\n{BEGIN}\n{earlier}\n{END}\n\nafter\n")
    assert main(["bench", "report", "--out", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    accuracy = format(result["runs"]["reservoir"]["final_accuracy"], ".3f")
    assert "stale" not in text and text.endswith("\nafter\n")
    row = next(line for line in text.splitlines() if line.startswith("| `taste-cl bench online-digits`"))
    assert f"final accuracy over all 10 classes {accuracy} vs" in row
    # a benchmark without a result this time keeps its earlier row, marked as such
    assert kept in text and "Rows of `soak`: from an earlier run (2020-01-01, x86_64)." in text
    lines = text.splitlines()
    assert lines.index(kept) > lines.index(row)  # command order


def test_report_refuses_a_file_without_markers_and_a_folder_without_results(tmp_path, capsys):
    with pytest.raises(ValueError, match="no table markers"):
        replace_table("# README without the markers\n", "| table |")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "report", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "no benchmark results" in capsys.readouterr().err


def test_demo_without_matplotlib_prints_its_table_and_says_how_to_get_the_plot(tmp_path):
    """``pip install .`` installs no matplotlib (the ``plot`` extra brings it): the demo still runs."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None; "  # an import of matplotlib now raises ImportError
        "from taste_cl.cli import main; "
        f"raise SystemExit(main(['demo', '--no-progress', '--no-baseline', '--plot', {str(tmp_path / 'demo.png')!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "after task" in result.stdout and "final accuracy" in result.stdout
    assert "no plot: install matplotlib for the plot: pip install '.[plot]'" in result.stdout
    assert not (tmp_path / "demo.png").exists()


def test_a_core_install_brings_no_matplotlib():
    """What ``pip install .`` installs: taste-cl's requirements without extras, and theirs, as installed here."""
    import re
    from importlib import metadata

    def requirements(distribution: str) -> list[str]:
        wanted = []
        for line in metadata.requires(distribution) or []:
            if "extra ==" not in line:
                wanted.append(re.split(r"[ ;<>=!~\[(]", line, maxsplit=1)[0].lower().replace("_", "-"))
        return wanted

    seen: set[str] = set()
    todo = requirements("taste-cl")
    assert "lazy-loader" in todo and "torch" in todo
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            try:
                todo.extend(requirements(name))
            except metadata.PackageNotFoundError:  # a platform-only requirement not installed here
                pass
    assert "matplotlib" not in seen
