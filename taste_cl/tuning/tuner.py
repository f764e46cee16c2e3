"""Throughput-aware batch-size tuning (the TASTE method), for real models and real streams.

Training throughput (samples/s) rises with the batch size up to a ceiling set by the
hardware and often falls beyond it. :class:`BatchSizeTuner` times real training steps of
a private copy of the user's model and optimizer on real samples, and finds the fastest
batch (optionally jointly with torch's intra-op thread count) by Bayesian optimisation
on a Gaussian-process surrogate of log-throughput. Observations are cached on disk per
model, optimizer, hardware and load bucket, so a retune makes one quick check.

As a :class:`~taste_cl.plugins.LearnerPlugin` it changes *how* a step is computed, not
*what* a step is: micro-batches of (at most) the tuned size, accumulated up to the
effective batch (default: the learner's own stream batch plus replay share), the live
learning rates scaled by an optimizer-aware rule when the effective batch changes, and a
freshness bound so stream samples never wait long for a step. A tune that fails leaves
the learner exactly as it was, warns, and is retried later.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from taste_cl._batch import batch_len, index_batch
from taste_cl.plugins import LearnerPlugin
from taste_cl.tuning.cache import (
    MAX_SAMPLES_PER_S,
    CachedSurface,
    SurrogateCache,
    TunerCacheWarning,
    check_observations,
)
from taste_cl.tuning.fingerprint import hardware_fingerprint, model_signature
from taste_cl.tuning.load import LoadMeter, load_bucket
from taste_cl.tuning.probe import (
    ProbeRunner,
    Samples,
    max_batch_for_memory,
    measure_throughput,
    num_threads,
    preserved_rng,
    thread_options,
)
from taste_cl.tuning.search import GridSearch

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner
    from taste_cl.monitor.monitor import MonitorEvent

__all__ = [
    "BatchSizeTuner",
    "SurrogateCache",
    "TunerCacheWarning",
    "TuningError",
    "TuningResult",
    "TuningWarning",
    "candidate_batch_sizes",
    "lr_scale_for",
    "max_batch_for_memory",
    "measure_throughput",
]

logger = logging.getLogger(__name__)
LossFn = Callable[[Any, Any], torch.Tensor]
LrRule = str | Callable[[float], float]
_LINEAR_OPTIMIZERS = (torch.optim.SGD, torch.optim.ASGD)
_LR_RULES = ("auto", "linear", "sqrt", "none")
_STALE_RATIO = 2.5  # a re-measured incumbent this far from its cached rate invalidates the cache
_SPLIT_GAIN = 1.1  # micro-batches must beat one effective-batch step by this factor to be used
_STOP_BELOW = 0.8  # a probe already this far below the best rate stops early
_BUDGET = 0.2  # a cold tune's surrogate-guided probes stop within this share of a full sweep's predicted seconds
_STRIDE = 2**1.5  # a probe at most 1.5 octaves above the largest size measured (cost grows with size) ...
_STEEP_STRIDE, _STEEP_SLOPE = 4.0, 0.25  # ... or 2 octaves while the rate still rises over 28 % per octave there
_REACH = 0.7  # the initial design spans the cheapest 70 % of the candidates (octaves)
_MIN_GAIN = 0.02  # a probe must be expected to raise the best log-rate by this much (about 2 %)
_CONFIRM_ROUNDS = 3  # interleaved windows of work in which more threads must beat one thread


class TuningError(RuntimeError):
    """No batch size could be tuned (every probe failed, or no samples to probe with)."""


class TuningWarning(UserWarning):
    """A (re)tune failed; the learner kept its previous plan and the tuner will retry."""


def candidate_batch_sizes(max_batch_size: int, *, per_octave: int = 4, min_batch_size: int = 1) -> list[int]:
    """Distinct integers spaced ``per_octave`` to a doubling from ``min_batch_size`` to ``max_batch_size``."""
    if min_batch_size < 1 or max_batch_size < min_batch_size:
        raise ValueError(f"need 1 <= min_batch_size <= max_batch_size; got {min_batch_size}, {max_batch_size}")
    steps = math.log2(max_batch_size / min_batch_size) * per_octave
    sizes = {round(min_batch_size * 2 ** (k / per_octave)) for k in range(math.floor(steps) + 1)}
    return sorted(sizes | {max_batch_size})


def lr_scale_for(optimizer: torch.optim.Optimizer, ratio: float, rule: LrRule = "auto") -> float:
    """Learning-rate factor for an effective batch ``ratio`` times the reference one.

    ``"linear"`` (SGD, Goyal et al.), ``"sqrt"`` (Adam family and other adaptive
    optimizers), ``"none"``, or a callable ``ratio -> factor``. ``"auto"``: linear for
    SGD/ASGD, sqrt for every other optimizer.
    """
    if callable(rule):
        factor = float(rule(ratio))
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"lr_rule returned {factor!r} for ratio {ratio}; must be a finite number > 0")
        return factor
    if rule == "auto":
        rule = "linear" if isinstance(optimizer, _LINEAR_OPTIMIZERS) else "sqrt"
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


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


@dataclass(frozen=True)
class _LoadBaseline:
    """Training rate and foreign-load bucket calibrated after a (re)tune."""

    rate: float
    bucket: str


def _int_arg(label: str, value: Any, low: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{label} == {value!r}`, must be an int >= {low}" + (" or None" if optional else ""))


class BatchSizeTuner(LearnerPlugin):
    """Find the training batch size (and optionally thread count) with the highest throughput.

    Parameters
    ----------
    max_batch_size:
        Upper end of the search; lowered further to fit ``memory_budget_bytes``.
    memory_budget_bytes:
        Memory the training step may use; default a quarter of the memory available now.
    n_calls, n_initial_points:
        Probes of a cold tune at most (the first ``n_initial_points`` spread over the cheapest
        70 % of the range, in octaves). It stops sooner when no size within reach (1.5 octaves
        above the largest measured, 2 while the rate still climbs steeply) is expected to gain
        2 %, or when its probes have taken a fifth of the seconds a sweep of every candidate is
        predicted to take.
    warm_calls:
        Probes of a tune that starts from cached observations: the first is a quick check of the
        cheapest cached size near the best (off by more than 2.5x: the cache is dropped and the
        tune runs cold), the others probe the cached best's unmeasured neighbours.
    per_octave:
        Candidate batch sizes per doubling.
    min_probe_time:
        Seconds each probe times at least (at least three steps; clearly slower sizes stop early).
    effective_batch_size:
        Samples per optimizer step. ``None``: the learner's own step (its first stream
        batch plus ``replay_batch_size``), so the tuner changes how a step is computed but
        not what it is. Micro-batches never exceed it.
    lr_rule:
        How learning rates follow the effective batch relative to ``reference_batch_size``:
        ``"auto"`` (linear for SGD, square root for Adam and other adaptive optimizers),
        ``"linear"``, ``"sqrt"``, ``"none"`` or a callable ``ratio -> factor``. The live
        learning rates are rescaled by the ratio of new to old factor at every retune.
    reference_batch_size:
        The batch the optimizer's learning rate was chosen for; default the learner's first
        stream batch plus its replay share.
    max_wait_samples, max_wait_s:
        Freshness bound: a step is forced once this many stream samples wait, or the
        oldest has waited this long (checked at each ``observe``). Default 1 s.
    tune_threads:
        Also tune torch's intra-op thread count (applied with ``torch.set_num_threads``).
    retune_every, retune_on_drift, load_tolerance, calibration_window, min_retune_interval:
        Retune triggers: a schedule in observes, the monitor's ``drift_detected``, and a
        load shift (median training rate off its baseline by more than ``load_tolerance``,
        or the foreign-CPU-load bucket changing), at most once per ``min_retune_interval`` observes.
    probe_samples:
        Real samples kept for probes (tiled to the probed batch size).
    cache_dir:
        Where observations are cached (default ``$TASTE_CL_CACHE_DIR`` or ``~/.cache/taste_cl``).
    """

    name = "batch_size_tuner"

    def __init__(
        self,
        *,
        max_batch_size: int = 1024,
        memory_budget_bytes: float | None = None,
        n_calls: int = 10,
        n_initial_points: int = 3,
        warm_calls: int = 1,
        per_octave: int = 4,
        min_probe_time: float = 0.15,
        effective_batch_size: int | None = None,
        lr_rule: LrRule = "auto",
        reference_batch_size: int | None = None,
        max_wait_samples: int | None = None,
        max_wait_s: float | None = 1.0,
        tune_threads: bool = False,
        retune_every: int | None = None,
        retune_on_drift: bool = True,
        load_tolerance: float = 0.5,
        calibration_window: int = 8,
        min_retune_interval: int = 100,
        probe_samples: int = 256,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
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
            _int_arg(label, value, low)
        for label, size in (
            ("effective_batch_size", effective_batch_size),
            ("reference_batch_size", reference_batch_size),
            ("max_wait_samples", max_wait_samples),
            ("retune_every", retune_every),
        ):
            _int_arg(label, size, 1, optional=True)
        if not callable(lr_rule) and lr_rule not in _LR_RULES:
            raise ValueError(f"`lr_rule == {lr_rule!r}`, must be one of {', '.join(map(repr, _LR_RULES))} or a callable")
        for label, number in (("load_tolerance", load_tolerance), ("min_probe_time", min_probe_time), ("max_wait_s", max_wait_s)):
            if number is not None and (not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0):
                raise ValueError(f"`{label} == {number!r}`, must be a finite number > 0")
        self.max_batch_size = max_batch_size
        self.memory_budget_bytes = memory_budget_bytes
        self.n_calls = n_calls
        self.n_initial_points = n_initial_points
        self.warm_calls = warm_calls
        self.per_octave = per_octave
        self.min_probe_time = min_probe_time
        self.effective_batch_size = effective_batch_size
        self.lr_rule = lr_rule
        self.reference_batch_size = reference_batch_size
        self.max_wait_samples = max_wait_samples
        self.max_wait_s = max_wait_s
        self.tune_threads = tune_threads
        self.retune_every = retune_every
        self.retune_on_drift = retune_on_drift
        self.load_tolerance = load_tolerance
        self.calibration_window = calibration_window
        self.min_retune_interval = min_retune_interval
        self.probe_samples = probe_samples
        self.cache_dir = cache_dir
        self.cache = SurrogateCache(cache_dir)
        self.result_: TuningResult | None = None
        self.reference_: int | None = reference_batch_size
        self.history_: deque[dict[str, Any]] = deque(maxlen=100)  # (re)tunes and failures: when, why, what
        self._base_threads = torch.get_num_threads()  # torch's count before this tuner set any
        self._load_meter = LoadMeter()
        self._rates: deque[float] = deque(maxlen=calibration_window)
        self._foreign: deque[float] = deque(maxlen=calibration_window)
        self._baseline: _LoadBaseline | None = None  # None until calibrated after a tune
        self._pending_reason: str | None = None
        self._recent: Samples | None = None  # real stream samples for probes
        self._observes = 0
        self._last_retune = 0
        self._failures = 0
        self._retry_at = 0

    # ------------------------------------------------------------ standalone
    def tune(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        samples: Samples,
        *,
        foreign_load: float | None = None,
        anchor: int | None = None,
    ) -> TuningResult:
        """Measure and return the best batch size (and threads) for this model on this machine now.

        ``samples`` is ``(x, y)``: real inputs (a tensor, or a dict/tuple/list of tensors)
        and targets, batch first; probes tile them to each probed size. ``anchor`` (the
        effective batch of a plan) caps the search and is always measured, so a plan can
        tell whether smaller micro-batches pay. Nothing passed in is modified. Targets go
        through the task the loss implies, as in :class:`~taste_cl.OnlineLearner` (``(n,)``
        regression targets of an ``(n, 1)`` output are reshaped; targets that would only
        broadcast raise :class:`~taste_cl.exceptions.InvalidBatchError`). Raises
        :class:`TuningError` when no size trains.
        """
        start = time.perf_counter()
        x, y = samples
        if batch_len(x) != batch_len(y):
            raise ValueError(f"samples: x has {batch_len(x)} rows, y has {batch_len(y)}")
        with preserved_rng():
            runner = ProbeRunner(model, optimizer, loss_fn, samples)
            bucket = load_bucket(self._load_meter.read() if foreign_load is None else foreign_load)
            key = self._key(model, optimizer, loss_fn, x, bucket)
            budget = self.memory_budget_bytes
            if budget is None:
                import psutil

                budget = psutil.virtual_memory().available / 4
            limit = min(self.max_batch_size, anchor or self.max_batch_size)
            try:
                limit = min(limit, max_batch_for_memory(runner.model, x, budget_bytes=budget))
            except Exception as error:  # noqa: BLE001 - the probes below find out what trains
                logger.info("no memory estimate (%s); searching up to max_batch_size", error)
            cached = self.cache.load(key)
            infeasible: list[tuple[int, int, str]] = []
            minimum = cached.min_batch_size if cached is not None else self._smallest_trainable(runner, limit, infeasible)
            threads = thread_options() if self.tune_threads else [torch.get_num_threads()]
            candidates = candidate_batch_sizes(max(limit, minimum), per_octave=self.per_octave, min_batch_size=minimum)
            known = [o for o in cached.observations if o[0] in candidates and o[1] in threads] if cached else []
            search, known, checks = self._search(runner, candidates, threads, known, anchor is not None)
            if anchor is not None and not known:  # a warm tune relies on the confirmations cached by its cold one
                self._confirm(search, runner)
        observations = [(b, t, r) for (b, t), rates in search.rates.items() for r in rates]
        if not observations and not known:
            reasons = "; ".join(f"{b}: {why}" for (b, _), why in list(search.infeasible.items())[:3])
            raise TuningError(f"no batch size in {candidates[0]}..{candidates[-1]} trained ({reasons})")
        batch, best_threads = search.best()  # type: ignore[misc]  # something was measured
        if best_threads > 1 and self.tune_threads:
            with preserved_rng():
                batch, best_threads = self._threads_that_pay(runner, (batch, best_threads), known + observations)
        rate = statistics.fmean(r for b, t, r in known + observations if (b, t) == (batch, best_threads))
        at_top = [r for b, t, r in known + observations if b == candidates[-1] and t == best_threads]
        if observations:
            self.cache.save(key, CachedSurface(minimum, known + observations))
        infeasible += [(b, t, why) for (b, t), why in search.infeasible.items()]
        result = TuningResult(
            batch,
            rate,
            checks + observations,
            time.perf_counter() - start,
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

    def _search(
        self, runner: ProbeRunner, candidates: list[int], threads: list[int], known: list[tuple[int, int, float]], anchored: bool
    ) -> tuple[GridSearch, list[tuple[int, int, float]], list[tuple[int, int, float]]]:
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
                    search.record(point, functools.partial(self._measure, runner, point[0], point[1], None, self.min_probe_time))
                return search, known, [(batch, t, fresh)]
            logger.info("cached rate %.0f at batch %d is stale (now %s): tuning cold", cached_rate, batch, fresh)
            search = GridSearch(candidates, threads, per_octave=self.per_octave)
        design = search.initial_design(min(self.n_calls, max(self.n_initial_points, len(threads))), reach=_REACH)
        if anchored and (candidates[-1], threads[0]) not in design:
            design.append((candidates[-1], threads[0]))
        self._explore(search, runner, design, self.n_calls)
        return search, [], []

    def _fresh_rate(self, runner: ProbeRunner, batch: int, threads: int, cached_rate: float) -> float | None:
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

    def _check_point(self, search: GridSearch, best: tuple[int, int]) -> tuple[int, int]:
        """The cached point a warm tune re-measures: the cheapest to probe among those at the best
        point's thread count within 4x of its rate (a load change shows at every size; the best is
        often the most expensive size to probe)."""
        rates = {p: statistics.fmean(r) for p, r in search.known.items() if p[1] == best[1]}
        near = [p for p, r in rates.items() if r >= rates[best] / 4]
        return min(near, key=lambda p: (self._probe_cost(p, rates[p]), -p[0]))

    def _probe_cost(self, point: tuple[int, int], rate: float) -> float:
        """Seconds a probe at ``point`` takes if it trains at ``rate``: a warm-up step and then three
        steps or ``min_probe_time``, whichever is longer."""
        step = point[0] / rate
        return step + max(3 * step, self.min_probe_time)

    def _confirm(self, search: GridSearch, runner: ProbeRunner) -> None:
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
                search.record(point, functools.partial(self._measure, runner, point[0], point[1], None, self.min_probe_time))

    def _explore(self, search: GridSearch, runner: ProbeRunner, design: list[tuple[int, int]], calls: int) -> None:
        """Measure ``design``, then the surrogate's suggestions (the highest expected improvement per
        square-root second of probing), ``calls`` probes at most. A suggestion is at most
        1.5 octaves above the largest size measured (2 while the curve still rises steeply there;
        :meth:`GridSearch.climb_limit`) and fits the budget left: ``_BUDGET`` of the seconds the surrogate
        predicts a sweep of every candidate would take (or twice the design's seconds, if more: a
        grid of a few sizes), less the probes' seconds so far. It stops once nothing affordable is
        expected to improve the best by ``_MIN_GAIN``. A size already 20 % slower than the best stops early."""
        design_seconds: float | None = None
        for call in range(calls):
            point: tuple[int, int] | None
            if call < len(design):
                point = design[call]
            elif not search.rates:  # every probe failed
                break
            else:
                spent = sum(self._probe_cost(p, r) for p, rates in search.rates.items() for r in rates)
                design_seconds = spent if design_seconds is None else design_seconds
                budget = max(_BUDGET * search.sweep_cost(self._probe_cost), 2 * design_seconds)
                limit = search.climb_limit(_STRIDE, steep_stride=_STEEP_STRIDE, steep_slope=_STEEP_SLOPE)
                point = search.suggest(self._probe_cost, min_gain=_MIN_GAIN, budget=budget - spent, max_batch=limit)
            if point is None:
                break
            if point in search.rates or point in search.infeasible:
                continue
            best = search.best_rate()
            stop_below = None if best is None else best * _STOP_BELOW
            search.record(point, functools.partial(self._measure, runner, point[0], point[1], stop_below, self.min_probe_time))

    def _threads_that_pay(self, runner: ProbeRunner, chosen: tuple[int, int], measured: list[tuple[int, int, float]]) -> tuple[int, int]:
        """``chosen`` (more than one thread) if it beats the best one-thread point over the same
        amount of work, else that point. Probes time the lower-quartile step, which suits batch
        sizes; several threads beside a busy neighbour are fast most of the time and, in spells
        of a second or so, 100x slower, which only whole windows of work show."""
        grouped: dict[tuple[int, int], list[float]] = {}
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

    def _check_rate(self, runner: ProbeRunner, batch: int, threads: int) -> float:
        """A quick rate for a warm tune's checks (within 2.5x is all they need): a quarter of the
        probe time, the faster of two timed steps at least (one step alone was held by the scheduler)."""
        return runner.measure(batch, threads=threads if self.tune_threads else None, min_time=self.min_probe_time / 4, min_steps=2)

    def _measure(self, runner: ProbeRunner, batch: int, threads: int, stop_below: float | None, min_time: float) -> float:
        return runner.measure(batch, threads=threads if self.tune_threads else None, min_time=min_time, stop_below=stop_below)

    @staticmethod
    def _smallest_trainable(runner: ProbeRunner, limit: int, infeasible: list[tuple[int, int, str]]) -> int:
        """The smallest batch (1, 2, 4, ...) one training step works at (BatchNorm: 2)."""
        batch, failures = runner.smallest_trainable(limit)
        infeasible += [(b, torch.get_num_threads(), why) for b, why in failures]
        if not batch:
            raise TuningError(f"the model did not train at any batch size from 1 to {limit}: {failures[-1][1]}")
        return batch

    def _key(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, x: Any, bucket: str) -> str:
        """Model, trainable set, input structure, optimizer and loss types, hardware and load bucket."""
        leaves, spec = tree_flatten(x)
        payload = {
            "model": model_signature(model, (), torch.float32),
            "trainable": "".join("1" if p.requires_grad else "0" for p in model.parameters()),
            "inputs": [str(spec), [[list(t.shape[1:]), str(t.dtype)] for t in leaves if isinstance(t, torch.Tensor)]],
            "optimizer": type(optimizer).__name__,
            "loss": type(loss_fn).__name__,
            "threads_tuned": self.tune_threads,
        }
        with num_threads(self._base_threads if self.tune_threads else None):  # key independent of the count it set
            hardware = hardware_fingerprint(load=bucket)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16] + f"-{hardware}"

    # ------------------------------------------------------------ as a plugin
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if self.retune_on_drift:
            learner.monitor.subscribe(self._on_drift, event="drift_detected")

    def _on_drift(self, event: MonitorEvent) -> None:
        self._pending_reason = self._pending_reason or f"stream drift at step {event.step}"

    def on_first_batch(self, learner: OnlineLearner, x: Any, y: Any = None, **kwargs: Any) -> None:
        if self.reference_ is None:
            self.reference_ = batch_len(x) + (learner.replay_batch_size if learner.replay is not None else 0)
        if y is not None:
            keep = torch.arange(min(batch_len(x), self.probe_samples))
            self._recent = (index_batch(x, keep), index_batch(y, keep))
        if self.result_ is None:
            self._retune(learner, "first batch")

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self._observes += 1
        if stats.micro_batches and stats.step_time_s > 0:
            self._rates.append(stats.micro_batches * stats.batch_size / stats.step_time_s)
            self._foreign.append(self._load_meter.read())
        if self._observes < self._retry_at:
            return
        reason = self._pending_reason or self._load_shift_reason(learner)
        if reason is None and self.retune_every and self._observes % self.retune_every == 0:
            reason = f"schedule (every {self.retune_every} observes)"
        if reason is not None:
            self._pending_reason = None
            self._retune(learner, reason)

    def _load_shift_reason(self, learner: OnlineLearner) -> str | None:
        """Compare the recent training rate with its calibrated baseline, and the foreign load bucket."""
        if len(self._rates) < self.calibration_window:
            return None
        if self._baseline is not None and self._observes - self._last_retune < self.min_retune_interval:
            return None
        rate = statistics.median(self._rates)
        bucket = load_bucket(statistics.median(self._foreign))
        if self._baseline is None:  # calibrate both signals over the first window after a tune
            self._baseline = _LoadBaseline(rate, bucket)
            return None
        ratio = rate / self._baseline.rate
        reason = None
        if ratio < 1 / (1 + self.load_tolerance) or ratio > 1 + self.load_tolerance:
            reason = f"load shift: training rate {rate:.0f} samples/s vs baseline {self._baseline.rate:.0f} (x{ratio:.2f})"
        elif bucket != self._baseline.bucket:
            reason = f"load shift: foreign CPU load went from {self._baseline.bucket} to {bucket}"
        if reason is not None:
            learner.monitor.emit("load_shift", ratio=ratio, bucket=bucket)
        return reason

    def _probe_samples(self, learner: OnlineLearner) -> Samples:
        """Real samples: the replay buffer's (its RNG left as it was), else the first stream batch."""
        replay = learner.replay
        stored = 0 if replay is None else len(replay)
        if replay is not None and stored and (self._recent is None or stored >= batch_len(self._recent[0])):
            with preserved_rng(replay):
                return replay.sample(min(stored, self.probe_samples))
        if self._recent is None:
            raise TuningError("no real samples to probe with yet (empty replay buffer and no stream batch since loading)")
        return self._recent

    def plan_for(self, result: TuningResult, optimizer: torch.optim.Optimizer) -> tuple[int, int, float] | None:
        """``(micro_batch, accumulation_steps, lr_scale)`` for ``result``, or None to keep the
        learner's own step (one per ``observe``, the default when it is also the fastest).

        The effective batch goes in one micro-batch unless balanced micro-batches of at most
        the tuned size are at least 10 % faster; a micro-batch never exceeds the effective batch.
        """
        reference = self.reference_ or result.batch_size
        effective = max(self.effective_batch_size or reference, result.min_batch_size)
        top = result.top_samples_per_s
        if result.batch_size >= effective or (top is not None and result.samples_per_s < _SPLIT_GAIN * top):
            if self.effective_batch_size is None:
                return None
            micro, accumulation = effective, 1
        else:
            accumulation = math.ceil(effective / result.batch_size)
            micro = max(math.ceil(effective / accumulation), result.min_batch_size)
        return micro, accumulation, lr_scale_for(optimizer, micro * accumulation / reference, self.lr_rule)

    def _retune(self, learner: OnlineLearner, reason: str) -> None:
        """Tune and apply; on any failure keep the learner as it was, warn, and retry later."""
        try:
            effective = self.effective_batch_size or self.reference_
            result = self.tune(learner.model, learner.optimizer, learner.loss_fn, self._probe_samples(learner), anchor=effective)
            plan = self.plan_for(result, learner.optimizer)
            micro, accumulation, lr_scale = plan if plan is not None else (None, 1, 1.0)
            learner.set_batch_plan(
                micro,
                accumulation_steps=accumulation,
                lr_scale=lr_scale,
                max_wait_samples=self.max_wait_samples,
                max_wait_s=self.max_wait_s,
            )
        except Exception as error:  # noqa: BLE001 - a failed tune must never break observe
            self._failures += 1
            self._retry_at = self._observes + 2 ** min(self._failures, 10)
            self._pending_reason = reason if reason.startswith("retry") else f"retry after a failed tune ({reason})"
            self.history_.append({"step": learner.steps, "reason": reason, "failed": f"{type(error).__name__}: {error}"})
            warnings.warn(
                f"batch-size tuning failed ({reason}): {type(error).__name__}: {error}; the learner keeps its plan "
                f"{learner.batch_plan}; retrying in {self._retry_at - self._observes} observes",
                TuningWarning,
                stacklevel=2,
            )
            return
        if self.tune_threads:
            torch.set_num_threads(result.threads)
        self.result_ = result
        self._failures = 0
        self._last_retune = self._observes
        self._rates.clear()
        self._foreign.clear()
        self._baseline = None
        entry = {
            "step": learner.steps,
            "reason": reason,
            "batch_size": micro or self.reference_,  # what each forward pass now trains on
            "tuned_batch_size": result.batch_size,
            "threads": result.threads,
            "micro_batch_size": micro,
            "accumulation_steps": accumulation,
            "lr_scale": lr_scale,
            "samples_per_s": result.samples_per_s,
            "probes": len(result.probes),
            "seconds": result.seconds,
            "warm": result.warm,
        }
        self.history_.append(entry)
        learner.monitor.emit("retuned", **entry)
        logger.info("retuned at step %d because %s: plan %s", learner.steps, reason, learner.batch_plan)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        result = None if self.result_ is None else asdict(self.result_)
        return {
            "result": result,
            "reference": self.reference_,
            "history": list(self.history_),
            "observes": self._observes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; every field is validated before anything changes
        (``ValueError`` naming the field). The result's observations re-seed a missing cache."""
        if not isinstance(state, dict) or set(state) != {"result", "reference", "history", "observes"}:
            raise ValueError("batch_size_tuner state must have keys result, reference, history, observes")
        result = None if state["result"] is None else _result_from_state(state["result"])
        reference, observes, history = state["reference"], state["observes"], state["history"]
        _int_arg("tuner state reference", reference, 1, optional=True)
        _int_arg("tuner state observes", observes, 0)
        if not isinstance(history, list) or len(history) > 100 or not all(isinstance(h, dict) for h in history):
            raise ValueError("tuner state history must be a list of at most 100 dicts")
        self.result_, self.reference_, self._observes = result, reference, observes
        self.history_.clear()
        self.history_.extend(dict(entry) for entry in history)
        if result is not None and result.probes and not self.cache.path(result.key).exists():
            self.cache.save(result.key, CachedSurface(result.min_batch_size, list(result.probes)))


def _result_from_state(saved: Any) -> TuningResult:
    """A :class:`TuningResult` from checkpoint values, each checked (ValueError naming the field)."""
    names = set(TuningResult.__dataclass_fields__)
    if not isinstance(saved, dict) or set(saved) != names:
        raise ValueError(f"tuner state result must have exactly the keys {sorted(names)}")
    for label in ("batch_size", "threads", "min_batch_size"):
        _int_arg(f"tuner state result.{label}", saved[label], 1)
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
