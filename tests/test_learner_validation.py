"""Bad input to observe/predict raises a clear InvalidBatchError and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import batch, snapshot, tiny_learner

from taste_cl import InvalidBatchError

X, Y = batch(6, seed=1)

BAD_BATCHES = [
    ((torch.randn(6, 5), Y), "feature shape \\(5,\\), expected \\(4,\\)"),
    ((torch.randn(6, 2, 2), Y), "feature shape \\(2, 2\\)"),
    ((torch.randn(6), Y), "at least 2 dimensions"),
    ((torch.empty(0, 4), torch.empty(0, dtype=torch.long)), "empty batch"),
    ((X.clone().index_fill_(0, torch.tensor([2]), float("nan")), Y), "non-finite"),
    ((X.clone().index_fill_(0, torch.tensor([0]), float("inf")), Y), "non-finite"),
    ((X, torch.tensor([0, 1, 2, 3, 0, 1])), "label 3 out of range"),
    ((X, torch.tensor([0, -1, 2, 0, 0, 1])), "label -1 out of range"),
    ((X, Y.float()), "integer class labels"),
    ((X, Y.bool()), "integer class labels"),
    ((X, Y[:5]), "lengths differ"),
    ((X, Y.unsqueeze(1)), "1-D"),
    ((X.bool(), Y), "dtype torch.bool; the first batch had floating point"),
    ((X.to(torch.complex64), Y), "real floating, integer or bool"),
    ((X.tolist(), Y), "torch.Tensor or numpy.ndarray"),
    ((X,), "pair"),
    ({"x": X}, "missing \\['y'\\]"),
    ("not a batch", "pair"),
    ((np.array([["a"] * 4] * 6, dtype=object), Y), "numeric dtype"),
]


@pytest.mark.parametrize("bad, message", BAD_BATCHES)
def test_bad_batch_raises_and_leaves_state_bit_identical(bad, message):
    learner = tiny_learner()
    for seed in range(3):
        learner.observe(batch(seed=seed))
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError, match=message):
        learner.observe(bad)
    assert snapshot(learner) == before
    assert isinstance(InvalidBatchError("x"), ValueError)


def test_first_batch_that_the_model_cannot_take_is_rejected_before_training():
    learner = tiny_learner()
    wide = torch.randn(6, 7)
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError, match="model cannot take x of shape \\(6, 7\\)"):
        learner.observe((wide, Y))
    assert snapshot(learner) == before and learner.input_shape is None
    learner.observe((X, Y))
    assert learner.input_shape == (4,) and learner.num_classes == 3


def test_num_classes_must_match_the_model_output():
    learner = tiny_learner(num_classes=5)
    with pytest.raises(ValueError, match="outputs 3 logits but num_classes=5"):
        learner.observe((X, Y))


def test_predict_validates_too():
    learner = tiny_learner()
    learner.observe((X, Y))
    with pytest.raises(InvalidBatchError, match="non-finite"):
        learner.predict(torch.full((2, 4), float("nan")))
    with pytest.raises(InvalidBatchError, match="feature shape"):
        learner.predict(torch.randn(2, 3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replay_batch_size": -1}, "replay_batch_size == -1"),
        ({"train_iterations": 0}, "train_iterations == 0"),
        ({"num_classes": 0}, "num_classes == 0"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_learner(**kwargs)


def test_non_module_model_and_bad_replay_are_type_errors():
    from taste_cl import OnlineLearner

    with pytest.raises(TypeError, match="torch.nn.Module"):
        OnlineLearner(lambda x: x)
    with pytest.raises(TypeError, match="ReplayStrategy"):
        OnlineLearner(torch.nn.Linear(2, 2), replay=[])
