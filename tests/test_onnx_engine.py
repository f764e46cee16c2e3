"""The ONNX engine: standard-ONNX forward/backward/optimizer graphs, driven from numpy on plain onnxruntime."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from helpers import run_without_torch

from taste_cl.adapters.onnx_engine.decompositions import adaptive_avg_pool2d_backward, avg_pool2d_backward, convolution_backward
from taste_cl.adapters.onnx_engine.engine import OnnxEngine
from taste_cl.adapters.onnx_engine.export import export_engine
from taste_cl.exceptions import CheckpointError, ExportError, InvalidBatchError, UntranslatableOperatorError

ORT131 = Path(os.environ.get("TASTE_CL_ORT_VENV", "/tmp/ort131")) / "bin" / "python"
aten = torch.ops.aten


# ----------------------------------------------------------------- models
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def small_cnn() -> nn.Module:
    """Strided and depthwise convolutions, BatchNorm in eval mode with settled statistics, max and avg pooling."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, 2, 1, groups=8),  # depthwise, strided
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, 2, 1, bias=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AvgPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return Bag()


def _inputs(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return torch.randn(n, 3, 16, 16, generator=g)
    if kind == "bag":
        return torch.randint(0, 30, (n, 6), generator=g)
    return torch.randn(n, 8, generator=g)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def ce_grad(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """d(mean cross entropy)/d(logits), in numpy, as the learning loop computes it."""
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    probabilities = shifted / shifted.sum(1, keepdims=True)
    probabilities[np.arange(len(labels)), labels] -= 1
    return (probabilities / len(labels)).astype(np.float32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx_engine")
    made = {}
    for kind, build in (("mlp", mlp), ("cnn", small_cnn), ("bag", embedding_model)):
        made[kind] = export_engine(build(), _inputs(kind, 8), root / kind, optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-3)
    model = mlp()
    made["adamw"] = export_engine(
        model, _inputs("mlp", 8), root / "adamw", optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    )
    return made


BUILDERS = {"mlp": mlp, "cnn": small_cnn, "bag": embedding_model}


# ----------------------------------------------------------------- the decompositions, against aten
CONVS = [  # (in, out, kernel, stride, padding, dilation, groups, 1-D, spatial size)
    (3, 4, 3, 1, 1, 1, 1, False, 11),
    (4, 6, 3, 2, 1, 1, 1, False, 11),
    (6, 6, 3, 2, 1, 1, 6, False, 11),  # depthwise, strided
    (4, 8, 5, 1, 2, 2, 2, False, 11),  # grouped, dilated
    (4, 4, 1, 1, 0, 1, 1, False, 11),
    (5, 7, 3, 2, 0, 1, 1, True, 11),  # 1-D
    (8, 32, 3, 1, 1, 1, 2, False, 3),  # more output channels than positions: one GEMM over the batch
    (4, 4, 3, 1, 1, 1, 1, False, 64),  # enough positions for the flipped-kernel input gradient
]


@pytest.mark.parametrize("config", CONVS)
def test_convolution_backward_matches_aten(config: tuple[Any, ...]) -> None:
    c_in, c_out, k, s, p, d, groups, one_d, side = config
    size = (2, c_in, side) if one_d else (2, c_in, side, side - 2)
    x = torch.randn(*size)
    w = torch.randn(c_out, c_in // groups, *([k] if one_d else [k, k]))
    conv = torch.nn.functional.conv1d if one_d else torch.nn.functional.conv2d
    grad = torch.randn_like(conv(x, w, None, s, p, d, groups))
    args = (grad, x, w, [c_out], [s], [p], [d], False, [0], groups, [True, True, True])
    ours, reference = convolution_backward(*args), aten.convolution_backward(*args)
    for mine, theirs in zip(ours, reference):
        assert relative(mine.numpy(), theirs.numpy()) < 1e-5


def test_pooling_backward_matches_aten() -> None:
    x = torch.randn(2, 3, 8, 8)
    grad = torch.randn(2, 3, 4, 4)
    ours = avg_pool2d_backward(grad, x, [3, 3], [2, 2], [1, 1], False, True, None)
    assert relative(ours.numpy(), aten.avg_pool2d_backward(grad, x, [3, 3], [2, 2], [1, 1], False, True, None).numpy()) < 1e-6
    for out in (1, 2):
        grad = torch.randn(2, 3, out, out)
        assert relative(adaptive_avg_pool2d_backward(grad, x).numpy(), aten._adaptive_avg_pool2d_backward(grad, x).numpy()) < 1e-6


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (lambda g: avg_pool2d_backward(g, torch.randn(1, 1, 8, 8), [3, 3], [2, 2], [1, 1], False, False, None), "avg_pool2d_backward"),
        (lambda g: adaptive_avg_pool2d_backward(g, torch.randn(1, 1, 7, 7)), "does not divide"),
    ],
)
def test_pooling_refuses_unequal_windows(case: Any, message: str) -> None:
    with pytest.raises(UntranslatableOperatorError, match=message):
        case(torch.randn(1, 1, 3, 3))


# ----------------------------------------------------------------- gradients and steps against torch
@pytest.mark.parametrize("kind", ["mlp", "cnn", "bag"])
def test_gradients_match_torch(folders: dict[str, Path], kind: str) -> None:
    model, x = BUILDERS[kind]().eval(), _inputs(kind, 8, seed=1)
    engine = OnnxEngine(folders[kind])
    outputs = engine.forward(x.numpy(), train=True)
    grad = np.random.default_rng(0).standard_normal(outputs.shape).astype(np.float32)
    gradients = engine.backward(grad)
    reference = model(x)
    reference.backward(torch.from_numpy(grad))
    assert relative(outputs, reference.detach().numpy()) < 1e-5
    assert set(gradients) == {name for name, _ in model.named_parameters()}
    for name, parameter in model.named_parameters():
        assert relative(gradients[name], parameter.grad.numpy()) < 1e-5, name


@pytest.mark.parametrize("rows", [3, 8, 13])
def test_other_batch_sizes_run_as_padded_chunks_exactly(folders: dict[str, Path], rows: int) -> None:
    model, x = small_cnn(), _inputs("cnn", rows, seed=2)
    engine = OnnxEngine(folders["cnn"])
    outputs = engine.forward(x.numpy(), train=True)
    grad = np.ones_like(outputs)
    gradients = engine.backward(grad)
    model(x).backward(torch.from_numpy(grad))
    assert outputs.shape == (rows, 4)
    for name, parameter in model.named_parameters():
        assert relative(gradients[name], parameter.grad.numpy()) < 1e-5, name


def _train_both(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, kind: str, steps: int = 20) -> tuple[np.ndarray, np.ndarray]:
    engine = OnnxEngine(folder)
    lr = optimizer.param_groups[0]["lr"]
    for step in range(steps):
        x = _inputs(kind, 8, seed=100 + step)
        labels = torch.randint(0, 4 if kind != "bag" else 3, (8,), generator=torch.Generator().manual_seed(step))
        outputs = engine.forward(x.numpy(), train=True)
        engine.step(engine.backward(ce_grad(outputs, labels.numpy())), lr)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), labels).backward()
        optimizer.step()
    probe = _inputs(kind, 8, seed=999)
    return engine.forward(probe.numpy(), train=False), model(probe).detach().numpy()


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_twenty_sgd_steps_track_torch(folders: dict[str, Path], kind: str) -> None:
    model = BUILDERS[kind]().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    ours, theirs = _train_both(folders[kind], model, optimizer, kind)
    assert np.abs(ours - theirs).max() < 1e-4


