"""Elastic selection on the device: re-chosen from the engine's own measured costs and gradients (torch-free).

:class:`~taste_cl.elastic.ElasticTrainer` trains, between probes, only the units (tensors or
modules) of maximal importance whose backward fits a share ``rho`` of full training's.
:class:`ElasticEngine` is that cycle around an engine that can train a subset of its tensors
(:class:`SelectableEngine`): every ``reselect_every`` training steps a probe step trains every unit
and scores each by ``sum |grad * delta_w|`` (the torch trainer's :class:`GradientImportance`);
:func:`select_tensors`, the same dynamic programme as the torch trainer's, then chooses within the
budget, with costs the engine measured itself; the engine switches to that selection without a
new export.

Why several backward graphs: the backward's cost is how deep gradients must flow. Measured on
the personalize benchmark's CNN (onnxruntime 1.19, one thread, a loaded machine), the full
backward took 70 ms; asking ``session.run`` for the head's gradients only still took 58 ms (ONNX
Runtime runs every node of the graph, requested or not), while the backward graph pruned to those
outputs took 0.01 ms, to the last conv and the head 8 ms, from the third conv on 32 ms. So the
export writes one pruned backward graph per *cut* (the gradients of every tensor from one module
on), all reading the engine's one parameter store; a selection runs on the graph of its earliest
unit and steps only its own tensors. Its cost is that cut's: the gradients of the later tensors
come with it. In :func:`select_tensors`' terms a unit's weight-gradient cost is 0 and the
activation-gradient costs are the differences between consecutive cuts' measured times
(:func:`cut_costs`), so the torch trainer given the same costs and importances selects the same.

Costs: each cut's forward + backward is timed on the first training step (``repeats`` runs after an
untimed one, no step applied), then every real step's time replaces its cut's oldest (the median of the last
five counts). The optimizer step is the same for every selection and is not budgeted, as in
the torch trainer. A monitor's ``drift_detected`` raises the budget to ``drift_rho`` for
``drift_steps`` steps (:meth:`ElasticEngine.on_drift`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from taste_cl._checks import check_int, check_positive
from taste_cl.engine.base import Engine, Inputs

__all__ = ["CLOCKS", "OPTIMIZER_STATE_POLICIES", "SETTINGS", "ElasticEngine", "SelectableEngine", "cut_costs", "select_tensors"]

OPTIMIZER_STATE_POLICIES = ("keep", "reset")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
SETTINGS = ("rho", "reselect_every", "drift_rho", "drift_steps", "optimizer_state", "clock", "resolution")
_WINDOW = 5  # measured steps kept per cut
_COUNTERS = ("steps", "probes", "since_probe", "drift_left")


def _check_costs(name: str, values: Sequence[float], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"`{name}` must have one value per unit ({n}); got {len(values)}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"`{name}` must hold finite numbers >= 0; got {bad[0]!r}")


def _bins(values: Sequence[float], unit: float) -> list[int]:
    return [math.ceil(v / unit - 1e-9) for v in values]


def select_tensors(
    importance: Sequence[float],
    weight_grad_s: Sequence[float],
    act_grad_s: Sequence[float],
    budget_s: float,
    *,
    resolution: int = 1000,
    weight_bytes: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    budget_bytes: float | None = None,
    memory_resolution: int = 64,
) -> list[int]:
    """Indices (ascending) of the units of maximal total importance within the budgets.

    The time of a set ``S`` is ``sum(weight_grad_s[S]) + sum(act_grad_s[min(S) + 1:])``;
    with ``budget_bytes``, its memory ``sum(weight_bytes[S]) + sum(act_bytes[min(S) + 1:])``
    must fit too (both have the same shape: a per-unit part and a part paid for every
    unit after the earliest trainable one). Costs are rounded *up* to ``budget /
    resolution``, so the result never exceeds a budget; it is optimal for the rounded
    costs. For each candidate earliest unit ``k`` the rest is a 0/1 knapsack over the later
    units; adding units from the output backwards shares one table, so the search is
    O(units x resolution x memory_resolution). Returns ``[]`` when no unit fits.
    """
    n = len(importance)
    for name, values in (("importance", importance), ("weight_grad_s", weight_grad_s), ("act_grad_s", act_grad_s)):
        _check_costs(name, values, n)
    check_positive("budget_s", budget_s)
    check_int("resolution", resolution, 1)
    with_memory = budget_bytes is not None
    if with_memory:
        if weight_bytes is None or act_bytes is None:
            raise ValueError("`budget_bytes` needs `weight_bytes` and `act_bytes`")
        _check_costs("weight_bytes", weight_bytes, n)
        _check_costs("act_bytes", act_bytes, n)
        check_positive("budget_bytes", budget_bytes)
        check_int("memory_resolution", memory_resolution, 1)
    t_cap = resolution
    m_cap = memory_resolution if with_memory else 0
    w_t, a_t = _bins(weight_grad_s, budget_s / t_cap), _bins(act_grad_s, budget_s / t_cap)
    if with_memory:
        unit_m = budget_bytes / m_cap  # type: ignore[operator]
        w_m, a_m = _bins(weight_bytes, unit_m), _bins(act_bytes, unit_m)  # type: ignore[arg-type]
    else:
        w_m, a_m = [0] * n, [0] * n
    after_t = [sum(a_t[k + 1 :]) for k in range(n)]
    after_m = [sum(a_m[k + 1 :]) for k in range(n)]
    table = np.zeros((t_cap + 1, m_cap + 1))  # best importance of the units added so far, per (time, memory) capacity
    takes = np.zeros((n, t_cap + 1, m_cap + 1), dtype=bool)
    best, best_k, best_cap = -math.inf, -1, (0, 0)
    for k in reversed(range(n)):
        cap_t, cap_m = t_cap - after_t[k] - w_t[k], m_cap - after_m[k] - w_m[k]
        if cap_t >= 0 and cap_m >= 0 and importance[k] + table[cap_t, cap_m] > best:
            best, best_k, best_cap = importance[k] + table[cap_t, cap_m], k, (cap_t, cap_m)
        if w_t[k] <= t_cap and w_m[k] <= m_cap:
            with_k = np.full_like(table, -math.inf)
            with_k[w_t[k] :, w_m[k] :] = table[: t_cap + 1 - w_t[k], : m_cap + 1 - w_m[k]] + importance[k]
            takes[k] = with_k > table
            table = np.maximum(table, with_k)
    if best_k < 0:
        return []
    chosen, (cap_t, cap_m) = [best_k], best_cap
    for i in range(best_k + 1, n):
        if takes[i, cap_t, cap_m]:
            chosen.append(i)
            cap_t, cap_m = cap_t - w_t[i], cap_m - w_m[i]
    return chosen


def cut_costs(seconds: Sequence[float], unit_cuts: Sequence[int]) -> tuple[list[float], float]:
    """Per-unit activation-gradient costs and the cost every selection pays, from each cut's measured step seconds.

    ``unit_cuts[i]`` is the cut unit ``i`` trains on (non-decreasing). A selection whose earliest unit
    is ``i`` costs its cut's time, made non-increasing along the cuts (a later cut computes less):
    ``fixed + sum(act[i + 1:])``, with ``fixed`` the last unit's cut's time."""
    flat = list(seconds)
    for j in reversed(range(len(flat) - 1)):
        flat[j] = max(flat[j], flat[j + 1])
    act = [0.0] + [flat[unit_cuts[i - 1]] - flat[unit_cuts[i]] for i in range(1, len(unit_cuts))]
    return act, flat[unit_cuts[-1]]


@runtime_checkable
class SelectableEngine(Engine, Protocol):
    """An engine that can train a subset of its tensors on a cheaper backward graph.

    ``cuts``: the tensor names of each backward graph, the first every trainable tensor, each
    next one a subset of the one before. :meth:`select` trains ``names`` from now on, on the
    latest cut that holds them all (returned); :meth:`Engine.backward` then returns and
    :meth:`Engine.step` takes exactly their gradients, and the other tensors and their optimizer
    state stay as they are."""

    cuts: tuple[tuple[str, ...], ...]

    def select(self, names: Sequence[str]) -> int: ...


class ElasticEngine:
    """:class:`SelectableEngine` ``engine`` with the elastic cycle around its training steps (see the module).

    ``units``: each unit's tensor names, in execution order (the torch trainer's profile order);
    ``names``: the units' names (default: their first tensor's). The other settings are
    :class:`~taste_cl.elastic.ElasticTrainer`'s; ``repeats`` times each cut on the first
    training step; ``timer`` replaces the ``clock`` (tests inject one). It is an
    :class:`~taste_cl.engine.base.Engine` itself: the loop trains through it.
    """

    def __init__(
        self,
        engine: SelectableEngine,
        units: Sequence[Sequence[str]],
        *,
        names: Sequence[str] | None = None,
        rho: float = 0.5,
        reselect_every: int = 50,
        drift_rho: float | None = None,
        drift_steps: int = 20,
        optimizer_state: str = "keep",
        clock: str = "wall",
        resolution: int = 1000,
        repeats: int = 2,
        timer: Callable[[], float] | None = None,
    ) -> None:
        check_positive("rho", rho, upper=1.0)
        check_int("reselect_every", reselect_every, 1)
        if drift_rho is not None and check_positive("drift_rho", drift_rho, upper=1.0) < rho:
            raise ValueError(f"`drift_rho == {drift_rho!r}`, must be >= rho ({rho!r})")
        check_int("drift_steps", drift_steps, 1)
        check_int("resolution", resolution, 1)
        check_int("repeats", repeats, 1)
        if optimizer_state not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(f"`optimizer_state == {optimizer_state!r}`, must be one of {list(OPTIMIZER_STATE_POLICIES)}")
        if clock not in CLOCKS:
            raise ValueError(f"`clock == {clock!r}`, must be one of {list(CLOCKS)}")
        self.inner = engine
        self.trainable = engine.trainable
        self.units = [tuple(unit) for unit in units]
        self.names = [unit[0] for unit in self.units] if names is None else list(names)
        flat = [name for unit in self.units for name in unit]
        if not self.units or any(not unit for unit in self.units) or sorted(flat) != sorted(self.trainable):
            raise ValueError("`units` must split the engine's trainable tensors into non-empty groups, each tensor in one")
        if len(self.names) != len(self.units) or len(set(self.names)) != len(self.names):
            raise ValueError(f"`names` must name each of the {len(self.units)} units once")
        self.unit_cuts = [max(j for j, cut in enumerate(engine.cuts) if set(unit) <= set(cut)) for unit in self.units]
        if self.unit_cuts != sorted(self.unit_cuts):
            raise ValueError("`units` must be in execution order: each unit's backward graph is the same as or later than the one before's")
        self.rho, self.reselect_every, self.drift_rho, self.drift_steps = rho, reselect_every, drift_rho, drift_steps
        self.optimizer_state_policy, self.clock, self.resolution, self.repeats = optimizer_state, clock, resolution, repeats
        self.timer = timer if timer is not None else CLOCKS[clock]
        self.selected: list[str] = list(self.names)
        self.importance: list[float] | None = None
        self.cut_seconds: list[list[float]] = [[] for _ in engine.cuts]
        self.steps = self.probes = self.since_probe = self.drift_left = 0
        self.probe_now = True
        self.cut = engine.select(flat)
        self._probe = False
        self._pending: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None  # a probe's gradients and weights before
        self._started: float | None = None

    # ---------------------------------------------------------------- the cycle
    @property
    def current_rho(self) -> float:
        """The budget in force: ``drift_rho`` during a drift window, else ``rho``."""
        if not self.drift_left:
            return self.rho
        return self.drift_rho if self.drift_rho is not None else (1.0 + self.rho) / 2

    def on_drift(self, event: Any = None) -> None:
        """Raise the budget to ``drift_rho`` for ``drift_steps`` steps, probing now and when it ends."""
        self.drift_left, self.probe_now = self.drift_steps, True

    def costs(self) -> tuple[list[float], float] | None:
        """:func:`cut_costs` of the measured cut times (None before they are measured)."""
        if not all(self.cut_seconds):
            return None
        return cut_costs([statistics.median(s) for s in self.cut_seconds], self.unit_cuts)

    def choose(self, importance: Sequence[float], rho: float) -> list[str]:
        """The units to train with ``importance`` at budget ``rho`` under the measured costs: every unit when ``rho``
        is 1 or no selection fits (as the torch trainer, which warns)."""
        costs = self.costs()
        if costs is None:
            raise RuntimeError("the cut costs are measured on the first training step")
        act, fixed = costs
        budget = rho * (fixed + sum(act)) - fixed
        everything = list(range(len(self.units)))
        chosen = everything if rho >= 1.0 or budget <= 0 else select_tensors(importance, [0.0] * len(act), act, budget, resolution=self.resolution)
        return [self.names[i] for i in chosen or everything]

    def settle(self) -> None:
        """Finish a probe step: score each unit from its gradient and weight change (a step refused or undone keeps the
        last scores) and select. Runs before the next training step, and before a save."""
        if not self._probe:
            return
        self._probe = False
        if self._pending is not None:
            grads, before = self._pending
            self._pending = None
            after = self.inner.parameters()
            scores = []
            for unit in self.units:
                score = sum(float(np.abs(grads[n] * (after[n] - before[n])).sum()) for n in unit if n in grads)
                scores.append(score if math.isfinite(score) else 0.0)
            if any(scores):
                self.importance = scores
        if self.importance is None or self.current_rho >= 1.0:
            self._apply(self.names)
        else:
            self._apply(self.choose(self.importance, self.current_rho))

    def _apply(self, selected: Sequence[str]) -> None:
        chosen = set(selected)
        before = {n for unit, name in zip(self.units, self.names) if name in self.selected for n in unit}
        tensors = [n for unit, name in zip(self.units, self.names) if name in chosen for n in unit]
        leaving = before - set(tensors)
        if self.optimizer_state_policy == "reset" and leaving:  # their momentum goes stale: they rejoin as fresh tensors
            state = self.inner.optimizer_state()
            for key, value in state.items():
                if key.partition(".")[2] in leaving:
                    state[key] = np.zeros_like(value)
            self.inner.load_optimizer_state(state)
        self.selected = [name for name in self.names if name in chosen]
        self.cut = self.inner.select(tensors)

    def measure_cuts(self, x: Inputs) -> None:
        """Time each unmeasured cut's forward + backward on ``x`` (``repeats`` runs after an untimed one, no step applied):
        what the first training step does. (Without the untimed run, each cut's first run, which allocates, would inflate
        the costs of the cuts not trained since, while the trained cut's are refreshed by warm steps.)"""
        current = [n for unit, name in zip(self.units, self.names) if name in self.selected for n in unit]
        for j, cut in enumerate(self.inner.cuts):
            if self.cut_seconds[j]:
                continue
            self.inner.select(cut)
            self.inner.backward(np.zeros_like(self.inner.forward(x, train=True)))  # untimed: a graph's first run allocates
            for _ in range(self.repeats):
                start = self.timer()
                self.inner.backward(np.zeros_like(self.inner.forward(x, train=True)))
                self.cut_seconds[j].append(max(self.timer() - start, 0.0))
        self.cut = self.inner.select(current)

    # ---------------------------------------------------------------- the engine interface
    def forward(self, x: Inputs, *, train: bool) -> np.ndarray:
        if not train:
            return self.inner.forward(x, train=False)
        self.settle()
        if not all(self.cut_seconds):
            self.measure_cuts(x)
        if self.probe_now or self.since_probe >= self.reselect_every:
            self._apply(self.names)
            self._probe, self.since_probe, self.probe_now = True, 0, False
            self.probes += 1
        self.steps += 1
        self.since_probe += 1
        if self.drift_left:
            self.drift_left -= 1
            self.probe_now = self.drift_left == 0
        self._started = self.timer()
        return self.inner.forward(x, train=True)

    def backward(self, grad_outputs: np.ndarray) -> dict[str, np.ndarray]:
        gradients = self.inner.backward(grad_outputs)
        if self._started is not None:
            seconds, self._started = max(self.timer() - self._started, 0.0), None
            self.cut_seconds[self.cut] = [*self.cut_seconds[self.cut][-(_WINDOW - 1) :], seconds]
        return gradients

    def step(self, gradients: Mapping[str, np.ndarray], lr: float) -> None:
        before = self.inner.parameters() if self._probe else None
        self.inner.step(gradients, lr)
        if before is not None:
            self._pending = {k: np.array(v) for k, v in gradients.items()}, before

    def parameters(self) -> dict[str, np.ndarray]:
        return self.inner.parameters()

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        self.inner.load_parameters(values)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return self.inner.optimizer_state()

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.inner.load_optimizer_state(state)

    def save(self, folder: Any) -> None:
        self.inner.save(folder)

    def __getattr__(self, name: str) -> Any:
        """Everything else (a runtime's ``inputs``, ``batch_size``, ``folder``...) is the wrapped engine's."""
        if name == "inner":  # not yet set: no recursion while constructing
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---------------------------------------------------------------- settings and state
    def settings(self) -> dict[str, Any]:
        """What rebuilds this cycle (with the units): :data:`SETTINGS`, ``units`` and ``names``."""
        return {key: getattr(self, "optimizer_state_policy" if key == "optimizer_state" else key) for key in SETTINGS} | {
            "units": [list(unit) for unit in self.units],
            "names": list(self.names),
        }

    def state(self) -> dict[str, Any]:
        """The cycle's state as plain values (a pending probe is settled first): the selection, the scores, the
        measured cut times and the counters."""
        self.settle()
        return {
            "selected": list(self.selected),
            "importance": self.importance,
            "cut_seconds": [list(s) for s in self.cut_seconds],
            "probe_now": self.probe_now,
        } | {key: getattr(self, key) for key in _COUNTERS}

    def check_state(self, state: Any) -> dict[str, Any]:
        """``state`` (from :meth:`state`) checked: ``ValueError`` naming the first bad field; nothing changes."""
        keys = {"selected", "importance", "cut_seconds", "probe_now", *_COUNTERS}
        if not isinstance(state, Mapping) or set(state) != keys:
            raise ValueError(f"the elastic state must be an object with exactly the keys {sorted(keys)}")
        selected = state["selected"]
        if not isinstance(selected, list) or not selected or not set(selected) <= set(self.names) or len(set(selected)) != len(selected):
            raise ValueError(f"elastic state `selected` must name one or more of the units {self.names}, each once")
        importance = state["importance"]
        if importance is not None and (
            not isinstance(importance, list) or len(importance) != len(self.units) or not all(_nonnegative(v) for v in importance)
        ):
            raise ValueError(f"elastic state `importance` must be null or {len(self.units)} finite numbers >= 0")
        seconds = state["cut_seconds"]
        if (
            not isinstance(seconds, list)
            or len(seconds) != len(self.inner.cuts)
            or not all(isinstance(s, list) and len(s) <= max(_WINDOW, self.repeats) and all(_nonnegative(v) for v in s) for s in seconds)
        ):
            raise ValueError(
                f"elastic state `cut_seconds` must hold {len(self.inner.cuts)} lists of at most {max(_WINDOW, self.repeats)} finite seconds >= 0"
            )
        for key in _COUNTERS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**53:
                raise ValueError(f"elastic state `{key} == {value!r}`, must be an int in [0, 2**53]")
        if state["drift_left"] > self.drift_steps:
            raise ValueError(f"elastic state `drift_left == {state['drift_left']}`, must be at most drift_steps ({self.drift_steps})")
        if not isinstance(state["probe_now"], bool):
            raise ValueError("elastic state `probe_now` must be a bool")  # noqa: TRY004 (a saved state: ValueError, as every field)
        return dict(state)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Apply what :meth:`check_state` accepted (the optimizer state is the loop's to restore)."""
        self._probe, self._pending, self._started = False, None, None
        self.importance = None if state["importance"] is None else [float(v) for v in state["importance"]]
        self.cut_seconds = [[float(v) for v in s] for s in state["cut_seconds"]]
        self.probe_now = state["probe_now"]
        self.steps, self.probes, self.since_probe, self.drift_left = (int(state[key]) for key in _COUNTERS)
        chosen = set(state["selected"])
        self.selected = [name for name in self.names if name in chosen]
        self.cut = self.inner.select([n for unit, name in zip(self.units, self.names) if name in chosen for n in unit])


def _nonnegative(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
