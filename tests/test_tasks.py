"""Tasks: inferred from the loss, targets validated against the model output, guard rails."""

from __future__ import annotations

import pytest
import torch
from helpers import snapshot
from torch import nn

from taste_cl import (
    ClassBalancedReplay,
    InvalidBatchError,
    OnlineLearner,
    ReservoirReplay,
)
from taste_cl.tasks import (
    Classification,
    MultiLabel,
    Regression,
    TokenClassification,
    infer_task,
    resolve_task,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "loss_fn, output_shape, expected",
    [
        (nn.CrossEntropyLoss(), (4,), Classification()),
        (nn.NLLLoss(), None, Classification()),
        (nn.CrossEntropyLoss(ignore_index=7), (4, 12), TokenClassification(7)),
        (nn.MSELoss(), (1,), Regression()),
        (nn.L1Loss(), None, Regression()),
        (nn.SmoothL1Loss(), None, Regression()),
        (nn.HuberLoss(), None, Regression()),
        (nn.BCEWithLogitsLoss(), (5,), MultiLabel(logits=True)),
        (nn.BCELoss(), (5,), MultiLabel(logits=False)),
        (nn.KLDivLoss(), (5,), None),
        (lambda out, y: out.sum(), (5,), None),
    ],
)
def test_the_task_is_inferred_from_the_loss(loss_fn, output_shape, expected):
    assert infer_task(loss_fn, output_shape) == expected


def test_tasks_round_trip_through_their_config_and_names():
    for task in (Classification(), TokenClassification(3), Regression(), MultiLabel(logits=False)):
        assert resolve_task(task.config()) == task and resolve_task(task.name).name == task.name
    with pytest.raises(ValueError, match="must be a Task or one of"):
        resolve_task("ranking")


def _mlp(outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, outputs))


@pytest.mark.parametrize(
    "outputs, loss_fn, y, message",
    [
        (1, nn.MSELoss(), torch.randn(6, 3), "no broadcasting"),
        (3, nn.MSELoss(), torch.randn(6), "no broadcasting"),
        (1, nn.MSELoss(), torch.full((6,), float("nan")), "non-finite"),
        (5, nn.BCEWithLogitsLoss(), torch.randn(6, 5) * 3, "must be in \\[0, 1\\]"),
        (5, nn.BCEWithLogitsLoss(), torch.ones(6, 4), "no broadcasting"),
        (3, nn.CrossEntropyLoss(), torch.rand(6), "integer class labels.*MSELoss"),
        (3, nn.CrossEntropyLoss(), torch.zeros(6, 2, dtype=torch.long), "1-D"),
        (3, nn.KLDivLoss(reduction="batchmean"), torch.rand(6, 3), "task="),
        (3, nn.CrossEntropyLoss(reduction="none"), torch.zeros(6, dtype=torch.long), "must return a scalar"),
    ],
)
def test_bad_targets_and_losses_are_refused_on_the_first_batch_before_anything_changes(outputs, loss_fn, y, message):
    learner = OnlineLearner(_mlp(outputs), loss_fn=loss_fn, replay=ReservoirReplay(8))
    x = torch.randn(6, 4)
    before = snapshot(learner)  # holds the RNG state too
    with pytest.raises(InvalidBatchError, match=message):
        learner.observe((x, y))
    assert snapshot(learner) == before and learner.output_shape is None


def test_a_vector_target_for_a_single_output_is_reshaped_and_trained_on_as_pairs_of_equal_shape():
    seen = []

    def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(out.shape), tuple(y.shape)))
        return nn.functional.mse_loss(out, y)

    learner = OnlineLearner(_mlp(1), loss_fn=mse, task="regression", replay=ReservoirReplay(8), replay_batch_size=2)
    for _ in range(2):
        stats = learner.observe((torch.randn(6, 4), torch.randn(6)))
    assert seen == [((1, 1), (1, 1)), ((6, 1), (6, 1)), ((8, 1), (8, 1))]  # loss check, stream, stream + replay
    assert stats.replay_samples == 2
    assert set(stats.metrics) == {"mse", "mae"}


