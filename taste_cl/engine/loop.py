"""One learner loop over any engine: replay, the strategy's loss, clipping and the update guard, in numpy.

:class:`EngineLearner` is ``observe``/``predict`` written once against the
:class:`~taste_cl.engine.base.Engine` interface: test on the batch (the prequential score),
draw replayed rows from one seeded ``numpy`` stream, form the strategy's loss and its
gradient with respect to the outputs (:mod:`taste_cl.engine.losses`), turn that into
parameter gradients with the engine, clip them to ``max_grad_norm`` as torch does, and let
the :class:`~taste_cl.guards.device.DeviceUpdateGuard` take, refuse or undo the
step. The same seeds give the same replay draws on every engine, so two engines that agree
on the model's numbers agree on the whole run.

Strategies: ``"er"``, ``"er_ace"``, ``"der++"`` (the buffer stores each row's outputs) and
``"lwf"`` (a teacher snapshot of the parameters, taken every ``lwf_every`` observes and/or, with
``lwf_on_drift``, when the monitor reports drift, as torch's ``LwF(every=, on_drift=)``).
Buffers: ``"reservoir"`` or ``"class_balanced"`` (equal quotas per class), whose decisions
(:mod:`taste_cl.replay.draws`) are the torch buffers' own. The monitor
(:class:`~taste_cl.engine.monitor.LoopMonitor`) records every observe and evaluates its probe when the
torch monitor would. Classification with integer labels. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from taste_cl._checks import INT_LIMIT, check_finite_positive, check_int
from taste_cl.engine import losses
from taste_cl.engine.base import Engine
from taste_cl.engine.monitor import LoopMonitor
from taste_cl.engine.probe_guard import LoopProbeGuard
from taste_cl.exceptions import InvalidBatchError
from taste_cl.guards.device import DeviceUpdateGuard, StepMeasure, check_finite_outputs, measure_arrays
from taste_cl.replay.draws import ClassQuotaIndex, ReservoirIndex, apply_plan, draw_rows, new_rng

__all__ = ["BUFFERS", "STRATEGIES", "EngineLearner", "EngineStats", "LoopReplay"]

STRATEGIES = ("er", "er_ace", "der++", "lwf")
BUFFERS = ("reservoir", "class_balanced")


@dataclass(frozen=True)
class EngineStats:
    """One ``observe``: the mean loss of its steps, the prequential accuracy, and the steps taken or refused."""

    loss: float
    accuracy: float
    steps: int
    refused: int


class LoopReplay:
    """A bounded buffer of rows ``x``, labels and stored outputs, carrying out the decisions of
    :mod:`taste_cl.replay.draws` (the torch buffers' decisions, from the same generator)."""

    def __init__(self, capacity: int, policy: str, rng: np.random.Generator) -> None:
        self.capacity = check_int("capacity", capacity, 1)
        if policy not in BUFFERS:
            raise ValueError(f"`replay == {policy!r}`, must be one of {BUFFERS}")
        self.policy = policy
        self.rng = rng
        self.index: ReservoirIndex | ClassQuotaIndex = ReservoirIndex(capacity, rng) if policy == "reservoir" else ClassQuotaIndex(capacity, rng)
        self.size = 0
        self._x: np.ndarray | None = None  # allocated on the first rows, ``capacity`` long
        self._y = np.zeros(capacity, dtype=np.int64)
        self._outputs: np.ndarray | None = None

    def __len__(self) -> int:
        return self.size

    @property
    def seen(self) -> int:
        """Rows offered so far."""
        index = self.index
        return index.seen if isinstance(index, ReservoirIndex) else sum(index.seen.values())

    @property
    def row_shape(self) -> tuple[int, ...] | None:
        return None if self._x is None else tuple(self._x.shape[1:])

    def rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the rows at ``index``: inputs, labels and stored outputs."""
        assert self._x is not None and self._outputs is not None
        return self._x[index], self._y[index], self._outputs[index]

    def add(self, x: np.ndarray, y: np.ndarray, outputs: np.ndarray) -> None:
        if self._x is None or self._outputs is None:
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
            self._outputs = np.empty((self.capacity, *outputs.shape[1:]), dtype=outputs.dtype)
        plan = self.index.offer(y.shape[0]) if isinstance(self.index, ReservoirIndex) else self.index.offer(y.tolist())
        self.size = apply_plan(plan, (self._x, self._y, self._outputs), (x, y, outputs), self.size)

    def sample(self, n: int) -> np.ndarray:
        """Indices of ``n`` rows drawn without replacement (fewer if the buffer holds fewer)."""
        return draw_rows(self.rng, self.size, n)

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored rows (copies), for a saved state."""
        if self._x is None or self._outputs is None:
            return {}
        return {"replay.x": self._x[: self.size].copy(), "replay.y": self._y[: self.size].copy(), "replay.outputs": self._outputs[: self.size].copy()}

    def counts(self) -> dict[str, Any]:
        """The plain part of a saved state: rows held and seen, and a class-balanced buffer's classes, their counts and slots."""
        index = self.index
        if isinstance(index, ReservoirIndex):
            return {"size": self.size, "seen": index.seen}
        return {"size": self.size, "seen": self.seen, "classes": list(index.classes), "class_seen": [index.seen[c] for c in index.classes],
                "slots": [list(index.slots[c]) for c in index.classes]}  # fmt: skip

    def check_state(self, counts: Any, arrays: Mapping[str, np.ndarray], num_classes: int) -> None:
        """``ValueError`` naming the first thing in ``counts`` (from :meth:`counts`) and ``arrays`` (from
        :meth:`arrays`) that cannot be this buffer's state; nothing changes."""
        keys = ("size", "seen") if self.policy == "reservoir" else ("size", "seen", "classes", "class_seen", "slots")
        if not isinstance(counts, Mapping) or set(counts) != set(keys):
            raise ValueError(f"`replay` must be an object with exactly {list(keys)} for a {self.policy} buffer")
        size, seen = counts["size"], counts["seen"]
        if type(size) is not int or type(seen) is not int or not 0 <= size <= self.capacity or not size <= seen <= INT_LIMIT:
            raise ValueError(f"replay size {size!r} and seen {seen!r} must be ints with 0 <= size <= capacity ({self.capacity}) and size <= seen")
        if self.policy == "reservoir" and size != min(seen, self.capacity):
            raise ValueError(f"a reservoir that has seen {seen} rows holds {min(seen, self.capacity)}; the state holds {size}")
        if size:
            missing = {"replay.x", "replay.y", "replay.outputs"} - set(arrays)
            if missing:
                raise ValueError(f"the saved state lacks {sorted(missing)}")
            x, y, outputs = arrays["replay.x"], arrays["replay.y"], arrays["replay.outputs"]
            if x.shape[0] != size or y.shape != (size,) or outputs.shape[0] != size:
                raise ValueError(f"replay arrays must hold {size} rows; got {x.shape[0]}, {y.shape}, {outputs.shape[0]}")
            if y.dtype != np.int64 or (y.min() < 0 or y.max() >= num_classes):
                raise ValueError(f"replay.y must hold int64 labels in [0, {num_classes})")
            for name, value in (("replay.x", x), ("replay.outputs", outputs)):
                if value.dtype.kind == "f" and not np.isfinite(value).all():
                    raise ValueError(f"{name} holds NaN or infinite values")
            if self._x is not None and (x.shape[1:] != self._x.shape[1:] or x.dtype != self._x.dtype):
                raise ValueError(f"replay.x rows must be {self._x.dtype} {self._x.shape[1:]}; got {x.dtype} {x.shape[1:]}")
        if isinstance(self.index, ClassQuotaIndex):
            labels = arrays["replay.y"].tolist() if size else []
            self.index.check_state(counts["classes"], counts["class_seen"], counts["slots"], labels)
            if sum(counts["class_seen"]) != seen:
                raise ValueError(f"the classes' seen counts must add up to `seen` ({seen})")

    def load_state(self, counts: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Apply what :meth:`check_state` accepted."""
        size = counts["size"]
        if isinstance(self.index, ReservoirIndex):
            self.index.seen = counts["seen"]
        else:
            self.index.load_state(counts["classes"], counts["class_seen"], counts["slots"])
        self.size = size
        if size:
            x, outputs = arrays["replay.x"], arrays["replay.outputs"]
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
            self._outputs = np.empty((self.capacity, *outputs.shape[1:]), dtype=outputs.dtype)
            self._x[:size], self._y[:size], self._outputs[:size] = x, arrays["replay.y"], outputs


class EngineLearner:
    """Online continual learning on an :class:`~taste_cl.engine.base.Engine` (see the module).

    ``lr`` is the learning rate every step uses; ``seed`` seeds the one generator that draws
    replay (and evicts); ``guard`` is the update guard (default: ``DeviceUpdateGuard()``);
    ``monitor`` measures stability, plasticity, forgetting and drift and emits their events, the guard's
    refusals as ``numerical_fault`` (default: ``LoopMonitor()``, as the torch learner's default monitor);
    ``probe_guard`` rolls back update windows that made the model worse on its probe
    (:class:`~taste_cl.engine.probe_guard.LoopProbeGuard`; default None: off, as torch's ``ProbeGuard`` plugin).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        lr: float,
        num_classes: int,
        strategy: str = "er",
        replay: str | None = "reservoir",
        capacity: int = 200,
        replay_batch_size: int = 10,
        train_iterations: int = 1,
        max_grad_norm: float | None = None,
        alpha: float = 1.0,
        beta: float = 1.0,
        temperature: float = 2.0,
        lwf_every: int | None = 50,
        lwf_on_drift: bool = False,
        guard: DeviceUpdateGuard | None = None,
        seed: int = 0,
        monitor: LoopMonitor | None = None,
        probe_guard: LoopProbeGuard | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"`strategy == {strategy!r}`, must be one of {STRATEGIES}")
        if strategy == "der++" and replay is None:
            raise ValueError("DER++ replays stored outputs: it needs a replay buffer")
        self.engine = engine
        self.lr = check_finite_positive("lr", lr)
        self.num_classes = check_int("num_classes", num_classes, 2)
        self.strategy = strategy
        self.replay_batch_size = check_int("replay_batch_size", replay_batch_size, 0)
        self.train_iterations = check_int("train_iterations", train_iterations, 1)
        self.max_grad_norm = None if max_grad_norm is None else check_finite_positive("max_grad_norm", max_grad_norm)
        self.alpha, self.beta, self.temperature = float(alpha), float(beta), check_finite_positive("temperature", temperature)
        self.lwf_every = None if lwf_every is None else check_int("lwf_every", lwf_every, 1)
        self.lwf_on_drift = bool(lwf_on_drift)
        if strategy == "lwf" and self.lwf_every is None and not self.lwf_on_drift:
            raise ValueError("LwF needs a moment to take its snapshot: set lwf_every=N or lwf_on_drift=True")
        self.guard = guard if guard is not None else DeviceUpdateGuard()
        self.rng = new_rng(seed)
        self.replay = None if replay is None else LoopReplay(capacity, replay, self.rng)
        self.teacher: dict[str, np.ndarray] | None = None
        self.observes = 0
        self.replay_draws: list[np.ndarray] = []  # the indices each step replayed (the last 1000)
        self.monitor = monitor if monitor is not None else LoopMonitor()
        if strategy == "lwf" and self.lwf_on_drift:  # as torch's LwF(on_drift=True): a snapshot when the monitor reports drift
            self.monitor.subscribe(lambda event: self._snapshot_teacher(), "drift_detected")
        self.probe_guard = probe_guard
        if probe_guard is not None:
            probe_guard.attach(self)

    # ---------------------------------------------------------------- checks
    def _check(self, x: np.ndarray, y: Any) -> np.ndarray:
        labels = np.asarray(y)
        if labels.ndim != 1 or labels.shape[0] != x.shape[0] or labels.shape[0] == 0:
            raise InvalidBatchError(f"y must be a 1-D array with one label per row of x ({x.shape[0]}); got shape {labels.shape}")
        if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= self.num_classes:
            raise InvalidBatchError(f"y must hold integer labels in [0, {self.num_classes}); got {labels.dtype} in [{labels.min()}, {labels.max()}]")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise InvalidBatchError("x holds NaN or infinite values")
        shape = (None if self.replay is None else self.replay.row_shape) or self.monitor.row_shape
        if shape is not None and tuple(x.shape[1:]) != shape:
            raise InvalidBatchError(f"x rows must have shape {shape}; got {x.shape[1:]}")
        return labels.astype(np.int64)

    # ---------------------------------------------------------------- the loop
    def observe(self, x: np.ndarray, y: Any) -> EngineStats:
        """Test-then-train on one stream batch."""
        x = np.asarray(x)
        labels = self._check(x, y)
        scored = self.engine.forward(x, train=False)
        accuracy = float((scored.argmax(axis=1) == labels).mean()) if np.isfinite(scored).all() else 0.0
        total, steps, refused, finite = 0.0, 0, 0, True
        outputs = scored
        for _ in range(self.train_iterations):
            loss, stream_outputs, cause = self._step(x, labels)
            total += loss
            outputs = stream_outputs
            steps += cause is None
            refused += cause is not None
            finite &= math.isfinite(loss)
            if cause is not None:
                self.monitor.emit("numerical_fault", micro_batches=1, cause=cause)
        if self.replay is not None and np.isfinite(outputs).all():
            self.replay.add(x, labels, outputs)
        self._monitor(x, labels, scored, store=finite)
        self.observes += 1
        if self.strategy == "lwf" and self.lwf_every is not None and self.observes % self.lwf_every == 0:
            self._snapshot_teacher()
        if self.probe_guard is not None:  # after the buffer and the monitor took the batch, as torch's plugins
            self.probe_guard.after_observe(self, x, labels)
        self.monitor.dispatch()
        return EngineStats(total / self.train_iterations, accuracy, steps, refused)

    def _monitor(self, x: np.ndarray, y: np.ndarray, scored: np.ndarray, *, store: bool) -> None:
        """Record the batch's prequential score and, every ``eval_every`` observes, evaluate the probe on the
        trained model, as the torch learner does after each stream batch; a batch whose loss overflowed is not stored."""
        self.monitor.record(x, y, scored, store=store)
        if self.monitor.due():
            self.monitor.evaluate(lambda rows: self.engine.forward(rows, train=False))

    def _step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, str | None]:
        n_stream = y.shape[0]
        drawn = None
        if self.replay is not None and len(self.replay) and self.replay_batch_size:
            drawn = self.replay.sample(self.replay_batch_size)
            self.replay_draws = [*self.replay_draws[-999:], drawn]
            replay_x, replay_y, _ = self.replay.rows(drawn)
            x, y = np.concatenate([x, replay_x]), np.concatenate([y, replay_y])
        teacher = self._teacher_outputs(x) if self.strategy == "lwf" and self.teacher is not None else None
        outputs = self.engine.forward(x, train=True)
        loss, grad = self._loss(outputs, y, n_stream, drawn, teacher)
        gradients = self.engine.backward(grad)
        norm = losses.total_norm(gradients)
        if self.max_grad_norm is not None:
            gradients, norm = losses.clip_by_total_norm(gradients, self.max_grad_norm)
            norm = min(norm, self.max_grad_norm)
        cause = self.guard.step(_Session(self.engine), lambda: self.engine.step(gradients, self.lr), lr=self.lr, grad_norm=norm, loss=loss)
        return loss, outputs[:n_stream], cause

    def _loss(
        self, outputs: np.ndarray, y: np.ndarray, n_stream: int, drawn: np.ndarray | None, teacher: np.ndarray | None
    ) -> tuple[float, np.ndarray]:
        if self.strategy == "er_ace":
            return losses.er_ace(outputs, y, n_stream)
        if self.strategy == "der++":
            stored = None if drawn is None or self.replay is None else self.replay.rows(drawn)[2]
            return losses.der_plus_plus(outputs, y, n_stream, stored, alpha=self.alpha, beta=self.beta)
        if self.strategy == "lwf":
            return losses.lwf(outputs, y, n_stream, teacher, alpha=self.alpha, temperature=self.temperature)
        return losses.experience_replay(outputs, y, n_stream)

    def _snapshot_teacher(self) -> None:
        self.teacher = self.engine.parameters()

    def _teacher_outputs(self, x: np.ndarray) -> np.ndarray:
        assert self.teacher is not None
        current = self.engine.parameters()
        self.engine.load_parameters(self.teacher)
        try:
            return self.engine.forward(x, train=False)
        finally:
            self.engine.load_parameters(current)

    # ---------------------------------------------------------------- resume
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Everything a resumed run needs, as plain values and named arrays: the engine's parameters and
        optimizer state, the replay rows, the generator, the teacher, the guard's history and the counters."""
        arrays = {f"param.{k}": v for k, v in self.engine.parameters().items()}
        arrays |= {f"optim.{k}": np.asarray(v) for k, v in self.engine.optimizer_state().items()}
        arrays |= {f"teacher.{k}": v.copy() for k, v in (self.teacher or {}).items()}
        replay = None
        if self.replay is not None:
            arrays |= self.replay.arrays()
            replay = self.replay.counts()
        plain = {
            "format": 1,
            "observes": self.observes,
            "rng": self.rng.bit_generator.state,
            "replay": replay,
            "teacher": self.teacher is not None,
            "guard": self.guard.state_dict(),
        }
        monitor_plain, monitor_arrays = self.monitor.state()
        plain["monitor"] = monitor_plain
        plain["probe_guard"], guard_arrays = self.probe_guard.state() if self.probe_guard is not None else (None, {})
        return plain, arrays | monitor_arrays | guard_arrays

    def load_state(self, plain: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state` of a learner built with the same settings on the same engine: every value is
        checked first (``ValueError`` naming it), and nothing changes unless all of it loads."""
        if not isinstance(plain, Mapping) or plain.get("format") != 1:
            raise ValueError("the saved loop state must be an object with format 1")
        observes = plain.get("observes")
        if isinstance(observes, bool) or not isinstance(observes, int) or not 0 <= observes <= 2**53:
            raise ValueError(f"`observes == {observes!r}`, must be an int in [0, 2**53]")
        rng = np.random.default_rng()
        saved_rng: Any = plain.get("rng")
        try:
            rng.bit_generator.state = saved_rng
        except (TypeError, ValueError, KeyError) as error:
            raise ValueError(f"`rng` is not a {type(self.rng.bit_generator).__name__} state: {error}") from None
        params = {k.removeprefix("param."): v for k, v in arrays.items() if k.startswith("param.")}
        current = self.engine.parameters()
        if params.keys() != current.keys() or any(params[k].shape != current[k].shape or params[k].dtype != current[k].dtype for k in params):
            raise ValueError("the saved parameters must be this engine's trainable tensors, with their shapes and dtypes")
        if not all(np.isfinite(v).all() for v in params.values()):
            raise ValueError("the saved parameters hold NaN or infinite values")
        teacher = {k.removeprefix("teacher."): v for k, v in arrays.items() if k.startswith("teacher.")}
        if bool(plain.get("teacher")) != bool(teacher) or (teacher and teacher.keys() != current.keys()):
            raise ValueError("the saved teacher must be absent or hold every trainable tensor")
        replay: Any = plain.get("replay")
        if (replay is None) != (self.replay is None):
            raise ValueError("the saved state and this learner disagree on having a replay buffer")
        if self.replay is not None:
            self.replay.check_state(replay, arrays, self.num_classes)
        probe = DeviceUpdateGuard()
        probe.load_state_dict(plain.get("guard"))
        if "monitor" in plain:  # states saved before the loop had a monitor carry none: it is left as it is
            self.monitor.check_state(plain["monitor"], arrays, self.num_classes)
        guard_state = self._check_probe_guard(plain, arrays)
        snapshot = self.engine.parameters(), self.engine.optimizer_state()
        try:
            self.engine.load_parameters(params)
            self.engine.load_optimizer_state({k.removeprefix("optim."): v for k, v in arrays.items() if k.startswith("optim.")})
        except (ValueError, KeyError, RuntimeError) as error:
            self.engine.load_parameters(snapshot[0])
            self.engine.load_optimizer_state(snapshot[1])
            raise ValueError(f"the engine refused the saved optimizer state: {error}") from None
        self.guard.load_state_dict(plain["guard"])
        if self.replay is not None:
            self.replay.load_state(replay, arrays)
        self.rng.bit_generator.state = rng.bit_generator.state  # the replay buffer shares this generator
        self.teacher = {k: v.copy() for k, v in teacher.items()} or None
        self.observes = observes
        if "monitor" in plain:
            self.monitor.load_state(plain["monitor"], arrays, self.num_classes)
        if self.probe_guard is not None and guard_state is not None:
            self.probe_guard.load_state(guard_state, arrays)

    def _check_probe_guard(self, plain: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
        """The saved probe guard's state checked (``ValueError``); None for a state saved before the loop had one."""
        if "probe_guard" not in plain:
            return None
        if (plain["probe_guard"] is None) != (self.probe_guard is None):
            raise ValueError("the saved state and this learner disagree on having a probe guard")
        return None if self.probe_guard is None else self.probe_guard.check_state(plain["probe_guard"], arrays, self)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Outputs for ``x``; :class:`~taste_cl.exceptions.NonFiniteOutputError` rather than NaN."""
        outputs = self.engine.forward(np.asarray(x), train=False)
        check_finite_outputs(outputs, self.guard)
        return outputs


class _Session:
    """The guard's view of an engine: a step's state is its parameters and optimizer state."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def save_step_state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self.engine.parameters(), self.engine.optimizer_state()

    def measure_step(self, saved: Any) -> StepMeasure:
        before: Mapping[str, np.ndarray] = saved[0]
        after = self.engine.parameters()
        return measure_arrays((old, after[name]) for name, old in before.items())

    def restore_step_state(self, saved: Any) -> None:
        self.engine.load_parameters(saved[0])
        self.engine.load_optimizer_state(saved[1])
