"""taste_cl vs Avalanche on the same online class-incremental split-digits stream, in one run.

5 tasks x 2 classes, one pass, stream batch 10 (Avalanche ``split_online_stream``, same
seed for every run), reservoir replay of 200, the same seeded 64-128-128-10 MLP, SGD lr 0.1.
Avalanche: ``Naive`` + ``ReplayPlugin(mem_size=200)`` with a ``ReservoirSamplingBuffer(200)``
(its default, an experience-balanced buffer, is not reservoir replay), ``train_mb_size=10`` (10 replayed
samples per step), once with ``train_epochs=1`` (the issue's setup) and once with
``train_epochs=3`` (as many SGD steps per batch as taste_cl's ``train_iterations=3``).
A third Avalanche run (1 epoch) adds ``TasteBatchSizePlugin``: the micro-batch tuned on
this machine, with gradient accumulation up to the strategy's mini-batch (tuning time is
counted; its surrogate cache lives in a temporary folder, so the first repeat tunes cold
and later ones warm). taste_cl, fed by ``run_on_avalanche_stream`` from the same
Avalanche stream: ``taste_cl.cli.demo.build_digits_learner()`` (3 rehearsal steps of 10
stream + 10 replayed samples per batch), and the throughput plan of
:func:`build_throughput_learner` (one step per two stream batches: 20 stream + 160
replayed samples, learning rate scaled linearly to 0.2). All runs are evaluated by the
same code on the same test sets; ``gc.collect()`` runs before each.
Variants alternate over ``--repeats`` runs; samples/s is the median (training calls only),
peak memory is the tracemalloc peak of the Python heap over one extra run of each.
Run: ``taste-cl bench vs-avalanche``.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.datasets import make_mlp, split_digits
from taste_cl.experiment import StreamResult
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import accuracy, average_forgetting, backward_transfer
from taste_cl.reference import build_digits_learner
from taste_cl.report import format_table

LR = 0.1
CAPACITY = 200
BATCH = 10
THROUGHPUT_STREAM_BATCHES = 2  # stream batches per SGD step in the throughput plan
THROUGHPUT_REPLAYED = 160  # replayed samples per SGD step in the throughput plan


def _online_stream(benchmark: Any, seed: int) -> Any:
    from avalanche.benchmarks.scenarios.online import split_online_stream

    return split_online_stream(benchmark.train_stream, BATCH, shuffle=True, seed=seed)


def run_avalanche(benchmark: Any, tasks: Sequence[Any], *, seed: int, epochs: int, plugins: Sequence[Any] = ()) -> StreamResult:
    """Avalanche Naive + ReplayPlugin(200) (and ``plugins``) over the online stream; evaluated after each task."""
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin, ReplayPlugin
    from avalanche.training.storage_policy import ReservoirSamplingBuffer

    torch.manual_seed(seed)
    model = make_mlp(seed=seed)
    strategy = Naive(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=torch.nn.CrossEntropyLoss(),
        train_mb_size=BATCH,
        train_epochs=epochs,
        eval_mb_size=256,
        plugins=[ReplayPlugin(mem_size=CAPACITY, storage_policy=ReservoirSamplingBuffer(CAPACITY)), *plugins],
        evaluator=EvaluationPlugin(),  # no metrics, no loggers: evaluation is ours, the same for all runs
    )

    def predict(x: torch.Tensor) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(x)

    matrix: list[list[float]] = []
    seconds, seen, current = 0.0, 0, 0
    for experience in _online_stream(benchmark, seed):
        task = experience.origin_experience.current_experience
        if task != current:
            matrix.append([accuracy(predict, t.x_test, t.y_test) for t in tasks])
            current = task
        start = time.perf_counter()
        strategy.train(experience)
        seconds += time.perf_counter() - start
        seen += len(experience.dataset)
    matrix.append([accuracy(predict, t.x_test, t.y_test) for t in tasks])
    x_all, y_all = torch.cat([t.x_test for t in tasks]), torch.cat([t.y_test for t in tasks])
    return StreamResult(matrix, accuracy(predict, x_all, y_all), average_forgetting(matrix), backward_transfer(matrix), seen, seconds)


def build_throughput_learner(seed: int) -> OnlineLearner:
    """The reference MLP and reservoir, trained for speed: one SGD step per 20 stream samples
    (two stream batches) plus 160 replayed ones, at twice the learning rate (linear scaling
    for twice the stream samples per step)."""
    # The plan splits each micro-batch in the learner's stream:replay ratio (10:80 here).
    learner = build_digits_learner(
        replay_capacity=CAPACITY,
        lr=LR,
        seed=seed,
        replay_batch_size=THROUGHPUT_REPLAYED // THROUGHPUT_STREAM_BATCHES,
        train_iterations=1,
    )
    learner.set_batch_plan(THROUGHPUT_STREAM_BATCHES * BATCH + THROUGHPUT_REPLAYED, lr_scale=float(THROUGHPUT_STREAM_BATCHES))
    return learner


def run_taste(benchmark: Any, tasks: Sequence[Any], *, seed: int, throughput: bool = False) -> StreamResult:
    """taste_cl over the same Avalanche online stream: the reference learner, or the throughput one."""
    from taste_cl.adapters.avalanche import run_on_avalanche_stream

    torch.manual_seed(seed)
    if throughput:
        learner = build_throughput_learner(seed)
    else:
        learner = build_digits_learner(replay_capacity=CAPACITY, lr=LR, seed=seed)
    return run_on_avalanche_stream(learner, _online_stream(benchmark, seed), test_stream=benchmark.test_stream, batch_size=BATCH)


def _peak_bytes(run: Callable[[], StreamResult]) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("vs-avalanche", __doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing runs of each variant")
    args = parse(parser, argv)
    if args.repeats < 1:
        parser.error(f"`--repeats == {args.repeats}`, must be >= 1")
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    warnings.filterwarnings("ignore", module="qpsolvers")
    # the Avalanche runs are evaluated by this benchmark's own code, so they have no loggers on purpose
    warnings.filterwarnings("ignore", message="No loggers specified")
    from taste_cl.adapters.avalanche import TasteBatchSizePlugin, benchmark_from_tasks
    from taste_cl.tuning.tuner import BatchSizeTuner

    tasks = split_digits(5, seed=args.seed)
    benchmark = benchmark_from_tasks(tasks)
    cache = tempfile.TemporaryDirectory(prefix="taste-vs-avalanche-")
    tuned: list[Any] = []

    def run_tuned() -> StreamResult:
        tuned.append(TasteBatchSizePlugin(BatchSizeTuner(cache_dir=cache.name)))
        return run_avalanche(benchmark, tasks, seed=args.seed, epochs=1, plugins=[tuned[-1]])

    variants: dict[str, Callable[[], StreamResult]] = {
        "avalanche Naive+Replay, 1 epoch": lambda: run_avalanche(benchmark, tasks, seed=args.seed, epochs=1),
        "avalanche Naive+Replay, 3 epochs": lambda: run_avalanche(benchmark, tasks, seed=args.seed, epochs=3),
        "avalanche Naive+Replay+TasteBatchSize, 1 epoch": run_tuned,
        "taste_cl OnlineLearner, 3 rehearsal steps": lambda: run_taste(benchmark, tasks, seed=args.seed),
        "taste_cl OnlineLearner, throughput plan": lambda: run_taste(benchmark, tasks, seed=args.seed, throughput=True),
    }
    results: dict[str, list[StreamResult]] = {name: [] for name in variants}
    for _ in progress_bar(range(args.repeats), enabled=not args.no_progress, desc="repeats"):
        for name, run in variants.items():
            gc.collect()  # each run starts without the previous one's garbage
            results[name].append(run())
    peaks = {name: _peak_bytes(run) for name, run in variants.items()}
    cache.cleanup()
    runs: dict[str, dict[str, Any]] = {}
    for name, found in results.items():
        last = found[-1]
        runs[name] = {
            "final_accuracy": last.final_accuracy,
            "forgetting": last.forgetting,
            "backward_transfer": last.backward_transfer,
            "samples_per_s": statistics.median(r.samples_per_s for r in found),
            "samples_per_s_runs": [r.samples_per_s for r in found],
            "final_accuracy_runs": [r.final_accuracy for r in found],
            "peak_python_heap_mib": peaks[name] / 2**20,
            "accuracy_matrix": last.accuracy_matrix,
        }
    baseline = runs["avalanche Naive+Replay, 1 epoch"]["samples_per_s"]
    for r in runs.values():
        r["x_avalanche_1_epoch"] = r["samples_per_s"] / baseline
    rows = [
        [name, r["final_accuracy"], r["forgetting"], r["samples_per_s"], r["x_avalanche_1_epoch"], r["peak_python_heap_mib"]]
        for name, r in runs.items()
    ]
    print(format_table(["run", "final acc", "forgetting", "samples/s", "x avalanche(1 ep)", "peak heap MiB"], rows))
    runs["avalanche Naive+Replay+TasteBatchSize, 1 epoch"]["tunes"] = [plugin.history_ for plugin in tuned]
    config = {
        "lr": LR,
        "optimizer": "SGD",
        "replay_capacity": CAPACITY,
        "stream_batch": BATCH,
        "tasks": 5,
        "throughput_plan": {
            "stream_per_step": THROUGHPUT_STREAM_BATCHES * BATCH,
            "replayed_per_step": THROUGHPUT_REPLAYED,
            "lr": THROUGHPUT_STREAM_BATCHES * LR,
        },
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
    }
    save_result(args.out, "vs_avalanche", {"config": config, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
