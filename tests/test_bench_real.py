"""``taste-cl bench real``: its networks and the device learner ignore padding, the bare reference loop takes the
libraries' steps, and a quick run reports every part."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from taste_cl.cli import main as cli_main

pytest.importorskip("aeon")
pytest.importorskip("avalanche")
pytest.importorskip("onnxruntime")

from taste_cl.benchmarks.recorded import real
from taste_cl.recorded import class_incremental_tasks, load_recorded


@pytest.mark.parametrize("kind", real.MODELS)
def test_networks_ignore_what_lies_in_the_padding(kind: str) -> None:
    vowels = load_recorded("JapaneseVowels", standardize=True)
    model = real.build_model(kind, vowels, seed=0).eval()
    x = torch.from_numpy(vowels.test.with_mask_channel()[:16])
    noisy = x.clone()
    padding = noisy[:, -1:].expand_as(noisy[:, :-1]) == 0
    noisy[:, :-1][padding] = torch.randn(int(padding.sum()))
    with torch.no_grad():
        torch.testing.assert_close(model(noisy), model(x), rtol=1e-5, atol=1e-5)


def test_quick_run_reports_streams_offline_bound_and_enrolment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert real.main(["--quick", "--datasets", "BasicMotions", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert all(
        word in out for word in ("acc taste_cl", "acc avalanche", "train s bare", "x faster", "ceiling", "offline bound", "device, onnx_engine")
    )
    result = json.loads((tmp_path / "real.json").read_text())
    entry = result["datasets"]["BasicMotions"]
    streams = entry["streams"]["cnn"]
    assert set(streams["taste_cl"]) == set(streams["avalanche"]) == {"replay", "ER-ACE"}
    assert set(streams["bare"]) == {"replay"}  # the reference of both strategies, which replay
    for runs in streams.values():
        for summary in runs.values():
            assert 0 <= summary["final_accuracy"] <= 1 and summary["train_seconds"] > 0
    for name, ratios in entry["speed"]["cnn"].items():
        assert ratios["x_faster"] == pytest.approx(streams["avalanche"][name]["train_seconds"] / streams["taste_cl"][name]["train_seconds"])
        assert ratios["ceiling"] == pytest.approx(streams["avalanche"][name]["train_seconds"] / streams["bare"]["replay"]["train_seconds"])
    assert 0 <= entry["offline"]["network"]["cnn"]["accuracy"] <= 1
    assert entry["offline"]["published"]["accuracy"] == real.PUBLISHED["BasicMotions"][0]
    enrolment = entry["enrolment"]["cnn"]["summary"]
    assert "torch" in enrolment and ("device" in enrolment or enrolment["refused"])
    assert enrolment["tolerance"] == 2 / 40 and "2 test samples" in enrolment["tolerance_rule"]  # 1 point of 40 is < 2 samples
    assert result["config"]["device_backend"] == "onnx_engine" and enrolment["export_seconds"] > 0
    seed0 = entry["enrolment"]["cnn"]["per_seed"][0]
    assert {"new_class", "old_classes", "all", "seconds_per_observe"} <= set(seed0["torch"]) and seed0["before"]["new_class"] == 0


def test_speed_ratios_read_avalanche_against_taste_cl_and_the_bare_loop() -> None:
    summary = {
        "taste_cl": {"replay": {"train_seconds": 2.0}, "LwF": {"train_seconds": 1.0}},
        "avalanche": {"replay": {"train_seconds": 4.0}, "LwF": {"train_seconds": 3.0}},
        "bare": {"replay": {"train_seconds": 1.0}, "no buffer": {"train_seconds": 0.5}},
    }
    assert real.speed_ratios(summary) == {"replay": {"x_faster": 2.0, "ceiling": 4.0}, "LwF": {"x_faster": 3.0, "ceiling": 6.0}}
    assert real.speed_ratios({"taste_cl": {"replay": {"train_seconds": 2.0}}}) == {"replay": {"x_faster": None, "ceiling": None}}


def test_the_bare_loop_takes_the_same_steps_on_the_same_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    vowels = load_recorded("JapaneseVowels", standardize=True)
    tasks = class_incremental_tasks(vowels, 3, seed=0)
    batches = [(0, tasks[0].x_train[rows], tasks[0].y_train[rows]) for rows in torch.arange(30).split(10)]
    model = real.build_model("cnn", vowels, seed=0)
    seen: list[int] = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda x: seen.append(x.shape[0]) or forward(x))
    args = argparse.Namespace(lr=0.1, iterations=3, capacity=15)
    run = real.run_bare(model, batches, tasks[:1], args, seed=0, replay=True)
    assert seen[:9] == [10, 10, 10, 20, 20, 20, 20, 20, 20]  # the first batch alone, then 10 replayed rows beside each
    assert run.samples == 30 and run.train_seconds > 0 and len(run.curve) == 1


def test_the_device_learner_ignores_what_lies_in_the_padding(tmp_path: Path) -> None:
    from taste_cl.adapters.device import load_learner
    from taste_cl.learner import OnlineLearner

    vowels = load_recorded("JapaneseVowels", standardize=True)
    model = real.build_model("cnn", vowels, seed=0)
    x = torch.from_numpy(vowels.test.with_mask_channel()[:32])
    learner = OnlineLearner(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), num_classes=vowels.n_classes, input_shape=tuple(x.shape[1:])
    )
    learner.export(tmp_path / "device", backend="onnx_engine")  # the mask is the input's last channel: it travels with it
    device = load_learner(tmp_path / "device")
    noisy = x.clone()
    padding = noisy[:, -1:].expand_as(noisy[:, :-1]) == 0
    noisy[:, :-1][padding] = torch.randn(int(padding.sum()))
    assert padding.any()
    np.testing.assert_allclose(device.predict(noisy.numpy()), device.predict(x.numpy()), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(device.predict(x.numpy()), learner.predict(x).numpy(), rtol=1e-4, atol=1e-4)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "real", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: taste-cl bench real") and "--quick" in out and "--enrol-samples" in out and "--device-backend" in out


def test_aeon_leaves_torch_threads_and_generator_as_they_were() -> None:
    motions = load_recorded("BasicMotions", standardize=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        found = real.offline_aeon(motions, seed=0)  # aeon's Hydra sets torch's threads and reseeds torch's generator
        assert torch.get_num_threads() == 1 and torch.equal(torch.rand(3), expected)
        assert found["classifier"] == "MultiRocketHydraClassifier" and 0 <= found["accuracy"] <= 1
    finally:
        torch.set_num_threads(threads)
