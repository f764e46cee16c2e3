"""LoadMeter: the foreign-load reading the batch-size tuner compares across observes."""

from __future__ import annotations

import pytest

from taste_cl.tuning import load
from taste_cl.tuning.load import LoadMeter, load_bucket


def test_reads_the_kernel_counters_at_most_every_min_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(load.time, "monotonic", lambda: clock[0])
    meter = LoadMeter(min_interval=0.25)
    # 2 cores; between samples the system was busy 0.3 s of which this process used 0.1 s
    samples = iter([(100.3, 10.3, 5.1), (100.9, 11.5, 5.2)])
    calls = []

    def sample() -> tuple[float, float, float]:
        calls.append(clock[0])
        return next(samples)

    monkeypatch.setattr(meter, "_last", (100.0, 10.0, 5.0))
    monkeypatch.setattr(meter, "_sample", sample)
    clock[0] = 100.1
    assert meter.read() == 0.0 and calls == []  # too soon: the previous reading (none yet: 0)
    clock[0] = 100.3
    assert meter.read() == pytest.approx(0.2 / (0.3 * 2))  # foreign 0.3 - 0.1 s over 0.3 s x 2 cores
    clock[0] = 100.5
    assert meter.read() == pytest.approx(1 / 3) and len(calls) == 1  # cached
    clock[0] = 100.9
    assert meter.read() == pytest.approx(min(1.0, (1.2 - 0.1) / (0.6 * 2))) and len(calls) == 2


def test_load_buckets() -> None:
    assert [load_bucket(f) for f in (0.0, 0.3, 0.9)] == ["idle", "busy", "saturated"]
