"""A class the pretrained model never saw: the torch learner grows its classifier
(``max_classes``), the device learners activate a reserved output slot (``reserved_classes``)."""

from __future__ import annotations

import json
import math
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash, snapshot
from torch import nn

from taste_cl import ClassBalancedReplay, OnlineLearner, ReservoirReplay
from taste_cl.exceptions import CheckpointError, InvalidBatchError

CENTERS = torch.randn(6, 8, generator=torch.Generator().manual_seed(7)) * 3


def _batch(classes: list[int], n: int = 8, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around fixed centres: ``n`` samples of the given classes."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=g)]
    return CENTERS[y] + torch.randn(n, 8, generator=g), y


def _mlp(width: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, width))


def _learner(model: nn.Module | None = None, **kwargs: Any) -> OnlineLearner:
    model = model if model is not None else _mlp()
    kwargs = {"optimizer": torch.optim.Adam(model.parameters(), lr=0.01), "replay": ReservoirReplay(64), "replay_batch_size": 8,
              "max_classes": 6, **kwargs}  # fmt: skip
    return OnlineLearner(model, **kwargs)


def _accuracy(predict: Any, classes: list[int], seed: int = 999) -> float:
    x, y = _batch(classes, 128, seed=seed)
    outputs = predict(x)
    return float((torch.as_tensor(np.asarray(outputs)).argmax(1) == y).float().mean())


def test_mlp_learns_a_new_class_and_keeps_the_old_ones():
    learner = _learner(replay=ClassBalancedReplay(64))
    for step in range(15):
        learner.observe(_batch([0, 1, 2], seed=step))
    head = learner.model[2]
    events: list[Any] = []
    learner.monitor.subscribe(events.append, "classes_added")
    learner.observe(_batch([0, 1, 2, 3], seed=100))  # the user's own class arrives
    assert learner.num_classes == learner.output_shape[0] == head.out_features == 4
    assert [e.details["classes"] for e in events] == [[3]]
    state = learner.optimizer.state[head.weight]
    assert state["exp_avg"].shape == (4, 32) and float(state["step"]) == 16
    for step in range(25):
        learner.observe(_batch([0, 1, 2, 3], seed=200 + step))
    assert _accuracy(learner.predict, [3]) > 0.8  # chance is 0.25
    assert _accuracy(learner.predict, [0, 1, 2]) > 0.9


def test_growth_keeps_old_rows_bit_for_bit_and_pads_optimizer_state():
    learner = _learner()
    for step in range(3):
        learner.observe(_batch([0, 1, 2], seed=step))
    head = learner.model[2]
    weight, bias = head.weight.detach().clone(), head.bias.detach().clone()
    moments = {k: v.clone() for k, v in learner.optimizer.state[head.weight].items()}
    learner._validate((_batch([0], 2, seed=3)[0], torch.tensor([0, 5])))  # validation grows; no step yet
    assert head.out_features == 6
    assert torch.equal(head.weight[:3], weight) and torch.equal(head.bias[:3], bias)
    state = learner.optimizer.state[head.weight]
    assert torch.equal(state["exp_avg"][:3], moments["exp_avg"]) and not state["exp_avg"][3:].any()
    assert torch.equal(state["step"], moments["step"])
    bound = 1 / math.sqrt(32)
    assert head.bias[3:].abs().max() <= bound  # new rows drawn like a fresh nn.Linear


def _quadrants(classes: set[int], g: torch.Generator, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """The zoo's image task (class = the brightest quadrant) restricted to ``classes``."""
    from zoo import ZOO

    x, y = ZOO["resnet18"].make_batch(8 * n, g)
    keep = torch.tensor([label in classes for label in y.tolist()])
    return x[keep][:n], y[keep][:n]


@pytest.mark.slow  # tens of seconds on a loaded CPU
def test_zoo_resnet_grows_its_fc_layer():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=3)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), max_classes=4)
    g = torch.Generator().manual_seed(0)
    learner.observe(_quadrants({0, 1, 2}, g, 4))
    rows = model.fc.weight.detach().clone()
    x, y = _quadrants({3}, g, 4)
    learner._validate((x, y))
    assert model.fc.out_features == 4 and torch.equal(model.fc.weight[:3], rows)
    assert learner.optimizer.state[model.fc.weight]["momentum_buffer"].shape == (4, 512)
    assert math.isfinite(learner.observe((x, y)).loss) and learner.predict(x).shape == (4, 4)


