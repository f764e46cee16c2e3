"""``learner.export(folder, backend="onnx_engine")`` and ``load_learner``: the engine loop over an OnnxEngine as a device learner."""

from __future__ import annotations

import io
import json
import shutil
import textwrap
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

from taste_cl import ClassBalancedReplay, OnlineLearner, ReservoirReplay
from taste_cl.adapters.device import load_learner
from taste_cl.adapters.device.artifacts import MANIFEST_FILE, write_manifest
from taste_cl.adapters.onnx_engine.learner import LOOP_FILE, OnnxEngineLearner
from taste_cl.datasets import split_digits
from taste_cl.engine.loop import EngineLearner
from taste_cl.exceptions import ArtifactError, BatchNormModeWarning, ExportError
from taste_cl.strategies import DERPlusPlus, LwF, Strategy

TASKS = split_digits(5)
CASES = {  # strategy, buffer, optimizer, clipping: every strategy, both buffers, both optimizers
    "er": ("er", "reservoir", "sgd", None),
    "er_ace": ("er_ace", "class_balanced", "adamw", 1.0),
    "der++": ("der++", "class_balanced", "sgd", None),
    "lwf": ("lwf", "reservoir", "adamw", None),
}


def mlp(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    middle: list[nn.Module] = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Linear(64, 32), *middle, nn.ReLU(), nn.Linear(32, 10))


def make_learner(case: str, observes: int = 8) -> OnlineLearner:
    strategy, buffer, kind, clip = CASES[case]
    model = mlp()
    if kind == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    built = {"der++": DERPlusPlus(alpha=0.5, beta=1.0), "lwf": LwF(alpha=1.0, temperature=2.0, every=3)}.get(strategy, strategy)
    replay = ReservoirReplay(60, seed=1) if buffer == "reservoir" else ClassBalancedReplay(60, seed=1)
    learner = OnlineLearner(model, optimizer=optimizer, replay=replay, replay_batch_size=10, strategy=built, max_grad_norm=clip)
    stream(learner, 0, observes)
    return learner


def stream(learner: Any, task: int, batches: int, start: int = 0) -> list[Any]:
    x, y = TASKS[task].x_train, TASKS[task].y_train
    return [learner.observe((x[s : s + 10], y[s : s + 10])) for s in range(start * 10, (start + batches) * 10, 10)]


def accuracy(device: Any, task: int) -> float:
    x, y = TASKS[task].x_test, TASKS[task].y_test
    return float((device.predict(np.asarray(x, np.float32)).argmax(1) == np.asarray(y)).mean())


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[OnlineLearner, Path]]:
    made: dict[str, tuple[OnlineLearner, Path]] = {}

    def get(case: str) -> tuple[OnlineLearner, Path]:
        if case not in made:
            learner = make_learner(case)
            made[case] = learner, learner.export(tmp_path_factory.mktemp(case.replace("+", "p")) / "art", backend="onnx_engine")
        return made[case]

    return get


# ----------------------------------------------------------------- export, load, continue
@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_predicts_like_torch_and_keeps_learning(exported: Callable[[str], tuple[OnlineLearner, Path]], case: str) -> None:
    learner, folder = exported(case)
    device = load_learner(folder)
    assert isinstance(device, OnnxEngineLearner) and isinstance(device, EngineLearner)
    strategy, buffer, _, clip = CASES[case]
    assert device.replay is not None
    assert (device.strategy, device.replay.policy, device.replay.capacity, device.max_grad_norm) == (strategy, buffer, 60, clip)
    assert device.lr == learner.optimizer.param_groups[0]["lr"] and device.num_classes == 10 and device.samples_seen == 80
    assert len(device.replay) == len(learner.replay)
    x, y, outputs = device.replay.rows(np.arange(len(device.replay)))
    stored_x, stored_y, fields = learner.replay.contents()
    np.testing.assert_array_equal(x, stored_x.numpy())
    np.testing.assert_array_equal(y, stored_y.numpy())
    if case == "der++":
        np.testing.assert_array_equal(outputs, fields["logits"].numpy())  # the logits stored when each row was buffered
    if case == "lwf":
        assert device.teacher is not None and device.lwf_every == 3 and device.observes == 8
    for task in (0, 1):  # before any further step: torch's numbers
        rows = TASKS[task].x_test
        expected = learner.predict(torch.as_tensor(rows)).numpy()
        np.testing.assert_allclose(device.predict(np.asarray(rows, np.float32)), expected, atol=1e-5, rtol=0)
    before = accuracy(device, 1)
    stats = stream(device, 1, 15)
    assert all(np.isfinite(s.loss) and s.refused == 0 for s in stats)
    assert accuracy(device, 1) > before + 0.3, "the device learns the new task"
    assert device.samples_seen == 230 and device.replay.seen > 80


