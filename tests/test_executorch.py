"""ExecuTorch backend: training parity with eager PyTorch, the parity gate's refusals, the device learner."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("executorch.extension.training")

from taste_cl import InvalidBatchError, OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.device.parity import ParityError
from taste_cl.adapters.device.transforms import FrozenBatchNorm, apply_transforms
from taste_cl.adapters.executorch.build import UnsupportedModelError, export_model
from taste_cl.adapters.executorch.learner import EtOnlineLearner

STEPS = 20


pytestmark = pytest.mark.usefixtures("one_thread")


class TinyText(nn.Module):
    """Embedding + one TransformerEncoder layer over padded tokens with an attention mask (dict input)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        layer = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        weights = attention_mask.unsqueeze(-1).float()
        return self.head((hidden * weights).sum(1) / weights.sum(1))


def _text_batch(n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    lengths = torch.randint(2, 7, (n,))
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    return {"input_ids": torch.randint(1, 20, (n, 6)) * mask, "attention_mask": mask}, torch.randint(0, 3, (n,))


def _classes(n: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, *shape), torch.randint(0, 3, (n,))


# name -> (model builder, batch maker, loss, num_classes)
CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), lambda n: _classes(n, 6), nn.CrossEntropyLoss(), 3),
    "cnn_stride2": (
        lambda: nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 3)),
        lambda n: _classes(n, 3, 8, 8),
        nn.CrossEntropyLoss(),
        3,
    ),
    "layernorm_mlp": (
        lambda: nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3)),
        lambda n: _classes(n, 6),
        nn.CrossEntropyLoss(),
        3,
    ),
    "hardswish": (
        lambda: nn.Sequential(nn.Linear(6, 16), nn.Hardswish(), nn.Linear(16, 3)), lambda n: _classes(n, 6), nn.CrossEntropyLoss(), 3
    ),
    "text_transformer": (TinyText, _text_batch, nn.CrossEntropyLoss(), 3),
    "mse_regressor": (
        lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0)),
        lambda n: (torch.randn(n, 6), torch.randn(n)),
        nn.MSELoss(),
        None,
    ),
}


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


def _numpy(x):
    return {k: v.numpy() for k, v in x.items()} if isinstance(x, dict) else x.numpy()


# the Transformer's capture and lowering alone take about 15 s of CPU: kept out of the default run
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name == "text_transformer" else name for name in sorted(CASES)]
)
def test_device_training_matches_eager_torch_over_20_steps_with_batches_3_and_8(name, tmp_path):
    build, batch, loss_fn, classes = CASES[name]
    model = build()
    folder = export_model(model, loss_fn, _sgd(model), batch(16), tmp_path / "art", num_classes=classes)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parity"]["steps"] == STEPS and manifest["parity"]["max_param_diff"] < 1e-5
    assert manifest["batch"] == {"min": 2, "max": 128}

    device = EtOnlineLearner.from_artifacts(folder)
    reference = copy.deepcopy(model)
    optimizer = _sgd(reference)
    loss_diff = 0.0
    for step in range(STEPS):
        x, y = batch(3 if step % 2 else 8)  # both sizes through one artifact
        optimizer.zero_grad()
        out = reference(**x) if isinstance(x, dict) else reference(x)
        loss = loss_fn(out, y)
        loss.backward()
        optimizer.step()
        stats = device.observe((_numpy(x), y.numpy()))
        assert not stats.skipped
        loss_diff = max(loss_diff, abs(stats.loss - loss.item()))
    trained = device.parameters()
    param_diff = max(float(np.abs(trained[n] - p.detach().numpy()).max()) for n, p in reference.named_parameters())
    assert loss_diff < 1e-5, loss_diff
    assert param_diff < 1e-5, param_diff
    x, _ = batch(3)
    with torch.no_grad():
        expected = reference.eval()(**x) if isinstance(x, dict) else reference.eval()(x)
    np.testing.assert_allclose(device.predict(_numpy(x)), expected.numpy(), atol=1e-5)


def _pool_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 4 * 4, 3))


def test_linear_layers_run_on_the_optimised_mm_and_add_kernels():
    """ExecuTorch 1.5's runtime has optimised kernels for mm and add but only a portable loop for addmm
    (a Linear with bias): the export splits every addmm, and a bias-free Linear stays one mm."""
    from taste_cl.adapters.executorch.build import _lower

    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3, bias=False))
    lowered = _lower(model, nn.CrossEntropyLoss(), *_classes(8, 6), 16)
    ops = {op.name for plan in lowered.executorch_program.execution_plan for op in plan.operators}
    assert "aten::addmm" not in ops and {"aten::mm", "aten::add"} <= ops


