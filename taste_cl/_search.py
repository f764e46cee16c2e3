"""The tuner's search: Bayesian optimisation of log-throughput over a grid of
(batch size, thread count) points, with scikit-optimize's ask/tell ``Optimizer``.

A point that fails to train is infeasible (never proposed again); a size that runs out
of memory takes every larger size at that thread count with it. Suggestions the search
has already measured are replaced by the nearest unmeasured feasible point, and a search
that keeps insisting on known points has converged.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable

__all__ = ["GridSearch", "Point", "best_point"]

Point = tuple[int, int]  # (batch size, threads)
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "defaultcpuallocator")


class GridSearch:
    """Ask/tell search over ``batches x threads``; every measurement goes through :meth:`record`."""

    def __init__(self, batches: list[int], threads: list[int], *, per_octave: int, seed: int) -> None:
        from skopt import Optimizer  # imported here: `import taste_cl` stays light
        from skopt.learning import GaussianProcessRegressor
        from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern
        from skopt.space import Integer

        self.batches, self.threads = batches, threads
        dims = [Integer(0, len(batches) - 1)] + ([Integer(0, len(threads) - 1)] if len(threads) > 1 else [])
        # Fixed hyperparameters: correlation over about an octave of batch sizes and one thread
        # step (skopt normalises each axis to [0, 1]). Fitting them from a handful of points is
        # unreliable and cost 0.3 s per probe.
        scales = [per_octave / max(1, len(batches) - 1)] + ([1 / (len(threads) - 1)] if len(threads) > 1 else [])
        kernel = ConstantKernel(1.0, "fixed") * Matern(length_scale=scales, length_scale_bounds="fixed", nu=2.5)
        surrogate = GaussianProcessRegressor(kernel=kernel, normalize_y=True, noise=0.2, optimizer=None)
        self._optimizer = Optimizer(
            dims,
            base_estimator=surrogate,
            n_initial_points=1,  # the initial design is ours (:meth:`initial_design`), told before any ask
            acq_func="EI",
            random_state=seed,
            model_queue_size=1,
            avoid_duplicates=False,
            acq_optimizer="sampling",  # a grid of a few dozen points: 10,000 samples is waste
            acq_optimizer_kwargs={"n_points": 8 * len(batches) * len(threads)},
        )
        self._told = 0
        self._known: set[Point] = set()
        self.rates: dict[Point, list[float]] = {}
        self.infeasible: dict[Point, str] = {}

    def initial_design(self, count: int) -> list[Point]:
        """``count`` points spread evenly over the batch axis (smallest first), cycling through thread counts."""
        picks = sorted({min(len(self.batches) - 1, int((i + 0.5) * len(self.batches) / count)) for i in range(count)})
        return [(self.batches[b], self.threads[i % len(self.threads)]) for i, b in enumerate(picks)]

    def _coords(self, point: Point) -> list[int]:
        coords = [self.batches.index(point[0])]
        return coords + ([self.threads.index(point[1])] if len(self.threads) > 1 else [])

    def tell_known(self, observations: list[tuple[int, int, float]]) -> None:
        """Give the surrogate points measured before (the cache), averaged per point."""
        grouped: dict[Point, list[float]] = {}
        for batch, threads, rate in observations:
            if batch in self.batches and threads in self.threads:
                grouped.setdefault((batch, threads), []).append(rate)
        self._known |= set(grouped)
        if grouped:
            points = list(grouped)
            self._optimizer.tell([self._coords(p) for p in points], [-math.log(statistics.fmean(grouped[p])) for p in points])
            self._told += len(points)

    def ask(self) -> Point | None:
        """The surrogate's next point (expected improvement); None before anything was told."""
        if not self._told:
            return None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The objective has been evaluated", category=UserWarning)
            coords = [int(c) for c in self._optimizer.ask()]
        return self.batches[coords[0]], self.threads[coords[1]] if len(coords) > 1 else self.threads[0]

    def nearest_open(self, point: Point) -> Point | None:
        """The unmeasured feasible point nearest ``point`` on the grid, or None if none is left."""
        open_points = [(b, t) for b in self.batches for t in self.threads if (b, t) not in self.rates and (b, t) not in self.infeasible]
        here = self._coords(point)
        return min(open_points, key=lambda p: sum(abs(a - c) for a, c in zip(self._coords(p), here)), default=None)

    def open_neighbour_of_best(self) -> Point | None:
        """An unmeasured feasible grid neighbour of the best point so far (None: it is a local optimum)."""
        if not self.rates:
            return None
        best = max(self.rates, key=lambda p: statistics.fmean(self.rates[p]))
        b, t = self.batches.index(best[0]), self.threads.index(best[1])
        around = [(b + 1, t), (b - 1, t), (b, t + 1), (b, t - 1)]
        for i, j in around:
            if 0 <= i < len(self.batches) and 0 <= j < len(self.threads):
                point = (self.batches[i], self.threads[j])
                if point not in self.rates and point not in self.infeasible:
                    return point
        return None

    def record(self, point: Point, measure: Callable[[], float], *, fit: bool) -> float | None:
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
            if self.rates:  # the surrogate learns a cliff there
                self._optimizer.tell(self._coords(point), -math.log(min(min(r) for r in self.rates.values()) / 4), fit=fit)
                self._told += 1
            return None
        self.rates.setdefault(point, []).append(rate)
        self._optimizer.tell(self._coords(point), -math.log(rate), fit=fit)
        self._told += 1
        return rate

    def best(self) -> Point | None:
        """The measured point (this search's or told as known) with the best *surrogate*
        log-throughput: the GP smooths measurement noise across neighbouring sizes, so one
        lucky probe on a busy machine does not win alone."""
        from sklearn.base import clone

        points = sorted(self._known | set(self.rates))
        if not points:
            return None
        optimizer = self._optimizer
        surrogate = clone(optimizer.base_estimator_).fit(optimizer.space.transform(optimizer.Xi), optimizer.yi)
        predicted = surrogate.predict(optimizer.space.transform([self._coords(p) for p in points]))
        return points[int(predicted.argmin())]  # y is -log(samples/s)

    def best_rate(self) -> float | None:
        return max((statistics.fmean(r) for r in self.rates.values()), default=None)


def best_point(observations: list[tuple[int, int, float]]) -> tuple[Point, float]:
    """The point with the highest mean rate (repeats average out noise)."""
    grouped: dict[Point, list[float]] = {}
    for batch, threads, rate in observations:
        grouped.setdefault((batch, threads), []).append(rate)
    point = max(grouped, key=lambda p: statistics.fmean(grouped[p]))
    return point, statistics.fmean(grouped[point])
