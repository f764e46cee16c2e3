"""The update guard: no optimizer step that can poison the model, and a way out when stuck.

Before every step the :class:`UpdateGuard` checks the optimizer's hyperparameters (a NaN,
infinite or negative learning rate, one above ``max_lr``, or any non-finite float
hyperparameter skips the step with the reason), the window's loss and the gradient norm
(non-finite skips). A step that may be unusual is made on a copy-protected path:
parameters and optimizer state are restored bit for bit if it leaves a parameter
non-finite, or if it changes the parameters by far more than is sane (see *Update size*).

Update size. A protected step measures its relative size
``r = ||Δθ|| / max(||θ||, 0.1 sqrt(n))`` (θ: the ``n`` parameters that have a gradient;
the floor keeps a zero-initialized model from dividing by 0) and refuses it when
``r > update_jump`` (no step is sanely 1000x the parameters' own norm) or, once earlier
steps were measured, when ``r > max(1, update_jump * typical)`` (orders of magnitude
beyond the geometric running mean of measured healthy ``r``, and more than the parameters'
own norm: so the large steps of early training or of a new task are never refused).
The rule is :mod:`taste_cl.guards.size_rule`, which the device learners' guard applies too.
In ``"auto"`` mode a step is protected only when it may be unusual: its size bound, largest
LR times ``max(1, gradient norm)``, exceeds ``update_bound``; LR times gradient norm is
over 10x its running geometric mean; a hyperparameter other than the LR changed; it is
the first step; or 50 steps passed since the last measured one (to keep ``typical``
current). Healthy steps of a steady run are thus measured 1 in 50.

Two conditions are reported as monitor events:

- ``updates_stuck``: ``stuck_after`` steps in a row were skipped (e.g. after a finite
  but huge step every loss overflows). With ``rollback=True`` the model and optimizer
  go back to the last good snapshot, taken every ``snapshot_every`` ordinary steps just
  before a step whose loss was finite and whose size bound is within ``update_bound``
  (so the snapshot's parameters give a finite loss and its learning rates are sane).
  Snapshots cost one copy of the model and optimizer state, hence off by default.
- ``diverging``: the smoothed loss rose above ``divergence_factor`` times its best
  value so far (orders of magnitude; the default is 1000x).

>>> guard = UpdateGuard(stuck_after=5, rollback=True, snapshot_every=20)
>>> guard.check_hyperparameters([{"lr": float("nan"), "params": []}])
'learning rate of param group 0 is nan, must be finite'
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._checks import check_finite_positive, check_int
from taste_cl.guards.size_rule import StepSizeHistory, log_clamped

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["GUARD_MODES", "UpdateGuard"]

GUARD_MODES = ("auto", "always", "never")
_EMA_ALPHA = 0.2  # weight of the newest window loss in the smoothed loss
_EMA_WARMUP = 5  # windows before ``diverging`` may fire (the first losses are noisy)
_LOSS_FLOOR = 1e-2  # the best smoothed loss is floored here, so a loss near 0 is not a hair trigger
HYPERPARAMETER_RANGES: dict[str, tuple[float, float]] = {
    "momentum": (0.0, 1.0),
    "dampening": (0.0, 1.0),
    "betas": (0.0, 1.0),
    "weight_decay": (0.0, 1e3),
    "eps": (0.0, 1e3),
}
"""Sane ranges of common optimizer hyperparameters (each member of a tuple such as
Adam's ``betas``); a value outside is refused by the guard and by checkpoint loading."""


def hyperparameter_problem(key: str, value: float) -> str | None:
    """Why ``value`` is not a sane ``key`` hyperparameter, or None (NaN is never sane)."""
    if not math.isfinite(value):
        return f"is {value}, must be finite"
    low, high = HYPERPARAMETER_RANGES.get(key, (-math.inf, math.inf))
    if not low <= value <= high:
        return f"is {value:g}, must be in [{low:g}, {high:g}]"
    return None


@dataclass(frozen=True)
class _GuardConfig:
    mode: str
    max_lr: float
    update_bound: float
    stuck_after: int
    rollback: bool
    snapshot_every: int
    divergence_factor: float
    update_jump: float = 1e3  # a default: checkpoints written before it existed lack it


class UpdateGuard:
    """Refuse or undo optimizer steps that would poison the model; detect stuck and diverging runs.

    Parameters
    ----------
    mode:
        ``"auto"``: copy-protect only steps that may be unusual (see the module doc);
        ``"always"``: every step; ``"never"``: none (the hyperparameter and finiteness
        checks still run, the update size is not measured).
    max_lr:
        Learning rates above this are absurd: the step is skipped with the reason.
    update_bound:
        Size bound (largest LR x max(1, gradient norm)) above which a step is copy-protected.
    update_jump:
        A protected step that changes the parameters by more than this times their norm,
        or (once there is history) by more than their norm and this times the typical
        relative step, is undone with the reason.
    stuck_after:
        Emit ``updates_stuck`` after this many skipped steps in a row.
    rollback:
        On ``updates_stuck``, restore the last good snapshot (needs one copy of the model
        and optimizer state in memory).
    snapshot_every:
        Applied steps between snapshots when ``rollback`` is on.
    divergence_factor:
        Emit ``diverging`` when the smoothed loss exceeds this times its best value.
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        max_lr: float = 1e6,
        update_bound: float = 1e4,
        stuck_after: int = 10,
        rollback: bool = False,
        snapshot_every: int = 50,
        divergence_factor: float = 1e3,
        update_jump: float = 1e3,
    ) -> None:
        if mode not in GUARD_MODES:
            raise ValueError(f"`guard_updates == {mode!r}`, must be one of {', '.join(map(repr, GUARD_MODES))}")
        if not isinstance(rollback, bool):
            raise TypeError(f"rollback must be a bool; got {type(rollback).__name__}")
        self.config = _GuardConfig(
            mode=mode,
            max_lr=check_finite_positive("max_lr", max_lr),
            update_bound=check_finite_positive("update_bound", update_bound),
            stuck_after=check_int("stuck_after", stuck_after, 1),
            rollback=rollback,
            snapshot_every=check_int("snapshot_every", snapshot_every, 1),
            divergence_factor=check_finite_positive("divergence_factor", divergence_factor),
            update_jump=check_finite_positive("update_jump", update_jump),
        )
        self.protected_steps = 0  # copy-protected steps since construction (not saved): what "auto" costs
        self._reset()

    def _reset(self) -> None:
        self.skipped_in_row = 0
        self._since_snapshot = self.config.snapshot_every  # the first applied step snapshots
        self._window_losses: list[float] = []
        self._ema: float | None = None
        self._best: float | None = None
        self._windows = 0
        self._diverging = False
        self._snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._sane_settings: list[tuple[tuple[str, Any], ...] | None] | None = None  # see check_hyperparameters
        self._stepped_settings: object = None  # ``_sane_settings`` at the last applied step
        self._sizes = StepSizeHistory()  # what the update-size rule remembers

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def has_snapshot(self) -> bool:
        """Whether a good snapshot is held for rollback."""
        return self._snapshot is not None

    def drop_snapshot(self) -> None:
        """Forget the snapshot (the model changed shape: its classifier grew); the next applied step takes one."""
        self._snapshot, self._since_snapshot = None, self.config.snapshot_every

    # ------------------------------------------------------------- checks
    def check_hyperparameters(self, param_groups: Sequence[dict[str, Any]]) -> str | None:
        """Why the optimizer must not step with these groups, or None when they are sane.

        Every comparison is written so that NaN fails it (``nan > bound`` is False).
        The learning rates are checked on every call; the other hyperparameters only when
        they differ from the last sane set (a NaN never equals itself, so it is always rechecked).
        """
        settings = [_settings(group) for group in param_groups]
        for index, group in enumerate(param_groups):
            lr = _as_float(group.get("lr"))
            if lr is None:
                return f"learning rate of param group {index} is {group.get('lr')!r}, must be a number"
            if not math.isfinite(lr):
                return f"learning rate of param group {index} is {lr}, must be finite"
            if not 0.0 <= lr <= self.config.max_lr:
                return f"learning rate of param group {index} is {lr:g}, must be in [0, max_lr={self.config.max_lr:g}]"
        if None not in settings and settings == self._sane_settings:
            return None
        for index, group in enumerate(param_groups):
            for key, value in group.items():
                if key in ("lr", "params"):
                    continue
                for member in value if isinstance(value, (tuple, list)) else (value,):
                    number = _as_float(member)  # None for flags, strings and None
                    problem = None if number is None else hyperparameter_problem(key, number)
                    if problem is not None:
                        return f"hyperparameter `{key}` of param group {index} {problem}"
        self._sane_settings = settings
        return None

    def record_loss(self, loss: float) -> None:
        """Note a micro-batch loss of the current accumulation window."""
        self._window_losses.append(loss)

    # --------------------------------------------------------------- step
    def step(self, learner: OnlineLearner, params: list[torch.Tensor], grad_norm: float, window_finite: bool) -> bool:
        """Apply the accumulated gradient of ``learner`` unless unsafe; return whether it was applied.

        ``params`` are the optimizer's parameters that have a gradient. Emits
        ``numerical_fault`` with the cause for a skipped or undone step, then checks
        for ``updates_stuck`` and ``diverging``.
        """
        losses, self._window_losses = self._window_losses, []
        cause = None
        if not (window_finite and math.isfinite(grad_norm)):
            cause = "non-finite loss or gradient"
        else:
            cause = self.check_hyperparameters(learner.optimizer.param_groups)
        if cause is None:
            largest_lr = max(float(group["lr"]) for group in learner.optimizer.param_groups)
            ordinary = largest_lr * max(1.0, grad_norm) <= self.config.update_bound
            snapshot = self._snapshot_due(learner) if ordinary else None
            log_proxy = log_clamped(largest_lr * grad_norm)
            protect = self.config.mode == "always" or (self.config.mode == "auto" and not (ordinary and self._usual(log_proxy)))
            if protect:
                cause = self._protected_step(learner.optimizer, params)
            else:
                learner.optimizer.step()
            if cause is None:
                self._sizes.applied(log_proxy, measured=protect)
                self._stepped_settings = self._sane_settings
                if snapshot is not None:
                    self._snapshot, self._since_snapshot = snapshot, 0
        if cause is not None:
            learner.monitor.emit("numerical_fault", micro_batches=len(losses), cause=cause)
        applied = cause is None
        self._track_skips(learner, applied)
        if applied and losses:
            self._track_divergence(learner, sum(losses) / len(losses))
        return applied

    def _usual(self, log_proxy: float) -> bool:
        """Whether an ordinary-size step may skip the copy protection: the size rule says so
        (:meth:`~taste_cl.guards.size_rule.StepSizeHistory.usual`) and the hyperparameters are
        those of the last applied step (the check keeps one settings object while they are unchanged)."""
        return self._sizes.usual(log_proxy) and self._sane_settings is self._stepped_settings

    def _protected_step(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> str | None:
        """Step and measure it; undo it on ``params`` and their optimizer state (bit for bit)
        if a parameter became non-finite or the step is too large. Returns why it was undone, or None."""
        self.protected_steps += 1
        if not params:
            optimizer.step()
            return None
        with torch.no_grad():
            saved_params = torch._foreach_mul(params, 1.0)  # one fused copy
        saved_state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()} for p in params if p in optimizer.state
        }
        optimizer.step()
        with torch.no_grad():
            largest = _total_norm(params, math.inf)  # max |p|: no overflow, non-finite iff a parameter is
            change = _total_norm(torch._foreach_sub(params, saved_params), 2.0)
            size = _total_norm(saved_params, 2.0)
            largest_value, change_value, size_value = torch.stack([largest, change, size]).tolist()  # one sync
        count = sum(p.numel() for p in params)
        cause = self._sizes.judge(largest=largest_value, change=change_value, size=size_value, count=count, update_jump=self.config.update_jump)
        if cause is None:
            return None
        with torch.no_grad():
            torch._foreach_copy_(params, saved_params)
        for p in params:
            if p in saved_state:
                optimizer.state[p] = saved_state[p]
            else:
                optimizer.state.pop(p, None)
        return cause

    # ------------------------------------------------------ stuck / rollback
    def _snapshot_due(self, learner: OnlineLearner) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Before an ordinary-size step with a finite loss, every ``snapshot_every`` such steps,
        a copy of the model and optimizer state, kept only if the step is then applied.

        The copied parameters just gave a finite loss, and the copied learning rates passed
        the hyperparameter check and then made an applied step, so rolling back to them is
        safe (a refused step's learning rate may be the spike that got the learner stuck)."""
        if not self.config.rollback:
            return None
        self._since_snapshot += 1
        if self._since_snapshot < self.config.snapshot_every:
            return None
        return copy.deepcopy(learner.model.state_dict()), copy.deepcopy(learner.optimizer.state_dict())

    def _track_skips(self, learner: OnlineLearner, applied: bool) -> None:
        if applied:
            self.skipped_in_row = 0
            return
        self.skipped_in_row += 1
        if self.skipped_in_row != self.config.stuck_after:
            return
        rolled_back = self.config.rollback and self._snapshot is not None
        learner.monitor.emit("updates_stuck", skipped=self.skipped_in_row, rolled_back=rolled_back)
        if rolled_back:
            assert self._snapshot is not None
            model_state, optimizer_state = self._snapshot
            learner.model.load_state_dict(model_state)
            learner.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
            self.skipped_in_row = 0
            self._ema, self._best, self._windows, self._diverging = None, None, 0, False

    def _track_divergence(self, learner: OnlineLearner, loss: float) -> None:
        self._ema = loss if self._ema is None else (1 - _EMA_ALPHA) * self._ema + _EMA_ALPHA * loss
        self._windows += 1
        if self._windows <= _EMA_WARMUP:
            self._best = self._ema if self._best is None else min(self._best, self._ema)
            return
        assert self._best is not None
        threshold = self.config.divergence_factor * max(self._best, _LOSS_FLOOR)
        if self._ema > threshold and not self._diverging:
            learner.monitor.emit("diverging", loss=self._ema, best=self._best, factor=self.config.divergence_factor)
        self._diverging = self._ema > threshold
        self._best = min(self._best, self._ema)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, param_groups: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Config and counters (the rollback snapshot itself is not saved: it is a second model copy).

        With the optimizer's ``param_groups``, ``settings_unchanged`` records whether its
        hyperparameters are still those of the last applied step, so a resumed run decides
        its next copy protection as the uninterrupted one would.
        """
        return {
            "config": asdict(self.config),
            "skipped_in_row": self.skipped_in_row,
            "since_snapshot": self._since_snapshot,
            "ema": self._ema,
            "best": self._best,
            "windows": self._windows,
            "diverging": self._diverging,
            "window_losses": list(self._window_losses),
            **self._sizes.state_dict(),  # the update-size history (absent from checkpoints written before it existed)
            "settings_unchanged": self._settings_unchanged(param_groups),
        }

    def _settings_unchanged(self, param_groups: Sequence[dict[str, Any]] | None) -> bool:
        """Whether the next :meth:`check_hyperparameters` keeps the settings of the last applied step."""
        held = self._sane_settings
        return (
            param_groups is not None and held is not None and held is self._stepped_settings and [_settings(group) for group in param_groups] == held
        )

    @classmethod
    def parse_state(cls, state: Any) -> tuple[UpdateGuard, dict[str, Any]]:
        """Validate ``state`` into a new guard plus its counters; raises ValueError/TypeError naming the field."""
        fresh, sizes = cls(), StepSizeHistory().state_dict()
        keys, optional = set(fresh.state_dict()), {*sizes, "settings_unchanged"}
        if not isinstance(state, dict) or not keys - optional <= set(state) <= keys:
            raise ValueError(f"guard state must be a dict with keys {sorted(keys)} ({', '.join(sorted(optional))} optional)")
        state = {**sizes, "settings_unchanged": False, **state}
        config = state["config"]
        fields = set(_GuardConfig.__dataclass_fields__)
        if not isinstance(config, dict) or not fields - {"update_jump"} <= set(config) <= fields:
            raise ValueError(f"guard config must have keys {sorted(fields)} (update_jump optional)")
        guard = cls(config["mode"], **{k: v for k, v in config.items() if k != "mode"})
        counters: dict[str, Any] = {}
        for key in ("skipped_in_row", "since_snapshot", "windows", "since_measure"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"guard `{key} == {value!r}`, must be an int >= 0")
            counters[key] = value
        for key in ("ema", "best"):
            value = state[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
                raise ValueError(f"guard `{key} == {value!r}`, must be None or a finite number >= 0")
            counters[key] = None if value is None else float(value)
        for key in ("log_proxy", "log_size"):
            value = state[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= 1e3):
                raise ValueError(f"guard `{key} == {value!r}`, must be None or a number in [-1e3, 1e3] (a log)")
            counters[key] = None if value is None else float(value)
        if (counters["ema"] is None) != (counters["best"] is None):
            raise ValueError("guard `ema` and `best` must both be None or both be numbers")
        if not isinstance(state["diverging"], bool):
            raise ValueError(f"guard `diverging == {state['diverging']!r}`, must be a bool")  # noqa: TRY004
        counters["diverging"] = state["diverging"]
        if not isinstance(state["settings_unchanged"], bool):
            raise ValueError(f"guard `settings_unchanged == {state['settings_unchanged']!r}`, must be a bool")  # noqa: TRY004
        counters["settings_unchanged"] = state["settings_unchanged"]
        losses = state["window_losses"]
        if not isinstance(losses, list) or len(losses) > 2**20 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in losses):
            raise ValueError("guard `window_losses` must be a list of numbers (the losses of the open window)")
        counters["window_losses"] = [float(v) for v in losses]
        return guard, counters

    def load_state_dict(self, state: dict[str, Any], param_groups: Sequence[dict[str, Any]] | None = None) -> None:
        """Restore config and counters (validated first; on error nothing changes). Drops any snapshot.

        ``param_groups`` (the restored optimizer's) restore ``settings_unchanged``; without them
        the next step is copy-protected and measured, as after a hyperparameter change.
        """
        parsed, counters = self.parse_state(state)
        self.config = parsed.config
        self._reset()
        self.skipped_in_row = counters["skipped_in_row"]
        self._since_snapshot = counters["since_snapshot"]
        self._ema, self._best, self._windows = counters["ema"], counters["best"], counters["windows"]
        self._diverging = counters["diverging"]
        self._window_losses = counters["window_losses"]
        self._sizes.load_state_dict({key: counters[key] for key in ("log_proxy", "log_size", "since_measure")})
        if counters["settings_unchanged"] and param_groups is not None:
            settings = [_settings(group) for group in param_groups]
            if None not in settings:
                self._sane_settings = self._stepped_settings = settings


def _settings(group: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """A group's hyperparameters other than ``lr`` and ``params``, comparable with ``==``;
    None when one holds a tensor (a tensor comparison is not a plain bool: never cached)."""
    items = tuple(
        (key, tuple(value) if isinstance(value, list) else value)  # a copy: a list may be changed in place
        for key, value in group.items()
        if key != "lr" and key != "params"
    )
    for _, value in items:
        for member in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(member, torch.Tensor):
                return None
    return items


def _total_norm(tensors: Sequence[torch.Tensor], order: float) -> torch.Tensor:
    """The ``order``-norm of all ``tensors`` together as a 0-d tensor on the first one's device,
    without a sync: one ``_foreach_norm`` per device and dtype, half precision accumulated in float32."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    result_dtype = torch.float64 if any(dtype == torch.float64 for _, dtype in groups) else torch.float32
    norms = [
        norm.to(tensors[0].device, result_dtype)
        for (_, dtype), group in groups.items()
        for norm in torch._foreach_norm(group, order, dtype=torch.promote_types(dtype, torch.float32))
    ]
    return torch.linalg.vector_norm(torch.stack(norms), order)


def _as_float(value: Any) -> float | None:
    """``value`` as a float (numbers and one-element tensors), or None when it is not numeric."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            return math.inf
    return None