def test_cnn_learns_a_new_class():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 5, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 3))  # fmt: skip
    learner = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                            replay=ClassBalancedReplay(96), replay_batch_size=12, max_classes=4)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for _ in range(15):
        learner.observe(_quadrants({0, 1, 2}, g))
    for _ in range(25):
        learner.observe(_quadrants({0, 1, 2, 3}, g))
    x, y = _quadrants({0, 1, 2, 3}, g, 96)
    predicted = learner.predict(x).argmax(1)
    new = y == 3
    assert float((predicted[new] == 3).float().mean()) > 0.7  # chance 0.25
    assert float((predicted[~new] == y[~new]).float().mean()) > 0.7


@pytest.mark.parametrize("strategy", ["er_ace", "der++", "lwf"])
def test_strategies_follow_the_grown_head(strategy):
    kwargs: dict[str, Any] = {"strategy": strategy}
    if strategy == "lwf":
        from taste_cl.strategies import LwF

        kwargs["strategy"] = LwF(every=2)
    learner = _learner(**kwargs)
    for step in range(4):
        learner.observe(_batch([0, 1, 2], seed=step))
    batch = _batch([0, 1, 2, 4], seed=10)
    if strategy == "der++":
        x, _, fields = learner.replay._storage.contents()
        stored = fields["logits"].clone()
        learner._validate(batch)  # grows, before any step: the new columns are the grown model's outputs
        logits = learner.replay._storage.contents()[2]["logits"]
        assert logits.shape[1] == 5 and torch.equal(logits[:, :3], stored)
        assert torch.allclose(logits[:, 3:], learner.predict(x)[:, 3:])
    if strategy == "lwf":
        learner._validate(batch)
        teacher = learner.strategy.teacher[2]
        assert teacher.out_features == 5 and torch.equal(teacher.weight[3:], learner.model[2].weight[3:])
    stats = learner.observe(batch)
    assert math.isfinite(stats.loss) and learner.num_classes == 5
    for step in range(3):
        assert math.isfinite(learner.observe(_batch([0, 1, 2, 4], seed=20 + step)).loss)


@pytest.mark.parametrize("save_at", [2, 6], ids=["before-growth", "after-growth"])
def test_resumed_run_equals_the_uninterrupted_one(tmp_path, save_at):
    stream = [_batch([0, 1, 2] if i < 4 else [0, 1, 2, 3], seed=i) for i in range(10)]
    stream[4] = _batch([0, 1, 2, 5], seed=4)  # a gap: classes 3 and 4 come into being unused
    straight = _learner(strategy="der++")
    for i, batch in enumerate(stream):
        if i == save_at:
            straight.save(tmp_path)
        straight.observe(batch)
    model = _mlp()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    assert resumed.max_classes == 6
    for batch in stream[save_at:]:
        resumed.observe(batch)
    # all but the update guard's step-size statistics, which differ after any resume with Adam
    # (growth or not: the first step after a load is copy-protected and measured)
    resumed_state, straight_state = snapshot(resumed), snapshot(straight)
    del resumed_state.state["guard"], straight_state.state["guard"]
    assert resumed_state == straight_state


def test_a_bare_linear_model_grows_and_its_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    learner = OnlineLearner(nn.Linear(8, 2), max_classes=4)
    learner.observe(_batch([0, 1, 3], seed=0))
    learner.save(tmp_path)
    restored = OnlineLearner.load(tmp_path, model=nn.Linear(8, 2))
    assert restored.model.out_features == 4 and torch.equal(restored.model.weight, learner.model.weight)


