"""The ExecuTorch engine (taste_cl.adapters.executorch.engine): the Engine contract, the numpy optimizer
against torch.optim, and the one loop (EngineLearner) over it against the loop over torch eager.

One program is exported per module (about 10 s on a loaded 2-core machine); the AdamW engine is the
same program with the manifest's optimizer and state rewritten, which is all that differs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("executorch")

from taste_cl.adapters.executorch.engine import ExecuTorchEngine  # noqa: E402
from taste_cl.adapters.executorch.engine_export import export_engine  # noqa: E402
from taste_cl.adapters.executorch.optimizer import NumpyOptimizer  # noqa: E402
from taste_cl.datasets import split_digits  # noqa: E402
from taste_cl.engine import check_engine  # noqa: E402
from taste_cl.engine.loop import EngineLearner  # noqa: E402
from taste_cl.engine.torch_engine import TorchEngine  # noqa: E402
from taste_cl.exceptions import ArtifactError, CheckpointError, ExportError, InvalidBatchError, UnsupportedModelError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # small models on a shared machine: one torch thread

SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
ADAMW = {"lr": 0.01, "weight_decay": 0.01}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), **SGD) if kind == "sgd" else torch.optim.AdamW(model.parameters(), **ADAMW)


@pytest.fixture(scope="module")
def stream():
    tasks = split_digits(5, seed=0)
    return [(t.x_train[r].numpy(), t.y_train[r].numpy()) for t in tasks for r in torch.arange(len(t.y_train)).split(10) if len(r) == 10]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, stream):
    """The exported digits MLP with SGD (momentum, weight decay), and a copy stepping AdamW."""
    root = tmp_path_factory.mktemp("et_engine")
    model = _mlp()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sgd = export_engine(model, torch.as_tensor(stream[0][0]), root / "sgd", optimizer=_optimizer("sgd", model))
    finally:
        torch.set_num_threads(threads)
    adamw = root / "adamw"
    shutil.copytree(sgd, adamw)
    manifest = json.loads((adamw / "engine.json").read_text())
    spec = NumpyOptimizer.from_torch(_optimizer("adamw", model))
    manifest["optimizer"] = spec.to_json()
    (adamw / "engine.json").write_text(json.dumps(manifest))
    np.savez(adamw / "optimizer_state.npz", **spec.initial_state({k: tuple(v) for k, v in manifest["trainable"].items()}))
    return {"sgd": sgd, "adamw": adamw}


def test_the_engine_keeps_the_contract_and_counts_the_forwards_its_backward_repeats(folders):
    engine = ExecuTorchEngine(folders["sgd"])
    check_engine(engine, np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32))
    assert engine.recomputed_forwards == 1  # the one backward check_engine takes reran its forward
    assert engine.trainable == ("0.weight", "0.bias", "2.weight", "2.bias")


@pytest.mark.parametrize("rows", [1, 20, 300])  # one row padded to the program's minimum of 2; 300 in chunks of 128
def test_outputs_and_the_vector_jacobian_product_are_torchs_at_any_batch_size(folders, rows):
    engine, model = ExecuTorchEngine(folders["sgd"]), _mlp()
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    direction = torch.randn(rows, 10, generator=torch.Generator().manual_seed(1))
    outputs = model(x)
    expected = torch.autograd.grad(outputs, list(model.parameters()), direction)
    np.testing.assert_allclose(engine.forward(x.numpy(), train=True), outputs.detach().numpy(), rtol=1e-5, atol=1e-6)
    got = engine.backward(direction.numpy())
    for (name, _), grad in zip(model.named_parameters(), expected):
        np.testing.assert_allclose(got[name], grad.numpy(), rtol=1e-4, atol=1e-5)
    assert engine.recomputed_forwards == -(-rows // 128)  # one vjp run per chunk


@pytest.mark.parametrize(
    "kind, settings",
    [
        ("sgd", {"momentum": 0.9, "weight_decay": 1e-3}),
        ("sgd", {"momentum": 0.8, "dampening": 0.3}),
        ("sgd", {"momentum": 0.9, "nesterov": True}),
        ("sgd", {}),
        ("adamw", {"weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ],
)
def test_the_numpy_optimizer_steps_as_torch_optim_and_continues_its_state(kind, settings):
    rng = np.random.default_rng(0)
    param = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32)))
    optimizer = torch.optim.SGD([param], lr=0.1, **settings) if kind == "sgd" else torch.optim.AdamW([param], lr=0.1, **settings)
    spec = NumpyOptimizer.from_torch(optimizer)
    grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(6)]
    for grad in grads[:2]:  # two torch steps first: the state travels (torch_state) and the numpy steps continue it
        param.grad = torch.from_numpy(grad)
        optimizer.step()
    params, state = {"w": param.detach().numpy().copy()}, spec.torch_state(optimizer, {"w": param})
    for i, grad in enumerate(grads[2:]):
        lr = 0.1 / (i + 1)  # the loop's learning rate may change between steps
        for group in optimizer.param_groups:
            group["lr"] = lr
        param.grad = torch.from_numpy(grad)
        optimizer.step()
        spec.step(params, {"w": grad}, state, lr=lr)
        np.testing.assert_allclose(params["w"], param.detach().numpy(), rtol=1e-6, atol=1e-7)
    if kind == "adamw":  # its bias corrections count torch's two steps and the four here
        assert float(state["step"]) == 6.0


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"kind": "adam"}, "kind"),
        ({"kind": "sgd", "momentum": 1.5}, "momentum"),
        ({"kind": "sgd", "nesterov": True}, "nesterov"),
        ({"kind": "adamw", "eps": -1.0}, "eps"),
    ],
)
def test_the_optimizer_refuses_settings_torch_would_not_take(bad, match):
    with pytest.raises(ValueError, match=match):
        NumpyOptimizer(**bad)


def test_export_refuses_another_optimizer_and_a_dict_input(tmp_path):
    model = _mlp()
    with pytest.raises(ExportError, match="SGD or AdamW"):
        export_engine(model, torch.randn(4, 64), tmp_path / "a", optimizer=torch.optim.Adagrad(model.parameters()))
    with pytest.raises(ExportError, match="one tensor batch"):
        export_engine(model, {"x": torch.randn(4, 64)}, tmp_path / "b", optimizer=_optimizer("sgd", model))  # type: ignore[arg-type]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


VARIANTS = {
    "er": {"strategy": "er"},
    "er_ace": {"strategy": "er_ace"},
    "der++": {"strategy": "der++"},
    "lwf": {"strategy": "lwf", "lwf_every": 20},
    "class_balanced": {"strategy": "er", "replay": "class_balanced"},
}


def _run(engine, variant, stream, lr, poison=()):
    learner = EngineLearner(engine, lr=lr, num_classes=10, seed=3, max_grad_norm=5.0, **variant)
    refused = []
    for i, (x, y) in enumerate(stream):
        learner.lr = lr * 1e5 if i in poison else lr
        if learner.observe(x, y).refused:
            refused.append(i)
    return learner, refused


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_loop_over_executorch_follows_the_loop_over_torch(folders, stream, kind, variant):
    lr = SGD["lr"] if kind == "sgd" else ADAMW["lr"]
    model = _mlp()
    on_torch, _ = _run(TorchEngine(model, _optimizer(kind, model)), VARIANTS[variant], stream[:40], lr)
    on_et, _ = _run(ExecuTorchEngine(folders[kind]), VARIANTS[variant], stream[:40], lr)
    assert len(on_et.replay_draws) == 39 and all(np.array_equal(a, b) for a, b in zip(on_torch.replay_draws, on_et.replay_draws))
    expected, got = on_torch.engine.parameters(), on_et.engine.parameters()
    assert max(float(np.abs(expected[k] - got[k]).max()) for k in expected) < 1e-4
    assert on_et.engine.recomputed_forwards == 40


def test_a_poisoned_window_is_refused_at_the_same_observes_and_undone_bit_for_bit(folders, stream):
    model = _mlp()
    _, torch_refused = _run(TorchEngine(model, _optimizer("sgd", model)), VARIANTS["er"], stream[:30], SGD["lr"], poison={20, 21, 22})
    engine = ExecuTorchEngine(folders["sgd"])
    learner, _ = _run(engine, VARIANTS["er"], stream[:20], SGD["lr"])
    before = engine.parameters(), engine.optimizer_state()
    learner.lr = SGD["lr"] * 1e5
    assert learner.observe(*stream[20]).refused == 1
    after = engine.parameters(), engine.optimizer_state()
    assert all(np.array_equal(before[i][k], after[i][k]) for i in range(2) for k in before[i])
    _, et_refused = _run(ExecuTorchEngine(folders["sgd"]), VARIANTS["er"], stream[:30], SGD["lr"], poison={20, 21, 22})
    assert et_refused == torch_refused == [20, 21, 22]


def test_a_saved_engine_and_loop_resume_bit_for_bit(folders, stream, tmp_path):
    learner, _ = _run(ExecuTorchEngine(folders["adamw"]), VARIANTS["der++"], stream[:15], ADAMW["lr"])
    learner.engine.save(tmp_path / "saved")
    plain, arrays = learner.state()
    resumed = EngineLearner(ExecuTorchEngine(tmp_path / "saved"), lr=ADAMW["lr"], num_classes=10, seed=3, max_grad_norm=5.0, strategy="der++")
    resumed.load_state(json.loads(json.dumps(plain)), arrays)
    for x, y in stream[15:25]:
        learner.observe(x, y)
        resumed.observe(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(learner.engine.parameters().values(), resumed.engine.parameters().values()))
    assert all(np.array_equal(a, b) for a, b in zip(learner.engine.optimizer_state().values(), resumed.engine.optimizer_state().values()))


def test_bad_state_is_refused_and_changes_nothing(folders):
    engine = ExecuTorchEngine(folders["sgd"])
    params = engine.parameters()
    broken = {**params, "2.bias": np.full(10, np.nan, np.float32)}
    with pytest.raises(CheckpointError, match="2.bias"):
        engine.load_parameters(broken)
    with pytest.raises(CheckpointError, match="names"):
        engine.load_parameters({"0.weight": params["0.weight"]})
    with pytest.raises(CheckpointError, match="momentum"):
        engine.load_optimizer_state({**engine.optimizer_state(), "momentum.0.bias": np.zeros(3, np.float32)})
    assert all(np.array_equal(params[k], v) for k, v in engine.parameters().items())
    with pytest.raises(InvalidBatchError, match="shaped"):
        engine.forward(np.zeros((2, 63), np.float32), train=False)
    with pytest.raises(RuntimeError, match="forward"):
        engine.backward(np.zeros((2, 10), np.float32))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda f: (f / "engine.json").write_text("{}"), "not an ExecuTorch engine manifest"),
        (lambda f: np.savez(f / "parameters.npz", **{"0.weight": np.zeros((64, 64), np.float32)}), "parameters.npz"),
        (lambda f: (f / "engine.pte").write_bytes(b"not a program"), "could not load"),
        (lambda f: ((f / "engine.ptd").unlink(), (f / "engine.ptd").symlink_to(f / "engine.pte")), "symbolic link"),
        (lambda f: _rewrite(f, trainable={"0.weight": [64, 64]}), "'forward' must take 2 inputs"),
        (lambda f: _rewrite(f, trainable={"0.weight": [64, 64], "0.bias": [64], "2.weight": [10, 64], "2.bias": [9]}), "trainable tensors"),
        (lambda f: _rewrite(f, optimizer={"kind": "sgd"}), "optimizer"),
    ],
)
def test_a_damaged_folder_is_refused_naming_what(folders, tmp_path, damage, match):
    folder = tmp_path / "damaged"
    shutil.copytree(folders["sgd"], folder)
    damage(folder)
    with pytest.raises(ArtifactError, match=match):
        ExecuTorchEngine(folder)


def _rewrite(folder, **changes):
    manifest = json.loads((folder / "engine.json").read_text())
    (folder / "engine.json").write_text(json.dumps({**manifest, **changes}))


@pytest.mark.slow  # two more exports
def test_batchnorm_and_dropout_train_as_in_eval_mode_and_a_wrong_gradient_is_not_published(tmp_path):
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    model(torch.randn(32, 6))  # non-trivial running statistics
    folder = export_engine(model, torch.randn(8, 6), tmp_path / "bn", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert json.loads((folder / "engine.json").read_text())["transforms"] == ["freeze_batchnorm", "disable_random_layers"]
    engine, x = ExecuTorchEngine(folder), torch.randn(5, 6)
    assert engine.inputs == {"input": (np.dtype(np.float32), (6,))}
    with torch.no_grad():
        np.testing.assert_allclose(engine.forward(x.numpy(), train=False), model.eval()(x).numpy(), atol=1e-5)
    cnn = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 4 * 4, 3))
    with pytest.raises(UnsupportedModelError, match="differently from torch"):  # ExecuTorch 1.5's MaxPool2d backward
        export_engine(cnn, torch.randn(8, 3, 8, 8), tmp_path / "cnn", optimizer=torch.optim.SGD(cnn.parameters(), lr=0.1))
    assert not (tmp_path / "cnn").exists()
