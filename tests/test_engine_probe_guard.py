"""The engine loop's probe guard (taste_cl.engine.probe_guard): torch's ProbeGuard rollbacks, on torch and on a device."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import edit_manifest, run_without_torch
from test_shared_draws import TASKS, mlp

from taste_cl import ClassBalancedReplay, OnlineLearner
from taste_cl.engine.loop import EngineLearner
from taste_cl.engine.probe_guard import LoopProbeGuard
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.exceptions import ExportError
from taste_cl.guards.probe import ProbeGuard

GUARD = {"window": 5, "max_drop": 0.1, "max_flip_rate": None, "probe_capacity": 100, "warmup": 2, "seed": 3}
HARMFUL = range(60, 65)  # the 13th window (observes 61-65): labels shifted by 3


def stream(count: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 10 from the five digits tasks in turn (all ten classes), one window's labels poisoned."""
    for i in range(start, start + count):
        task = TASKS[i % 5]
        rows = torch.arange(i // 5 * 10, i // 5 * 10 + 10) % task.y_train.shape[0]
        x, y = task.x_train[rows], task.y_train[rows]
        yield x, (y + 3) % 10 if i in HARMFUL else y


def torch_learner(model: torch.nn.Module) -> OnlineLearner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return OnlineLearner(model, optimizer=optimizer, replay=ClassBalancedReplay(50, seed=7), replay_batch_size=10, train_iterations=2,
                         plugins=[ProbeGuard(**GUARD)])  # fmt: skip


def loop_learner(model: torch.nn.Module) -> EngineLearner:
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return EngineLearner(engine, lr=0.05, num_classes=10, replay="class_balanced", capacity=50, replay_batch_size=10, train_iterations=2,
                         seed=7, probe_guard=LoopProbeGuard(**GUARD))  # fmt: skip


def run(learners: list[Any], batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        for learner in learners:
            learner.observe((x, y)) if isinstance(learner, OnlineLearner) else learner.observe(x.numpy(), y.numpy())


def rollbacks(learner: Any) -> list[int]:
    return [e.step for e in learner.monitor.events if e.name == "update_rolled_back"]


def assert_same_parameters(learner: OnlineLearner, loop: EngineLearner, atol: float = 1e-5) -> None:
    parameters = loop.engine.parameters()
    for name, value in learner.model.named_parameters():
        np.testing.assert_allclose(parameters[name], value.detach().numpy(), atol=atol, rtol=0)


def test_the_loop_rolls_back_the_windows_torch_rolls_back_and_ends_with_its_parameters() -> None:
    model = mlp()
    learner, loop = torch_learner(copy.deepcopy(model)), loop_learner(model)
    run([learner, loop], stream(100))
    assert rollbacks(learner) == [65]  # the poisoned window, and only it
    assert all(abs(a - b) <= 1 for a, b in zip(rollbacks(learner), rollbacks(loop))) and len(rollbacks(loop)) == 1
    guard, loop_guard = learner.plugins[0], loop.probe_guard
    assert isinstance(guard, ProbeGuard) and loop_guard is not None
    assert (loop_guard.windows, loop_guard.rollbacks) == (guard.windows, guard.rollbacks) == (20, 1)
    np.testing.assert_array_equal(loop_guard.probe.rows()[2], guard.state_dict()["probe"]["storage"]["fields"]["sid"].numpy())
    assert_same_parameters(learner, loop)


def test_a_loop_saved_mid_window_resumes_identically_and_a_bad_guard_state_changes_nothing() -> None:
    model = mlp()
    loop = loop_learner(copy.deepcopy(model))
    run([loop], stream(62))  # inside the poisoned window
    plain, arrays = loop.state()
    resumed = loop_learner(model)
    resumed.load_state(plain, arrays)
    run([loop, resumed], stream(38, 62))
    assert rollbacks(resumed) == rollbacks(loop) and len(rollbacks(loop)) == 1
    for name, value in loop.engine.parameters().items():
        np.testing.assert_array_equal(value, resumed.engine.parameters()[name])
    before = resumed.state()
    guard = plain["probe_guard"]
    bad = [
        ({**guard, "rollbacks": guard["windows"] + 1}, arrays, "probe_guard.rollbacks"),
        ({**guard, "pending": 3}, arrays, "probe_guard.pending"),
        ({**guard, "snapshot": {"replay": None, "rng": None}}, arrays, "probe_guard.snapshot"),
        (guard, {**arrays, "probe_guard.baseline.ids": arrays["probe_guard.baseline.ids"] + 10**6}, "probe_guard.baseline.ids"),
        (guard, {**arrays, "probe_guard.probe.y": arrays["probe_guard.probe.y"] + 10}, "probe_guard.probe.y"),
        (guard, {**arrays, "probe_guard.snapshot.param.0.weight": np.full((32, 64), np.nan, np.float32)}, "probe_guard.snapshot.param"),
        (guard, {k: v for k, v in arrays.items() if k != "probe_guard.snapshot.replay.y"}, "probe_guard.snapshot"),
        (None, arrays, "probe guard"),
    ]
    for saved_guard, saved, match in bad:
        with pytest.raises(ValueError, match=match):
            resumed.load_state({**plain, "probe_guard": saved_guard}, saved)
    after = resumed.state()
    assert after[0] == before[0] and all(np.array_equal(after[1][k], v) for k, v in before[1].items())


def test_an_export_goes_on_with_the_same_rollbacks_on_the_device_and_resumes_from_its_folder(tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from taste_cl.adapters.device import load_learner

    learner = torch_learner(mlp())
    run([learner], stream(52))
    with pytest.raises(ExportError, match="half done"):
        learner.export(tmp_path / "half", backend="onnx_engine")
    run([learner], stream(3, 52))
    device = load_learner(learner.export(tmp_path / "art", backend="onnx_engine"))
    assert device.probe_guard is not None and device.probe_guard.settings() == LoopProbeGuard(**GUARD).settings()
    run([learner, device], stream(7, 55))  # to observe 62, inside the poisoned window
    resumed = load_learner(device.save(tmp_path / "saved"))
    run([learner, device, resumed], stream(38, 62))
    assert rollbacks(learner) == [65]
    assert [s for s in rollbacks(device) if s > 55] == [s for s in rollbacks(resumed) if s > 55]
    assert all(abs(a - b) <= 1 for a, b in zip(rollbacks(learner), rollbacks(device))) and len(rollbacks(device)) == 1
    assert device.probe_guard.rollbacks == resumed.probe_guard.rollbacks == 1
    for name, value in device.engine.parameters().items():
        np.testing.assert_array_equal(value, resumed.engine.parameters()[name])
    for name, value in learner.model.named_parameters():
        np.testing.assert_allclose(device.engine.parameters()[name], value.detach().numpy(), atol=1e-4, err_msg=name)


def _guarded_folder(tmp_path: Path) -> Path:
    from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner

    learner = torch_learner(mlp())
    run([learner], stream(55))
    device = OnnxEngineLearner.from_artifacts(learner.export(tmp_path / "art", backend="onnx_engine"))
    run([device], stream(7, 55))  # a window half done: the folder holds its pending rows and snapshot
    return device.save(tmp_path / "saved")


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("settings.probe_guard.window", 0, "window"),
        ("settings.probe_guard.probe_capacity", 2**40, "probe_capacity"),
        ("loop.probe_guard", "x", "probe_guard"),
        ("loop.probe_guard.windows", -1, "windows"),
    ],
)
def test_hostile_guard_folders_are_refused_naming_the_field(tmp_path: Path, path: str, value: Any, match: str) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from taste_cl.adapters.device import load_learner
    from taste_cl.exceptions import ArtifactError

    folder = _guarded_folder(tmp_path)
    assert load_learner(folder).probe_guard is not None
    edit_manifest(folder, path, value)
    with pytest.raises(ArtifactError, match=match):
        load_learner(folder)


def test_the_loop_probe_guard_imports_and_runs_without_torch() -> None:
    code = (
        "import numpy as np\n"
        "from taste_cl.engine.probe_guard import LoopProbeGuard\n"
        "from taste_cl.guards.probe_rule import window_verdict\n"
        "g = LoopProbeGuard(window=2)\n"
        "print(g.settings()['window'], window_verdict({0: 1.0}, {0: True}, {0: 0.0}, {0: False}))"
    )
    result = run_without_torch(code, timeout=120)
    assert result.stdout.strip() == "2 (1.0, 1.0, 1)", result.stderr