def test_a_grown_checkpoint_that_does_not_fit_leaves_the_model_as_it_was(tmp_path):
    learner = _learner()
    learner.observe(_batch([0, 1, 4], seed=0))
    learner.save(tmp_path)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="optimizer"):
        OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[2].out_features == 3 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("value", [-1, "8", 2, 10**9])
def test_a_hostile_max_classes_in_a_checkpoint_is_refused(tmp_path, value):
    from taste_cl.state.checkpoint import CHECKPOINT_FILE, decode_state, encode_state

    learner = _learner()
    learner.observe(_batch([0, 1, 2], seed=0))
    state = decode_state(encode_state(learner.state_dict()))
    state["config"]["max_classes"] = value
    (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))
    model = _mlp()
    with pytest.raises(CheckpointError, match="max_classes"):
        OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    before = snapshot(learner)
    with pytest.raises(CheckpointError, match="max_classes"):
        learner.load_state_dict(state)
    assert snapshot(learner) == before


@pytest.mark.parametrize(
    ("labels", "match"),
    [([0, 6], "label 6 out of range; labels must be in \\[0, 5\\]"), ([0, 10**9], "out of range"), ([-1, 1], "label -1 out of range")],
)
def test_bad_labels_leave_the_learner_unchanged(labels, match):
    learner = _learner()
    learner.observe(_batch([0, 1, 2], seed=0))
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError, match=match):
        learner.observe((_batch([0], 2, seed=1)[0], torch.tensor(labels)))
    assert snapshot(learner) == before and learner.model[2].out_features == 3


def test_without_the_opt_in_a_larger_label_is_refused_and_named():
    learner = _learner(max_classes=None)
    learner.observe(_batch([0, 1, 2], seed=0))
    with pytest.raises(InvalidBatchError, match="max_classes=N"):
        learner.observe(_batch([3], 2, seed=1))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * 2


_LABELS = torch.tensor([0, 1, 2, 0])


@pytest.mark.parametrize(
    ("model", "kwargs", "batch", "match"),
    [
        (nn.Sequential(nn.Linear(8, 3), nn.Tanh()), {}, (torch.randn(4, 8), _LABELS), "do not give the model's output"),
        (_Scaled(), {}, (torch.randn(4, 8), _LABELS), "body.2"),
        (nn.Sequential(nn.Conv1d(1, 3, 8), nn.Flatten()), {}, (torch.randn(4, 1, 8), _LABELS), "no nn.Linear has the model's 3 outputs"),
        (nn.Sequential(nn.Linear(8, 3)), {"max_classes": 2}, (torch.randn(4, 8), _LABELS), "must be >= the model's 3 outputs"),
        (nn.Sequential(nn.Linear(8, 3)), {"loss_fn": nn.MSELoss()}, (torch.randn(4, 8), torch.randn(4, 3)), "task is regression"),
    ],
)
def test_models_that_cannot_grow_are_refused_on_the_first_batch(model, kwargs, batch, match):
    learner = OnlineLearner(model, **{"max_classes": 5, **kwargs})
    with pytest.raises(ValueError, match=match):
        learner.observe(batch)
    assert learner.output_shape is None and learner.samples_seen == 0


def test_a_probe_guard_refuses_growth_and_changes_nothing():
    from taste_cl.guards import ProbeGuard

    learner = _learner(plugins=[ProbeGuard(window=2)])
    learner.observe(_batch([0, 1, 2], seed=0))
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError, match="ProbeGuard"):
        learner.observe(_batch([0, 3], seed=1))
    assert snapshot(learner) == before


def test_tuner_and_elastic_plugins_keep_working_through_growth(tmp_path):
    from taste_cl.elastic import ElasticTrainer
    from taste_cl.tuning import BatchSizeTuner

    tuner = BatchSizeTuner(cache_dir=tmp_path / "tuner", max_batch_size=16, n_calls=3, n_initial_points=2, min_probe_time=0.002)
    elastic = ElasticTrainer(cache_dir=tmp_path / "elastic", reselect_every=2, granularity="module", warmup=0, repeats=2)
    learner = _learner(plugins=[tuner, elastic])
    for step in range(3):
        learner.observe(_batch([0, 1, 2], seed=step))
    for step in range(4):
        assert math.isfinite(learner.observe(_batch([0, 1, 2, 3], seed=10 + step)).loss)
    assert learner.num_classes == 4 and learner.predict(torch.randn(2, 8)).shape == (2, 4)