def test_twenty_adamw_steps_track_torch(folders: dict[str, Path]) -> None:
    model = mlp().eval()
    ours, theirs = _train_both(folders["adamw"], model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05), "mlp")
    assert np.abs(ours - theirs).max() < 1e-4


def test_save_and_load_continue_identically(folders: dict[str, Path], tmp_path: Path) -> None:
    engine = OnnxEngine(folders["adamw"])

    def train(target: OnnxEngine, seeds: range) -> None:
        for seed in seeds:
            x = _inputs("mlp", 8, seed=seed).numpy()
            outputs = target.forward(x, train=True)
            target.step(target.backward(ce_grad(outputs, np.arange(8) % 4)), 1e-2)

    train(engine, range(3))
    engine.save(tmp_path / "saved")
    resumed = OnnxEngine(tmp_path / "saved")
    for a, b in ((engine.parameters(), resumed.parameters()), (engine.optimizer_state(), resumed.optimizer_state())):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    train(engine, range(3, 6))
    train(resumed, range(3, 6))
    assert all(np.array_equal(engine.parameters()[k], resumed.parameters()[k]) for k in engine.trainable)
    assert float(resumed.optimizer_state()["step"]) == 6.0


def test_trainable_selects_the_gradients_and_freezes_the_rest(tmp_path: Path) -> None:
    model = small_cnn()
    folder = export_engine(model, _inputs("cnn", 4), tmp_path, trainable=["11.weight", "11.bias", "5.weight"])
    engine = OnnxEngine(folder)
    assert engine.trainable == ("11.weight", "11.bias", "5.weight")
    outputs = engine.forward(_inputs("cnn", 4).numpy(), train=True)
    assert set(engine.backward(np.ones_like(outputs))) == {"11.weight", "11.bias", "5.weight"}


