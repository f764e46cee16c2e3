"""Continual-learning strategies side by side, and the cost and benefit of the probe guard.

Part 1, strategies. Two streams, each an Avalanche ``split_online_stream`` of batches of
10 (same seed for every method, so every method sees the same batches in the same
order): class-incremental split digits (5 tasks x 2 classes) and a generated gradual
drift stream (10 classes in 64 dimensions whose prototypes move step by step from one
random configuration to another over 8 segments). Equal compute per stream batch of 10,
for every method of both libraries: one forward and backward pass over a micro-batch of
the 10 stream samples plus 10 samples replayed from a buffer of 200, then one SGD step
(lr 0.1), on the same seeded 64-128-128-10 MLP (LwF: the stream samples only, plus one
forward of its snapshot). The buffers follow the same policy in both libraries:
class-balanced (capacity split evenly over the classes seen, reservoir sampling within a
class: taste_cl's ``ClassBalancedReplay``, Avalanche's ``ClassBalancedBuffer``). taste_cl:
ER, ER-ACE, DER++ and LwF (snapshot every 50 steps and at drift; no buffer); Avalanche
0.6: ``ER_ACE`` and ``DER`` (one epoch per experience of 10; its ``DER`` also runs an
eval-mode forward over each experience after training on it to store the logits, which
taste_cl takes from the training forward). DER++ weights, the same for both libraries:
alpha 0.5 (MSE to stored logits), beta 2 (replay cross-entropy), the best of a grid
alpha in {0.2, 0.5, 1, 2} x beta in {1, 2, 3} (10 seeds, split digits) for Avalanche's
``DER`` and for taste_cl's alike (Mammoth's seq-MNIST values, alpha 0.2 / beta 1 at
lr 0.03, learn too slowly in this 135-step stream). Metrics, computed by the same code for all: final accuracy (all test data),
anytime accuracy (mean over evaluations every 5 batches of the accuracy on the test
data of the classes / segments seen so far), forgetting (average over tasks of best
minus final accuracy, from the per-task accuracy matrix), negative flip rate (between
consecutive evaluations, on the test samples seen at both), samples/s (training calls
only; the median over a method's runs, and the fastest run beside it, as a shared
machine's load only ever slows a run down; the JSON keeps every run). Runs alternate over ``--seeds`` seeds.

Part 2, guard. Shuffled digits (all classes), batches of 10, 3 rehearsal steps per batch;
from 40 % to 60 % of the stream every label is wrong (a burst of mislabelled samples).
The same learner with and without :class:`~taste_cl.guards.probe.ProbeGuard` (windows of 10
batches, 4 warm-up windows, max drop 5 points): held-out accuracy after every batch of
the model each serves (the guarded learner serves its accepted model), worst from the
burst on and final; rollbacks; training time ratio (fastest of ``--guard-repeats``
identical runs of each, as the machine's load only ever slows a run down).

Writes a table, ``strategies.json`` and ``strategies.png`` (accuracy over the streams).
Run: ``taste-cl bench strategies``.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.datasets import Task, make_mlp, split_digits
from taste_cl.guards.probe import ProbeGuard
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import average_forgetting
from taste_cl.plotting import PLOT_HINT, plotting_available, pyplot, save_figure
from taste_cl.replay import ClassBalancedReplay, ReservoirReplay
from taste_cl.report import format_number, format_table
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy

LR = 0.1
CAPACITY = 200
BATCH = 10
ALPHA, BETA = 0.5, 2.0  # DER++ weights for both libraries (grid in the module docstring)
EVAL_EVERY = 5  # stream batches between evaluations
EQUAL_COMPUTE = (
    f"per stream batch of {BATCH}, every method: one forward and backward over {BATCH} stream + {BATCH} replayed samples "
    f"and one SGD step (LwF: the {BATCH} stream samples plus a snapshot forward; Avalanche DER: plus an eval forward "
    f"over the {BATCH} to store their logits)"
)
BUFFER = f"class-balanced, capacity {CAPACITY}, both libraries (taste_cl ClassBalancedReplay, Avalanche ClassBalancedBuffer)"


@dataclass
class Run:
    """One method on one stream: the metrics and the accuracy curve."""

    final_accuracy: float
    anytime_accuracy: float
    forgetting: float
    negative_flip_rate: float
    samples: int
    train_seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_seconds


def drift_tasks(segments: int = 8, *, n_train: int = 200, n_test: int = 100, scale: float = 0.3, seed: int = 0) -> list[Task]:
    """A gradual-drift stream as tasks: every segment has all 10 classes; class prototypes
    move linearly from one random configuration to another across the segments."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    start, end = (scale * torch.randn(10, 64, generator=generator) for _ in range(2))
    tasks = []
    for k in range(segments):
        t = k / (segments - 1)
        prototypes = (1 - t) * start + t * end

        (x_train, y_train), (x_test, y_test) = (_draw(prototypes, n, generator) for n in (n_train, n_test))
        tasks.append(Task(tuple(range(10)), x_train, y_train, x_test, y_test))
    return tasks


