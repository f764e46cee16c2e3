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

This module is the plugin side (hooks, plans, retune triggers, checkpoint state) and the
preparation of a tune's probes; which probes to run and what they decide is
:class:`~taste_cl.tuning.searcher.ProbeSearch`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from taste_cl._batch import batch_len, index_batch
from taste_cl.learner.batching import replaying_micro_batch
from taste_cl.plugins import LearnerPlugin
from taste_cl.tuning.cache import (
    CachedSurface,
    SurrogateCache,
    TunerCacheWarning,
)
from taste_cl.tuning.fingerprint import hardware_fingerprint, model_signature
from taste_cl.tuning.load import LoadMeter, LoadShiftDetector, load_bucket
from taste_cl.tuning.probe import (
    ProbeRunner,
    Samples,
    max_batch_for_memory,
    measure_throughput,
    num_threads,
    preserved_rng,
    thread_options,
)
from taste_cl.tuning.searcher import (
    ProbeSearch,
    TuningError,
    TuningResult,
    TuningWarning,
    candidate_batch_sizes,
    check_tuner_options,
    result_from_state,
    split_plan,
)

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
    clock:
        The timer probes and tunes read, in seconds (default ``time.perf_counter``). A
        simulator or a test passes its own, so that what the search decides does not
        depend on how busy the machine is.
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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_tuner_options(
            max_batch_size=max_batch_size,
            n_calls=n_calls,
            n_initial_points=n_initial_points,
            warm_calls=warm_calls,
            per_octave=per_octave,
            calibration_window=calibration_window,
            min_retune_interval=min_retune_interval,
            probe_samples=probe_samples,
            load_tolerance=load_tolerance,
            min_probe_time=min_probe_time,
        )
        for label, size in (
            ("effective_batch_size", effective_batch_size),
            ("reference_batch_size", reference_batch_size),
            ("max_wait_samples", max_wait_samples),
            ("retune_every", retune_every),
        ):
            _int_arg(label, size, 1, optional=True)
        if not callable(lr_rule) and lr_rule not in _LR_RULES:
            raise ValueError(f"`lr_rule == {lr_rule!r}`, must be one of {', '.join(map(repr, _LR_RULES))} or a callable")
        wait_ok = max_wait_s is None or (not isinstance(max_wait_s, bool) and isinstance(max_wait_s, (int, float)) and 0 < max_wait_s < math.inf)
        if not wait_ok:
            raise ValueError(f"`max_wait_s == {max_wait_s!r}`, must be a finite number > 0 or None")
        if not callable(clock):
            raise TypeError(f"`clock == {clock!r}`, must be a callable returning seconds")
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
        self.clock = clock
        self.cache = SurrogateCache(cache_dir)
        self.result_: TuningResult | None = None
        self.reference_: int | None = reference_batch_size
        self.history_: deque[dict[str, Any]] = deque(maxlen=100)  # (re)tunes and failures: when, why, what
        self._base_threads = torch.get_num_threads()  # torch's count before this tuner set any
        self._load_meter = LoadMeter()
        self._load_shift = LoadShiftDetector(calibration_window, self._load_meter)
        self._pending_reason: str | None = None
        self._recent: Samples | None = None  # real stream samples for probes
        self._observes = 0
        self._last_retune = 0
        self._failures = 0
        self._retry_at = 0

    # ------------------------------------------------------------ standalone
    def probe_search(self) -> ProbeSearch:
        """The search side with this tuner's current settings and cache: which probes a tune runs
        and what they decide (the offline replay runs it on simulated probes)."""
        return ProbeSearch(
            self.cache,
            n_calls=self.n_calls,
            n_initial_points=self.n_initial_points,
            warm_calls=self.warm_calls,
            per_octave=self.per_octave,
            min_probe_time=self.min_probe_time,
            tune_threads=self.tune_threads,
            clock=self.clock,
        )

    def tune(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        samples: Samples,
        *,
        foreign_load: float | None = None,
        anchor: int | None = None,
        output: Callable[[Any], Any] | None = None,
        call: str = "auto",
    ) -> TuningResult:
        """Measure and return the best batch size (and threads) for this model on this machine now.

        ``samples`` is ``(x, y)``: real inputs (a tensor, or a dict/tuple/list of tensors)
        and targets, batch first; probes tile them to each probed size. ``anchor`` (the
        effective batch of a plan) caps the search and is always measured, so a plan can
        tell whether smaller micro-batches pay. Nothing passed in is modified. Targets go
        through the task the loss implies, as in :class:`~taste_cl.OnlineLearner` (``(n,)``
        regression targets of an ``(n, 1)`` output are reshaped; targets that would only
        broadcast raise :class:`~taste_cl.exceptions.InvalidBatchError`). ``output`` picks
        the trained tensor from the model's output (the learner's ``output``, see
        :mod:`taste_cl.outputs`), ``call`` how a structured input reaches it (the learner's ``call``).
        Raises :class:`TuningError` when no size trains.
        """
        start = self.clock()
        x, y = samples
        if batch_len(x) != batch_len(y):
            raise ValueError(f"samples: x has {batch_len(x)} rows, y has {batch_len(y)}")
        with preserved_rng():
            runner = ProbeRunner(model, optimizer, loss_fn, samples, clock=self.clock, output=output, call=call)
            bucket = load_bucket(self._load_meter.read() if foreign_load is None else foreign_load)
            with num_threads(self._base_threads if self.tune_threads else None):  # key independent of the count it set
                key = _cache_key(model, optimizer, loss_fn, x, hardware_fingerprint(load=bucket), tune_threads=self.tune_threads)
            budget = self.memory_budget_bytes
            if budget is None:
                import psutil

                budget = psutil.virtual_memory().available / 4
            limit = min(self.max_batch_size, anchor or self.max_batch_size)
            try:
                limit = min(limit, max_batch_for_memory(runner.model, x, budget_bytes=budget, call=call))
            except Exception as error:  # noqa: BLE001 - the probes find out what trains
                logger.info("no memory estimate (%s); searching up to max_batch_size", error)
            threads = thread_options() if self.tune_threads else [torch.get_num_threads()]
            return self.probe_search().run(
                runner, key=key, limit=limit, threads=threads, current_threads=torch.get_num_threads(), anchor=anchor, started=start
            )

    # ------------------------------------------------------------ as a plugin
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if self.retune_on_drift:
            learner.monitor.subscribe(self._on_drift, event="drift_detected")

    def _on_drift(self, event: MonitorEvent) -> None:
        self._pending_reason = self._pending_reason or f"stream drift at step {event.step}"

    def on_first_batch(self, learner: OnlineLearner, x: Any, y: Any = None, **kwargs: Any) -> None:
        if self.reference_ is None:
            self.reference_ = batch_len(x) + learner.replay_rows
        if y is not None:
            keep = torch.arange(min(batch_len(x), self.probe_samples))
            self._recent = (index_batch(x, keep), index_batch(y, keep))
        if self.result_ is None:
            self._retune(learner, "first batch")

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self._observes += 1
        if stats.micro_batches and stats.step_time_s > 0:
            self._load_shift.add(stats.micro_batches * stats.batch_size / stats.step_time_s)
        if self._observes < self._retry_at:
            return
        reason = self._pending_reason or self._load_shift_reason(learner)
        if reason is None and self.retune_every and self._observes % self.retune_every == 0:
            reason = f"schedule (every {self.retune_every} observes)"
        if reason is not None:
            self._pending_reason = None
            self._retune(learner, reason)

    def _load_shift_reason(self, learner: OnlineLearner) -> str | None:
        """A load shift since the last tune (emitted to the monitor), at most once per ``min_retune_interval`` observes."""
        if self._load_shift.calibrated and self._observes - self._last_retune < self.min_retune_interval:
            return None
        shift = self._load_shift.check(self.load_tolerance)
        if shift is None:
            return None
        learner.monitor.emit("load_shift", ratio=shift.ratio, bucket=shift.bucket)
        return shift.reason

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

    def plan_for(self, result: TuningResult, optimizer: torch.optim.Optimizer, replay_batch_size: int = 0) -> tuple[int, int, float] | None:
        """``(micro_batch, accumulation_steps, lr_scale)`` for ``result``, or None to keep the
        learner's own step (one per ``observe``, the default when it is also the fastest).

        The effective batch goes in one micro-batch unless balanced micro-batches of at most
        the tuned size are at least 10 % faster; a micro-batch never exceeds the effective batch,
        and holds at least one replayed sample when the learner replays ``replay_batch_size``
        per stream batch (:func:`~taste_cl.learner.batching.replaying_micro_batch`).
        """
        reference = self.reference_ or result.batch_size
        effective = max(self.effective_batch_size or reference, result.min_batch_size)
        smallest = replaying_micro_batch(max(reference - replay_batch_size, 1), replay_batch_size)
        split = split_plan(result, effective, smallest=smallest)
        if split is None:
            if self.effective_batch_size is None:
                return None
            split = effective, 1
        micro, accumulation = split
        return micro, accumulation, lr_scale_for(optimizer, micro * accumulation / reference, self.lr_rule)

    def _retune(self, learner: OnlineLearner, reason: str) -> None:
        """Tune and apply; on any failure keep the learner as it was, warn, and retry later."""
        try:
            effective = self.effective_batch_size or self.reference_
            result = self.tune(
                learner.model,
                learner.optimizer,
                learner.loss_fn,
                self._probe_samples(learner),
                anchor=effective,
                output=learner.output,
                call=learner.call,
            )
            plan = self.plan_for(result, learner.optimizer, learner.replay_rows)
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
        self._load_shift.reset()
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
        result = None if state["result"] is None else result_from_state(state["result"])
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


def _cache_key(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, x: Any, hardware: str, *, tune_threads: bool) -> str:
    """Model, trainable set, input structure, optimizer and loss types, whether threads are tuned,
    and ``hardware`` (:func:`~taste_cl.tuning.fingerprint.hardware_fingerprint` with the load bucket)."""
    leaves, spec = tree_flatten(x)
    payload = {
        "model": model_signature(model, (), torch.float32),
        "trainable": "".join("1" if p.requires_grad else "0" for p in model.parameters()),
        "inputs": [str(spec), [[list(t.shape[1:]), str(t.dtype)] for t in leaves if isinstance(t, torch.Tensor)]],
        "optimizer": type(optimizer).__name__,
        "loss": type(loss_fn).__name__,
        "threads_tuned": tune_threads,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16] + f"-{hardware}"
