"""Inputs at the boundary: pytrees of tensors, and odd inputs refused before anything changes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import batch, snapshot, tiny_learner
from torch import nn

from taste_cl import InvalidBatchError, OnlineLearner
from taste_cl._batch import (
    Spec,
    batch_len,
    call_model,
    cat_batches,
    describe,
    index_batch,
    map_leaves,
    to_inputs,
)

X, Y = batch(6, seed=1)
CPU = torch.device("cpu")


def _odd_inputs() -> list[tuple[object, str]]:
    with warnings.catch_warnings():  # torch calls sparse CSR support "beta"
        warnings.simplefilter("ignore")
        csr = X.to_sparse_csr()
    return [
        (torch.empty(6, 4, device="meta"), "meta device"),
        (X.to_sparse(), "dense tensor"),
        (csr, "dense tensor"),
        (X.numpy().astype(np.longdouble), "longdouble"),
        (np.array(["2024-01-01"] * 24, dtype="datetime64[D]").reshape(6, 4), "datetime64"),
        (np.zeros((6, 4), dtype=[("a", "f4"), ("b", "i4")]), "structured"),
        (np.full((6, 4), "text"), "string"),
        (np.full((6, 4), b"bytes"), "bytes"),
        (X.numpy().astype(np.complex64), "complex"),
        (np.array([[object()] * 4] * 6, dtype=object), "numeric dtype"),
        (None, "is None"),
        ({}, "empty dict"),
        ((), "empty tuple"),
        ({"x": X, 3: X}, "non-string key"),
        ({"x": X, "mask": None}, "\\['mask'\\] is None"),
        ([X, np.zeros((6, 4), dtype="datetime64[s]")], "datetime64"),
        (np.full((6, 4), 2**63 + 5, dtype=np.uint64), "above the int64 maximum"),
    ]


@pytest.mark.parametrize("odd, message", _odd_inputs())
def test_odd_inputs_raise_invalid_batch_and_change_nothing(odd, message):
    fresh, warm = tiny_learner(), tiny_learner()
    for seed in range(2):
        warm.observe(batch(seed=seed))
    for learner in (fresh, warm):
        before = snapshot(learner)
        with pytest.raises(InvalidBatchError, match=message if learner is fresh else None):
            learner.observe((odd, Y))
        with pytest.raises(InvalidBatchError, match=message if learner is fresh else None):
            learner.predict(odd)
        assert snapshot(learner) == before
    assert fresh.input_spec is None


@pytest.mark.parametrize(
    "target, message",
    [
        (torch.zeros(6, dtype=torch.long, device="meta"), "meta device"),
        (np.array(["a"] * 6), "string"),
        (np.zeros(6, dtype=[("a", "i4")]), "structured"),
        (None, "is None"),
        (Y.to_sparse(), "dense tensor"),
    ],
)
def test_odd_targets_raise_invalid_batch_and_change_nothing(target, message):
    learner = tiny_learner()
    learner.observe(batch())
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError, match=message):
        learner.observe((X, target))
    assert snapshot(learner) == before


def test_big_endian_and_wide_unsigned_arrays_are_converted():
    learner = tiny_learner()
    big_x = X.numpy().astype(">f4")
    big_y = Y.numpy().astype(">i8")
    learner.observe((big_x, big_y))  # the first batch: no error, same numbers
    assert torch.equal(learner.predict(big_x), learner.predict(X))
    for dtype in (np.uint16, np.uint32, np.uint64, ">u4"):
        learner.observe((X.numpy(), Y.numpy().astype(dtype)))
    tokens, spec = to_inputs(np.arange(12, dtype=">u2").reshape(6, 2), spec=None, dtype=torch.float32, device=CPU)
    assert tokens.dtype == torch.int32 and tokens.tolist()[0] == [0, 1] and spec.leaf == "int"
    for dtype, wide in ((torch.uint16, torch.int32), (torch.uint32, torch.int64), (torch.uint64, torch.int64)):
        out, _ = to_inputs(torch.arange(6).reshape(3, 2).to(dtype), spec=None, dtype=torch.float32, device=CPU)
        assert out.dtype == wide and out.tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InvalidBatchError, match="above the int64 maximum"):
        to_inputs(torch.full((2, 2), -1).to(torch.uint64), spec=None, dtype=torch.float32, device=CPU)


def test_integer_and_bool_leaves_keep_their_dtype_and_float_leaves_follow_the_model():
    x = {"ids": np.arange(8).reshape(4, 2), "mask": torch.ones(4, 2, dtype=torch.bool), "feats": torch.randn(4, 3).double()}
    out, spec = to_inputs(x, spec=None, dtype=torch.float32, device=CPU)
    assert [t.dtype for t in out.values()] == [torch.int64, torch.bool, torch.float32]
    assert spec == Spec.from_json(spec.to_json()) and spec.keys == ("ids", "mask", "feats")
    with pytest.raises(InvalidBatchError, match="leaves differ in batch length"):
        to_inputs({**x, "ids": x["ids"][:3]}, spec=None, dtype=torch.float32, device=CPU)
    with pytest.raises(InvalidBatchError, match="keys"):
        to_inputs({"ids": x["ids"]}, spec=spec, dtype=torch.float32, device=CPU)
    with pytest.raises(InvalidBatchError, match="\\['ids'\\] has feature shape \\(3,\\), expected \\(2,\\)"):
        to_inputs({**x, "ids": np.zeros((4, 3), dtype=np.int64)}, spec=spec, dtype=torch.float32, device=CPU)
    reordered, _ = to_inputs(dict(reversed(list(x.items()))), spec=spec, dtype=torch.float32, device=CPU)
    assert list(reordered) == ["ids", "mask", "feats"]  # the first batch's order


def test_pytree_helpers_follow_the_structure():
    x = {"a": torch.arange(6).reshape(3, 2), "b": (torch.ones(3), [torch.zeros(3, 1)])}
    assert batch_len(x) == 3
    head = index_batch(x, slice(0, 2))
    assert head["a"].shape == (2, 2) and isinstance(head["b"], tuple) and isinstance(head["b"][1], list)
    both = cat_batches([head, index_batch(x, torch.tensor([2]))])
    assert torch.equal(both["a"], x["a"]) and describe(both) == describe(x)
    assert map_leaves(lambda t: t + 1, x)["b"][1][0].sum() == 3
    model = nn.Bilinear(2, 2, 1)
    pair = (torch.randn(3, 2), torch.randn(3, 2))
    assert torch.equal(call_model(model, pair), model(*pair))
    assert torch.equal(call_model(model, {"input1": pair[0], "input2": pair[1]}), model(*pair))


def test_tuple_inputs_are_passed_as_positional_arguments():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Embedding(10, 3)

        def forward(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.a(feats) + self.b(ids)

    model = Two()
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 10, (6,))
    learner.observe(((X, ids), Y))
    assert learner.input_spec.kind == "tuple" and learner.predict((X, ids)).shape == (6, 3)
    with pytest.raises(InvalidBatchError, match="1 items, expected 2"):
        learner.observe(((X,), Y))


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 4), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.embed(ids).mean(1), feats], dim=1))


def _dict_batch(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 20, (3, 5), generator=g), "feats": torch.randn(3, 4, generator=g)}, torch.randint(0, 3, (3,), generator=g)


def _dict_learner() -> OnlineLearner:
    from taste_cl import ReservoirReplay

    torch.manual_seed(0)
    model = _DictModel()
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(8), replay_batch_size=2)


def test_structured_samples_waiting_for_a_micro_batch_survive_a_checkpoint(tmp_path):
    straight, resumed = _dict_learner(), _dict_learner()
    for learner in (straight, resumed):
        learner.set_batch_plan(8)  # 5 stream samples and 3 replayed: batches of 3 leave samples waiting
        for seed in range(3):
            learner.observe(_dict_batch(seed))
    assert resumed.batcher.pending is not None and set(resumed.batcher.pending[0]) == {"ids", "feats"}
    resumed.save(tmp_path)
    torch.manual_seed(123)  # load restores the RNG
    model = _DictModel()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert resumed.batcher.pending[0]["ids"].dtype == torch.int64
    for seed in range(3, 6):
        straight.observe(_dict_batch(seed))
        resumed.observe(_dict_batch(seed))
    x, _ = _dict_batch(99)
    assert torch.equal(straight.predict(x), resumed.predict(x))
    stored_x, _ = resumed.replay.sample(4)
    assert stored_x["ids"].dtype == torch.int64 and stored_x["feats"].dtype == torch.float32


def test_the_plain_input_path_copies_exactly_what_the_full_validation_accepts_unchanged():
    from taste_cl._batch import Spec, _copy_if_plain, to_inputs

    spec, cpu, f32 = Spec("tensor", "float", "", (3, 2)), torch.device("cpu"), torch.float32
    x = torch.randn(4, 2, 3).transpose(1, 2)  # non-contiguous, still plain
    copied = _copy_if_plain(x, spec, dtype=f32, device=cpu)
    assert copied is not None and copied.is_contiguous() and torch.equal(copied, x)
    assert copied.data_ptr() != x.data_ptr() and torch.equal(copied, to_inputs(x, spec=spec, dtype=f32, device=cpu)[0])
    nan = torch.zeros(4, 3, 2)
    nan[1, 2, 0] = float("nan")
    for odd in (
        x.double(),  # converted by the full path
        torch.ones(4, 3, 2, dtype=torch.long),
        torch.zeros(4, 3, 3),  # wrong feature shape: the full path explains
        torch.zeros(0, 3, 2),
        nan,
        torch.zeros(4, 3, 2, requires_grad=True),
        nn.Parameter(torch.zeros(4, 3, 2)),
        x.numpy(),
    ):
        assert _copy_if_plain(odd, spec, dtype=f32, device=cpu) is None
    assert _copy_if_plain(x, Spec("tensor", "int", "int64", (3, 2)), dtype=f32, device=cpu) is None


def test_the_plain_label_path_agrees_with_the_full_checks():
    from taste_cl.tasks import Classification

    task, cpu = Classification(), torch.device("cpu")
    y = torch.tensor([0, 2, 1, 2])
    targets = task.to_targets(y, n=4, output_shape=(3,), dtype=torch.float32, device=cpu)
    assert torch.equal(targets, y) and targets.data_ptr() != y.data_ptr()
    for bad, message in ((torch.tensor([0, 3, 1, 2]), "label 3 out of range"), (torch.tensor([0, -1, 1, 2]), "label -1 out of range")):
        with pytest.raises(InvalidBatchError, match=message):
            task.to_targets(bad, n=4, output_shape=(3,), dtype=torch.float32, device=cpu)
    with pytest.raises(InvalidBatchError, match="lengths differ|must be"):
        task.to_targets(y, n=5, output_shape=(3,), dtype=torch.float32, device=cpu)
