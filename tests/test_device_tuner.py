"""The device batch-size tuner: a plan found on the device's own replay rows and applied with gradient
accumulation, probes that leave the learner bit-identical, state that survives save and load, retunes
on a load shift, tuned threads, and no torch on an ONNX Runtime device.

The probes' steps are real; their clock is injected (each step advances it by a cost that depends on
the batch size and threads), so what the search decides does not depend on how busy the machine is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_without_torch
from torch import nn

pytestmark = pytest.mark.training_build

from taste_cl.adapters.device import tuning
from taste_cl.adapters.device.artifacts import ArtifactError
from taste_cl.adapters.device.tuning import DeviceBatchTuner, micro_batch_bounds
from taste_cl.adapters.onnxruntime.build import ReplayRows, export_model
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.adapters.onnxruntime.session import OrtSession
from taste_cl.tuning.load import LoadMeter
from taste_cl.tuning.searcher import split_plan

STREAM, REPLAY = 8, 8  # the learner's step: 8 stream rows and 8 replayed ones


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small classifiers (SGD with momentum, AdamW) with a 40-row buffer, replaying 8 rows a step."""
    torch.manual_seed(0)
    exported = {}
    for kind in ("sgd", "adamw"):
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        if kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
        exported[kind] = export_model(
            model, nn.CrossEntropyLoss(), optimizer, (x[:8], y[:8]), tmp_path_factory.mktemp(kind) / "art",
            replay=ReplayRows(x, y, capacity=100, seen=40), replay_batch_size=REPLAY,
        )  # fmt: skip
    return exported


@dataclasses.dataclass
class Clock:
    """The probes' clock: every training step advances it by ``cost(batch, threads)`` seconds."""

    cost: Callable[[int, int | None], float]
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def small_is_fast(batch: int, threads: int | None) -> float:
    """Per sample, a step of up to 5 rows is ten times cheaper than a larger one: the plan splits."""
    return 0.01 + (0.001 * batch if batch <= 5 else 0.01 * batch)


