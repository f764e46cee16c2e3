"""Closing the loop: correct the profile's time model with the step times actually measured.

The profile times each unit alone, once; a real step also runs the optimizer, the
monitor and replay, and runs under whatever load the device has now. After each
reselection the measured step time is compared with the prediction, and a linear
correction is fitted online by ridge regression towards "the profile is right":

    measured(S) ~= overhead + forward_scale * forward + scale * sum_i s_i * cost_i(S)

with ``cost_i(S)`` unit ``i``'s share of the predicted step (its weight-gradient time if
it trains, plus its activation-gradient time if it lies after the earliest trainable
unit); the backward through the modules after the last unit (the profile's tail, spent
whenever anything trains) is under the global ``scale`` only. The forward pass costs the same for every selection, so step times alone cannot
tell it from the overhead; it is measured on its own every step
(:meth:`StepTimeModel.observe_forward`; each refit sets ``forward_scale`` to the median of
the latest ratios, so predictions change only at refits). ``overhead`` and the global backward ``scale`` are cheap to move (few
observations pin them); the per-unit scales ``s_i`` move only as residuals keep pointing
at the same units.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from taste_cl.elastic.tensor_profile import TensorProfile

__all__ = ["StepTimeModel"]

_PRIOR_WEIGHT = {"overhead": 0.05, "scale": 0.02, "unit": 0.5}
_SCALE_RANGE = (0.2, 5.0)


class StepTimeModel:
    """A profile plus online corrections; predicts measured step times of selections.

    All fitting is done in units of the profile's full step time, so the ridge penalties
    mean the same for every model size.
    """

    def __init__(self, profile: TensorProfile, *, max_observations: int = 64) -> None:
        self.profile = profile
        n = len(profile.units)
        self.max_observations = max_observations
        self.overhead = 0.0  # fraction of the profile's full step
        self.scale = 1.0
        self.unit_scale = np.ones(n)
        self.forward_scale = 1.0
        self._forward_ratios: list[float] = []
        self._features: list[np.ndarray] = []
        self._targets: list[float] = []
        self._full: float | None = None  # latest measured full step (probe steps), profile units

    def _costs(self, selected: Sequence[int]) -> tuple[float, float, np.ndarray]:
        """(forward, tail, per-unit cost vector) of ``selected``, in profile full-step units."""
        p, full = self.profile, self.profile.full_step_s
        costs = np.zeros(len(p.units))
        tail = 0.0
        if selected:
            earliest = min(selected)
            for i in selected:
                costs[i] += p.weight_grad_s[i]
            for i in range(earliest + 1, len(p.units)):
                costs[i] += p.act_grad_s[i]
            tail = p.tail_grad_s
        return p.forward_s / full, tail / full, costs / full

    def raw_prediction(self, selected: Sequence[int]) -> float:
        """Seconds the uncorrected profile predicts (forward + backward only)."""
        return self.profile.step_s(selected)

    def predict(self, selected: Sequence[int]) -> float:
        """Seconds the corrected model predicts for a whole measured step."""
        forward, tail, costs = self._costs(selected)
        backward = tail + float(costs @ self.unit_scale)
        return self.profile.full_step_s * (self.overhead + self.forward_scale * forward + self.scale * backward)

    def corrected_costs(self) -> tuple[float, float, list[float], list[float], float]:
        """(overhead_s, forward_s, weight_grad_s, act_grad_s, tail_grad_s) with the corrections applied."""
        p = self.profile
        scales = self.scale * self.unit_scale
        return (
            self.overhead * p.full_step_s,
            self.forward_scale * p.forward_s,
            [float(t * s) for t, s in zip(p.weight_grad_s, scales)],
            [float(t * s) for t, s in zip(p.act_grad_s, scales)],
            self.scale * p.tail_grad_s,
        )

    def _row(self, selected: Sequence[int]) -> np.ndarray:
        _, tail, costs = self._costs(selected)
        return np.concatenate([[1.0, tail + float(costs.sum())], costs])

    def observe_forward(self, measured_s: float) -> None:
        """Add one measured forward time (seconds). No refit: the next one sets ``forward_scale``
        to the median of the latest 15 ratios to the profile's forward time."""
        if np.isfinite(measured_s) and measured_s > 0 and self.profile.forward_s > 0:
            self._forward_ratios = [*self._forward_ratios[-14:], measured_s / self.profile.forward_s]

    def observe(self, selected: Sequence[int], measured_s: float) -> None:
        """Add one measured step time (seconds) of ``selected`` and refit."""
        if not np.isfinite(measured_s) or measured_s <= 0:
            return
        self._features.append(self._row(selected))
        self._targets.append(measured_s / self.profile.full_step_s)
        del self._features[: -self.max_observations], self._targets[: -self.max_observations]
        self._fit()

    def observe_full(self, measured_s: float) -> None:
        """Set the measured time of a step that trains every unit (the latest replaces the last) and refit."""
        if np.isfinite(measured_s) and measured_s > 0:
            self._full = measured_s / self.profile.full_step_s
            self._fit()

    def _fit(self) -> None:
        """Ridge regression towards the prior (overhead 0, scales 1) on the linearised model,
        the measured forward (``forward_scale``) taken off the targets first.

        Parameters: overhead, global backward scale g, and per-unit deltas d_i with
        s_i = 1 + d_i (the product g * s_i is linearised around g = s_i = 1).
        """
        if self._forward_ratios:
            self.forward_scale = float(np.clip(np.median(self._forward_ratios), *_SCALE_RANGE))
        rows, targets = list(self._features), list(self._targets)
        if self._full is not None:
            rows.append(self._row(range(len(self.profile.units))))
            targets.append(self._full)
        a = np.stack(rows)
        t = np.asarray(targets) - self.forward_scale * self.profile.forward_s / self.profile.full_step_s
        n = a.shape[1]
        prior = np.zeros(n)
        prior[1] = 1.0
        weights = np.full(n, _PRIOR_WEIGHT["unit"])
        weights[0], weights[1] = _PRIOR_WEIGHT["overhead"], _PRIOR_WEIGHT["scale"]
        lhs = a.T @ a + np.diag(weights)
        rhs = a.T @ t + weights * prior
        theta = np.linalg.solve(lhs, rhs)
        low, high = _SCALE_RANGE
        self.overhead = float(max(theta[0], 0.0))
        self.scale = float(np.clip(theta[1], low, high))
        self.unit_scale = np.clip(1.0 + theta[2:] / self.scale, low, high)