def test_an_unknown_loss_with_integer_targets_is_classification():
    learner = OnlineLearner(_mlp(3), loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
    learner.observe((torch.randn(6, 4), torch.randint(0, 3, (6,))))
    assert learner.task == Classification() and learner.num_classes == 3


def test_explicit_task_overrides_the_inferred_one():
    learner = OnlineLearner(_mlp(3), loss_fn=nn.MSELoss(), task=Regression())
    learner.observe((torch.randn(6, 4), torch.randn(6, 3)))
    assert learner.task == Regression()
    with pytest.raises(ValueError, match="must be a Task or one of"):
        OnlineLearner(_mlp(3), task="ranking")


def test_class_balanced_replay_on_a_task_without_class_labels_is_refused_at_construction():
    with pytest.raises(ValueError, match="ClassBalancedReplay balances on one class label per sample; the regression"):
        OnlineLearner(_mlp(1), loss_fn=nn.MSELoss(), replay=ClassBalancedReplay(10))
    with pytest.raises(ValueError, match="multilabel"):
        OnlineLearner(_mlp(5), loss_fn=nn.BCEWithLogitsLoss(), replay=ClassBalancedReplay(10))


def test_token_tagging_with_class_balanced_replay_is_refused_on_the_first_batch():
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens)).transpose(1, 2)

    learner = OnlineLearner(Tagger(), replay=ClassBalancedReplay(10))
    with pytest.raises(ValueError, match="token_classification task has none"):
        learner.observe((torch.randint(0, 10, (4, 5)), torch.randint(0, 3, (4, 5))))
    assert learner.output_shape is None


def test_token_targets_respect_the_ignore_index():
    task = TokenClassification(-100)
    y = task.to_targets(torch.tensor([[0, 2, -100]]), n=1, output_shape=(3, 3), dtype=torch.float32, device=CPU)
    logits = torch.tensor([[[9.0, 0, 0], [0, 9.0, 0], [0, 0, 0]]])  # (1, C=3, t=3): predicts tags 0, 1, 0
    assert task.batch_stats(logits, y) == (1, 2)  # the ignored token is not counted
    with pytest.raises(InvalidBatchError, match="label 3 out of range.*-100, ignored"):
        task.to_targets(torch.tensor([[0, 3, -100]]), n=1, output_shape=(3, 3), dtype=torch.float32, device=CPU)


def test_an_optimizer_for_another_model_is_refused_at_construction():
    model, other = _mlp(3), _mlp(3)
    with pytest.raises(ValueError, match="optimizer holds none of the model's parameters"):
        OnlineLearner(model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_trainable_parameters_missing_from_the_optimizer_are_named():
    model = _mlp(3)
    with pytest.raises(ValueError, match="2 trainable parameter\\(s\\) are in no optimizer group: 2.weight, 2.bias"):
        OnlineLearner(model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1))
    for p in model[2].parameters():
        p.requires_grad_(False)  # frozen on purpose: fine
    OnlineLearner(model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_regression_stability_and_forgetting_are_errors_that_rise_when_the_probe_gets_worse():
    learner = OnlineLearner(_mlp(1), loss_fn=nn.MSELoss(), optimizer=None)
    learner.monitor.eval_every = 1
    x = torch.randn(8, 4)
    learner.observe((x, torch.zeros(8)))
    best = learner.monitor.stability
    with torch.no_grad():
        learner.model[2].bias.add_(100.0)  # every prediction now far off
    learner.observe((torch.randn(8, 4), torch.zeros(8)))
    assert learner.monitor.stability > best and learner.monitor.forgetting > 0
    assert learner.monitor.report()["metric"] == "mse"


@pytest.mark.parametrize("task", [Regression(), MultiLabel(), MultiLabel(logits=False)], ids=["regression", "multilabel", "probabilities"])
@pytest.mark.parametrize(
    "outputs_dtype, targets_dtype", [(torch.float64, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float64)]
)
def test_the_drift_loss_takes_outputs_and_targets_of_different_float_dtypes(task, outputs_dtype, targets_dtype):
    outputs, targets = torch.rand(6, 3).to(outputs_dtype), torch.rand(6, 3).round().to(targets_dtype)
    expected = task.loss(outputs.double(), targets.double())
    assert task.loss(outputs, targets) == pytest.approx(expected, rel=1e-2)
