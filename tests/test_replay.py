from __future__ import annotations

import pytest
import torch

from taste_cl import (
    BufferStorage,
    ClassBalancedReplay,
    InvalidBatchError,
    OnlineLearner,
    ReplayStrategy,
    ReservoirReplay,
)
from taste_cl.testing import check_replay_strategy


@pytest.mark.parametrize("strategy", [ReservoirReplay(1), ReservoirReplay(7), ClassBalancedReplay(1), ClassBalancedReplay(9)])
def test_builtin_strategies_meet_the_contract(strategy):
    check_replay_strategy(strategy)


@pytest.mark.parametrize("make", [lambda: ReservoirReplay(6), lambda: ClassBalancedReplay(7)])
def test_builtin_strategies_meet_the_contract_on_structured_samples(make):
    check_replay_strategy(make(), structured=True)


@pytest.mark.parametrize("cls", [ReservoirReplay, ClassBalancedReplay])
@pytest.mark.parametrize("capacity, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_capacity_is_rejected(cls, capacity, error):
    with pytest.raises(error, match="capacity"):
        cls(capacity)


def _retention_frequency(make, n_stream: int, trials: int, batch: int, labels=None) -> torch.Tensor:
    """How often each stream position ends up in the buffer, over independent seeds."""
    kept = torch.zeros(n_stream)
    for trial in range(trials):
        buffer = make(trial)
        ids = torch.arange(n_stream, dtype=torch.float32).unsqueeze(1)
        y = torch.zeros(n_stream, dtype=torch.long) if labels is None else labels
        for start in range(0, n_stream, batch):
            buffer.add(ids[start : start + batch], y[start : start + batch])
        stored, _ = buffer.sample(len(buffer))
        kept[stored.squeeze(1).long()] += 1
    return kept / trials


@pytest.mark.parametrize("batch", [1, 7, 60])
def test_reservoir_keeps_every_position_with_equal_probability(batch):
    frequency = _retention_frequency(lambda seed: ReservoirReplay(10, seed=seed), 60, 1500, batch)
    expected = 10 / 60
    # binomial std for 1500 trials is ~0.0096; 5 sigma bound, early and late positions alike
    assert (frequency - expected).abs().max() < 0.05
    assert abs(frequency[:30].mean() - frequency[30:].mean()) < 0.02


def test_reservoir_fills_before_replacing():
    buffer = ReservoirReplay(5)
    buffer.add(torch.arange(3.0).unsqueeze(1), torch.zeros(3, dtype=torch.long))
    assert len(buffer) == 3 and buffer.seen == 3
    buffer.add(torch.arange(3.0, 10.0).unsqueeze(1), torch.zeros(7, dtype=torch.long))
    assert len(buffer) == 5 and buffer.seen == 10


def test_class_balanced_splits_capacity_evenly_across_seen_classes():
    buffer = ClassBalancedReplay(10)
    for label in range(3):
        buffer.add(torch.randn(50, 2), torch.full((50,), label))
        counts = buffer.class_counts()
        assert sum(counts.values()) == min(10, 50 * (label + 1))
        assert max(counts.values()) - min(counts.values()) <= 1
    assert buffer.class_counts() == {0: 4, 1: 3, 2: 3}
    assert [buffer.quota(label) for label in range(3)] == [4, 3, 3]
    assert sorted(buffer.labels.tolist()) == [0] * 4 + [1] * 3 + [2] * 3
    with pytest.raises(KeyError, match="class 7 has not been seen"):
        buffer.quota(7)


def test_class_balanced_is_uniform_within_a_class_even_after_quota_shrinks():
    n = 40
    labels = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(8, dtype=torch.long)])
    frequency = _retention_frequency(lambda seed: ClassBalancedReplay(8, seed=seed), n + 8, 1500, 4, labels)
    # class 0 shrinks from 8 to 4 slots when class 1 arrives: each of its samples kept w.p. 4/40
    assert (frequency[:n] - 4 / n).abs().max() < 0.04
    assert torch.all(frequency[n:] > 0.3)  # 4 of the 8 class-1 samples are kept


def test_class_balanced_keeps_the_same_samples_of_a_seeded_stream():
    # pinned (numpy PCG64 draws, taste_cl.replay.draws, the same on every engine): classes arriving
    # mid-batch, appends, evictions and in-class reservoir writes
    buffer = ClassBalancedReplay(6, seed=0)
    labels = [0, 0, 1, 0, 1, 1, 2, 0, 2, 1, 0, 2, 2, 1, 0, 3, 3, 0, 1, 2, 3, 1, 0, 2, 3, 3, 1, 0, 2, 1]
    for start in range(0, 30, 5):
        buffer.add(torch.arange(start, start + 5.0).unsqueeze(1), torch.tensor(labels[start : start + 5]))
    x, y, _ = buffer.contents()
    assert x.squeeze(1).tolist() == [10, 2, 14, 4, 19, 15]
    assert y.tolist() == [0, 1, 0, 1, 2, 3]


