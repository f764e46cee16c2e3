"""The tuner's search: a Gaussian process on log-throughput over the grid of (batch size,
thread count) points, probed where the expected improvement per (square-root) second of probing is highest.

The grid has at most a few hundred points, so the posterior is computed exactly on every one
of them (numpy, no sampling, no randomness). Coordinates are octaves of batch size and steps
of thread count; the kernel is Matern 5/2 with a fixed length of one octave and one thread
step (fitting length scales from a handful of points is unreliable); the prior mean and
amplitude come from the measured log-rates, and a noise term (shrinking with repeats) keeps
one lucky probe from winning alone: the answer is the measured point with the highest
posterior mean.

A point that fails to train is infeasible (never proposed again; the surrogate learns a cliff
there); a size that runs out of memory takes every larger size at that thread count with it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import numpy as np

__all__ = ["NOISE", "GridSearch", "Point"]

Point = tuple[int, int]  # (batch size, threads)
NOISE = 0.1  # standard deviation of one probe's log-rate (about 10 %: a shared CPU's load moves between probes)
_MIN_AMPLITUDE = 0.2  # prior spread of log-rate away from the data, at least (about 20 %)
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator")


def _matern52(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    r = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) * math.sqrt(5)
    return (1 + r + r * r / 3) * np.exp(-r)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


class GridSearch:
    """Surrogate-guided search over ``batches x threads``; every measurement goes through :meth:`record`."""

    def __init__(self, batches: list[int], threads: list[int], *, per_octave: int, noise: float = NOISE) -> None:
        self.batches, self.threads, self.noise = batches, threads, noise
        self.points: list[Point] = [(b, t) for t in threads for b in batches]
        self._index = {p: i for i, p in enumerate(self.points)}
        self._coords = np.array([[i / per_octave, j] for j in range(len(threads)) for i in range(len(batches))], dtype=float)
        self.rates: dict[Point, list[float]] = {}  # measured by this search
        self.known: dict[Point, list[float]] = {}  # told from earlier tunes (the cache)
        self.infeasible: dict[Point, str] = {}
        self._cliffs: set[Point] = set()  # failed points the surrogate is told are much slower

    def initial_design(self, count: int, *, reach: float = 0.5) -> list[Point]:
        """``count`` points spread evenly (log scale) from the smallest batch to ``reach`` of the
        way up the range, cycling through thread counts: the cheap end first, the surrogate climbs from there."""
        top = (len(self.batches) - 1) * reach
        picks = sorted({round(i * top / max(1, count - 1)) for i in range(count)})
        return [(self.batches[b], self.threads[i % len(self.threads)]) for i, b in enumerate(picks)]

    def tell_known(self, observations: list[tuple[int, int, float]]) -> None:
        """Give the surrogate points measured before (the cache)."""
        for batch, threads, rate in observations:
            if (batch, threads) in self._index:
                self.known.setdefault((batch, threads), []).append(rate)

    def _measured(self) -> dict[Point, list[float]]:
        merged = {p: list(r) for p, r in self.known.items()}
        for point, rates in self.rates.items():
            merged.setdefault(point, []).extend(rates)
        return merged

    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of log samples/s at every grid point (``self.points`` order)."""
        measured = self._measured()
        if not measured:
            raise ValueError("no measurements yet")
        logs = {p: [math.log(r) for r in rates] for p, rates in measured.items()}
        means = np.array([statistics.fmean(v) for v in logs.values()])
        octaves = self._coords[[self._index[p] for p in logs], 0]
        trend = self._trend(octaves, means)
        residuals = means - trend(octaves)
        amplitude = max(float(residuals.std()), _MIN_AMPLITUDE)
        cliff = float(means.min()) - math.log(4)
        told = list(logs) + [p for p in self._cliffs if p not in logs]
        x = self._coords[[self._index[p] for p in told]]
        y = np.concatenate([means, np.full(len(told) - len(logs), cliff)]) - trend(x[:, 0])
        noise = [self.noise**2 / len(v) for v in logs.values()] + [self.noise**2] * (len(told) - len(logs))
        gram = amplitude**2 * _matern52(x, x) + np.diag(noise)
        cross = amplitude**2 * _matern52(self._coords, x)
        factor = np.linalg.cholesky(gram)
        alpha = np.linalg.solve(factor.T, np.linalg.solve(factor, y))
        v = np.linalg.solve(factor, cross.T)
        mean = trend(self._coords[:, 0]) + cross @ alpha
        std = np.sqrt(np.clip(amplitude**2 - (v * v).sum(0), 1e-12, None))
        return mean, std

    @staticmethod
    def _trend(octaves: np.ndarray, logs: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """The prior mean: log-rate linear in octaves of batch size, fitted to the measured points
        (constant with one batch size). Throughput still rising where the search has looked is
        extrapolated rising, so the surrogate looks further up instead of assuming a plateau."""
        if np.ptp(octaves) == 0:
            level = float(logs.mean())
            return lambda o: np.full(len(o), level)
        slope, intercept = np.polyfit(octaves, logs, 1)
        return lambda o: intercept + slope * o

    def predicted_rate(self, point: Point) -> float:
        """The surrogate's samples/s at ``point`` (its neighbours temper one lucky or unlucky probe)."""
        mean, _ = self.posterior()
        return math.exp(mean[self._index[point]])

    def best(self) -> Point | None:
        """The measured point (this search's or told as known) with the highest posterior mean."""
        measured = self._measured()
        if not measured:
            return None
        mean, _ = self.posterior()
        return max(measured, key=lambda p: mean[self._index[p]])

    def suggest(
        self, cost: Callable[[Point, float], float], *, min_gain: float, budget: float = math.inf, max_batch: float = math.inf
    ) -> Point | None:
        """The open point with the highest expected improvement per square root of the seconds its
        probe takes, among those expected to improve the best log-rate by at least ``min_gain``,
        whose probe fits in ``budget`` seconds and whose batch is at most ``max_batch``; None when
        none is (converged, or out of budget). Per second, the search climbs in many small, cheap
        steps whose total costs more than one long stride; the square root favours cheap probes less.

        ``cost(point, predicted_rate)`` estimates the seconds a probe at ``point`` takes.
        """
        measured = self._measured()
        open_points = [p for p in self.points if p not in measured and p not in self.infeasible and p[0] <= max_batch]
        if not measured or not open_points:
            return None
        mean, std = self.posterior()
        incumbent = max(mean[self._index[p]] for p in measured)
        rows = [self._index[p] for p in open_points]
        mu, sigma = mean[rows], std[rows]
        z = (mu - incumbent) / sigma
        gain = (mu - incumbent) * _normal_cdf(z) + sigma * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        worth = []
        for g, m, p in zip(gain, mu, open_points):
            seconds = cost(p, math.exp(m))
            if g >= min_gain and seconds <= budget:
                worth.append((g / math.sqrt(seconds), p))
        return max(worth)[1] if worth else None

    def climb_limit(self, stride: float, *, steep_stride: float, steep_slope: float) -> float:
        """The largest batch worth probing next: ``stride`` times the largest measured, or
        ``steep_stride`` times while log-rate still rises more than ``steep_slope`` per octave
        between the two largest measured sizes. The surrogate extrapolates poorly beyond its
        data and a probe's seconds grow with its size, except on a curve far below its ceiling,
        where a larger batch costs less per sample."""
        logs: dict[int, list[float]] = {}
        for (batch, _), rates in self._measured().items():
            logs.setdefault(batch, []).extend(math.log(r) for r in rates)
        sizes = sorted(logs)
        if len(sizes) >= 2:
            slope = (statistics.fmean(logs[sizes[-1]]) - statistics.fmean(logs[sizes[-2]])) / math.log2(sizes[-1] / sizes[-2])
            if slope > steep_slope:
                return steep_stride * sizes[-1]
        return stride * sizes[-1] if sizes else math.inf

    def sweep_cost(self, cost: Callable[[Point, float], float]) -> float:
        """Predicted seconds to probe every feasible point once (measured: at its measured rate)."""
        mean, _ = self.posterior()
        measured = self._measured()
        return sum(
            cost(p, statistics.fmean(measured[p]) if p in measured else math.exp(mean[self._index[p]]))
            for p in self.points
            if p not in self.infeasible
        )

    def neighbour_to_probe(self, point: Point) -> Point:
        """The unmeasured feasible grid neighbour of ``point`` (one batch or thread step away) with the
        highest posterior mean; ``point`` itself when every neighbour is measured (a repeat sharpens it)."""
        b, t = self.batches.index(point[0]), self.threads.index(point[1])
        around = [(b + 1, t), (b - 1, t), (b, t + 1), (b, t - 1)]
        measured = self._measured()
        open_points = [
            (self.batches[i], self.threads[j])
            for i, j in around
            if 0 <= i < len(self.batches)
            and 0 <= j < len(self.threads)
            and (self.batches[i], self.threads[j]) not in measured
            and (self.batches[i], self.threads[j]) not in self.infeasible
        ]
        if not open_points:
            return point
        mean, _ = self.posterior()
        return max(open_points, key=lambda p: mean[self._index[p]])

    def record(self, point: Point, measure: Callable[[], float]) -> float | None:
        """Measure ``point``; on failure mark it (and, for memory errors, larger batches) infeasible."""
        try:
            rate = measure()
            if not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"measured {rate!r} samples/s")
        except Exception as error:  # noqa: BLE001 - the user's model may raise anything at a size
            reason = f"{type(error).__name__}: {str(error)[:200]}"
            oom = isinstance(error, MemoryError) or any(word in str(error).lower() for word in _OOM_WORDS)
            for batch in self.batches:
                if batch == point[0] or (oom and batch > point[0]):
                    self.infeasible.setdefault((batch, point[1]), reason)
            self._cliffs.add(point)
            return None
        self.rates.setdefault(point, []).append(rate)
        return rate

    def best_rate(self) -> float | None:
        """The highest mean rate measured so far (this search and the cache)."""
        return max((statistics.fmean(r) for r in self._measured().values()), default=None)
