"""The fleet's result tables, printed by ``taste-cl fleet`` and ``taste-cl bench federated``.

Both engines report the same things: each device's accuracy on held-out digits of all
classes and of its own classes, for one or more runs side by side, and what each round
cost (:class:`~taste_cl.adapters.flower.fleet.RoundStats`: payload bytes, time, memory).
A deployment run's ``result.json`` (:func:`~taste_cl.adapters.flower.app.read_outputs`)
holds them as strings and dicts; :func:`last_evaluation` reads its per-device metrics.

>>> runs = {"local": {0: {"accuracy-all": 0.25, "accuracy-own": 0.5}, 1: {"accuracy-all": 0.5, "accuracy-own": 1.0}}}
>>> table, means = accuracy_table(runs)
>>> print(table)
device  local all  local own
------  ---------  ---------
0           0.250      0.500
1           0.500      1.000
mean        0.375      0.750
>>> means
{'accuracy-all': {'local': 0.375}, 'accuracy-own': {'local': 0.75}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from taste_cl.report import format_table

__all__ = ["ACCURACIES", "accuracy_table", "last_evaluation", "rounds_table"]

ACCURACIES = ("accuracy-all", "accuracy-own")
_ROUND_COLUMNS = {  # RoundStats field -> column
    "server_round": "round",
    "accepted": "accepted",
    "dropped": "dropped",
    "bytes_down": "bytes down",
    "bytes_up": "bytes up",
    "seconds": "round s",
    "mean_client_train_s": "client train s",
    "server_rss_mb": "server RSS MB",
    "max_client_rss_mb": "max client RSS MB",
}


def last_evaluation(result: Mapping[str, Any]) -> dict[int, dict[str, float]]:
    """Per-device metrics after the last evaluated round of a run's ``result.json``, by device number."""
    evaluations = result["evaluations"]
    return {int(device): dict(metrics) for device, metrics in evaluations[max(evaluations, key=int)].items()}


def accuracy_table(
    runs: Mapping[str, Mapping[int, Mapping[str, float]]],
    keys: Sequence[str] = ACCURACIES,
    *,
    details: Mapping[str, Mapping[int, Any]] | None = None,
) -> tuple[str, dict[str, dict[str, float]]]:
    """Each device's metrics ``keys`` in every run (``{run: {device: {key: value}}}``), and a mean row.

    Columns go key by key, runs in order within a key: ``"<run> all"`` for ``accuracy-all``
    (the key without ``accuracy-``), or just ``"<run>"`` when there is one key. ``details``
    adds text columns after the device (``{"classes": {device: "1,7"}}``), blank in the mean
    row. Returns the table and the means as ``{key: {run: mean}}``.
    """
    devices = sorted(next(iter(runs.values())))
    details = details or {}
    columns = [(key, run) for key in keys for run in runs]
    rows: list[list[Any]] = [
        [device, *(details[name][device] for name in details), *(runs[run][device][key] for key, run in columns)] for device in devices
    ]
    means = [float(np.mean([runs[run][device][key] for device in devices])) for key, run in columns]
    rows.append(["mean", *([""] * len(details)), *means])
    names = [run if len(keys) == 1 else f"{run} {key.removeprefix('accuracy-')}" for key, run in columns]
    by_key: dict[str, dict[str, float]] = {key: {} for key in keys}
    for (key, run), mean in zip(columns, means):
        by_key[key][run] = mean
    return format_table(["device", *details, *names], rows), by_key


def rounds_table(rounds: Sequence[Mapping[str, Any]]) -> str:
    """One row per round of :class:`~taste_cl.adapters.flower.fleet.RoundStats` fields (as dicts, as in ``result.json``)."""
    return format_table(list(_ROUND_COLUMNS.values()), [[r[field] for field in _ROUND_COLUMNS] for r in rounds])
