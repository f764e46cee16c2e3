"""``learner.export(backend="auto")``: the first backend passing its parity gate is published, refusals recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("executorch.extension.training")

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ExportError
from taste_cl.adapters.device.backends import AUTO_ORDER
from taste_cl.adapters.executorch.learner import EtOnlineLearner

pytestmark = [pytest.mark.training_build, pytest.mark.usefixtures("one_thread")]


def _trained(model: nn.Module, shape: tuple[int, ...], optimizer: torch.optim.Optimizer | None = None) -> OnlineLearner:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05)
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(capacity=32), replay_batch_size=4)
    for _ in range(3):
        learner.observe((torch.randn(8, *shape), torch.randint(0, 3, (8,))))
    return learner


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_maxpool_cnn_is_refused_by_executorch_and_published_through_onnxruntime(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 4 * 4, 3))
    learner = _trained(model, (3, 8, 8))
    default = _manifest(learner.export(tmp_path / "default", backend="auto"))["selection"]
    assert default == {"backend": "onnxruntime", "order": list(AUTO_ORDER), "refused": {}}
    folder = learner.export(tmp_path / "art", backend="auto", order=["executorch", "onnxruntime"])
    selection = _manifest(folder)["selection"]
    assert selection["backend"] == "onnxruntime"
    assert "executorch parity FAILED" in selection["refused"]["executorch"]
    assert (folder / "training_model.onnx").is_file() and not (folder / "model.pte").exists()


class Bilinear(nn.Module):
    """A bilinear classifier written with ``torch.einsum``: ONNX Runtime has no Einsum gradient, ExecuTorch trains it."""

    def __init__(self, features: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, features, features) * 0.1)
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ni,kij,nj->nk", x, self.weight, x) + self.bias


def test_einsum_model_refused_by_onnxruntime_is_published_through_executorch(tmp_path):
    example = (torch.randn(10, 6), torch.randint(0, 3, (10,)))  # both backends take example=
    folder = _trained(Bilinear(), (6,)).export(tmp_path / "art", backend="auto", example=example)
    manifest = _manifest(folder)
    assert manifest["selection"]["backend"] == "executorch"
    assert "Einsum" in manifest["selection"]["refused"]["onnxruntime"]
    assert EtOnlineLearner.from_artifacts(folder).observe((np.zeros((4, 6), np.float32), np.zeros(4, np.int64))).steps == 1


def test_bad_order_is_refused(tmp_path):
    learner = _trained(nn.Linear(6, 3), (6,))
    for order in (["tflite"], [], "executorch", ["executorch", "executorch"]):
        with pytest.raises(ValueError, match="order =="):
            learner.export(tmp_path / "art", backend="auto", order=order)


def test_no_backend_passing_is_an_error_naming_each_refusal_and_writes_nothing(tmp_path):
    # Einsum: ONNX Runtime has no gradient; MaxPool2d: ExecuTorch's gradient is wrong
    conv = nn.Conv2d(3, 6, 3, padding=1)
    model = nn.Sequential(conv, nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), Bilinear(36))  # (3, 4, 6) -> (6, 2, 3)
    learner = _trained(model, (3, 4, 6))
    with pytest.raises(ExportError, match="onnxruntime: .*Einsum.*; executorch: .*parity FAILED"):
        learner.export(tmp_path / "art", backend="auto")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_mobilenet_v3_small_trains_on_device_through_auto_with_parity(tmp_path):
    from zoo import ZOO

    model, loss_fn, _ = ZOO["mobilenet_v3_small"].build(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(capacity=32))
    for seed in range(2):
        learner.observe(ZOO["mobilenet_v3_small"].batch(8, seed))
    transforms = ["freeze_batchnorm", "disable_random_layers"]
    chosen = _manifest(learner.export(tmp_path / "default", backend="auto", transforms=transforms))
    assert chosen["selection"]["backend"] in AUTO_ORDER  # ONNX Runtime with its own transforms, when it passes
    folder = learner.export(tmp_path / "art", backend="auto", transforms=transforms, order=["executorch", "onnxruntime"])
    manifest = _manifest(folder)
    assert manifest["selection"] == {"backend": "executorch", "order": ["executorch", "onnxruntime"], "refused": {}}
    assert manifest["transforms"] == transforms
    assert manifest["parity"]["max_param_diff"] < 1e-4 and manifest["parity"]["steps"] == 20
    device = EtOnlineLearner.from_artifacts(folder)
    before = device.parameters()
    x, y = ZOO["mobilenet_v3_small"].batch(8, 5)
    stats = [device.observe((x.numpy(), y.numpy())) for _ in range(3)]
    assert all(np.isfinite(s.loss) and s.steps == 1 for s in stats)
    after = device.parameters()
    assert any(not np.array_equal(before[name], after[name]) for name in before)


def test_bench_device_reports_both_backends(tmp_path, capsys):
    from taste_cl.cli import main

    argv = ["bench", "device", "--models", "layernorm", "--steps", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    (run,) = json.loads((tmp_path / "device_runtimes.json").read_text())["runs"]
    assert set(run["backends"]) == {"onnxruntime", "executorch"}
    assert run["backends"]["executorch"]["samples_per_s"] > 0 and run["backends"]["executorch"]["artifact_bytes"] > 0
    assert "device/torch" in capsys.readouterr().out


def test_bench_device_keeps_a_refusal_message_whole_in_its_json(tmp_path):
    """The table cuts a refusal to fit; the JSON keeps every line (the advice is at the end)."""
    from taste_cl.benchmarks.device_runtimes import _export

    class Refusing:
        def export(self, *args: object, **kwargs: object) -> None:
            raise ValueError("refusing to publish: " + "x" * 200 + "\nwhat to do: pass a smaller learning rate")

    learner, facts = _export(Refusing(), "onnxruntime", tmp_path / "art", 1, None)  # type: ignore[arg-type]
    assert learner is None
    assert facts == {"refused": "ValueError: refusing to publish: " + "x" * 200 + "\nwhat to do: pass a smaller learning rate"}
