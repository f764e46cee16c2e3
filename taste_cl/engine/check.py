"""``check_engine``: the contract every engine (:class:`~taste_cl.engine.base.Engine`) must keep.

Run it on an engine built for a small model and a batch ``x`` of its inputs; it raises
``AssertionError`` naming the broken rule. Torch-free, so device engines are checked on the
device's own runtime too. ``taste_cl.testing.check_engine`` is the same function.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from taste_cl.engine.base import Engine, Inputs

__all__ = ["check_engine"]


def _fail(engine: object, rule: str) -> AssertionError:
    return AssertionError(f"{type(engine).__name__} breaks the Engine contract: {rule}")


def _same(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def check_engine(engine: Engine, x: Inputs, *, seed: int = 0, rtol: float = 0.05) -> None:
    """Check ``engine`` on inputs ``x`` (a batch of at least 2 rows): names, copies, a
    deterministic evaluation forward, gradients that match finite differences of the
    outputs, steps that change the parameters, and a saved state that continues bit for bit.

    The finite-difference check assumes the training forward is deterministic (no dropout).
    """
    rng = np.random.default_rng(seed)
    names = engine.trainable
    if not isinstance(names, tuple) or not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise _fail(engine, f"`trainable` must be a non-empty tuple of distinct names; got {names!r}")
    params = engine.parameters()
    if set(params) != set(names):
        raise _fail(engine, f"parameters() must return exactly the trainable tensors; got {sorted(params)}")
    first = names[0]
    params[first][...] = np.nan  # a copy: this must not reach the engine
    if not np.isfinite(engine.parameters()[first]).all():
        raise _fail(engine, "parameters() must return copies, not views of the live tensors")
    params = engine.parameters()

    evaluated = engine.forward(x, train=False)
    if not np.array_equal(evaluated, engine.forward(x, train=False)) or not _same(params, engine.parameters()):
        raise _fail(engine, "forward(train=False) must be deterministic and change no parameter")
    outputs = engine.forward(x, train=True)
    if outputs.ndim < 2 or not np.isfinite(outputs).all():
        raise _fail(engine, f"forward(train=True) must return finite (rows, ...) outputs; got shape {outputs.shape}")
    direction = rng.standard_normal(outputs.shape).astype(outputs.dtype)
    grads = engine.backward(direction)
    if set(grads) != set(names) or any(grads[n].shape != params[n].shape for n in names):
        raise _fail(engine, "backward() must return one gradient per trainable tensor, shaped like it")
    if not all(np.isfinite(g).all() for g in grads.values()):
        raise _fail(engine, "backward() returned non-finite gradients on finite inputs")
    try:
        engine.backward(direction)
    except RuntimeError:
        pass
    else:
        raise _fail(engine, "a second backward() for one forward must raise RuntimeError (its activations are spent)")

    # d/de <direction, f(params + e * g)> at e = 0 is |g|^2: compare with central differences
    norm2 = sum(float(np.vdot(g, g)) for g in grads.values())
    if norm2 > 0:
        eps = 1e-2 / np.sqrt(norm2)

        def along(sign: float) -> float:
            engine.load_parameters({n: (params[n] + sign * eps * grads[n]).astype(params[n].dtype) for n in names})
            return float(np.vdot(direction.astype(np.float64), engine.forward(x, train=True).astype(np.float64)))

        numeric = (along(1.0) - along(-1.0)) / (2 * eps)
        engine.load_parameters(params)
        if not abs(numeric - norm2) <= rtol * norm2 + 1e-6:
            raise _fail(engine, f"backward() disagrees with finite differences of the outputs: {norm2:.6g} against {numeric:.6g}")
    if not _same(params, engine.parameters()):
        raise _fail(engine, "load_parameters() must restore the parameters exactly")

    before_state = engine.optimizer_state()
    engine.step(grads, 0.01)
    stepped = engine.parameters()
    if _same(params, stepped):
        raise _fail(engine, "step() with non-zero gradients changed no parameter")
    after_state = engine.optimizer_state()
    engine.step(grads, 0.01)
    second = engine.parameters()
    engine.load_parameters(stepped)
    engine.load_optimizer_state(after_state)
    engine.step(grads, 0.01)
    if not _same(second, engine.parameters()):
        raise _fail(engine, "a step after load_parameters() + load_optimizer_state() must continue bit for bit")
    engine.load_parameters(params)
    engine.load_optimizer_state(before_state)
    with tempfile.TemporaryDirectory() as folder:
        engine.save(folder)
        if not any(Path(folder).iterdir()):
            raise _fail(engine, "save() wrote nothing")
