"""Elastic trainable-tensor selection: train only the part of the network worth its time.

After ElasticTrainer (Huang, Zhang, Gao; MobiSys 2023, arXiv:2312.14227). Four small pieces:

- :func:`profile_tensors` times, once per model, input shape and hardware, the forward pass
  and, for every parameterised module ("unit") in execution order, its weight-gradient and
  activation-gradient time separately (warm-up, then the median of repeats);
  :func:`load_or_profile` caches that as JSON keyed by
  :func:`~taste_cl._fingerprint.model_signature` and
  :func:`~taste_cl._fingerprint.hardware_fingerprint`;
- :class:`GradientImportance` estimates each unit's importance to the loss as
  ``sum |grad * delta_w|`` over one full-backward probe step (first-order Taylor estimate
  of the loss change the unit's update caused);
- :func:`select_tensors` picks, by dynamic programming, the units of maximal total
  importance whose backward time fits a budget; a unit's cost is its weight-gradient time,
  plus the activation-gradient time of every later unit when it is the earliest trainable
  one (autograd stops the backward pass there, since nothing earlier needs a gradient);
- :class:`ElasticTrainer` is the :class:`~taste_cl.plugins.LearnerPlugin` that ties them
  together: it toggles ``requires_grad``, so frozen tensors get no ``.grad`` and torch
  optimizers leave their state (momentum, Adam moments) untouched until they rejoin.

>>> import torch
>>> from torch import nn
>>> from taste_cl import ElasticTrainer, OnlineLearner
>>> _ = torch.manual_seed(0)
>>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
>>> elastic = ElasticTrainer(rho=0.6, reselect_every=5, cache_dir=None)
>>> learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic])
>>> for _ in range(6):
...     _ = learner.observe((torch.randn(16, 8), torch.randint(0, 3, (16,))))
>>> len(elastic.selected) >= 1 and elastic.selected[-1] == "4"
True
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from taste_cl._fingerprint import default_cache_dir, hardware_fingerprint, model_signature
from taste_cl.checkpoint import atomic_write_bytes
from taste_cl.monitor import MonitorEvent
from taste_cl.plugins import LearnerPlugin

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner

__all__ = [
    "ElasticTrainer",
    "GradientImportance",
    "TensorProfile",
    "load_or_profile",
    "profile_tensors",
    "select_tensors",
]

CACHE_FILE = "elastic_profiles.json"
_PROFILE_FORMAT = 1



def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name} == {value!r}`, must be an int >= {minimum}")


def _check_positive(name: str, value: float, *, upper: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (upper is not None and value > upper):
        rule = "a number > 0" + ("" if upper is None else f" and <= {upper}")
        raise ValueError(f"`{name} == {value!r}`, must be {rule}")


# ---------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class TensorProfile:
    """Measured times (seconds) of one training step, split per unit in execution order.

    ``act_grad_s[i]`` is the time to pass the gradient back through unit ``i`` and the
    parameter-free modules between unit ``i - 1`` and it; it is spent only when some unit
    before ``i`` is trainable. ``backward_s`` is the measured full backward, for comparison
    with the model's prediction ``full_step_s - forward_s``.
    """

    units: list[str]
    weight_grad_s: list[float]
    act_grad_s: list[float]
    forward_s: float
    backward_s: float

    def step_s(self, selected: Sequence[int]) -> float:
        """Predicted forward + backward time when only the units at ``selected`` train."""
        if not selected:
            return self.forward_s
        earliest = min(selected)
        return (
            self.forward_s
            + sum(self.weight_grad_s[i] for i in selected)
            + sum(self.act_grad_s[earliest + 1 :])
        )

    @property
    def full_step_s(self) -> float:
        """Predicted step time with every unit trainable."""
        return self.step_s(range(len(self.units)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TensorProfile:
        return cls(
            units=[str(u) for u in state["units"]],
            weight_grad_s=[float(t) for t in state["weight_grad_s"]],
            act_grad_s=[float(t) for t in state["act_grad_s"]],
            forward_s=float(state["forward_s"]),
            backward_s=float(state["backward_s"]),
        )


def _trainable_direct(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(run: Callable[[], Callable[[], Any]], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median time of the callable that ``run()`` prepares (preparation is not timed)."""
    times = []
    for index in range(warmup + repeats):
        timed = run()
        _sync(device)
        start = time.perf_counter()
        timed()
        _sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _capture_inputs(model: nn.Module, example: torch.Tensor) -> list[tuple[str, nn.Module, tuple[Any, ...]]]:
    """Run ``model`` once; return (name, module, positional inputs) of the units and
    parameter-free leaf modules, in the order they were first called."""
    calls: list[tuple[str, nn.Module, tuple[Any, ...]]] = []
    seen: set[str] = set()
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            if name not in seen:
                seen.add(name)
                calls.append((name, module, tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args)))

        return record

    for name, module in model.named_modules():
        if _trainable_direct(module) or (not list(module.children()) and name):
            handles.append(module.register_forward_pre_hook(hook(name)))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _grad_time(
    module: nn.Module,
    args: tuple[Any, ...],
    params: list[nn.Parameter],
    *,
    wrt_input: bool,
    warmup: int,
    repeats: int,
    device: torch.device,
) -> float:
    """Time of the backward through ``module`` w.r.t. ``params`` or (``wrt_input``) its float inputs."""
    for p in params:
        p.requires_grad_(not wrt_input)

    def prepare() -> Callable[[], Any]:
        leaves = [
            a.clone().requires_grad_(wrt_input) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
        ]
        # a clone of the leaf, so in-place modules (ReLU(inplace=True)) may run
        out = module(*(a.clone() if torch.is_tensor(a) and a.requires_grad else a for a in leaves))
        targets = [a for a in leaves if torch.is_tensor(a) and a.requires_grad] if wrt_input else params
        if not torch.is_tensor(out) or not out.requires_grad or not targets:
            return lambda: None
        grad_out = torch.ones_like(out)
        return lambda: torch.autograd.grad(out, targets, grad_out)

    try:
        return _median_time(prepare, warmup=warmup, repeats=repeats, device=device)
    finally:
        for p in params:
            p.requires_grad_(True)