def test_state_round_trip_preserves_contents_and_continuation():
    buffer = ClassBalancedReplay(6, seed=3)
    buffer.add(torch.randn(20, 3), torch.randint(0, 3, (20,)))
    clone = ClassBalancedReplay(6, seed=99)
    clone.load_state_dict(buffer.state_dict())
    batch = (torch.randn(10, 3), torch.randint(0, 4, (10,)))
    buffer.add(*batch)
    clone.add(*batch)
    assert clone.class_counts() == buffer.class_counts()
    assert all(torch.equal(a, b) for a, b in zip(buffer.sample(6), clone.sample(6)))


def test_load_state_with_other_capacity_is_rejected():
    buffer = ReservoirReplay(4)
    buffer.add(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="capacity"):
        ReservoirReplay(5).load_state_dict(buffer.state_dict())


@pytest.mark.parametrize(
    "x, y, message",
    [
        (torch.randn(3, 2), torch.zeros(2, dtype=torch.long), "same n"),
        (torch.randn(3, 5), torch.zeros(3, dtype=torch.long), "feature shape"),
        (torch.randn(3, 2), torch.zeros(3), "int64"),
        (torch.full((3, 2), float("nan")), torch.zeros(3, dtype=torch.long), "non-finite"),
        ([[1.0, 2.0]], torch.zeros(1, dtype=torch.long), "torch tensors"),
    ],
)
def test_bad_batches_raise_and_leave_the_buffer_unchanged(x, y, message):
    buffer = ReservoirReplay(4)
    buffer.add(torch.randn(6, 2), torch.zeros(6, dtype=torch.long))
    before = buffer.state_dict()
    with pytest.raises(InvalidBatchError, match=message):
        buffer.add(x, y)
    after = buffer.state_dict()
    assert after["seen"] == before["seen"]
    assert torch.equal(after["storage"]["x"], before["storage"]["x"])
    assert torch.equal(after["generator"], before["generator"])


def test_sampling_an_empty_buffer_says_so():
    with pytest.raises(ValueError, match="empty"):
        ReservoirReplay(3).sample(1)


def test_storage_keep_packs_the_kept_slots_in_order():
    storage = BufferStorage(5)
    storage.append(torch.arange(5.0).unsqueeze(1), torch.arange(5))
    storage.keep(torch.tensor([4, 1, 3]))
    assert len(storage) == 3 and storage.labels.tolist() == [4, 1, 3]
    assert storage.gather(torch.arange(3))[0].flatten().tolist() == [4.0, 1.0, 3.0]
    storage.append(torch.tensor([[9.0]]), torch.tensor([9]))  # the freed slots are reused
    assert storage.labels.tolist() == [4, 1, 3, 9]