def large_is_fast(batch: int, threads: int | None) -> float:
    """A fixed cost per step: the largest batch (the learner's own step) is fastest, no split."""
    return 0.01


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Advance the clock on every real ONNX Runtime training step; scratch sessions remember their threads."""
    fake = Clock(small_is_fast)
    train_step, accumulated_step, copy_session = OrtSession.train_step, OrtSession.accumulated_step, tuning._OrtRuntime.copy_session

    def timed_step(self: OrtSession, inputs: list[np.ndarray], labels: np.ndarray) -> Any:
        fake.now += fake.cost(labels.shape[0], getattr(self, "threads_for_test", None))
        return train_step(self, inputs, labels)

    def timed_accumulation(self: OrtSession, parts: list[tuple[list[np.ndarray], np.ndarray]]) -> Any:
        fake.now += sum(fake.cost(labels.shape[0], getattr(self, "threads_for_test", None)) for _, labels in parts)
        return accumulated_step(self, parts)

    def tagged_copy(self: Any, threads: int | None) -> OrtSession:
        session = copy_session(self, threads)
        session.threads_for_test = threads  # type: ignore[attr-defined]
        return session

    monkeypatch.setattr(OrtSession, "train_step", timed_step)
    monkeypatch.setattr(OrtSession, "accumulated_step", timed_accumulation)
    monkeypatch.setattr(tuning._OrtRuntime, "copy_session", tagged_copy)
    return fake


def tuner(clock: Clock, cache: Path, **kwargs: Any) -> DeviceBatchTuner:
    settings = {"min_probe_time": 0.05, "n_calls": 4, "cache_dir": cache, "clock": clock, **kwargs}
    return DeviceBatchTuner(**settings)


def batches(count: int, seed: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield rng.standard_normal((STREAM, 6)).astype(np.float32), rng.integers(0, 3, STREAM)


def close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], *, exact: bool = False) -> bool:
    check = np.array_equal if exact else lambda u, v: np.allclose(u, v, rtol=1e-5, atol=1e-6)
    return a.keys() == b.keys() and all(check(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ the plan
def test_plan_is_found_on_the_replay_rows_and_applied(folders: dict[str, Path], clock: Clock, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folders["sgd"], tuner=tuner(clock, tmp_path))
    stats = device.observe(next(batches(1)))
    tuned = device.tuner
    assert tuned.reference_ == STREAM + REPLAY and tuned.result_ is not None
    assert tuned.result_.batch_size <= 5 < tuned.reference_  # the cost model's fastest sizes
    micro = split_plan(tuned.result_, STREAM + REPLAY)
    assert micro is not None and tuned.micro_batch_size_ == micro[0]
    assert stats.micro_batches == len(micro_batch_bounds(STREAM + REPLAY, tuned.micro_batch_size_)) > 1
    assert tuned.probe_seconds_ > tuned.result_.seconds > 0 and tuned.tunes_ == 1  # the search, then the plan's check
    assert [entry["reason"] for entry in tuned.history_] == ["first observe"]
    assert tuned.history_[0]["split_gain"] == pytest.approx(0.17 / (4 * 0.014), rel=0.05)  # whole step vs 4 pieces
    assert len(device.replay) == 40 + STREAM  # probing drew nothing from the buffer and added nothing


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_accumulated_micro_batches_take_the_untuned_step(folders: dict[str, Path], clock: Clock, tmp_path: Path, kind: str) -> None:
    tuned = OrtOnlineLearner.from_artifacts(folders[kind], tuner=tuner(clock, tmp_path))
    plain = OrtOnlineLearner.from_artifacts(folders[kind])
    for batch in batches(3):
        a, b = tuned.observe(batch), plain.observe(batch)
        assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.micro_batches > b.micro_batches == 1
    assert tuned.tuner.micro_batch_size_ is not None
    assert close(tuned.parameters(), plain.parameters())
    assert close(tuned.session.sgd_state, plain.session.sgd_state)


def test_one_step_per_micro_batch_is_an_opt_in(folders: dict[str, Path], clock: Clock, tmp_path: Path) -> None:
    split = OrtOnlineLearner.from_artifacts(folders["sgd"], tuner=tuner(clock, tmp_path, accumulate=False))
    plain = OrtOnlineLearner.from_artifacts(folders["sgd"])
    for batch in batches(2):
        split.observe(batch)
        plain.observe(batch)
    assert split.tuner.micro_batch_size_ is not None
    assert not close(split.parameters(), plain.parameters())  # more, smaller steps on the same rows


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_probes_leave_weights_and_optimizer_state_bit_identical(folders: dict[str, Path], clock: Clock, tmp_path: Path, kind: str) -> None:
    clock.cost = large_is_fast  # no split: the tuned learner then takes exactly the untuned steps
    tuned = OrtOnlineLearner.from_artifacts(folders[kind], tuner=tuner(clock, tmp_path))
    plain = OrtOnlineLearner.from_artifacts(folders[kind])
    stream = batches(4)
    first = next(stream)
    tuned.observe(first)
    plain.observe(first)
    weights, momentum = tuned.parameters(), {k: v.copy() for k, v in tuned.session.sgd_state.items()}
    tuned.tuner.tune(reason="asked again")
    assert tuned.tuner.tunes_ == 2 and tuned.tuner.micro_batch_size_ is None
    assert close(tuned.parameters(), weights, exact=True) and close(tuned.session.sgd_state, momentum, exact=True)
    for batch in stream:  # AdamW's moments and step count, SGD's momentum, the replay draws: all as before
        assert tuned.observe(batch).loss == plain.observe(batch).loss
    assert close(tuned.parameters(), plain.parameters(), exact=True)


# --------------------------------------------------------------- checkpoints
def test_save_and_load_keep_the_plan_the_cache_and_the_probes_cost(folders: dict[str, Path], clock: Clock, tmp_path: Path) -> None:
    device = OrtOnlineLearner.from_artifacts(folders["adamw"], tuner=tuner(clock, tmp_path / "cache"))
    stream = batches(4)
    device.observe(next(stream))
    saved = device.save(tmp_path / "saved")
    fresh_cache = tmp_path / "other-cache"  # another process, its cache gone: the folder re-seeds it
    resumed = OrtOnlineLearner.from_artifacts(saved, tuner=tuner(clock, fresh_cache))
    before, after = device.tuner, resumed.tuner
    assert after.result_ == before.result_ and after.micro_batch_size_ == before.micro_batch_size_ is not None
    assert after.probe_seconds_ == before.probe_seconds_ and list(after.history_) == list(before.history_)
    cached = after.cache.load(before.result_.key)
    assert cached is not None and cached == before.cache.load(before.result_.key)
    for batch in stream:  # resumed without a new tune, stepping as the original does
        assert resumed.observe(batch).loss == pytest.approx(device.observe(batch).loss, rel=1e-6)
    assert after.tunes_ == 1 and close(resumed.parameters(), device.parameters())
    untuned = OrtOnlineLearner.from_artifacts(saved)  # no tuner: the state is kept for the next save
    again = json.loads((untuned.save(tmp_path / "again") / "manifest.json").read_text())
    assert again["tuner"] == json.loads((saved / "manifest.json").read_text())["tuner"]


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("micro_batch_size",), 0, "micro_batch_size == 0"),
        (("probe_seconds",), -1.0, "probe_seconds == -1.0"),
        (("result", "batch_size"), "8", "result.batch_size"),
        (("cache", "observations"), [[4, 1, 1e12]], "samples_per_s"),
        (("format",), 99, "format 1"),
    ],
)
def test_a_bad_saved_tuner_state_is_refused(
    folders: dict[str, Path], clock: Clock, tmp_path: Path, path: tuple[str, ...], value: Any, message: str
) -> None:
    device = OrtOnlineLearner.from_artifacts(folders["sgd"], tuner=tuner(clock, tmp_path / "cache"))
    device.observe(next(batches(1)))
    saved = device.save(tmp_path / "saved")
    manifest = json.loads((saved / "manifest.json").read_text())
    *parents, last = path
    node = manifest["tuner"]
    for key in parents:
        node = node[key]
    node[last] = value
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"tuner state.*{message}"):
        OrtOnlineLearner.from_artifacts(saved, tuner=DeviceBatchTuner(cache_dir=tmp_path / "cache"))
    assert OrtOnlineLearner.from_artifacts(saved).tuner is None  # without a tuner it is not read


# ------------------------------------------------------------ retune, threads
def test_a_load_shift_retunes(folders: dict[str, Path], clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected readings, as in tests/test_load_shift.py: the training rate halves after the baseline."""
    monkeypatch.setattr(LoadMeter, "read", lambda self: 0.05)
    device = OrtOnlineLearner.from_artifacts(
        folders["sgd"], tuner=tuner(clock, tmp_path, calibration_window=4, load_tolerance=0.3, min_retune_interval=0)
    )
    device.observe(next(batches(1)))
    tuned = device.tuner
    spent = tuned.probe_seconds_
    for _ in range(4):
        tuned.after_observe(16, 0.004)  # the baseline: 4000 samples/s
    assert tuned.tunes_ == 1
    for _ in range(3):
        tuned.after_observe(16, 0.016)  # 1000 samples/s: the median moves
    assert tuned.tunes_ == 2 and tuned.history_[-1]["reason"].startswith("load shift: training rate")
    assert tuned.history_[-1]["warm"] and tuned.probe_seconds_ > spent


