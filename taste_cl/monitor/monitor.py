"""Stability-plasticity monitor: does the model keep old knowledge while learning new data?

- **plasticity**: prequential (test-then-train) score on each incoming stream batch,
  measured with the parameters *before* the model trains on that batch, over a
  sliding window of recent batches;
- **stability**: score on a *probe* of past stream samples (class-balanced when the task
  has one class per sample, a reservoir otherwise), kept by the monitor apart from the
  replay buffer and re-evaluated every ``eval_every`` steps;
- **forgetting**: per class, best probe score so far minus current probe score,
  averaged over classes (the class-wise analogue of Chaudhry et al.'s forgetting); for
  tasks without classes, over the whole probe (for error metrics: current minus best);
- **drift**: Page-Hinkley test on the prequential loss;
- **anytime score**: the probe score (all classes seen so far) averaged over every evaluation;
- **negative flip rate** (classification, multi-label): among probe samples scored at two
  consecutive evaluations, the share that was right and became wrong; **flip impact** is
  the share of the current errors that are such flips. ``update_regressed`` fires when
  the probe score drops by more than ``regression_threshold`` between two evaluations.

Scores are the task's (:mod:`taste_cl.tasks`): accuracy for classification and token
tagging, micro-F1 for multi-label, MSE for regression (``report()`` has all its metrics).

``prequential`` chooses the forward that plasticity is scored with: ``"train"`` reuses the
training forward (free, but batch statistics and dropout make it differ from what
``predict()`` returns), ``"eval"`` scores with an extra eval-mode forward of the stream
samples, ``"auto"`` (default) uses ``"eval"`` only for models whose output changes with the
train/eval mode (checked once, on a copy, on the first batch).

Other components subscribe to its events (``drift_detected``, ``forgetting_rising``,
``numerical_fault``, ``update_regressed``, the guard's ``update_rolled_back``, the tuner's ``load_shift`` and a grown classifier's
``classes_added``) with :meth:`subscribe`.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from taste_cl._batch import leaves
from taste_cl.monitor import saved
from taste_cl.monitor.drift import PageHinkley
from taste_cl.monitor.events import EventBus, MonitorEvent, negative_flips, probe_outcome
from taste_cl.replay import ClassBalancedReplay, ReservoirReplay
from taste_cl.report import MonitorReport
from taste_cl.tasks import Classification, MultiLabel, Task, TokenClassification, resolve_task

__all__ = ["MonitorEvent", "StabilityPlasticityMonitor", "sample_correct"]

PREQUENTIAL_MODES = ("auto", "train", "eval")
SETTINGS = ("probe_capacity", "eval_every", "window", "forgetting_threshold", "max_events", "seed", "prequential", "regression_threshold")
"""The constructor arguments a learner's checkpoint keeps (its ``config.monitor``), see :meth:`StabilityPlasticityMonitor.settings`."""
_OFFER_SAMPLES, _OFFER_BYTES = 512, 8 << 20  # at most this many waiting stream samples / bytes before they are offered to the probe
_CONCAT_BYTES = 1 << 20  # waiting batches up to this size are offered as one
_NO_IDS, _NO_FLAGS = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.bool_)


