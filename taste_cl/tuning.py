"""Throughput-aware batch-size tuning (the TASTE method).

Training throughput (samples/s) rises with the batch size up to a ceiling set by the
hardware and often falls beyond it. :class:`BatchSizeTuner` measures real training
steps of the user's model on this machine and finds the best batch with Bayesian
optimisation: a Gaussian-process surrogate of log-throughput over a log-spaced grid of
batch sizes (scikit-optimize's ask/tell ``Optimizer``). Observations are cached on disk
(JSON) per model signature and hardware fingerprint, so a later tune warm-starts and
needs one or two probes instead of ten.

As a :class:`~taste_cl.plugins.LearnerPlugin` it tunes on the learner's first batch,
then trains with micro-batches of the tuned size, gradient accumulation up to the
effective batch, and linear learning-rate scaling; it retunes (warm, bounded probes)
when the monitor reports drift, when the observed step time departs from the tuned
prediction or the foreign CPU load changes bucket, and optionally on a schedule.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from taste_cl._fingerprint import default_cache_dir, hardware_fingerprint, model_signature
from taste_cl.checkpoint import atomic_write_bytes
from taste_cl.load import LoadMeter, load_bucket
from taste_cl.plugins import LearnerPlugin

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner
    from taste_cl.monitor import MonitorEvent

__all__ = [
    "BatchSizeTuner",
    "SurrogateCache",
    "TunerCacheWarning",
    "TuningResult",
    "candidate_batch_sizes",
    "max_batch_for_memory",
    "measure_throughput",
]

logger = logging.getLogger(__name__)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TunerCacheWarning(UserWarning):
    """A tuner cache file was unreadable and has been ignored (the tune ran cold)."""



def candidate_batch_sizes(max_batch_size: int, *, per_octave: int = 4, min_batch_size: int = 1) -> list[int]:
    """Distinct integers spaced ``per_octave`` to a doubling from ``min_batch_size`` to ``max_batch_size``."""
    if min_batch_size < 1 or max_batch_size < min_batch_size:
        raise ValueError(f"need 1 <= min_batch_size <= max_batch_size; got {min_batch_size}, {max_batch_size}")
    steps = math.log2(max_batch_size / min_batch_size) * per_octave
    sizes = {round(min_batch_size * 2 ** (k / per_octave)) for k in range(int(math.floor(steps)) + 1)}
    return sorted(sizes | {max_batch_size})


def max_batch_for_memory(model: nn.Module, input_shape: Sequence[int], *, budget_bytes: float, dtype: torch.dtype = torch.float32) -> int:
    """Largest batch whose estimated training memory fits ``budget_bytes``.

    Estimate: parameters x4 (weights, gradients, two optimizer moments) plus, per sample,
    three times the bytes of every module output at batch 1 (activation, its gradient, slack).
    """
    activation_bytes = 0

    def count(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal activation_bytes
        if isinstance(output, torch.Tensor):
            activation_bytes += output.numel() * output.element_size()

    probe = copy.deepcopy(model).eval()
    handles = [m.register_forward_hook(count) for m in probe.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            probe(torch.zeros((1, *input_shape), dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    fixed = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    per_sample = 3 * max(activation_bytes, 1)
    return max(1, int((budget_bytes - fixed) // per_sample))


def measure_throughput(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    input_shape: Sequence[int],
    num_classes: int,
    batch_size: int,
    *,
    min_time: float = 0.15,
    warmup: int = 1,
    blocks: int = 3,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Training samples/s of full steps (forward, backward, optimizer) at ``batch_size``.

    Runs on copies of ``model`` and ``optimizer``: the caller's model and optimizer state
    are untouched. The result is the median of ``blocks`` timed blocks of at least
    ``min_time / blocks`` seconds each, after ``warmup`` untimed steps.
    """
    twin = copy.deepcopy(model).train()
    twin_optimizer = type(optimizer)([p for p in twin.parameters() if p.requires_grad], **optimizer.defaults)
    generator = torch.Generator().manual_seed(batch_size)
    device = next(twin.parameters()).device
    x = torch.randn((batch_size, *input_shape), generator=generator).to(device=device, dtype=dtype)
    y = torch.randint(0, num_classes, (batch_size,), generator=generator).to(device)

    def step() -> None:
        loss = loss_fn(twin(x), y)
        loss.backward()
        twin_optimizer.step()
        twin_optimizer.zero_grad(set_to_none=True)

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    synchronize()
    rates = []
    for _ in range(blocks):
        steps, start = 0, time.perf_counter()
        while True:
            step()
            steps += 1
            synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time / blocks:
                break
        rates.append(steps * batch_size / elapsed)
    return statistics.median(rates)


