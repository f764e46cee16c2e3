"""How busy the machine is with *other* work, measured without sleeping.

Training itself keeps the CPU busy, so system-wide utilisation says little; what
matters to the batch-size tuner is the share of CPU taken by other processes since
the last reading (system busy time minus this process's own CPU time).
"""

from __future__ import annotations

import time

import psutil

__all__ = ["LoadMeter", "load_bucket"]


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