def profile_tensors(model: nn.Module, example: torch.Tensor, *, warmup: int = 2, repeats: int = 5) -> TensorProfile:
    """Measure forward, per-unit weight-gradient and activation-gradient times on ``example``.

    Units are the modules with trainable parameters of their own, in the order the forward
    pass first calls them. Each unit is replayed alone on its captured input; a
    parameter-free leaf module's activation-gradient time is added to the next unit, since
    both are spent under the same condition. The model's parameters, buffers (BatchNorm
    statistics), trainability and the torch RNG are left as they were.
    """
    _check_int("warmup", warmup, 0)
    _check_int("repeats", repeats, 1)
    device = example.device
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            calls = _capture_inputs(model, example)
            units: list[str] = []
            weight_grad: list[float] = []
            act_grad: list[float] = []
            pending = 0.0
            for name, module, args in calls:
                params = _trainable_direct(module)
                timing = dict(warmup=warmup, repeats=repeats, device=device)
                pending += _grad_time(module, args, params, wrt_input=True, **timing)
                if params:
                    units.append(name)
                    weight_grad.append(_grad_time(module, args, params, wrt_input=False, **timing))
                    act_grad.append(pending)
                    pending = 0.0
            forward = _median_time(lambda: lambda: model(example), warmup=warmup, repeats=repeats, device=device)

            def full_backward() -> Callable[[], Any]:
                out = model(example)
                return lambda: out.backward(torch.ones_like(out))

            backward = _median_time(full_backward, warmup=warmup, repeats=repeats, device=device)
            model.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return TensorProfile(units, weight_grad, act_grad, forward, backward)


def load_or_profile(
    model: nn.Module,
    example: torch.Tensor,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    refresh: bool = False,
) -> tuple[TensorProfile, bool]:
    """Return ``(profile, from_cache)``, reading/writing ``cache_dir/elastic_profiles.json``.

    The key is the model signature for ``example``'s full shape and dtype plus the hardware
    fingerprint, so a changed architecture, batch size, machine or torch version profiles
    anew. ``refresh`` measures again and overwrites the entry.
    """
    path = Path(cache_dir) / CACHE_FILE
    key = f"{model_signature(model, tuple(example.shape), example.dtype)}:{hardware_fingerprint()}"
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entries, dict) or entries.get("format") != _PROFILE_FORMAT:
            entries = {}
    except (OSError, ValueError):
        entries = {}
    if not refresh and key in entries.get("profiles", {}):
        return TensorProfile.from_dict(entries["profiles"][key]), True
    profile = profile_tensors(model, example, warmup=warmup, repeats=repeats)
    profiles = {**entries.get("profiles", {}), key: profile.to_dict()}
    payload = {"format": _PROFILE_FORMAT, "profiles": profiles}
    atomic_write_bytes(path, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())
    return profile, False


