"""Avalanche adapter, both directions, on a tiny split-digits stream."""

from __future__ import annotations

import random
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("avalanche")
warnings.filterwarnings("ignore", module="qpsolvers")

from avalanche.benchmarks.scenarios.online import split_online_stream  # noqa: E402
from avalanche.core import SupervisedPlugin  # noqa: E402
from avalanche.training import Naive  # noqa: E402
from avalanche.training.plugins import EvaluationPlugin, ReplayPlugin  # noqa: E402
from avalanche.training.storage_policy import (  # noqa: E402
    ClassBalancedBuffer,
    ParametricBuffer,
    ReservoirSamplingBuffer,
)
from helpers import fake_hardware as install_fake_hardware  # noqa: E402

from taste_cl import InvalidBatchError, MissingDependencyError, OnlineLearner, StabilityPlasticityMonitor  # noqa: E402
from taste_cl.adapters import avalanche as adapter  # noqa: E402
from taste_cl.adapters.avalanche import (  # noqa: E402
    AvalancheReplay,
    avalanche_metrics,
    benchmark_from_tasks,
    run_on_avalanche_stream,
)
from taste_cl.datasets import Task, make_mlp, split_digits  # noqa: E402
from taste_cl.tuning.tuner import BatchSizeTuner  # noqa: E402

POLICIES = {
    "reservoir": lambda: ReservoirSamplingBuffer(20),
    "class_balanced": lambda: ClassBalancedBuffer(20),
    "parametric_by_class": lambda: ParametricBuffer(20, groupby="class"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread hand-off costs more than it saves on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # Avalanche's loaders and buffers draw from the global RNGs
    random.seed(0)


@pytest.fixture(scope="module")
def tiny_tasks() -> list[Task]:
    """5 tasks x 2 classes, 40 training and 30 test samples per task."""
    return [Task(t.classes, t.x_train[:40], t.y_train[:40], t.x_test[:30], t.y_test[:30]) for t in split_digits(5)]


def _batches(n: int = 8, size: int = 10, seed: int = 0, features: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, features, generator=generator), torch.randint(0, 4, (size,), generator=generator)) for _ in range(n)]


def _learner(replay: AvalancheReplay | None = None) -> OnlineLearner:
    model = make_mlp(seed=0)
    return OnlineLearner(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=replay, replay_batch_size=10, train_iterations=3
    )


# ------------------------------------------------------------ import hygiene
def test_core_and_adapter_imports_do_not_import_avalanche():
    code = (
        "import sys, taste_cl, taste_cl.adapters.avalanche\n"
        "assert not any(m == 'avalanche' or m.startswith('avalanche.') for m in sys.modules), 'avalanche imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard: avalanche imports slowly on a loaded machine


def test_missing_avalanche_raises_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "avalanche.training.storage_policy", None)
    with pytest.raises(MissingDependencyError, match=r"pip install '\.\[avalanche\]'"):
        AvalancheReplay(ReservoirSamplingBuffer(5))


# ------------------------------------------ direction 1: policies as replay
@pytest.mark.parametrize("name", POLICIES)
def test_replay_keeps_added_samples_within_capacity(name):
    replay = AvalancheReplay(POLICIES[name](), seed=1)
    rows = {}
    for x, y in _batches():
        replay.add(x, y)
        rows.update({tuple(row.tolist()): int(label) for row, label in zip(x, y)})
        assert len(replay) <= replay.capacity == 20
    assert len(replay) == 20
    x, y = replay.sample(7)
    assert x.shape == (7, 4) and y.shape == (7,)
    assert all(rows[tuple(row.tolist())] == int(label) for row, label in zip(x, y))  # real (x, y) pairs
    x.zero_()
    assert not bool((replay.sample(20)[0] == 0).all(dim=1).any())  # sample returned a copy


def test_class_balanced_policy_balances_classes():
    replay = AvalancheReplay(ClassBalancedBuffer(20))
    replay.add(torch.randn(30, 4), torch.zeros(30, dtype=torch.long))
    replay.add(torch.randn(30, 4), torch.ones(30, dtype=torch.long))
    assert torch.bincount(replay.labels).tolist() == [10, 10]