def test_save_and_load_continue_bit_for_bit(exported: Callable[[str], tuple[OnlineLearner, Path]], tmp_path: Path) -> None:
    _, folder = exported("lwf")  # a teacher, AdamW state and a reservoir: the most state there is
    device = load_learner(folder)
    stream(device, 1, 4)
    saved = device.save(tmp_path / "saved")
    again = load_learner(saved)
    assert again.samples_seen == device.samples_seen == 120
    for a, b in zip(stream(device, 1, 5, start=4), stream(again, 1, 5, start=4)):
        assert a == b
    for name, value in device.engine.parameters().items():
        np.testing.assert_array_equal(value, again.engine.parameters()[name])
    for name, value in device.engine.optimizer_state().items():
        np.testing.assert_array_equal(value, again.engine.optimizer_state()[name])
    np.testing.assert_array_equal(device.replay_draws[-1], again.replay_draws[-1])
    device.lr = 0.01  # the live lr is what a save keeps
    assert load_learner(device.save(tmp_path / "lr")).lr == 0.01


DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner
    from taste_cl.adapters.device import load_learner
    device = load_learner(sys.argv[1])
    data = np.load(sys.argv[2])
    stats = device.observe((data["x"], data["y"]))
    device.save(sys.argv[3])
    print(json.dumps({"type": type(device).__name__, "loss": stats.loss, "torch": "torch" in sys.modules}))
    """
)


def test_the_device_learner_runs_without_torch(exported: Callable[[str], tuple[OnlineLearner, Path]], tmp_path: Path) -> None:
    _, folder = exported("der++")
    np.savez(tmp_path / "batch.npz", x=np.asarray(TASKS[1].x_train[:10], np.float32), y=np.asarray(TASKS[1].y_train[:10]))
    done = run_without_torch(DEVICE_SCRIPT, str(folder), str(tmp_path / "batch.npz"), str(tmp_path / "saved"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["torch"] is False and info["type"] == "OnnxEngineLearner" and np.isfinite(info["loss"])
    assert isinstance(load_learner(tmp_path / "saved"), OnnxEngineLearner)


# ----------------------------------------------------------------- refusals, before anything is written
class Mine(Strategy):
    name = "mine"


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 10), nn.Linear(32, 10)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a) + self.b(b)


def _custom_strategy() -> OnlineLearner:
    return OnlineLearner(mlp(), replay=ReservoirReplay(20), strategy=Mine(), num_classes=10, input_shape=(64,))


def _adam() -> OnlineLearner:
    model = mlp()
    return OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters()), num_classes=10, input_shape=(64,))


def _structured() -> OnlineLearner:
    learner = OnlineLearner(TwoInputs(), replay=ReservoirReplay(20))
    x = torch.as_tensor(TASKS[0].x_train[:10])
    learner.observe(({"a": x[:, :32], "b": x[:, 32:]}, torch.as_tensor(TASKS[0].y_train[:10])))
    return learner


@pytest.mark.parametrize(
    ("build", "options", "match"),
    [
        (_custom_strategy, {}, "Mine"),
        (_adam, {}, "Adam"),
        (_structured, {}, "structured"),
        (lambda: make_learner("er", observes=1), {"batchnorm": "batch"}, "batchnorm"),
        (lambda: make_learner("er", observes=1), {"trainable": ["0.wieght"]}, "0.wieght"),
    ],
    ids=["custom-strategy", "adam", "structured-inputs", "batchnorm-batch", "unknown-trainable"],
)
def test_export_refuses_before_writing(build: Callable[[], OnlineLearner], options: dict[str, Any], match: str, tmp_path: Path) -> None:
    learner = build()
    with pytest.raises((ExportError, ValueError), match=match):
        learner.export(tmp_path / "out", backend="onnx_engine", **options)
    assert list(tmp_path.iterdir()) == []


def test_batchnorm_trained_in_batch_mode_is_frozen_with_a_warning(tmp_path: Path) -> None:
    model = mlp(batchnorm=True)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), replay=ReservoirReplay(30))
    stream(learner, 0, 3)
    with pytest.warns(BatchNormModeWarning, match="'1'"):
        folder = learner.export(tmp_path / "art", backend="onnx_engine")
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["export"]["batchnorm_choice"]["chosen"] == "frozen"
    learner.model.eval()
    np.testing.assert_allclose(load_learner(folder).predict(np.asarray(TASKS[0].x_test, np.float32)),
                               learner.model(torch.as_tensor(TASKS[0].x_test)).detach().numpy(), atol=1e-5)  # fmt: skip


# ----------------------------------------------------------------- hostile folders
def _manifest(folder: Path) -> dict[str, Any]:
    return {k: v for k, v in json.loads((folder / MANIFEST_FILE).read_text()).items() if k != "files"}


def _set(path: str, value: Any) -> Callable[[Path], None]:
    """Set the manifest value at dotted ``path`` and re-hash, as an attacker who can write the folder would."""
    return lambda folder: edit_manifest(folder, path, value)


def _raw_lr(text: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / MANIFEST_FILE
        path.write_text(path.read_text().replace('"lr": 0.05', f'"lr": {text}'))

    return apply


def _loop_array(key: str, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        with np.load(folder / LOOP_FILE) as data:
            arrays = {k: data[k] for k in data.files}
        arrays[key] = change(arrays[key])
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        (folder / LOOP_FILE).write_bytes(buffer.getvalue())
        write_manifest(folder, _manifest(folder))

    return apply


def _tamper(folder: Path) -> None:
    data = bytearray((folder / "parameters.npz").read_bytes())
    data[-40] ^= 0xFF  # a weight's byte; the manifest's hash stays as it was
    (folder / "parameters.npz").write_bytes(bytes(data))


def _labels_out_of_range(y: np.ndarray) -> np.ndarray:
    y = y.copy()
    y[0] = 10
    return y


@pytest.mark.parametrize(
    ("hostile", "match"),
    [
        (_tamper, "parameters.npz.*SHA-256"),
        (_raw_lr("NaN"), "non-finite"),
        (_raw_lr("1e400"), "settings.lr"),
        (_set("settings.lr", 1e9), "settings.lr"),
        (_set("settings.lr", "0.05"), "settings.lr"),
        (_set("settings.capacity", 2**40), "settings.capacity"),
        (_set("settings.strategy", "foo"), "settings.strategy"),
        (_set("settings.num_classes", 12), "settings.num_classes"),
        (_set("settings.temperature", 0), "settings.temperature"),
        (_set("settings.replay_batch_size", -1), "settings.replay_batch_size"),
        (_set("loop.replay.size", 61), "loop.replay.size"),
        (_set("loop.rng", {"bit_generator": "PCG64", "state": 3}), "rng"),
        (_loop_array("replay.y", _labels_out_of_range), "replay.y"),
        (_loop_array("replay.x", lambda x: x[:, :63]), "replay.x"),
        (_loop_array("replay.outputs", lambda o: np.full_like(o, np.nan)), "replay.outputs"),
        (_loop_array("replay.x", lambda x: x.astype(object)), LOOP_FILE),
        (_set("settings.monitor.eval_every", 0), "monitor.eval_every"),
        (_set("settings.monitor.drift.alpha", 2.0), "monitor.drift"),
        (_set("settings.monitor.probe_capacity", 2**40), "monitor.probe_capacity"),
        (_set("loop.monitor.probe.size", 101), "monitor.probe.size"),
        (_set("loop.monitor.steps", -1), "monitor.steps"),
        (_set("loop.monitor.events", [{"name": "drift_detected", "step": 10**9, "details": {}}]), "monitor.events"),
        (_set("loop.monitor.drift.mean", "x"), "monitor.drift"),
        (_loop_array("monitor.probe.sid", np.zeros_like), "monitor.probe.sid"),
        (_loop_array("monitor.probe.x", lambda x: np.full_like(x, np.inf)), "monitor.probe.x"),
        (_loop_array("monitor.recent", lambda r: r[:, :2]), "monitor.recent"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_hostile_folders_are_refused_naming_the_field(
    exported: Callable[[str], tuple[OnlineLearner, Path]], tmp_path: Path, hostile: Callable[[Path], None], match: str
) -> None:
    _, folder = exported("der++")
    copy = Path(shutil.copytree(folder, tmp_path / "art"))
    hostile(copy)
    with pytest.raises(ArtifactError, match=match):
        load_learner(copy)