def sample_correct(task: Task, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """Per sample, whether the prediction is right (all labels right for multi-label);
    None for tasks without a right or wrong answer per sample (regression, token tagging)."""
    if isinstance(task, Classification):
        return outputs.argmax(1) == y
    if isinstance(task, MultiLabel):
        predicted = outputs > 0 if task.logits else outputs > 0.5
        return (predicted == (y > 0.5)).all(1)
    return None


class StabilityPlasticityMonitor(EventBus):
    """Measure stability, plasticity, forgetting and drift of an online learner.

    Parameters
    ----------
    probe_capacity:
        Size of the probe of past samples used for stability (class-balanced for
        classification, a reservoir otherwise).
    eval_every:
        Evaluate the probe every this many recorded stream batches. With the default
        probe of 100 samples every 20 batches, the probe's forward pass is about 2.5% of
        the training FLOPs of a small CNN with stream and replay batches of 32, and 4-5% of
        its ``observe`` time on a CPU where that CNN's forward is slow relative to its
        backward (``taste-cl bench overhead``); a larger probe or a shorter interval gives
        finer stability and forgetting curves at a proportional cost.
    window:
        Number of recent stream batches the plasticity estimate averages over.
    forgetting_threshold:
        ``forgetting_rising`` fires when average forgetting rises above this.
    drift_detector:
        Any object with ``update(value) -> bool`` and ``state_dict``/``load_state_dict``;
        defaults to :class:`~taste_cl.monitor.drift.PageHinkley` on the batch loss.
    max_events:
        Bound on the remembered event history (memory stays flat on long streams).
    prequential:
        ``"auto"``, ``"train"`` or ``"eval"``: which forward scores plasticity (see the module doc).
    regression_threshold:
        ``update_regressed`` fires when the probe score gets worse by more than this between two evaluations.
    task:
        How targets are scored; the learner sets it (default classification).
    """

    def __init__(
        self,
        *,
        probe_capacity: int = 100,
        eval_every: int = 20,
        window: int = 50,
        forgetting_threshold: float = 0.1,
        drift_detector: PageHinkley | None = None,
        max_events: int = 1000,
        seed: int = 0,
        prequential: str = "auto",
        task: Task | None = None,
        regression_threshold: float = 0.05,
    ) -> None:
        for name, value in (("eval_every", eval_every), ("window", window), ("max_events", max_events)):
            if value < 1:
                raise ValueError(f"`{name} == {value}`, must be >= 1")
        if prequential not in PREQUENTIAL_MODES:
            raise ValueError(f"`prequential == {prequential!r}`, must be one of {', '.join(map(repr, PREQUENTIAL_MODES))}")
        self.probe_capacity = probe_capacity
        self.eval_every = eval_every
        self.window = window
        self.forgetting_threshold = forgetting_threshold
        self.drift_detector = drift_detector if drift_detector is not None else PageHinkley()
        self.max_events = max_events
        self.seed = seed
        self.prequential = prequential
        self.regression_threshold = regression_threshold
        self.task: Task = Classification()
        self._probe = self._new_probe()
        self._forget_unoffered()
        if task is not None:
            self.set_task(task)
        self._open_bus(self.max_events)
        self._reset_measurements()

    def _reset_measurements(self) -> None:
        self.steps = 0
        self.samples_seen = 0
        self._recent: deque[tuple[tuple[float, ...], float]] = deque(maxlen=self.window)  # (task stats, loss)
        self._class_accuracy: dict[int, float] = {}
        self._best_class_accuracy: dict[int, float] = {}
        self._stability: float | None = None
        self._forgetting = 0.0
        self._clear_log(self.max_events)
        self._last_drift_step: int | None = None
        self._anytime = [0.0, 0]  # sum of probe scores over evaluations, evaluations
        self._last_correct = (_NO_IDS, _NO_FLAGS)  # probe sample ids and whether each was right at the last evaluation
        self._flips: tuple[float, float] | None = None  # (negative flip rate, flip impact) at the last evaluation

    def set_task(self, task: Task) -> None:
        """Score with ``task``; the probe becomes class-balanced or a reservoir to suit it.

        Only before the first measurement (or for the same task): ``ValueError`` otherwise.
        """
        task = resolve_task(task)
        if task == self.task:
            return
        if self.steps or len(self._probe) or self._unoffered:
            raise ValueError(f"monitor already scores {self.task!r}; cannot switch to {task!r} mid-stream")
        self.task = task
        self._probe = self._new_probe()

    def _new_probe(self) -> ClassBalancedReplay | ReservoirReplay:
        probe = ClassBalancedReplay if self.task.balances_classes else ReservoirReplay
        return probe(self.probe_capacity, seed=self.seed)

    # ----------------------------------------------------------------- events
    # ----------------------------------------------------------- measurements
    def record(self, x: Any, y: torch.Tensor, outputs: torch.Tensor, *, validated: bool = False, store: bool = True) -> tuple[float, ...]:
        """Score a stream batch with outputs computed *before* training on it, then store it in the probe.

        Returns the task's additive statistics of the batch (for classification
        ``(correct, n)``). ``validated=True`` (the learner's own calls, on its own copies
        that nothing changes afterwards) skips the probe's input checks and lets the batch
        wait to be offered to the probe with the next ones (same result, less time);
        ``store=False`` scores without storing (a batch whose training loss overflowed).
        """
        outputs = outputs.detach() if outputs.requires_grad else outputs  # the learner's are detached already
        loss = self.task.loss(outputs, y)
        stats = self.task.batch_stats(outputs, y)
        self.steps += 1
        self.samples_seen += y.shape[0]
        self._recent.append((stats, loss))
        if math.isfinite(loss) and self.drift_detector.update(loss):
            self._last_drift_step = self.steps
            self.emit("drift_detected", loss=loss)
        if store and validated:  # the learner's own copies: nobody changes them before the offer
            self._unoffered.append((x, y, self.samples_seen - y.shape[0]))
            self._unoffered_samples += y.shape[0]
            self._unoffered_bytes += x.nbytes if isinstance(x, torch.Tensor) else sum(t.nbytes for t in leaves(x))
            if self._unoffered_samples >= _OFFER_SAMPLES or self._unoffered_bytes >= _OFFER_BYTES:
                self._offer_to_probe()
        elif store:
            self._offer_to_probe()  # keep the order of offers
            self._probe.add(x, y, sid=self._ids(self.samples_seen - y.shape[0], y.shape[0]))
        return stats

    @staticmethod
    def _ids(first: int, n: int) -> torch.Tensor:
        """Ids of stream samples ``first ..``: they name probe samples across evaluations."""
        return torch.arange(first, first + n)

    def _offer_to_probe(self) -> None:
        """Offer the waiting stream batches to the probe, oldest first; small ones in joined
        runs (:meth:`~taste_cl.replay.ClassBalancedReplay.add_batches`: the same probe, one
        pass of its bookkeeping)."""
        batches = [(x, y, {"sid": self._ids(first, y.shape[0])}) for x, y, first in self._unoffered]
        if self._unoffered_bytes <= _CONCAT_BYTES:
            self._probe.add_batches(batches)
        else:  # joining would copy this much once more
            for x, y, fields in batches:
                self._probe.add_validated(x, y, **fields)
        self._forget_unoffered()

    def _forget_unoffered(self) -> None:
        """Empty the list of validated stream batches not yet offered to the probe.

        They wait as (x, y, id of the first sample), counted in samples and bytes: offering
        them in a run every few batches is exactly what offering each at once does, for a
        fraction of the time.
        """
        self._unoffered: list[tuple[Any, torch.Tensor, int]] = []
        self._unoffered_samples = self._unoffered_bytes = 0

    def due(self) -> bool:
        """Whether the probe should be evaluated after this step."""
        return self.steps % self.eval_every == 0 and (len(self._probe) > 0 or bool(self._unoffered))

    def evaluate(self, predict: Callable[[Any], torch.Tensor]) -> None:
        """Evaluate the probe with ``predict`` (inputs -> outputs) and update stability/forgetting."""
        self._offer_to_probe()
        x, y, fields = self._probe.contents()
        previous_score = self._stability
        with torch.no_grad():
            outputs = predict(x)
            self._stability = self.task.metrics(self.task.batch_stats(outputs, y))[self.task.primary]
            scores = self.task.group_scores(outputs, y)
            self._count_flips(fields["sid"], sample_correct(self.task, outputs, y))
        self._anytime = [self._anytime[0] + self._stability, self._anytime[1] + 1]
        drop, self._forgetting, rising = probe_outcome(
            scores, self._class_accuracy, self._best_class_accuracy, previous=previous_score, stability=self._stability,
            forgetting=self._forgetting, higher_is_better=self.task.higher_is_better,
            regression_threshold=self.regression_threshold, forgetting_threshold=self.forgetting_threshold,
        )  # fmt: skip
        if drop is not None:
            flips = {} if self._flips is None else {"negative_flip_rate": self._flips[0], "flip_impact": self._flips[1]}
            self.emit("update_regressed", score=self._stability, previous=previous_score, drop=drop, **flips)
        if rising:
            self.emit("forgetting_rising", forgetting=self._forgetting, threshold=self.forgetting_threshold)

    def _count_flips(self, ids: torch.Tensor, correct: torch.Tensor | None) -> None:
        """Negative flips among probe samples also scored at the previous evaluation."""
        if correct is None:
            return
        ids_now, correct_now = ids.cpu().numpy().copy(), correct.cpu().numpy().copy()
        flips = negative_flips(*self._last_correct, ids_now, correct_now)
        self._flips = flips if flips is not None else self._flips
        self._last_correct = (ids_now, correct_now)

    # ---------------------------------------------------------------- reading
    @property
    def anytime_score(self) -> float | None:
        """The probe score (all seen classes) averaged over every evaluation so far (None before one)."""
        return self._anytime[0] / self._anytime[1] if self._anytime[1] else None

    @property
    def negative_flip_rate(self) -> float | None:
        """Share of probe samples right at the previous evaluation and wrong at the last one
        (None before two evaluations, or for tasks without per-sample right/wrong)."""
        return None if self._flips is None else self._flips[0]

    @property
    def flip_impact(self) -> float | None:
        """Share of the probe errors at the last evaluation that were right at the one before."""
        return None if self._flips is None else self._flips[1]

    @property
    def plasticity(self) -> float | None:
        """Prequential score (the task's primary metric, e.g. accuracy) over the recent
        window (None before any batch, NaN if nothing in it could be scored)."""
        metrics = self.plasticity_metrics
        return None if metrics is None else metrics[self.task.primary]

    @property
    def plasticity_metrics(self) -> dict[str, float] | None:
        """All the task's prequential metrics over the recent window (None before any batch)."""
        if not self._recent:
            return None
        return self.task.metrics([sum(column) for column in zip(*(stats for stats, _ in self._recent))])

    @property
    def stability(self) -> float | None:
        """The task's primary score on the probe of past samples at the last evaluation (None before one)."""
        return self._stability

    @property
    def forgetting(self) -> float:
        """Average over classes of the drop of the probe score from its best so far."""
        return self._forgetting

    def report(self) -> MonitorReport:
        """A dict summary: stability, plasticity, forgetting, drift, per-class scores
        (``print`` shows it as a few rounded lines)."""
        losses = [loss for _, loss in self._recent if math.isfinite(loss)]
        report = {
            "task": self.task.name,
            "metric": self.task.primary,
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "stability": self._stability,
            "plasticity": self.plasticity,
            "plasticity_metrics": self.plasticity_metrics,
            "plasticity_loss": sum(losses) / len(losses) if losses else None,
            "forgetting": self._forgetting,
            "anytime_score": self.anytime_score,
            "negative_flip_rate": self.negative_flip_rate,
            "flip_impact": self.flip_impact,
            "drift": {
                "count": self._event_counts["drift_detected"],
                "last_step": self._last_drift_step,
                "recent": self._last_drift_step is not None and self.steps - self._last_drift_step < self.window,
            },
            "per_class_accuracy": dict(sorted(self._class_accuracy.items())),
            "events": dict(self._event_counts),
        }
        return MonitorReport(report)

    # ------------------------------------------------------------ checkpoints
    def settings(self) -> dict[str, Any]:
        """The constructor arguments this monitor was built with (those in :data:`SETTINGS`)."""
        return {key: getattr(self, key) for key in SETTINGS}

    def twin(self) -> StabilityPlasticityMonitor:
        """A fresh monitor with these settings and a copy of the drift detector, without this one's subscribers:
        what a checkpoint's monitor state is tried on."""
        return StabilityPlasticityMonitor(**self.settings(), drift_detector=copy.deepcopy(self.drift_detector))

    def check_state(self, state: Any) -> dict[str, Any]:
        """Check :meth:`state_dict` output against this monitor (its settings, task and probe capacity) and return
        it parsed, its probe and drift detector as new objects; changes nothing. Raises ``ValueError`` naming the field."""
        return _parse_state(state, self)

    def state_dict(self) -> dict[str, Any]:
        self._offer_to_probe()
        return {
            "steps": self.steps,
            "samples_seen": self.samples_seen,
            "task": self.task.config(),
            "recent": [[*stats, loss] for stats, loss in self._recent],
            "class_accuracy": [[c, a] for c, a in self._class_accuracy.items()],
            "best_class_accuracy": [[c, a] for c, a in self._best_class_accuracy.items()],
            "stability": self._stability,
            "forgetting": self._forgetting,
            "events": [asdict(event) for event in self._events],
            "event_counts": dict(self._event_counts),
            "last_drift_step": self._last_drift_step,
            "anytime": list(self._anytime),
            "last_correct": [self._last_correct[0].tolist(), self._last_correct[1].tolist()],
            "flips": None if self._flips is None else list(self._flips),
            "probe": self._probe.state_dict(),
            "drift_detector": self.drift_detector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; validated first, so a bad state raises ValueError and changes nothing."""
        parsed = self.check_state(state)
        self._forget_unoffered()  # the probe is replaced
        self._reset_measurements()
        self.task = parsed["task"]
        self.steps, self.samples_seen = parsed["steps"], parsed["samples_seen"]
        self._recent.extend(parsed["recent"])
        self._class_accuracy, self._best_class_accuracy = parsed["class_accuracy"], parsed["best_class_accuracy"]
        self._stability, self._forgetting = parsed["stability"], parsed["forgetting"]
        self._events.extend(parsed["events"])
        self._event_counts.update(parsed["event_counts"])
        self._last_drift_step = parsed["last_drift_step"]
        self._probe, self.drift_detector = parsed["probe"], parsed["drift_detector"]
        self._anytime, self._last_correct, self._flips = parsed["anytime"], parsed["last_correct"], parsed["flips"]


def _parse_state(state: Any, monitor: StabilityPlasticityMonitor) -> dict[str, Any]:
    """Validate a monitor state into plain values and new probe/detector objects (``monitor`` is untouched);
    the fields both monitors save are checked by :mod:`taste_cl.monitor.saved`."""
    if not isinstance(state, dict):
        raise ValueError(f"monitor state must be a dict; got {type(state).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
    try:
        task = resolve_task(state.get("task", {"name": "classification"}))
    except ValueError as error:
        raise saved.fail("task", state.get("task"), f"a known task ({error})") from error
    high = 1.0 if task.higher_is_better else math.inf  # accuracy-like scores are fractions; errors are unbounded
    width = len(task.batch_stats(*_empty_batch(task))) + 1
    recent = state.get("recent")
    if not isinstance(recent, list) or not all(isinstance(r, (list, tuple)) and len(r) == width for r in recent):
        raise saved.fail("recent", recent, f"a list of [*{task.name} statistics, loss] rows of length {width}")
    recent_items = []
    for row in recent:
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in row) or not all(math.isfinite(v) and v >= 0 for v in row[:-1]):
            raise saved.fail("recent", row, "rows of finite, non-negative statistics and a numeric loss")
        stats = tuple(float(v) for v in row[:-1])
        primary = task.metrics(stats)[task.primary]
        if task.higher_is_better and not (math.isnan(primary) or 0.0 <= primary <= 1.0):
            raise saved.fail("recent", row, f"rows that score in [0, 1] (e.g. correct <= n); a row scores {primary}")
        recent_items.append((stats, float(row[-1])))
    steps, seen = saved.count("steps", state.get("steps")), saved.count("samples_seen", state.get("samples_seen"))
    stability = state.get("stability")
    last_correct = state.get("last_correct", [[], []])
    if not isinstance(last_correct, list) or len(last_correct) != 2 or not all(isinstance(v, list) for v in last_correct):
        raise saved.fail("last_correct", last_correct, "[sample ids, correct flags]")
    ids, flags = last_correct
    if len(ids) != len(flags) or not all(isinstance(f, bool) for f in flags):
        raise saved.fail("last_correct", last_correct, "one bool flag per sample id")
    id_list = [saved.count("last_correct", i) for i in ids]
    if len(set(id_list)) != len(id_list) or any(i >= seen for i in id_list):
        raise saved.fail("last_correct", ids, "distinct ids of samples seen")
    probe = (ClassBalancedReplay if task.balances_classes else ReservoirReplay)(monitor.probe_capacity, seed=monitor.seed)
    probe.load_state_dict(state.get("probe", {}))  # atomic on the new probe
    _check_probe_ids(probe, seen)
    detector = copy.deepcopy(monitor.drift_detector)
    detector.load_state_dict(state.get("drift_detector", {}))
    return {
        "task": task,
        "steps": steps,
        "samples_seen": seen,
        "recent": recent_items,
        "class_accuracy": saved.pairs("class_accuracy", state.get("class_accuracy"), high=high),
        "best_class_accuracy": saved.pairs("best_class_accuracy", state.get("best_class_accuracy"), high=high),
        "stability": None if stability is None else saved.score("stability", stability, high=high),
        "forgetting": saved.score("forgetting", state.get("forgetting"), low=-high, high=high),
        "events": saved.events(state.get("events"), steps, monitor.max_events, plain_details=False),
        "event_counts": saved.event_counts(state.get("event_counts")),
        "last_drift_step": saved.last_drift_step(state.get("last_drift_step"), steps),
        "probe": probe,
        "drift_detector": detector,
        "anytime": list(saved.anytime(state.get("anytime", [0.0, 0]))),
        "last_correct": (np.asarray(id_list, dtype=np.int64), np.asarray(flags, dtype=np.bool_)),
        "flips": saved.flips(state.get("flips")),
    }


def _check_probe_ids(probe: ClassBalancedReplay | ReservoirReplay, samples_seen: int) -> None:
    """The probe's only per-sample field is each sample's stream id: an int64 ``(n,)`` tensor of
    distinct ids of samples seen, ``[0, samples_seen)``. The flip metrics match samples across
    evaluations by id, so a repeated or made-up id would pair different samples."""
    if not len(probe):
        return
    where = "monitor state `probe.storage.fields"
    fields = probe.contents()[2]
    if set(fields) != {"sid"}:
        raise ValueError(f"{where}` must hold exactly the sample ids `sid`; got {sorted(fields)}")
    ids = fields["sid"]
    if ids.dtype != torch.int64 or tuple(ids.shape) != (len(probe),):
        raise ValueError(f"{where}.sid` must be an int64 tensor of shape ({len(probe)},); got {ids.dtype} {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= samples_seen:
        raise ValueError(f"{where}.sid` must hold ids of samples seen, in [0, {samples_seen}); got ids in [{low}, {high}]")
    repeated = len(probe) - int(ids.unique().numel())
    if repeated:
        raise ValueError(f"{where}.sid` must hold distinct ids; got {repeated} repeated (e.g. {int(ids.mode().values)})")


def _empty_batch(task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and targets of one tiny batch the task accepts (to learn its statistics' width)."""
    if isinstance(task, TokenClassification):
        return torch.zeros(1, 2, 1), torch.zeros(1, 1, dtype=torch.long)
    if isinstance(task, Classification):
        return torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)
    return torch.zeros(1, 1), torch.zeros(1, 1)
