"""The selection cycle of :class:`~taste_cl.elastic.trainer.ElasticTrainer`, without the plugin wiring.

Over one timing profile, repeatedly: a probe step trains every unit and measures each
one's importance (:class:`~taste_cl.elastic.selection.GradientImportance`); the units of
maximal importance that fit the time budget (and the memory budget) are selected
(:func:`~taste_cl.elastic.selection.select_tensors`) and trained until the next probe;
the step times measured meanwhile refit the time model
(:class:`~taste_cl.elastic.calibration.StepTimeModel`) that the next selection budgets with.

:class:`SelectionCycle` holds that loop's settings, state and steps; the plugin
(:mod:`taste_cl.elastic.trainer`) decides when they run (learner hooks, monitor events),
where the profile comes from, and how the state is checkpointed.

Frozen parameters are the user's decision. The candidates are the parameters the user
left trainable (``requires_grad``) and the optimizer holds; the cycle switches off only
candidates it did not select, and switches back on only what it switched off itself, so a
parameter the user froze never gets ``requires_grad=True`` and selecting every unit
restores exactly the user's flags.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from taste_cl._checks import check_int, check_positive
from taste_cl.elastic.calibration import StepTimeModel
from taste_cl.elastic.memory import optimizer_state_factor
from taste_cl.elastic.profiling import unit_parameters
from taste_cl.elastic.selection import GradientImportance, select_tensors
from taste_cl.elastic.tensor_profile import CLOCKS, Clock, TensorProfile, check_clock
from taste_cl.exceptions import ElasticWarning

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["OPTIMIZER_STATE_POLICIES", "OptimizerStatePolicy", "SelectionCycle"]

OptimizerStatePolicy = Literal["keep", "reset"]
OPTIMIZER_STATE_POLICIES: tuple[OptimizerStatePolicy, ...] = ("keep", "reset")


class SelectionCycle:
    """Probe importance, select within the budgets, measure, correct the time model.

    Parameters are those of :class:`~taste_cl.elastic.trainer.ElasticTrainer` that shape
    the cycle (``rho``, ``reselect_every``, ``drift_rho``, ``drift_steps``,
    ``memory_budget_bytes``, ``check_steps``, ``resolution``, ``clock``,
    ``optimizer_state``), checked here.
    The learner (its model's units, its optimizer's state size) is set on attach.
    """

    def __init__(
        self,
        *,
        rho: float,
        reselect_every: int,
        drift_rho: float | None,
        drift_steps: int,
        memory_budget_bytes: int | None,
        check_steps: int,
        resolution: int,
        clock: Clock,
        optimizer_state: OptimizerStatePolicy = "keep",
    ) -> None:
        check_positive("rho", rho, upper=1.0)
        check_int("reselect_every", reselect_every, 1)
        if drift_rho is not None:
            check_positive("drift_rho", drift_rho, upper=1.0)
            if drift_rho < rho:
                raise ValueError(f"`drift_rho == {drift_rho!r}`, must be >= rho ({rho!r})")
        check_int("drift_steps", drift_steps, 1)
        if memory_budget_bytes is not None:
            check_int("memory_budget_bytes", memory_budget_bytes, 1)
        check_int("check_steps", check_steps, 1)
        check_int("resolution", resolution, 1)
        check_clock(clock)
        if optimizer_state not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(f"`optimizer_state == {optimizer_state!r}`, must be one of {list(OPTIMIZER_STATE_POLICIES)}")
        self.rho = rho
        self.reselect_every = reselect_every
        self.drift_rho = drift_rho
        self.drift_steps = drift_steps
        self.memory_budget_bytes = memory_budget_bytes
        self.check_steps = check_steps
        self.resolution = resolution
        self.clock = clock
        self.optimizer_state = optimizer_state
        self.profile_: TensorProfile | None = None
        self.fixed_costs = False  # use_costs: select with given costs, uncorrected by this learner's step times
        self.timing_: StepTimeModel | None = None
        self.importance_: list[float] | None = None
        self.selected: list[str] = []
        self.predictions_: list[dict[str, Any]] = []
        self.steps_ = 0
        self.probes_ = 0
        self._since_probe = 0
        self._drift_left = 0
        self._probe_now = True
        self._learner: OnlineLearner | None = None
        self._estimator: GradientImportance | None = None
        self._unit_params: list[list[nn.Parameter]] = []
        self._switched_off: dict[int, nn.Parameter] = {}  # candidates this cycle set requires_grad=False on
        self._probe_step = False
        self._arm_s = 0.0
        self._probe_times: list[float] = []
        self._window: list[float] = []
        self._window_prediction: dict[str, Any] | None = None

    # ----------------------------------------------------------- public API
    @property
    def current_rho(self) -> float:
        """The budget in force: ``drift_rho`` during a drift window, else ``rho``."""
        if not self._drift_left:
            return self.rho
        return self.drift_rho if self.drift_rho is not None else (1.0 + self.rho) / 2

    def reselect(self) -> None:
        """Make the next training step a probe that re-measures importance and reselects."""
        self._probe_now = True

    def predicted_speedup(self) -> float | None:
        """Predicted (corrected) full step time over the current selection's (None before a selection)."""
        if self.timing_ is None or not self.selected:
            return None
        return self.timing_.predict(range(len(self.profile_.units))) / self.timing_.predict(self._indices())  # type: ignore[union-attr]

    def memory_estimate(self, selected: Sequence[str] | None = None) -> int | None:
        """Estimated training memory (bytes) of ``selected`` (default: the current selection)."""
        if self.profile_ is None:
            return None
        names = self.selected if selected is None else selected
        factor = optimizer_state_factor(self._attached().optimizer)
        return self.profile_.memory_bytes(self._indices(names), factor)

    def prediction_errors(self) -> dict[str, float | int | None]:
        """Mean absolute relative error of the raw profile and of the corrected model over the
        checked windows (each the median of ``check_steps`` measured steps after a selection)."""
        rows = self.predictions_

        def mean_error(key: str) -> float | None:
            return statistics.fmean(abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows) if rows else None

        later = rows[1:]
        return {
            "windows": len(rows),
            "raw": mean_error("raw_s"),
            "corrected": mean_error("predicted_s"),
            "corrected_after_first": (statistics.fmean(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in later) if later else None),
        }

    def selection_for(self, costs: TensorProfile, *, rho: float | None = None) -> list[str]:
        """The parameter names to train where a step costs ``costs``: a device runtime's timing.

        ``costs`` is a profile of the same units measured elsewhere (for ONNX Runtime,
        :func:`taste_cl.adapters.onnxruntime.step_costs.measure_step_costs`); the units of
        maximal importance (as last measured on this learner) whose forward + backward time
        under ``costs`` is at most ``rho`` (default: the budget in force) of full training's
        are chosen, within ``memory_budget_bytes`` if set. The result is what
        ``learner.export(..., trainable=...)`` takes; this learner's own selection is unchanged.
        ``ValueError`` before the first probe, for a profile of other units, or when no unit fits.
        """
        if self.profile_ is None or self.importance_ is None:
            raise ValueError("ElasticTrainer has no importance yet: observe batches until its first probe has run")
        if costs.units != self.profile_.units or costs.granularity != self.profile_.granularity:
            raise ValueError("`costs` must profile this ElasticTrainer's units (same names, order and granularity)")
        budget_rho = self.current_rho if rho is None else check_positive("rho", rho, upper=1.0)
        budget = budget_rho * costs.full_step_s - costs.forward_s - costs.tail_grad_s
        everything = budget_rho >= 1.0 and self.memory_budget_bytes is None
        chosen = list(range(len(costs.units))) if everything else self._choose(costs, costs.weight_grad_s, costs.act_grad_s, budget)
        if not chosen:
            fixed = (costs.forward_s + costs.tail_grad_s) / costs.full_step_s
            raise ValueError(
                f"no selection of the trainable units fits rho={budget_rho} under these costs (the forward pass and tail take {fixed:.0%} of a step)"
            )
        ids = {id(p) for i in chosen for p in self._unit_params[i]}
        return [name for name, p in self._attached().model.named_parameters() if id(p) in ids]

    def use_costs(self, costs: TensorProfile) -> None:
        """Select with ``costs`` from now on, as given: another runtime's measured costs of this trainer's units
        (:meth:`TensorProfile.from_cut_costs` of a device's :meth:`~taste_cl.engine.elastic.ElasticEngine.costs`), so
        this learner re-selects as that device would. The closed loop does not correct them with this learner's own
        step times; :meth:`~taste_cl.elastic.ElasticTrainer.reprofile` goes back to measured costs. ``ValueError``
        for costs of other units; the next step probes."""
        self._set_profile(costs)
        self.fixed_costs = True
        self.reselect()

    def units_holding(self, names: Sequence[str]) -> list[int]:
        """Indices (ascending) of the profile's units that hold any of the parameters ``names``
        (what :meth:`selection_for` returns): to predict a selection's time with a profile, or
        sum its importance. ``ValueError`` naming a name that is not a parameter of the model."""
        if self.profile_ is None:
            raise RuntimeError("ElasticTrainer has no profile yet: call learner.observe first")
        parameters = dict(self._attached().model.named_parameters())
        unknown = [name for name in names if name not in parameters]
        if unknown:
            raise ValueError(f"not parameters of the model: {short_list(unknown)}")
        wanted = {id(parameters[name]) for name in names}
        return [i for i, group in enumerate(self._unit_params) if any(id(p) in wanted for p in group)]

    def apply_selection(self, selected: Sequence[str]) -> None:
        """Train only the units named in ``selected`` until the next probe.

        Units left out get ``requires_grad=False`` and no gradient, so the optimizer skips
        them; with ``optimizer_state="keep"`` it keeps their state (momentum, Adam moments)
        for when they rejoin, with ``"reset"`` their state is dropped as they leave and they
        rejoin as fresh parameters. Units named get back the ``requires_grad=True`` the
        cycle took, never more (a parameter the user froze stays frozen). Selecting every
        unit restores the user's flags.
        """
        self._apply(selected, drop_state=self.optimizer_state == "reset")

    def _apply(self, selected: Sequence[str], *, drop_state: bool) -> None:
        """:meth:`apply_selection`, dropping the optimizer state of units that leave only if
        ``drop_state`` (a checkpoint load does not: the checkpoint's optimizer state follows,
        and a refused load must leave the learner's as it was)."""
        if self.profile_ is None:
            raise RuntimeError("ElasticTrainer has no profile yet: call learner.observe first")
        chosen = set(selected)
        unknown = sorted(chosen - set(self.profile_.units))
        if unknown:
            raise ValueError(f"unknown units {unknown}; the units are {self.profile_.units}")
        self.selected = [name for name in self.profile_.units if name in chosen]
        on = {id(p) for name, params in zip(self.profile_.units, self._unit_params) if name in chosen for p in params}
        for params in self._unit_params:
            for p in params:
                if id(p) in on:
                    if self._switched_off.pop(id(p), None) is not None:
                        p.requires_grad_(True)
                elif p.requires_grad or id(p) in self._switched_off:
                    if drop_state and id(p) not in self._switched_off:
                        self._attached().optimizer.state.pop(p, None)  # leaving now: its momentum goes stale
                    p.requires_grad_(False)
                    p.grad = None  # optimizers skip params without a gradient (and keep any state)
                    self._switched_off[id(p)] = p

    def candidates(self) -> list[nn.Parameter]:
        """The parameters the cycle may select: left trainable by the user and held by the optimizer.

        "Trainable by the user" counts the units the cycle itself switched off as trainable.
        """
        learner = self._attached()
        held = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
        return [p for p in learner.model.parameters() if id(p) in held and (p.requires_grad or id(p) in self._switched_off)]

    def frozen_names(self) -> list[str]:
        """Names of the model's parameters that are not :meth:`candidates` (the user froze them, or no optimizer group holds them)."""
        ids = {id(p) for p in self.candidates()}
        return [name for name, p in self._attached().model.named_parameters() if id(p) not in ids]

    def _release(self) -> None:
        """Give back every ``requires_grad`` the cycle took: the model's flags are the user's again."""
        for p in self._switched_off.values():
            p.requires_grad_(True)
        self._switched_off = {}

    # ------------------------------------------------------------ the cycle
    @property
    def attached_model(self) -> nn.Module:
        """The model of the learner this is attached to (``RuntimeError`` when not attached)."""
        return self._attached().model

    def _attached(self) -> OnlineLearner:
        if self._learner is None:
            raise RuntimeError("ElasticTrainer is not attached: pass it in OnlineLearner(plugins=[...])")
        return self._learner

    def _set_profile(self, profile: TensorProfile) -> None:
        """Use ``profile`` from now on, every unit trainable until the next selection
        (``ValueError`` if its units are not the model's trainable ones; nothing changes then)."""
        try:
            params = unit_parameters(self._attached().model, profile.units, profile.granularity, self.candidates())
        except KeyError as error:
            raise ValueError(f"the profile does not fit the model: {error.args[0]}") from None
        self._release()
        self.profile_, self._unit_params = profile, params
        self.timing_ = StepTimeModel(profile)
        self._probe_times, self._window, self._window_prediction = [], [], None

    def _start_drift_window(self) -> None:
        """Raise the budget to ``drift_rho`` for ``drift_steps`` steps, probing now and when it ends."""
        self._drift_left = self.drift_steps
        self._probe_now = True

    def _begin_step(self) -> None:
        """A training step begins (after :meth:`_finish_probe`): start a probe when due, count the step."""
        self._probe_step = False
        if self.profile_ is None:
            return
        if self._probe_now or self._since_probe >= self.reselect_every:
            self._start_probe()
        self.steps_ += 1
        self._since_probe += 1
        if self._drift_left:
            self._drift_left -= 1
            self._probe_now = self._drift_left == 0

    def _indices(self, names: Sequence[str] | None = None) -> list[int]:
        assert self.profile_ is not None
        index = {name: i for i, name in enumerate(self.profile_.units)}
        return [index[n] for n in (self.selected if names is None else names)]

    def _record_time(self, seconds: float) -> None:
        """Feed one measured step time to the closed loop (not with :meth:`use_costs`' fixed costs)."""
        if self.timing_ is None or self.fixed_costs:
            return
        if self._probe_step:
            self._probe_times = [*self._probe_times[-4:], max(seconds - self._arm_s, 1e-9)]
            self.timing_.observe_full(statistics.median(self._probe_times))
            return
        if self._window_prediction is None:
            return
        self._window.append(seconds)
        if len(self._window) >= self.check_steps:
            measured = statistics.median(self._window)
            selected = self._indices()
            self.predictions_.append({**self._window_prediction, "measured_s": measured, "step": self.steps_})
            self.timing_.observe(selected, measured)
            self._window, self._window_prediction = [], None

    def _start_probe(self) -> None:
        assert self.profile_ is not None
        self.apply_selection(self.profile_.units)
        self._estimator = GradientImportance(self._unit_params)
        now = CLOCKS[self.clock]
        start = now()
        self._estimator.arm()
        self._arm_s = now() - start  # inside the measured step: not training time
        self._since_probe = 0
        self._probe_now = False
        self._probe_step = True
        self._window, self._window_prediction = [], None
        self.probes_ += 1

    def _finish_probe(self) -> None:
        if self._estimator is None:
            return
        scores, self._estimator = self._estimator.collect(), None
        if scores is not None and any(scores):  # a skipped step moves no weight: keep the old scores
            self.importance_ = scores
        self._select()

    def _select(self) -> None:
        profile, timing = self.profile_, self.timing_
        assert profile is not None and timing is not None
        everything = list(range(len(profile.units)))
        if self.importance_ is None or (self.current_rho >= 1.0 and self.memory_budget_bytes is None):
            self.apply_selection(profile.units)
            return
        overhead, forward, weight_s, act_s, tail = timing.corrected_costs()
        # rho bounds forward + backward (the part the selection changes), as in ElasticTrainer;
        # the optimizer/bookkeeping overhead is predicted and reported, not budgeted
        full = timing.predict(everything) - overhead
        budget = self.current_rho * full - forward - tail
        chosen = self._choose(profile, weight_s, act_s, budget)
        if not chosen:
            chosen = self._over_budget(self._memory_budget(profile), (forward + tail) / full)
        self.apply_selection([profile.units[i] for i in chosen])
        self._window = []
        self._window_prediction = {
            "units": len(chosen),
            "raw_s": timing.raw_prediction(chosen),
            "predicted_s": timing.predict(chosen),
        }

    def _memory_budget(self, profile: TensorProfile) -> dict[str, Any]:
        """``select_tensors``'s memory arguments for ``memory_budget_bytes`` (none without one)."""
        if self.memory_budget_bytes is None:
            return {}
        factor = optimizer_state_factor(self._attached().optimizer)
        return {
            "weight_bytes": [i + p * (1 + factor) for i, p in zip(profile.input_bytes, profile.param_bytes)],
            "act_bytes": [float(b) for b in profile.act_bytes],
            "budget_bytes": float(self.memory_budget_bytes),
        }

    def _choose(self, profile: TensorProfile, weight_s: Sequence[float], act_s: Sequence[float], budget: float) -> list[int]:
        """The most important units within ``budget`` seconds of backward (and the memory budget); [] if none fits."""
        assert self.importance_ is not None
        if budget <= 0:
            return []
        return select_tensors(self.importance_, weight_s, act_s, budget, resolution=self.resolution, **self._memory_budget(profile))

    def _over_budget(self, memory: dict[str, Any], fixed_share: float) -> list[int]:
        """The selection when no selection fits ``rho``: rho cannot be met, so train what the
        user made trainable (within the memory budget, the most important units that fit;
        when none fits, the smallest), and say so."""
        profile = self.profile_
        assert profile is not None and self.importance_ is not None
        n = len(profile.units)
        if self.memory_budget_bytes is None:
            chosen = list(range(n))
        else:  # memory alone: a time budget no selection can exceed
            chosen = select_tensors(self.importance_, [0.0] * n, [0.0] * n, 1.0, resolution=1, **memory)
            if not chosen:
                chosen = [min(range(n), key=lambda k: self.memory_estimate([profile.units[k]]) or 0)]
        frozen = len(self.frozen_names())
        warnings.warn(
            f"ElasticTrainer: no selection of the trainable units fits rho={self.current_rho} (the forward pass"
            + (f", through {frozen} frozen parameter tensor(s) too," if frozen else "")
            + f" and the backward every selection pays take {fixed_share:.0%} of a full step); training "
            + ("all" if len(chosen) == n else f"{len(chosen)} of")
            + f" {n} trainable unit(s)"
            + ("" if self.memory_budget_bytes is None else f" within memory_budget_bytes={self.memory_budget_bytes}")
            + f": {short_list([profile.units[i] for i in chosen])}",
            ElasticWarning,
            stacklevel=4,
        )
        return chosen


def short_list(names: list[str], shown: int = 6) -> str:
    """``names`` for a message, at most ``shown`` of them."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
