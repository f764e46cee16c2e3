"""The plain-text tables and summaries the CLI, demo and benchmarks print."""

from __future__ import annotations

import pytest

from taste_cl.report import MonitorReport, format_fields, format_number, format_table


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.72666, "0.727"),
        (1.0918, "1.09"),
        (1.0, "1.000"),
        (24.234, "24.2"),
        (99.5, "99.5"),
        (102.4, "102"),
        (13840.4, "13840"),
        (3.2e8, "3.2e+08"),
        (float("nan"), "nan"),
        (7, "7"),
        (True, "True"),
    ],
)
def test_format_number_rounds_by_magnitude(value: float, text: str) -> None:
    assert format_number(value) == text


def test_format_table_right_aligns_numeric_columns_and_their_headers() -> None:
    rows = [["a", 0.72666, 13840.4, 1.0918], ["bb", float("nan"), 3.2e8, 24.234], ["c", None, 992.047, 102.0]]
    lines = format_table(["run", "acc", "samples/s", "x"], rows).splitlines()
    assert lines[0] == "run    acc  samples/s     x"
    assert set(lines[1]) == {"-", " "}
    assert lines[2] == "a    0.727      13840  1.09"
    assert lines[3] == "bb     nan    3.2e+08  24.2"
    assert lines[4] == "c        -        992   102"


def test_format_table_left_aligns_text_columns() -> None:
    lines = format_table(["measure", "value"], [["replay", "200 / 500"], ["rate", 1.5]]).splitlines()
    assert lines[2] == "replay   200 / 500"
    assert lines[3] == "rate     1.50"


def test_format_fields_is_one_rounded_line() -> None:
    assert format_fields({"loss": 0.41234, "samples": 10, "missing": None}) == "loss 0.412  samples 10  missing -"


def test_monitor_report_is_a_dict_printed_as_rounded_lines() -> None:
    report = MonitorReport(
        steps=3,
        samples_seen=30,
        stability=0.8333333333333334,
        plasticity=0.9,
        forgetting=0.01234,
        drift={"count": 1},
        per_class_accuracy={0: 1.0, 1: 0.6666666666666666},
        events={"drift_detected": 1, "retuned": 0},
    )
    assert report["stability"] == 0.8333333333333334
    assert str(report).splitlines() == [
        "steps 3  samples 30  stability 0.833  plasticity 0.900  forgetting 0.012  drift detections 1",
        "per-class accuracy: 0: 1.000  1: 0.667",
        "events: drift_detected 1",
    ]
