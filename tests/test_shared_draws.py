"""One seeded stream of replay decisions for every engine (taste_cl.replay.draws).

The torch learner's buffers and the device loop's buffer carry out the same decisions from the
same generator: the same seed replays the same rows on both for a whole stream, and a learner
exported to the device continues with exactly the draws the torch learner goes on to make.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import taste_cl.engine.loop
import taste_cl.replay.buffers
from taste_cl import ClassBalancedReplay, OnlineLearner, ReservoirReplay
from taste_cl.datasets import split_digits
from taste_cl.engine.loop import EngineLearner, LoopReplay
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.replay import draws
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF

TASKS = split_digits(5, seed=0)
STRATEGIES = {"er": ExperienceReplay, "er_ace": ERACE, "der++": lambda: DERPlusPlus(alpha=0.5, beta=1.0),
              "lwf": lambda: LwF(alpha=1.0, temperature=2.0, every=20)}  # fmt: skip
BUFFERS = {"reservoir": ReservoirReplay, "class_balanced": ClassBalancedReplay}


def batches(count: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of 10, the digits tasks in turn (40 batches each, cycling), from batch ``start``."""
    for i in range(start, start + count):
        task = TASKS[(i // 40) % len(TASKS)]
        rows = torch.arange(i % 40 * 10, i % 40 * 10 + 10) % task.y_train.shape[0]
        yield task.x_train[rows], task.y_train[rows]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def torch_learner(strategy: str, buffer: str, model: nn.Module) -> OnlineLearner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return OnlineLearner(
        model, optimizer=optimizer, replay=BUFFERS[buffer](50, seed=7), replay_batch_size=10, train_iterations=2, strategy=STRATEGIES[strategy]()
    )


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[np.ndarray]]:
    """Every replay draw, by who drew it: the torch buffers (``"torch"``) and the loop's (``"loop"``)."""
    calls: dict[str, list[np.ndarray]] = {"torch": [], "loop": []}

    def recording(who: str) -> Any:
        def draw(rng: np.random.Generator, size: int, n: int) -> np.ndarray:
            picked = draws.draw_rows(rng, size, n)
            calls[who].append(picked)
            return picked

        return draw

    monkeypatch.setattr(taste_cl.replay.buffers, "draw_rows", recording("torch"))
    monkeypatch.setattr(taste_cl.engine.loop, "draw_rows", recording("loop"))
    return calls


@pytest.mark.parametrize("buffer", list(BUFFERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_torch_learner_and_engine_loop_replay_the_same_rows_for_200_observes(
    recorded: dict[str, list[np.ndarray]], strategy: str, buffer: str
) -> None:
    model = mlp()
    learner = torch_learner(strategy, buffer, copy.deepcopy(model))
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    loop = EngineLearner(engine, lr=0.05, num_classes=10, strategy=strategy, replay=buffer, capacity=50, replay_batch_size=10,
                         train_iterations=2, alpha=1.0 if strategy == "lwf" else 0.5, temperature=2.0, lwf_every=20, seed=7)  # fmt: skip
    for x, y in batches(200):
        learner.observe((x, y))
        loop.observe(x.numpy(), y.numpy())
    assert len(recorded["torch"]) == len(recorded["loop"]) == 200 * 2 - 2  # every step but the first observe's two
    for step, (a, b) in enumerate(zip(recorded["torch"], recorded["loop"])):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
    assert loop.replay is not None and learner.replay is not None
    stored_x, stored_y, _ = learner.replay.contents()
    x, y, _ = loop.replay.rows(np.arange(len(loop.replay)))
    np.testing.assert_array_equal(y, stored_y.numpy())
    np.testing.assert_array_equal(x, stored_x.numpy())


def test_class_balanced_decisions_are_the_same_in_torch_and_numpy_storage() -> None:
    labels = [0, 0, 1, 0, 1, 1, 2, 0, 2, 1, 0, 2, 2, 1, 0, 3, 3, 0, 1, 2, 3, 1, 0, 2, 3, 3, 1, 0, 2, 1]
    buffer = ClassBalancedReplay(6, seed=0)
    loop = LoopReplay(6, "class_balanced", draws.new_rng(0))
    for start in range(0, 30, 5):
        x, y = torch.arange(start, start + 5.0).unsqueeze(1), torch.tensor(labels[start : start + 5])
        buffer.add(x, y)
        loop.add(x.numpy(), y.numpy(), np.zeros((5, 2), np.float32))
    stored_x, stored_y, _ = buffer.contents()
    x, y, _ = loop.rows(np.arange(len(loop)))
    assert x[:, 0].tolist() == stored_x[:, 0].tolist() and y.tolist() == stored_y.tolist()
    assert loop.counts()["slots"] == [s.tolist() for s in buffer.state_dict()["slots"]]


def test_adding_rows_at_once_or_in_parts_draws_the_same() -> None:
    whole, parts = ReservoirReplay(8, seed=2), ReservoirReplay(8, seed=2)
    x, y = torch.arange(40.0).unsqueeze(1), torch.arange(40) % 5
    whole.add(x, y)
    for rows in torch.arange(40).split(7):
        parts.add(x[rows], y[rows])
    assert whole.contents()[0].tolist() == parts.contents()[0].tolist()
    assert whole.sample(4)[0].tolist() == parts.sample(4)[0].tolist()


def test_generator_state_round_trips_and_hostile_states_are_refused() -> None:
    rng = draws.new_rng(11)
    rng.random(3)
    encoded = draws.encode_rng(rng)
    assert encoded.dtype == np.uint8 and encoded.shape == (draws.RNG_STATE_BYTES,)
    assert draws.decode_rng(encoded).random(4).tolist() == rng.random(4).tolist()
    even = encoded.copy()
    even[16] &= 0xFE  # PCG64's increment is always odd
    for bad, match in ((encoded[:-1], "37 bytes"), (encoded.astype(np.int16), "uint8"), (even, "increment")):
        with pytest.raises(ValueError, match=match):
            draws.decode_rng(bad)
    buffer = ReservoirReplay(4, seed=1)
    buffer.add(torch.randn(6, 2), torch.arange(6))
    state = buffer.state_dict()
    before = buffer.state_dict()
    with pytest.raises(ValueError, match="generator state is invalid"):
        buffer.load_state_dict({**state, "generator": torch.zeros(36, dtype=torch.uint8)})
    assert torch.equal(buffer.state_dict()["generator"], before["generator"])


def test_a_checkpoint_with_a_torch_generator_state_resumes_with_its_rows() -> None:
    """Buffers saved before the numpy generator held torch's state: the rows load, the draws start afresh."""
    buffer = ReservoirReplay(4, seed=1)
    buffer.add(torch.arange(6.0).unsqueeze(1), torch.arange(6))
    old = {**buffer.state_dict(), "generator": torch.Generator().manual_seed(1).get_state()}
    restored = ReservoirReplay(4, seed=1)
    restored.load_state_dict(old)
    assert restored.contents()[0].tolist() == buffer.contents()[0].tolist() and restored.seen == 6
    again = ReservoirReplay(4, seed=1)
    again.load_state_dict(old)
    assert restored.sample(2)[0].tolist() == again.sample(2)[0].tolist()  # deterministic from the saved bytes


@pytest.mark.parametrize("case", [("der++", "class_balanced"), ("er_ace", "reservoir")])
def test_an_exported_device_learner_continues_with_the_torch_learners_draws(
    recorded: dict[str, list[np.ndarray]], case: tuple[str, str], tmp_path: Any
) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from taste_cl.adapters.device import load_learner

    strategy, buffer = case
    learner = torch_learner(strategy, buffer, mlp())
    for x, y in batches(100):
        learner.observe((x, y))
    device = load_learner(learner.export(tmp_path / "art", backend="onnx_engine"))
    recorded["torch"].clear()
    for x, y in batches(100, start=100):
        learner.observe((x, y))
        device.observe(x.numpy(), y.numpy())
    assert len(recorded["loop"]) == len(recorded["torch"]) == 200
    for step, (a, b) in enumerate(zip(recorded["torch"], recorded["loop"])):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step} after the export")
    assert device.replay is not None and learner.replay is not None
    np.testing.assert_array_equal(device.replay.rows(np.arange(len(device.replay)))[1], learner.replay.contents()[1].numpy())
    for name, value in learner.model.named_parameters():  # SGD's momentum continues across the export (it used to restart there)
        np.testing.assert_allclose(device.engine.parameters()[name], value.detach().numpy(), atol=1e-4, err_msg=name)


def test_lwf_snapshots_on_the_monitors_drift_on_both_learners() -> None:
    """LwF(on_drift=True) without a period: torch snapshots on drift_detected, and so does the loop's monitor."""
    model, twin = mlp(), mlp()
    learner = OnlineLearner(twin, optimizer=torch.optim.SGD(twin.parameters(), lr=0.05), replay=None,
                            strategy=LwF(alpha=1.0, temperature=2.0, on_drift=True))  # fmt: skip
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loop = EngineLearner(engine, lr=0.05, num_classes=10, strategy="lwf", replay=None, lwf_every=None, lwf_on_drift=True)
    drifts = []
    loop.monitor.subscribe(lambda event: drifts.append(loop.observes), "drift_detected")
    for x, y in batches(120):
        learner.observe((x, y))
        loop.observe(x.numpy(), y.numpy())
    assert drifts and loop.teacher is not None
    for name, value in learner.model.named_parameters():
        np.testing.assert_allclose(loop.engine.parameters()[name], value.detach().numpy(), atol=1e-4, err_msg=name)
    with pytest.raises(ValueError, match="snapshot"):
        EngineLearner(engine, lr=0.05, num_classes=10, strategy="lwf", replay=None, lwf_every=None)
