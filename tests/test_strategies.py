"""Strategies: ER-ACE's asymmetric loss, DER++'s stored logits, LwF's snapshot, and refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from zoo import ZOO

from taste_cl import ClassBalancedReplay, OnlineLearner, ReplayStrategy, ReservoirReplay
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy


def _learner(strategy: Any, *, replay: ReplayStrategy | None = None, lr: float = 0.1, **kwargs: Any) -> OnlineLearner:
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), replay=replay,
                         replay_batch_size=4, strategy=strategy, **kwargs)


def test_er_ace_stream_loss_ignores_absent_classes() -> None:
    outputs = torch.randn(6, 5, requires_grad=True)
    y = torch.tensor([0, 1, 0, 1, 3, 4])  # stream: classes 0 and 1; replay: 3 and 4
    loss = ERACE().loss(nn.CrossEntropyLoss(), outputs, y, x=None, n_stream=4, fields={})
    loss.backward()
    assert outputs.grad is not None
    assert torch.equal(outputs.grad[:4, 2:], torch.zeros(4, 3))  # absent classes: untouched by the stream part
    assert outputs.grad[:4, :2].abs().sum() > 0
    assert (outputs.grad[4:] != 0).all()  # replay part: over all classes
    # the absent logits do not enter the stream loss at all
    shifted = outputs.detach().clone()
    shifted[:4, 2:] += 100.0
    stream_only = ERACE().loss(nn.CrossEntropyLoss(), shifted[:4], y[:4], x=None, n_stream=4, fields={})
    expected = nn.functional.cross_entropy(outputs.detach()[:4, :2], y[:4])
    assert torch.allclose(stream_only, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n_stream", [3, 5, 8])
@pytest.mark.parametrize("strategy", [ERACE(), DERPlusPlus(0.5, 2.0)], ids=["er_ace", "der++"])
def test_one_pass_cross_entropy_equals_the_loss_over_parts(strategy: Strategy, reduction: str, n_stream: int) -> None:
    # nn.CrossEntropyLoss takes the one-pass path (weighted per-sample losses); a wrapper of it the generic one
    outputs = (3 * torch.randn(8, 6, dtype=torch.float64)).requires_grad_()
    y = torch.tensor([0, 2, 2, 5, 0, 1, 3, 4])
    fields = {"logits": torch.randn(8 - n_stream, 6, dtype=torch.float64)}
    fast = strategy.loss(nn.CrossEntropyLoss(reduction=reduction), outputs, y, x=None, n_stream=n_stream, fields=fields)
    (fast_grad,) = torch.autograd.grad(fast, outputs)
    generic_fn = lambda o, t: nn.functional.cross_entropy(o, t, reduction=reduction)  # noqa: E731
    generic = strategy.loss(generic_fn, outputs, y, x=None, n_stream=n_stream, fields=fields)
    (generic_grad,) = torch.autograd.grad(generic, outputs)
    assert torch.allclose(fast, generic, rtol=1e-12, atol=0)
    assert torch.allclose(fast_grad, generic_grad, rtol=1e-12, atol=1e-15)
    assert torch.isfinite(fast_grad).all()


def test_plain_er_is_the_default_and_is_loss_fn_on_the_whole_micro_batch() -> None:
    learner = _learner(None, replay=ReservoirReplay(50))
    assert isinstance(learner.strategy, ExperienceReplay)
    x, y = torch.randn(8, 4), torch.randint(0, 5, (8,))
    with torch.no_grad():
        expected = nn.functional.cross_entropy(learner.model(x), y)
    assert learner.observe((x, y)).loss == pytest.approx(float(expected), abs=1e-7)


def test_der_stores_logits_at_insertion_and_the_checkpoint_holds_them(tmp_path: Any) -> None:
    learner = _learner("der++", replay=ReservoirReplay(100), lr=0.0)
    x, y = torch.randn(8, 4), torch.randint(0, 5, (8,))
    with torch.no_grad():
        at_insertion = learner.model(x)
    learner.observe((x, y))
    stored_x, _, fields = learner.replay.sample(8, with_fields=True)
    order = [int((stored_x == row).all(1).nonzero()) for row in x]
    assert torch.allclose(fields["logits"][order], at_insertion, atol=1e-6)
    learner.optimizer.param_groups[0]["lr"] = 0.5  # the model moves on; stored logits must not
    for _ in range(3):
        learner.observe((torch.randn(8, 4), torch.randint(0, 5, (8,))))
    assert "logits" in learner.state_dict()["replay"]["storage"]["fields"]
    learner.save(tmp_path)
    everything = learner.replay.sample(100, with_fields=True)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    loaded = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    assert isinstance(loaded.strategy, DERPlusPlus)
    assert (loaded.strategy.alpha, loaded.strategy.beta) == (learner.strategy.alpha, learner.strategy.beta)
    again = loaded.replay.sample(100, with_fields=True)
    assert torch.equal(again[2]["logits"], everything[2]["logits"])
    first = [int((again[0] == row).all(1).nonzero()) for row in x]
    assert torch.allclose(again[2]["logits"][first], at_insertion, atol=1e-6)


def test_der_logits_stay_with_their_samples_in_a_class_balanced_buffer_across_new_classes() -> None:
    # the benchmark's setting: class-incremental stream, each new class makes the older ones give up slots
    learner = _learner("der++", replay=ClassBalancedReplay(6, seed=0), lr=0.0)  # frozen model: stored logits == model(x)
    for classes in ([0, 1], [2, 3], [4]):
        for _ in range(3):
            y = torch.tensor(classes).repeat(4)
            learner.observe((torch.randn(y.shape[0], 4), y))
        stored_x, stored_y, fields = learner.replay.sample(6, with_fields=True)
        with torch.no_grad():
            assert torch.allclose(fields["logits"], learner.model(stored_x), atol=1e-6)
    assert learner.replay.class_counts() == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1}
    assert sorted(stored_y.tolist()) == [0, 0, 1, 2, 3, 4]


def test_der_loss_adds_logit_mse_and_replay_loss() -> None:
    outputs = torch.randn(6, 5)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    stored = torch.randn(2, 5)
    loss_fn = nn.CrossEntropyLoss()
    loss = DERPlusPlus(alpha=0.3, beta=0.7).loss(loss_fn, outputs, y, x=None, n_stream=4, fields={"logits": stored})
    expected = loss_fn(outputs[:4], y[:4]) + 0.3 * nn.functional.mse_loss(outputs[4:], stored) + 0.7 * loss_fn(outputs[4:], y[4:])
    assert torch.allclose(loss, expected)


def test_lwf_distills_to_a_snapshot_every_n_chunks_and_checkpoints_it(tmp_path: Any) -> None:
    learner = _learner(LwF(alpha=1.0, every=2, on_drift=False))
    batches = [(torch.randn(8, 4), torch.randint(0, 5, (8,))) for _ in range(3)]
    learner.observe(batches[0])
    assert learner.strategy.teacher is None
    learner.observe(batches[1])
    teacher = learner.strategy.teacher
    assert teacher is not None
    assert all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), learner.model.state_dict().values()))
    learner.observe(batches[2])  # the model moves, the teacher does not
    assert not all(torch.equal(a, b) for a, b in zip(teacher.state_dict().values(), learner.model.state_dict().values()))
    with torch.no_grad():
        outputs = learner.model(batches[2][0])
    with_teacher = learner.strategy.loss(nn.CrossEntropyLoss(), outputs, batches[2][1], x=batches[2][0], n_stream=8, fields={})
    assert float(with_teacher) > float(nn.functional.cross_entropy(outputs, batches[2][1]))
    learner.save(tmp_path)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5))
    loaded = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(loaded.strategy, LwF) and loaded.strategy.every == 2 and loaded.strategy.chunks == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded.strategy.teacher.state_dict().values(), teacher.state_dict().values()))


@pytest.mark.parametrize("strategy", ["der++", "lwf"])
@pytest.mark.parametrize("case", ["regression_mlp", "multilabel_mlp"])
def test_der_and_lwf_work_for_regression_and_multilabel(strategy: str, case: str) -> None:
    model, loss_fn, optimizer = ZOO[case].build(0)
    chosen = LwF(every=1) if strategy == "lwf" else strategy
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(50), replay_batch_size=4, strategy=chosen)
    for seed in range(3):
        stats = learner.observe(ZOO[case].batch(8, seed))
        assert math.isfinite(stats.loss)


class _NoFields(ReplayStrategy):
    capacity = 10

    def add(self, x: Any, y: torch.Tensor) -> None: ...

    def sample(self, n: int) -> tuple[Any, torch.Tensor]:
        raise AssertionError("not called")

    def __len__(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: _learner("er_ace", loss_fn=nn.MSELoss(), task="regression"), "ERACE supports the classification task"),
        (lambda: _learner(ERACE(), loss_fn=nn.BCEWithLogitsLoss()), "this learner's task is multilabel"),
        (lambda: _learner("der++"), "DERPlusPlus rehearses stored logits: pass replay="),
        (lambda: _learner("der++", replay=_NoFields()), "keeps extra per-sample fields"),
        (lambda: _learner("agem"), "unknown strategy 'agem'"),
        (lambda: LwF(every=None, on_drift=False), "LwF needs a moment to take its snapshot"),
        (lambda: LwF(every=0), "`every == 0`"),
        (lambda: LwF(temperature=0), "`temperature == 0`"),
        (lambda: DERPlusPlus(alpha=-1), "`alpha == -1`"),
        (lambda: DERPlusPlus(beta=math.inf), "`beta == inf`, must be a finite number >= 0"),
        (lambda: LwF(alpha=math.nan), "`alpha == nan`"),
        (lambda: LwF(temperature=math.inf), "`temperature == inf`, must be a finite number > 0"),
        (lambda: LwF(on_drift="no"), "`on_drift == 'no'`, must be a bool"),
    ],
)
def test_refusals(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        build()


def test_er_ace_refuses_token_tagging_when_the_first_batch_settles_it() -> None:
    model, loss_fn, optimizer = ZOO["token_tagger"].build(0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, strategy="er_ace")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="token_classification"):
        learner.observe(ZOO["token_tagger"].batch(4, 0))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_custom_strategy_forms_the_loss() -> None:
    class Doubled(Strategy):
        name = "doubled"

        def loss(self, loss_fn: Any, outputs: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return 2 * loss_fn(outputs, y)

    x, y = torch.randn(8, 4), torch.randint(0, 5, (8,))
    plain, doubled = _learner(None), _learner(Doubled())
    doubled.model.load_state_dict(plain.model.state_dict())
    assert doubled.observe((x, y)).loss == pytest.approx(2 * plain.observe((x, y)).loss, rel=1e-6)
