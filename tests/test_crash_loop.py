"""SIGKILL at random moments while checkpoints and tuner caches are being written, in a bounded loop.

Each round forks a child that resumes from the last checkpoint and then alternates
``observe``, ``save`` and a tuner-cache write as fast as it can; the parent kills it
at a random time. After every kill the checkpoint must load and resume, with
``samples_seen`` never going back, and the cache must read back without a warning.
Two rounds in three first wait for one or two of the child's saves to complete (it
reports each through a pipe), so the children make progress however slow the machine is.
"""

from __future__ import annotations

import os
import random
import select
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import batch, tiny_learner

from taste_cl import OnlineLearner
from taste_cl.state.checkpoint import CHECKPOINT_FILE
from taste_cl.tuning.cache import CachedSurface, SurrogateCache

ROUNDS = 20
KEY = "crash-test"


def _resume(directory: Path) -> OnlineLearner:
    fresh = tiny_learner()
    return OnlineLearner.load(directory, model=fresh.model, optimizer=fresh.optimizer)


def _child(directory: Path, cache: SurrogateCache, saved: int) -> None:
    """Resume, then observe, save (reported by a byte on the pipe ``saved``) and write the cache, forever."""
    learner = _resume(directory)
    count = learner.samples_seen
    while True:
        learner.observe(batch(seed=count))
        count = learner.samples_seen
        learner.save(directory)
        os.write(saved, b".")
        cache.save(KEY, CachedSurface(1, [(1 + i % 64, 1, float(count + i)) for i in range(count % 64 + 1)]))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_sigkill_during_saves_never_leaves_an_unloadable_checkpoint(tmp_path):
    directory, cache = tmp_path / "ckpt", SurrogateCache(tmp_path / "cache")
    learner = tiny_learner()
    learner.observe(batch())
    learner.save(directory)
    cache.save(KEY, CachedSurface(1, [(1, 1, 1.0)]))
    rng = random.Random(0)
    last_seen, mid_write = learner.samples_seen, 0
    for round_ in range(ROUNDS):
        saved, report = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            try:
                os.close(saved)
                torch.set_num_threads(1)
                _child(directory, cache, report)
            finally:
                os._exit(1)
        os.close(report)
        try:
            for _ in range(round_ % 3):  # let whole saves land first: progress must not depend on the machine's speed
                assert select.select([saved], [], [], 120)[0] and os.read(saved, 1), "the child completed no save in 120 s"
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.close(saved)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "child died before the kill"
        leftovers = [p for p in directory.iterdir() if p.name != CHECKPOINT_FILE]
        mid_write += bool(leftovers) or any(p.suffix == ".tmp" for p in cache.directory.iterdir())
        for stale in leftovers + [p for p in cache.directory.iterdir() if p.suffix == ".tmp"]:
            stale.unlink()  # a killed writer cannot clean up its temp file; count it and clear it
        resumed = _resume(directory)
        assert resumed.samples_seen >= last_seen
        last_seen = resumed.samples_seen
        resumed.observe(batch(seed=1))  # and it trains on
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            surface = cache.load(KEY)
        assert surface is not None and surface.observations and all(b >= 1 and s > 0 for b, _, s in surface.observations)
    assert last_seen > learner.samples_seen  # the children made progress across kills
    print(f"\n{ROUNDS} SIGKILLs, {mid_write} landed while a temp file was open; checkpoint reached {last_seen} samples")
