"""Test-time adaptation (``OnlineLearner.adapt``): what moves, what never moves, and the collapse guard."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from taste_cl import InvalidBatchError, OnlineLearner, ReservoirReplay
from taste_cl.adaptation import CollapseGuard, Eata, Tent, TestTimeAdapter
from taste_cl.adaptation.anchor import norm_tensors
from taste_cl.adaptation.corruptions import IMAGE_CORRUPTIONS, SEQUENCE_CORRUPTIONS, corrupt
from taste_cl.exceptions import AdaptationWarning


def _bn_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


def _images(n: int, seed: int = 0, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() * 0.5 + shift
    return x, y


@pytest.fixture
def pretrained() -> nn.Module:
    model = _bn_cnn()
    x, y = _images(512)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(5):
        for rows in torch.arange(512).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
    model.eval()
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _norm_names(model: nn.Module) -> set[str]:
    return set(norm_tensors(model))


def test_bn_adapt_moves_only_running_statistics(pretrained):
    before = _snapshot(pretrained)
    learner = OnlineLearner(pretrained, adaptation=TestTimeAdapter("bn", guard=None))
    stats = learner.adapt(_images(32, seed=1, shift=2.0)[0])
    after = pretrained.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in moved)
    assert stats.outputs.shape == (32, 4) and stats.rows_used == 0 and stats.batch_statistics


def test_tent_steps_only_normalisation_affine_parameters_and_leaves_no_gradient(pretrained):
    before = _snapshot(pretrained)
    optimizer = torch.optim.SGD(pretrained.parameters(), lr=0.1, momentum=0.9)
    learner = OnlineLearner(pretrained, optimizer=optimizer, adaptation=TestTimeAdapter(Tent(lr=1e-2), guard=None))
    learner.adapt(_images(32, seed=1, shift=2.0)[0])
    after = pretrained.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in moved if k.endswith(("weight", "bias"))} == {"1.weight", "1.bias", "5.weight", "5.bias"}
    assert moved <= _norm_names(pretrained)
    assert all(p.grad is None for p in pretrained.parameters())
    assert not optimizer.state  # the learner's optimizer took no step and holds no state


def test_adapt_keeps_requires_grad_flags_of_a_frozen_backbone(pretrained):
    pretrained[:7].requires_grad_(False)
    learner = OnlineLearner(pretrained, optimizer=torch.optim.SGD(pretrained[9].parameters(), lr=0.1), adaptation="tent")
    learner.adapt(_images(16, seed=1)[0])
    assert [p.requires_grad for p in pretrained.parameters()] == [False] * 8 + [True, True]


def test_the_guard_resets_a_collapsing_tent_to_the_anchor_and_says_so(pretrained):
    anchor = {k: v.clone() for k, v in norm_tensors(pretrained).items()}
    heard = []
    guarded = OnlineLearner(pretrained, adaptation=TestTimeAdapter(Tent(lr=1.0), guard=CollapseGuard(window=64, min_rows=32)))
    guarded.monitor.subscribe(heard.append, "adaptation_reset")
    resets = [guarded.adapt(_images(16, seed=s, shift=1.5)[0]).reset for s in range(40)]
    assert any(resets) and heard and "marginal ratio" in heard[0].details["reason"]
    assert guarded.adapter is not None and guarded.adapter.resets == sum(resets)
    # unguarded, the same stream collapses onto few classes
    model = _bn_cnn()
    model.load_state_dict(pretrained.state_dict())
    free = OnlineLearner(model, adaptation=TestTimeAdapter(Tent(lr=1.0), guard=None))
    last = [free.adapt(_images(16, seed=s, shift=1.5)[0]).outputs for s in range(40)][-8:]
    assert len(torch.cat(last).argmax(1).unique()) <= 2
    guarded.adapter.reset()
    assert all(torch.equal(anchor[k], v) for k, v in norm_tensors(pretrained).items())


def test_the_guard_reads_collapse_from_the_marginal_not_from_confidence():
    guard = CollapseGuard(window=64, min_rows=32, min_marginal_ratio=0.7)
    balanced = torch.eye(4).repeat(8, 1) * 10  # confident, every class
    assert not guard.update(balanced).reset
    assert not guard.update(balanced).reset
    collapsed = torch.zeros(32, 4)
    collapsed[:, 0] = 10
    verdicts = [guard.update(collapsed) for _ in range(3)]
    # half a window collapsed is not yet below 0.7 of the prior's entropy; a full one is, and after the reset
    # the window starts over from the next batch
    assert [v.reset for v in verdicts] == [False, True, True] and guard.resets == 2
    assert verdicts[0].marginal_ratio == pytest.approx(0.77, abs=0.01)
    two = torch.zeros(32, 4)
    two[:16, 0] = two[16:, 1] = 10  # a stream that holds classes 0 and 1 only
    assert any(CollapseGuard(window=64, min_rows=32).update(two).reset for _ in range(2))
    known = CollapseGuard(window=64, min_rows=32, class_prior=[5, 5, 0, 0])  # label counts seen so far
    assert not any(known.update(two).reset for _ in range(3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, r"`window == 0`, must be an int >= 1"),
        ({"window": 8, "min_rows": 16}, r"`min_rows == 16`, must be <= window"),
        ({"min_marginal_ratio": 1.5}, r"`min_marginal_ratio == 1.5`"),
        ({"class_prior": [1.0]}, r"`class_prior` must be at least 2"),
        ({"class_prior": [1.0, float("nan")]}, r"`class_prior` must be at least 2"),
    ],
)
def test_bad_guard_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CollapseGuard(**kwargs)


def test_nothing_unlabelled_enters_the_buffer_or_the_labelled_metrics(pretrained):
    learner = OnlineLearner(pretrained, replay=ReservoirReplay(64), replay_batch_size=8)
    x, y = _images(16)
    learner.observe((x, y))
    stored, seen = len(learner.replay), learner.samples_seen
    report = learner.monitor.report()
    for s in range(3):
        learner.adapt(_images(16, seed=s + 1)[0])
    assert (len(learner.replay), learner.samples_seen) == (stored, seen)
    assert learner.monitor.report()["anytime_score"] == report["anytime_score"]


def test_a_labelled_observe_moves_the_anchor(pretrained):
    learner = OnlineLearner(pretrained, optimizer=torch.optim.SGD(pretrained.parameters(), lr=0.5), adaptation="tent")
    learner.adapt(_images(16, seed=1)[0])
    learner.observe(_images(16, seed=2))
    trained = {k: v.clone() for k, v in norm_tensors(pretrained).items()}
    learner.adapt(_images(16, seed=3)[0])
    assert learner.adapter is not None
    learner.adapter.reset()
    assert all(torch.equal(trained[k], v) for k, v in norm_tensors(pretrained).items())


def test_a_batch_of_one_warns_and_keeps_batchnorm_on_its_running_statistics(pretrained):
    learner = OnlineLearner(pretrained, adaptation=TestTimeAdapter("bn", guard=None))
    before = _snapshot(pretrained)
    with pytest.warns(AdaptationWarning, match=r"below min_batch=2.*bn takes no step on it"):
        stats = learner.adapt(_images(1)[0])
    assert not stats.batch_statistics
    assert all(torch.equal(before[k], v) for k, v in pretrained.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner.adapt(_images(1)[0])  # once per adapter


def test_bad_batches_and_models_are_refused_before_anything_changes(pretrained):
    learner = OnlineLearner(pretrained, adaptation="tent")
    learner.adapt(_images(8)[0])
    before = _snapshot(pretrained)
    with pytest.raises(InvalidBatchError):
        learner.adapt(torch.zeros(8, 1, 9, 9))
    with pytest.raises(InvalidBatchError):
        learner.adapt(torch.zeros(8, 2, 8, 8))
    assert all(torch.equal(before[k], v) for k, v in pretrained.state_dict().items())
    plain = OnlineLearner(nn.Sequential(nn.Linear(4, 3)), adaptation="tent")
    with pytest.raises(ValueError, match="normalisation layers' affine parameters, and the model has none"):
        plain.adapt(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"`method == 'sar'`"):
        OnlineLearner(_bn_cnn(), adaptation="sar")


def test_eata_uses_only_reliable_rows_and_its_anchor_holds_it_closer(pretrained):
    x = _images(64, seed=1, shift=0.3)[0]
    state = _snapshot(pretrained)
    eata = OnlineLearner(pretrained, adaptation=TestTimeAdapter(Eata(lr=1e-2, anchor_weight=100.0), guard=None))
    used = [eata.adapt(x).rows_used for _ in range(5)]
    assert 0 < min(used) and max(used) < 64
    eata_drift = sum(float((pretrained.state_dict()[k] - state[k]).abs().sum()) for k in ("1.weight", "5.weight"))
    pretrained.load_state_dict(state)
    tent = OnlineLearner(pretrained, adaptation=TestTimeAdapter(Tent(lr=1e-2), guard=None))
    for _ in range(5):
        tent.adapt(x)
    tent_drift = sum(float((pretrained.state_dict()[k] - state[k]).abs().sum()) for k in ("1.weight", "5.weight"))
    assert eata_drift < tent_drift


def test_the_anchor_costs_a_fraction_of_a_model_copy(pretrained):
    adapter = TestTimeAdapter()
    adapter.bind(pretrained)
    assert 0 < adapter.anchor_bytes < adapter.model_copy_bytes / 10


@pytest.mark.parametrize("name", sorted(IMAGE_CORRUPTIONS))
def test_image_corruptions_keep_the_shape_are_seeded_and_grow_with_severity(name):
    x = _images(8)[0].repeat(1, 3, 2, 2)
    mild, harsh = corrupt(x, name, 1), corrupt(x, name, 5)
    assert mild.shape == x.shape and torch.equal(harsh, corrupt(x, name, 5))
    assert float((harsh - x).abs().mean()) > float((mild - x).abs().mean()) > 0


@pytest.mark.parametrize("name", sorted(SEQUENCE_CORRUPTIONS))
def test_sequence_corruptions_keep_the_shape_and_grow_with_severity(name):
    x = torch.sin(torch.linspace(0, 12, 50)).repeat(4, 3, 1)
    mild, harsh = corrupt(x, name, 1), corrupt(x, name, 5)
    assert mild.shape == x.shape
    assert float((harsh - x).abs().mean()) > float((mild - x).abs().mean()) > 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 3), "blur", 1), "must be images"),
        ((torch.zeros(2, 1, 4, 4), "drift", 1), "must be one of"),
        ((torch.zeros(2, 1, 4, 4), "blur", 6), r"`severity == 6`"),
    ],
)
def test_bad_corruption_arguments_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        corrupt(*args)
