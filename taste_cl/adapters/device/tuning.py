"""The batch-size tuner (TASTE) for the device learners, without torch.

:class:`DeviceBatchTuner` gives :class:`~taste_cl.adapters.onnxruntime.runtime.OrtOnlineLearner` and
:class:`~taste_cl.adapters.executorch.learner.EtOnlineLearner` what :class:`~taste_cl.BatchSizeTuner`
gives the PyTorch learner. Probes time real training steps of the device runtime on the device's own
replay rows at candidate micro-batch sizes (the artifacts' batch axis is dynamic); the same
Gaussian-process search (:class:`~taste_cl.tuning.searcher.ProbeSearch`), cache and load meter pick
the fastest size, optionally jointly with the runtime's intra-op threads. ``observe`` then trains
each step in micro-batches of that size whose gradients are accumulated, so a step stays the same
step (``accumulate=False`` opts into one optimizer step per micro-batch instead). A load shift (the
training rate, or other processes' share of the CPU, moving away from its level after a tune)
retunes. The plan, the cache entry and the seconds spent probing are saved with the learner's folder
and validated when it is loaded.

Probes never change the learner: ONNX Runtime probes train scratch sessions loaded from a copy of the
live checkpoint (optimizer state included); ExecuTorch probes step a scratch SGD optimizer and put the
parameters back bit for bit afterwards (the live optimizer's momentum is never touched).

Torch-free: this module and the search, cache, load and fingerprint modules it uses import no torch,
so the tuner runs on an ONNX Runtime device with numpy, psutil and ``onnxruntime-training-cpu``
(ExecuTorch's Python runtime imports torch itself). Without psutil, importing this module raises
:class:`~taste_cl.exceptions.MissingDependencyError` saying ``pip install psutil``.

Threads: ONNX Runtime's intra-op thread count is a session option, so a tuned count rebuilds the
learner's session from a copy of its state. ExecuTorch's thread pool is process-wide
(``_unsafe_reset_threadpool``): a tuned count applies to every ExecuTorch program in the process.

>>> from taste_cl.adapters.device.tuning import DeviceBatchTuner
>>> from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
>>> device = OrtOnlineLearner.from_artifacts("artifacts", tuner=DeviceBatchTuner())  # doctest: +SKIP
>>> stats = device.observe((x, y))  # the first observe tunes on the replay rows  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from taste_cl._checks import check_int
from taste_cl.exceptions import MissingDependencyError

try:  # the load meter and the cache key read it; a device installed with `pip install --no-deps taste-cl` may lack it
    import psutil  # noqa: F401
except ModuleNotFoundError as error:
    raise MissingDependencyError("psutil", command="pip install psutil") from error

from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.tuning.cache import CachedSurface, SurrogateCache, check_observations
from taste_cl.tuning.fingerprint import runtime_fingerprint
from taste_cl.tuning.load import LoadMeter, LoadShiftDetector, load_bucket
from taste_cl.tuning.searcher import (
    ProbeSearch,
    TuningError,
    TuningResult,
    TuningWarning,
    check_tuner_options,
    result_from_state,
    split_plan,
    thread_options,
    timed_rate,
)

__all__ = ["DeviceBatchTuner", "micro_batch_bounds"]

logger = logging.getLogger(__name__)
Rows = tuple[list[Any], Any]  # a batch's inputs in the program's order (numpy arrays or tensors) and its targets
STATE_FORMAT = 1
_SPLIT_GAIN = 1.1  # accumulated micro-batches must beat whole steps over the same work by this factor
_CONFIRM_ROUNDS = 3  # interleaved windows of that comparison
_STATE_KEYS = {"format", "result", "micro_batch_size", "threads", "reference", "probe_seconds", "tunes", "observes", "history", "cache"}
_HISTORY = 100


def micro_batch_bounds(rows: int, micro_batch_size: int | None, min_batch: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` of balanced micro-batches of at most ``micro_batch_size`` rows covering ``rows``
    (one when there is no plan or the step fits), each at least ``min_batch`` rows (ExecuTorch: 2).

    >>> micro_batch_bounds(10, 4)
    [(0, 4), (4, 7), (7, 10)]
    """
    if micro_batch_size is None or rows <= micro_batch_size:
        return [(0, rows)]
    count = max(1, min(math.ceil(rows / micro_batch_size), rows // min_batch))
    base, extra = divmod(rows, count)
    stops = np.cumsum([base + (i < extra) for i in range(count)])
    return [(int(stop - base - (i < extra)), int(stop)) for i, stop in enumerate(stops)]


def _take(rows: Rows, index: Any) -> Rows:
    """Rows ``index`` (a slice or an index array) of every input and of the targets (numpy or torch)."""
    inputs, targets = rows
    return [leaf[index] for leaf in inputs], targets[index]


class _Runtime(Protocol):
    """What the tuner needs of a device learner's runtime (one adapter per backend, below)."""

    @property
    def name(self) -> str:
        """The runtime and its version (part of the cache key)."""

    @property
    def min_batch(self) -> int:
        """The fewest rows a training step takes."""

    @property
    def max_batch(self) -> int | None:
        """The most rows a training step takes (None: no bound)."""

    def artifact_key(self) -> str: ...
    def rows(self, limit: int) -> Rows | None: ...
    def current_threads(self) -> int: ...
    def set_threads(self, threads: int) -> None: ...
    def probe_step(self, threads: int | None) -> Callable[[list[Rows]], object]: ...
    def close_probes(self) -> None: ...
    def step(self, parts: list[Rows], accumulate: bool) -> tuple[Any, ...]: ...


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class _OrtRuntime:
    """ONNX Runtime: scratch sessions over copies of the live checkpoint; threads are a session option."""

    min_batch, max_batch = 1, None

    def __init__(self, learner: Any) -> None:
        from taste_cl.adapters.onnxruntime.session import ort_bindings

        self.learner = learner
        self.name = f"onnxruntime {ort_bindings().get_version_string()}"
        self.threads: int | None = None  # set by the tuner; None: ONNX Runtime's default (one per core)
        self._probes: dict[int | None, Any] = {}

    def artifact_key(self) -> str:
        from taste_cl.adapters.onnxruntime.manifest import OPTIMIZER_MODEL, TRAINING_MODEL

        files = self.learner.manifest["files"]
        optimizer = {k: v for k, v in self.learner.spec.optimizer.items() if k != "lr"}
        return _digest([files[TRAINING_MODEL], files.get(OPTIMIZER_MODEL), optimizer, list(self.learner.spec.trainable)])

    def rows(self, limit: int) -> Rows | None:
        replay = self.learner.replay
        return replay.rows(limit) if replay is not None and len(replay) else None

    def current_threads(self) -> int:
        return self.threads or max(thread_options())

    def copy_session(self, threads: int | None) -> Any:
        """A new session over a copy of the live one's checkpoint (parameters and optimizer state), SGD
        momentum and learning rate, with ``threads`` intra-op threads. Its folder lives as long as it does
        (ONNX Runtime reads the eval graph again when exporting)."""
        from taste_cl.adapters.device.artifacts import read_verified
        from taste_cl.adapters.onnxruntime.manifest import CHECKPOINT, EVAL_MODEL, OPTIMIZER_MODEL, TRAINING_MODEL
        from taste_cl.adapters.onnxruntime.session import OrtSession, ort_bindings

        C, live = ort_bindings(), self.learner.session
        folder = tempfile.TemporaryDirectory(prefix="taste-cl-tuner-")
        path = Path(folder.name)
        try:
            C.save_checkpoint(live.state, str(path / CHECKPOINT), True)
            for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL):
                if name in self.learner.manifest["files"]:
                    (path / name).write_bytes(read_verified(self.learner.directory, self.learner.manifest, name))
            options = C.SessionOptions()
            options.log_severity_level = 3
            if threads is not None:
                options.intra_op_num_threads = threads
            session = OrtSession(path, live.spec, {k: v.copy() for k, v in live.sgd_state.items()}, session_options=options)
        except BaseException:
            folder.cleanup()
            raise
        session.lr = live.lr
        weakref.finalize(session, folder.cleanup)
        return session

    def set_threads(self, threads: int) -> None:
        session = self.copy_session(threads)
        session.guard = self.learner.session.guard  # the live session keeps the learner's guard
        self.learner.session = session
        self.threads = threads

    def probe_step(self, threads: int | None) -> Callable[[list[Rows]], object]:
        if threads not in self._probes:
            self._probes[threads] = self.copy_session(threads if threads is not None else self.threads)
        return lambda parts: self.step(parts, True, self._probes[threads])

    def close_probes(self) -> None:
        self._probes.clear()

    def step(self, parts: list[Rows], accumulate: bool, session: Any = None) -> tuple[Any, ...]:
        session = session or self.learner.session
        if len(parts) == 1:
            return session.train_step(*parts[0])
        if accumulate:
            return session.accumulated_step(parts)
        results = [session.train_step(*part) for part in parts]
        return np.concatenate([r[0] for r in results]), _mean_loss(parts, [r[1] for r in results]), any(r[2] for r in results)


class _EtRuntime:
    """ExecuTorch: probes step a scratch SGD on the live parameters, restored afterwards; a process-wide thread pool."""

    def __init__(self, learner: Any) -> None:
        from importlib.metadata import version

        from taste_cl.adapters.executorch.runtime import MIN_BATCH, executorch_runtime

        self.learner = learner
        self.name = f"executorch {version('executorch')}"
        self.min_batch, self.max_batch = MIN_BATCH, learner.trainer.max_batch
        self._lib = executorch_runtime()
        self._saved: tuple[dict[str, np.ndarray], int, Any, Any] | None = None  # parameters, threads, SGD and guard before the probes

    def artifact_key(self) -> str:
        from taste_cl.adapters.executorch.runtime import PROGRAM

        sgd = {k: v for k, v in self.learner.trainer.sgd.items() if k != "lr"}
        return _digest([self.learner.manifest["files"][PROGRAM], sgd])

    def rows(self, limit: int) -> Rows | None:
        replay = self.learner.replay
        if replay is None or not len(replay):
            return None
        storage = replay.state_dict()["storage"]
        n = min(limit, int(storage["size"]))
        return [storage["x"][:n].clone()], storage["y"][:n].clone()

    def current_threads(self) -> int:
        return int(self._lib._threadpool_get_thread_count())

    def set_threads(self, threads: int) -> None:
        if threads != self.current_threads():
            self._lib._unsafe_reset_threadpool(threads)

    def probe_step(self, threads: int | None) -> Callable[[list[Rows]], object]:
        trainer = self.learner.trainer
        if self._saved is None:  # probes step a fresh SGD of the same settings, unguarded (as ONNX Runtime's
            # probes step an unguarded copy): the live momentum and the guard's history are untouched
            self._saved = trainer.parameters(), self.current_threads(), trainer.optimizer, trainer.guard
            trainer.optimizer, trainer.guard = trainer.new_optimizer(), None
        default = self._saved[1]

        def step(parts: list[Rows]) -> None:
            self.set_threads(threads if threads is not None else default)
            self.step(parts, True)

        return step

    def close_probes(self) -> None:
        if self._saved is not None:
            params, threads, optimizer, guard = self._saved
            self._saved = None
            trainer = self.learner.trainer
            trainer.optimizer, trainer.guard = optimizer, guard
            trainer.load_parameters(params)
            self.set_threads(threads)

    def step(self, parts: list[Rows], accumulate: bool) -> tuple[Any, ...]:
        trainer = self.learner.trainer
        if len(parts) == 1:
            return trainer.run(*parts[0], step=True)
        if accumulate:
            return trainer.accumulated_step(parts)
        import torch

        results = [trainer.run(*part, step=True) for part in parts]
        return _mean_loss(parts, [r[0] for r in results]), torch.cat([r[1] for r in results]), any(r[2] for r in results)


def _mean_loss(parts: Sequence[Rows], losses: Sequence[float]) -> float:
    total = sum(len(part[1]) for part in parts)
    return sum(loss * len(part[1]) / total for part, loss in zip(parts, losses))


class _Prober:
    """The search's :class:`~taste_cl.tuning.searcher.Prober` over a runtime's scratch copies."""

    def __init__(self, runtime: _Runtime, rows: Rows, clock: Callable[[], float]) -> None:
        self.runtime, self.rows, self.clock = runtime, rows, clock
        self._count = len(rows[1])

    def _timed(self, batch_size: int, threads: int | None, micro: int | None = None) -> Callable[[], float]:
        """Seconds of one step of ``batch_size`` real rows (tiled), in micro-batches of ``micro`` accumulated."""
        step = self.runtime.probe_step(threads)
        rows = _take(self.rows, np.arange(batch_size) % self._count)
        parts = [_take(rows, slice(a, b)) for a, b in micro_batch_bounds(batch_size, micro, self.runtime.min_batch)]

        def timed() -> float:
            start = self.clock()
            step(parts)
            return self.clock() - start

        return timed

    def split_gain(self, rows: int, micro: int, threads: int | None, min_time: float) -> float:
        """How much faster steps of ``rows`` rows run in accumulated micro-batches of ``micro`` than whole,
        over the same work: interleaved windows of at least ``min_time`` seconds each (a probe's typical
        step can flatter small sizes on a busy machine, and only the plan's own steps show what
        accumulation costs)."""
        whole, pieces = self._timed(rows, threads), self._timed(rows, threads, micro)
        seconds = [whole(), pieces()]  # warm-ups, counted too: a spell of foreign load hits both alike
        for _ in range(_CONFIRM_ROUNDS):
            for i, timed in enumerate((whole, pieces)):
                spent = 0.0
                while spent < min_time:
                    spent += timed()
                seconds[i] += spent
        return seconds[0] / seconds[1] if seconds[1] > 0 else math.inf

    def measure(
        self, batch_size: int, *, threads: int | None = None, min_time: float = 0.15, min_steps: int = 3, stop_below: float | None = None
    ) -> float:
        return timed_rate(self._timed(batch_size, threads), batch_size, min_time=min_time, min_steps=min_steps, stop_below=stop_below)

    def work(self, batch_size: int, steps: int, *, threads: int | None = None, max_seconds: float = math.inf) -> tuple[int, float]:
        timed = self._timed(batch_size, threads)
        timed()  # starts the thread pool
        done, seconds = 0, 0.0
        while done < steps and (done == 0 or seconds < max_seconds):
            seconds += timed()
            done += 1
        return done, seconds

    def smallest_trainable(self, limit: int) -> tuple[int, list[tuple[int, str]]]:
        failures: list[tuple[int, str]] = []
        batch = 1
        while batch <= limit:
            try:
                self._timed(batch, None)()
                return batch, failures
            except Exception as error:  # noqa: BLE001 - any failure of the program makes the size infeasible
                failures.append((batch, f"{type(error).__name__}: {error}"))
            batch *= 2
        return 0, failures


class DeviceBatchTuner:
    """Find and apply the fastest training micro-batch (and optionally thread count) on a device learner.

    Pass it to ``OrtOnlineLearner.from_artifacts(folder, tuner=...)`` or
    ``EtOnlineLearner.from_artifacts(folder, tuner=...)``: the first ``observe`` tunes on the
    replay rows (or that batch when the buffer is empty), later ones retune on a load shift.

    Parameters
    ----------
    max_batch_size:
        Upper end of the search; it never exceeds the learner's step (stream batch plus replay share)
        nor an ExecuTorch program's batch bound.
    n_calls, n_initial_points, warm_calls, per_octave, min_probe_time:
        The search's budget, as for :class:`~taste_cl.BatchSizeTuner`.
    accumulate:
        Accumulate the micro-batches' gradients into one optimizer step per learner step (default: the
        step is unchanged, computed in pieces). ``False`` opts into one step per micro-batch: more,
        smaller steps on the same rows, with the learning rate unchanged.
    tune_threads:
        Also tune the runtime's intra-op threads (ONNX Runtime session option; ExecuTorch's
        process-wide thread pool).
    load_tolerance, calibration_window, min_retune_interval, retune_every:
        Retune triggers: a load shift (median training rate off its baseline by more than
        ``load_tolerance``, or other processes' CPU share changing bucket), at most once per
        ``min_retune_interval`` observes; and a schedule in observes.
    probe_samples:
        Replay rows the probes train on (tiled to each probed size).
    cache_dir:
        Where measurements are cached (default ``$TASTE_CL_CACHE_DIR`` or ``~/.cache/taste_cl``).
    clock:
        The timer probes read (default ``time.perf_counter``); a test passes its own.

    Attributes set by a tune: ``result_`` (:class:`~taste_cl.tuning.TuningResult`),
    ``micro_batch_size_`` (None: one piece per step), ``probe_seconds_`` (all tunes' seconds),
    ``history_`` (what each tune found and why it ran).
    """

    def __init__(
        self,
        *,
        max_batch_size: int = 1024,
        n_calls: int = 10,
        n_initial_points: int = 3,
        warm_calls: int = 1,
        per_octave: int = 4,
        min_probe_time: float = 0.15,
        accumulate: bool = True,
        tune_threads: bool = False,
        load_tolerance: float = 0.5,
        calibration_window: int = 8,
        min_retune_interval: int = 100,
        retune_every: int | None = None,
        probe_samples: int = 256,
        cache_dir: str | Path | None = None,
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
        if retune_every is not None:
            check_int("retune_every", retune_every, 1)
        for label, flag in (("accumulate", accumulate), ("tune_threads", tune_threads)):
            if not isinstance(flag, bool):
                raise TypeError(f"`{label} == {flag!r}`, must be True or False")
        if not callable(clock):
            raise TypeError(f"`clock == {clock!r}`, must be a callable returning seconds")
        self.max_batch_size = max_batch_size
        self.accumulate = accumulate
        self.tune_threads = tune_threads
        self.load_tolerance = load_tolerance
        self.min_retune_interval = min_retune_interval
        self.retune_every = retune_every
        self.probe_samples = probe_samples
        self.cache = SurrogateCache(cache_dir)
        self.search = ProbeSearch(
            self.cache,
            n_calls=n_calls,
            n_initial_points=n_initial_points,
            warm_calls=warm_calls,
            per_octave=per_octave,
            min_probe_time=min_probe_time,
            tune_threads=tune_threads,
            clock=clock,
        )
        self.result_: TuningResult | None = None
        self.micro_batch_size_: int | None = None
        self.threads_: int | None = None
        self.reference_: int | None = None
        self.probe_seconds_ = 0.0
        self.tunes_ = 0
        self.history_: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._runtime: _Runtime | None = None
        self._learner: Any = None
        self._meter = LoadMeter()
        self._shift = LoadShiftDetector(calibration_window, self._meter)
        self._recent: Rows | None = None
        self._observes = self._last_retune = self._failures = self._retry_at = 0
        self._pending: str | None = None

    # ------------------------------------------------------------- learner side
    def attach(self, learner: Any, state: Any = None) -> None:
        """Tune ``learner`` (an ``OrtOnlineLearner`` or ``EtOnlineLearner``) from now on, resuming ``state``
        (its folder's saved tuner state, validated first: :class:`ArtifactError` naming the field)."""
        if self._learner is not None:
            raise ValueError("this DeviceBatchTuner is attached to a learner already; make one tuner per learner")
        runtime: _Runtime
        if hasattr(learner, "session"):
            runtime = _OrtRuntime(learner)
        elif hasattr(learner, "trainer"):
            runtime = _EtRuntime(learner)
        else:
            raise TypeError(f"a DeviceBatchTuner tunes OrtOnlineLearner or EtOnlineLearner; got {type(learner).__name__}")
        if state is not None:
            try:
                self.load_state_dict(state)
            except ValueError as error:
                raise ArtifactError(f"{str(learner.directory)!r}: the manifest's tuner state is invalid: {error}") from None
        self._runtime, self._learner = runtime, learner
        if self.threads_ is not None:
            runtime.set_threads(self.threads_)
        learner.tuner = self

    def before_observe(self, inputs: list[Any], targets: Any) -> None:
        """Tune on the first observe (on the replay rows, else this batch; a failed tune is retried by
        :meth:`after_observe`). The batch is kept for later tunes of an empty buffer."""
        if self.reference_ is None:
            self.reference_ = len(targets) + self._learner.replay_batch_size
        self._recent = (list(inputs), targets)
        if self.result_ is None and not self.tunes_ and not self._failures:
            self._retune("first observe")

    def step(self, inputs: list[Any], targets: Any) -> tuple[Any, ...]:
        """One learner step on these rows under the plan; returns what the runtime's own step returns."""
        runtime = self._require()
        bounds = micro_batch_bounds(len(targets), self.micro_batch_size_, runtime.min_batch)
        return runtime.step([_take((inputs, targets), slice(a, b)) for a, b in bounds], self.accumulate)

    def micro_batches(self, rows: int) -> int:
        """Pieces a step of ``rows`` rows is computed in under the plan."""
        return len(micro_batch_bounds(rows, self.micro_batch_size_, self._require().min_batch))

    def after_observe(self, samples: int, seconds: float) -> None:
        """Count an observe that trained ``samples`` rows in ``seconds``; retune on a load shift or the schedule."""
        self._observes += 1
        if seconds > 0 and samples:
            self._shift.add(samples / seconds)
        if self._observes < self._retry_at:
            return
        reason = self._pending or self._load_shift()
        if reason is None and self.retune_every and self._observes % self.retune_every == 0:
            reason = f"schedule (every {self.retune_every} observes)"
        if reason is not None:
            self._retune(reason)

    def _load_shift(self) -> str | None:
        if self._shift.calibrated and self._observes - self._last_retune < self.min_retune_interval:
            return None
        shift = self._shift.check(self.load_tolerance)
        return None if shift is None else shift.reason

    def _probe_threads(self, result: TuningResult) -> int | None:
        """The thread count probes of ``result``'s plan run at (None: the learner's own)."""
        return result.threads if self.tune_threads else None

    def _require(self) -> _Runtime:
        if self._runtime is None:
            raise RuntimeError("attach the tuner to a device learner first (from_artifacts(folder, tuner=...))")
        return self._runtime

    # ----------------------------------------------------------------- tuning
    def tune(self, *, reason: str = "asked") -> TuningResult:
        """Tune now and apply the plan; raises :class:`~taste_cl.tuning.TuningError` (nothing changed) when no size trains."""
        runtime = self._require()
        with self._learner.lock:
            if self.reference_ is None:
                raise TuningError("the learner's step size is known after its first observe; observe a batch first")
            start = self.search.clock()
            rows = runtime.rows(self.probe_samples) or self._recent
            if rows is None:
                raise TuningError("no rows to probe with (an empty replay buffer and no batch observed since loading)")
            bucket = load_bucket(self._meter.read())
            key = f"{runtime.artifact_key()}-{int(self.tune_threads)}-{runtime_fingerprint(runtime.name, load=bucket)}"
            limit = min(self.max_batch_size, self.reference_, runtime.max_batch or self.reference_)
            threads = thread_options() if self.tune_threads else [runtime.current_threads()]
            prober = _Prober(runtime, rows, self.search.clock)
            try:
                result = self.search.run(
                    prober,
                    key=key,
                    limit=limit,
                    threads=threads,
                    current_threads=runtime.current_threads(),
                    anchor=self.reference_,
                    started=start,
                )
                split = split_plan(result, max(self.reference_, result.min_batch_size))
                gain = (
                    None if split is None else prober.split_gain(self.reference_, split[0], self._probe_threads(result), self.search.min_probe_time)
                )
                if gain is not None and gain < _SPLIT_GAIN:
                    split = None
            finally:
                runtime.close_probes()
            if self.tune_threads and result.threads != self.threads_:  # the first tuned count is set even if it is the
                runtime.set_threads(result.threads)  # default's label: ONNX Runtime's default may differ from the cores
                self.threads_ = result.threads
            self.result_, self.micro_batch_size_ = result, None if split is None else split[0]
            self.probe_seconds_ += self.search.clock() - start
            self.tunes_ += 1
            self._failures, self._last_retune, self._pending = 0, self._observes, None
            self._shift.reset()
            self.history_.append(
                {
                    "observe": self._observes,
                    "reason": reason,
                    "tuned_batch_size": result.batch_size,
                    "micro_batch_size": self.micro_batch_size_,
                    "threads": result.threads,
                    "samples_per_s": result.samples_per_s,
                    "split_gain": gain,
                    "probes": len(result.probes),
                    "seconds": result.seconds,
                    "warm": result.warm,
                }
            )
            logger.info("device tuner (%s): micro-batch %s of %d, %d threads", reason, self.micro_batch_size_, self.reference_, result.threads)
            return result

    def _retune(self, reason: str) -> None:
        """Tune and apply; on any failure keep the plan, warn, and retry later (never breaks ``observe``)."""
        try:
            self.tune(reason=reason)
        except Exception as error:  # noqa: BLE001 - a failed tune must never break observe
            self._failures += 1
            self._retry_at = self._observes + 2 ** min(self._failures, 10)
            self._pending = reason if reason.startswith("retry") else f"retry after a failed tune ({reason})"
            self.history_.append({"observe": self._observes, "reason": reason, "failed": f"{type(error).__name__}: {error}"})
            warnings.warn(
                f"device batch-size tuning failed ({reason}): {type(error).__name__}: {error}; the learner keeps micro-batch "
                f"{self.micro_batch_size_}; retrying in {self._retry_at - self._observes} observes",
                TuningWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON values: the plan, the last result, the cache entry behind it, the probes' seconds."""
        cached = self.cache.load(self.result_.key) if self.result_ is not None else None
        return {
            "format": STATE_FORMAT,
            "result": None if self.result_ is None else json.loads(json.dumps(asdict(self.result_))),
            "micro_batch_size": self.micro_batch_size_,
            "threads": self.threads_,
            "reference": self.reference_,
            "probe_seconds": self.probe_seconds_,
            "tunes": self.tunes_,
            "observes": self._observes,
            "history": list(self.history_),
            "cache": None if cached is None else {"min_batch_size": cached.min_batch_size, "observations": [list(o) for o in cached.observations]},
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output; everything is checked before anything changes
        (``ValueError`` naming the field). The cache entry re-seeds a cache that lacks it."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS or state["format"] != STATE_FORMAT:
            raise ValueError(f"tuner state must be an object with the keys {sorted(_STATE_KEYS)} and format {STATE_FORMAT}")
        result = None if state["result"] is None else result_from_state(state["result"])
        for label in ("micro_batch_size", "threads", "reference"):
            if state[label] is not None:
                check_int(f"tuner state {label}", state[label], 1)
        check_int("tuner state tunes", state["tunes"], 0)
        check_int("tuner state observes", state["observes"], 0)
        seconds = state["probe_seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"`tuner state probe_seconds == {seconds!r}`, must be a finite number >= 0")
        history = state["history"]
        if not isinstance(history, list) or len(history) > _HISTORY or not all(isinstance(h, dict) for h in history):
            raise ValueError(f"tuner state history must be a list of at most {_HISTORY} objects")
        cache = state["cache"]
        surface = None
        if cache is not None:
            if not isinstance(cache, dict) or set(cache) != {"min_batch_size", "observations"} or result is None:
                raise ValueError("tuner state cache must be null or {min_batch_size, observations} beside a result")
            minimum = check_int("tuner state cache.min_batch_size", cache["min_batch_size"], 1)
            surface = CachedSurface(minimum, check_observations(cache["observations"], limit=self.cache.max_observations))
        self.result_, self.micro_batch_size_, self.threads_, self.reference_ = result, state["micro_batch_size"], state["threads"], state["reference"]
        self.probe_seconds_, self.tunes_, self._observes = float(seconds), state["tunes"], state["observes"]
        self.history_.clear()
        self.history_.extend(dict(entry) for entry in history)
        if result is not None and surface is not None and not self.cache.path(result.key).exists():
            self.cache.save(result.key, surface)
