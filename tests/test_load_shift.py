"""Hardware load shift: other work starts mid-stream; the learner keeps learning and the tuner retunes.

The tuner sees the machine's load through two readings: other processes' CPU share (its
:class:`~taste_cl.tuning.load.LoadMeter`) and its own training rate (the step time of each
``observe``). Both are injected here, so the outcome does not depend on how busy the test
machine is; the learner, its steps and the tuner's probes are real. (How quickly real CPU
hogs show on a given machine is a measurement, not a test.)
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import batch, tiny_learner

from taste_cl.tuning.load import LoadMeter
from taste_cl.tuning.tuner import BatchSizeTuner

QUIET_RATE, BUSY_RATE = 4000.0, 1000.0  # training samples/s before and while other work runs
QUIET_LOAD, BUSY_LOAD = 0.05, 0.9  # other processes' share of the CPU


@dataclasses.dataclass
class Machine:
    """What the tuner reads of the machine."""

    rate: float = QUIET_RATE
    foreign: float = QUIET_LOAD


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "rate, foreign, reason",
    [
        (BUSY_RATE, QUIET_LOAD, "load shift: training rate 2500 samples/s vs baseline 4000 (x0.62)"),
        (QUIET_RATE, BUSY_LOAD, "load shift: foreign CPU load went from idle to busy"),
        (BUSY_RATE, BUSY_LOAD, "load shift: training rate 2500 samples/s vs baseline 4000 (x0.62)"),
    ],
    ids=["slower-steps", "foreign-load", "both"],
)
def test_learner_keeps_learning_and_retunes_when_other_work_starts(tmp_path, monkeypatch, one_thread, rate, foreign, reason):
    """Three readings of the six-step window after the shift move its median (half new, half old), and
    that retunes, once; once the machine is quiet again the new baseline holds and nothing else retunes."""
    machine = Machine()
    monkeypatch.setattr(LoadMeter, "read", lambda self: machine.foreign)
    tuner = BatchSizeTuner(
        max_batch_size=32, n_calls=3, n_initial_points=2, warm_calls=1, min_probe_time=0.02,
        calibration_window=6, load_tolerance=0.3, retune_on_drift=False, min_retune_interval=20, cache_dir=tmp_path,
    )  # fmt: skip
    observed = tuner.after_observe

    def after_observe(learner, stats, **kwargs):  # each step lasts what it would at the machine's rate
        observed(learner, dataclasses.replace(stats, step_time_s=stats.micro_batches * stats.batch_size / machine.rate), **kwargs)

    monkeypatch.setattr(tuner, "after_observe", after_observe)
    learner = tiny_learner(replay_capacity=50, plugins=[tuner])
    shifts = []
    learner.monitor.subscribe(shifts.append, event="load_shift")
    losses = [learner.observe(batch(seed=i)).loss for i in range(60)]  # tune, then calibrate the baseline
    assert [h["reason"] for h in tuner.history_] == ["first batch"]  # a steady machine never retunes
    machine.rate, machine.foreign = rate, foreign
    i = 60
    while len(tuner.history_) == 1 and i < 100:
        losses.append(learner.observe(batch(seed=i)).loss)
        i += 1
    machine.rate, machine.foreign = QUIET_RATE, QUIET_LOAD
    for j in range(30):
        losses.append(learner.observe(batch(seed=i + j)).loss)
    learner.monitor.dispatch()
    assert [h["reason"] for h in tuner.history_] == ["first batch", reason]
    assert len(shifts) == 1 and learner.samples_seen == 8 * (i + 30)
    finite = [loss for loss in losses if loss is not None]  # None only while samples wait for a micro-batch
    assert finite and all(math.isfinite(loss) for loss in finite)
    assert all(torch.isfinite(p).all() for p in learner.model.parameters())
