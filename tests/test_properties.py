"""Property-based bad input (hypothesis): every call succeeds or raises the documented error,
and a rejected call leaves the learner bit-identical.

The default run keeps ``max_examples`` small; ``pytest -m slow`` runs the same properties
with many more examples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import batch, snapshot, tiny_learner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from taste_cl import ClassBalancedReplay, InvalidBatchError, ReservoirReplay

FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.int8, np.bool_, np.complex64]
SPECIALS = [0.0, np.nan, np.inf, -np.inf, 1e30, -1e30, 1e300, 3e38, 1e-45]


@st.composite
def arrays(draw, *, clean: bool, feature_shape: tuple[int, ...] = (4,)) -> np.ndarray:
    """Feature batches: valid ones when ``clean`` (any numeric dtype, huge finite values),
    otherwise wrong shapes, dtypes, emptiness and NaN/inf mixed in."""
    n = draw(st.integers(1, 12) if clean else st.sampled_from([0] + list(range(1, 13)) * 3))
    good = (n, *feature_shape)
    shape = good if clean else draw(st.sampled_from([good] * 8 + [(n,), (n, 5), (n, 2, 2), (n, 4, 1)]))
    dtype = draw(st.sampled_from(DTYPES[:7] if clean else [np.float32] * 6 + DTYPES))
    values = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=shape) * draw(st.sampled_from([1.0, 1e3]))
    flat = values.reshape(-1)
    spoiled = flat.size and draw(st.integers(0, 3)) == 0
    for index in draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=3)) if spoiled else []:
        flat[index] = draw(st.sampled_from(SPECIALS[-3:] if clean and dtype == np.float64 else [0.0, 1e4] if clean else SPECIALS))
    with np.errstate(all="ignore"):
        return values.astype(dtype)


@st.composite
def labels(draw, n: int, *, clean: bool) -> np.ndarray:
    if clean:
        y = np.random.default_rng(draw(st.integers(0, 2**16))).integers(0, 3, size=n)
        return y.astype(draw(st.sampled_from([np.int64, np.int32, np.int16, np.int8, np.uint8])))
    length = draw(st.sampled_from([n] * 6 + [max(n - 1, 0), n + 1]))
    low, high = draw(st.sampled_from([(0, 2)] * 6 + [(-1, 2), (0, 3), (-(2**40), 2**40)]))
    dtype = draw(st.sampled_from([np.int64] * 4 + [np.int32, np.uint8, np.float32, np.bool_]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    y = rng.integers(low, high + 1, size=length)
    with np.errstate(all="ignore"):
        return y.astype(dtype) if draw(st.integers(0, 5)) else y.reshape(-1, 1).astype(dtype)


@st.composite
def batches(draw):
    """An ``(x, y)`` pair, valid or not, as numpy or torch, possibly non-contiguous, possibly a mapping."""
    clean = draw(st.booleans())
    x = draw(arrays(clean=clean))
    y = draw(labels(x.shape[0], clean=clean))
    kind = draw(st.sampled_from(["numpy", "torch", "torch_noncontiguous", "mapping"]))
    if kind == "numpy":
        return x, y
    tx, ty = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    if kind == "torch_noncontiguous" and tx.dim() == 2:
        tx = torch.from_numpy(np.ascontiguousarray(x.T).copy()).T  # same values, transposed strides
        assert not tx.is_contiguous() or tx.shape[0] <= 1 or tx.shape[1] <= 1
    return {"x": tx, "y": ty} if kind == "mapping" else (tx, ty)


def _warm_learner(**kwargs):
    learner = tiny_learner(**kwargs)
    for seed in range(3):
        learner.observe(batch(seed=seed))
    return learner


def _observe_property(bad) -> None:
    learner = _warm_learner()
    before = snapshot(learner)
    seen = learner.samples_seen
    try:
        stats = learner.observe(bad)
    except InvalidBatchError as error:
        event(f"observe rejected: {str(error).split(';')[0].split(' (')[0][:40]}")
        assert snapshot(learner) == before
        return
    event("observe accepted" + (" (update skipped: non-finite)" if stats.skipped else ""))
    assert learner.samples_seen == seen + stats.samples
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())


def _predict_property(bad) -> None:
    learner = _warm_learner()
    before = snapshot(learner)
    x = bad["x"] if isinstance(bad, dict) else bad[0]
    try:
        out = learner.predict(x)
    except InvalidBatchError:
        event("predict rejected")
    else:
        event("predict accepted")
        assert out.shape == (x.shape[0], 3)
    assert snapshot(learner) == before  # predict never changes state, accepted or not


def _replay_property(strategy_name: str, bad) -> None:
    strategy = {"reservoir": ReservoirReplay, "class_balanced": ClassBalancedReplay}[strategy_name](5, seed=0)
    strategy.add(*batch(4))
    before = strategy.state_dict()
    x, y = (bad["x"], bad["y"]) if isinstance(bad, dict) else bad
    x = torch.as_tensor(x) if isinstance(x, np.ndarray) else x
    y = torch.as_tensor(y) if isinstance(y, np.ndarray) else y
    try:
        strategy.add(x, y)
    except InvalidBatchError:
        event("replay add rejected")
        from taste_cl.testing import states_equal

        assert states_equal(strategy.state_dict(), before)
    else:
        event("replay add accepted")
    assert 1 <= len(strategy) <= strategy.capacity
    sx, sy = strategy.sample(3)
    assert sx.shape[1:] == (4,) and sy.dtype == torch.long


PROPERTIES = {"observe": _observe_property, "predict": _predict_property}


@pytest.mark.parametrize("name", PROPERTIES)
@FAST
@given(bad=batches())
def test_bad_input(name, bad):
    PROPERTIES[name](bad)


@pytest.mark.parametrize("strategy", ["reservoir", "class_balanced"])
@FAST
@given(bad=batches())
def test_replay_bad_input(strategy, bad):
    _replay_property(strategy, bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", PROPERTIES)
@SLOW
@given(bad=batches())
def test_bad_input_long(name, bad):
    PROPERTIES[name](bad)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["reservoir", "class_balanced"])
@SLOW
@given(bad=batches())
def test_replay_bad_input_long(strategy, bad):
    _replay_property(strategy, bad)
