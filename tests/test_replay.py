from __future__ import annotations

import pytest
import torch

from taste_cl import BufferStorage, ClassBalancedReplay, InvalidBatchError, ReservoirReplay
from taste_cl.testing import check_replay_strategy


@pytest.mark.parametrize("strategy", [ReservoirReplay(1), ReservoirReplay(7), ClassBalancedReplay(1), ClassBalancedReplay(9)])
def test_builtin_strategies_meet_the_contract(strategy):
    check_replay_strategy(strategy)


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
    assert sorted(buffer.labels.tolist()) == [0] * 4 + [1] * 3 + [2] * 3


def test_class_balanced_is_uniform_within_a_class_even_after_quota_shrinks():
    n = 40
    labels = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(8, dtype=torch.long)])
    frequency = _retention_frequency(lambda seed: ClassBalancedReplay(8, seed=seed), n + 8, 1500, 4, labels)
    # class 0 shrinks from 8 to 4 slots when class 1 arrives: each of its samples kept w.p. 4/40
    assert (frequency[:n] - 4 / n).abs().max() < 0.04
    assert torch.all(frequency[n:] > 0.3)  # 4 of the 8 class-1 samples are kept


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


def test_storage_remove_keeps_slots_contiguous():
    storage = BufferStorage(4)
    storage.append(torch.arange(4.0).unsqueeze(1), torch.arange(4))
    assert storage.remove(1) == 3
    assert len(storage) == 3 and storage.labels.tolist() == [0, 3, 2]
    assert storage.remove(2) is None
