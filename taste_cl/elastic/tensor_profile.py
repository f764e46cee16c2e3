"""The profile's data: :class:`TensorProfile`, its units and clocks, and its validating parser.

Both the profiler (:mod:`taste_cl.elastic.profiling`, which measures a profile) and the
cache (:mod:`taste_cl.elastic.cache`, which reads one back from disk) need the type and
its checks, and a checkpoint's elastic state holds one too; so they live here, importing
nothing else of the package, and every other module imports them one way.

A profile read back is untrusted (a cache file or checkpoint may be stale, truncated,
hand-edited or hostile): :func:`parse_profile` checks every field and raises
``ValueError`` naming the first bad one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["CLOCKS", "GRANULARITIES", "Clock", "Granularity", "TensorProfile", "check_clock", "check_granularity", "parse_profile"]

Granularity = Literal["tensor", "module"]
GRANULARITIES = ("tensor", "module")
Clock = Literal["wall", "cpu"]
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_MAX_UNITS = 100_000
_MAX_BYTES = 2**50  # a petabyte: larger "memory" is corruption


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"`granularity == {granularity!r}`, must be one of {GRANULARITIES}")


def check_clock(clock: str) -> None:
    if clock not in CLOCKS:
        raise ValueError(f"`clock == {clock!r}`, must be one of {tuple(CLOCKS)}")


@dataclass(frozen=True)
class TensorProfile:
    """Measured times (seconds) and memory (bytes) of one training step, per unit in execution order.

    ``act_grad_s[i]`` is the time to pass the gradient back through unit ``i``'s module and
    the parameter-free modules between the previous unit's module and it; it is spent
    only when some unit before ``i`` trains (0 for the second tensor of a module).
    ``*_ci`` are 95% confidence half-widths. ``param_bytes[i]`` is the unit's size (its
    gradient has the same size); ``input_bytes[i]`` what autograd keeps to compute its
    weight gradient; ``act_bytes[i]`` what it keeps to pass the gradient back through
    ``i``'s segment. ``tail_grad_s`` (CI ``tail_grad_ci``, memory ``tail_bytes``) is the
    backward through the modules after the last unit (a frozen head, a final activation),
    spent whenever any unit trains. ``backward_s`` is the measured full backward, for
    comparison with the model's ``full_step_s - forward_s``. ``noisy`` is True when
    ``max_rounds`` did not bring the confidence intervals under the tolerance.
    """

    units: list[str]
    weight_grad_s: list[float]
    act_grad_s: list[float]
    forward_s: float
    backward_s: float
    weight_grad_ci: list[float]
    act_grad_ci: list[float]
    forward_ci: float
    param_bytes: list[int]
    input_bytes: list[int]
    act_bytes: list[int]
    granularity: str = "tensor"
    rounds: int = 0
    noisy: bool = False
    clock: str = "wall"
    tail_grad_s: float = 0.0
    tail_grad_ci: float = 0.0
    tail_bytes: int = 0

    def step_s(self, selected: Sequence[int]) -> float:
        """Predicted forward + backward time when only the units at ``selected`` train."""
        if not selected:
            return self.forward_s
        earliest = min(selected)
        backward = sum(self.weight_grad_s[i] for i in selected) + sum(self.act_grad_s[earliest + 1 :]) + self.tail_grad_s
        return self.forward_s + backward

    @property
    def full_step_s(self) -> float:
        """Predicted step time with every unit trainable."""
        return self.step_s(range(len(self.units)))

    def memory_bytes(self, selected: Sequence[int], state_factor: float) -> int:
        """Estimated training memory of ``selected``: kept activations + gradients + optimizer state.

        ``state_factor`` is the optimizer state per parameter byte (SGD with momentum 1, Adam 2).
        """
        if not selected:
            return 0
        earliest = min(selected)
        own = sum(self.input_bytes[i] + self.param_bytes[i] * (1 + state_factor) for i in selected)
        return int(own + sum(self.act_bytes[earliest + 1 :]) + self.tail_bytes)

    def relative_noise(self, *, min_share: float = 0.05) -> float:
        """Largest CI half-width over estimate among components worth ``min_share`` of a full step."""
        full = self.full_step_s
        pairs = [(self.forward_s, self.forward_ci), (self.tail_grad_s, self.tail_grad_ci)]
        pairs += list(zip(self.weight_grad_s, self.weight_grad_ci)) + list(zip(self.act_grad_s, self.act_grad_ci))
        worst = [ci / t for t, ci in pairs if t > 0 and t >= min_share * full]
        return max(worst, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_cut_costs(
        cls, units: Sequence[str], act_grad_s: Sequence[float], fixed_s: float, *, granularity: str = "tensor", clock: str = "wall"
    ) -> TensorProfile:
        """The profile a device's cut costs (:func:`taste_cl.engine.elastic.cut_costs`) amount to: no weight-gradient
        cost (a cut's graph computes every later tensor's gradient anyway), ``act_grad_s`` between cuts and ``fixed_s``
        as the forward; memory unknown (0). :meth:`~taste_cl.elastic.ElasticTrainer.use_costs` selects with it as the
        device does. ``ValueError`` naming a bad field."""
        n = len(units)
        zeros = [0.0] * n
        return parse_profile({
            "units": list(units), "weight_grad_s": zeros, "act_grad_s": list(act_grad_s), "forward_s": fixed_s,
            "backward_s": float(sum(act_grad_s)), "weight_grad_ci": zeros, "act_grad_ci": zeros, "forward_ci": 0.0,
            "param_bytes": [0] * n, "input_bytes": [0] * n, "act_bytes": [0] * n, "granularity": granularity, "rounds": 0,
            "noisy": False, "clock": clock,
        })  # fmt: skip

    @classmethod
    def from_dict(cls, state: Any) -> TensorProfile:
        """Parse and validate a :meth:`to_dict` value; raise ``ValueError`` naming the bad field."""
        return parse_profile(state)


def _field(state: dict[str, Any], name: str) -> Any:
    if name not in state:
        raise ValueError(f"profile field `{name}` is missing")
    return state[name]


def _number(name: str, value: Any, *, upper: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 <= value <= upper):
        raise ValueError(f"profile field `{name} == {value!r}`, must be a finite number >= 0 and <= {upper}")
    return float(value)


def _numbers(state: dict[str, Any], name: str, n: int, *, integer: bool = False) -> list[Any]:
    values = _field(state, name)
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"profile field `{name}` must be a list of {n} numbers; got {type(values).__name__}")
    if integer:
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_BYTES]
        if bad:
            raise ValueError(f"profile field `{name}` must hold ints in [0, {_MAX_BYTES}]; got {bad[0]!r}")
        return list(values)
    return [_number(name, v, upper=1e6) for v in values]


def parse_profile(state: Any) -> TensorProfile:
    """A :class:`TensorProfile` from untrusted plain values; ``ValueError`` naming the first bad field."""
    if not isinstance(state, dict):
        raise ValueError(f"a profile must be a JSON object; got {type(state).__name__}")  # noqa: TRY004 (documented: corrupt cache -> ValueError)
    units = _field(state, "units")
    if not isinstance(units, list) or not 0 < len(units) <= _MAX_UNITS or not all(isinstance(u, str) for u in units):
        raise ValueError("profile field `units` must be a non-empty list of strings")
    if len(set(units)) != len(units):
        raise ValueError("profile field `units` holds duplicate names")
    granularity = _field(state, "granularity")
    if granularity not in GRANULARITIES:
        raise ValueError(f"profile field `granularity == {granularity!r}`, must be one of {GRANULARITIES}")
    rounds = _field(state, "rounds")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"profile field `rounds == {rounds!r}`, must be an int >= 0")
    noisy = _field(state, "noisy")
    if not isinstance(noisy, bool):
        raise ValueError(f"profile field `noisy == {noisy!r}`, must be a bool")  # noqa: TRY004
    clock = state.get("clock", "wall")  # checkpoints from before clocks were named: wall
    if clock not in CLOCKS:
        raise ValueError(f"profile field `clock == {clock!r}`, must be one of {tuple(CLOCKS)}")
    n = len(units)
    tail_bytes = state.get("tail_bytes", 0)  # profiles from before tails were measured: none
    if isinstance(tail_bytes, bool) or not isinstance(tail_bytes, int) or not 0 <= tail_bytes <= _MAX_BYTES:
        raise ValueError(f"profile field `tail_bytes == {tail_bytes!r}`, must be an int in [0, {_MAX_BYTES}]")
    return TensorProfile(
        units=list(units),
        weight_grad_s=_numbers(state, "weight_grad_s", n),
        act_grad_s=_numbers(state, "act_grad_s", n),
        forward_s=_number("forward_s", _field(state, "forward_s"), upper=1e6),
        backward_s=_number("backward_s", _field(state, "backward_s"), upper=1e6),
        weight_grad_ci=_numbers(state, "weight_grad_ci", n),
        act_grad_ci=_numbers(state, "act_grad_ci", n),
        forward_ci=_number("forward_ci", _field(state, "forward_ci"), upper=1e6),
        param_bytes=_numbers(state, "param_bytes", n, integer=True),
        input_bytes=_numbers(state, "input_bytes", n, integer=True),
        act_bytes=_numbers(state, "act_bytes", n, integer=True),
        granularity=granularity,
        rounds=rounds,
        noisy=noisy,
        clock=clock,
        tail_grad_s=_number("tail_grad_s", state.get("tail_grad_s", 0.0), upper=1e6),
        tail_grad_ci=_number("tail_grad_ci", state.get("tail_grad_ci", 0.0), upper=1e6),
        tail_bytes=tail_bytes,
    )