class SurrogateCache:
    """Throughput observations per (model signature, hardware fingerprint), as JSON files.

    Unreadable or foreign files are ignored with a :class:`TunerCacheWarning`; they are
    never unpickled or executed. Writes are atomic.
    """

    FORMAT = 1

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, max_observations: int = 64) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.max_observations = max_observations

    def path(self, key: str) -> Path:
        return self.directory / f"batch-{key}.json"

    def load(self, key: str) -> list[tuple[int, float]]:
        """Cached ``(batch_size, samples_per_s)`` observations for ``key``; empty on a miss."""
        path = self.path(key)
        if not path.exists():
            return []
        try:
            data = json.loads(path.read_text())
            if data.get("format") != self.FORMAT or data.get("key") != key:
                raise ValueError("format or key does not match")
            observations = [(int(b), float(s)) for b, s in data["observations"]]
            if any(b < 1 or not math.isfinite(s) or s <= 0 for b, s in observations):
                raise ValueError("observations out of range")
            return observations
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            warnings.warn(f"ignoring corrupt tuner cache {str(path)!r} ({error}); tuning from scratch", TunerCacheWarning, stacklevel=3)
            return []

    def save(self, key: str, observations: Sequence[tuple[int, float]]) -> None:
        recent = [[int(b), float(s)] for b, s in observations][-self.max_observations :]
        payload = {"format": self.FORMAT, "key": key, "observations": recent}
        atomic_write_bytes(self.path(key), json.dumps(payload, indent=1).encode())


@dataclass(frozen=True)
class TuningResult:
    """The outcome of one tune: the chosen batch and how it was found."""

    batch_size: int
    samples_per_s: float
    probes: list[tuple[int, float]]
    seconds: float
    warm: bool
    key: str
    candidates: list[int] = field(default_factory=list)

    def predicted_step_time(self) -> float:
        """Seconds one training step at ``batch_size`` should take."""
        return self.batch_size / self.samples_per_s


@dataclass(frozen=True)
class _LoadBaseline:
    """Training rate and foreign-load bucket calibrated after a (re)tune."""

    rate: float
    bucket: str


