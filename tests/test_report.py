"""The plain-text tables the CLI and benchmarks print."""

from __future__ import annotations

from taste_cl._report import format_table


def test_format_table_aligns_columns_and_formats_floats_by_magnitude() -> None:
    table = format_table(["run", "acc", "samples/s"], [["a", 0.72666, 13840.4], ["bb", float("nan"), 3.2e8], ["c", 99.5, 992.047]])
    lines = table.splitlines()
    assert lines[0].split() == ["run", "acc", "samples/s"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["a", "0.727", "13840"]
    assert lines[3].split() == ["bb", "nan", "3.2e+08"]
    assert lines[4].split() == ["c", "99.500", "992"]
    assert len({len(line) for line in lines}) == 1  # every row padded to the same width
