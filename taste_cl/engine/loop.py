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
``"lwf"`` (a teacher snapshot of the parameters, taken every ``lwf_every`` observes).
Buffers: ``"reservoir"`` or ``"class_balanced"`` (the largest class gives up a random row
when full). Classification with integer labels. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from taste_cl._checks import check_finite_positive, check_int
from taste_cl.engine import losses
from taste_cl.engine.base import Engine
from taste_cl.exceptions import InvalidBatchError
from taste_cl.guards.device import DeviceUpdateGuard, StepMeasure, check_finite_outputs, measure_arrays

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
    """A bounded buffer of rows ``x``, labels and stored outputs, drawn from the loop's generator."""

    def __init__(self, capacity: int, policy: str, rng: np.random.Generator) -> None:
        self.capacity = check_int("capacity", capacity, 1)
        if policy not in BUFFERS:
            raise ValueError(f"`replay == {policy!r}`, must be one of {BUFFERS}")
        self.policy = policy
        self.rng = rng
        self.seen = 0
        self.size = 0
        self._x: np.ndarray | None = None  # allocated on the first rows, ``capacity`` long
        self._y = np.zeros(capacity, dtype=np.int64)
        self._outputs: np.ndarray | None = None

    def __len__(self) -> int:
        return self.size

    @property
    def row_shape(self) -> tuple[int, ...] | None:
        return None if self._x is None else tuple(self._x.shape[1:])

    def rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the rows at ``index``: inputs, labels and stored outputs."""
        assert self._x is not None and self._outputs is not None
        return self._x[index], self._y[index], self._outputs[index]

    def _slot(self, label: int) -> int | None:
        """Where a new row goes once full (None: not kept)."""
        if self.policy == "reservoir":
            j = int(self.rng.integers(0, self.seen))
            return j if j < self.capacity else None
        counts = np.bincount(self._y, minlength=label + 1)
        largest = int(counts.argmax())
        if counts[label] >= counts[largest]:
            return None  # its class already holds the most rows
        return int(self.rng.choice(np.flatnonzero(self._y == largest)))

    def add(self, x: np.ndarray, y: np.ndarray, outputs: np.ndarray) -> None:
        if self._x is None or self._outputs is None:
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
            self._outputs = np.empty((self.capacity, *outputs.shape[1:]), dtype=outputs.dtype)
        for i in range(y.shape[0]):
            self.seen += 1
            slot: int | None = self.size
            if self.size < self.capacity:
                self.size += 1
            else:
                slot = self._slot(int(y[i]))
            if slot is not None:
                self._x[slot], self._y[slot], self._outputs[slot] = x[i], y[i], outputs[i]

    def sample(self, n: int) -> np.ndarray:
        """Indices of ``n`` rows drawn without replacement (fewer if the buffer holds fewer)."""
        return np.sort(self.rng.choice(self.size, size=min(n, self.size), replace=False))

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored rows (copies), for a saved state."""
        if self._x is None or self._outputs is None:
            return {}
        return {"replay.x": self._x[: self.size].copy(), "replay.y": self._y[: self.size].copy(), "replay.outputs": self._outputs[: self.size].copy()}

    def check_arrays(self, arrays: Mapping[str, np.ndarray], size: int, seen: int, num_classes: int) -> None:
        """``ValueError`` naming the first of ``arrays`` (from :meth:`arrays`) that cannot be this buffer's ``size`` rows."""
        if not 0 <= size <= self.capacity or not size <= seen <= 2**53:
            raise ValueError(f"replay size {size} and seen {seen} must satisfy 0 <= size <= capacity ({self.capacity}) and size <= seen <= 2**53")
        if size == 0:
            return
        missing = {"replay.x", "replay.y", "replay.outputs"} - set(arrays)
        if missing:
            raise ValueError(f"the saved state lacks {sorted(missing)}")
        x, y, outputs = arrays["replay.x"], arrays["replay.y"], arrays["replay.outputs"]
        if x.shape[0] != size or y.shape != (size,) or outputs.shape[0] != size:
            raise ValueError(f"replay arrays must hold {size} rows; got {x.shape[0]}, {y.shape}, {outputs.shape[0]}")
        if y.dtype != np.int64 or (y.size and (y.min() < 0 or y.max() >= num_classes)):
            raise ValueError(f"replay.y must hold int64 labels in [0, {num_classes})")
        for name, value in (("replay.x", x), ("replay.outputs", outputs)):
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise ValueError(f"{name} holds NaN or infinite values")
        if self._x is not None and (x.shape[1:] != self._x.shape[1:] or x.dtype != self._x.dtype):
            raise ValueError(f"replay.x rows must be {self._x.dtype} {self._x.shape[1:]}; got {x.dtype} {x.shape[1:]}")

    def load_arrays(self, arrays: Mapping[str, np.ndarray], size: int, seen: int) -> None:
        """Apply what :meth:`check_arrays` accepted."""
        self.size, self.seen = size, seen
        if size:
            x, outputs = arrays["replay.x"], arrays["replay.outputs"]
            self._x = np.empty((self.capacity, *x.shape[1:]), dtype=x.dtype)
            self._outputs = np.empty((self.capacity, *outputs.shape[1:]), dtype=outputs.dtype)
            self._x[:size], self._y[:size], self._outputs[:size] = x, arrays["replay.y"], outputs