# ------------------------------------------------------------------------ devices
def _exported(tmp_path, backend: str) -> tuple[OnlineLearner, Any]:
    model = _mlp()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(64), replay_batch_size=8)
    for step in range(15):
        learner.observe(_batch([0, 1, 2], seed=step))
    rng = torch.get_rng_state()
    folder = learner.export(tmp_path / "artifacts", backend=backend, reserved_classes=2)
    assert torch.equal(torch.get_rng_state(), rng)  # the new rows' draw leaves the learner's random stream alone
    return learner, folder


def _device_learns_a_new_class(device_type: Any, folder: Any, tmp_path: Any) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["active_classes"] == [0, 1, 2]
    device = device_type.from_artifacts(folder)
    outputs = device.predict(_batch([0], 4, seed=1)[0].numpy())
    assert outputs.shape == (4, 5) and np.isneginf(outputs[:, 3:]).all() and np.isfinite(outputs[:, :3]).all()
    for step in range(40):
        x, y = _batch([0, 1, 2, 3], seed=300 + step)
        device.observe((x.numpy(), y.numpy()))
    assert _accuracy(lambda x: device.predict(x.numpy()), [3]) > 0.8
    assert _accuracy(lambda x: device.predict(x.numpy()), [0, 1, 2]) > 0.9
    device.save(tmp_path / "saved")
    resumed = device_type.from_artifacts(tmp_path / "saved")
    assert sorted(resumed.classes.active) == [0, 1, 2, 3]
    x = _batch([0, 1, 2, 3], 16, seed=5)[0].numpy()
    np.testing.assert_array_equal(resumed.predict(x), device.predict(x))
    assert np.isneginf(resumed.predict(x)[:, 4]).all()


@pytest.fixture(scope="module")
def ort_folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One ONNX Runtime export with 2 reserved slots, shared by the tests that only read it (marked training_build)."""
    learner, folder = _exported(tmp_path_factory.mktemp("ort"), "onnxruntime")
    assert learner.model[2].out_features == 3  # the export widened a copy
    return folder


@pytest.mark.training_build
def test_onnxruntime_device_learns_a_new_class_through_a_reserved_slot(ort_folder, tmp_path):
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    _device_learns_a_new_class(OrtOnlineLearner, ort_folder, tmp_path)


@pytest.mark.slow
def test_executorch_device_learns_a_new_class_through_a_reserved_slot(tmp_path):
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    _, folder = _exported(tmp_path, "executorch")
    _device_learns_a_new_class(EtOnlineLearner, folder, tmp_path)


@pytest.mark.training_build
@pytest.mark.parametrize("active", [[0, 5], [2, 1], [], "all", [0, 0]])
def test_a_bad_active_class_list_is_refused(ort_folder, tmp_path, active):
    from taste_cl.adapters.device.artifacts import ArtifactError
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    folder = tmp_path / "artifacts"
    shutil.copytree(ort_folder, folder)
    rehash(folder, lambda manifest: manifest.update(active_classes=active))
    with pytest.raises(ArtifactError, match="active_classes"):
        OrtOnlineLearner.from_artifacts(folder)


def test_reserved_classes_are_refused_for_a_learner_without_a_classifier(tmp_path):
    pytest.importorskip("onnxruntime")
    model = nn.Sequential(nn.Linear(8, 1))
    learner = OnlineLearner(model, loss_fn=nn.MSELoss(), replay=ReservoirReplay(8))
    learner.observe((torch.randn(4, 8), torch.randn(4)))
    with pytest.raises(ValueError, match="reserved_classes adds classifier outputs"):
        learner.export(tmp_path / "a", backend="onnxruntime", reserved_classes=1)
    assert not (tmp_path / "a").exists()