class BatchSizeTuner(LearnerPlugin):
    """Find the training batch size with the highest throughput, and keep it up to date.

    Parameters
    ----------
    max_batch_size:
        Upper end of the search; lowered further to fit ``memory_budget_bytes``.
    memory_budget_bytes:
        Memory the training step may use; default a quarter of the memory available now.
    n_calls:
        Probes of a cold tune (the first ``n_initial_points`` spread by Latin hypercube).
    warm_calls:
        Probes of a tune that starts from cached observations (bounded retune cost).
    effective_batch_size:
        Samples per optimizer step. ``None``: one micro-batch per step (the effective
        batch follows the tuned one). Otherwise micro-batches are accumulated up to it
        (rounded up to a whole number of micro-batches).
    scale_lr:
        Scale the learning rate linearly with the effective batch relative to the
        reference batch the optimizer was configured for (``reference_batch_size``,
        default the learner's first stream batch plus its replay share).
    retune_every:
        Also retune every this many ``observe`` calls (None: only on events).
    retune_on_drift:
        Retune when the monitor reports ``drift_detected``.
    load_tolerance:
        Relative departure of the observed step time from its calibrated baseline that
        counts as a hardware load shift (0.5 = 50 % slower or faster).
    cache_dir:
        Where surrogate observations are cached (default :func:`default_cache_dir`).
    """

    name = "batch_size_tuner"

    def __init__(
        self,
        *,
        max_batch_size: int = 1024,
        memory_budget_bytes: float | None = None,
        n_calls: int = 8,
        n_initial_points: int = 3,
        warm_calls: int = 1,
        per_octave: int = 4,
        min_probe_time: float = 0.15,
        effective_batch_size: int | None = None,
        scale_lr: bool = True,
        reference_batch_size: int | None = None,
        retune_every: int | None = None,
        retune_on_drift: bool = True,
        load_tolerance: float = 0.5,
        calibration_window: int = 8,
        min_retune_interval: int = 100,
        cache_dir: str | os.PathLike[str] | None = None,
        seed: int = 0,
    ) -> None:
        for label, value, low in (
            ("max_batch_size", max_batch_size, 1),
            ("n_calls", n_calls, 1),
            ("n_initial_points", n_initial_points, 1),
            ("warm_calls", warm_calls, 0),
            ("per_octave", per_octave, 1),
            ("calibration_window", calibration_window, 2),
            ("min_retune_interval", min_retune_interval, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{label} == {value!r}`, must be an int >= {low}")
        if effective_batch_size is not None and effective_batch_size < 1:
            raise ValueError(f"`effective_batch_size == {effective_batch_size}`, must be >= 1 or None")
        if load_tolerance <= 0:
            raise ValueError(f"`load_tolerance == {load_tolerance}`, must be > 0")
        self.max_batch_size = max_batch_size
        self.memory_budget_bytes = memory_budget_bytes
        self.n_calls = n_calls
        self.n_initial_points = n_initial_points
        self.warm_calls = warm_calls
        self.per_octave = per_octave
        self.min_probe_time = min_probe_time
        self.effective_batch_size = effective_batch_size
        self.scale_lr = scale_lr
        self.reference_batch_size = reference_batch_size
        self.retune_every = retune_every
        self.retune_on_drift = retune_on_drift
        self.load_tolerance = load_tolerance
        self.calibration_window = calibration_window
        self.min_retune_interval = min_retune_interval
        self.cache_dir = cache_dir
        self.seed = seed
        self.cache = SurrogateCache(cache_dir)
        self.result_: TuningResult | None = None
        self.history_: deque[dict[str, Any]] = deque(maxlen=100)  # (re)tunes: when, why, what
        self._load_meter = LoadMeter()
        self._rates: deque[float] = deque(maxlen=calibration_window)
        self._foreign: deque[float] = deque(maxlen=calibration_window)
        self._baseline: _LoadBaseline | None = None  # None until calibrated after a tune
        self._pending_reason: str | None = None
        self._observes = 0
        self._last_retune = 0

    # ------------------------------------------------------------ standalone
    def tune(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        input_shape: Sequence[int],
        num_classes: int,
        *,
        dtype: torch.dtype = torch.float32,
        foreign_load: float | None = None,
    ) -> TuningResult:
        """Measure and return the best batch size for this model on this machine now."""
        from skopt import Optimizer  # imported here: `import taste_cl` stays light
        from skopt.space import Integer

        start = time.perf_counter()
        bucket = load_bucket(self._load_meter.read() if foreign_load is None else foreign_load)
        trainable = "".join("1" if p.requires_grad else "0" for p in model.parameters())
        key = f"{model_signature(model, input_shape, dtype)}-{trainable}-{hardware_fingerprint(load=bucket)}"
        budget = self.memory_budget_bytes
        if budget is None:
            import psutil

            budget = psutil.virtual_memory().available / 4
        limit = min(self.max_batch_size, max_batch_for_memory(model, input_shape, budget_bytes=budget, dtype=dtype))
        candidates = candidate_batch_sizes(limit, per_octave=self.per_octave)
        cached = [(b, s) for b, s in self.cache.load(key) if b in candidates]
        index = {b: i for i, b in enumerate(candidates)}
        calls = self.warm_calls if cached else self.n_calls
        probes: list[tuple[int, float]] = []
        measured = {b for b, _ in cached}
        search = None
        budget = min(calls, len(candidates))
        for call in range(budget):
            if cached and call == 0:
                batch = self._best(cached)[0]  # re-measure the incumbent first: has this machine changed?
            else:
                if search is None:
                    search = self._surrogate(Optimizer, Integer, len(candidates), warm=bool(cached))
                    if cached or probes:
                        known = cached + probes
                        search.tell([[index[b]] for b, _ in known], [-math.log(r) for _, r in known])
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The objective has been evaluated", category=UserWarning)
                    suggested = int(search.ask()[0])
                batch = candidates[suggested]
                if batch in measured and not cached:
                    if len(probes) >= self.n_initial_points + 2:
                        break  # the surrogate insists on a point it knows: converged
                    unmeasured = [b for b in candidates if b not in measured]
                    if unmeasured:  # else re-measure the suggestion
                        batch = min(unmeasured, key=lambda b: abs(index[b] - suggested))
            measured.add(batch)
            rate = measure_throughput(
                model, optimizer, loss_fn, input_shape, num_classes, batch, min_time=self.min_probe_time, dtype=dtype
            )
            probes.append((batch, rate))
            if search is not None:
                search.tell([index[batch]], -math.log(rate), fit=call < budget - 1)  # no refit after the last probe
        observations = cached + probes
        best, rate = self._best(observations)
        self.cache.save(key, observations)
        result = TuningResult(best, rate, probes, time.perf_counter() - start, bool(cached), key, candidates)
        logger.info("tuned batch size %d (%.0f samples/s) with %d probes in %.2fs (warm=%s)", best, rate, len(probes), result.seconds, result.warm)
        return result

    def _surrogate(self, optimizer_cls: Any, integer_cls: Any, n_candidates: int, *, warm: bool) -> Any:
        """A GP ask/tell optimizer over candidate indices (log-spaced batch sizes)."""
        return optimizer_cls(
            [integer_cls(0, n_candidates - 1)],
            base_estimator="GP",
            n_initial_points=1 if warm else min(self.n_initial_points, n_candidates),
            initial_point_generator="random" if warm else "lhs",
            acq_func="EI",
            random_state=self.seed,
            model_queue_size=1,
            avoid_duplicates=False,
            acq_optimizer="sampling",  # the space is a few dozen points: 10,000 samples is waste
            acq_optimizer_kwargs={"n_points": 8 * n_candidates},
        )

    @staticmethod
    def _best(observations: list[tuple[int, float]]) -> tuple[int, float]:
        """The batch with the highest mean measured throughput (repeats average out noise)."""
        by_batch: dict[int, list[float]] = {}
        for batch, rate in observations:
            by_batch.setdefault(batch, []).append(rate)
        return max(((b, statistics.fmean(r)) for b, r in by_batch.items()), key=lambda item: item[1])

    # ------------------------------------------------------------ as a plugin
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if self.retune_on_drift:
            learner.monitor.subscribe(self._on_drift, event="drift_detected")

    def _on_drift(self, event: MonitorEvent) -> None:
        self._pending_reason = self._pending_reason or f"stream drift at step {event.step}"

    def on_first_batch(self, learner: OnlineLearner, x: torch.Tensor, **kwargs: Any) -> None:
        if self.result_ is None:
            self._retune(learner, "first batch", reference=x.shape[0] + learner.replay_batch_size)

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self._observes += 1
        if stats.micro_batches and stats.step_time_s > 0:
            self._rates.append(stats.micro_batches * stats.batch_size / stats.step_time_s)
            self._foreign.append(self._load_meter.read())
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

    def _retune(self, learner: OnlineLearner, reason: str, *, reference: int | None = None) -> None:
        assert learner.input_shape is not None and learner.num_classes is not None
        result = self.tune(
            learner.model, learner.optimizer, learner.loss_fn, learner.input_shape, learner.num_classes, dtype=learner.dtype
        )
        self.result_ = result
        self._last_retune = self._observes
        if self.reference_batch_size is None and reference is not None:
            self.reference_batch_size = reference
        accumulation = max(1, math.ceil((self.effective_batch_size or result.batch_size) / result.batch_size))
        effective = accumulation * result.batch_size  # the requested effective batch, rounded up to whole micro-batches
        lr_scale = effective / self.reference_batch_size if self.scale_lr and self.reference_batch_size else 1.0
        learner.set_batch_plan(result.batch_size, accumulation_steps=accumulation, lr_scale=lr_scale)
        self._rates.clear()
        self._foreign.clear()
        self._baseline = None
        entry = {
            "step": learner.steps,
            "reason": reason,
            "batch_size": result.batch_size,
            "accumulation_steps": accumulation,
            "lr_scale": lr_scale,
            "samples_per_s": result.samples_per_s,
            "probes": len(result.probes),
            "seconds": result.seconds,
            "warm": result.warm,
        }
        self.history_.append(entry)
        learner.monitor.emit("retuned", **entry)
        logger.info("retuned at step %d because %s: batch %d x%d, lr x%.3g", learner.steps, reason, result.batch_size, accumulation, lr_scale)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        result = None if self.result_ is None else {
            "batch_size": self.result_.batch_size,
            "samples_per_s": self.result_.samples_per_s,
            "probes": [list(p) for p in self.result_.probes],
            "seconds": self.result_.seconds,
            "warm": self.result_.warm,
            "key": self.result_.key,
            "candidates": list(self.result_.candidates),
        }
        cache = {} if self.result_ is None else {"key": self.result_.key, "observations": [list(o) for o in self.cache.load(self.result_.key)]}
        return {
            "result": result,
            "reference_batch_size": self.reference_batch_size,
            "history": list(self.history_),
            "observes": self._observes,
            "cache": cache,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["result"]
        self.result_ = None if saved is None else TuningResult(
            int(saved["batch_size"]), float(saved["samples_per_s"]), [(int(b), float(s)) for b, s in saved["probes"]],
            float(saved["seconds"]), bool(saved["warm"]), str(saved["key"]), [int(c) for c in saved["candidates"]],
        )
        self.reference_batch_size = state["reference_batch_size"]
        self.history_.clear()
        self.history_.extend(dict(entry) for entry in state["history"])
        self._observes = int(state["observes"])
        if state["cache"] and not self.cache.path(state["cache"]["key"]).exists():
            self.cache.save(state["cache"]["key"], [(int(b), float(s)) for b, s in state["cache"]["observations"]])