def _draw(prototypes: torch.Tensor, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, prototypes.shape[0], (n,), generator=generator)
    return prototypes[y] + 0.8 * torch.randn(n, prototypes.shape[1], generator=generator), y


def _online(benchmark: Any, seed: int) -> list[Any]:
    from avalanche.benchmarks.scenarios.online import split_online_stream

    return list(split_online_stream(benchmark.train_stream, BATCH, shuffle=True, seed=seed))


def _drive(
    train: Callable[[Any], object],
    predict: Callable[[torch.Tensor], torch.Tensor],
    experiences: Sequence[Any],
    batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    tasks: Sequence[Task],
    *,
    use_experiences: bool,
) -> Run:
    """Feed the stream to ``train`` (Avalanche experiences or taste_cl batches) and score it the same way for all."""
    x_all = torch.cat([t.x_test for t in tasks])
    owner = torch.cat([torch.full((t.x_test.shape[0],), i) for i, t in enumerate(tasks)])
    y_all = torch.cat([t.y_test for t in tasks])

    def correct() -> torch.Tensor:
        with torch.no_grad():
            return predict(x_all).argmax(1) == y_all

    def task_accuracies(right: torch.Tensor) -> list[float]:
        return [float(right[owner == i].float().mean()) for i in range(len(tasks))]

    matrix: list[list[float]] = []
    curve: list[tuple[int, float]] = []
    flips: list[float] = []
    previous: tuple[torch.Tensor, torch.Tensor] | None = None
    seconds, seen, current = 0.0, 0, 0
    for step, (task, x, y) in enumerate(batches, 1):
        if task != current:
            matrix.append(task_accuracies(correct()))
            current = task
        payload = experiences[step - 1] if use_experiences else (x, y)
        begin = time.perf_counter()
        train(payload)
        seconds += time.perf_counter() - begin
        seen += y.shape[0]
        if step % EVAL_EVERY == 0 or step == len(batches):
            right = correct()
            mask = owner <= task
            curve.append((seen, float(right[mask].float().mean())))
            if previous is not None:
                common = previous[1]
                flips.append(float((previous[0][common] & ~right[common]).float().mean()))
            previous = (right, mask)
    right = correct()
    matrix.append(task_accuracies(right))
    return Run(
        float(right.float().mean()),
        statistics.fmean(a for _, a in curve),
        average_forgetting(matrix),
        statistics.fmean(flips) if flips else 0.0,
        seen,
        seconds,
        curve,
    )


def run_taste(strategy: Strategy, experiences: Sequence[Any], batches: Sequence[Any], tasks: Sequence[Task], *, seed: int) -> Run:
    torch.manual_seed(seed)
    model = make_mlp(seed=seed)
    learner = OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        replay=None if isinstance(strategy, LwF) else ClassBalancedReplay(CAPACITY, seed=seed),
        replay_batch_size=BATCH,
        strategy=strategy,
    )
    return _drive(learner.observe, learner.predict, experiences, batches, tasks, use_experiences=False)


def run_avalanche(name: str, experiences: Sequence[Any], batches: Sequence[Any], tasks: Sequence[Task], *, seed: int) -> Run:
    from avalanche.training import DER, ER_ACE
    from avalanche.training.plugins import EvaluationPlugin

    torch.manual_seed(seed)
    model = make_mlp(seed=seed)
    common = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=LR),
        "criterion": torch.nn.CrossEntropyLoss(),
        "mem_size": CAPACITY,
        "batch_size_mem": BATCH,
        "train_mb_size": BATCH,
        "train_epochs": 1,
        "eval_mb_size": 256,
        "evaluator": EvaluationPlugin(),
    }
    strategy = ER_ACE(**common) if name == "ER_ACE" else DER(alpha=ALPHA, beta=BETA, **common)

    def predict(x: torch.Tensor) -> torch.Tensor:
        model.eval()
        return model(x)

    shown = warnings.showwarning
    warnings.showwarning = lambda *args, **kwargs: None  # Avalanche re-enables its deprecation warnings on every call
    try:
        return _drive(strategy.train, predict, experiences, batches, tasks, use_experiences=True)
    finally:
        warnings.showwarning = shown


