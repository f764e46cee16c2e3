"""The benchmarks' shared plumbing: alternating timing rounds and figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from taste_cl.benchmarks._common import alternating_rounds
from taste_cl.plotting import save_figure


def test_alternating_rounds_warm_up_once_then_reverse_the_order_every_other_round() -> None:
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    timings = alternating_rounds(variants, steps=2, repeats=3)
    assert calls == ["a", "b", "c"] + ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["c"] * 2 + ["b"] * 2 + ["a"] * 2 + ["a"] * 2 + ["b"] * 2 + ["c"] * 2
    assert {name: len(values) for name, values in timings.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(value >= 0 for values in timings.values() for value in values)


def test_save_figure_creates_the_folder_and_closes_the_figure(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "new" / "plot.png", dpi=50)
    assert path == tmp_path / "new" / "plot.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert not plt.fignum_exists(fig.number)
