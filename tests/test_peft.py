"""Models wrapped by Hugging Face peft (LoRA, IA3, LoHa) through the core learner.

The scenario is personalization: a plain torch model is pretrained on the digits, then a
user whose images come shifted by one pixel (a camera mounted off-centre) trains only
adapters on their own stream. The frozen base must stay bit-identical, the adapters must
learn, and everything around the learner (checkpoints, strategies, the tuner, the guards,
the elastic selection, the device exports) must handle the wrapped model. peft is an
optional extra: taste_cl never imports it (tests/test_packaging.py checks that).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network: every model is built locally
peft = pytest.importorskip("peft", reason="needs the [peft] extra: pip install 'taste-cl[peft]'")

import torch  # noqa: E402
from helpers import Snapshot, snapshot  # noqa: E402
from torch import nn  # noqa: E402
from zoo import ZOO  # noqa: E402

from taste_cl import BatchSizeTuner, CheckpointError, OnlineLearner, ReservoirReplay  # noqa: E402
from taste_cl.datasets import Task, split_digits, stream  # noqa: E402
from taste_cl.elastic import ElasticTrainer  # noqa: E402
from taste_cl.guards.probe import ProbeGuard  # noqa: E402
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class MLP(nn.Module):
    """A plain torch classifier of flattened 8x8 digits; its layers are found by name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    """A plain torch CNN of (1, 8, 8) digit images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        return self.head(nn.functional.adaptive_avg_pool2d(x, 2).flatten(1))


ARCHS: dict[str, tuple[type[nn.Module], list[str], tuple[int, ...]]] = {
    "mlp": (MLP, ["fc1", "fc2", "head"], (64,)),
    "cnn": (CNN, ["conv1", "conv2", "head"], (1, 8, 8)),
}
ADAPTERS: dict[str, Callable[[list[str]], Any]] = {
    "lora": lambda targets: peft.LoraConfig(r=8, target_modules=targets),
    "ia3": lambda targets: peft.IA3Config(target_modules=targets, feedforward_modules=targets),
    "loha": lambda targets: peft.LoHaConfig(r=8, target_modules=targets),
}
ADAPTER_MARKS = ("lora_", "ia3_", "hada_")  # the names peft gives the tensors it adds


def is_adapter(name: str) -> bool:
    return any(mark in name for mark in ADAPTER_MARKS)


@pytest.fixture(scope="module")
def digits() -> Task:
    return split_digits(1)[0]


def user_view(x: torch.Tensor, arch: str) -> torch.Tensor:
    """The user's images: shifted one pixel to the right (wrapping round), shaped for ``arch``."""
    return x.reshape(-1, 8, 8).roll(1, dims=-1).reshape(-1, *ARCHS[arch][2])


@pytest.fixture(scope="module")
def pretrained(digits: Task) -> dict[str, dict[str, torch.Tensor]]:
    """Each architecture's weights after 15 epochs on the unshifted digits (the vendor's pretraining)."""
    weights = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for arch, (cls, _, shape) in ARCHS.items():
            torch.manual_seed(0)
            model = cls()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            x = digits.x_train.reshape(-1, *shape)
            for _ in range(15):
                for rows in torch.randperm(len(x)).split(32):
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x[rows]), digits.y_train[rows]).backward()
                    optimizer.step()
            weights[arch] = copy.deepcopy(model.state_dict())
    finally:
        torch.set_num_threads(threads)
    return weights


def wrapped(arch: str, method: str, base: dict[str, torch.Tensor] | None, *, seed: int = 0) -> nn.Module:
    """``arch`` (with ``base`` weights, or freshly initialised) wrapped by peft's ``method`` on its layers named in ARCHS."""
    cls, targets, _ = ARCHS[arch]
    torch.manual_seed(seed)
    model = cls()
    if base is not None:
        model.load_state_dict(base)
    return peft.get_peft_model(model, ADAPTERS[method](targets))


