"""Elastic selection re-chosen on the device: an ElasticTrainer exported with ``backend="onnx_engine"`` keeps re-selecting
from the device's own measured costs and gradients, on pruned backward graphs that share one parameter store."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from helpers import edit_manifest, run_without_torch

from taste_cl import ElasticTrainer, OnlineLearner
from taste_cl.adapters.device.artifacts import MANIFEST_FILE
from taste_cl.adapters.onnx_engine.cuts import cut_groups, write_cuts
from taste_cl.adapters.onnx_engine.engine import OnnxEngine
from taste_cl.adapters.onnx_engine.export import export_engine
from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner
from taste_cl.datasets import split_digits
from taste_cl.elastic import TensorProfile
from taste_cl.elastic import select_tensors as torch_select
from taste_cl.engine.elastic import cut_costs, select_tensors
from taste_cl.exceptions import ArtifactError, ExportError

TASKS = split_digits(5)


class CutClock:
    """A clock that advances by the cost of the cut the engine trains on at each reading: a step on cut ``k`` measures ``costs[k]``."""

    def __init__(self, costs: list[float]) -> None:
        self.costs, self.now, self.engine = list(costs), 0.0, None

    def __call__(self) -> float:
        self.now += self.costs[self.engine.cut]  # type: ignore[attr-defined]
        return self.now


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def batches(task: int, n: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = TASKS[task].x_train, TASKS[task].y_train
    return [(x[s : s + 10], y[s : s + 10]) for s in range(start * 10, (start + n) * 10, 10)]


def elastic_learner(optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, **options: Any) -> tuple[OnlineLearner, ElasticTrainer]:
    model = mlp()
    elastic = ElasticTrainer(rho=0.5, reselect_every=3, cache_dir=None, warmup=0, repeats=2, **options)
    opt = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    learner = OnlineLearner(model, optimizer=opt, plugins=[elastic])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in batches(0, 3):
            learner.observe(batch)
    return learner, elastic


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnlineLearner, ElasticTrainer, Path]:
    learner, elastic = elastic_learner()
    folder = learner.export(tmp_path_factory.mktemp("elastic") / "device", backend="onnx_engine", batch_size=10)
    return learner, elastic, folder


def load(folder: Path, costs: list[float]) -> OnnxEngineLearner:
    clock = CutClock(costs)
    device = OnnxEngineLearner.from_artifacts(folder, timer=clock)
    clock.engine = device.onnx_engine
    return device


def observe(device: OnnxEngineLearner, task: int, n: int, start: int = 0) -> list[list[str]]:
    chosen = []
    for x, y in batches(task, n, start):
        device.observe(x.numpy(), y.numpy())
        assert device.elastic is not None
        chosen.append(list(device.elastic.selected))
    return chosen


def test_the_dynamic_programme_is_one_torch_free_function() -> None:
    assert torch_select is select_tensors
    act, fixed = cut_costs([5.0, 6.0, 2.0, 1.0], [0, 0, 1, 2, 3])  # a noisy later cut is flattened to the one before
    assert fixed == 1.0 and act == [0.0, 0.0, 0.0, 4.0, 1.0]  # earliest unit i costs fixed + sum(act[i + 1:])


@pytest.mark.parametrize("build, shape", [(mlp, (10, 64)), (cnn, (10, 1, 8, 8))])
def test_a_cut_computes_the_same_gradients_and_steps_only_its_tensors(build: Callable[[], nn.Module], shape: tuple[int, ...], tmp_path: Path) -> None:
    model = build()
    folder = export_engine(model, torch.rand(shape), tmp_path, optimizer="sgd", lr=0.1, momentum=0.9)
    units = [[name] for name, _ in model.named_parameters()]
    write_cuts(folder, cut_groups(units))
    engine = OnnxEngine(folder)
    assert len(engine.cuts) == 3 and engine.cuts[0] == engine.trainable
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    grad = np.random.default_rng(1).standard_normal((10, 10)).astype(np.float32)
    engine.forward(x, train=True)
    full = engine.backward(grad)
    last = units[-2][0]  # the head's weight, but not its bias
    assert engine.select([last]) == 2 and engine.cut == 2
    engine.forward(x, train=True)
    part = engine.backward(grad)
    assert list(part) == [last]
    np.testing.assert_allclose(part[last], full[last], rtol=1e-5, atol=1e-6)
    before, state = engine.parameters(), engine.optimizer_state()
    engine.step(part, 0.1)
    after, state_after = engine.parameters(), engine.optimizer_state()
    assert not np.array_equal(after[last], before[last])
    for name in engine.trainable:
        if name != last:
            assert np.array_equal(after[name], before[name]) and np.array_equal(state_after[f"momentum.{name}"], state[f"momentum.{name}"])
    with pytest.raises(ValueError, match="does not train"):
        engine.select(["nope"])


def test_export_carries_the_trainer_and_the_device_reselects_without_reexport(exported: tuple[OnlineLearner, ElasticTrainer, Path]) -> None:
    _, elastic, folder = exported
    files = {p.name for p in folder.iterdir()}
    assert {"backward.cut1.onnx", "backward.cut2.onnx"} <= files
    settings = json.loads((folder / MANIFEST_FILE).read_text())["settings"]["elastic"]
    assert settings["rho"] == 0.5 and settings["reselect_every"] == 3 and settings["names"] == elastic.profile_.units
    device = load(folder, [10.0, 4.0, 1.0])  # the first cut is expensive: rho 0.5 affords the second
    assert device.elastic is not None and device.elastic.probe_now
    chosen = observe(device, 1, 3)
    assert chosen[0] == device.elastic.names  # the probe trains everything
    assert chosen[1] == chosen[2] == device.elastic.names[2:] and device.elastic.cut == 1
    clock = device.elastic.timer
    clock.costs = [10.0, 9.0, 1.0]  # type: ignore[attr-defined]  # the second cut got slower: measured, then re-selected
    chosen = observe(device, 1, 9, start=3)
    assert chosen[-1] == ["4.weight", "4.bias"] and device.elastic.cut == 2
    assert device.elastic.probes >= 3


def test_units_without_importance_are_left_out(exported: tuple[OnlineLearner, ElasticTrainer, Path]) -> None:
    device = load(exported[2], [10.0, 4.0, 1.0])
    observe(device, 1, 1)
    assert device.elastic is not None
    everything = device.elastic.choose([1.0] * 6, 0.5)
    assert everything == device.elastic.names[2:]
    assert device.elastic.choose([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], 0.5) == ["2.weight", "4.weight", "4.bias"]


def test_the_device_selects_as_torch_does_with_the_same_costs_and_importance(exported: tuple[OnlineLearner, ElasticTrainer, Path]) -> None:
    _, elastic, folder = exported
    device = load(folder, [10.0, 7.0, 2.0])
    observe(device, 1, 1)
    assert device.elastic is not None and elastic.importance_ is not None
    costs = device.elastic.costs()
    assert costs is not None
    profile = TensorProfile.from_cut_costs(device.elastic.names, *costs)
    importance = [v * (1 + i % 3) for i, v in enumerate(elastic.importance_)]
    for rho in (0.3, 0.5, 0.8):
        elastic.importance_ = importance
        assert device.elastic.choose(importance, rho) == elastic.selection_for(profile, rho=rho)


def test_torch_trains_with_the_device_costs(exported: tuple[OnlineLearner, ElasticTrainer, Path]) -> None:
    learner, elastic = elastic_learner()
    profile = TensorProfile.from_cut_costs(elastic.profile_.units, [0.0, 0.0, 5.0, 0.0, 3.0, 0.0], 1.0)
    elastic.use_costs(profile)
    for batch in batches(1, 4):
        learner.observe(batch)
    assert elastic.fixed_costs and elastic.selected == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert elastic.timing_ is not None and elastic.timing_.scale == 1.0  # not corrected by torch's own step times
    assert elastic.state_dict()["fixed_costs"] is True


def test_save_and_resume_continue_identically(exported: tuple[OnlineLearner, ElasticTrainer, Path], tmp_path: Path) -> None:
    costs = [10.0, 4.0, 1.0]
    device = load(exported[2], costs)
    observe(device, 1, 4)
    saved = device.save(tmp_path / "saved")
    resumed = load(saved, costs)
    assert resumed.elastic is not None and device.elastic is not None
    assert resumed.elastic.state() == device.elastic.state()
    assert observe(resumed, 2, 7) == observe(device, 2, 7)
    assert resumed.elastic.state() == device.elastic.state()
    for name, value in device.engine.parameters().items():
        np.testing.assert_array_equal(resumed.engine.parameters()[name], value)
    for name, value in device.engine.optimizer_state().items():
        np.testing.assert_array_equal(resumed.engine.optimizer_state()[name], value)


def test_the_device_reselects_without_torch(exported: tuple[OnlineLearner, ElasticTrainer, Path]) -> None:
    script = """
        import sys, numpy as np
        from taste_cl.adapters.device import load_learner
        device = load_learner(sys.argv[1])
        rng = np.random.default_rng(0)
        for _ in range(5):
            device.observe(rng.random((10, 64), dtype=np.float32), rng.integers(0, 10, 10))
        print("torch" in sys.modules, device.elastic.probes, all(device.elastic.cut_seconds))
    """
    done = run_without_torch(script, str(exported[2]), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "2", "True"]


@pytest.mark.parametrize(
    "path, value, match",
    [
        ("elastic.selected", ["no.such"], "`selected`"),
        ("elastic.importance", [-1.0] * 6, "`importance`"),
        ("elastic.cut_seconds", [[1.0]], "`cut_seconds`"),
        ("elastic.steps", -3, "`steps"),
        ("elastic.drift_left", 99, "`drift_left"),
        ("elastic.probe_now", "yes", "`probe_now`"),
        ("settings.elastic.units", [["0.weight"]], "settings.elastic"),
        ("settings.elastic.rho", 2.0, "settings.elastic"),
        ("settings.elastic.reselect_every", 0, "settings.elastic.reselect_every"),
        ("settings.elastic.clock", ["wall"], "settings.elastic"),
    ],
)
def test_hostile_elastic_values_are_refused_naming_the_field(
    exported: tuple[OnlineLearner, ElasticTrainer, Path], tmp_path: Path, path: str, value: Any, match: str
) -> None:
    folder = load(exported[2], [3.0, 2.0, 1.0]).save(tmp_path / "copy")
    edit_manifest(folder, path, value)
    with pytest.raises(ArtifactError, match=match):
        OnnxEngineLearner.from_artifacts(folder)


def test_export_refuses_what_the_device_cycle_cannot_carry(tmp_path: Path) -> None:
    learner, _ = elastic_learner(lambda params: torch.optim.AdamW(params, lr=0.01))
    with pytest.raises(ExportError, match="SGD with dampening=0.*AdamW"):
        learner.export(tmp_path / "adam", backend="onnx_engine")
    learner, _ = elastic_learner(memory_budget_bytes=10**9)
    with pytest.raises(ExportError, match="memory_budget_bytes"):
        learner.export(tmp_path / "memory", backend="onnx_engine")
    assert not (tmp_path / "adam").exists() and not (tmp_path / "memory").exists()


def test_trainable_elastic_still_exports_its_selection_fixed(exported: tuple[OnlineLearner, ElasticTrainer, Path], tmp_path: Path) -> None:
    learner, elastic, _ = exported
    folder = learner.export(tmp_path / "fixed", backend="onnx_engine", trainable=elastic, batch_size=10)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert "elastic" not in manifest["settings"] and "elastic" not in manifest
    assert manifest["export"]["trainable_selection"]["source"] == "elastic"
    assert not any(p.name.startswith("backward.cut") for p in folder.iterdir())


@pytest.mark.slow
def test_bench_personalize_trains_elastic_on_the_device_beside_torch_under_device_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench's elastic device row: exported before the stream, re-selecting on the device, beside torch's elastic_0.5
    under the device's own measured costs (elastic_0.5_devcost); numbers only, no timing asserted."""
    pytest.importorskip("peft")
    from taste_cl.benchmarks import personalize

    tiny = [
        "--width", "4", "--pretrain-steps", "3", "--pretrain-samples", "64", "--users", "1", "--user-classes", "2",
        "--user-samples", "32", "--test-samples", "32", "--steps", "4", "--batch-size", "8", "--lrs", "0.01",
        "--reselect-every", "2", "--no-progress", "--backends", "none", "--methods", "full,elastic_0.5,elastic_0.5_devcost",
        "--device-methods", "full,elastic_0.5", "--out", str(tmp_path),
    ]  # fmt: skip
    assert personalize.main(tiny) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "personalize.json").read_text())
    assert "cut times" in out and result["device_costs"]["weight_grad_s"] == [0.0] * 14
    row = result["device"]["methods"]["elastic_0.5"]
    assert row["export"]["refused"] is None and row["devcost_gap_points"] is not None and row["speedup_vs_device_full"] > 0
    (user,) = result["device"]["per_user"]
    assert user["elastic_0.5"]["selected"] and set(user["elastic_0.5"]["selected"]) <= {n for n, _ in personalize.build_cnn(4).named_parameters()}
    assert any("elastic_0.5_devcost" in c["criterion"] for c in result["device"]["criteria"])