class EngineLearner:
    """Online continual learning on an :class:`~taste_cl.engine.base.Engine` (see the module).

    ``lr`` is the learning rate every step uses; ``seed`` seeds the one generator that draws
    replay (and evicts); ``guard`` is the update guard (default: ``DeviceUpdateGuard()``).
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
        lwf_every: int = 50,
        guard: DeviceUpdateGuard | None = None,
        seed: int = 0,
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
        self.lwf_every = check_int("lwf_every", lwf_every, 1)
        self.guard = guard if guard is not None else DeviceUpdateGuard()
        self.rng = np.random.default_rng(seed)
        self.replay = None if replay is None else LoopReplay(capacity, replay, self.rng)
        self.teacher: dict[str, np.ndarray] | None = None
        self.observes = 0
        self.replay_draws: list[np.ndarray] = []  # the indices each step replayed (the last 1000)

    # ---------------------------------------------------------------- checks
    def _check(self, x: np.ndarray, y: Any) -> np.ndarray:
        labels = np.asarray(y)
        if labels.ndim != 1 or labels.shape[0] != x.shape[0] or labels.shape[0] == 0:
            raise InvalidBatchError(f"y must be a 1-D array with one label per row of x ({x.shape[0]}); got shape {labels.shape}")
        if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= self.num_classes:
            raise InvalidBatchError(f"y must hold integer labels in [0, {self.num_classes}); got {labels.dtype} in [{labels.min()}, {labels.max()}]")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise InvalidBatchError("x holds NaN or infinite values")
        shape = None if self.replay is None else self.replay.row_shape
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
        total, steps, refused = 0.0, 0, 0
        outputs = scored
        for _ in range(self.train_iterations):
            loss, stream_outputs, cause = self._step(x, labels)
            total += loss
            outputs = stream_outputs
            steps += cause is None
            refused += cause is not None
        if self.replay is not None and np.isfinite(outputs).all():
            self.replay.add(x, labels, outputs)
        self.observes += 1
        if self.strategy == "lwf" and self.observes % self.lwf_every == 0:
            self.teacher = self.engine.parameters()
        return EngineStats(total / self.train_iterations, accuracy, steps, refused)

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
            replay = {"size": len(self.replay), "seen": self.replay.seen}
        plain = {
            "format": 1,
            "observes": self.observes,
            "rng": self.rng.bit_generator.state,
            "replay": replay,
            "teacher": self.teacher is not None,
            "guard": self.guard.state_dict(),
        }
        return plain, arrays

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
            counts = [replay.get(k) for k in ("size", "seen")] if isinstance(replay, Mapping) else [None]
            if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
                raise ValueError("`replay` must be an object with int `size` and `seen`")
            self.replay.check_arrays(arrays, replay["size"], replay["seen"], self.num_classes)
        probe = DeviceUpdateGuard()
        probe.load_state_dict(plain.get("guard"))
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
            self.replay.load_arrays(arrays, replay["size"], replay["seen"])
        self.rng.bit_generator.state = rng.bit_generator.state  # the replay buffer shares this generator
        self.teacher = {k: v.copy() for k, v in teacher.items()} or None
        self.observes = observes

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