# ---------------------------------------------------------------------------- importance
class GradientImportance:
    """Importance of each unit over one training step: ``sum |grad * delta_w|``.

    :meth:`arm` snapshots the weights and hooks the gradients; after the step,
    :meth:`collect` returns one non-negative score per unit (None if no gradient arrived,
    e.g. the step was skipped) and removes the hooks. Costs one copy of the weights and
    gradients, only on probe steps.
    """

    def __init__(self, units: Sequence[Sequence[nn.Parameter]]) -> None:
        self.units = [list(params) for params in units]
        self._before: list[list[torch.Tensor]] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._before)

    def arm(self) -> None:
        self.disarm()
        self._before = [[p.detach().clone() for p in params] for params in self.units]
        for params in self.units:
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._record))

    def _record(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._grads[id(param)] = param.grad.detach().clone()

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._before, self._grads = [], [], {}

    def collect(self) -> list[float] | None:
        """Scores from the gradients seen since :meth:`arm` and the weight change since then."""
        if not self._grads:
            self.disarm()
            return None
        scores = []
        with torch.no_grad():
            for params, before in zip(self.units, self._before):
                score = 0.0
                for p, old in zip(params, before):
                    grad = self._grads.get(id(p))
                    if grad is not None:
                        score += float((grad * (p.detach() - old)).abs().sum())
                scores.append(score)
        self.disarm()
        return scores


# ---------------------------------------------------------------------------- selection
def select_tensors(
    importance: Sequence[float],
    weight_grad_s: Sequence[float],
    act_grad_s: Sequence[float],
    budget_s: float,
    *,
    resolution: int = 1000,
) -> list[int]:
    """Indices (ascending) of the units of maximal total importance whose backward fits ``budget_s``.

    The cost of a set ``S`` is ``sum(weight_grad_s[S]) + sum(act_grad_s[min(S) + 1:])``.
    Times are rounded *up* to ``budget_s / resolution``, so the result never exceeds the
    budget; it is optimal for the rounded costs (exact for integer times when
    ``resolution == budget_s``). For each candidate earliest unit ``k`` the rest is a 0/1
    knapsack over the later units; adding units from the output backwards shares one table,
    so the whole search is O(units x resolution). Returns ``[]`` when no unit fits.
    """
    n = len(importance)
    if len(weight_grad_s) != n or len(act_grad_s) != n:
        raise ValueError(
            f"importance, weight_grad_s and act_grad_s must have the same length; "
            f"got {n}, {len(weight_grad_s)}, {len(act_grad_s)}"
        )
    for name, values in (("importance", importance), ("weight_grad_s", weight_grad_s), ("act_grad_s", act_grad_s)):
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"`{name}` must hold finite values >= 0; got {bad[0]!r}")
    _check_positive("budget_s", budget_s)
    _check_int("resolution", resolution, 1)
    unit = budget_s / resolution
    weights = [math.ceil(t / unit - 1e-9) for t in weight_grad_s]
    acts = [math.ceil(t / unit - 1e-9) for t in act_grad_s]
    after = [sum(acts[k + 1 :]) for k in range(n)]
    table = np.zeros(resolution + 1)  # best importance of the units added so far, per capacity
    takes = np.zeros((n, resolution + 1), dtype=bool)
    best, best_k, best_cap = -math.inf, -1, 0
    for k in reversed(range(n)):
        cap = resolution - after[k] - weights[k]
        if cap >= 0 and importance[k] + table[cap] > best:
            best, best_k, best_cap = importance[k] + table[cap], k, cap
        if weights[k] <= resolution:
            with_k = np.full(resolution + 1, -math.inf)
            with_k[weights[k] :] = table[: resolution + 1 - weights[k]] + importance[k]
            takes[k] = with_k > table
            table = np.maximum(table, with_k)
    if best_k < 0:
        return []
    chosen, cap = [best_k], best_cap
    for i in range(best_k + 1, n):
        if takes[i, cap]:
            chosen.append(i)
            cap -= weights[i]
    return chosen


