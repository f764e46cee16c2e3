from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import batch, snapshot, tiny_learner
from torch import nn

from taste_cl import CheckpointError, ClassBalancedReplay, OnlineLearner
from taste_cl.exceptions import CheckpointNotFoundError
from taste_cl.state import checkpoint, files
from taste_cl.state.checkpoint import CHECKPOINT_FILE, write_checkpoint

TESTS = Path(__file__).parent


def _params(learner: OnlineLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def _fresh_parts():
    torch.manual_seed(123)  # different init: load must overwrite it
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_save_load_continue_equals_an_uninterrupted_run(tmp_path):
    uninterrupted = tiny_learner()
    for seed in range(20):
        uninterrupted.observe(batch(seed=seed))

    torch.manual_seed(7)
    first_half = tiny_learner()
    for seed in range(10):
        first_half.observe(batch(seed=seed))
    first_half.save(tmp_path)
    torch.manual_seed(999)  # the process that resumes has another global RNG state
    model, optimizer = _fresh_parts()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=optimizer)
    for seed in range(10, 20):
        resumed.observe(batch(seed=seed))
    assert all(torch.equal(a, b) for a, b in zip(_params(uninterrupted), _params(resumed)))
    assert resumed.monitor.report() == uninterrupted.monitor.report()
    assert torch.equal(resumed.replay.sample(5)[0], uninterrupted.replay.sample(5)[0])


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS)!r})
        from helpers import batch, tiny_learner
        learner = tiny_learner()
        for seed in range(10):
            learner.observe(batch(seed=seed))
        learner.save({str(tmp_path)!r})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    uninterrupted = tiny_learner()
    for seed in range(20):
        uninterrupted.observe(batch(seed=seed))
    model, optimizer = _fresh_parts()
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=optimizer)  # restores the global RNG too
    for seed in range(10, 20):
        resumed.observe(batch(seed=seed))
    assert all(torch.equal(a, b) for a, b in zip(_params(uninterrupted), _params(resumed)))


def test_class_balanced_buffer_and_counters_survive(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    learner = OnlineLearner(model, replay=ClassBalancedReplay(9, seed=1))
    for seed in range(5):
        learner.observe(batch(seed=seed))
    learner.save(tmp_path)
    loaded = OnlineLearner.load(tmp_path, model=nn.Linear(4, 3))
    assert isinstance(loaded.replay, ClassBalancedReplay)
    assert loaded.replay.class_counts() == learner.replay.class_counts()
    assert (loaded.samples_seen, loaded.steps, loaded.input_shape) == (40, 5, (4,))
    assert snapshot(loaded) == snapshot(learner)


def _saved(tmp_path) -> Path:
    learner = tiny_learner()
    learner.observe(batch())
    learner.save(tmp_path)
    return tmp_path / CHECKPOINT_FILE


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.unlink(), "does not exist"),
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "checksum mismatch"),
        (lambda p: p.write_bytes(b""), "bad header"),
        (lambda p: p.write_bytes(b"garbage" * 10), "bad header"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "checksum mismatch"),
    ],
)
def test_damaged_checkpoints_give_clear_errors_and_leave_the_model_alone(tmp_path, damage, message):
    path = _saved(tmp_path)
    damage(path)
    model, optimizer = _fresh_parts()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=model, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _signed(body: bytes, magic: bytes = checkpoint._MAGIC) -> bytes:
    return magic + hashlib.sha256(body).digest() + body


def _pickle_cases() -> list[tuple[str, bytes, str]]:
    """Correctly checksummed files whose payload would run a command if anything unpickled it."""
    evil = pickle.dumps({"format": 2, "evil": _Payload()}, protocol=2)
    header = json.dumps({"tree": {"format": 2, "x": {"$tensor": "t0"}}}).encode()
    return [
        ("raw pickle as the body", _signed(evil), "malformed header"),
        ("pickle in the tensor section", _signed(len(header).to_bytes(8, "little") + header + evil), "malformed tensor section"),
        ("pickle as the JSON header", _signed(len(evil).to_bytes(8, "little") + evil), "malformed header"),
        ("format-1 file (torch.save pickle)", _signed(evil, magic=b"TASTECL1"), "format-1 .pickle-based."),
    ]


@pytest.mark.parametrize("case", _pickle_cases(), ids=lambda case: case[0])
def test_a_malicious_pickle_payload_is_refused_not_executed(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    _, data, message = case
    (tmp_path / CHECKPOINT_FILE).write_bytes(data)
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=nn.Linear(4, 3))
    assert not (tmp_path / "PWNED").exists()


