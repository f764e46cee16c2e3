"""The loop written once over the engine interface (taste_cl.engine.loop), run here on torch eager."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from taste_cl.datasets import split_digits
from taste_cl.engine import check_engine
from taste_cl.engine.loop import EngineLearner
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.exceptions import InvalidBatchError, NonFiniteOutputError


def _engine(seed: int = 0, momentum: float = 0.0) -> TorchEngine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum))


def _stream(tasks, batch: int = 10):
    for task in tasks:
        for rows in torch.arange(len(task.y_train)).split(batch):
            yield task.x_train[rows].numpy(), task.y_train[rows].numpy()


@pytest.fixture(scope="module")
def tasks():
    return split_digits(5, seed=0)


def _accuracy(learner: EngineLearner, tasks) -> float:
    x = np.concatenate([t.x_test.numpy() for t in tasks])
    y = np.concatenate([t.y_test.numpy() for t in tasks])
    return float((learner.predict(x).argmax(1) == y).mean())


@pytest.mark.parametrize("strategy", ["er", "er_ace", "der++", "lwf"])
def test_every_strategy_learns_a_class_incremental_stream_and_replays_the_same_rows_twice(strategy, tasks):
    runs = []
    for _ in range(2):
        learner = EngineLearner(_engine(), lr=0.1, num_classes=10, strategy=strategy, replay="class_balanced", lwf_every=20, seed=3)
        for x, y in _stream(tasks):
            learner.observe(x, y)
        runs.append(learner)
    first, second = runs
    assert len(first.replay_draws) > 100 and all(np.array_equal(a, b) for a, b in zip(first.replay_draws, second.replay_draws))
    assert all(np.array_equal(a, b) for a, b in zip(first.engine.parameters().values(), second.engine.parameters().values()))
    assert _accuracy(first, tasks) > 0.5  # plain SGD without replay ends near 0.2 (the last task only)


def test_without_replay_the_stream_forgets(tasks):
    learner = EngineLearner(_engine(), lr=0.1, num_classes=10, replay=None)
    for x, y in _stream(tasks):
        learner.observe(x, y)
    assert _accuracy(learner, tasks) < 0.35


def test_a_poisoned_step_is_refused_and_undone_bit_for_bit(tasks):
    learner = EngineLearner(_engine(momentum=0.9), lr=0.1, num_classes=10, seed=1)
    stream = list(_stream(tasks[:1]))
    for x, y in stream[:10]:
        learner.observe(x, y)
    before = learner.engine.parameters(), learner.engine.optimizer_state()
    learner.lr = 1e5
    stats = learner.observe(*stream[10])
    assert stats.refused == 1 and stats.steps == 0 and learner.guard.refused_steps == 1
    after = learner.engine.parameters(), learner.engine.optimizer_state()
    assert all(np.array_equal(before[i][k], after[i][k]) for i in range(2) for k in before[i])
    learner.lr = 0.1
    assert learner.observe(*stream[11]).steps == 1


def test_clipping_bounds_the_applied_update(tasks):
    learner = EngineLearner(_engine(), lr=1.0, num_classes=10, max_grad_norm=0.01, replay=None)
    x, y = next(_stream(tasks))
    before = learner.engine.parameters()
    learner.observe(x, y)
    after = learner.engine.parameters()
    moved = np.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))
    assert moved == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        (np.zeros((4, 64), dtype=np.float32), np.array([0, 1, 2, 10]), r"labels in \[0, 10\)"),
        (np.zeros((4, 64), dtype=np.float32), np.array([0.0, 1, 2, 3]), "integer labels"),
        (np.zeros((4, 64), dtype=np.float32), np.array([0, 1]), "one label per row"),
        (np.full((4, 64), np.nan, dtype=np.float32), np.array([0, 1, 2, 3]), "NaN"),
        (np.zeros((4, 32), dtype=np.float32), np.array([0, 1, 2, 3]), r"rows must have shape \(64,\)"),
    ],
)
def test_bad_batches_are_refused_before_anything_changes(x, y, match, tasks):
    learner = EngineLearner(_engine(), lr=0.1, num_classes=10)
    learner.observe(*next(_stream(tasks)))
    params, state, size = learner.engine.parameters(), learner.rng.bit_generator.state, len(learner.replay)
    with pytest.raises(InvalidBatchError, match=match):
        learner.observe(x, y)
    assert all(np.array_equal(params[k], v) for k, v in learner.engine.parameters().items())
    assert learner.rng.bit_generator.state == state and len(learner.replay) == size


def test_predict_raises_rather_than_returning_nan():
    learner = EngineLearner(_engine(), lr=0.1, num_classes=10)
    learner.engine.load_parameters({k: np.full_like(v, np.nan) for k, v in learner.engine.parameters().items()})
    with pytest.raises(NonFiniteOutputError, match="NaN or infinite outputs"):
        learner.predict(np.zeros((2, 64), dtype=np.float32))


def test_a_class_balanced_buffer_keeps_the_classes_even(tasks):
    learner = EngineLearner(_engine(), lr=0.1, num_classes=10, replay="class_balanced", capacity=50)
    for x, y in _stream(tasks):
        learner.observe(x, y)
    assert learner.replay is not None
    counts = np.bincount(learner.replay.rows(np.arange(len(learner.replay)))[1], minlength=10)
    assert counts.sum() == 50 and counts.max() - counts.min() <= 1


# ------------------------------------------------------------------ the same loop on ONNX Runtime
@pytest.fixture(scope="module")
def onnx_folder(tmp_path_factory):
    pytest.importorskip("onnxscript")
    from taste_cl.adapters.onnx_engine.export import export_engine

    engine = _engine(momentum=0.9)
    folder = tmp_path_factory.mktemp("onnx_engine") / "mlp"
    export_engine(engine.model, torch.zeros(20, 64), folder, optimizer=engine.optimizer)
    return folder


def test_the_onnx_engine_keeps_the_engine_contract(onnx_folder):
    from taste_cl.adapters.onnx_engine.engine import OnnxEngine

    check_engine(OnnxEngine(onnx_folder), np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32))


@pytest.mark.parametrize("strategy", ["er", "er_ace", "der++", "lwf"])
def test_torch_and_onnx_runtime_run_the_same_stream_the_same_way(strategy, onnx_folder, tasks):
    """Same seeds: the same replay draws on both engines, and the same model within float error."""
    from taste_cl.adapters.onnx_engine.engine import OnnxEngine

    runs = {}
    for name, engine in (("torch", _engine(momentum=0.9)), ("onnxruntime", OnnxEngine(onnx_folder))):
        learner = EngineLearner(engine, lr=0.1, num_classes=10, strategy=strategy, replay="class_balanced", lwf_every=20, seed=5)
        for x, y in _stream(tasks[:3]):
            learner.observe(x, y)
        runs[name] = learner
    torch_run, device_run = runs["torch"], runs["onnxruntime"]
    assert all(np.array_equal(a, b) for a, b in zip(torch_run.replay_draws, device_run.replay_draws))
    for name, value in torch_run.engine.parameters().items():
        np.testing.assert_allclose(device_run.engine.parameters()[name], value, rtol=1e-3, atol=3e-4, err_msg=name)  # float32 drift over 30 observes
    assert abs(_accuracy(torch_run, tasks[:3]) - _accuracy(device_run, tasks[:3])) <= 0.01


# ------------------------------------------------------------------ save and resume
def _resumed_equals_uninterrupted(make_engine, tasks, strategy: str) -> None:
    stream = list(_stream(tasks[:2]))
    settings = {"lr": 0.1, "num_classes": 10, "strategy": strategy, "replay": "reservoir", "lwf_every": 10, "seed": 7}
    whole = EngineLearner(make_engine(), **settings)
    for x, y in stream[:30]:
        whole.observe(x, y)
    plain, arrays = whole.state()
    plain = json.loads(json.dumps(plain))  # plain values only
    for x, y in stream[30:50]:
        whole.observe(x, y)
    resumed = EngineLearner(make_engine(), **settings)
    resumed.load_state(plain, arrays)
    for x, y in stream[30:50]:
        resumed.observe(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(whole.replay_draws[-20:], resumed.replay_draws[-20:]))
    for name, value in whole.engine.parameters().items():
        assert np.array_equal(resumed.engine.parameters()[name], value), name


@pytest.mark.parametrize("strategy", ["der++", "lwf"])
def test_a_resumed_loop_continues_bit_for_bit_on_torch(strategy, tasks):
    _resumed_equals_uninterrupted(lambda: _engine(seed=1, momentum=0.9), tasks, strategy)


def test_a_resumed_loop_continues_bit_for_bit_on_onnx_runtime(onnx_folder, tasks):
    from taste_cl.adapters.onnx_engine.engine import OnnxEngine

    _resumed_equals_uninterrupted(lambda: OnnxEngine(onnx_folder), tasks, "der++")


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p, a: a.__setitem__("param.0.weight", np.full_like(a["param.0.weight"], np.nan)), "NaN or infinite"),
        (lambda p, a: a.__setitem__("replay.y", np.full_like(a["replay.y"], 12)), r"labels in \[0, 10\)"),
        (lambda p, a: p["replay"].__setitem__("size", 10**6), "size <= capacity"),
        (lambda p, a: p.__setitem__("rng", {"bit_generator": "MT19937"}), "`rng` is not a PCG64 state"),
        (lambda p, a: p.__setitem__("observes", -1), r"`observes == -1`"),
        (lambda p, a: a.pop("param.2.bias"), "this engine's trainable tensors"),
    ],
)
def test_a_damaged_saved_state_is_refused_and_nothing_changes(damage, match, tasks):
    learner = EngineLearner(_engine(), lr=0.1, num_classes=10, seed=2)
    for x, y in list(_stream(tasks[:1]))[:5]:
        learner.observe(x, y)
    plain, arrays = learner.state()
    damage(plain, arrays)
    before = learner.state()
    with pytest.raises(ValueError, match=match):
        learner.load_state(plain, arrays)
    after = learner.state()
    assert json.dumps(before[0]) == json.dumps(after[0])
    assert before[1].keys() == after[1].keys() and all(np.array_equal(before[1][k], after[1][k]) for k in before[1])


class _OneTensor:
    """A guarded session over one numpy parameter, whose step is whatever ``apply`` does to it."""

    def __init__(self) -> None:
        self.p = np.ones(100, np.float32)

    def save_step_state(self) -> np.ndarray:
        return self.p.copy()

    def measure_step(self, saved: np.ndarray):
        from taste_cl.guards.device import measure_arrays

        return measure_arrays([(saved, self.p)])

    def restore_step_state(self, saved: np.ndarray) -> None:
        self.p = saved.copy()


def test_a_step_at_a_new_learning_rate_is_measured_even_when_its_gradient_is_tiny():
    """A momentum buffer moves at the new rate: lr x gradient does not bound the step, so, as the torch guard
    does, the device guard measures the first step at a changed learning rate (it used to apply it unmeasured)."""
    from taste_cl.guards.device import DeviceUpdateGuard

    guard, session = DeviceUpdateGuard(), _OneTensor()

    def move(by: float):
        def apply() -> None:
            session.p = session.p + by

        return apply

    for _ in range(30):  # ordinary steps at lr 0.1
        assert guard.step(session, move(1e-3), lr=0.1, grad_norm=0.5, loss=1.0) is None
    before = session.p.copy()
    cause = guard.step(session, move(1e3), lr=1e4, grad_norm=1e-7, loss=1e-7)  # lr x 1e5, a momentum-sized step
    assert cause is not None and "rolled back" in cause
    np.testing.assert_array_equal(session.p, before)
    assert guard.step(session, move(1e-3), lr=0.1, grad_norm=0.5, loss=1.0) is None
