"""Device step speed and exported selections: the in-place SGD of the ONNX Runtime learner,
``export(..., trainable=names | ElasticTrainer)`` on both backends, and ``taste-cl bench device``."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn


from taste_cl import OnlineLearner
from taste_cl.adapters.onnxruntime.build import export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.elastic import ElasticTrainer

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)
    )  # fmt: skip


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 8, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def _learner(plugins=(), frozen_first: bool = False) -> OnlineLearner:
    torch.manual_seed(0)
    model = _cnn()
    if frozen_first:
        model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return OnlineLearner(model, optimizer=optimizer, plugins=list(plugins), input_shape=(3, 8, 8), num_classes=4)


def _torch_train(model: nn.Module, names: list[str], batches, lr: float = 0.05) -> dict[str, np.ndarray]:
    """Torch training exactly ``names`` with the learner's SGD on ``batches``; the parameters after."""
    model = copy.deepcopy(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in names)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().numpy() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        {},
    ],
    ids=["momentum-dampening-decay", "nesterov-decay", "plain"],
)
def test_in_place_sgd_trains_like_torch_and_copies_no_weight(tmp_path: Path, settings: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **settings)
    batches = [(torch.randn(8, 12, generator=torch.Generator().manual_seed(s)), torch.arange(8) % 4) for s in range(5)]
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, batches[0], tmp_path / "art", verify=False)
    device = OrtOnlineLearner.from_artifacts(folder)
    state = device.session.state
    pointers = {name: state.get_parameter(name).data.data_ptr() for name in device.spec.trainable}
    for x, y in batches:
        device.train_step(x.numpy(), y.numpy())
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    got = device.parameters()
    for name, parameter in model.named_parameters():
        np.testing.assert_allclose(got[name], parameter.detach().numpy(), rtol=0, atol=2e-6)
    # the update wrote ONNX Runtime's own buffers: no parameter was reallocated or copied in
    assert pointers == {name: state.get_parameter(name).data.data_ptr() for name in device.spec.trainable}


def test_non_finite_gradient_skips_the_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 12), torch.arange(4)
    device = OrtOnlineLearner.from_artifacts(export_model(model, nn.CrossEntropyLoss(), optimizer, (x, y), tmp_path / "a", verify=False))
    before = device.parameters()
    huge = np.full((4, 12), 3e38, np.float32)  # finite input, infinite logits and gradients
    _, loss, skipped = device.train_step(huge, y.numpy())
    assert skipped and not np.isfinite(loss)
    assert all(np.array_equal(before[name], value) for name, value in device.parameters().items())
    assert not device.session.sgd_state  # no momentum buffer was started from the bad gradient


@pytest.mark.parametrize(
    ("trainable", "error", "match"),
    [
        (["2.weigth"], ValueError, r"'2\.weigth', which is not a parameter of the model \(did you mean '2\.weight'\?\)"),
        (["0.weight"], ValueError, r"'0\.weight', which the learner does not train \(requires_grad=False"),
        ([], ValueError, "selects no parameter"),
        ("2.weight", TypeError, "list of parameter names or an ElasticTrainer"),
        (ElasticTrainer(cache_dir=None), ValueError, "not attached to this learner"),
    ],
)
def test_trainable_refusals_leave_nothing(tmp_path: Path, trainable, error: type, match: str) -> None:
    learner = _learner(frozen_first=True)
    learner.observe(_batch(0))
    with pytest.raises(error, match=match):
        learner.export(tmp_path / "art", backend="onnxruntime", trainable=trainable)
    assert not (tmp_path / "art").exists()


def test_elastic_trainer_without_a_selection_is_refused(tmp_path: Path) -> None:
    elastic = ElasticTrainer(cache_dir=None)
    learner = _learner([elastic])
    with pytest.raises(ValueError, match="has selected nothing yet"):
        learner.export(tmp_path / "art", backend="onnxruntime", trainable=elastic)
    assert not (tmp_path / "art").exists()


