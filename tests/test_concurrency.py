"""Threads calling observe, predict and save at once: no lost sample, no corrupt buffer, no deadlock."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import batch, tiny_learner

from taste_cl import OnlineLearner

OBSERVERS, OBSERVES_EACH, PREDICTORS, PREDICTS_EACH, BATCH = 4, 300, 2, 500, 8
TIMEOUT_S = 120  # a deadlock fails the test instead of hanging it


def _run_threads(targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as error:  # reported by the test, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), f"deadlock: threads still running after {TIMEOUT_S} s"
    return errors


@pytest.mark.parametrize("micro_batch", [None, 12])
def test_concurrent_observe_predict_and_save(tmp_path, micro_batch):
    learner = tiny_learner(replay_capacity=50)
    learner.observe(batch(BATCH, seed=0))
    if micro_batch:
        learner.set_batch_plan(micro_batch, accumulation_steps=2)  # samples wait in the pending queue
    start_seen = learner.samples_seen
    predictions: list[int] = []

    def observer(worker: int):
        return lambda: [learner.observe(batch(BATCH, seed=1000 * worker + i)) for i in range(OBSERVES_EACH)]

    def predictor():
        for i in range(PREDICTS_EACH):
            out = learner.predict(batch(3, seed=i)[0])
            assert out.shape == (3, 3) and torch.isfinite(out).all()
            predictions.append(1)

    def saver():
        for i in range(5):
            learner.save(tmp_path / f"ckpt{i % 2}")

    errors = _run_threads([observer(w) for w in range(OBSERVERS)] + [predictor] * PREDICTORS + [saver])
    assert errors == []
    total = OBSERVERS * OBSERVES_EACH * BATCH
    assert learner.samples_seen - start_seen == total
    assert len(predictions) == PREDICTORS * PREDICTS_EACH
    pending = 0 if learner.batcher.pending is None else learner.batcher.pending[0].shape[0]
    assert learner.replay.seen + pending == start_seen + total  # every sample reached the buffer or waits for it
    assert learner.monitor.samples_seen + pending == learner.samples_seen
    labels = learner.replay.labels
    assert len(learner.replay) == learner.replay.capacity and labels.min() >= 0 and labels.max() < 3
    state = learner.replay.state_dict()["storage"]
    assert state["x"].shape == (50, 4) and torch.isfinite(state["x"]).all()
    for i in range(2):  # every checkpoint written under contention loads
        OnlineLearner.load(tmp_path / f"ckpt{i}", model=tiny_learner().model)


def test_every_buffered_sample_is_a_whole_sample_that_was_fed():
    """No torn rows: each stored (x, y) is one sample some thread observed, label included."""
    learner = tiny_learner(replay_capacity=30)
    feeds = {w: [batch(BATCH, seed=100 * w + i) for i in range(50)] for w in range(4)}
    errors = _run_threads([lambda w=w: [learner.observe(b) for b in feeds[w]] for w in feeds])
    assert errors == [] and learner.replay.seen == 4 * 50 * BATCH
    fed = {tuple(x.tolist()) + (int(y),) for bs in feeds.values() for xb, yb in bs for x, y in zip(xb, yb)}
    stored = learner.replay.state_dict()["storage"]
    assert all(tuple(x.tolist()) + (int(y),) in fed for x, y in zip(stored["x"], stored["y"]))