TASTE: dict[str, Callable[[], Strategy]] = {
    "taste_cl ER": ExperienceReplay,
    "taste_cl ER-ACE": ERACE,
    "taste_cl DER++": lambda: DERPlusPlus(ALPHA, BETA),
    "taste_cl LwF (no buffer)": lambda: LwF(every=50),
}
AVALANCHE = {"avalanche ER_ACE": "ER_ACE", "avalanche DER++": "DER"}


def compare_strategies(tasks: list[Task], seeds: Sequence[int]) -> dict[str, list[Run]]:
    """Every method on every seed of one stream, methods alternating within a seed."""
    from taste_cl.adapters.avalanche import benchmark_from_tasks, experience_tensors

    benchmark = benchmark_from_tasks(tasks)
    runs: dict[str, list[Run]] = {name: [] for name in [*TASTE, *AVALANCHE]}
    for seed in seeds:
        experiences = _online(benchmark, seed)
        batches = [(e.origin_experience.current_experience, *experience_tensors(e)) for e in experiences]
        for name, make in TASTE.items():
            gc.collect()
            runs[name].append(run_taste(make(), experiences, batches, tasks, seed=seed))
        for name, kind in AVALANCHE.items():
            gc.collect()
            runs[name].append(run_avalanche(kind, _online(benchmark, seed), batches, tasks, seed=seed))
    return runs


def mislabelled_stream(seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, range]:
    """Shuffled digits in batches of 10 with every label wrong from 40 % to 60 % of the stream."""
    tasks = split_digits(1, seed=seed)
    x, y = tasks[0].x_train, tasks[0].y_train
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order].clone()
    n_batches = x.shape[0] // BATCH
    harmful = range(int(0.4 * n_batches), int(0.6 * n_batches))
    wrong = slice(harmful.start * BATCH, harmful.stop * BATCH)
    y[wrong] = (y[wrong] + 1 + torch.randint(0, 9, y[wrong].shape, generator=torch.Generator().manual_seed(seed))) % 10
    batches = [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(n_batches)]
    return batches, tasks[0].x_test, tasks[0].y_test, harmful


class _TimedGuard(ProbeGuard):
    """ProbeGuard that adds up the time spent in its own hook (an in-run, load-robust cost measure)."""

    seconds = 0.0

    def after_observe(self, learner: OnlineLearner, stats: Any, **kwargs: Any) -> None:
        begin = time.perf_counter()
        super().after_observe(learner, stats, **kwargs)
        self.seconds += time.perf_counter() - begin


def run_guard(
    seed: int, *, guarded: bool, window: int = 10, warmup: int = 4, lr: float = LR, iterations: int = 3, max_drop: float = 0.05
) -> dict[str, Any]:
    batches, x_test, y_test, harmful = mislabelled_stream(seed)
    torch.manual_seed(seed)
    model = make_mlp(seed=seed)
    guard = _TimedGuard(window=window, warmup=warmup, max_drop=max_drop, seed=seed)
    learner = OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        replay=ReservoirReplay(CAPACITY, seed=seed),
        replay_batch_size=BATCH,
        train_iterations=iterations,
        plugins=[guard] if guarded else [],
    )
    seconds, curve = 0.0, []
    for step, batch in enumerate(batches, 1):
        begin = time.perf_counter()
        learner.observe(batch)
        seconds += time.perf_counter() - begin
        with torch.no_grad():  # after every batch: a dip inside an update window counts too
            served = guard.predict(x_test) if guarded else learner.predict(x_test)  # what the user gets
            curve.append((step * BATCH, float((served.argmax(1) == y_test).float().mean())))
    from_burst = [a for s, a in curve if s > harmful.start * BATCH]  # before it, the guard has nothing to prevent
    return {
        "worst_accuracy": min(from_burst),
        "final_accuracy": curve[-1][1],
        "train_seconds": seconds,
        "guard_seconds": guard.seconds if guarded else 0.0,
        "rollbacks": guard.rollbacks if guarded else 0,
        "windows": guard.windows if guarded else 0,
        "harmful_samples": [harmful.start * BATCH, harmful.stop * BATCH],
        "curve": curve,
    }


