"""The probe guard of the engine loop, in numpy: the torch :class:`~taste_cl.guards.probe.ProbeGuard`, torch-free.

:class:`LoopProbeGuard` splits an :class:`~taste_cl.engine.loop.EngineLearner`'s stream into update
windows of ``window`` observes and keeps a snapshot of the last accepted window: the engine's
parameters and optimizer state and (``restore_replay``) the replay buffer with the generator it
draws from. At the end of each window it scores the model (the eval forward) on its probe: rows of
the windows it accepted before, kept class-balanced by
:class:`~taste_cl.replay.draws.ClassQuotaIndex` from a generator seeded with ``seed`` (the torch
guard's probe decisions, so the same seed keeps the same rows), or a fixed probe ``(x, y)``. The
verdict is :mod:`taste_cl.guards.probe_rule`'s, as in torch: a window whose probe score dropped by
more than ``max_drop`` or whose negative flip rate exceeds ``max_flip_rate`` is rolled back to the
snapshot, its rows are dropped, the loop's monitor emits ``update_rolled_back`` and the loop's ``lr``
is multiplied by ``lr_factor`` (not below ``min_lr``); an accepted window is snapshotted and its rows
join the probe. Classification with integer labels, as the loop.

Its state (:meth:`LoopProbeGuard.state`) carries the snapshot, so a loop saved mid-window resumes
with the same rollbacks. The fixed probe is a constructor argument, not state (as in torch).

>>> import numpy as np
>>> guard = LoopProbeGuard(window=2)
>>> guard.settings()["window"], guard.windows, guard.lost_updates != guard.lost_updates
(2, 0, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from taste_cl._checks import INT_LIMIT
from taste_cl.engine.monitor import ProbeRows
from taste_cl.guards.probe_rule import check_probe_settings, lowered_lr, regressed, window_verdict
from taste_cl.replay.draws import draw_rows

if TYPE_CHECKING:
    from taste_cl.engine.loop import EngineLearner

__all__ = ["NAME", "SETTINGS", "LoopProbeGuard"]

NAME = "probe_guard"
SETTINGS = ("window", "max_drop", "max_flip_rate", "probe_capacity", "lr_factor", "min_lr", "restore_replay", "warmup", "seed")
_PLAIN = {"windows", "rollbacks", "calls", "next_id", "probe", "baseline", "pending", "snapshot"}
_SNAPSHOT = f"{NAME}.snapshot."


@dataclass(frozen=True)
class _Snapshot:
    """What a rollback restores: parameters, optimizer state and, with ``restore_replay``, the buffer's counts, rows and generator."""

    parameters: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    replay: tuple[dict[str, Any], dict[str, np.ndarray]] | None
    rng: Mapping[str, Any] | None


