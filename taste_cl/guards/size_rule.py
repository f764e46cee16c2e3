"""The update-size rule every learner's guard applies, in plain floats (no torch, no numpy).

The PyTorch learner's :class:`~taste_cl.guards.update.UpdateGuard` and the device learners'
:class:`~taste_cl.adapters.device.guard.DeviceUpdateGuard` decide with this one rule, so a step
is refused on a device exactly when it would be in torch.

A measured step's relative size is ``r = ||Δθ|| / max(||θ||, 0.1 sqrt(n))`` (θ: the ``n``
trained parameters; the floor keeps a zero-initialized model from dividing by 0). It is
refused when ``r > update_jump`` (no step is sanely 1000x the parameters' own norm) or, once
earlier steps were measured, when ``r > max(1, update_jump * typical)``, ``typical`` being the
geometric running mean of the measured healthy sizes. A step needs measuring (copy
protection) only when it may be unusual: learning rate x gradient norm over 10x its running
geometric mean, no typical size yet, or ``MEASURE_EVERY`` applied steps since the last
measured one (see :meth:`StepSizeHistory.usual`).

>>> history = StepSizeHistory()
>>> history.judge(largest=1.0, change=0.01, size=1.0, count=4, update_jump=1e3) is None
True
>>> history.judge(largest=1.0, change=5e4, size=1.0, count=4, update_jump=1e3)
'step changed the parameters by 5e+04 times their norm, over the limit of 1e+03 (rolled back)'
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MEASURE_EVERY", "StepSizeHistory", "log_clamped"]

NORM_FLOOR = 0.1  # parameter RMS below which a step's size is judged against this RMS instead
LOG_SANE_STEP = 0.0  # log of the relative step size that the relative test never refuses (1: the own norm)
LOG_PROXY_JUMP = math.log(10.0)  # LR x gradient norm this far above its running mean protects the step
MEASURE_EVERY = 50  # applied steps between measurements that keep the typical size current
LOG_ALPHA = 0.2  # weight of the newest value in the running means of log step size and log LR x gradient norm
_LOG_BOUND = 1e3  # a saved running mean of logs beyond this is not a log of a float


def log_clamped(value: float) -> float:
    """``log(value)`` with ``value`` clamped to [1e-30, 1e300]: finite for 0 and inf (NaN stays NaN)."""
    return math.log(min(max(value, 1e-30), 1e300)) if not math.isnan(value) else math.nan


def _moved(mean: float | None, value: float) -> float:
    """The running mean ``mean`` moved towards ``value`` (weight ``LOG_ALPHA``); ``value`` when there is none."""
    return value if mean is None else (1 - LOG_ALPHA) * mean + LOG_ALPHA * value


class StepSizeHistory:
    """Running means of log(LR x gradient norm) and of the log relative step size, and the
    applied steps since the last measured one: what the rule remembers between steps."""

    def __init__(self) -> None:
        self.log_proxy: float | None = None  # running mean of log(largest LR x gradient norm), applied steps
        self.log_size: float | None = None  # running mean of log relative step size, measured applied steps
        self.since_measure = 0  # applied steps since the last measured one

    def usual(self, log_proxy: float) -> bool:
        """Whether an ordinary-size step with this log(LR x gradient norm) may skip measuring: not 10x
        above its running mean, a typical size known and measured within ``MEASURE_EVERY`` steps."""
        return (
            self.log_proxy is not None
            and self.log_size is not None
            and log_proxy <= self.log_proxy + LOG_PROXY_JUMP
            and self.since_measure < MEASURE_EVERY
        )

    def limit(self, update_jump: float) -> float:
        """Log of the largest relative step size applied now."""
        log_jump = math.log(update_jump)
        if self.log_size is None:
            return log_jump
        return min(log_jump, max(LOG_SANE_STEP, log_jump + self.log_size))

    def judge(self, *, largest: float, change: float, size: float, count: int, update_jump: float) -> str | None:
        """Why a measured step must be undone, or None (then its size joins the typical size).

        ``largest``: the largest ``|θ|`` after the step (non-finite iff a parameter is);
        ``change`` and ``size``: the L2 norms of ``Δθ`` and of ``θ`` before the step; ``count``:
        the number of parameters.
        """
        ratio = change / max(size, NORM_FLOOR * math.sqrt(count))
        limit = self.limit(update_jump)
        if not math.isfinite(largest):
            return "non-finite parameters after the step (rolled back)"
        if not log_clamped(ratio) <= limit:  # NaN fails
            return f"step changed the parameters by {ratio:.3g} times their norm, over the limit of {math.exp(limit):.3g} (rolled back)"
        self.log_size = _moved(self.log_size, log_clamped(ratio))
        self.since_measure = 0
        return None

    def applied(self, log_proxy: float, *, measured: bool) -> None:
        """Note an applied step: its log(LR x gradient norm), and whether it was measured."""
        self.log_proxy = _moved(self.log_proxy, log_proxy)
        if not measured:
            self.since_measure += 1

    def state_dict(self) -> dict[str, Any]:
        return {"log_proxy": self.log_proxy, "log_size": self.log_size, "since_measure": self.since_measure}

    @staticmethod
    def parse_state(state: Any, where: str) -> dict[str, Any]:
        """Validate a :meth:`state_dict` (ValueError naming the field and ``where`` it was read)."""
        keys = {"log_proxy", "log_size", "since_measure"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"{where}: the update-size history must be an object with keys {sorted(keys)}")
        for key in ("log_proxy", "log_size"):
            value = state[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= _LOG_BOUND):
                raise ValueError(f"{where}: `{key} == {value!r}`, must be None or a number in [-1e3, 1e3] (a log)")
        count = state["since_measure"]
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 2**53:
            raise ValueError(f"{where}: `since_measure == {count!r}`, must be an int in [0, 2**53]")
        return {"log_proxy": _float_or_none(state["log_proxy"]), "log_size": _float_or_none(state["log_size"]), "since_measure": count}

    def load_state_dict(self, parsed: dict[str, Any]) -> None:
        """Apply what :meth:`parse_state` returned."""
        self.log_proxy, self.log_size, self.since_measure = parsed["log_proxy"], parsed["log_size"], parsed["since_measure"]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
