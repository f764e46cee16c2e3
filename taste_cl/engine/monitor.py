"""The stability-plasticity monitor of the engine loop, in numpy: the torch monitor's measurements and events, torch-free.

:class:`LoopMonitor` is :class:`~taste_cl.monitor.monitor.StabilityPlasticityMonitor` for the
:class:`~taste_cl.engine.loop.EngineLearner` (classification): per ``observe`` it records the
prequential loss (mean cross-entropy of the outputs scored before training, as
:class:`~taste_cl.tasks.Classification` computes it) and accuracy, runs the same
:class:`~taste_cl.monitor.drift.PageHinkley` test on the loss (``drift_detected``), and keeps a
class-balanced probe of past stream rows decided by
:class:`~taste_cl.replay.draws.ClassQuotaIndex` from its own generator seeded with ``seed``: the
torch monitor's probe decisions, so the same seed keeps the same rows. Every ``eval_every``
records it evaluates the probe: stability, per-class forgetting (``forgetting_rising``), negative
flips and ``update_regressed``. The events and the arithmetic of an evaluation
(:mod:`taste_cl.monitor.events`) are the torch monitor's own. Events carry the monitor's step and reach
:meth:`LoopMonitor.subscribe`'s callbacks at :meth:`LoopMonitor.dispatch` (the end of an observe).

>>> import numpy as np
>>> monitor = LoopMonitor(eval_every=2, probe_capacity=4)
>>> x, y = np.eye(4, dtype=np.float32), np.array([0, 1, 0, 1])
>>> monitor.record(x, y, 5 * np.eye(2, dtype=np.float32)[y])
(4, 4)
>>> monitor.record(x, y, np.zeros((4, 2), np.float32))
(2, 4)
>>> monitor.due(), monitor.evaluate(lambda rows: np.tile([[0.0, 1.0]], (len(rows), 1))), monitor.stability
(True, None, 0.5)
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from taste_cl._checks import INT_LIMIT, check_int
from taste_cl.engine import losses
from taste_cl.monitor import saved
from taste_cl.monitor.drift import PageHinkley
from taste_cl.monitor.events import EventBus, negative_flips, probe_outcome
from taste_cl.replay.draws import ClassQuotaIndex, apply_plan, new_rng

__all__ = ["LoopMonitor", "ProbeRows"]

SETTINGS = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "regression_threshold", "max_events", "seed", "drift")
DRIFT_SETTINGS = ("min_instances", "delta", "threshold", "alpha")
MAX_WINDOW = MAX_EVENTS = 1_000_000


class ProbeRows:
    """The probe's rows ``x``, labels ``y`` and stream ids ``sid``, kept class-balanced by
    :class:`~taste_cl.replay.draws.ClassQuotaIndex` from a generator seeded with ``seed`` (the torch probe's decisions);
    ``name`` prefixes its saved arrays and the fields a refused state names (the monitor's, or the probe guard's)."""

    def __init__(self, capacity: int, seed: int, name: str = "monitor.probe") -> None:
        self.capacity = check_int("probe_capacity", capacity, 1)
        self.name = name
        self.rng = new_rng(seed)
        self.index = ClassQuotaIndex(capacity, self.rng)
        self.size = 0
        self._x: np.ndarray | None = None  # allocated on the first rows
        self._y = np.zeros(capacity, dtype=np.int64)
        self._sid = np.zeros(capacity, dtype=np.int64)

    def __len__(self) -> int:
        return self.size

    @property
    def row_shape(self) -> tuple[int, ...] | None:
        return None if self._x is None else tuple(self._x.shape[1:])

    def add(self, x: np.ndarray, y: np.ndarray, first_id: int) -> None:
        """Offer stream rows ``x``, ``y`` whose ids start at ``first_id``."""
        if self._x is None:
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
        ids = np.arange(first_id, first_id + y.shape[0], dtype=np.int64)
        self.size = apply_plan(self.index.offer(y.tolist()), (self._x, self._y, self._sid), (x, y, ids), self.size)

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of every stored ``x``, ``y``, ``sid``, in slot order."""
        assert self._x is not None
        return self._x[: self.size].copy(), self._y[: self.size].copy(), self._sid[: self.size].copy()

    def counts(self) -> dict[str, Any]:
        index = self.index
        return {"size": self.size, "classes": list(index.classes), "class_seen": [index.seen[c] for c in index.classes],
                "slots": [list(index.slots[c]) for c in index.classes], "rng": self.rng.bit_generator.state}  # fmt: skip

    def check_state(self, counts: Any, arrays: Mapping[str, np.ndarray], samples_seen: int, num_classes: int) -> np.random.Generator:
        """``ValueError`` naming what in ``counts`` and the ``<name>.*`` arrays cannot be this probe's state
        (ids below ``samples_seen``); the saved generator, as a new one. Nothing changes."""
        keys = {"size", "classes", "class_seen", "slots", "rng"}
        if not isinstance(counts, Mapping) or set(counts) != keys:
            raise ValueError(f"`{self.name}` must be an object with exactly the keys {sorted(keys)}")
        size = counts["size"]
        if type(size) is not int or not 0 <= size <= self.capacity:
            raise ValueError(f"`{self.name}.size == {size!r}`, must be an int in [0, {self.capacity}]")
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = counts["rng"]
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(f"`{self.name}.rng` is not a PCG64 state: {error}") from None
        x, y, sid = (arrays.get(f"{self.name}.{k}") for k in ("x", "y", "sid"))
        if size and (x is None or y is None or sid is None):
            raise ValueError(f"the saved state lacks `{self.name}.x`, `.y` or `.sid`")
        labels: list[int] = []
        if size:
            assert x is not None and y is not None and sid is not None
            if x.shape[0] != size or y.shape != (size,) or sid.shape != (size,) or y.dtype != np.int64 or sid.dtype != np.int64:
                raise ValueError(f"`{self.name}.x`, `.y`, `.sid` must hold {size} rows, `.y` and `.sid` int64")
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise ValueError(f"`{self.name}.x` holds NaN or infinite values")
            if self._x is not None and (x.shape[1:] != self._x.shape[1:] or x.dtype != self._x.dtype):
                raise ValueError(f"`{self.name}.x` rows must be {self._x.dtype} {self._x.shape[1:]}; got {x.dtype} {x.shape[1:]}")
            if y.min() < 0 or y.max() >= num_classes:
                raise ValueError(f"`{self.name}.y` must hold labels in [0, {num_classes})")
            if sid.min() < 0 or sid.max() >= samples_seen or np.unique(sid).size != size:
                raise ValueError(f"`{self.name}.sid` must hold distinct ids of rows seen, in [0, {samples_seen})")
            labels = y.tolist()
        try:
            self.index.check_state(counts["classes"], counts["class_seen"], counts["slots"], labels)
        except ValueError as error:
            raise ValueError(f"`{self.name}`: {error}") from None
        if sum(counts["class_seen"]) > samples_seen:
            raise ValueError(f"`{self.name}.class_seen` must add up to at most the rows seen ({samples_seen})")
        return rng

    def load_state(self, counts: Mapping[str, Any], arrays: Mapping[str, np.ndarray], rng: np.random.Generator) -> None:
        """Apply what :meth:`check_state` accepted."""
        self.index.load_state(counts["classes"], counts["class_seen"], counts["slots"])
        self.rng.bit_generator.state = rng.bit_generator.state  # the index shares this generator
        self.size = size = counts["size"]
        if size:
            x = arrays[f"{self.name}.x"]
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
            self._x[:size], self._y[:size], self._sid[:size] = x, arrays[f"{self.name}.y"], arrays[f"{self.name}.sid"]


class LoopMonitor(EventBus):
    """Stability, plasticity, forgetting and drift of an engine loop (see the module); the torch monitor's
    settings and defaults, with the drift test's settings in ``drift_detector`` (a
    :class:`~taste_cl.monitor.drift.PageHinkley`)."""

    def __init__(
        self,
        *,
        probe_capacity: int = 100,
        eval_every: int = 20,
        window: int = 50,
        forgetting_threshold: float = 0.1,
        regression_threshold: float = 0.05,
        max_events: int = 1000,
        seed: int = 0,
        drift_detector: PageHinkley | None = None,
    ) -> None:
        for name, value in (("eval_every", eval_every), ("window", window), ("max_events", max_events)):
            check_int(name, value, 1)
        for name, number in (("forgetting_threshold", forgetting_threshold), ("regression_threshold", regression_threshold)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
                raise ValueError(f"`{name} == {number!r}`, must be a finite number")
        self.probe_capacity = check_int("probe_capacity", probe_capacity, 1)
        self.eval_every, self.window, self.max_events = eval_every, window, max_events
        self.forgetting_threshold, self.regression_threshold = float(forgetting_threshold), float(regression_threshold)
        self.seed = check_int("seed", seed)
        self.drift_detector = drift_detector if drift_detector is not None else PageHinkley()
        self.probe = ProbeRows(probe_capacity, seed)
        self._open_bus(max_events)
        self.steps = self.samples_seen = 0
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=window)  # (correct, n, loss) of recent records
        self._class_accuracy: dict[int, float] = {}
        self._best_class_accuracy: dict[int, float] = {}
        self._stability: float | None = None
        self._forgetting = 0.0
        self._anytime = (0.0, 0)  # sum of probe scores over evaluations, evaluations
        self._flips: tuple[float, float] | None = None
        self._last_correct = (np.zeros(0, np.int64), np.zeros(0, np.bool_))  # probe ids and whether each was right last time
        self._last_drift_step: int | None = None

    def settings(self) -> dict[str, Any]:
        """The constructor arguments, the drift test's as a plain object: what an exported folder's manifest keeps."""
        detector = self.drift_detector
        drift = {"min_instances": detector.min_instances, "delta": detector.delta, "threshold": detector.threshold, "alpha": detector.alpha}
        return {key: getattr(self, key) for key in SETTINGS[:-1]} | {"drift": drift}

    @classmethod
    def from_settings(cls, settings: Any) -> LoopMonitor:
        """A monitor built from :meth:`settings` output; ``ValueError`` naming the first bad ``monitor.<key>``."""
        if not isinstance(settings, Mapping) or set(settings) != set(SETTINGS):
            raise ValueError(f"`monitor` must be an object with exactly the keys {sorted(SETTINGS)}")
        drift = settings["drift"]
        if not isinstance(drift, Mapping) or set(drift) != set(DRIFT_SETTINGS):
            raise ValueError(f"`monitor.drift` must be an object with exactly the keys {sorted(DRIFT_SETTINGS)}")
        bounds = {"probe_capacity": 10_000_000, "eval_every": 2**31, "window": MAX_WINDOW, "max_events": MAX_EVENTS, "seed": 2**63 - 1}
        for key, high in bounds.items():
            value = settings[key]
            if type(value) is not int or not (0 if key == "seed" else 1) <= value <= high:
                raise ValueError(f"`monitor.{key} == {value!r}`, must be an int in [{0 if key == 'seed' else 1}, {high}]")
        if type(drift["min_instances"]) is not int or not 1 <= drift["min_instances"] <= INT_LIMIT:
            raise ValueError(f"`monitor.drift.min_instances == {drift['min_instances']!r}`, must be an int in [1, 2**62]")
        for where, key in (("monitor.", "forgetting_threshold"), ("monitor.", "regression_threshold"), ("monitor.drift.", "delta"),
                           ("monitor.drift.", "threshold"), ("monitor.drift.", "alpha")):  # fmt: skip
            value = (settings if where == "monitor." else drift)[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"`{where}{key} == {value!r}`, must be a finite number")
        try:
            detector = PageHinkley(**{k: drift[k] for k in DRIFT_SETTINGS})
        except ValueError as error:
            raise ValueError(f"`monitor.drift`: {error}") from None
        return cls(**{k: settings[k] for k in SETTINGS[:-1]}, drift_detector=detector)

    # ----------------------------------------------------------------- events
    @property
    def event_counts(self) -> dict[str, int]:
        """How many of each event were dispatched, all told."""
        return dict(self._event_counts)

    # ----------------------------------------------------------- measurements
    def record(self, x: np.ndarray, y: np.ndarray, outputs: np.ndarray, *, store: bool = True) -> tuple[int, int]:
        """Score a stream batch with the outputs computed before training on it (prequential), run the drift
        test on its loss, then offer it to the probe unless ``store`` is False (a batch whose training loss
        overflowed). Returns ``(correct, n)``."""
        n = int(y.shape[0])
        finite = bool(np.isfinite(outputs).all())
        loss = losses.experience_replay(outputs.astype(np.float64), y, n)[0] if finite else math.nan
        correct = int((outputs.argmax(axis=1) == y).sum())
        self.steps += 1
        self.samples_seen += n
        self._recent.append((correct, n, loss))
        if math.isfinite(loss) and self.drift_detector.update(loss):
            self._last_drift_step = self.steps
            self.emit("drift_detected", loss=loss)
        if store:
            self.probe.add(x, y, self.samples_seen - n)
        return correct, n

    def due(self) -> bool:
        """Whether the probe should be evaluated after this record."""
        return self.steps % self.eval_every == 0 and len(self.probe) > 0

    def evaluate(self, predict: Callable[[np.ndarray], np.ndarray]) -> None:
        """Evaluate the probe with ``predict`` (rows -> logits): stability, per-class forgetting, flips, and the events they raise."""
        x, y, ids = self.probe.rows()
        right = np.asarray(predict(x)).argmax(axis=1) == y
        previous, stability = self._stability, int(right.sum()) / y.shape[0]
        totals, hits = np.bincount(y).tolist(), np.bincount(y, weights=right.astype(np.float64)).tolist()
        scores = {label: hit / total for label, (total, hit) in enumerate(zip(totals, hits)) if total}
        flips = negative_flips(*self._last_correct, ids, right)
        self._flips = flips if flips is not None else self._flips
        self._last_correct = (ids, right)
        self._stability = stability
        self._anytime = (self._anytime[0] + stability, self._anytime[1] + 1)
        drop, self._forgetting, rising = probe_outcome(
            scores, self._class_accuracy, self._best_class_accuracy, previous=previous, stability=stability, forgetting=self._forgetting,
            higher_is_better=True, regression_threshold=self.regression_threshold, forgetting_threshold=self.forgetting_threshold,
        )  # fmt: skip
        if drop is not None:
            extra = {} if self._flips is None else {"negative_flip_rate": self._flips[0], "flip_impact": self._flips[1]}
            self.emit("update_regressed", score=stability, previous=previous, drop=drop, **extra)
        if rising:
            self.emit("forgetting_rising", forgetting=self._forgetting, threshold=self.forgetting_threshold)

    # ---------------------------------------------------------------- reading
    @property
    def row_shape(self) -> tuple[int, ...] | None:
        """The shape of the probe's rows once it holds some (a stream's rows must keep it)."""
        return self.probe.row_shape

    @property
    def stability(self) -> float | None:
        """Accuracy on the probe at the last evaluation (None before one)."""
        return self._stability

    @property
    def forgetting(self) -> float:
        """Average over classes of the drop of the probe accuracy from its best so far."""
        return self._forgetting

    @property
    def plasticity(self) -> float | None:
        """Prequential accuracy over the recent window (None before any record)."""
        n = sum(r[1] for r in self._recent)
        return sum(r[0] for r in self._recent) / n if n else None

    @property
    def class_accuracy(self) -> dict[int, float]:
        """Per-class probe accuracy at the last evaluation."""
        return dict(sorted(self._class_accuracy.items()))

    @property
    def negative_flip_rate(self) -> float | None:
        """Share of probe samples right at the previous evaluation and wrong at the last one (None before two)."""
        return None if self._flips is None else self._flips[0]

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Plain values (finite numbers only: a manifest holds them) and ``monitor.*`` arrays: everything a resumed run needs."""
        arrays = {
            "monitor.recent": np.asarray(list(self._recent), dtype=np.float64).reshape(-1, 3),
            "monitor.last_ids": self._last_correct[0].copy(),
            "monitor.last_correct": self._last_correct[1].copy(),
        }
        if len(self.probe):
            arrays |= dict(zip(("monitor.probe.x", "monitor.probe.y", "monitor.probe.sid"), self.probe.rows()))
        plain = {
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "recent": len(self._recent),
            "last_correct": int(self._last_correct[0].size),
            "class_accuracy": [[c, a] for c, a in self._class_accuracy.items()],
            "best_class_accuracy": [[c, a] for c, a in self._best_class_accuracy.items()],
            "stability": self._stability,
            "forgetting": self._forgetting,
            "anytime": list(self._anytime),
            "flips": None if self._flips is None else list(self._flips),
            "last_drift_step": self._last_drift_step,
            "events": [asdict(event) for event in self._events],
            "event_counts": dict(self._event_counts),
            "drift": self.drift_detector.state_dict(),
            "probe": self.probe.counts(),
        }
        return plain, arrays

    def expected_arrays(self, plain: Any, dtype: np.dtype, row: tuple[int, ...]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """The dtype and shape of every ``monitor.*`` array that the plain state ``plain`` names, for inputs
        ``dtype`` ``row``: what a loader checks array headers against before reading them (``ValueError`` naming the field)."""
        if not isinstance(plain, Mapping) or not isinstance(plain.get("probe"), Mapping):
            raise ValueError("`monitor` must be an object with a `probe` object")  # noqa: TRY004 (a bad state is a ValueError)
        recent, last, size = (
            saved.count("recent", plain.get("recent"), self.window),
            saved.count("last_correct", plain.get("last_correct"), self.probe_capacity),
            saved.count("probe.size", plain["probe"].get("size"), self.probe_capacity),
        )
        expected = {
            "monitor.recent": (np.dtype(np.float64), (recent, 3)),
            "monitor.last_ids": (np.dtype(np.int64), (last,)),
            "monitor.last_correct": (np.dtype(np.bool_), (last,)),
        }
        if size:
            expected |= {"monitor.probe.x": (np.dtype(dtype), (size, *row)), "monitor.probe.y": (np.dtype(np.int64), (size,)),
                         "monitor.probe.sid": (np.dtype(np.int64), (size,))}  # fmt: skip
        return expected

    def check_state(self, plain: Any, arrays: Mapping[str, np.ndarray], num_classes: int) -> dict[str, Any]:
        """Check :meth:`state` output against this monitor's settings (``ValueError`` naming the field) and return
        it parsed, the drift test and the probe's generator as new objects; changes nothing."""
        keys = {"steps", "samples_seen", "recent", "last_correct", "class_accuracy", "best_class_accuracy", "stability", "forgetting",
                "anytime", "flips", "last_drift_step", "events", "event_counts", "drift", "probe"}  # fmt: skip
        if not isinstance(plain, Mapping) or set(plain) != keys:
            raise ValueError(f"`monitor` must be an object with exactly the keys {sorted(keys)}")
        for key, (dtype, shape) in self.expected_arrays(plain, np.dtype(np.float32), ()).items():
            value = arrays.get(key)
            if value is None or (not key.startswith("monitor.probe.x") and (value.dtype != dtype or value.shape != shape)):
                raise ValueError(f"`{key}` must be {dtype} {shape}")
        steps, seen = saved.count("steps", plain["steps"]), saved.count("samples_seen", plain["samples_seen"])
        recent = arrays["monitor.recent"]
        correct, n = recent[:, 0], recent[:, 1]
        if not (np.isfinite(recent[:, :2]).all() and (correct >= 0).all() and (correct <= n).all() and (n == np.round(n)).all()):
            raise ValueError("`monitor.recent` rows must hold whole counts 0 <= correct <= n, then the loss")
        ids, right = arrays["monitor.last_ids"], arrays["monitor.last_correct"]
        if ids.size and (ids.min() < 0 or ids.max() >= seen or np.unique(ids).size != ids.size):
            raise ValueError(f"`monitor.last_ids` must hold distinct ids of rows seen, in [0, {seen})")
        stability = plain["stability"]
        detector = PageHinkley(min_instances=self.drift_detector.min_instances, delta=self.drift_detector.delta,
                               threshold=self.drift_detector.threshold, alpha=self.drift_detector.alpha)  # fmt: skip
        try:
            detector.load_state_dict(dict(plain["drift"]) if isinstance(plain["drift"], Mapping) else plain["drift"])
        except ValueError as error:
            raise ValueError(f"`monitor.drift`: {error}") from None
        return {
            "steps": steps,
            "samples_seen": seen,
            "recent": [(int(c), int(k), float(loss)) for c, k, loss in recent.tolist()],
            "last_correct": (ids.copy(), right.copy()),
            "class_accuracy": saved.pairs("class_accuracy", plain["class_accuracy"]),
            "best_class_accuracy": saved.pairs("best_class_accuracy", plain["best_class_accuracy"]),
            "stability": None if stability is None else saved.score("stability", stability),
            "forgetting": saved.score("forgetting", plain["forgetting"], low=-1.0),
            "anytime": saved.anytime(plain["anytime"]),
            "flips": saved.flips(plain["flips"]),
            "last_drift_step": saved.last_drift_step(plain["last_drift_step"], steps),
            "events": saved.events(plain["events"], steps, self.max_events, plain_details=True),
            "event_counts": saved.event_counts(plain["event_counts"]),
            "drift": detector,
            "rng": self.probe.check_state(plain["probe"], arrays, seen, num_classes),
        }

    def load_state(self, plain: Any, arrays: Mapping[str, np.ndarray], num_classes: int) -> None:
        """Restore :meth:`state` output: all of it is checked first (``ValueError``), and nothing changes unless it loads."""
        parsed = self.check_state(plain, arrays, num_classes)
        self.probe.load_state(plain["probe"], arrays, parsed["rng"])
        self.steps, self.samples_seen = parsed["steps"], parsed["samples_seen"]
        self._recent.clear()
        self._recent.extend(parsed["recent"])
        self._last_correct = parsed["last_correct"]
        self._class_accuracy, self._best_class_accuracy = parsed["class_accuracy"], parsed["best_class_accuracy"]
        self._stability, self._forgetting = parsed["stability"], parsed["forgetting"]
        self._anytime, self._flips, self._last_drift_step = parsed["anytime"], parsed["flips"], parsed["last_drift_step"]
        self._events.clear()
        self._events.extend(parsed["events"])
        self._event_counts = Counter(parsed["event_counts"])
        self.drift_detector, self._pending = parsed["drift"], []
