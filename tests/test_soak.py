"""Bounded soak: a 20k-sample stream keeps memory and every history flat (long form: ``taste-cl bench soak``)."""

from __future__ import annotations

import pytest

from taste_cl.benchmarks.soak import run_soak

pytestmark = pytest.mark.usefixtures("one_thread")


def _check(result: dict, samples: int) -> None:
    assert result["samples"] == samples
    assert result["rss_growth_mb"] < 30, result["rss_mb"]
    assert result["replay_len"] == result["replay_capacity"]
    assert result["monitor_events"] <= result["max_events"]
    # checkpoints do not grow with the stream beyond the capped histories (whose caps are checked here)
    assert result["state_bytes_uncapped_final"] < 1.1 * result["state_bytes_uncapped_warm"]
    assert result["state_bytes_uncapped_warm"] < result["state_bytes_warm"]
    assert result["loss_last_tenth"] < 1.0  # and it is still learning the drifting clusters


def test_bounded_soak_keeps_memory_and_histories_flat():
    result = run_soak(samples=20_000, batch_size=40, drift_every=2_000, max_events=3)
    _check(result, 20_000)
    assert sum(result["event_counts"].values()) > result["max_events"]  # more events fired than are kept


@pytest.mark.slow
def test_long_soak_with_the_tuner(tmp_path):
    result = run_soak(samples=200_000, tuner_cache_dir=tmp_path)
    _check(result, 200_000)
    assert result["tuner_history"] <= result["tuner_history_max"]
