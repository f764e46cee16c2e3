"""Frozen means frozen: the normalisation statistics of parts nobody trains stay fixed.

``requires_grad=False`` stops parameters, not buffers: in train mode a frozen backbone's
BatchNorm normalised with batch statistics and moved its running statistics towards the
user's data, so last-layer personalization forgot the base task. The learner now runs the
normalisation modules of frozen parts in eval mode while it trains (``frozen_norm="eval"``,
the default; ``"train"`` is the old behaviour), everywhere it trains: its own step, ElasticTrainer's
profile, the batch-size tuner's probes, peft-wrapped models, checkpoints and device exports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import quadrant_images
from torch import nn

from taste_cl import CheckpointError, ElasticTrainer, OnlineLearner, ReservoirReplay
from taste_cl.learner.frozen import frozen_norms
from taste_cl.state.checkpoint import write_checkpoint
from taste_cl.tuning.probe import ProbeRunner

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD = 8  # index of the linear head in _cnn()


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 4),
    )  # fmt: skip


def _user(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This user's sensor reads inverted (the darkest quadrant marks the class): the pretrained model
    gets none right, and a BatchNorm in train mode follows the inverted statistics."""
    x, y = quadrant_images(n, seed + 1000)
    return -x, y


@pytest.fixture(scope="module")
def pretrained() -> nn.Sequential:
    """The vendor's model: the CNN trained on the base task, its BatchNorm statistics settled there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(80):
            x, y = quadrant_images(64, step)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _backbone_frozen(pretrained: nn.Sequential) -> nn.Sequential:
    model = copy.deepcopy(pretrained)
    model[:HEAD].requires_grad_(False)
    return model


def _statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every running statistic (running_mean, running_var, num_batches_tracked) of ``model``, copied."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _moved(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, b in model.named_buffers() if not torch.equal(b, before[name])]


def _personalize(model: nn.Module, steps: int = 30, **kwargs: Any) -> OnlineLearner:
    """The documented last-layer personalization: the head alone in the optimizer, on the user's stream."""
    head = [p for p in model.parameters() if p.requires_grad]
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(head, lr=0.05), replay=ReservoirReplay(64), replay_batch_size=8, **kwargs)
    for step in range(steps):
        learner.observe(_user(32, step))
    return learner


def _accuracy(outputs: torch.Tensor, y: torch.Tensor) -> float:
    return float((outputs.argmax(1) == y).float().mean())


# ------------------------------------------------------------------ the learner's own step
def test_a_frozen_backbone_keeps_its_statistics_and_the_base_task_is_the_frozen_features_plus_the_new_head(pretrained):
    model = _backbone_frozen(pretrained)
    before = _statistics(model)
    learner = _personalize(model)
    assert learner.frozen_norm == "eval" and learner.frozen_norms == ["1", "4"]
    assert _moved(model, before) == []  # bit-identical running_mean, running_var, num_batches_tracked
    assert not learner.score_eval  # the training forward is the eval forward: no second pass to score
    reference = copy.deepcopy(pretrained).eval()  # the original backbone with the personalized head
    reference[HEAD].load_state_dict(model[HEAD].state_dict())
    x, y = quadrant_images(400, 10_000)
    with torch.no_grad():
        expected = reference(x)
    assert torch.equal(learner.predict(x), expected)
    assert _accuracy(learner.predict(x), y) == _accuracy(expected, y)
    user_x, user_y = _user(400, 10_000)
    assert _accuracy(learner.predict(user_x), user_y) > 0.8  # the head learnt the user


def test_frozen_norm_train_restores_moving_statistics(pretrained):
    model = _backbone_frozen(pretrained)
    before = _statistics(model)
    learner = _personalize(model, frozen_norm="train")
    assert learner.frozen_norms == []
    assert sorted(_moved(model, before)) == sorted(before)  # every statistic followed the user's data
    assert int(model[1].num_batches_tracked) == int(before["1.num_batches_tracked"]) + 30  # one per training step
    kept = _personalize(_backbone_frozen(pretrained))
    x, y = quadrant_images(400, 10_000)
    assert _accuracy(kept.predict(x), y) > _accuracy(learner.predict(x), y) + 0.2  # frozen statistics forget far less


@pytest.mark.parametrize("value", ["frozen", "EVAL", None, True, 1])
def test_a_bad_frozen_norm_is_refused_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"`frozen_norm == .*`, must be one of \('eval', 'train'\)"):
        OnlineLearner(_cnn(), frozen_norm=value)


