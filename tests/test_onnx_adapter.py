"""ONNX Runtime adapter at the learner level: torch/ORT parity, round trip, tampering and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn


import onnxruntime

from taste_cl import CheckpointError, OnlineLearner
from taste_cl.adapters.onnxruntime.learner_export import export
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import UnsupportedOperatorError
from taste_cl.reference import build_digits_learner
from taste_cl.datasets import split_digits, stream
from taste_cl.exceptions import InvalidBatchError


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 4)
    )


MODELS = {"mlp": (_mlp, (12,)), "cnn": (_cnn, (1, 8, 8))}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
}


def _learner(model: nn.Module, shape: tuple[int, ...], optimizer: str = "sgd") -> OnlineLearner:
    return OnlineLearner(
        model, optimizer=OPTIMIZERS[optimizer](model.parameters()), input_shape=shape, num_classes=4
    )


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnlineLearner, Path, list]:
    """The reference digits learner after two tasks, and its exported artifacts."""
    torch.manual_seed(0)
    tasks = split_digits(5)
    learner = build_digits_learner()
    for _, x, y in stream(tasks[:2], 10):
        learner.observe((x, y))
    folder = export(learner, tmp_path_factory.mktemp("digits") / "artifacts", batch_size=10)
    return learner, folder, tasks


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_torch_and_ort_training_agree(tmp_path: Path, kind: str, optimizer: str) -> None:
    build, shape = MODELS[kind]
    learner = _learner(build(), shape, optimizer)
    example = (torch.randn(4, *shape), torch.randint(0, 4, (4,)))
    device = OrtOnlineLearner.from_artifacts(export(learner, tmp_path / "art", example=example))
    for step, batch_size in enumerate([8, 3, 8, 5, 3, 8]):  # the batch axis is dynamic
        x, y = torch.randn(batch_size, *shape), torch.randint(0, 4, (batch_size,))
        _, torch_loss, _ = learner.train_step(x, y)
        ort_logits, ort_loss, skipped = device.train_step(x.numpy(), y.numpy())
        assert not skipped
        assert ort_logits.shape == (batch_size, 4)
        assert ort_loss == pytest.approx(torch_loss, rel=1e-4), f"step {step}"
    ort_params = device.parameters()
    for name, param in learner.model.named_parameters():
        np.testing.assert_allclose(ort_params[name], param.detach().numpy(), rtol=0, atol=1e-4, err_msg=name)


def test_round_trip_keeps_learning_and_inference_model_matches(digits_artifacts, tmp_path: Path) -> None:
    learner, folder, tasks = digits_artifacts
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "input", "shape": ["batch", 64], "dtype": "float32"}]
    assert manifest["batch_size"] == 10 and manifest["optimizer"]["type"] == "sgd"
    assert manifest["optimizer"]["lr"] == pytest.approx(0.1) and manifest["parity"]["max_loss_diff"] < 1e-4
    device = OrtOnlineLearner.from_artifacts(folder)
    assert (len(device.replay), device.replay.seen) == (len(learner.replay), learner.replay.seen)
    new = tasks[2]
    np.testing.assert_allclose(device.predict(new.x_test), learner.predict(new.x_test).numpy(), atol=1e-5)
    before = float((device.predict(new.x_test).argmax(1) == new.y_test.numpy()).mean())
    for _, x, y in stream([new], 10):
        stats = device.observe((x.numpy(), y.numpy()))
        assert stats.replay_samples == 30 and stats.steps == 3  # 10 replayed in each of 3 steps
    after = float((device.predict(new.x_test).argmax(1) == new.y_test.numpy()).mean())
    assert before == 0.0 and after > 0.8  # unseen classes, then learned on device
    old = tasks[0]
    assert float((device.predict(old.x_test).argmax(1) == old.y_test.numpy()).mean()) > 0.5  # replay kept task 0
    session = onnxruntime.InferenceSession(str(device.export_inference_model(tmp_path / "model.onnx")))
    (logits,) = session.run(None, {"input": new.x_test.numpy()})
    np.testing.assert_allclose(logits, device.predict(new.x_test), atol=1e-5)


def test_save_resumes_weights_buffer_and_optimizer_state(tmp_path: Path) -> None:
    learner = _learner(_mlp(), (12,), "adamw")
    learner.replay_batch_size = 0
    example = (torch.randn(4, 12), torch.randint(0, 4, (4,)))
    device = OrtOnlineLearner.from_artifacts(export(learner, tmp_path / "art", example=example))
    batches = [(np.random.default_rng(i).normal(size=(6, 12)).astype(np.float32), np.arange(6) % 4) for i in range(4)]
    for batch in batches[:2]:
        device.observe(batch)
    resumed = OrtOnlineLearner.from_artifacts(device.save(tmp_path / "saved"))
    assert (resumed.samples_seen, resumed.steps) == (12, 2)
    for batch in batches[2:]:
        assert resumed.observe(batch).loss == pytest.approx(device.observe(batch).loss, rel=1e-6)
    np.testing.assert_allclose(resumed.predict(batches[0][0]), device.predict(batches[0][0]), atol=1e-6)


def test_requires_grad_selects_what_trains_on_device(tmp_path: Path) -> None:
    model = _mlp()
    model[0].requires_grad_(False)  # e.g. a last-layers-only personalisation
    learner = _learner(model, (12,))
    folder = learner.export(tmp_path / "art", example=(torch.randn(4, 12), torch.randint(0, 4, (4,))), backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trainable"] == ["model.2.weight", "model.2.bias"]
    assert manifest["param_names"]["model.0.weight"] == "0.weight"
    device = OrtOnlineLearner.from_artifacts(folder)
    start = device.parameters()
    device.observe((torch.randn(8, 12), torch.randint(0, 4, (8,))))
    end = device.parameters()
    np.testing.assert_array_equal(end["0.weight"], start["0.weight"])
    assert not np.allclose(end["2.weight"], start["2.weight"])


def test_unsupported_op_is_named_and_nothing_is_left_behind(tmp_path: Path) -> None:
    class Mixer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("ni,ni->ni", x, x)

    model = nn.Sequential(nn.Linear(12, 8), Mixer(), nn.Linear(8, 4))
    with pytest.raises(UnsupportedOperatorError, match=r"operator 'Einsum' \(used by module '1'\)"):
        export(_learner(model, (12,)), tmp_path / "art", example=(torch.randn(4, 12), torch.randint(0, 4, (4,))))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda folder: (folder / "checkpoint").unlink(), "'checkpoint' is missing"),
        (lambda folder: (folder / "training_model.onnx").write_bytes(b"tampered"), "'training_model.onnx'.*SHA-256"),
        (lambda folder: (folder / "replay.npz").write_bytes(b"x"), "'replay.npz'.*modified"),
        (lambda folder: (folder / "manifest.json").write_text("{"), "not valid JSON"),
        (lambda folder: (folder / "manifest.json").unlink(), "no manifest.json"),
    ],
)
def test_damaged_artifacts_are_refused_naming_the_file(digits_artifacts, tmp_path: Path, damage, match: str) -> None:
    import shutil

    folder = Path(shutil.copytree(digits_artifacts[1], tmp_path / "copy"))
    damage(folder)
    with pytest.raises(CheckpointError, match=match):
        OrtOnlineLearner.from_artifacts(folder)


@pytest.mark.parametrize(
    ("learner", "kwargs", "error", "match"),
    [
        (lambda: _learner(_mlp(), (12,)), {"optimizer": "adam"}, ValueError, r"`optimizer == 'adam'`"),
        (lambda: _learner(_mlp(), (12,)), {"lr": 0.0}, ValueError, r"`lr == 0.0`, must be a finite number > 0"),
        (lambda: _learner(_mlp(), (12,)), {"trainable": ["9.weight"]}, ValueError, r"trainable names '9.weight', which is not a parameter"),
        (lambda: _learner(_mlp(), (12,)), {"batch_size": 0}, ValueError, r"`batch_size == 0`"),
        (lambda: OnlineLearner(_mlp()), {"example": None}, ValueError, "fewer than 2 rows and the learner was built without input_shape= and num_classes=: pass example"),
        (
            lambda: OnlineLearner((m := _mlp()), optimizer=torch.optim.RMSprop(m.parameters()), input_shape=(12,), num_classes=4),
            {},
            ValueError,
            "optimizer RMSprop cannot run on the device",
        ),
    ],
)
def test_bad_export_arguments(tmp_path: Path, learner, kwargs: dict, error: type, match: str) -> None:
    kwargs = {"example": (torch.randn(4, 12), torch.randint(0, 4, (4,))), **kwargs}
    with pytest.raises(error, match=match):
        export(learner(), tmp_path / "art", **kwargs)
    assert not (tmp_path / "art").exists()


def test_refuses_to_overwrite_a_folder_that_holds_other_files(tmp_path: Path) -> None:
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="non-empty folder without manifest.json"):
        export(_learner(_mlp(), (12,)), tmp_path / "art", example=(torch.randn(4, 12), torch.randint(0, 4, (4,))))
    assert (tmp_path / "art" / "notes.txt").read_text() == "mine"


def test_bad_batch_on_device_changes_nothing(digits_artifacts) -> None:
    device = OrtOnlineLearner.from_artifacts(digits_artifacts[1])
    before = device.parameters()
    with pytest.raises(InvalidBatchError, match=r"shape \(4, 63\), must be \(n, 64\)"):
        device.observe((np.zeros((4, 63), np.float32), np.zeros(4, np.int64)))
    with pytest.raises(InvalidBatchError, match=r"must be in \[0, 9\]"):
        device.observe((np.zeros((4, 64), np.float32), np.full(4, 10)))
    assert device.samples_seen == digits_artifacts[0].samples_seen
    for name, value in device.parameters().items():
        np.testing.assert_array_equal(value, before[name])


def test_cli_export_writes_a_loadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taste_cl.cli import main

    assert main(["export", "--out", str(tmp_path / "art"), "--tasks", "1", "--last-layer-only"]) == 0
    assert "training_model.onnx" in capsys.readouterr().out
    device = OrtOnlineLearner.from_artifacts(tmp_path / "art")
    assert device.spec.trainable == ("model.4.weight", "model.4.bias") and len(device.replay) == 200


def test_missing_extra_names_the_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from taste_cl import MissingDependencyError

    monkeypatch.setitem(__import__("sys").modules, "onnxruntime.capi", None)
    with pytest.raises(MissingDependencyError, match=r"'onnxruntime-training-cpu'.*pip install '\.\[onnx-training\]'"):
        OrtOnlineLearner.from_artifacts(tmp_path)