def test_maxpool_cnn_is_refused_by_the_parity_gate_with_the_numbers(tmp_path):
    model = _pool_cnn()
    with pytest.raises(ParityError, match="executorch parity FAILED") as caught:
        export_model(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05), _classes(16, 3, 8, 8), tmp_path / "art")
    report = caught.value.report
    assert not report.passed and report.max_param_diff > report.param_tol
    assert not (tmp_path / "art").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left behind


def test_batchnorm_needs_the_freeze_transform_and_then_trains_with_parity(tmp_path):
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    model(torch.randn(32, 6))  # non-trivial running statistics
    with pytest.raises(UnsupportedModelError, match="freeze_batchnorm"):
        export_model(model, nn.CrossEntropyLoss(), _sgd(model), _classes(16, 6), tmp_path / "a")
    folder = export_model(
        model, nn.CrossEntropyLoss(), _sgd(model), _classes(16, 6), tmp_path / "a", transforms=["freeze_batchnorm", "disable_random_layers"]
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["transforms"] == ["freeze_batchnorm", "disable_random_layers"]
    x = torch.randn(4, 6)
    with torch.no_grad():
        expected = model.eval()(x)  # frozen BatchNorm without dropout == the model in eval mode
    np.testing.assert_allclose(EtOnlineLearner.from_artifacts(folder).predict(x.numpy()), expected.numpy(), atol=1e-5)


def test_the_device_side_imports_nothing_from_the_export_side():
    code = (
        "import sys; import taste_cl.adapters.executorch.learner, taste_cl.adapters.executorch.replay; "
        "from taste_cl.adapters.executorch import EtOnlineLearner; "
        "assert 'taste_cl.adapters.executorch.build' not in sys.modules, sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_transforms_keep_parameter_names_and_eval_outputs():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout2d(0.5))
    model(torch.randn(8, 3, 6, 6))
    transformed = copy.deepcopy(model)
    assert apply_transforms(transformed, ["freeze_batchnorm", "disable_random_layers"]) == ["freeze_batchnorm", "disable_random_layers"]
    assert isinstance(transformed[1], FrozenBatchNorm) and isinstance(transformed[2], nn.Identity)
    assert [n for n, _ in transformed.named_parameters()] == [n for n, _ in model.named_parameters()]
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(transformed.train()(x), model.eval()(x))
    assert apply_transforms(nn.Linear(2, 2), ["freeze_batchnorm"]) == []
    with pytest.raises(ValueError, match="unknown names \\['fuse'\\]"):
        apply_transforms(model, ["fuse"])


def test_only_sgd_ships_and_options_are_validated(tmp_path):
    model = CASES["mlp"][0]()
    example = _classes(8, 6)
    with pytest.raises(ExportError, match="ships only SGD"):
        export_model(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters()), example, tmp_path / "a")
    with pytest.raises(ValueError, match="max_batch_size == 4"):
        export_model(model, nn.CrossEntropyLoss(), _sgd(model), example, tmp_path / "a", max_batch_size=4)
    with pytest.raises(TypeError, match="transforms"):
        export_model(model, nn.CrossEntropyLoss(), _sgd(model), example, tmp_path / "a", transforms="disable_random_layers")
    assert not (tmp_path / "a").exists()


@pytest.fixture(scope="module")
def learner_artifact(tmp_path_factory):
    """An OnlineLearner with a replay buffer exported through ``learner.export(backend='executorch')``."""
    torch.manual_seed(0)
    model = CASES["hardswish"][0]()
    learner = OnlineLearner(model, optimizer=_sgd(model), replay=ReservoirReplay(capacity=40, seed=1), replay_batch_size=4)
    for _ in range(4):
        learner.observe(_classes(8, 6))
    folder = learner.export(tmp_path_factory.mktemp("et") / "art", backend="executorch")
    return learner, folder


def test_learner_export_carries_the_buffer_counters_and_settings(learner_artifact):
    learner, folder = learner_artifact
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["backend"] == "executorch" and manifest["optimizer"]["nesterov"] is True
    assert manifest["replay"]["size"] == 32 and manifest["counters"] == {"samples_seen": 32, "steps": 4}
    device = EtOnlineLearner.from_artifacts(folder)
    assert len(device.replay) == 32 and device.replay_batch_size == 4
    assert all(np.array_equal(device.parameters()[n], p.detach().numpy()) for n, p in learner.model.named_parameters())
    stats = device.observe(_classes(5, 6))
    assert (stats.samples, stats.replay_samples, stats.batch_size, stats.steps) == (5, 4, 9, 1)
    assert len(device.replay) == 37 and device.samples_seen == 37


def test_save_and_reload_resume_the_trained_parameters_and_buffer(learner_artifact, tmp_path):
    _, folder = learner_artifact
    device = EtOnlineLearner.from_artifacts(folder)
    for _ in range(3):
        device.observe(_classes(6, 6))
    device.lr = 0.01
    saved = device.save(tmp_path / "saved")
    again = EtOnlineLearner.from_artifacts(saved)
    before = device.parameters()
    assert all(np.array_equal(before[n], v) for n, v in again.parameters().items())
    assert again.lr == 0.01 and len(again.replay) == len(device.replay) and again.steps == device.steps
    x = torch.randn(1, 6).numpy()  # one sample: padded to the program's minimum batch of 2
    np.testing.assert_array_equal(again.predict(x), device.predict(x))


def test_tampered_or_foreign_artifacts_are_refused(learner_artifact, tmp_path):
    _, folder = learner_artifact
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    for item in folder.iterdir():
        (copy_dir / item.name).write_bytes(item.read_bytes())
    data = bytearray((copy_dir / "model.ptd").read_bytes())
    data[-1] ^= 0xFF
    (copy_dir / "model.ptd").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="model.ptd"):
        EtOnlineLearner.from_artifacts(copy_dir)