# ---------------------------------------------------------------------------- the plugin
class ElasticTrainer(LearnerPlugin):
    """Train, at each step, only the units worth their backward time (ElasticTrainer).

    Every ``reselect_every`` training steps one probe step trains every unit and measures
    importance; the units of maximal importance whose predicted step time (forward +
    backward, from the profile) is at most ``rho`` times that of full training are then
    trained until the next probe. Frozen units get no gradient, so the optimizer keeps
    their state for when they rejoin.

    Drift policy: on the monitor's ``drift_detected`` event the next step is a probe and
    the budget is raised to ``drift_rho`` for ``drift_steps`` steps (new data needs more
    plasticity), then a probe reselects at ``rho``.

    Parameters
    ----------
    rho:
        Target step time as a fraction of full training, in (0, 1].
    reselect_every:
        Training steps between probes.
    drift_rho, drift_steps:
        Budget (>= ``rho``; default halfway between ``rho`` and 1) and duration after a
        drift event.
    cache_dir:
        Where profiles are cached (see :func:`default_cache_dir`); None to always profile.
    warmup, repeats:
        Profiling warm-up runs and timed repeats per measurement.
    resolution:
        Time bins of the DP selector.
    """

    name = "elastic"

    def __init__(
        self,
        *,
        rho: float = 0.5,
        reselect_every: int = 50,
        drift_rho: float | None = None,
        drift_steps: int = 20,
        cache_dir: str | os.PathLike[str] | None = "default",
        warmup: int = 2,
        repeats: int = 5,
        resolution: int = 1000,
    ) -> None:
        _check_positive("rho", rho, upper=1.0)
        _check_int("reselect_every", reselect_every, 1)
        if drift_rho is not None:
            _check_positive("drift_rho", drift_rho, upper=1.0)
        if drift_rho is not None and drift_rho < rho:
            raise ValueError(f"`drift_rho == {drift_rho!r}`, must be >= rho ({rho!r})")
        _check_int("drift_steps", drift_steps, 1)
        _check_int("warmup", warmup, 0)
        _check_int("repeats", repeats, 1)
        _check_int("resolution", resolution, 1)
        self.rho = rho
        self.reselect_every = reselect_every
        self.drift_rho = drift_rho
        self.drift_steps = drift_steps
        self.cache_dir = cache_dir
        self.warmup = warmup
        self.repeats = repeats
        self.resolution = resolution
        self.profile_: TensorProfile | None = None
        self.importance_: list[float] | None = None
        self.selected: list[str] = []
        self.steps_ = 0
        self.probes_ = 0
        self._since_probe = 0
        self._drift_left = 0
        self._probe_now = True
        self._learner: OnlineLearner | None = None
        self._example: torch.Tensor | None = None
        self._estimator: GradientImportance | None = None

    # ----------------------------------------------------------------- hooks
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        self._learner = learner
        learner.monitor.subscribe(self._on_drift, event="drift_detected")
        learner.monitor.subscribe(self._on_retuned, event="retuned")

    def on_first_batch(self, learner: OnlineLearner, x: Any, **kwargs: Any) -> None:
        self._example = x[:1].detach().clone()
        if self.profile_ is None:
            self.reprofile(x.shape[0] + learner.replay_batch_size)

    def before_step(self, learner: OnlineLearner, **kwargs: Any) -> None:
        self._finish_probe()
        if self.profile_ is None:
            return
        if self._probe_now or self._since_probe >= self.reselect_every:
            self._start_probe()
        self.steps_ += 1
        self._since_probe += 1
        if self._drift_left:
            self._drift_left -= 1
            self._probe_now = self._drift_left == 0

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self._finish_probe()

    def _on_retuned(self, event: MonitorEvent) -> None:
        """The batch-size tuner picked a new micro-batch: step times changed, so reprofile and reselect."""
        if self._example is not None:
            self.reprofile(int(event.details["batch_size"]))

    def _on_drift(self, event: MonitorEvent) -> None:
        self._drift_left = self.drift_steps
        self._probe_now = True

    # ----------------------------------------------------------- public API
    @property
    def current_rho(self) -> float:
        """The budget in force: ``drift_rho`` during a drift window, else ``rho``."""
        if not self._drift_left:
            return self.rho
        return self.drift_rho if self.drift_rho is not None else (1.0 + self.rho) / 2

    def reprofile(self, batch_size: int | None = None, *, refresh: bool = False) -> TensorProfile:
        """(Re)measure the profile for training batches of ``batch_size`` and reselect.

        Call after the batch size changes (the batch-size tuner); uses the cache when it
        holds this model, batch shape and hardware, unless ``refresh``.
        """
        learner = self._attached()
        if self._example is None:
            raise RuntimeError("ElasticTrainer.reprofile needs a first batch: call learner.observe first")
        size = batch_size if batch_size is not None else self._example.shape[0]
        _check_int("batch_size", size, 1)
        example = self._example.expand(size, *self._example.shape[1:]).contiguous()
        with self._all_trainable():
            if self.cache_dir is None:
                self.profile_ = profile_tensors(learner.model, example, warmup=self.warmup, repeats=self.repeats)
            else:
                directory = default_cache_dir() if self.cache_dir == "default" else self.cache_dir
                self.profile_, _ = load_or_profile(
                    learner.model, example, cache_dir=directory, warmup=self.warmup, repeats=self.repeats,
                    refresh=refresh,
                )
        self.reselect()
        return self.profile_

    def reselect(self) -> None:
        """Make the next training step a probe that re-measures importance and reselects."""
        self._probe_now = True

    def predicted_speedup(self) -> float | None:
        """Predicted full step time over the current selection's step time (None before a selection)."""
        if self.profile_ is None or not self.selected:
            return None
        index = {name: i for i, name in enumerate(self.profile_.units)}
        return self.profile_.full_step_s / self.profile_.step_s([index[n] for n in self.selected])

    # ------------------------------------------------------------ internals
    def _attached(self) -> OnlineLearner:
        if self._learner is None:
            raise RuntimeError("ElasticTrainer is not attached: pass it in OnlineLearner(plugins=[...])")
        return self._learner

    def _unit_params(self) -> list[list[nn.Parameter]]:
        assert self.profile_ is not None
        modules = dict(self._attached().model.named_modules())
        return [list(modules[name].parameters(recurse=False)) for name in self.profile_.units]

    def _all_trainable(self) -> _Trainable:
        return _Trainable([p for params in self._unit_params() for p in params] if self.profile_ else [])

    def apply_selection(self, selected: Sequence[str]) -> None:
        """Train only the units named in ``selected`` until the next probe.

        Frozen units' gradients are set to None, so the optimizer skips them and keeps their
        state (momentum, Adam moments) for when they rejoin.
        """
        if self.profile_ is None:
            raise RuntimeError("ElasticTrainer has no profile yet: call learner.observe first")
        chosen = set(selected)
        unknown = sorted(chosen - set(self.profile_.units))
        if unknown:
            raise ValueError(f"unknown units {unknown}; the units are {self.profile_.units}")
        self.selected = [name for name in self.profile_.units if name in chosen]
        for name, params in zip(self.profile_.units, self._unit_params()):
            for p in params:
                p.requires_grad_(name in chosen)
                if name not in chosen:
                    p.grad = None  # optimizers skip params without a gradient: their state is kept

    def _start_probe(self) -> None:
        self.apply_selection(self.profile_.units)  # type: ignore[union-attr]
        self._estimator = GradientImportance(self._unit_params())
        self._estimator.arm()
        self._since_probe = 0
        self._probe_now = False
        self.probes_ += 1

    def _finish_probe(self) -> None:
        if self._estimator is None:
            return
        scores, self._estimator = self._estimator.collect(), None
        if scores is not None and any(scores):  # a skipped step moves no weight: keep the old scores
            self.importance_ = scores
        self._select()

    def _select(self) -> None:
        profile = self.profile_
        assert profile is not None
        if self.importance_ is None or self.current_rho >= 1.0:
            self.apply_selection(profile.units)
            return
        budget = self.current_rho * profile.full_step_s - profile.forward_s
        chosen = (
            select_tensors(self.importance_, profile.weight_grad_s, profile.act_grad_s, budget, resolution=self.resolution)
            if budget > 0
            else []
        )
        if not chosen:
            chosen = [min(range(len(profile.units)), key=lambda k: profile.step_s([k]))]
            warnings.warn(
                f"ElasticTrainer: no unit fits rho={self.current_rho} (forward alone takes "
                f"{profile.forward_s / profile.full_step_s:.0%} of a full step); training only "
                f"{profile.units[chosen[0]]!r}",
                RuntimeWarning,
                stacklevel=3,
            )
        self.apply_selection([profile.units[i] for i in chosen])

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "profile": None if self.profile_ is None else self.profile_.to_dict(),
            "importance": self.importance_,
            "selected": list(self.selected),
            "steps": self.steps_,
            "probes": self.probes_,
            "since_probe": self._since_probe,
            "drift_left": self._drift_left,
            "probe_now": self._probe_now,
            "example": self._example,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.profile_ = None if state["profile"] is None else TensorProfile.from_dict(state["profile"])
        self.importance_ = None if state["importance"] is None else [float(v) for v in state["importance"]]
        self.steps_ = int(state["steps"])
        self.probes_ = int(state["probes"])
        self._since_probe = int(state["since_probe"])
        self._drift_left = int(state["drift_left"])
        self._probe_now = bool(state["probe_now"])
        self._example = state["example"]
        if self.profile_ is not None and state["selected"]:
            self.apply_selection([str(name) for name in state["selected"]])
        else:
            self.selected = [str(name) for name in state["selected"]]


class _Trainable:
    """Context manager: make ``params`` trainable inside, restore their flags after."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self._flags: list[bool] = []

    def __enter__(self) -> None:
        self._flags = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(True)

    def __exit__(self, *exc: object) -> None:
        for p, flag in zip(self.params, self._flags):
            p.requires_grad_(flag)