def _plot(path: Path, curves: dict[str, dict[str, list[tuple[int, float]]]], guard: dict[str, list[tuple[int, float]]], harmful: list[int]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for axis, (stream, by_method) in zip(axes, curves.items()):
        for name, curve in by_method.items():
            seen, acc = zip(*curve)
            axis.plot(seen, acc, label=name, linestyle="--" if name.startswith("avalanche") else "-")
        axis.set(xlabel="samples seen", ylabel="accuracy on seen classes / segments", ylim=(0, 1), title=f"{stream} (seed 0)")
        axis.legend(fontsize=7)
    for name, curve in guard.items():
        seen, acc = zip(*curve)
        axes[2].plot(seen, acc, label=name)
    axes[2].axvspan(*harmful, color="red", alpha=0.15, label="mislabelled burst")
    axes[2].set(xlabel="samples seen", ylabel="held-out accuracy", ylim=(0, 1), title="probe guard (seed 0)")
    axes[2].legend(fontsize=7)
    save_figure(fig, path)


def _summary(runs: list[Run]) -> dict[str, Any]:
    def mean(key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in runs)

    return {
        "final_accuracy": mean("final_accuracy"),
        "anytime_accuracy": mean("anytime_accuracy"),
        "forgetting": mean("forgetting"),
        "negative_flip_rate": mean("negative_flip_rate"),
        "samples_per_s": statistics.median(r.samples_per_s for r in runs),
        "samples_per_s_fastest": max(r.samples_per_s for r in runs),
        "final_accuracy_runs": [r.final_accuracy for r in runs],
        "samples_per_s_runs": [r.samples_per_s for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("strategies", __doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds (stream order and model init) per stream")
    parser.add_argument("--guard-repeats", type=int, default=3, help="timing repeats per seed of each guard variant (fastest kept)")
    args = parse(parser, argv)
    if args.seeds < 1 or args.guard_repeats < 1:
        parser.error(f"`--seeds == {args.seeds}`, `--guard-repeats == {args.guard_repeats}`: both must be >= 1")
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    warnings.filterwarnings("ignore", module="qpsolvers")
    seeds = range(args.seed, args.seed + args.seeds)
    streams = {"split digits": split_digits(5, seed=0), "gradual drift": drift_tasks(seed=0)}
    results: dict[str, Any] = {}
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for stream, tasks in streams.items():
        runs = compare_strategies(tasks, seeds)
        summary = {name: _summary(found) for name, found in runs.items()}
        for name, kind in (("taste_cl ER-ACE", "avalanche ER_ACE"), ("taste_cl DER++", "avalanche DER++")):
            summary[name]["x_avalanche_samples_per_s"] = summary[name]["samples_per_s"] / summary[kind]["samples_per_s"]
            summary[name]["x_avalanche_fastest"] = summary[name]["samples_per_s_fastest"] / summary[kind]["samples_per_s_fastest"]
        results[stream] = summary
        curves[stream] = {name: found[0].curve for name, found in runs.items()}
        rows = [
            [
                name,
                s["final_accuracy"],
                s["anytime_accuracy"],
                s["forgetting"],
                s["negative_flip_rate"],
                s["samples_per_s"],
                s.get("x_avalanche_samples_per_s", float("nan")),
                s.get("x_avalanche_fastest", float("nan")),
            ]
            for name, s in summary.items()
        ]
        print(f"\n{stream}: mean of {args.seeds} seeds (samples/s: median run; x avalanche also from the fastest runs)")
        print(f"equal compute: {EQUAL_COMPUTE}\nbuffer: {BUFFER}")
        print(format_table(["method", "final acc", "anytime acc", "forgetting", "neg. flip rate", "samples/s", "x avalanche", "fastest"], rows))
    guard_runs: dict[str, list[dict[str, Any]]] = {"unguarded": [], "guarded": []}
    for seed in seeds:
        for name, found in guard_runs.items():
            repeats = []
            for _ in range(args.guard_repeats):  # same seed, same result: the fastest run is the least disturbed
                gc.collect()
                repeats.append(run_guard(seed, guarded=name == "guarded"))
            found.append(min(repeats, key=lambda r: r["train_seconds"]))
    time_ratio = [g["train_seconds"] / u["train_seconds"] for g, u in zip(guard_runs["guarded"], guard_runs["unguarded"])]
    guard_summary = {
        name: {
            "worst_accuracy": statistics.fmean(r["worst_accuracy"] for r in found),
            "final_accuracy": statistics.fmean(r["final_accuracy"] for r in found),
            "rollbacks": statistics.fmean(r["rollbacks"] for r in found),
            "train_seconds": statistics.median(r["train_seconds"] for r in found),
            "worst_accuracy_runs": [r["worst_accuracy"] for r in found],
        }
        for name, found in guard_runs.items()
    }
    guard_summary["time_ratio_guarded_over_unguarded"] = {"median": statistics.median(time_ratio), "runs": time_ratio}
    own = [r["guard_seconds"] / (r["train_seconds"] - r["guard_seconds"]) for r in guard_runs["guarded"]]
    guard_summary["guard_own_time_over_training"] = {"median": statistics.median(own), "runs": own}
    print(f"\nprobe guard, mislabelled burst: mean of {args.seeds} seeds")
    print(
        format_table(
            ["learner", "worst acc", "final acc", "rollbacks", "median train s"],
            [[n, s["worst_accuracy"], s["final_accuracy"], s["rollbacks"], s["train_seconds"]] for n, s in guard_summary.items() if n in guard_runs],
        )
    )
    print(f"guarded / unguarded training time: median {statistics.median(time_ratio):.3f} (runs: {', '.join(f'{r:.3f}' for r in time_ratio)})")
    print(f"time inside the guard / the rest of training, same run: median {statistics.median(own):.3f} (runs: {', '.join(f'{r:.3f}' for r in own)})")
    if plotting_available():
        _plot(
            Path(args.out) / "strategies.png",
            curves,
            {n: found[0]["curve"] for n, found in guard_runs.items()},
            guard_runs["guarded"][0]["harmful_samples"],
        )
    else:
        print(f"no plot: {PLOT_HINT}")
    config = {
        "lr": LR,
        "optimizer": "SGD",
        "replay_capacity": CAPACITY,
        "stream_batch": BATCH,
        "replayed_per_step": BATCH,
        "steps_per_batch": 1,
        "equal_compute": EQUAL_COMPUTE,
        "buffer": BUFFER,
        "der_alpha": ALPHA,
        "der_beta": BETA,
        "eval_every_batches": EVAL_EVERY,
        "seeds": list(seeds),
        "threads": torch.get_num_threads(),
        "guard": {
            "window": 10,
            "max_drop": ProbeGuard().max_drop,
            "max_flip_rate": ProbeGuard().max_flip_rate,
            "warmup_windows": 4,
            "steps_per_batch": 3,
        },
    }
    save_result(
        args.out, "strategies", {"config": config, "streams": results, "guard": guard_summary}, summary=_headline(results, guard_summary, args.seeds)
    )
    return 0


def _headline(results: dict[str, Any], guard: dict[str, Any], seeds: int) -> str:
    """The README row: split digits against Avalanche at equal compute, and the guard's worth and cost."""
    digits = results["split digits"]

    def versus(ours: str, theirs: str) -> str:
        mine, other = digits[f"taste_cl {ours}"], digits[f"avalanche {theirs}"]
        return (
            f"{ours} {format_number(mine['final_accuracy'])} vs Avalanche {theirs} {format_number(other['final_accuracy'])} "
            f"at {format_number(mine['x_avalanche_samples_per_s'])}x its samples/s"
        )

    ratio = guard["time_ratio_guarded_over_unguarded"]["median"]
    return (
        f"split digits, {seeds} seeds: {versus('ER-ACE', 'ER_ACE')}; {versus('DER++', 'DER++')}; plain ER "
        f"{format_number(digits['taste_cl ER']['final_accuracy'])}. Probe guard on a mislabelled burst: worst accuracy "
        f"{format_number(guard['guarded']['worst_accuracy'])} vs {format_number(guard['unguarded']['worst_accuracy'])} "
        f"unguarded, at {format_number(ratio)}x the training time"
    )


if __name__ == "__main__":
    raise SystemExit(main())