def test_bad_batches_are_refused_before_any_state_changes(learner_artifact):
    _, folder = learner_artifact
    device = EtOnlineLearner.from_artifacts(folder)
    before, stored = device.parameters(), len(device.replay)
    bad = [
        ((np.zeros((4, 5), np.float32), np.zeros(4, np.int64)), "shape"),
        ((np.zeros((4, 6), np.float32), np.zeros(3, np.int64)), "samples"),
        ((np.full((4, 6), np.nan, np.float32), np.zeros(4, np.int64)), "non-finite"),
        ((np.zeros((4, 6), np.float32), np.full(4, 7, np.int64)), "labels outside"),
        ((np.zeros((4, 6), np.float32), np.zeros(4, np.float32)), "dtype"),
    ]
    for batch, message in bad:
        with pytest.raises(InvalidBatchError, match=message):
            device.observe(batch)
    with pytest.raises(ValueError, match="lr == -1"):
        device.lr = -1
    assert all(np.array_equal(before[n], v) for n, v in device.parameters().items()) and len(device.replay) == stored
    assert math.isclose(device.lr, 0.05)
    # one stream sample trains: with 4 replayed ones it meets the program's minimum batch of 2
    assert device.observe((np.zeros((1, 6), np.float32), np.zeros(1, np.int64))).batch_size == 5


def test_export_without_example_needs_a_filled_buffer_unless_float_inputs_can_be_made_up(tmp_path):
    model, make, loss, _ = CASES["text_transformer"]
    learner = OnlineLearner(model(), loss_fn=loss, replay=ReservoirReplay(capacity=10))
    learner.observe(make(4))
    with pytest.raises(ValueError, match="at least 8 samples \\(it holds 4\\)"):  # token ids cannot be made up
        learner.export(tmp_path / "a", backend="executorch")
    assert not (tmp_path / "a").exists()
    model = CASES["mlp"][0]()
    learner = OnlineLearner(model, optimizer=_sgd(model), replay=ReservoirReplay(capacity=10))
    learner.observe(_classes(4, 6))  # float features, class labels: 16 seeded rows fix the shapes
    assert (learner.export(tmp_path / "b", backend="executorch") / "manifest.json").exists()


def test_unknown_backend_and_options_are_refused(tmp_path):
    learner = OnlineLearner(CASES["mlp"][0]())
    with pytest.raises(ValueError, match="backend == 'tflite'"):
        learner.export(tmp_path / "a", backend="tflite")
    with pytest.raises(TypeError, match="\\['colour'\\]"):
        learner.export(tmp_path / "a", backend="executorch", colour="red")
    assert not Path(tmp_path / "a").exists()


def test_importing_taste_cl_does_not_import_executorch():
    import subprocess
    import sys

    code = "import sys, taste_cl; print('executorch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.slow
def test_zoo_text_transformer_trains_with_parity_without_dropout(tmp_path):
    from zoo import ZOO

    model, loss_fn, _ = ZOO["text_transformer"].build(0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    folder = export_model(
        model, loss_fn, sgd, ZOO["text_transformer"].batch(16, 0), tmp_path / "art", num_classes=4, transforms=["disable_random_layers"]
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["transforms"] == ["disable_random_layers"] and manifest["parity"]["max_param_diff"] < 1e-5
    x, y = ZOO["text_transformer"].batch(6, 1)
    stats = EtOnlineLearner.from_artifacts(folder).observe(({k: v.numpy() for k, v in x.items()}, y.numpy()))
    assert stats.steps == 1 and math.isfinite(stats.loss)