def test_exported_names_train_alone_on_the_device_like_torch(tmp_path: Path) -> None:
    learner = _learner(frozen_first=True)  # not trained yet: no momentum to carry, so torch starts from the same state
    chosen = ["2.weight", "5.bias"]
    folder = learner.export(tmp_path / "art", backend="onnxruntime", trainable=chosen)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trainable"] == ["model.2.weight", "model.5.bias"]
    selection = manifest["trainable_selection"]
    assert selection["source"] == "names" and selection["trainable"] == chosen
    trained = {name: p.numel() for name, p in learner.model.named_parameters() if name != "0.weight" and name != "0.bias"}
    assert selection["parameter_share"] == pytest.approx((trained["2.weight"] + trained["5.bias"]) / sum(trained.values()))
    device = OrtOnlineLearner.from_artifacts(folder)
    before = device.parameters()
    batches = [_batch(10 + step) for step in range(3)]
    for x, y in batches:
        device.train_step(x.numpy(), y.numpy())
    after = device.parameters()
    assert sorted(name for name in before if not np.array_equal(before[name], after[name])) == sorted(chosen)
    expected = _torch_train(learner.model, chosen, batches)
    for name in chosen:
        np.testing.assert_allclose(after[name], expected[name], rtol=0, atol=1e-5)
    # the device's optimizer state is the selection's alone
    assert sorted(device.session.sgd_state) == ["model.2.weight", "model.5.bias"]


def _elastic_learner() -> tuple[OnlineLearner, ElasticTrainer]:
    elastic = ElasticTrainer(rho=0.5, reselect_every=2, cache_dir=None, warmup=1, repeats=2, max_rounds=4, check_steps=1, clock="cpu")
    learner = _learner([elastic])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no selection fits rho" on a tiny CNN: then every unit trains
        for step in range(8):
            learner.observe(_batch(step, 16))
            if elastic.selected:
                break
    assert elastic.selected
    return learner, elastic


def test_elastic_selection_exports_and_default_export_trains_every_unit(tmp_path: Path) -> None:
    from taste_cl.adapters.device.trainable import selected_parameters

    learner, elastic = _elastic_learner()
    names = selected_parameters(learner, elastic)
    folder = learner.export(tmp_path / "sel", backend="onnxruntime", trainable=elastic)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trainable"] == ["model." + name for name in names]
    assert manifest["trainable_selection"]["source"] == "elastic" and manifest["trainable_selection"]["rho"] == 0.5
    # without trainable=, the units the ElasticTrainer switched off for now still train on the device
    everything = json.loads((learner.export(tmp_path / "all", backend="onnxruntime") / "manifest.json").read_text())
    assert everything["trainable"] == ["model." + name for name, _ in learner.model.named_parameters()]
    assert "trainable_selection" not in everything


@pytest.mark.slow
def test_executorch_trains_only_the_exported_names(tmp_path: Path) -> None:
    pytest.importorskip("executorch.extension.training")
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    learner = _learner(frozen_first=True)
    chosen = ["2.weight", "5.bias"]
    folder = learner.export(tmp_path / "art", backend="executorch", trainable=chosen)
    assert json.loads((folder / "manifest.json").read_text())["trainable_selection"]["trainable"] == chosen
    device = EtOnlineLearner.from_artifacts(folder)
    assert sorted(device.parameters()) == sorted(chosen)
    batches = [_batch(10 + step) for step in range(3)]
    for x, y in batches:
        device.trainer.train_step(x.numpy(), y.numpy())
    expected = _torch_train(learner.model, chosen, batches)
    for name, value in device.parameters().items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-5)