def test_replay_refuses_extra_fields_and_non_tensor_inputs_leaving_the_buffer_as_it_was():
    replay = AvalancheReplay(ReservoirSamplingBuffer(20), seed=1)
    x, y = _batches(n=1)[0]
    replay.add(x, y)
    before = replay.state_dict()["storage"]
    with pytest.raises(ValueError, match=r"keeps no extra per-sample fields; got \['logits'\]"):
        replay.add_validated(x, y, logits=torch.zeros(len(y), 2))
    with pytest.raises(TypeError, match="tensor inputs only; got x of type dict"):
        replay.add_validated({"x": x}, y)
    after = replay.state_dict()["storage"]
    assert replay.seen == len(y) and torch.equal(after["x"], before["x"]) and torch.equal(after["y"], before["y"])


@pytest.mark.parametrize("name", POLICIES)
def test_replay_is_seeded_and_leaves_global_rng_alone(name):
    first, second = AvalancheReplay(POLICIES[name](), seed=3), AvalancheReplay(POLICIES[name](), seed=3)
    before = torch.get_rng_state()
    for x, y in _batches():
        first.add(x, y)
        second.add(x, y)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first.sample(20)[0], second.sample(20)[0])


@pytest.mark.parametrize("name", POLICIES)
def test_state_dict_round_trip_resumes_exactly(name):
    batches = _batches(12)
    original = AvalancheReplay(POLICIES[name](), seed=2)
    for x, y in batches[:6]:
        original.add(x, y)
    restored = AvalancheReplay(POLICIES[name](), seed=99)
    restored.load_state_dict(original.state_dict())
    assert torch.equal(restored.sample(20)[0], original.sample(20)[0])
    for x, y in batches[6:]:
        original.add(x, y)
        restored.add(x, y)
    assert torch.equal(restored.sample(20)[0], original.sample(20)[0])
    assert len(restored.policy.buffer) == len(original.policy.buffer) == 20


def test_learner_checkpoint_with_avalanche_replay(tmp_path):
    learner = _learner(AvalancheReplay(ReservoirSamplingBuffer(50)))
    for x, y in _batches(5, seed=4, features=64):
        learner.observe((x, y))
    learner.save(tmp_path / "ckpt")
    loaded = OnlineLearner.load(
        tmp_path / "ckpt", model=make_mlp(seed=1), replay=AvalancheReplay(ReservoirSamplingBuffer(50))
    )
    assert torch.equal(loaded.replay.labels, learner.replay.labels)
    probe = torch.randn(3, 64)
    assert torch.allclose(loaded.predict(probe), learner.predict(probe))


