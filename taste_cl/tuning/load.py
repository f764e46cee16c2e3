"""How busy the machine is with *other* work, measured without sleeping, and whether that shifted.

Training itself keeps the CPU busy, so system-wide utilisation says little; what
matters to the batch-size tuner is the share of CPU taken by other processes since
the last reading (system busy time minus this process's own CPU time), and its own
training rate: :class:`LoadShiftDetector` compares both with their level after a tune.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import psutil

__all__ = ["LoadMeter", "LoadShift", "LoadShiftDetector", "load_bucket"]


def load_bucket(foreign_load: float) -> str:
    """Coarse level of a foreign-load fraction (0..1 of all cores): ``idle``, ``busy`` or ``saturated``."""
    return "idle" if foreign_load < 0.25 else "busy" if foreign_load < 0.75 else "saturated"


class LoadMeter:
    """Fraction of all cores used by other processes between two readings.

    The kernel counts CPU time in ticks (10 ms here), so a reading over a few
    milliseconds is noise, and each one costs two ``/proc`` reads (a quarter of a small
    model's ``observe``). :meth:`read` therefore measures again only after
    ``min_interval`` seconds and returns the last reading in between.
    """

    def __init__(self, min_interval: float = 0.25) -> None:
        self.min_interval = min_interval
        self._process = psutil.Process()
        self._cores = psutil.cpu_count(logical=True) or 1
        self._last = self._sample()
        self._reading = 0.0

    def _sample(self) -> tuple[float, float, float]:
        system = psutil.cpu_times()
        busy = sum(system) - system.idle - getattr(system, "iowait", 0.0)
        own = self._process.cpu_times()
        return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system

    def read(self) -> float:
        """Foreign load since the previous measurement (or construction), clipped to [0, 1];
        the previous reading while less than ``min_interval`` seconds have passed."""
        if time.monotonic() - self._last[0] < self.min_interval:
            return self._reading
        now = self._sample()
        wall = now[0] - self._last[0]
        foreign = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self._last = now
        self._reading = min(1.0, max(0.0, foreign / (wall * self._cores))) if wall > 0 else 0.0
        return self._reading


@dataclass(frozen=True)
class LoadShift:
    """A shift :class:`LoadShiftDetector` found: why, the median rate over its baseline, and the foreign-load bucket now."""

    reason: str
    ratio: float
    bucket: str


class LoadShiftDetector:
    """Whether the machine's load shifted since the last (re)tune, from two signals: the training
    rate of this process's steps, and other processes' share of the CPU (read from ``meter`` at
    each step).

    The medians over the first ``window`` steps after :meth:`reset` are the baseline; later
    windows are compared with it by :meth:`check`.
    """

    def __init__(self, window: int, meter: LoadMeter) -> None:
        self.meter = meter
        self._rates: deque[float] = deque(maxlen=window)
        self._foreign: deque[float] = deque(maxlen=window)
        self._baseline: tuple[float, str] | None = None  # (rate, bucket); None until calibrated after a tune

    @property
    def calibrated(self) -> bool:
        """Whether the baseline has been taken since the last :meth:`reset`."""
        return self._baseline is not None

    def add(self, rate: float) -> None:
        """One step's training rate (samples/s), with the foreign load now."""
        self._rates.append(rate)
        self._foreign.append(self.meter.read())

    def reset(self) -> None:
        """Forget the steps and the baseline (after a tune the plan, and so the rate, changed)."""
        self._rates.clear()
        self._foreign.clear()
        self._baseline = None

    def check(self, tolerance: float) -> LoadShift | None:
        """Once a full window has been seen: the first time after :meth:`reset`, take it as the baseline;
        later, a median rate more than ``tolerance`` off the baseline (``1 + tolerance`` times slower or
        faster), or another :func:`load_bucket` of the median foreign load, is a shift."""
        if len(self._rates) < (self._rates.maxlen or 0):
            return None
        rate = statistics.median(self._rates)
        bucket = load_bucket(statistics.median(self._foreign))
        if self._baseline is None:
            self._baseline = (rate, bucket)
            return None
        base_rate, base_bucket = self._baseline
        ratio = rate / base_rate
        if ratio < 1 / (1 + tolerance) or ratio > 1 + tolerance:
            return LoadShift(f"load shift: training rate {rate:.0f} samples/s vs baseline {base_rate:.0f} (x{ratio:.2f})", ratio, bucket)
        if bucket != base_bucket:
            return LoadShift(f"load shift: foreign CPU load went from {base_bucket} to {bucket}", ratio, bucket)
        return None