def test_the_rule_finds_frozen_parts_by_their_own_parameters_or_the_nearest_module_holding_some():
    backbone = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, affine=False), nn.InstanceNorm2d(4, track_running_stats=True),
        nn.BatchNorm2d(4, track_running_stats=False), nn.GroupNorm(2, 4), nn.BatchNorm2d(4),
    )  # fmt: skip
    model = nn.Sequential(backbone, nn.BatchNorm2d(4, affine=False), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    backbone.requires_grad_(False)
    model[3].weight.requires_grad_(False)  # its bias still trains: not a frozen part
    trained = [p for p in model.parameters() if p.requires_grad]
    # parameterless norms in the frozen backbone are frozen; the one beside trained layers and
    # those without running statistics (GroupNorm, track_running_stats=False) are never listed
    assert list(frozen_norms(model, trained)) == ["0.1", "0.2", "0.5"]
    assert list(frozen_norms(model, [])) == ["0.1", "0.2", "0.5", "1", "3"]


def test_the_mode_holds_after_predict_and_after_the_user_calls_train(pretrained):
    model = _backbone_frozen(pretrained)
    learner = _personalize(model, steps=1)
    learner.predict(_user(4, 0)[0])
    assert model.training and not model[1].training and not model[4].training
    model.train()  # the user's own call: the next step puts the frozen parts back in eval mode
    before = _statistics(model)
    learner.observe(_user(8, 1))
    assert _moved(model, before) == [] and not model[1].training


# ------------------------------------------------------------------ elastic training
class ModeSpy:
    """Records, at every forward of the first watched module with gradients on (training, and the elastic
    profile's timed passes), each watched module's mode and whether its weight trains."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.seen: list[dict[str, tuple[bool, bool]]] = []
        self._modules = modules
        self._handle = next(iter(modules.values())).register_forward_pre_hook(self._record)

    def _record(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.seen.append({name: (m.training, m.weight.requires_grad) for name, m in self._modules.items()})


@pytest.mark.filterwarnings("ignore:ElasticTrainer. the timing profile is too noisy")
def test_elastic_leaving_a_trainable_batchnorm_out_keeps_it_in_train_mode_and_a_frozen_one_in_eval_mode():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4),
    )  # fmt: skip
    model[:3].requires_grad_(False)  # a frozen stem with its BatchNorm; the rest trains
    elastic = ElasticTrainer(rho=0.9, reselect_every=1000, cache_dir=None, warmup=0, repeats=2, max_rounds=2)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05),
                            plugins=[elastic])  # fmt: skip
    assert learner.frozen_norms == ["1"]
    frozen_before = _statistics(model[1])
    spy = ModeSpy({"frozen": model[1], "trainable": model[4]})
    learner.observe(quadrant_images(16, 0))  # profiles (timing training forwards), probes with every unit, selects
    profiled = len(spy.seen)
    assert profiled > 1 and all(seen == {"frozen": (False, False), "trainable": (True, True)} for seen in spy.seen)
    elastic.apply_selection(["8.weight", "8.bias"])  # this step leaves the trainable BatchNorm out
    assert not model[4].weight.requires_grad
    trainable_before = _statistics(model[4])
    learner.observe(quadrant_images(16, 1))
    assert spy.seen[profiled:] == [{"frozen": (False, False), "trainable": (True, False)}]
    assert _moved(model[4], trainable_before) != [] and _moved(model[1], frozen_before) == []
    assert elastic.profile_ is not None and "4.weight" in elastic.profile_.units


# ------------------------------------------------------------------ the tuner's probes
def test_the_tuners_probes_train_a_batch_of_one_where_only_frozen_parts_hold_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model[:4].requires_grad_(False)
    runner = ProbeRunner(model, torch.optim.SGD(model[4].parameters(), lr=0.05), nn.CrossEntropyLoss(), _user(8, 0))
    assert runner.trains_at(1) is None  # eval-mode BatchNorm normalises one sample, as the learner's step does
    assert model.training and model[2].training  # the caller's model is untouched


# ------------------------------------------------------------------ peft
def test_a_peft_lora_models_base_batchnorm_keeps_its_statistics():
    peft = pytest.importorskip("peft", reason="needs the [peft] extra: pip install 'taste-cl[peft]'")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.head = nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
            return self.head(nn.functional.adaptive_avg_pool2d(x, 2).flatten(1))

    torch.manual_seed(0)
    model = peft.get_peft_model(Net(), peft.LoraConfig(r=4, target_modules=["conv1", "conv2", "head"]))
    before = _statistics(model)
    adapters = [p for p in model.parameters() if p.requires_grad]
    learner = OnlineLearner(model, optimizer=torch.optim.AdamW(adapters, lr=1e-2), replay=ReservoirReplay(64), replay_batch_size=8)
    assert learner.frozen_norms == ["base_model.model.bn1", "base_model.model.bn2"]
    first = None
    for step in range(10):
        stats = learner.observe(_user(16, step))
        first = stats.loss if first is None else first
    assert _moved(model, before) == []
    assert stats.loss < first  # the adapters learn


# ------------------------------------------------------------------ checkpoints
def test_checkpoints_keep_the_setting_and_an_older_one_loads_as_train(pretrained, tmp_path: Path):
    for setting in ("train", "eval"):
        learner = _personalize(_backbone_frozen(pretrained), steps=2, frozen_norm=setting)
        learner.save(tmp_path / setting)
        model = _backbone_frozen(pretrained)
        resumed = OnlineLearner.load(tmp_path / setting, model=model, optimizer=torch.optim.SGD(model[HEAD].parameters(), lr=0.05))
        assert resumed.frozen_norm == setting and resumed.state_dict()["config"]["frozen_norm"] == setting
        learner.observe(_user(16, 50))
        resumed.observe(_user(16, 50))
        assert all(torch.equal(a, b) for a, b in zip(learner.model.state_dict().values(), model.state_dict().values()))
    older = learner.state_dict()
    del older["config"]["frozen_norm"]  # written before the option: it trained with moving statistics
    target = _personalize(_backbone_frozen(pretrained), steps=0)
    target.load_state_dict(older)
    assert target.frozen_norm == "train" and target.frozen_norms == []


def test_a_bad_setting_in_a_checkpoint_is_refused_and_changes_nothing(pretrained, tmp_path: Path):
    learner = _personalize(_backbone_frozen(pretrained), steps=2)
    state = learner.state_dict()
    state["config"]["frozen_norm"] = "frozen"
    target = _personalize(_backbone_frozen(pretrained), steps=1, frozen_norm="train")
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(CheckpointError, match=r"config\.frozen_norm == 'frozen'"):
        target.load_state_dict(state)
    assert target.frozen_norm == "train"
    assert all(torch.equal(a, b) for a, b in _tensors(target.state_dict(), before))
    write_checkpoint(tmp_path / "bad", state)
    model = _backbone_frozen(pretrained)
    with pytest.raises(CheckpointError, match=r"config\.frozen_norm == 'frozen'"):
        OnlineLearner.load(tmp_path / "bad", model=model, optimizer=torch.optim.SGD(model[HEAD].parameters(), lr=0.05))


def _tensors(a: Any, b: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of the tensors of two states of the same structure."""
    if isinstance(a, torch.Tensor):
        yield a, b
    elif isinstance(a, dict):
        for key in a:
            yield from _tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            yield from _tensors(x, y)


# ------------------------------------------------------------------ on the device
@pytest.mark.training_build
def test_an_exported_frozen_backbone_trains_on_the_device_as_the_learner_does_in_torch(pretrained, tmp_path: Path):
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    model = _backbone_frozen(pretrained)
    optimizer = torch.optim.SGD(model[HEAD].parameters(), lr=0.05, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(32), replay_batch_size=0)
    for step in range(3):
        learner.observe(_user(16, step))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")  # the parity gate passed, or this raised
    device = OrtOnlineLearner.from_artifacts(folder)
    for step in range(3, 8):
        x, y = _user(16, step)
        learner.observe((x, y))
        device.observe((x.numpy(), y.numpy()))
    on_device = device.parameters()
    for name, value in model.state_dict().items():
        if value.is_floating_point():  # the head, and every frozen weight and running statistic
            np.testing.assert_allclose(on_device[name], value.numpy(), rtol=0, atol=1e-5, err_msg=name)
    x, _ = quadrant_images(64, 10_000)
    np.testing.assert_allclose(device.predict(x.numpy()), learner.predict(x).numpy(), rtol=0, atol=1e-5)