def test_no_pickle_based_loader_is_left_in_the_package():
    sources = list((TESTS.parent / "taste_cl").rglob("*.py"))
    offenders = [str(p) for p in sources if re.search(r"torch\.load\(|pickle\.loads?\(|import pickle", p.read_text())]
    assert sources and offenders == []


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    learner = tiny_learner()
    learner.observe(batch())
    learner.save(tmp_path)
    good = (tmp_path / CHECKPOINT_FILE).read_bytes()
    learner.observe(batch(seed=1))

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        learner.save(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]  # no temp file left


def test_mismatched_model_or_optimizer_is_rejected_and_rolled_back(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="section `model`: `model` keys differ"):
        OnlineLearner.load(tmp_path, model=nn.Linear(4, 3))
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    with pytest.raises(CheckpointError, match="holds 'SGD' state; got a Adam optimizer"):
        OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.Adam(model.parameters()))


def _fresh_from_its_loop(stale_grads: bool) -> OnlineLearner:
    """A model whose first layer is frozen (a pretrained backbone); ``stale_grads``: it comes
    straight out of its own training loop, gradients still set on every parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    if stale_grads:
        x, y = batch(seed=1)
        nn.functional.cross_entropy(model(x), y).backward()
    model[0].requires_grad_(False)
    return OnlineLearner(model, optimizer=torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9))


def test_gradients_left_by_training_before_the_learner_are_dropped(tmp_path):
    """They were added to the first step, and on the frozen part stayed in every checkpoint,
    which load refused ('grads are set but no micro-batch is accumulated')."""
    clean, stale = _fresh_from_its_loop(False), _fresh_from_its_loop(True)
    for learner in (clean, stale):
        learner.observe(batch(seed=2))
    assert snapshot(stale) == snapshot(clean)
    stale.save(tmp_path)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).requires_grad_(False)
    resumed = OnlineLearner.load(tmp_path, model=model, optimizer=torch.optim.SGD(model[2].requires_grad_().parameters(), lr=0.1, momentum=0.9))
    assert snapshot(resumed) == snapshot(stale)


def test_unknown_format_and_custom_replay_need_explicit_handling(tmp_path):
    write_checkpoint(tmp_path, {"format": 99})
    with pytest.raises(CheckpointError, match="format 99"):
        OnlineLearner.load(tmp_path, model=nn.Linear(4, 3))


def test_a_missing_checkpoint_is_also_a_file_not_found_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as caught:
        OnlineLearner.load(tmp_path / "nowhere", model=nn.Linear(4, 3))
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, CheckpointError)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_save_removes_temp_files_of_dead_writers_only(tmp_path):
    learner = tiny_learner()
    learner.observe(batch())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = files.host_tag()
        stale = tmp_path / f".{CHECKPOINT_FILE}.{host}.{_dead_pid()}.abc123.tmp"
        in_flight = tmp_path / f".{CHECKPOINT_FILE}.{host}.{live.pid}.def456.tmp"
        other_host = tmp_path / f".{CHECKPOINT_FILE}.elsewhere.{_dead_pid()}.0a0a0a.tmp"
        foreign = tmp_path / f".{CHECKPOINT_FILE}.notapid.tmp"
        for path in (stale, in_flight, other_host, foreign):
            path.write_bytes(b"half a checkpoint")
        learner.save(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT_FILE, in_flight.name, other_host.name, foreign.name])
    finally:
        live.kill()
        live.wait()


WRITERS, SAVES_EACH = 4, 20


def _writer(directory: Path, worker: int, go: float) -> None:
    """Child process: wait for the common start time, then save 20 times into ``directory``."""
    torch.set_num_threads(1)
    learner = tiny_learner()
    learner.observe(batch(seed=worker))
    while time.time() < go:
        time.sleep(0.001)
    failures = 0
    for i in range(SAVES_EACH):
        learner.samples_seen = 1000 * worker + i  # tells the files apart
        try:
            learner.save(directory)
        except Exception as error:  # counted and reported through the exit code
            print(f"writer {worker} save {i}: {error!r}", file=sys.stderr)
            failures += 1
    os._exit(min(failures, 100))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_four_processes_saving_to_one_folder_never_fail_and_leave_one_complete_checkpoint(tmp_path):
    go = time.time() + 0.5
    pids = []
    for worker in range(WRITERS):
        pid = os.fork()
        if pid == 0:
            try:
                _writer(tmp_path, worker, go)
            finally:
                os._exit(101)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    assert [os.waitstatus_to_exitcode(s) for s in statuses] == [0] * WRITERS  # 80 saves, none failed
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]  # no temp file left behind
    loaded = OnlineLearner.load(tmp_path, model=tiny_learner().model)
    worker, save = divmod(loaded.samples_seen, 1000)
    assert worker < WRITERS and save == SAVES_EACH - 1  # one writer's last save, complete