def adapter_learner(model: nn.Module, **kwargs: Any) -> OnlineLearner:
    """The documented setup: only the adapter parameters go to the optimizer."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return OnlineLearner(model, optimizer=optimizer, **{"replay": ReservoirReplay(200), "replay_batch_size": 16, **kwargs})


def user_batches(digits: Task, arch: str, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = [(user_view(x, arch), y) for _, x, y in stream([digits], 16)]
    return batches if n is None else batches[:n]


def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], digits: Task, arch: str) -> float:
    return float((predict(user_view(digits.x_test, arch)).argmax(1) == digits.y_test).float().mean())


def frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the base model's parameters (by name: the elastic selection switches adapters off too)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if not is_adapter(name)}


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}


def assert_equal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ learning
@pytest.mark.parametrize("method", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_personalize_a_pretrained_model_and_leave_its_base_bit_identical(arch, method, digits, pretrained):
    model = wrapped(arch, method, pretrained[arch])
    trainable = adapters(model)
    assert trainable and {name for name, p in model.named_parameters() if p.requires_grad} == set(trainable)  # peft froze the base
    base, before = frozen(model), accuracy(model, digits, arch)
    learner = adapter_learner(model)
    for batch in user_batches(digits, arch):
        learner.observe(batch)
    after = accuracy(learner.predict, digits, arch)
    # the user's shift is learned (chance: 0.1): at least 0.6, and a lift of 0.1 or half the gap to 1, whichever is
    # less (IA3 on the CNN starts at 0.84 on a fresh install of today's wheels and reaches 0.93)
    assert after >= max(before + min(0.1, 0.5 * (1 - before)), 0.6), (before, after)
    assert_equal_tensors(frozen(model), base)
    assert all(not torch.equal(value, trainable[name]) for name, value in adapters(model).items())
    prediction = learner.predict(user_view(digits.x_test[:5], arch))
    assert type(prediction) is torch.Tensor and prediction.shape == (5, 10)  # what the plain base returns
    report = learner.monitor.report()
    assert report["samples_seen"] == len(digits.y_train) and 0.5 < report["plasticity"] <= 1


def test_an_optimizer_built_before_wrapping_is_refused_naming_the_adapters():
    base = MLP()
    optimizer = torch.optim.AdamW(base.parameters())
    model = peft.get_peft_model(base, ADAPTERS["lora"](["fc1"]))
    with pytest.raises(ValueError, match=r"in no optimizer group: base_model\.model\.fc1\.lora_A\.default\.weight"):
        OnlineLearner(model, optimizer=optimizer)


# ------------------------------------------------------------------ checkpoints
def run_state(learner: OnlineLearner) -> Snapshot:
    """``snapshot(learner)`` less the update guard's step-size statistics. A loaded guard cannot
    know that the restored hyperparameters were already stepped with, so it copy-protects and
    measures its first step, which an uninterrupted run does not (plain models alike): the
    parameters are the same, the running mean of measured step sizes is not."""
    state = snapshot(learner)
    for key in ("log_size", "since_measure"):
        del state.state["guard"][key]
    return state


def _resumed_equals_uninterrupted(
    tmp_path: Path, digits: Task, pretrained: dict[str, Any], method: str, strategy: Callable[[], Strategy] = ExperienceReplay
) -> OnlineLearner:
    """Save half way, load into a freshly wrapped model with another random base and adapter
    init, continue: the result must equal an uninterrupted run bit for bit."""
    batches = user_batches(digits, "mlp", 24)
    uninterrupted = adapter_learner(wrapped("mlp", method, pretrained["mlp"]), strategy=strategy())
    for batch in batches:
        uninterrupted.observe(batch)
    first = adapter_learner(wrapped("mlp", method, pretrained["mlp"]), strategy=strategy())
    for batch in batches[:12]:
        first.observe(batch)
    first.save(tmp_path)
    fresh = wrapped("mlp", method, None, seed=7)  # the checkpoint holds the whole model, base included
    optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(999)  # the resuming process has another global RNG state
    resumed = OnlineLearner.load(tmp_path, model=fresh, optimizer=optimizer)
    assert snapshot(resumed) == snapshot(first)  # adapters, frozen base, AdamW moments, buffer, RNG
    assert resumed.optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    for batch in batches[12:]:
        resumed.observe(batch)
    assert run_state(resumed) == run_state(uninterrupted)
    return resumed


@pytest.mark.parametrize("method", ADAPTERS)
def test_save_load_restores_adapters_and_their_optimizer_state_into_a_freshly_wrapped_model(method, tmp_path, digits, pretrained):
    resumed = _resumed_equals_uninterrupted(tmp_path, digits, pretrained, method)
    assert_equal_tensors(frozen(resumed.model), frozen(wrapped("mlp", method, pretrained["mlp"])))


def test_a_model_fresh_from_its_training_loop_personalizes_and_its_checkpoint_loads(tmp_path, digits):
    """The usual hand-over: pretrain, wrap, personalize. The gradients of the vendor's last
    step stayed on the now frozen base and in every checkpoint, which load then refused."""
    torch.manual_seed(0)
    model = MLP()
    nn.functional.cross_entropy(model(digits.x_train[:32]), digits.y_train[:32]).backward()  # the loop's last step
    learner = adapter_learner(peft.get_peft_model(model, ADAPTERS["lora"](ARCHS["mlp"][1])))
    for batch in user_batches(digits, "mlp", 3):
        learner.observe(batch)
    learner.save(tmp_path)
    fresh = wrapped("mlp", "lora", None, seed=7)
    resumed = OnlineLearner.load(tmp_path, model=fresh, optimizer=torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2))
    assert snapshot(resumed) == snapshot(learner)


def _lora_rank(rank: int) -> nn.Module:
    torch.manual_seed(0)
    return peft.get_peft_model(MLP(), peft.LoraConfig(r=rank, target_modules=["fc1", "fc2", "head"]))


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: _lora_rank(4), r"lora_A\.default\.weight` must have shape \(4, 64\); got \(8, 64\)"),
        (MLP, r"the checkpoint's model was wrapped by peft .* wrap it with the same adapter config \(get_peft_model\) before load"),
    ],
    ids=["other-rank", "unwrapped"],
)
def test_a_model_wrapped_otherwise_is_refused_and_left_alone(other, message, tmp_path, digits):
    learner = adapter_learner(wrapped("mlp", "lora", None))
    learner.observe(user_batches(digits, "mlp", 1)[0])
    learner.save(tmp_path)
    model = other()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    assert_equal_tensors(model.state_dict(), before)


def test_a_wrapped_model_refuses_a_plain_models_checkpoint_with_the_reason(tmp_path, digits):
    torch.manual_seed(0)
    plain = MLP()
    learner = OnlineLearner(plain, optimizer=torch.optim.AdamW(plain.parameters()))
    learner.observe(user_batches(digits, "mlp", 1)[0])
    learner.save(tmp_path)
    model = wrapped("mlp", "lora", None)
    with pytest.raises(CheckpointError, match="this model is wrapped by peft and the checkpoint's was not"):
        OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))


# ------------------------------------------------------------------ strategies
@pytest.mark.parametrize("strategy", [ERACE, DERPlusPlus, lambda: LwF(every=5)], ids=["er_ace", "der++", "lwf"])
def test_strategies_train_adapters_and_resume_bit_identically(strategy, tmp_path, digits, pretrained):
    resumed = _resumed_equals_uninterrupted(tmp_path, digits, pretrained, "lora", strategy=strategy)
    base = frozen(wrapped("mlp", "lora", pretrained["mlp"]))
    assert_equal_tensors(frozen(resumed.model), base)
    if isinstance(resumed.strategy, LwF):  # the teacher is a frozen copy of the wrapped model: same base, its own adapters
        teacher = resumed.strategy.teacher
        assert isinstance(teacher, type(resumed.model)) and teacher is not resumed.model
        assert_equal_tensors({n: p for n, p in teacher.named_parameters() if not is_adapter(n)}, base)
    learner = adapter_learner(wrapped("mlp", "lora", pretrained["mlp"]), strategy=strategy())
    for batch in user_batches(digits, "mlp"):
        learner.observe(batch)
    assert accuracy(learner.predict, digits, "mlp") >= 0.7


# ------------------------------------------------------------------ tuner, guards
def test_the_batch_size_tuner_probes_copies_of_the_wrapped_model(tmp_path, digits, pretrained):
    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=32, n_calls=4, n_initial_points=2, min_probe_time=0.005)
    model = wrapped("cnn", "lora", pretrained["cnn"])
    learner = adapter_learner(model, plugins=[tuner])
    batches = user_batches(digits, "cnn", 2)
    learner.observe(batches[0])  # the first batch tunes, on deep copies of the peft model
    assert tuner.result_ is not None and tuner.result_.probes and not tuner.result_.infeasible
    state = snapshot(learner)
    result = tuner.tune(model, learner.optimizer, learner.loss_fn, batches[1], foreign_load=0.0)
    assert result.probes and snapshot(learner) == state  # the probes trained copies only
    base = frozen(model)
    for batch in user_batches(digits, "cnn", 30):
        learner.observe(batch)
    assert_equal_tensors(frozen(model), base)


def test_update_and_probe_guards_restore_the_wrapped_model_bit_identically(digits, pretrained):
    guard = ProbeGuard(window=2)
    learner = adapter_learner(wrapped("mlp", "lora", pretrained["mlp"]), plugins=[guard], guard_updates="always")
    batches = user_batches(digits, "mlp", 8)
    for batch in batches:
        learner.observe(batch)
    assert guard.windows == 4 and isinstance(guard.accepted_model, type(learner.model))
    accepted = copy.deepcopy(learner.model.state_dict())  # at a window's end: the accepted model
    assert_equal_tensors(guard.accepted_model.state_dict(), accepted)
    rollbacks = guard.rollbacks
    learner.optimizer.param_groups[0]["lr"] = 0.5  # a harmful window: wrong labels at a large step size
    for x, y in batches[:2]:
        learner.observe((x, (y + 1) % 10))
    assert guard.rollbacks == rollbacks + 1
    assert_equal_tensors(learner.model.state_dict(), accepted)
    x = batches[0][0]
    assert torch.equal(guard.predict(x), learner.predict(x))
    learner.optimizer.param_groups[0]["lr"] = 1e300  # the update guard refuses the step, leaving the model as it was
    stats = learner.observe(batches[2])
    assert stats.skipped
    assert_equal_tensors(learner.model.state_dict(), accepted)


# ------------------------------------------------------------------ real architectures
@pytest.mark.parametrize(
    ("name", "targets"),
    [("text_transformer", ["linear1", "linear2", "head"]), ("resnet18", r".*(layer4\.\d\.conv\d|fc)")],
)
def test_zoo_models_wrapped_by_lora_train_adapters_and_round_trip(name, targets, tmp_path):
    """Dict inputs reach the base through peft's forward; the frozen base's BatchNorm modules run in
    eval mode (``frozen_norm="eval"``, the default), so their running statistics stay, and all round-trips."""
    case = ZOO[name]
    model, loss_fn, _ = case.build()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    base = frozen(model)
    learner = adapter_learner(model, loss_fn=loss_fn, replay=ReservoirReplay(40), replay_batch_size=4)
    for seed in range(6):
        learner.observe(case.batch(8, seed=seed))
    assert_equal_tensors(frozen(model), base)
    learner.save(tmp_path)
    fresh, _, _ = case.build(seed=3)
    fresh = peft.get_peft_model(fresh, peft.LoraConfig(r=4, target_modules=targets))
    resumed = OnlineLearner.load(
        tmp_path, model=fresh, loss_fn=loss_fn, optimizer=torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    )
    assert snapshot(resumed) == snapshot(learner)


# ------------------------------------------------------------------ elastic, export
def test_elastic_selects_among_adapter_tensors_only(tmp_path, digits, pretrained):
    model = wrapped("mlp", "lora", pretrained["mlp"])
    elastic = ElasticTrainer(rho=0.5, reselect_every=20, cache_dir=tmp_path)
    learner = adapter_learner(model, plugins=[elastic])
    base, before = frozen(model), accuracy(model, digits, "mlp")
    for batch in user_batches(digits, "mlp"):
        learner.observe(batch)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in elastic.candidates()} == set(adapters(wrapped("mlp", "lora", None)))
    assert elastic.selected and all(is_adapter(name) for name in elastic.selected)
    assert_equal_tensors(frozen(model), base)
    assert accuracy(learner.predict, digits, "mlp") >= before + 0.1


def _exported(tmp_path: Path, digits: Task, pretrained: dict[str, Any], backend: str, method: str = "lora") -> tuple[OnlineLearner, Path]:
    model = wrapped("mlp", method, pretrained["mlp"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.05, momentum=0.9) if backend == "executorch" else torch.optim.AdamW(trainable, lr=1e-2)
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(64), replay_batch_size=8)
    for batch in user_batches(digits, "mlp", 6):
        learner.observe(batch)
    return learner, learner.export(tmp_path / "artifacts", backend=backend)


@pytest.mark.parametrize(
    ("backend", "method"),
    [
        pytest.param("onnxruntime", "lora", marks=pytest.mark.training_build),
        pytest.param("onnxruntime", "ia3", marks=pytest.mark.training_build),
        pytest.param("onnxruntime", "loha", marks=pytest.mark.training_build),
        ("executorch", "lora"),
        ("executorch", "ia3"),
        ("executorch", "loha"),
    ],
)
def test_device_exports_train_only_the_adapters_with_parity(backend, method, tmp_path, digits, pretrained):
    pytest.importorskip("onnxruntime" if backend == "onnxruntime" else "executorch")
    from taste_cl.adapters.device import load_learner

    learner, folder = _exported(tmp_path, digits, pretrained, backend, method)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parity"]["max_loss_diff"] <= manifest["parity"]["tolerance"]
    names = set(adapters(learner.model))
    device = load_learner(folder)
    before = device.parameters()
    assert names <= set(before)
    for x, y in user_batches(digits, "mlp")[6:12]:
        device.observe((x.numpy(), y.numpy()))
    after = device.parameters()
    changed = {name for name in after if not (after[name] == before[name]).all()}
    assert changed == names  # the device trains the adapter tensors and nothing else
    if backend == "onnxruntime":
        assert {name.removeprefix("model.") for name in manifest["trainable"]} == names


@pytest.mark.parametrize("arch", list(ARCHS))
def test_loha_in_plain_ops_matches_peft_in_outputs_and_gradients(arch, digits, pretrained):
    """ExecuTorch's LoHa rewrite is exact: same outputs, same adapter gradients as peft's HadaWeight."""
    from taste_cl.adapters.executorch.loha import rewrite_loha

    model = wrapped(arch, "loha", pretrained[arch])
    for name, parameter in model.named_parameters():  # peft starts one factor at 0: move all so every gradient is nonzero
        if "hada_" in name:
            nn.init.normal_(parameter, std=0.1)
    rewritten = copy.deepcopy(model)
    assert rewrite_loha(rewritten) == len(ARCHS[arch][1])
    x, y = user_batches(digits, arch, 1)[0]
    grads = []
    for m in (model, rewritten):
        out = m(x)
        nn.functional.cross_entropy(out, y).backward()
        grads.append((out.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])
    assert all(g.abs().sum() > 0 for g in grads[0][1].values())


def test_loha_with_module_dropout_is_refused_by_executorch_naming_the_layers_and_the_fix(tmp_path, digits):
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch.loha import rewrite_loha
    from taste_cl.adapters.device import ExportError

    model = peft.get_peft_model(MLP(), peft.LoHaConfig(r=8, target_modules=ARCHS["mlp"][1], module_dropout=0.2))
    with pytest.raises(ValueError, match="model.fc1, base_model.model.fc2, base_model.model.head draw"):  # a random draw per step: no exact plain-ops twin
        rewrite_loha(copy.deepcopy(model))
    learner = OnlineLearner(model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05))
    learner.observe(user_batches(digits, "mlp", 1)[0])
    before = snapshot(learner)
    with pytest.raises(ExportError, match=r"ExecuTorch cannot train this model: peft LoHa layers .*module_dropout=0"):
        learner.export(tmp_path / "artifacts", backend="executorch")
    assert snapshot(learner) == before
