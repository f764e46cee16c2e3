"""The device learners' update guard: the torch learner's rule, on any runtime's optimizer step.

:class:`DeviceUpdateGuard` decides each optimizer step of a device learner (or of
:class:`~taste_cl.engine.loop.EngineLearner` on any engine) as
:class:`~taste_cl.guards.update.UpdateGuard` decides the PyTorch learner's (the shared rule is
:mod:`taste_cl.guards.size_rule`): a non-finite loss or gradient, or a learning rate that is
not finite or over ``max_lr``, skips the step; a step that may be unusual is copy-protected,
and undone bit for bit (parameters, optimizer state, running statistics) when it leaves a
parameter non-finite or changes the parameters by far more than is sane. Healthy steps of a
steady run are measured 1 in 50, so the copies stay off the healthy path.

A runtime takes part through a :class:`GuardedSession`: it saves what a step changes,
measures a step against that copy, and restores it. The guard holds no arrays itself.
Reading a guard's settings from an artifact folder's manifest is the device adapters' job
(:func:`taste_cl.adapters.device.guard.guard_from_manifest`).

No torch here: the ONNX Runtime device learner runs without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from taste_cl._checks import check_finite_positive
from taste_cl.exceptions import NonFiniteOutputError
from taste_cl.guards.size_rule import StepSizeHistory, log_clamped

__all__ = ["DEVICE_GUARD_MODES", "DeviceUpdateGuard", "GuardedSession", "StepMeasure", "check_finite_outputs", "measure_arrays"]

DEVICE_GUARD_MODES = ("auto", "always", "never")
StepMeasure = tuple[float, float, float, int]
"""``(largest |θ| after, ||Δθ||, ||θ|| before, number of parameters)`` of one step."""


def measure_arrays(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> StepMeasure:
    """The :data:`StepMeasure` of a step from ``(before, after)`` arrays of each trained parameter,
    for a session whose parameters read as numpy arrays."""
    largest, change, size, count = 0.0, 0.0, 0.0, 0
    for old, new in pairs:
        largest = max(largest, float(np.abs(new).max(initial=0.0)))
        delta = new - old
        change += float(np.vdot(delta, delta))
        size += float(np.vdot(old, old))
        count += old.size
    return largest, math.sqrt(change), math.sqrt(size), count


class GuardedSession(Protocol):
    """What a device runtime offers the guard around one optimizer step."""

    def save_step_state(self) -> Any:
        """A copy of everything a step changes: trained parameters, optimizer state, running statistics."""

    def measure_step(self, saved: Any) -> StepMeasure:
        """The step just taken, measured against ``saved`` (see :data:`StepMeasure`)."""

    def restore_step_state(self, saved: Any) -> None:
        """Put back, bit for bit, what :meth:`save_step_state` copied."""


class DeviceUpdateGuard:
    """Refuse or undo device optimizer steps that would poison the model.

    ``mode``: ``"auto"`` copy-protects only steps that may be unusual, ``"always"`` every step,
    ``"never"`` none (the finiteness and learning-rate checks still run). ``max_lr``,
    ``update_bound`` and ``update_jump`` mean what they mean for the torch learner's guard, with
    its defaults. ``protect_first``: this many first steps are copy-protected whatever the mode
    says, e.g. when the export's parity gate checked generated rows rather than the user's.
    ``refused_steps`` counts the steps skipped or undone; ``last_cause`` says why the last was.
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        max_lr: float = 1e6,
        update_bound: float = 1e4,
        update_jump: float = 1e3,
        protect_first: int = 0,
    ) -> None:
        if mode not in DEVICE_GUARD_MODES:
            raise ValueError(f"`mode == {mode!r}`, must be one of {', '.join(map(repr, DEVICE_GUARD_MODES))}")
        if isinstance(protect_first, bool) or not isinstance(protect_first, int) or protect_first < 0:
            raise ValueError(f"`protect_first == {protect_first!r}`, must be an int >= 0")
        self.mode = mode
        self.max_lr = check_finite_positive("max_lr", max_lr)
        self.update_bound = check_finite_positive("update_bound", update_bound)
        self.update_jump = check_finite_positive("update_jump", update_jump)
        self.protect_first = protect_first
        self.sizes = StepSizeHistory()
        self.steps_seen = 0  # steps offered to the guard (applied or not), since it was built or loaded
        self.protected_steps = 0
        self.refused_steps = 0
        self.skipped_in_row = 0
        self.last_cause: str | None = None
        self.stepped_lr: float | None = None  # the learning rate of the last applied step

    def step(self, session: GuardedSession, apply: Callable[[], None], *, lr: float, grad_norm: float, loss: float) -> str | None:
        """Take the step ``apply`` makes on ``session``'s model unless unsafe; return why it was not
        taken (skipped or undone), or None when it was applied."""
        self.steps_seen += 1
        cause = self._precheck(lr, grad_norm, loss)
        if cause is None:
            log_proxy = log_clamped(lr * grad_norm)
            ordinary = lr * max(1.0, grad_norm) <= self.update_bound
            # as the torch guard: a step at another learning rate than the last applied one is not usual
            # (its size is not lr x gradient alone: a momentum buffer moves at the new rate too)
            usual = ordinary and self.sizes.usual(log_proxy) and lr == self.stepped_lr
            protect = self.mode == "always" or self.steps_seen <= self.protect_first or (self.mode == "auto" and not usual)
            if protect:
                cause = self._protected(session, apply)
            else:
                apply()
            if cause is None:
                self.sizes.applied(log_proxy, measured=protect)
                self.stepped_lr = lr
        self.skipped_in_row = 0 if cause is None else self.skipped_in_row + 1
        if cause is not None:
            self.refused_steps += 1
            self.last_cause = cause
        return cause

    def _precheck(self, lr: float, grad_norm: float, loss: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "non-finite loss or gradient"
        if not math.isfinite(lr):
            return f"learning rate is {lr}, must be finite"
        if not 0.0 <= lr <= self.max_lr:
            return f"learning rate is {lr:g}, must be in [0, max_lr={self.max_lr:g}]"
        return None

    def _protected(self, session: GuardedSession, apply: Callable[[], None]) -> str | None:
        self.protected_steps += 1
        saved = session.save_step_state()
        apply()
        largest, change, size, count = session.measure_step(saved)
        cause = self.sizes.judge(largest=largest, change=change, size=size, count=count, update_jump=self.update_jump)
        if cause is not None:
            session.restore_step_state(saved)
        return cause

    # ------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """The update-size history, which a saved device folder keeps so a resumed run decides alike."""
        return {"sizes": self.sizes.state_dict(), "steps_seen": self.steps_seen, "stepped_lr": self.stepped_lr}

    def load_state_dict(self, state: Any, *, where: str = "the guard state") -> None:
        """Restore :meth:`state_dict` (validated first: ``ValueError`` naming the field, nothing changed)."""
        if not isinstance(state, dict) or set(state) - {"stepped_lr"} != {"sizes", "steps_seen"}:
            raise ValueError(f"{where} must be an object with keys ['sizes', 'steps_seen'] (and 'stepped_lr')")
        sizes = StepSizeHistory.parse_state(state["sizes"], where)
        seen, stepped = state["steps_seen"], state.get("stepped_lr")  # states saved before it had none: the next step is protected
        if isinstance(seen, bool) or not isinstance(seen, int) or not 0 <= seen <= 2**53:
            raise ValueError(f"{where}: `steps_seen == {seen!r}`, must be an int in [0, 2**53]")
        if stepped is not None and (isinstance(stepped, bool) or not isinstance(stepped, (int, float)) or not 0 <= stepped <= self.max_lr):
            raise ValueError(f"{where}: `stepped_lr == {stepped!r}`, must be null or a number in [0, max_lr]")
        self.sizes.load_state_dict(sizes)
        self.steps_seen = seen
        self.stepped_lr = None if stepped is None else float(stepped)


def check_finite_outputs(outputs: np.ndarray, guard: DeviceUpdateGuard) -> None:
    """:class:`~taste_cl.exceptions.NonFiniteOutputError` when ``outputs`` (rows first) hold NaN or infinity:
    a device learner's ``predict`` never returns them."""
    bad = ~np.isfinite(outputs)
    if bad.any():
        rows = int(bad.reshape(outputs.shape[0], -1).any(axis=1).sum())
        raise NonFiniteOutputError(
            f"the model computes NaN or infinite outputs for {rows} of {outputs.shape[0]} rows: its weights are damaged "
            f"or overflow on this input; the guard refused {guard.refused_steps} step(s) since load (last: {guard.last_cause}); "
            "resume from an earlier saved folder"
        )