def test_tuned_threads_rebuild_the_session_and_survive_a_reload(
    folders: dict[str, Path], clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "thread_options", lambda: [1, 2])
    clock.cost = lambda batch, threads: 0.01 * (1 if threads == 1 else 3)  # two threads lose to a busy neighbour
    device = OrtOnlineLearner.from_artifacts(folders["adamw"], tuner=tuner(clock, tmp_path, tune_threads=True))
    plain = OrtOnlineLearner.from_artifacts(folders["adamw"])
    original = device.session
    for batch in batches(2):
        device.observe(batch)
        plain.observe(batch)
    assert device.tuner.threads_ == device.tuner.result_.threads == 1 and device.session is not original
    assert device.session.guard is device.guard is not None  # the rebuilt session still guards every step
    assert close(device.parameters(), plain.parameters())  # rebuilt from a copy of its state, momentum included
    resumed = OrtOnlineLearner.from_artifacts(device.save(tmp_path / "saved"), tuner=tuner(clock, tmp_path, tune_threads=True))
    assert resumed.tuner.threads_ == 1 and resumed.tuner._runtime.threads == 1


# ------------------------------------------------------------------ without torch
def test_the_device_tuner_runs_with_torch_unimportable(folders: dict[str, Path], tmp_path: Path) -> None:
    """The import hook of tests/test_onnx_device.py: any ``import torch`` fails in the subprocess."""
    result = run_without_torch(
        f"""
        import numpy as np
        from taste_cl.adapters.device.tuning import DeviceBatchTuner
        from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
        settings = dict(min_probe_time=0.005, n_calls=3, cache_dir={str(tmp_path / "cache")!r})
        device = OrtOnlineLearner.from_artifacts({str(folders["sgd"])!r}, tuner=DeviceBatchTuner(tune_threads=True, **settings))
        rng = np.random.default_rng(0)
        for _ in range(2):
            device.observe((rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)))
        tuned = device.tuner
        assert tuned.result_ is not None and tuned.probe_seconds_ > 0, tuned.history_
        resumed = OrtOnlineLearner.from_artifacts(device.save({str(tmp_path / "saved")!r}), tuner=DeviceBatchTuner(**settings))
        assert resumed.tuner.result_ == tuned.result_ and resumed.tuner.micro_batch_size_ == tuned.micro_batch_size_
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("OK")
        """,
        timeout=600,
        OMP_NUM_THREADS="1",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "OK"


def test_without_psutil_the_import_says_how_to_install_it() -> None:
    """A device installed with ``pip install --no-deps taste-cl`` may lack psutil (the load meter's)."""
    result = run_without_torch(
        """
        sys.modules["psutil"] = None  # `import psutil` now raises ModuleNotFoundError
        from taste_cl.exceptions import MissingDependencyError
        try:
            from taste_cl.adapters.device.tuning import DeviceBatchTuner
        except MissingDependencyError as error:
            print(error)
        """,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'psutil' is required" in result.stdout and "install it with: pip install psutil" in result.stdout


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size == 0"),
        ({"calibration_window": 1}, ValueError, "calibration_window == 1"),
        ({"min_probe_time": float("nan")}, ValueError, "min_probe_time == nan"),
        ({"retune_every": 0}, ValueError, "retune_every == 0"),
        ({"accumulate": "yes"}, TypeError, "accumulate == 'yes'"),
        ({"clock": 3}, TypeError, "clock == 3"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DeviceBatchTuner(**kwargs)


def test_one_tuner_per_learner(folders: dict[str, Path], tmp_path: Path) -> None:
    shared = DeviceBatchTuner(cache_dir=tmp_path)
    OrtOnlineLearner.from_artifacts(folders["sgd"], tuner=shared)
    with pytest.raises(ValueError, match="one tuner per learner"):
        OrtOnlineLearner.from_artifacts(folders["sgd"], tuner=shared)
    with pytest.raises(TypeError, match="OrtOnlineLearner or EtOnlineLearner"):
        DeviceBatchTuner(cache_dir=tmp_path).attach(object())


@pytest.mark.parametrize(
    "rows, micro, least, expected",
    [
        (16, None, 1, [(0, 16)]),
        (16, 16, 1, [(0, 16)]),
        (10, 4, 1, [(0, 4), (4, 7), (7, 10)]),
        (16, 5, 1, [(0, 4), (4, 8), (8, 12), (12, 16)]),
        (5, 2, 2, [(0, 3), (3, 5)]),  # ExecuTorch trains 2 rows at least
    ],
)
def test_micro_batches_are_balanced(rows: int, micro: int | None, least: int, expected: list[tuple[int, int]]) -> None:
    assert micro_batch_bounds(rows, micro, least) == expected


# ------------------------------------------------------------------ ExecuTorch
@pytest.fixture(scope="module")
def et_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("executorch.extension.training")
    from taste_cl import OnlineLearner, ReservoirReplay

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    learner = OnlineLearner(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), replay=ReservoirReplay(40, seed=1), replay_batch_size=REPLAY
    )
    for _ in range(4):
        learner.observe((torch.randn(STREAM, 6), torch.randint(0, 3, (STREAM,))))
    return learner.export(tmp_path_factory.mktemp("et") / "art", backend="executorch")


@pytest.fixture
def et_clock(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    """The fake clock on ExecuTorch steps, and the process-wide thread pool put back afterwards."""
    from taste_cl.adapters.executorch.runtime import EtTrainer, executorch_runtime

    run, accumulated_step = EtTrainer.run, EtTrainer.accumulated_step

    def timed_run(self: EtTrainer, inputs: list[torch.Tensor], y: torch.Tensor, *, step: bool) -> Any:
        clock.now += clock.cost(y.shape[0], executorch_runtime()._threadpool_get_thread_count())
        return run(self, inputs, y, step=step)

    def timed_accumulation(self: EtTrainer, parts: list[tuple[list[torch.Tensor], torch.Tensor]]) -> Any:
        clock.now += sum(clock.cost(y.shape[0], executorch_runtime()._threadpool_get_thread_count()) for _, y in parts)
        return accumulated_step(self, parts)

    monkeypatch.setattr(EtTrainer, "run", timed_run)
    monkeypatch.setattr(EtTrainer, "accumulated_step", timed_accumulation)
    threads = executorch_runtime()._threadpool_get_thread_count()
    yield clock
    executorch_runtime()._unsafe_reset_threadpool(threads)


@pytest.mark.slow  # an ExecuTorch export takes minutes on a busy machine
def test_executorch_tuner_plans_accumulates_probes_cleanly_and_resumes(et_folder: Path, et_clock: Clock, tmp_path: Path) -> None:
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    tuned = EtOnlineLearner.from_artifacts(et_folder, tuner=tuner(et_clock, tmp_path / "cache"))
    plain = EtOnlineLearner.from_artifacts(et_folder)
    stream = batches(4)
    first = next(stream)
    assert tuned.observe(first).loss == pytest.approx(plain.observe(first).loss, rel=1e-5)
    plan = tuned.tuner
    assert plan.micro_batch_size_ is not None and plan.result_ is not None and plan.result_.min_batch_size == 2
    weights = tuned.parameters()
    plan.tune(reason="asked again")  # the scratch SGD leaves the weights and the live momentum alone
    assert close(tuned.parameters(), weights, exact=True)
    resumed = EtOnlineLearner.from_artifacts(tuned.save(tmp_path / "saved"), tuner=tuner(et_clock, tmp_path / "other"))
    assert resumed.tuner.result_ == plan.result_ and resumed.tuner.probe_seconds_ == plan.probe_seconds_
    for batch in stream:  # micro-batches with accumulation take the untuned step
        assert tuned.observe(batch).loss == pytest.approx(plain.observe(batch).loss, rel=1e-5)
    assert close(tuned.parameters(), plain.parameters())


@pytest.mark.slow
def test_executorch_threads_are_tuned_process_wide(et_folder: Path, et_clock: Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from taste_cl.adapters.executorch.learner import EtOnlineLearner
    from taste_cl.adapters.executorch.runtime import executorch_runtime

    monkeypatch.setattr(tuning, "thread_options", lambda: [1, 2])
    executorch_runtime()._unsafe_reset_threadpool(2)
    et_clock.cost = lambda batch, threads: 0.01 * (1 if threads == 1 else 3)
    device = EtOnlineLearner.from_artifacts(et_folder, tuner=tuner(et_clock, tmp_path, tune_threads=True))
    device.observe(next(batches(1)))
    assert device.tuner.threads_ == 1 == executorch_runtime()._threadpool_get_thread_count()