# ----------------------------------------------------------------- refusals and validation
@pytest.mark.parametrize(
    ("model", "x", "op"),
    [
        (nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.Flatten()), torch.randn(2, 3, 5, 5), "aten.convolution_backward"),
        (nn.Sequential(nn.Conv3d(2, 2, 3), nn.Flatten()), torch.randn(2, 2, 4, 4, 4), "aten.convolution_backward"),
    ],
)
def test_export_refuses_untranslatable_operators_naming_them(model: nn.Module, x: torch.Tensor, op: str, tmp_path: Path) -> None:
    with pytest.raises(UntranslatableOperatorError, match=op) as caught:
        export_engine(model, x, tmp_path)
    assert caught.value.op == op


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"trainable": ["nope"]}, "unknown"),
        ({"optimizer": "lbfgs"}, "must be 'sgd' or 'adamw'"),
    ],
)
def test_export_validates_its_arguments(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=message):
        export_engine(mlp(), _inputs("mlp", 4), tmp_path, **kwargs)


def test_engine_validates_calls(folders: dict[str, Path]) -> None:
    engine = OnnxEngine(folders["mlp"])
    with pytest.raises(RuntimeError, match="forward"):  # out of order: the Engine contract's RuntimeError
        engine.backward(np.zeros((8, 4), np.float32))
    with pytest.raises(InvalidBatchError, match="shaped"):
        engine.forward(np.zeros((8, 5), np.float32), train=False)
    outputs = engine.forward(np.zeros((8, 8), np.float32), train=True)
    with pytest.raises(InvalidBatchError, match="grad_outputs"):
        engine.backward(np.zeros((7, 4), np.float32))
    engine.backward(np.zeros_like(outputs))
    with pytest.raises(RuntimeError, match="forward"):  # the activations serve one backward
        engine.backward(np.zeros_like(outputs))
    parameters = engine.parameters()
    parameters["0.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(CheckpointError, match=r"0\.weight"):
        engine.load_parameters(parameters)
    with pytest.raises(CheckpointError, match="missing"):
        engine.load_optimizer_state({})


# ----------------------------------------------------------------- torch-free, and on current onnxruntime
DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import onnxruntime
    from taste_cl.adapters.onnx_engine.engine import OnnxEngine
    engine = OnnxEngine(sys.argv[1])
    data = np.load(sys.argv[2])
    outputs = engine.forward(data["x"], train=True)
    gradients = engine.backward(data["grad"])
    engine.step(gradients, 0.1)
    saved = {**{"grad." + k: v for k, v in gradients.items()}, **{"param." + k: v for k, v in engine.parameters().items()}}
    np.savez(sys.argv[3], outputs=outputs, **saved)
    print(json.dumps({"ort": onnxruntime.__version__, "torch": "torch" in sys.modules}))
    """
)


def _device_run(python: Path | str, folder: Path, tmp_path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    x = _inputs("cnn", 8, seed=5).numpy()
    np.savez(tmp_path / "in.npz", x=x, grad=np.full((8, 4), 0.25, np.float32))
    done = run_without_torch(DEVICE_SCRIPT, str(folder), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), python=python, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    with np.load(tmp_path / "out.npz") as data:
        return json.loads(done.stdout.strip().splitlines()[-1]), {k: data[k] for k in data.files}


def _torch_reference(folder: Path) -> dict[str, np.ndarray]:
    engine = OnnxEngine(folder)
    outputs = engine.forward(_inputs("cnn", 8, seed=5).numpy(), train=True)
    gradients = engine.backward(np.full((8, 4), 0.25, np.float32))
    model = small_cnn()
    model(_inputs("cnn", 8, seed=5)).backward(torch.full((8, 4), 0.25))
    for name, parameter in model.named_parameters():
        assert relative(gradients[name], parameter.grad.numpy()) < 1e-5
    return {"outputs": outputs, **{"grad." + k: v for k, v in gradients.items()}}


def test_the_engine_runs_without_torch(folders: dict[str, Path], tmp_path: Path) -> None:
    info, result = _device_run(sys.executable, folders["cnn"], tmp_path)
    assert info["torch"] is False
    for name, value in _torch_reference(folders["cnn"]).items():
        assert relative(result[name], value) < 1e-6, name


@pytest.mark.skipif(
    not ORT131.exists(),
    reason=f"no venv with plain onnxruntime at {ORT131.parent.parent} (python -m venv /tmp/ort131 && /tmp/ort131/bin/pip install onnxruntime numpy)",
)
def test_the_engine_runs_on_plain_current_onnxruntime(folders: dict[str, Path], tmp_path: Path) -> None:
    info, result = _device_run(ORT131, folders["cnn"], tmp_path)
    assert info["torch"] is False and not info["ort"].startswith("1.19")
    for name, value in _torch_reference(folders["cnn"]).items():
        assert relative(result[name], value) < 1e-5, name
