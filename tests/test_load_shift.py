"""Hardware load shift: CPU hogs start mid-stream; the learner keeps learning and the tuner retunes."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import batch, tiny_learner

from taste_cl.tuning.tuner import BatchSizeTuner

HOG = "import time\nend = time.monotonic() + 10\nwhile time.monotonic() < end: pass"  # self-terminating


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_learner_keeps_learning_and_retunes_when_cpu_hogs_start(tmp_path, one_thread):
    tuner = BatchSizeTuner(
        max_batch_size=32, n_calls=3, n_initial_points=2, warm_calls=1, min_probe_time=0.02,
        calibration_window=6, load_tolerance=0.3, retune_on_drift=False, min_retune_interval=20, cache_dir=tmp_path,
    )
    learner = tiny_learner(replay_capacity=50, plugins=[tuner])
    losses = [learner.observe(batch(seed=i)).loss for i in range(60)]  # tune, then calibrate the baseline
    tunes_before, seen_before = len(tuner.history_), learner.samples_seen
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        deadline, i = time.monotonic() + 8, 60
        while time.monotonic() < deadline and not any(
            h["reason"].startswith("load shift") for h in list(tuner.history_)[tunes_before:]
        ):
            losses.append(learner.observe(batch(seed=i)).loss)
            i += 1
        seen_under_load = learner.samples_seen - seen_before
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    for j in range(30):
        losses.append(learner.observe(batch(seed=i + j)).loss)
    reasons = [h["reason"] for h in list(tuner.history_)[tunes_before:]]
    assert any(r.startswith("load shift") for r in reasons), f"no retune after the hogs started: {reasons}"
    assert seen_under_load > 0 and learner.samples_seen == 8 * (60 + (i - 60) + 30)
    finite = [loss for loss in losses if loss is not None]  # None only while samples wait for a micro-batch
    assert finite and all(math.isfinite(loss) for loss in finite)
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())
    print(f"\nretunes after the hogs started: {reasons}; {seen_under_load} samples learned under load")