def test_bench_device_reports_selection_memory_and_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taste_cl.cli import main

    argv = ["bench", "device", "--models", "mlp 64", "--backends", "onnxruntime", "--steps", "1", "--repeats", "1", "--tuner-calls", "3"]
    assert main([*argv, "--hog", "--rho", "0.8", "--out", str(tmp_path)]) == 0  # on ONNX Runtime the MLP's forward is over half a step
    saved = json.loads((tmp_path / "device_runtimes.json").read_text())
    assert saved["hog"] == 1 and saved["tuner_calls"] == 3
    (run,) = saved["runs"]
    assert run["selection"]["rho"] == 0.8 and 1 <= run["selection"]["tensors"] <= run["selection"]["of"] == 6
    facts = run["backends"]["onnxruntime"]
    assert facts["samples_per_s"] > 0 and facts["over_torch"] > 0 and facts["artifact_bytes"] > 0
    assert facts["selection"]["samples_per_s"] > 0 and facts["selection"]["over_all"] > 0
    assert set(run["rounds_samples_per_s"]) == {
        f"{runtime} {key}" for runtime in ("torch", "onnxruntime") for key in ("all", "selection", "ort costs")
    }
    costed = run["selection_ort_costs"]  # the selection budgeted with ONNX Runtime's own step costs, timed beside the others
    assert 1 <= costed["tensors"] <= 6 and costed["predicted_speedup"] >= 1 and 0 <= costed["importance_share"] <= 1
    assert facts["ort costs"]["samples_per_s"] > 0 and facts["ort costs"]["over_all"] > 0 and run["torch_ort_costs_samples_per_s"] > 0
    if Path("/proc/self/clear_refs").exists():
        assert facts["peak_step_mib"] is not None and facts["peak_step_mib"] >= 0
    tuned = facts["tuner"]  # the untuned device learner and the tuner's plan over the same observes (32 stream + 10 replayed rows)
    assert tuned["hog_processes"] == 1 and tuned["rows_per_observe"] == 42 and tuned["tunes"] == 1 and tuned["probe_seconds"] > 0
    assert tuned["tuned_samples_per_s"] > 0 and tuned["untuned_samples_per_s"] > 0 and tuned["torch_samples_per_s"] > 0
    assert tuned["tuned_over_untuned"] == pytest.approx(tuned["tuned_samples_per_s"] / tuned["untuned_samples_per_s"])
    assert set(tuned["rounds_samples_per_s"]) == {"torch", "untuned", "tuned"} and tuned["threads"] >= 1
    out = capsys.readouterr().out
    assert "device/torch" in out and "sel/all" in out and "tuned/untuned" in out and "rho 0.8, ORT costs" in out
    assert "first+head" not in out and "first+head" not in facts


def test_bench_device_cuts_time_the_dx_chain_and_the_weight_gradients_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taste_cl.cli import main

    argv = ["bench", "device", "--models", "mlp 64", "--backends", "onnxruntime", "--steps", "1", "--repeats", "1", "--tuner-calls", "0"]
    assert main([*argv, "--cuts", "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "device_runtimes.json").read_text())["runs"]
    facts = run["backends"]["onnxruntime"]
    for key in ("first+head", "later half"):  # the MLP's 6 tensors: fc1.weight + the head's two; the last three
        assert facts[key]["samples_per_s"] > 0 and facts[key]["over_all"] > 0 and run["torch_cuts_samples_per_s"][key] > 0
        assert f"onnxruntime {key}" in run["rounds_samples_per_s"] and f"torch {key}" in run["rounds_samples_per_s"]
    out = capsys.readouterr().out
    assert "first+head: 3/6" in out and "later half: 3/6" in out


def test_the_cpu_hog_is_killed_after_its_block() -> None:
    import psutil

    from taste_cl.benchmarks.device_runtimes import cpu_hog

    before = {child.pid for child in psutil.Process().children()}
    with cpu_hog(2):
        hogs = [child for child in psutil.Process().children() if child.pid not in before]
        assert len(hogs) == 2 and all(hog.is_running() for hog in hogs)
    assert not any(hog.is_running() and hog.status() != psutil.STATUS_ZOMBIE for hog in hogs)
