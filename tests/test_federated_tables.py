"""The fleet result tables shared by ``taste-cl fleet`` and ``taste-cl bench federated``."""

from __future__ import annotations

import math

from taste_cl.adapters.flower.tables import accuracy_table, last_evaluation, rounds_table

LOCAL = {0: {"accuracy-all": 0.2, "accuracy-own": 0.6}, 1: {"accuracy-all": 0.4, "accuracy-own": 0.8}}
FED = {0: {"accuracy-all": 0.5, "accuracy-own": 0.7}, 1: {"accuracy-all": 0.7, "accuracy-own": 0.9}}


def _lines(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines()]


def test_accuracy_table_goes_key_by_key_with_details_and_a_mean_row() -> None:
    table, means = accuracy_table({"local": LOCAL, "fed": FED}, details={"classes": {0: "1,7", 1: "2,3,9"}})
    lines = _lines(table)
    assert lines[0] == ["device", "classes", "local", "all", "fed", "all", "local", "own", "fed", "own"]
    assert lines[2] == ["0", "1,7", "0.200", "0.500", "0.600", "0.700"]
    assert lines[-1] == ["mean", "0.300", "0.600", "0.700", "0.800"]  # the details column is blank
    assert {key: {run: round(m, 6) for run, m in runs.items()} for key, runs in means.items()} == {
        "accuracy-all": {"local": 0.3, "fed": 0.6},
        "accuracy-own": {"local": 0.7, "fed": 0.8},
    }


def test_one_key_names_the_columns_by_run() -> None:
    table, means = accuracy_table({"local only": LOCAL, "fedper": FED}, ["accuracy-own"])
    assert _lines(table)[0] == ["device", "local", "only", "fedper"]
    assert list(means) == ["accuracy-own"] and math.isclose(means["accuracy-own"]["fedper"], 0.8)


def test_last_evaluation_reads_the_highest_round_of_a_result_json() -> None:
    result = {"evaluations": {"9": {"0": {"accuracy-all": 0.1}}, "10": {"1": {"accuracy-all": 0.9}, "0": {"accuracy-all": 0.8}}}}
    assert last_evaluation(result) == {1: {"accuracy-all": 0.9}, 0: {"accuracy-all": 0.8}}  # "10" after "9": by number


def test_rounds_table_has_a_row_per_round_with_every_round_stat() -> None:
    stats = {
        "server_round": 1,
        "sampled": 3,
        "accepted": 3,
        "dropped": 0,
        "bytes_down": 1200,
        "bytes_up": 1100,
        "server_rss_mb": 300.0,
        "max_client_rss_mb": 250.0,
        "mean_client_train_s": 0.5,
        "seconds": 2.0,
    }
    lines = _lines(rounds_table([stats, {**stats, "server_round": 2, "dropped": 1}]))
    assert lines[0][:6] == ["round", "accepted", "dropped", "bytes", "down", "bytes"]
    assert lines[2] == ["1", "3", "0", "1200", "1100", "2.00", "0.500", "300", "250"]
    assert lines[3][:3] == ["2", "3", "1"]
