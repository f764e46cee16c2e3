"""The batch-size tuner's search side: which probes to run, and what they decide.

:class:`ProbeSearch` drives a :class:`Prober` (real training steps:
:class:`~taste_cl.tuning.probe.ProbeRunner`; simulated ones: the offline replay of
``taste-cl bench tuner-replay``) over the grid of (batch size, threads) with the surrogate
of :mod:`.search`, and returns a :class:`TuningResult`:

- cold: the smallest trainable batch, a cheap initial design, then surrogate-guided probes
  within a budget of seconds;
- warm (cached observations): one quick staleness check of the cached surface, then probes
  of the cached best's neighbours;
- confirmations: the anchor measured beside a smaller best before a plan splits it, and
  fixed-work windows that decide whether more threads pay over the same work.

The plugin (:class:`~taste_cl.tuning.tuner.BatchSizeTuner`) prepares the probes (a private
copy of the model, the cache key, the memory limit) and applies the answer. Probes are
passed in, not built here, so nothing in this module needs torch itself.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from taste_cl._checks import check_int
from taste_cl.exceptions import TuningError, TuningWarning
from taste_cl.tuning.cache import MAX_SAMPLES_PER_S, CachedSurface, SurrogateCache, check_observations
from taste_cl.tuning.search import GridSearch, Point

__all__ = [
    "ProbeSearch",
    "Prober",
    "TuningError",
    "TuningResult",
    "TuningWarning",
    "candidate_batch_sizes",
    "check_tuner_options",
    "result_from_state",
    "split_plan",
    "thread_options",
    "timed_rate",
]

logger = logging.getLogger(__name__)
Observation = tuple[int, int, float]  # (batch size, threads, samples/s)
_STALE_RATIO = 2.5  # a re-measured incumbent this far from its cached rate invalidates the cache
_STOP_BELOW = 0.8  # a probe already this far below the best rate stops early
_BUDGET = 0.2  # a cold tune's surrogate-guided probes stop within this share of a full sweep's predicted seconds
_STRIDE = 2**1.5  # a probe at most 1.5 octaves above the largest size measured (cost grows with size) ...
_STEEP_STRIDE, _STEEP_SLOPE = 4.0, 0.25  # ... or 2 octaves while the rate still rises over 28 % per octave there
_REACH = 0.7  # the initial design spans the cheapest 70 % of the candidates (octaves)
_MIN_GAIN = 0.02  # a probe must be expected to raise the best log-rate by this much (about 2 %)
_CONFIRM_ROUNDS = 3  # interleaved windows of work in which more threads must beat one thread
_SPLIT_GAIN = 1.1  # micro-batches must beat one effective-batch step by this factor to be used


@dataclass(frozen=True)
class TuningResult:
    """The outcome of one tune: the chosen batch (and threads) and how they were found.

    ``probes`` are ``(batch, threads, samples/s)`` measured by this tune; ``infeasible``
    the ``(batch, threads, reason)`` that failed to train; ``top_samples_per_s`` the rate
    at the largest candidate (the anchor) and the chosen threads, if measured.
    """

    batch_size: int
    samples_per_s: float
    probes: list[tuple[int, int, float]]
    seconds: float
    warm: bool
    key: str
    candidates: list[int] = field(default_factory=list)
    threads: int = 1
    min_batch_size: int = 1
    infeasible: list[tuple[int, int, str]] = field(default_factory=list)
    top_samples_per_s: float | None = None

    def predicted_step_time(self) -> float:
        """Seconds one training step at ``batch_size`` should take."""
        return self.batch_size / self.samples_per_s


def result_from_state(saved: Any) -> TuningResult:
    """A :class:`TuningResult` from checkpoint values, each checked (ValueError naming the field)."""
    names = set(TuningResult.__dataclass_fields__)
    if not isinstance(saved, dict) or set(saved) != names:
        raise ValueError(f"tuner state result must have exactly the keys {sorted(names)}")
    for label in ("batch_size", "threads", "min_batch_size"):
        check_int(f"tuner state result.{label}", saved[label], 1)
    probes = check_observations([list(p) for p in saved["probes"]] if isinstance(saved["probes"], (list, tuple)) else None, limit=4096)
    for label in ("samples_per_s", "seconds"):
        value = saved[label]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"tuner state result.{label} must be a finite number >= 0; got {value!r}")
    if not isinstance(saved["key"], str) or not isinstance(saved["warm"], bool):
        raise ValueError("tuner state result.key must be a str and result.warm a bool")  # noqa: TRY004 - one error type for bad state
    candidates = saved["candidates"]
    if not isinstance(candidates, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in candidates):
        raise ValueError("tuner state result.candidates must be a list of ints >= 1")
    infeasible = saved["infeasible"]
    if not isinstance(infeasible, list) or not all(isinstance(i, (list, tuple)) and len(i) == 3 for i in infeasible):
        raise ValueError("tuner state result.infeasible must be a list of (batch, threads, reason)")
    top = saved["top_samples_per_s"]
    if top is not None and (isinstance(top, bool) or not isinstance(top, (int, float)) or not 0 < top <= MAX_SAMPLES_PER_S):
        raise ValueError(f"tuner state result.top_samples_per_s must be None or a rate in (0, {MAX_SAMPLES_PER_S:g}]; got {top!r}")
    return TuningResult(
        saved["batch_size"],
        float(saved["samples_per_s"]),
        probes,
        float(saved["seconds"]),
        saved["warm"],
        saved["key"],
        list(candidates),
        saved["threads"],
        saved["min_batch_size"],
        [(int(b), int(t), str(r)) for b, t, r in infeasible],
        None if top is None else float(top),
    )


def split_plan(result: TuningResult, effective: int, *, smallest: int = 1) -> tuple[int, int] | None:
    """``(micro_batch, accumulation_steps)`` that split a step of ``effective`` samples into balanced
    micro-batches of at most the tuned size (but at least ``smallest``), or None when one step of
    ``effective`` is as fast: the tuned size must be smaller and at least ``_SPLIT_GAIN`` (10 %)
    faster than the anchor measured."""
    top = result.top_samples_per_s
    size = max(result.batch_size, smallest)
    if size >= effective or (top is not None and result.samples_per_s < _SPLIT_GAIN * top):
        return None
    accumulation = math.ceil(effective / size)
    return max(math.ceil(effective / accumulation), result.min_batch_size), accumulation


def check_tuner_options(
    *,
    max_batch_size: Any,
    n_calls: Any,
    n_initial_points: Any,
    warm_calls: Any,
    per_octave: Any,
    calibration_window: Any,
    min_retune_interval: Any,
    probe_samples: Any,
    load_tolerance: Any,
    min_probe_time: Any,
) -> None:
    """The search and load-meter options both tuners take (the torch plugin and the device one):
    ``ValueError`` naming the first bad one, its rule and value."""
    for label, value, low in (
        ("max_batch_size", max_batch_size, 1),
        ("n_calls", n_calls, 1),
        ("n_initial_points", n_initial_points, 1),
        ("warm_calls", warm_calls, 1),
        ("per_octave", per_octave, 1),
        ("calibration_window", calibration_window, 2),
        ("min_retune_interval", min_retune_interval, 0),
        ("probe_samples", probe_samples, 1),
    ):
        check_int(label, value, low)
    for label, number in (("load_tolerance", load_tolerance), ("min_probe_time", min_probe_time)):
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
            raise ValueError(f"`{label} == {number!r}`, must be a finite number > 0")


def candidate_batch_sizes(max_batch_size: int, *, per_octave: int = 4, min_batch_size: int = 1) -> list[int]:
    """Distinct integers spaced ``per_octave`` to a doubling from ``min_batch_size`` to ``max_batch_size``."""
    if min_batch_size < 1 or max_batch_size < min_batch_size:
        raise ValueError(f"need 1 <= min_batch_size <= max_batch_size; got {min_batch_size}, {max_batch_size}")
    steps = math.log2(max_batch_size / min_batch_size) * per_octave
    sizes = {round(min_batch_size * 2 ** (k / per_octave)) for k in range(math.floor(steps) + 1)}
    return sorted(sizes | {max_batch_size})


class Prober(Protocol):
    """What the search needs of its probes (see :class:`~taste_cl.tuning.probe.ProbeRunner`)."""

    def measure(
        self, batch_size: int, *, threads: int | None = None, min_time: float = 0.15, min_steps: int = 3, stop_below: float | None = None
    ) -> float:
        """Training samples/s at ``batch_size`` (raises what the model raises)."""
        ...

    def work(self, batch_size: int, steps: int, *, threads: int | None = None, max_seconds: float = math.inf) -> tuple[int, float]:
        """``(steps done, seconds)`` of a fixed amount of work at ``batch_size``."""
        ...

    def smallest_trainable(self, limit: int) -> tuple[int, list[tuple[int, str]]]:
        """The smallest batch of 1, 2, 4, ... that trains, and the failures before it."""
        ...


@dataclass(frozen=True)
class ProbeSearch:
    """One tuner's search settings (see :class:`~taste_cl.tuning.tuner.BatchSizeTuner` for each),
    its cache, and the clock that times a tune."""

    cache: SurrogateCache
    n_calls: int
    n_initial_points: int
    warm_calls: int
    per_octave: int
    min_probe_time: float
    tune_threads: bool
    clock: Callable[[], float]

    def run(
        self, runner: Prober, *, key: str, limit: int, threads: list[int], current_threads: int, anchor: int | None, started: float
    ) -> TuningResult:
        """The best batch size (and threads) of ``threads`` up to ``limit``, from the cache under ``key``
        and fresh probes; the new observations are cached. ``current_threads`` is the count probes
        run at when threads are not tuned; ``anchor`` (a plan's effective batch) is always measured;
        ``started`` is the :attr:`clock` reading the tune began at. Raises :class:`TuningError`
        when no size trains."""
        cached = self.cache.load(key)
        infeasible: list[tuple[int, int, str]] = []
        minimum = cached.min_batch_size if cached is not None else self.smallest_trainable(runner, limit, current_threads, infeasible)
        candidates = candidate_batch_sizes(max(limit, minimum), per_octave=self.per_octave, min_batch_size=minimum)
        known = [o for o in cached.observations if o[0] in candidates and o[1] in threads] if cached else []
        search, known, checks = self.search(runner, candidates, threads, known, anchored=anchor is not None)
        if anchor is not None and not known:  # a warm tune relies on the confirmations cached by its cold one
            self.confirm(search, runner)
        observations = [(b, t, r) for (b, t), rates in search.rates.items() for r in rates]
        if not observations and not known:
            reasons = "; ".join(f"{b}: {why}" for (b, _), why in list(search.infeasible.items())[:3])
            raise TuningError(f"no batch size in {candidates[0]}..{candidates[-1]} trained ({reasons})")
        batch, best_threads = search.best()  # type: ignore[misc]  # something was measured
        if best_threads > 1 and self.tune_threads:
            batch, best_threads = self.threads_that_pay(runner, (batch, best_threads), known + observations)
        rate = statistics.fmean(r for b, t, r in known + observations if (b, t) == (batch, best_threads))
        at_top = [r for b, t, r in known + observations if b == candidates[-1] and t == best_threads]
        if observations:
            self.cache.save(key, CachedSurface(minimum, known + observations))
        infeasible += [(b, t, why) for (b, t), why in search.infeasible.items()]
        result = TuningResult(
            batch,
            rate,
            checks + observations,
            self.clock() - started,
            bool(known),
            key,
            candidates,
            best_threads,
            minimum,
            infeasible,
            statistics.fmean(at_top) if at_top else None,
        )
        logger.info(
            "tuned batch %d x %d threads (%.0f samples/s), %d probes in %.2fs (warm=%s)",
            batch,
            best_threads,
            rate,
            len(observations),
            result.seconds,
            result.warm,
        )
        return result

    @staticmethod
    def smallest_trainable(runner: Prober, limit: int, threads: int, infeasible: list[tuple[int, int, str]]) -> int:
        """The smallest batch (1, 2, 4, ...) one training step works at (BatchNorm: 2); the sizes
        that failed go to ``infeasible`` at ``threads``."""
        batch, failures = runner.smallest_trainable(limit)
        infeasible += [(b, threads, why) for b, why in failures]
        if not batch:
            raise TuningError(f"the model did not train at any batch size from 1 to {limit}: {failures[-1][1]}")
        return batch

    def search(
        self, runner: Prober, candidates: list[int], threads: list[int], known: list[Observation], *, anchored: bool
    ) -> tuple[GridSearch, list[Observation], list[Observation]]:
        """Warm: one quick staleness check of the cached surface (off by 2.5x: dropped, tune cold;
        otherwise the check does not move the cached answer), then ``warm_calls - 1`` probes of
        the cached best's unmeasured neighbours (or of the best again);
        cold: a cheap initial design, then surrogate-guided probes, ``n_calls`` in all.
        Returns the search, the cached observations used, and the warm check."""
        search = GridSearch(candidates, threads, per_octave=self.per_octave)
        if known:
            search.tell_known(known)
            best = search.best() or known[0][:2]  # known is not empty: best() is never None here
            batch, t = self._check_point(search, best)
            cached_rate = search.predicted_rate((batch, t))
            fresh = self._fresh_rate(runner, batch, t, cached_rate)
            if fresh is not None and 1 / _STALE_RATIO <= fresh / cached_rate <= _STALE_RATIO:
                top = (candidates[-1], best[1])
                if anchored and top not in search.known:
                    search.record(top, lambda: self._check_rate(runner, top[0], top[1]))
                for _ in range(self.warm_calls - 1):
                    point = search.neighbour_to_probe(search.best() or best)
                    search.record(point, functools.partial(self._measure, runner, point, None))
                return search, known, [(batch, t, fresh)]
            logger.info("cached rate %.0f at batch %d is stale (now %s): tuning cold", cached_rate, batch, fresh)
            search = GridSearch(candidates, threads, per_octave=self.per_octave)
        design = search.initial_design(min(self.n_calls, max(self.n_initial_points, len(threads))), reach=_REACH)
        if anchored and (candidates[-1], threads[0]) not in design:
            design.append((candidates[-1], threads[0]))
        self._explore(search, runner, design, self.n_calls)
        return search, [], []

    def _fresh_rate(self, runner: Prober, batch: int, threads: int, cached_rate: float) -> float | None:
        """The staleness check's rate (None: the size no longer trains). A reading off by 2.5x is
        checked once more and the faster kept: a burst of foreign load slows one quick check, a
        lasting change both (it only ever decides whether the cache is used, never the answer)."""
        fresh = None
        for _ in range(2):
            try:
                rate = self._check_rate(runner, batch, threads)
            except Exception:  # noqa: BLE001 - the size no longer trains: the cache is stale
                return None
            fresh = rate if fresh is None else max(fresh, rate)
            if 1 / _STALE_RATIO <= fresh / cached_rate <= _STALE_RATIO:
                break
        return fresh

    def _check_point(self, search: GridSearch, best: Point) -> Point:
        """The cached point a warm tune re-measures: the cheapest to probe among those at the best
        point's thread count within 4x of its rate (a load change shows at every size; the best is
        often the most expensive size to probe)."""
        rates = {p: statistics.fmean(r) for p, r in search.known.items() if p[1] == best[1]}
        near = [p for p, r in rates.items() if r >= rates[best] / 4]
        return min(near, key=lambda p: (self.probe_cost(p, rates[p]), -p[0]))

    def probe_cost(self, point: Point, rate: float) -> float:
        """Seconds a probe at ``point`` takes if it trains at ``rate``: a warm-up step and then three
        steps or ``min_probe_time``, whichever is longer."""
        step = point[0] / rate
        return step + max(3 * step, self.min_probe_time)

    def confirm(self, search: GridSearch, runner: Prober) -> None:
        """Before a plan splits the anchor (largest candidate) into smaller micro-batches, measure
        both twice more, interleaved, so one lucky probe on a busy machine does not decide."""
        best = search.best()
        if best is None:
            return
        top = (search.batches[-1], best[1])
        if best[0] == top[0] or top in search.infeasible:
            return
        for _ in range(2):
            for point in (top, best):
                search.record(point, functools.partial(self._measure, runner, point, None))

    def _explore(self, search: GridSearch, runner: Prober, design: list[Point], calls: int) -> None:
        """Measure ``design``, then the surrogate's suggestions (the highest expected improvement per
        square-root second of probing), ``calls`` probes at most. A suggestion is at most
        1.5 octaves above the largest size measured (2 while the curve still rises steeply there;
        :meth:`GridSearch.climb_limit`) and fits the budget left: ``_BUDGET`` of the seconds the surrogate
        predicts a sweep of every candidate would take (or twice the design's seconds, if more: a
        grid of a few sizes), less the probes' seconds so far. It stops once nothing affordable is
        expected to improve the best by ``_MIN_GAIN``. A size already 20 % slower than the best stops early."""
        design_seconds: float | None = None
        for call in range(calls):
            point: Point | None
            if call < len(design):
                point = design[call]
            elif not search.rates:  # every probe failed
                break
            else:
                spent = sum(self.probe_cost(p, r) for p, rates in search.rates.items() for r in rates)
                design_seconds = spent if design_seconds is None else design_seconds
                budget = max(_BUDGET * search.sweep_cost(self.probe_cost), 2 * design_seconds)
                limit = search.climb_limit(_STRIDE, steep_stride=_STEEP_STRIDE, steep_slope=_STEEP_SLOPE)
                point = search.suggest(self.probe_cost, min_gain=_MIN_GAIN, budget=budget - spent, max_batch=limit)
            if point is None:
                break
            if point in search.rates or point in search.infeasible:
                continue
            best = search.best_rate()
            stop_below = None if best is None else best * _STOP_BELOW
            search.record(point, functools.partial(self._measure, runner, point, stop_below))

    def threads_that_pay(self, runner: Prober, chosen: Point, measured: list[Observation]) -> Point:
        """``chosen`` (more than one thread) if it beats the best one-thread point over the same
        amount of work, else that point. Probes time the lower-quartile step, which suits batch
        sizes; several threads beside a busy neighbour are fast most of the time and, in spells
        of a second or so, 100x slower, which only whole windows of work show."""
        grouped: dict[Point, list[float]] = {}
        for b, t, r in measured:
            grouped.setdefault((b, t), []).append(r)
        means = {p: statistics.fmean(rates) for p, rates in grouped.items()}
        alone = max((p for p in means if p[1] == 1), key=means.__getitem__, default=None)
        if alone is None:
            return chosen
        expected = {p: means[p] for p in (chosen, alone)}
        steps = {p: max(2, math.ceil(self.min_probe_time * expected[p] / p[0])) for p in expected}
        done = dict.fromkeys(expected, 0)
        seconds = dict.fromkeys(expected, 0.0)
        for _ in range(_CONFIRM_ROUNDS):
            for point in expected:
                n, spent = runner.work(point[0], steps[point], threads=point[1], max_seconds=4 * self.min_probe_time)
                done[point] += n * point[0]
                seconds[point] += spent
        rates = {p: done[p] / seconds[p] for p in expected}
        logger.info("threads over the same work: %s", ", ".join(f"{b} x {t}: {r:.0f} samples/s" for (b, t), r in rates.items()))
        return chosen if rates[chosen] > rates[alone] else alone

    def _check_rate(self, runner: Prober, batch: int, threads: int) -> float:
        """A quick rate for a warm tune's checks (within 2.5x is all they need): a quarter of the
        probe time, the faster of two timed steps at least (one step alone was held by the scheduler)."""
        return runner.measure(batch, threads=threads if self.tune_threads else None, min_time=self.min_probe_time / 4, min_steps=2)

    def _measure(self, runner: Prober, point: Point, stop_below: float | None) -> float:
        """A full probe at ``point`` (``min_probe_time``), stopping early below ``stop_below``."""
        return runner.measure(point[0], threads=point[1] if self.tune_threads else None, min_time=self.min_probe_time, stop_below=stop_below)


def timed_rate(step: Callable[[], float], batch_size: int, *, min_time: float, min_steps: int = 3, stop_below: float | None = None) -> float:
    """The probe's timing rule (see :meth:`ProbeRunner.measure`) over ``step``, a callable that runs
    one training step and returns its seconds; shared with the tuner's offline replay."""
    warm = step()
    if stop_below is not None and warm >= min_time / 3 and batch_size / warm < stop_below / 2:
        return batch_size / warm
    times: list[float] = []
    while len(times) < min_steps or sum(times) < min_time:
        times.append(step())
        slow = stop_below is not None and batch_size / _typical(times) < stop_below
        if slow and sum(times) >= min_time / 3:
            break
    return batch_size / _typical(times)


def _typical(times: list[float]) -> float:
    """The lower-quartile step time: on a shared, oversubscribed CPU a step is often held
    for a whole scheduler period, which a median over a few dozen milliseconds still
    catches; the lower quartile keeps the step's own cost and still sees a slowdown that
    hits every step (too many threads under a busy neighbour)."""
    return sorted(times)[len(times) // 4]


def thread_options() -> list[int]:
    """Intra-op thread counts worth trying here: powers of two below the usable cores, and the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sorted({1, cores} | {2**k for k in range(cores.bit_length()) if 2**k < cores})
