"""Contract checks users run on their own extensions (and the test suite runs on built-ins).

>>> from taste_cl import ReservoirReplay
>>> from taste_cl.testing import check_replay_strategy
>>> check_replay_strategy(ReservoirReplay(capacity=8))
"""

from __future__ import annotations

from typing import Any

import torch

from taste_cl._batch import batch_len, describe, index_batch, leaves, map_leaves
from taste_cl.engine.check import check_engine
from taste_cl.exceptions import InvalidBatchError
from taste_cl.replay import ReplayStrategy
from taste_cl.state.checkpoint import decode_state, encode_state

__all__ = ["check_engine", "check_replay_strategy", "states_equal"]


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


def _features(n: int, n_features: int, structured: bool, generator: torch.Generator) -> Any:
    feats = torch.randn(n, n_features, generator=generator)
    if not structured:
        return feats
    return {"feats": feats, "tokens": torch.randint(0, 50, (n, 3), generator=generator)}


def _rows(x: Any, y: torch.Tensor) -> list[tuple[float, ...]]:
    """One hashable row per sample: every leaf's values, then the label."""
    flat = torch.cat([leaf.reshape(leaf.shape[0], -1).double() for leaf in leaves(x)] + [y.reshape(-1, 1).double()], dim=1)
    return [tuple(row) for row in flat.tolist()]


def check_replay_strategy(strategy: ReplayStrategy, *, n_features: int = 4, n_classes: int = 3, structured: bool = False) -> None:
    """Raise ``AssertionError`` naming the rule an empty ``strategy`` breaks.

    Checked: starts empty; ``len`` stays within ``capacity``; ``add`` does not modify its
    inputs; ``sample`` returns at most ``n`` fresh copies of stored samples (with the
    structure and per-leaf dtypes they were added with); the state survives the checkpoint
    codec (tensors and plain values only) and restoring it replays the same samples; a
    malformed batch raises :class:`InvalidBatchError` and changes nothing.
    ``structured=True`` adds samples whose ``x`` is a dict of a float and an integer tensor.
    """
    if not isinstance(strategy, ReplayStrategy):
        raise TypeError(f"expected a ReplayStrategy; got {type(strategy).__name__}")
    if len(strategy) != 0:
        raise _fail(strategy, "a new strategy must be empty")
    generator = torch.Generator().manual_seed(0)
    n = 2 * strategy.capacity + 3
    x = _features(n, n_features, structured, generator)
    y = torch.randint(0, n_classes, (n,), generator=generator)
    x_copy, y_copy = map_leaves(torch.clone, x), y.clone()
    for start in range(0, n, 5):
        strategy.add(index_batch(x, slice(start, start + 5)), y[start : start + 5])
    if not (states_equal(x, x_copy) and torch.equal(y, y_copy)):
        raise _fail(strategy, "add() modified its input tensors")
    if not 1 <= len(strategy) <= strategy.capacity:
        raise _fail(strategy, f"len() is {len(strategy)} after {n} adds; must be in [1, capacity={strategy.capacity}]")

    k = min(4, len(strategy))
    sx, sy = strategy.sample(k)
    if describe(sx) != describe(x) or [t.dtype for t in leaves(sx)] != [t.dtype for t in leaves(x)]:
        raise _fail(strategy, f"sample() returned x of {describe(sx)}, added {describe(x)} (structure, shapes, dtypes)")
    if batch_len(sx) != k or sy.shape != (k,) or sy.dtype != torch.long:
        raise _fail(strategy, f"sample({k}) returned {batch_len(sx)} samples and labels of shape {tuple(sy.shape)}, dtype {sy.dtype}")
    added = set(_rows(x, y))
    if any(row not in added for row in _rows(sx, sy)):
        raise _fail(strategy, "sample() returned a sample (or label) that was never added")
    if strategy.sample(10 * strategy.capacity)[1].shape[0] > len(strategy):
        raise _fail(strategy, "sample(n) returned more samples than are stored")

    state = strategy.state_dict()
    for leaf in leaves(sx):
        leaf.add_(1)  # must not reach the store
    restored = decode_state(encode_state(state))
    if not states_equal(strategy.state_dict(), state):
        raise _fail(strategy, "sample() returned views into the store, or sampling changed stored data")
    first = strategy.sample(k)
    strategy.load_state_dict(restored)
    second = strategy.sample(k)
    if not (states_equal(first[0], second[0]) and torch.equal(first[1], second[1])):
        raise _fail(strategy, "after load_state_dict(state_dict()) sampling did not repeat (is the RNG state saved?)")

    before = strategy.state_dict()
    short = _features(3, n_features, structured, generator)
    if structured:
        short["tokens"] = short["tokens"][:2]  # leaves of different lengths
    try:
        strategy.add(short, torch.zeros(2 if not structured else 3, dtype=torch.long))
    except InvalidBatchError:
        pass
    else:
        raise _fail(strategy, "add() accepted x and y (or x's leaves) of different lengths; raise InvalidBatchError")
    if not states_equal(strategy.state_dict(), before):
        raise _fail(strategy, "a rejected add() changed the state")
