"""The :class:`ElasticTrainer` plugin: the selection cycle wired into a learner.

The cycle itself (probe importance, select under the budgets, measure, correct the time
model) is :class:`~taste_cl.elastic.cycle.SelectionCycle`; this module adds what makes it
a :class:`~taste_cl.plugins.LearnerPlugin`: the learner hooks that run it and time its
steps, the monitor events that steer it, the profile it runs on (measured or cached) and
its state in learner checkpoints.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from taste_cl._checks import check_int
from taste_cl.elastic.cache import load_or_profile
from taste_cl.elastic.cycle import OptimizerStatePolicy, SelectionCycle, short_list
from taste_cl.elastic.profiling import check_profile_options, first_rows, profile_tensors, repeat_rows, unit_parameters
from taste_cl.elastic.tensor_profile import CLOCKS, Clock, Granularity, TensorProfile, parse_profile
from taste_cl.exceptions import CheckpointError, ElasticWarning
from taste_cl.monitor.monitor import MonitorEvent
from taste_cl.plugins import LearnerPlugin
from taste_cl.tuning.fingerprint import default_cache_dir

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner

__all__ = ["ElasticTrainer"]


class ElasticTrainer(SelectionCycle, LearnerPlugin):
    """Train, at each step, only the units worth their backward time (ElasticTrainer).

    Every ``reselect_every`` training steps one probe step trains every unit and measures
    importance; the units of maximal importance whose predicted forward + backward time is
    at most ``rho`` times that of full training (and, with ``memory_budget_bytes``, whose
    training memory fits) are then trained until the next probe. Frozen units get no
    gradient, so the optimizer skips them (``optimizer_state`` says whether their state waits
    for them or is dropped).

    Closed loop: the step times measured after each selection (``check_steps`` of them,
    median) and on probe steps refit a :class:`~taste_cl.elastic.calibration.StepTimeModel`
    (optimizer and bookkeeping overhead, a global backward scale, per-unit scales; the
    forward pass is timed on its own every step, through a forward hook on the model that
    lives only until it fires, so it is not confused with the overhead); later selections
    use the corrected times. :meth:`prediction_errors` reports how far the raw profile and
    the corrected model were from the measured times.

    Drift policy: on the monitor's ``drift_detected`` event the next step is a probe and
    the budget is raised to ``drift_rho`` for ``drift_steps`` steps, then a probe reselects
    at ``rho``.

    Parameters
    ----------
    rho:
        Target forward + backward time as a fraction of full training's, in (0, 1]
        (the optimizer step and bookkeeping, the same for any selection, are not budgeted).
    reselect_every:
        Training steps between probes.
    drift_rho, drift_steps:
        Budget (>= ``rho``; default halfway between ``rho`` and 1) and duration after a drift event.
    granularity:
        ``"tensor"`` (weights and biases are separate units) or ``"module"``.
    memory_budget_bytes:
        Optional cap on training memory (kept activations + gradients + optimizer state of
        the selected units; see :meth:`TensorProfile.memory_bytes`).
    cache_dir:
        Where profiles are cached (see :func:`~taste_cl.tuning.fingerprint.default_cache_dir`); None to always profile.
    warmup, repeats, max_rounds, tolerance:
        Profiling: untimed rounds, timed rounds, the bound on rounds when the profile is
        noisy, and the relative CI half-width that counts as noisy.
    check_steps:
        Steps measured after each selection to check and correct the prediction.
    resolution:
        Time bins of the DP selector.
    clock:
        ``"wall"`` (default) profiles and checks step times on the wall clock; ``"cpu"``
        on this process's CPU time, which a shared device's other processes do not
        inflate (see :mod:`taste_cl.elastic.profiling`). With one intra-op thread the two
        agree on an idle device.
    optimizer_state:
        ``"keep"`` (default): a unit that leaves the selection keeps its optimizer state
        (momentum, Adam moments) and resumes with it. ``"reset"``: the state is dropped as
        it leaves, freeing that memory, and the unit rejoins (a probe step included) as a
        fresh parameter would, not with a momentum from its last selection. On the
        personalize benchmark's SGD with momentum 0.9, reset took ten runs of elastic_0.5
        from a lift of 51.0-55.5 points (sd 1.4) to 53.4-55.0 (sd 0.5); on ``bench
        elastic`` it ended further below full fine-tuning; see docs/elastic.md.
    """

    name = "elastic"

    def __init__(
        self,
        *,
        rho: float = 0.5,
        reselect_every: int = 50,
        drift_rho: float | None = None,
        drift_steps: int = 20,
        granularity: Granularity = "tensor",
        memory_budget_bytes: int | None = None,
        cache_dir: str | os.PathLike[str] | None = "default",
        warmup: int = 2,
        repeats: int = 7,
        max_rounds: int = 28,
        tolerance: float = 0.2,
        check_steps: int = 5,
        resolution: int = 1000,
        clock: Clock = "wall",
        optimizer_state: OptimizerStatePolicy = "keep",
    ) -> None:
        super().__init__(
            rho=rho, reselect_every=reselect_every, drift_rho=drift_rho, drift_steps=drift_steps,
            memory_budget_bytes=memory_budget_bytes, check_steps=check_steps, resolution=resolution, clock=clock,
            optimizer_state=optimizer_state,
        )  # fmt: skip
        check_profile_options(granularity, clock, warmup, repeats, max_rounds, tolerance)
        self.granularity = granularity
        self.cache_dir = cache_dir
        self.warmup = warmup
        self.repeats = repeats
        self.max_rounds = max_rounds
        self.tolerance = tolerance
        self._example: Any = None
        self._cpu_start: float | None = None
        self._forward_start = 0.0
        self._forward_hook: Any = None

    # ----------------------------------------------------------------- hooks
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        self._learner = learner
        learner.monitor.subscribe(self._on_drift, event="drift_detected")
        learner.monitor.subscribe(self._on_retuned, event="retuned")

    def on_first_batch(self, learner: OnlineLearner, x: Any, **kwargs: Any) -> None:
        self._example = first_rows(x, 1)
        if self.profile_ is None:
            n = next(t for t in pytree.tree_leaves(x) if torch.is_tensor(t)).shape[0]
            self.reprofile(n + learner.replay_batch_size)

    def before_step(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if self.clock == "cpu" and self._cpu_start is None:
            self._cpu_start = time.process_time()  # the first step of this observe
        self._finish_probe()
        self._begin_step()
        if self.profile_ is None:
            return
        # time this step's forward pass on its own (the hook lives only until it fires)
        self._remove_forward_hook()
        self._forward_hook = learner.model.register_forward_hook(self._forward_done)
        self._forward_start = CLOCKS[self.clock]()

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        seconds = CLOCKS[self.clock]() - self._forward_start
        self._remove_forward_hook()
        if self.timing_ is not None and not self.fixed_costs:
            self.timing_.observe_forward(seconds)

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self._remove_forward_hook()  # the forward raised, or the step had none
        seconds = stats.step_time_s
        if self.clock == "cpu":
            seconds, self._cpu_start = (0.0 if self._cpu_start is None else time.process_time() - self._cpu_start), None
        if stats.micro_batches and stats.steps:
            self._record_time(seconds / stats.micro_batches)
        self._finish_probe()

    def _on_retuned(self, event: MonitorEvent) -> None:
        """The batch-size tuner picked a new micro-batch: step times changed, so reprofile and reselect."""
        if self._example is not None:
            self.reprofile(int(event.details["batch_size"]))

    def _on_drift(self, event: MonitorEvent) -> None:
        self._start_drift_window()

    # ----------------------------------------------------------- profile
    def reprofile(self, batch_size: int | None = None, *, refresh: bool = False) -> TensorProfile:
        """(Re)measure the profile for training batches of ``batch_size`` and reselect.

        Call after the batch size changes (the batch-size tuner); uses the cache when it
        holds this model, batch shape and hardware, unless ``refresh``. A profile still too
        noisy after ``max_rounds`` gives a ``RuntimeWarning`` (and ``profile_.noisy``).
        """
        learner = self._attached()
        if self._example is None:
            raise RuntimeError("ElasticTrainer.reprofile needs a first batch: call learner.observe first")
        size = batch_size if batch_size is not None else 1
        check_int("batch_size", size, 1)
        example = repeat_rows(self._example, size)
        options = {
            "granularity": self.granularity, "warmup": self.warmup, "repeats": self.repeats,
            "max_rounds": self.max_rounds, "tolerance": self.tolerance, "clock": self.clock, "output": learner.output,
            "call": learner.call, "frozen_norms": learner.frozen_norms,
        }  # fmt: skip
        trainable = self.candidates()  # the units this cycle switched off count as trainable
        if self.cache_dir is None:
            profile = profile_tensors(learner.model, example, trainable=trainable, **options)  # type: ignore[arg-type]
        else:
            directory = default_cache_dir() if self.cache_dir == "default" else self.cache_dir
            profile, _ = load_or_profile(learner.model, example, cache_dir=directory, refresh=refresh, trainable=trainable, **options)  # type: ignore[arg-type]
        if profile.noisy:
            warnings.warn(
                f"ElasticTrainer: the timing profile is too noisy to separate units after {profile.rounds} rounds "
                f"(largest relative 95% CI {profile.relative_noise():.0%} > tolerance {self.tolerance:.0%}); "
                "selecting on the best estimates, and the closed loop will correct them",
                ElasticWarning,
                stacklevel=2,
            )
        self._set_profile(profile)
        self.fixed_costs = False
        self.reselect()
        return profile

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Profile, importance, selection, counters and the parameters the user froze; the
        closed-loop correction is re-learned after a load."""
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
            "frozen": self.frozen_names() if self._learner is not None else None,
            "fixed_costs": self.fixed_costs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Validate every field of ``state`` (:class:`~taste_cl.exceptions.CheckpointError`, a
        ``ValueError``, naming it), then apply all of it.

        The state must have been saved with the same parameters frozen as this model has, and
        its profile and selection may name only parameters this model trains: loading never
        unfreezes anything.
        """
        parsed = _parse_state(self, state)
        if parsed.profile is not None:
            self._set_profile(parsed.profile)  # checked by _parse_state: cannot raise here
        else:
            self._release()
            self.profile_, self.timing_, self._unit_params = None, None, []
        self.importance_ = parsed.importance
        self.steps_, self.probes_ = state["steps"], state["probes"]
        self._since_probe, self._drift_left, self._probe_now = state["since_probe"], state["drift_left"], state["probe_now"]
        self._example = state["example"]
        self.fixed_costs = state.get("fixed_costs", False)  # checkpoints from before use_costs: measured costs
        if parsed.profile is not None and state["selected"]:
            self._apply(state["selected"], drop_state=False)  # the optimizer section brings the state
        else:
            self.selected = list(state["selected"])


_STATE_KEYS = {"profile", "importance", "selected", "steps", "probes", "since_probe", "drift_left", "probe_now", "example"}


@dataclass(frozen=True)
class _ParsedState:
    profile: TensorProfile | None
    importance: list[float] | None


def _parse_state(trainer: ElasticTrainer, state: Any) -> _ParsedState:
    """Check an elastic state against ``trainer`` and its learner's model; changes nothing.

    Raises :class:`~taste_cl.exceptions.CheckpointError` naming the first bad field.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"elastic state must be a dict; got {type(state).__name__}")
    missing = sorted(_STATE_KEYS - set(state))
    if missing:
        raise CheckpointError(f"elastic state lacks {missing}")
    try:
        profile = None if state["profile"] is None else parse_profile(state["profile"])
    except ValueError as error:
        raise CheckpointError(f"elastic state: {error}") from None
    if profile is not None and profile.granularity != trainer.granularity:
        raise CheckpointError(f"elastic state has granularity {profile.granularity!r}, this trainer {trainer.granularity!r}")
    if profile is not None and profile.clock != trainer.clock:
        raise CheckpointError(f"elastic state has a {profile.clock!r}-clock profile, this trainer clock {trainer.clock!r}")
    n = 0 if profile is None else len(profile.units)
    importance = state["importance"]
    if importance is not None and (
        not isinstance(importance, list)
        or len(importance) != n
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in importance)
    ):
        raise CheckpointError(f"elastic state `importance` must be {n} finite numbers >= 0")
    selected = state["selected"]
    units = set(profile.units) if profile is not None else set()
    if not isinstance(selected, list) or not all(isinstance(u, str) for u in selected) or not set(selected) <= units:
        raise CheckpointError("elastic state `selected` must name units of the profile")
    for key in ("steps", "probes", "since_probe", "drift_left"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"elastic state `{key} == {value!r}`, must be an int >= 0")
    if not isinstance(state["probe_now"], bool):
        raise CheckpointError("elastic state `probe_now` must be a bool")
    if not isinstance(state.get("fixed_costs", False), bool):
        raise CheckpointError("elastic state `fixed_costs` must be a bool")
    example = state["example"]
    if example is not None and not all(torch.is_tensor(t) for t in pytree.tree_leaves(example)):
        raise CheckpointError("elastic state `example` must be a tensor or a structure of tensors")
    _check_frozen(trainer, state.get("frozen"))  # None: a checkpoint from before the frozen set was kept
    if profile is not None:
        model, trainable = trainer.attached_model, trainer.candidates()
        try:
            unit_parameters(model, selected, profile.granularity, trainable)
        except KeyError as error:
            raise CheckpointError(f"elastic state `selected` names a unit this model does not train: {error.args[0]}") from None
        try:
            unit_parameters(model, profile.units, profile.granularity, trainable)
        except KeyError as error:
            raise CheckpointError(f"elastic state's profile does not fit this model: {error.args[0]}") from None
    return _ParsedState(profile, None if importance is None else [float(v) for v in importance])


def _check_frozen(trainer: ElasticTrainer, frozen: Any) -> None:
    """The state's frozen parameters must be this model's: frozen parameters are the user's decision."""
    if frozen is None:
        return
    if not isinstance(frozen, list) or not all(isinstance(name, str) for name in frozen):
        raise CheckpointError("elastic state `frozen` must be a list of parameter names")
    here = trainer.frozen_names()
    if set(frozen) != set(here):
        only_saved, only_here = sorted(set(frozen) - set(here)), sorted(set(here) - set(frozen))
        raise CheckpointError(
            "elastic state was saved with other parameters frozen than this model's"
            + (f"; frozen there, trainable here: {short_list(only_saved)}" if only_saved else "")
            + (f"; frozen here (requires_grad=False, or in no optimizer group), trainable there: {short_list(only_here)}" if only_here else "")
        )
