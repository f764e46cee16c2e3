"""Contract checks users run on their own extensions (and the test suite runs on built-ins).

>>> from taste_cl import ReservoirReplay
>>> from taste_cl.testing import check_replay_strategy
>>> check_replay_strategy(ReservoirReplay(capacity=8))
"""

from __future__ import annotations

from typing import Any

import torch

from taste_cl.checkpoint import decode_state, encode_state
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay import ReplayStrategy

__all__ = ["check_replay_strategy", "states_equal"]


def states_equal(a: Any, b: Any) -> bool:
    """Whether two state dicts are equal: same keys and structure, bit-identical tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _fail(strategy: ReplayStrategy, rule: str) -> AssertionError:
    return AssertionError(f"{type(strategy).__name__} breaks the ReplayStrategy contract: {rule}")


def check_replay_strategy(strategy: ReplayStrategy, *, n_features: int = 4, n_classes: int = 3) -> None:
    """Raise ``AssertionError`` naming the rule an empty ``strategy`` breaks.

    Checked: starts empty; ``len`` stays within ``capacity``; ``add`` does not modify its
    inputs; ``sample`` returns at most ``n`` fresh copies of stored samples; the state
    survives the checkpoint codec (tensors and plain values only) and restoring it replays
    the same samples;
    a malformed batch raises :class:`InvalidBatchError` and changes nothing.
    """
    if not isinstance(strategy, ReplayStrategy):
        raise TypeError(f"expected a ReplayStrategy; got {type(strategy).__name__}")
    if len(strategy) != 0:
        raise _fail(strategy, "a new strategy must be empty")
    generator = torch.Generator().manual_seed(0)
    n = 2 * strategy.capacity + 3
    x = torch.randn(n, n_features, generator=generator)
    y = torch.randint(0, n_classes, (n,), generator=generator)
    x_copy, y_copy = x.clone(), y.clone()
    for start in range(0, n, 5):
        strategy.add(x[start : start + 5], y[start : start + 5])
    if not (torch.equal(x, x_copy) and torch.equal(y, y_copy)):
        raise _fail(strategy, "add() modified its input tensors")
    if not 1 <= len(strategy) <= strategy.capacity:
        raise _fail(strategy, f"len() is {len(strategy)} after {n} adds; must be in [1, capacity={strategy.capacity}]")

    k = min(4, len(strategy))
    sx, sy = strategy.sample(k)
    if sx.shape != (k, n_features) or sy.shape != (k,) or sx.dtype != x.dtype or sy.dtype != torch.long:
        raise _fail(strategy, f"sample({k}) returned shapes {tuple(sx.shape)}, {tuple(sy.shape)} and dtypes {sx.dtype}, {sy.dtype}")
    rows = {tuple(row.tolist()) + (int(label),) for row, label in zip(x, y)}
    if any(tuple(row.tolist()) + (int(label),) not in rows for row, label in zip(sx, sy)):
        raise _fail(strategy, "sample() returned a sample (or label) that was never added")
    if strategy.sample(10 * strategy.capacity)[0].shape[0] > len(strategy):
        raise _fail(strategy, "sample(n) returned more samples than are stored")

    state = strategy.state_dict()
    sx.add_(1.0)  # must not reach the store
    restored = decode_state(encode_state(state))
    if not states_equal(strategy.state_dict(), state):
        raise _fail(strategy, "sample() returned views into the store, or sampling changed stored data")
    first = strategy.sample(k)
    strategy.load_state_dict(restored)
    second = strategy.sample(k)
    if not (torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])):
        raise _fail(strategy, "after load_state_dict(state_dict()) sampling did not repeat (is the RNG state saved?)")

    before = strategy.state_dict()
    try:
        strategy.add(torch.randn(3, n_features), torch.zeros(2, dtype=torch.long))
    except InvalidBatchError:
        pass
    else:
        raise _fail(strategy, "add() accepted x and y of different lengths; raise InvalidBatchError")
    if not states_equal(strategy.state_dict(), before):
        raise _fail(strategy, "a rejected add() changed the state")