def test_load_rejects_other_policy_type():
    original = AvalancheReplay(ReservoirSamplingBuffer(20))
    original.add(torch.randn(5, 4), torch.arange(5))
    with pytest.raises(ValueError, match="holds a ReservoirSamplingBuffer policy; .* wraps a ClassBalancedBuffer"):
        AvalancheReplay(ClassBalancedBuffer(20)).load_state_dict(original.state_dict())


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: AvalancheReplay(object()), TypeError, "policy must be an avalanche.*ExemplarsBuffer; got object"),
        (lambda: AvalancheReplay(ReservoirSamplingBuffer(0)), ValueError, r"`capacity == 0`, must be >= 1"),
        (
            lambda: AvalancheReplay(ReservoirSamplingBuffer(5)).add(torch.randn(3, 4), torch.zeros(2, dtype=torch.long)),
            InvalidBatchError,
            "same n",
        ),
        (lambda: adapter.TasteMonitorPlugin(batch_size=0), ValueError, r"`batch_size == 0`, must be an int >= 1"),
        (lambda: adapter.TasteBatchSizePlugin(object()), TypeError, "tuner must be a taste_cl.tuning.tuner.BatchSizeTuner.*got object"),
        (lambda: adapter.TasteBatchSizePlugin(retune_every=0), ValueError, r"`retune_every == 0`, must be an int >= 1 or None"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


# --------------------------------------------------------------- streams
def test_online_learner_over_avalanche_online_stream(tiny_tasks):
    benchmark = benchmark_from_tasks(tiny_tasks)
    untrained = run_on_avalanche_stream(_learner(), [], test_stream=benchmark.test_stream)
    learner = _learner(AvalancheReplay(ReservoirSamplingBuffer(50)))
    online = split_online_stream(benchmark.train_stream, 10, shuffle=True, seed=0)
    result = run_on_avalanche_stream(learner, online, test_stream=benchmark.test_stream)
    assert result.samples == learner.samples_seen == 200
    assert len(result.accuracy_matrix) == 5 and all(len(row) == 5 for row in result.accuracy_matrix)
    assert result.accuracy_matrix[0][0] > 0.8  # learned task 0 before task 1 arrived
    assert result.final_accuracy > untrained.final_accuracy + 0.2
    metrics = avalanche_metrics(result)
    assert metrics["Top1_Acc_Stream/eval_phase/test_stream/Task000"] == result.final_accuracy
    assert metrics["StreamForgetting/eval_phase/test_stream"] == pytest.approx(result.forgetting)
    assert metrics["Top1_Acc_Exp/eval_phase/test_stream/Task000/Exp004"] == result.accuracy_matrix[-1][4]


def test_benchmark_streams_and_missing_test_stream(tiny_tasks):
    benchmark = benchmark_from_tasks(tiny_tasks[:2])
    result = run_on_avalanche_stream(_learner(), benchmark, batch_size=20)  # batch stream: one experience per task
    assert result.samples == 80 and len(result.accuracy_matrix) == 2
    with pytest.raises(ValueError, match="test_stream is required"):
        run_on_avalanche_stream(_learner(), benchmark.train_stream)


# ---------------------------------------- direction 2: taste_cl in Avalanche
def test_monitor_plugin_in_naive_with_replay(tiny_tasks):
    benchmark = benchmark_from_tasks(tiny_tasks[:2])
    model = make_mlp(seed=0)
    plugin = adapter.TasteMonitorPlugin(StabilityPlasticityMonitor(eval_every=4))
    evaluator = EvaluationPlugin(collect_all=True)
    strategy = Naive(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_mb_size=10,
        train_epochs=3,
        plugins=[ReplayPlugin(mem_size=20), plugin],
        evaluator=evaluator,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for experience in split_online_stream(benchmark.train_stream, 10, shuffle=True, seed=0):
            strategy.train(experience)
    report = plugin.monitor.report()
    assert report["samples_seen"] == 80 and report["steps"] == 8
    assert report["stability"] is not None and 0.0 <= report["stability"] <= 1.0
    assert report["plasticity"] > 0.2  # prequential accuracy above chance (0.1): it learned while streaming
    assert report["forgetting"] > 0.1 and report["events"]["forgetting_rising"] == 1  # tiny replay: task 0 fades
    metrics = evaluator.get_all_metrics()
    for name in ("Taste/stability", "Taste/plasticity", "Taste/forgetting", "Taste/drift_count"):
        assert name in metrics
    assert metrics["Taste/plasticity"][1][-1] == report["plasticity"]


# ------------------------------------ direction 2: the batch-size tuner in Avalanche
def _small_batch_curve(batch_size: int) -> float:
    """Synthetic hardware whose throughput peaks at batch 4 (smaller than the 20-sample mini-batches)."""
    return 1000.0 * batch_size / (batch_size + 2) / (1 + (batch_size / 8) ** 2)


@pytest.fixture
def fake_hardware(monkeypatch):
    return install_fake_hardware(monkeypatch, _small_batch_curve)


class _RecordSizes(SupervisedPlugin):
    """Records the size of every mini-batch the strategy forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def before_forward(self, strategy, *args, **kwargs):
        self.sizes.append(len(strategy.mb_x))


def _train_naive(tasks, *plugins, epochs: int = 2):
    torch.manual_seed(0)
    model = make_mlp(seed=0)
    strategy = Naive(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
        train_mb_size=10,
        train_epochs=epochs,
        plugins=[ReplayPlugin(mem_size=20, storage_policy=ReservoirSamplingBuffer(20)), *plugins],
        evaluator=EvaluationPlugin(collect_all=True),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for experience in split_online_stream(benchmark_from_tasks(tasks).train_stream, 10, shuffle=True, seed=0):
            strategy.train(experience)
    return strategy


def test_batch_size_plugin_tunes_and_accumulates_to_the_same_parameters(tiny_tasks, tmp_path, fake_hardware):
    plain_sizes, tuned_sizes = _RecordSizes(), _RecordSizes()
    plain = _train_naive(tiny_tasks[:2], plain_sizes)
    plugin = adapter.TasteBatchSizePlugin(BatchSizeTuner(cache_dir=tmp_path))
    tuned = _train_naive(tiny_tasks[:2], plugin, tuned_sizes)
    micro = plugin.result_.batch_size
    assert _small_batch_curve(micro) >= 0.95 * max(map(_small_batch_curve, fake_hardware))  # the surrogate's best
    assert 3 <= micro <= 5 and len(plugin.history_) == 1 and not plugin.history_[0]["warm"]
    assert max(plain_sizes.sizes) == 20  # 10 stream + 10 replayed samples per step
    assert max(tuned_sizes.sizes) == micro and len(tuned_sizes.sizes) > 3 * len(plain_sizes.sizes)
    assert sum(tuned_sizes.sizes) == sum(plain_sizes.sizes)  # the same samples, in micro-batches
    for a, b in zip(plain.model.parameters(), tuned.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # accumulation == one large step (momentum, decay)
    assert tuned.evaluator.get_all_metrics()["Taste/micro_batch_size"][1] == [micro]


def test_batch_size_plugin_retunes_on_schedule_and_drift(tiny_tasks, tmp_path, fake_hardware):
    monitor_plugin = adapter.TasteMonitorPlugin(StabilityPlasticityMonitor(eval_every=4))
    plugin = adapter.TasteBatchSizePlugin(BatchSizeTuner(cache_dir=tmp_path), retune_every=3)
    model = make_mlp(seed=0)
    strategy = Naive(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_mb_size=10,
        plugins=[ReplayPlugin(mem_size=20), monitor_plugin, plugin], evaluator=EvaluationPlugin(),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, experience in enumerate(split_online_stream(benchmark_from_tasks(tiny_tasks[:2]).train_stream, 10, seed=0)):
            if index == 4:
                monitor_plugin.monitor.emit("drift_detected")
                monitor_plugin.monitor.dispatch()
            strategy.train(experience)
    reasons = [(entry["experience"], entry["reason"].split(" (")[0].split(" at")[0]) for entry in plugin.history_]
    assert reasons == [(0, "first experience"), (3, "schedule"), (4, "stream drift"), (6, "schedule")]
    assert all(entry["warm"] and entry["probes"] <= 1 for entry in plugin.history_[1:])  # cached surrogate: bounded retunes
    assert monitor_plugin.monitor.report()["samples_seen"] == 80


def test_benchmark_learners_match_or_beat_avalanche_accuracy_on_the_benchmark_stream():
    """The accuracy half of ``taste-cl bench vs-avalanche`` (deterministic: seeded stream and models)."""
    from taste_cl.benchmarks import vs_avalanche

    tasks = split_digits(5, seed=0)
    benchmark = benchmark_from_tasks(tasks)
    avalanche_run = vs_avalanche.run_avalanche(benchmark, tasks, seed=0, epochs=1)
    throughput_run = vs_avalanche.run_taste(benchmark, tasks, seed=0, throughput=True)
    assert avalanche_run.samples == throughput_run.samples == sum(t.x_train.shape[0] for t in tasks)
    assert throughput_run.final_accuracy >= avalanche_run.final_accuracy
    assert throughput_run.forgetting <= avalanche_run.forgetting