class LoopProbeGuard:
    """Roll back an update window of the engine loop that lowers the probe score (see the module); the torch
    guard's settings and defaults. Give it to the loop: ``EngineLearner(engine, ..., probe_guard=LoopProbeGuard())``."""

    def __init__(
        self,
        *,
        window: int = 10,
        max_drop: float = 0.05,
        max_flip_rate: float | None = 0.1,
        probe: tuple[Any, Any] | None = None,
        probe_capacity: int = 200,
        lr_factor: float = 1.0,
        min_lr: float = 0.0,
        restore_replay: bool = True,
        warmup: int = 0,
        seed: int = 0,
    ) -> None:
        checked = check_probe_settings(window=window, max_drop=max_drop, max_flip_rate=max_flip_rate, probe_capacity=probe_capacity,
                                       lr_factor=lr_factor, min_lr=min_lr, warmup=warmup, seed=seed)  # fmt: skip
        self.window, self.warmup, self.seed, self.probe_capacity = window, warmup, seed, probe_capacity
        self.max_drop, self.max_flip_rate = checked["max_drop"], checked["max_flip_rate"]
        self.lr_factor, self.min_lr = checked["lr_factor"], checked["min_lr"]
        self.restore_replay = bool(restore_replay)
        self.fixed = None if probe is None else _fixed_probe(probe)
        self.probe = ProbeRows(probe_capacity, seed, f"{NAME}.probe")
        self.windows = self.rollbacks = self.calls = self.next_id = 0
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._baseline = (np.zeros(0, np.int64), np.zeros(0, np.bool_))  # probe ids and whether each was right at the last accepted window
        self._snapshot: _Snapshot | None = None

    def settings(self) -> dict[str, Any]:
        """The constructor arguments but the fixed probe: what an exported folder's manifest keeps."""
        return {key: getattr(self, key) for key in SETTINGS}

    @classmethod
    def from_settings(cls, settings: Any) -> LoopProbeGuard:
        """A guard built from :meth:`settings` output; ``ValueError`` naming the first bad ``probe_guard.<key>``."""
        if not isinstance(settings, Mapping) or set(settings) != set(SETTINGS):
            raise ValueError(f"`{NAME}` must be an object with exactly the keys {sorted(SETTINGS)}")
        for key, high in (("window", 2**31), ("probe_capacity", 10_000_000), ("warmup", 2**31), ("seed", 2**63 - 1)):
            if type(settings[key]) is not int or not settings[key] <= high:
                raise ValueError(f"`{NAME}.{key} == {settings[key]!r}`, must be an int <= {high}")
        for key in ("max_drop", "min_lr"):
            if isinstance(settings[key], float) and not math.isfinite(settings[key]):
                raise ValueError(f"`{NAME}.{key} == {settings[key]!r}`, must be finite")
        if not isinstance(settings["restore_replay"], bool):
            raise ValueError(f"`{NAME}.restore_replay == {settings['restore_replay']!r}`, must be a bool")  # noqa: TRY004 - a bad manifest value, like every refusal here
        try:
            return cls(**settings)
        except ValueError as error:
            raise ValueError(f"`{NAME}`: {error}") from None

    # ---------------------------------------------------------------- the windows
    def attach(self, learner: EngineLearner) -> None:
        """Snapshot ``learner`` as it is now: the accepted state a rollback returns to (the loop calls this when built)."""
        self._snapshot = self._take(learner)

    def after_observe(self, learner: EngineLearner, x: np.ndarray, y: np.ndarray) -> None:
        """Count an observe of rows ``x``, labels ``y`` (kept for the probe unless it is fixed); judge the window at its end."""
        if self.fixed is None:
            self._pending.append((x.copy(), y.copy()))
        self.calls += 1
        if self.calls % self.window == 0:
            self.end_window(learner)

    def end_window(self, learner: EngineLearner) -> bool:
        """Judge the window that just ended: True if it was kept, False if rolled back."""
        self.windows += 1
        ids, right = self._score(learner)
        base_ids, base_right = self._baseline
        scores, correct = dict(zip(ids.tolist(), right.astype(np.float64).tolist())), dict(zip(ids.tolist(), right.tolist()))
        baseline = dict(zip(base_ids.tolist(), base_right.astype(np.float64).tolist()))
        drop, flips, common = window_verdict(baseline, dict(zip(base_ids.tolist(), base_right.tolist())), scores, correct)
        if regressed(windows=self.windows, warmup=self.warmup, drop=drop, flips=flips, max_drop=self.max_drop, max_flip_rate=self.max_flip_rate):
            self._rollback(learner, drop=drop, negative_flip_rate=flips, probe_samples=common)
            return False
        self._snapshot = self._take(learner)
        self._baseline = (ids, right)
        if self._pending:  # one offer for the whole window, as torch
            x, y = np.concatenate([x for x, _ in self._pending]), np.concatenate([y for _, y in self._pending])
            self.probe.add(x, y, self.next_id)
            self.next_id += int(y.shape[0])
        self._pending = []
        return True

    def _score(self, learner: EngineLearner) -> tuple[np.ndarray, np.ndarray]:
        """The probe's ids and whether the model gets each right now."""
        if self.fixed is not None:
            x, y = self.fixed
            ids = np.arange(y.shape[0], dtype=np.int64)
        elif len(self.probe):
            draw_rows(self.probe.rng, len(self.probe), len(self.probe))  # the draw torch's probe makes to read every row
            x, y, ids = self.probe.rows()
        else:
            return np.zeros(0, np.int64), np.zeros(0, np.bool_)
        return ids, np.asarray(learner.engine.forward(x, train=False)).argmax(axis=1) == y

    def _take(self, learner: EngineLearner) -> _Snapshot:
        replay = learner.replay if self.restore_replay else None
        saved = None if replay is None else (replay.counts(), replay.arrays())
        return _Snapshot(
            learner.engine.parameters(), learner.engine.optimizer_state(), saved, None if replay is None else learner.rng.bit_generator.state
        )

    def _rollback(self, learner: EngineLearner, **details: float) -> None:
        snapshot = self._snapshot
        assert snapshot is not None  # the loop attaches the guard when it is built
        learner.engine.load_parameters({k: v.copy() for k, v in snapshot.parameters.items()})
        learner.engine.load_optimizer_state({k: v.copy() for k, v in snapshot.optimizer.items()})
        if snapshot.replay is not None and learner.replay is not None and snapshot.rng is not None:
            learner.replay.load_state(*snapshot.replay)
            learner.rng.bit_generator.state = snapshot.rng
        learner.lr = lowered_lr(learner.lr, self.lr_factor, self.min_lr)
        self._pending = []
        self.rollbacks += 1
        learner.monitor.emit("update_rolled_back", window=self.windows, lr=learner.lr, **details)

    # ---------------------------------------------------------------- reading
    @property
    def accepted_parameters(self) -> dict[str, np.ndarray]:
        """Copies of the parameters of the last accepted window (the model users should be served)."""
        return {} if self._snapshot is None else {k: v.copy() for k, v in self._snapshot.parameters.items()}

    @property
    def lost_updates(self) -> float:
        """Share of windows rolled back (NaN before the first window)."""
        return self.rollbacks / self.windows if self.windows else math.nan

    # ---------------------------------------------------------------- state
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Plain values and ``probe_guard.*`` arrays: counters, probe, baseline, the window's rows and the snapshot."""
        snapshot = self._snapshot
        assert snapshot is not None
        arrays = {f"{NAME}.baseline.ids": self._baseline[0].copy(), f"{NAME}.baseline.correct": self._baseline[1].copy()}
        if len(self.probe):
            arrays |= dict(zip((f"{NAME}.probe.x", f"{NAME}.probe.y", f"{NAME}.probe.sid"), self.probe.rows()))
        if self._pending:
            arrays[f"{NAME}.pending.x"] = np.concatenate([x for x, _ in self._pending])
            arrays[f"{NAME}.pending.y"] = np.concatenate([y for _, y in self._pending])
        arrays |= {f"{_SNAPSHOT}param.{k}": v.copy() for k, v in snapshot.parameters.items()}
        arrays |= {f"{_SNAPSHOT}optim.{k}": np.asarray(v).copy() for k, v in snapshot.optimizer.items()}
        if snapshot.replay is not None:
            arrays |= {f"{_SNAPSHOT}{k}": v.copy() for k, v in snapshot.replay[1].items()}
        plain = {
            "windows": self.windows, "rollbacks": self.rollbacks, "calls": self.calls, "next_id": self.next_id,
            "probe": self.probe.counts(), "baseline": int(self._baseline[0].size), "pending": sum(int(y.shape[0]) for _, y in self._pending),
            "snapshot": {"replay": None if snapshot.replay is None else snapshot.replay[0], "rng": snapshot.rng},
        }  # fmt: skip
        return plain, arrays

    def expected_arrays(
        self, plain: Any, dtype: np.dtype, row: tuple[int, ...], parameters: Mapping[str, tuple[int, ...]],
        optimizer: Mapping[str, tuple[np.dtype, tuple[int, ...]]], num_classes: int,
    ) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:  # fmt: skip
        """The dtype and shape of every ``probe_guard.*`` array the plain state ``plain`` names, for input rows ``dtype``
        ``row``, trainable ``parameters`` shapes and ``optimizer`` state arrays: what a loader checks array headers
        against before reading them (``ValueError`` naming the field)."""
        if not isinstance(plain, Mapping) or set(plain) != _PLAIN or not isinstance(plain["probe"], Mapping):
            raise ValueError(f"`{NAME}` must be an object with exactly the keys {sorted(_PLAIN)}")
        snapshot = plain["snapshot"]
        if not isinstance(snapshot, Mapping) or set(snapshot) != {"replay", "rng"}:
            raise ValueError(f"`{NAME}.snapshot` must be an object with exactly the keys ['replay', 'rng']")
        size = _count(plain["probe"], "size", self.probe_capacity, "probe.")
        baseline = _count(plain, "baseline", self.probe_capacity if self.fixed is None else self.fixed[1].shape[0])
        pending = _count(plain, "pending", INT_LIMIT)
        int64, float32 = np.dtype(np.int64), np.dtype(np.float32)
        expected: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
            f"{NAME}.baseline.ids": (int64, (baseline,)),
            f"{NAME}.baseline.correct": (np.dtype(np.bool_), (baseline,)),
        }
        if size:
            expected |= {f"{NAME}.probe.x": (dtype, (size, *row)), f"{NAME}.probe.y": (int64, (size,)), f"{NAME}.probe.sid": (int64, (size,))}
        if pending:
            expected |= {f"{NAME}.pending.x": (dtype, (pending, *row)), f"{NAME}.pending.y": (int64, (pending,))}
        expected |= {f"{_SNAPSHOT}param.{k}": (float32, tuple(shape)) for k, shape in parameters.items()}
        expected |= {f"{_SNAPSHOT}optim.{k}": value for k, value in optimizer.items()}
        replay = snapshot["replay"]
        if replay is not None:
            if not isinstance(replay, Mapping):
                raise ValueError(f"`{NAME}.snapshot.replay` must be null or an object with int `size`")
            held = _count(replay, "size", INT_LIMIT, "snapshot.replay.")
            if held:
                expected |= {f"{_SNAPSHOT}replay.x": (dtype, (held, *row)), f"{_SNAPSHOT}replay.y": (int64, (held,)),
                             f"{_SNAPSHOT}replay.outputs": (float32, (held, num_classes))}  # fmt: skip
        return expected

    def check_state(self, plain: Any, arrays: Mapping[str, np.ndarray], learner: EngineLearner) -> dict[str, Any]:
        """Check :meth:`state` output for ``learner`` (``ValueError`` naming the field) and return it parsed; changes
        nothing (the snapshot's optimizer state is tried on the engine, then the engine's own is put back)."""
        if not isinstance(plain, Mapping) or set(plain) != _PLAIN:
            raise ValueError(f"`{NAME}` must be an object with exactly the keys {sorted(_PLAIN)}")
        windows = _count(plain, "windows", INT_LIMIT)
        rollbacks, calls, next_id = _count(plain, "rollbacks", windows), _count(plain, "calls", INT_LIMIT), _count(plain, "next_id", INT_LIMIT)
        rng = self.probe.check_state(plain["probe"], arrays, next_id, learner.num_classes)
        base_ids, base_right = arrays.get(f"{NAME}.baseline.ids"), arrays.get(f"{NAME}.baseline.correct")
        count, high = _count(plain, "baseline", INT_LIMIT), next_id if self.fixed is None else self.fixed[1].shape[0]
        if base_ids is None or base_right is None or base_ids.shape != (count,) or base_right.shape != (count,):
            raise ValueError(f"`{NAME}.baseline.ids` and `.correct` must hold {count} values")
        if base_ids.dtype != np.int64 or base_right.dtype != np.bool_ or (count and (base_ids.min() < 0 or base_ids.max() >= high)):
            raise ValueError(f"`{NAME}.baseline.ids` must be int64 ids in [0, {high}) and `.correct` bools")
        if np.unique(base_ids).size != count:
            raise ValueError(f"`{NAME}.baseline.ids` must be distinct")
        pending = self._check_pending(plain, arrays, learner)
        return {"windows": windows, "rollbacks": rollbacks, "calls": calls, "next_id": next_id, "probe": (plain["probe"], rng),
                "baseline": (base_ids.copy(), base_right.copy()), "pending": pending,
                "snapshot": self._check_snapshot(plain["snapshot"], arrays, learner)}  # fmt: skip

    def _check_pending(
        self, plain: Mapping[str, Any], arrays: Mapping[str, np.ndarray], learner: EngineLearner
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        rows = _count(plain, "pending", INT_LIMIT)
        if not rows:
            return []
        x, y = arrays.get(f"{NAME}.pending.x"), arrays.get(f"{NAME}.pending.y")
        if x is None or y is None or x.shape[0] != rows or y.shape != (rows,) or y.dtype != np.int64 or self.fixed is not None:
            raise ValueError(f"`{NAME}.pending.x` and `.y` (int64) must hold {rows} rows (none with a fixed probe)")
        if y.min() < 0 or y.max() >= learner.num_classes:
            raise ValueError(f"`{NAME}.pending.y` must hold labels in [0, {learner.num_classes})")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise ValueError(f"`{NAME}.pending.x` holds NaN or infinite values")
        return [(x.copy(), y.copy())]

    def _check_snapshot(self, snapshot: Any, arrays: Mapping[str, np.ndarray], learner: EngineLearner) -> _Snapshot:
        if not isinstance(snapshot, Mapping) or set(snapshot) != {"replay", "rng"}:
            raise ValueError(f"`{NAME}.snapshot` must be an object with exactly the keys ['replay', 'rng']")
        params = {k.removeprefix(f"{_SNAPSHOT}param."): v for k, v in arrays.items() if k.startswith(f"{_SNAPSHOT}param.")}
        current = learner.engine.parameters()
        if params.keys() != current.keys() or any(params[k].shape != v.shape or params[k].dtype != v.dtype for k, v in current.items()):
            raise ValueError(f"`{_SNAPSHOT}param.*` must be this engine's trainable tensors, with their shapes and dtypes")
        if not all(np.isfinite(v).all() for v in params.values()):
            raise ValueError(f"`{_SNAPSHOT}param.*` holds NaN or infinite values")
        optimizer = {k.removeprefix(f"{_SNAPSHOT}optim."): v.copy() for k, v in arrays.items() if k.startswith(f"{_SNAPSHOT}optim.")}
        own = learner.engine.optimizer_state()
        try:
            learner.engine.load_optimizer_state(optimizer)
        except (ValueError, KeyError, RuntimeError) as error:
            raise ValueError(f"`{_SNAPSHOT}optim.*`: the engine refused it: {error}") from None
        finally:
            learner.engine.load_optimizer_state(own)
        replay, rng_state = snapshot["replay"], snapshot["rng"]
        keep = self.restore_replay and learner.replay is not None
        if (replay is None) == keep or (rng_state is None) == keep:
            raise ValueError(f"`{NAME}.snapshot.replay` and `.rng` must be given exactly when the guard restores a replay buffer")
        saved = None
        if learner.replay is not None and replay is not None:
            rows = {k.removeprefix(_SNAPSHOT): v for k, v in arrays.items() if k.startswith(f"{_SNAPSHOT}replay.")}
            try:
                learner.replay.check_state(replay, rows, learner.num_classes)
                np.random.default_rng().bit_generator.state = rng_state
            except (TypeError, ValueError, KeyError) as error:
                raise ValueError(f"`{NAME}.snapshot`: {error}") from None
            saved = (dict(replay), {k: v.copy() for k, v in rows.items()})
        return _Snapshot({k: v.copy() for k, v in params.items()}, optimizer, saved, None if saved is None else dict(rng_state))

    def load_state(self, parsed: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
        """Apply what :meth:`check_state` returned (``arrays``: the state's arrays, for the probe's rows)."""
        counts, rng = parsed["probe"]
        self.probe.load_state(counts, arrays, rng)
        self.windows, self.rollbacks, self.calls, self.next_id = parsed["windows"], parsed["rollbacks"], parsed["calls"], parsed["next_id"]
        self._baseline, self._pending, self._snapshot = parsed["baseline"], parsed["pending"], parsed["snapshot"]


def _fixed_probe(probe: Any) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(probe, (tuple, list)) or len(probe) != 2:
        raise ValueError("probe must be a pair (x, y) of held-out samples or None")
    x, y = np.asarray(probe[0]), np.asarray(probe[1])
    if y.ndim != 1 or y.shape[0] != x.shape[0] or y.shape[0] == 0 or y.dtype.kind not in "iu":
        raise ValueError(f"probe must be rows x and one integer label per row; got x {x.shape}, y {y.dtype} {y.shape}")
    return x, y.astype(np.int64)


def _count(plain: Mapping[str, Any], key: str, high: int, where: str = "") -> int:
    value = plain.get(key)
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"`{NAME}.{where}{key} == {value!r}`, must be an int in [0, {high}]")
    return value