def test_storage_converts_later_float_batches_to_the_stored_dtype_but_rejects_integer_features():
    buffer = ReservoirReplay(4)
    buffer.add(torch.randn(4, 2), torch.zeros(4, dtype=torch.long))  # full: later adds overwrite
    buffer.add(torch.full((50, 2), 7.0, dtype=torch.float64), torch.ones(50, dtype=torch.long))
    x, y = buffer.sample(4)
    assert x.dtype == torch.float32 and (x == 7.0).any() and (y == 1).any()
    with pytest.raises(InvalidBatchError, match="dtype torch.int64"):
        buffer.add(torch.ones(2, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("make", [lambda: ReservoirReplay(8, seed=5), lambda: ClassBalancedReplay(8, seed=5)])
def test_add_validated_stores_exactly_what_add_stores(make):
    checked, trusted = make(), make()
    for start in range(0, 60, 6):
        x, y = torch.randn(6, 3, generator=torch.Generator().manual_seed(start)), torch.arange(start, start + 6) % 4
        checked.add(x, y)
        trusted.add_validated(x, y)
    assert len(checked) == len(trusted) == 8
    assert all(torch.equal(a, b) for a, b in zip(checked.sample(8), trusted.sample(8)))


def test_a_strategy_with_only_add_gets_the_learners_batches_through_the_default_add_validated():
    class KeepAll(ReplayStrategy):  # implements add, not add_validated
        def __init__(self) -> None:
            self.offered: list[tuple[torch.Tensor, torch.Tensor]] = []

        def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.offered.append((x.clone(), y.clone()))

        def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = torch.cat([x for x, _ in self.offered]), torch.cat([y for _, y in self.offered])
            return x[:n].clone(), y[:n].clone()

        def __len__(self) -> int:
            return sum(y.shape[0] for _, y in self.offered)

    replay = KeepAll()
    learner = OnlineLearner(torch.nn.Linear(3, 2), replay=replay, replay_batch_size=4)
    batches = [(torch.randn(5, 3), torch.randint(0, 2, (5,))) for _ in range(3)]
    for batch in batches:
        learner.observe(batch)
    assert len(replay.offered) == 3
    assert all(torch.equal(x, bx) and torch.equal(y, by) for (x, y), (bx, by) in zip(replay.offered, batches))


def _structured(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {"ids": torch.randint(0, 50, (n, 5), generator=g), "mask": torch.rand(n, 5, generator=g) > 0.5}
    return x, torch.randn(n, 2, generator=g)  # regression targets


@pytest.mark.parametrize("make", [lambda: ReservoirReplay(6, seed=1), lambda: ClassBalancedReplay(6, seed=1)])
def test_extra_fields_are_stored_with_their_samples_and_survive_a_checkpoint(make):
    buffer = make()
    for start in range(0, 40, 5):
        x = torch.arange(start, start + 5, dtype=torch.float32).unsqueeze(1)
        y = torch.arange(start, start + 5) % 3
        buffer.add(x, y, logits=x.repeat(1, 3) * 10, step=torch.full((5,), start))
    x, y, fields = buffer.sample(6, with_fields=True)
    assert set(fields) == {"logits", "step"} and fields["logits"].shape == (6, 3)
    assert torch.equal(fields["logits"], x.repeat(1, 3) * 10)  # each field row belongs to its sample
    assert torch.equal(fields["step"], (x.squeeze(1) // 5 * 5).long())
    restored = make()
    restored.load_state_dict(buffer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.sample(6, with_fields=True)[2].values(), buffer.sample(6, with_fields=True)[2].values()))
    before = buffer.state_dict()
    with pytest.raises(InvalidBatchError, match="fields"):
        buffer.add(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))  # the fields are missing
    with pytest.raises(InvalidBatchError, match="field 'logits' has shape \\(2,\\)"):
        buffer.add(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), logits=torch.zeros(2, 2), step=torch.zeros(2, dtype=torch.long))
    from taste_cl.testing import states_equal

    assert states_equal(buffer.state_dict(), before)


def test_reservoir_stores_structured_samples_with_float_targets_leaf_by_leaf():
    buffer = ReservoirReplay(4, seed=0)
    for seed in range(5):
        buffer.add(*_structured(3, seed))
    x, y = buffer.sample(4)
    assert x["ids"].dtype == torch.int64 and x["mask"].dtype == torch.bool and y.dtype == torch.float32
    assert x["ids"].shape == (4, 5) and y.shape == (4, 2)
    state = buffer.state_dict()["storage"]
    assert state["x_spec"]["kind"] == "dict" and [t.dtype for t in state["x"]] == [torch.int64, torch.bool]
    with pytest.raises(InvalidBatchError, match="keys"):
        buffer.add({"ids": x["ids"]}, y)
    with pytest.raises(InvalidBatchError, match="\\['mask'\\] is a int leaf"):
        buffer.add({"ids": x["ids"], "mask": x["mask"].long()}, y)


def test_class_balanced_replay_refuses_targets_that_are_not_class_labels():
    with pytest.raises(InvalidBatchError, match="integer class labels y of shape \\(n,\\)"):
        ClassBalancedReplay(4).add(*_structured(3, 0))


@pytest.mark.parametrize("kind", [ReservoirReplay, ClassBalancedReplay])
def test_add_batches_leaves_the_buffer_each_add_leaves(kind):
    """Joined runs equal one add per batch, also when a class first appears mid-run and its
    registration evicts with a draw from the buffer's generator."""
    from taste_cl.testing import states_equal

    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(12):
        n = 3 + i % 5
        labels = torch.randint(0, 2 + i // 3, (n,), generator=g)  # a new class every few batches
        batches.append((torch.randn(n, 3, generator=g), labels, {"sid": torch.arange(10 * i, 10 * i + n)}))
    joined, one_by_one = kind(9, seed=1), kind(9, seed=1)
    joined.add_batches(batches[:7])
    joined.add_batches(batches[7:])
    for x, y, fields in batches:
        one_by_one.add_validated(x, y, **fields)
    assert states_equal(joined.state_dict(), one_by_one.state_dict())
