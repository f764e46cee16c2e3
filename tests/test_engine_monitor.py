"""The engine loop's monitor (taste_cl.engine.monitor): the torch monitor's events at the same observes, on torch and on a device."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_without_torch
from test_shared_draws import batches, mlp, torch_learner

from taste_cl import OnlineLearner
from taste_cl.engine.loop import EngineLearner
from taste_cl.engine.monitor import LoopMonitor
from taste_cl.monitor.events import MonitorEvent
from taste_cl.engine.torch_engine import TorchEngine


def loop_learner(model: torch.nn.Module, **kwargs: Any) -> EngineLearner:
    """The engine loop with ``torch_learner``'s settings (ER, class-balanced replay of 50 seeded 7, SGD with momentum)."""
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    settings = {"lr": 0.05, "num_classes": 10, "strategy": "er", "replay": "class_balanced", "capacity": 50, "replay_batch_size": 10,
                "train_iterations": 2, "seed": 7} | kwargs  # fmt: skip
    return EngineLearner(engine, **settings)


def run(learners: list[Any], stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in stream:
        for learner in learners:
            learner.observe((x, y)) if isinstance(learner, OnlineLearner) else learner.observe(x.numpy(), y.numpy())


def assert_same_events(expected: list[MonitorEvent], got: list[MonitorEvent]) -> None:
    """The same events, in order, each within one observe of its twin."""
    assert [e.name for e in got] == [e.name for e in expected], (expected, got)
    assert all(abs(a.step - b.step) <= 1 for a, b in zip(expected, got)), (expected, got)


def test_the_loop_monitor_emits_the_torch_monitors_events_at_the_same_observes_and_keeps_its_probe() -> None:
    model = mlp()
    learner, loop = torch_learner("er", "class_balanced", copy.deepcopy(model)), loop_learner(model)
    run([learner, loop], batches(200))  # five tasks of two digits, a switch every 40 batches
    events = [(e.name, e.step) for e in loop.monitor.events]
    assert ("drift_detected", 41) in events and ("forgetting_rising", 140) in events  # after a switch, and once old classes fade
    assert_same_events(learner.monitor.events, loop.monitor.events)
    probe = learner.monitor.state_dict()["probe"]
    x, y, sid = loop.monitor.probe.rows()
    np.testing.assert_array_equal(y, probe["storage"]["y"].numpy())
    np.testing.assert_array_equal(sid, probe["storage"]["fields"]["sid"].numpy())
    np.testing.assert_array_equal(x, probe["storage"]["x"].numpy())
    assert loop.monitor.stability == pytest.approx(learner.monitor.stability)
    assert loop.monitor.forgetting == pytest.approx(learner.monitor.forgetting)
    assert loop.monitor.class_accuracy == pytest.approx(learner.monitor.report()["per_class_accuracy"])


def test_subscribers_hear_events_at_the_end_of_the_observe_and_refused_steps_are_numerical_faults() -> None:
    loop = loop_learner(mlp(), lr=1e7)  # above the guard's max_lr: every step is refused
    heard: list[MonitorEvent] = []
    unsubscribe = loop.monitor.subscribe(heard.append, "numerical_fault")
    run([loop], batches(2))
    assert [(e.name, e.step) for e in heard] == [("numerical_fault", 0)] * 2 + [("numerical_fault", 1)] * 2
    assert "max_lr" in heard[0].details["cause"]
    unsubscribe()
    run([loop], batches(1, 2))
    assert len(heard) == 4 and loop.monitor.event_counts["numerical_fault"] == 6
    with pytest.raises(ValueError, match="unknown event"):
        loop.monitor.subscribe(heard.append, "drift")


def test_a_resumed_loop_goes_on_with_the_same_events_and_a_bad_monitor_state_changes_nothing() -> None:
    model = mlp()
    loop = loop_learner(copy.deepcopy(model))
    run([loop], batches(70))
    plain, arrays = loop.state()
    resumed = loop_learner(model)
    resumed.load_state(plain, arrays)
    run([loop, resumed], batches(80, 70))
    assert resumed.monitor.events == loop.monitor.events and resumed.monitor.stability == loop.monitor.stability
    before = resumed.state()
    bad = [
        ({**plain["monitor"], "steps": -1}, arrays, "monitor.steps"),
        ({**plain["monitor"], "drift": {"n": 1}}, arrays, "monitor.drift"),
        ({**plain["monitor"], "forgetting": 2.0}, arrays, "monitor.forgetting"),
        (plain["monitor"], {**arrays, "monitor.probe.sid": np.zeros_like(arrays["monitor.probe.sid"])}, "monitor.probe.sid"),
        (plain["monitor"], {**arrays, "monitor.probe.y": arrays["monitor.probe.y"] + 10}, "monitor.probe.y"),
        ({**plain["monitor"], "probe": {**plain["monitor"]["probe"], "rng": {"bit_generator": "PCG64"}}}, arrays, "monitor.probe.rng"),
    ]
    for monitor, saved, match in bad:
        with pytest.raises(ValueError, match=match):
            resumed.load_state({**plain, "monitor": monitor}, saved)
    after = resumed.state()
    assert after[0] == before[0] and all(np.array_equal(after[1][k], v) for k, v in before[1].items())


def test_an_export_mid_stream_goes_on_with_the_same_events_on_the_device(tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from taste_cl.adapters.device import load_learner

    learner = torch_learner("er", "class_balanced", mlp())
    run([learner], batches(90))
    device = load_learner(learner.export(tmp_path / "art", backend="onnx_engine"))
    assert device.monitor.events == learner.monitor.events
    assert device.monitor.settings() == LoopMonitor(seed=learner.monitor.seed).settings()
    run([learner, device], batches(110, 90))
    assert_same_events(learner.monitor.events, device.monitor.events)
    assert [e.name for e in device.monitor.events if e.step > 90].count("drift_detected") >= 2
    sid = device.monitor.probe.rows()[2]
    np.testing.assert_array_equal(sid, learner.monitor.state_dict()["probe"]["storage"]["fields"]["sid"].numpy())
    resumed = load_learner(device.save(tmp_path / "saved"))
    assert resumed.monitor.events == device.monitor.events and resumed.monitor.probe.rows()[2].tolist() == sid.tolist()


def test_the_loop_monitor_imports_and_runs_without_torch() -> None:
    code = (
        "import numpy as np\n"
        "from taste_cl.engine.monitor import LoopMonitor\n"
        "m = LoopMonitor(eval_every=1)\n"
        "m.record(np.eye(2, dtype=np.float32), np.array([0, 1]), np.eye(2, dtype=np.float32))\n"
        "m.evaluate(lambda x: np.eye(2)[:len(x)])\n"
        "print(m.stability)"
    )
    result = run_without_torch(code, timeout=120)
    assert result.stdout.strip() == "1.0", result.stderr
