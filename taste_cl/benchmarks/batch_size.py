"""Throughput-aware batch-size tuning (TASTE) on real models, all measured in one run.

For each model (``--zoo``: an MLP, the 3-conv CNN, MobileNetV2 and ResNet-18 at 32x32, an
LSTM with AdamW and a small TransformerEncoder on token dicts; default: the CNN only):

1. the full throughput curve over the tuner's candidate grid, two passes (ascending and
   descending), each timed: the grid's cost is one pass, every size measured as a probe is;
2. a cold tune and a warm (cached) retune, timed;
3. side by side, interleaved rounds: the grid's three best sizes (the oracle is the fastest
   of them here), the tuned size, the max batch and batch 32.

Then, with a bounded CPU hog running (one busy process per core, killed by the benchmark
and self-terminating), joint (threads, batch) tuning against torch's default thread count
at the tuned batch, interleaved, over the same work: with batches up to an online
learner's step (32; the tuner plugin never exceeds the effective batch) and up to 1024. Probes and grid use the same measurement (real samples,
a copy of the model and optimizer). Writes ``batch_size.json`` and ``batch_size.png``
under ``--out``. Run: ``taste-cl bench batch-size --zoo``.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.datasets import TextClassifier, make_cnn, make_mlp, make_pattern_images
from taste_cl.plotting import PLOT_HINT, plotting_available, pyplot, save_figure
from taste_cl.report import format_number, format_table
from taste_cl.tuning.probe import ProbeRunner, Samples, preserved_rng
from taste_cl.tuning.tuner import BatchSizeTuner, candidate_batch_sizes

HOG = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
DEFAULT_THREADS = torch.get_num_threads()  # torch's own default, read before --threads applies


class _LSTM(nn.Module):
    """LSTM over ``(n, 20, 16)`` sequences, classifying from the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 64, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[1][0][-1])


def _tokens(n: int) -> Samples:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 33, (n,), generator=g)
    mask = (torch.arange(32)[None, :] < lengths[:, None]).long()
    return {"input_ids": torch.randint(1, 100, (n, 32), generator=g) * mask, "attention_mask": mask}, torch.randint(0, 10, (n,), generator=g)


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=10)

    return build


@dataclass(frozen=True)
class Case:
    """A benchmark model: builder, optimizer, real-looking samples, and its search ceiling."""

    name: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    samples: Callable[[], Samples]
    max_batch: int


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


CASES = {
    case.name: case
    for case in (
        Case("mlp", lambda: make_mlp(), _sgd, lambda: (torch.rand(256, 64), torch.randint(0, 10, (256,))), 1024),
        Case("cnn", lambda: make_cnn(), _sgd, lambda: make_pattern_images(256), 1024),
        Case("mobilenet_v2", _torchvision("mobilenet_v2"), _sgd, lambda: make_pattern_images(256), 256),
        Case("resnet18", _torchvision("resnet18"), _sgd, lambda: make_pattern_images(256), 256),
        Case(
            "lstm",
            _LSTM,
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
            lambda: (torch.randn(256, 20, 16), torch.randint(0, 10, (256,))),
            1024,
        ),
        Case(
            "transformer",
            partial(TextClassifier, vocab=100, dim=64, classes=10, feedforward=128),
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
            lambda: _tokens(256),
            512,
        ),
    )
}


def _interleaved(runner: ProbeRunner, points: Mapping[str, tuple[int, int | None]], rounds: int, min_time: float) -> dict[str, list[float]]:
    """Samples/s per labelled (batch, threads), one per round, measured round by round; labels
    naming the same point share its measurements (a tuned choice equal to the oracle's ties it)."""
    distinct = sorted(set(points.values()), key=lambda p: (p[0], p[1] or 0))
    rates: dict[tuple[int, int | None], list[float]] = {p: [] for p in distinct}
    for _ in range(rounds):
        for batch, threads in distinct:
            rates[(batch, threads)].append(runner.measure(batch, threads=threads, min_time=min_time))
    return {label: rates[point] for label, point in points.items()}


def _fixed_work(runner: ProbeRunner, point: tuple[int, int | None], steps: int, rounds: int) -> list[float]:
    """Seconds of ``steps`` training steps at ``point`` = (batch, threads), once per round."""
    return [runner.work(point[0], steps, threads=point[1])[1] for _ in range(rounds)]


def _ratio(rounds: dict[str, list[float]], label: str, reference: str) -> float:
    """Median over rounds of the two labels' rates measured in the same round (the machine's load
    drifts between rounds; within a round the two were measured moments apart)."""
    return statistics.median(a / b for a, b in zip(rounds[label], rounds[reference]))


def _grid(runner: ProbeRunner, candidates: list[int], min_time: float) -> tuple[dict[int, float], float]:
    """The throughput curve over ``candidates``: two passes (ascending, then descending, so a slow
    spell of the machine does not tilt one end), geometric mean per size; and the seconds one pass
    takes on average, each size measured the way a tuner probe measures it."""
    passes, seconds = [], []
    for order in (candidates, candidates[::-1]):
        start = time.perf_counter()
        passes.append({b: runner.measure(b, min_time=min_time) for b in order})
        seconds.append(time.perf_counter() - start)
    return {b: math.sqrt(passes[0][b] * passes[1][b]) for b in candidates}, statistics.fmean(seconds)


def run_case(case: Case, *, max_batch: int | None, rounds: int, min_time: float) -> dict[str, Any]:
    """Grid, cold and warm tune, then the interleaved comparison, for one model.

    The oracle is the fastest of the grid's three best sizes re-measured in the interleaved
    rounds beside the tuned choice, so neither a lucky grid point nor a lucky round decides."""
    torch.manual_seed(0)
    model, samples = case.build(), case.samples()
    optimizer, loss_fn = case.optimizer(model), nn.CrossEntropyLoss()
    limit = min(max_batch or case.max_batch, case.max_batch)
    with tempfile.TemporaryDirectory() as cache_dir, preserved_rng():
        tuner = BatchSizeTuner(max_batch_size=limit, cache_dir=cache_dir, memory_budget_bytes=16e9, min_probe_time=min_time)
        runner = ProbeRunner(model, optimizer, loss_fn, samples)
        minimum = runner.smallest_trainable(limit)[0]  # what the tuner searches from (BatchNorm: 2)
        candidates = candidate_batch_sizes(limit, per_octave=tuner.per_octave, min_batch_size=minimum)
        grid, grid_seconds = _grid(runner, candidates, min_time)
        cold = tuner.tune(model, optimizer, loss_fn, samples, foreign_load=0.0)
        warm = tuner.tune(model, optimizer, loss_fn, samples, foreign_load=0.0)
        top = sorted(grid, key=grid.__getitem__, reverse=True)[:3]
        sizes = {"tuned": cold.batch_size, "max_batch": limit, "default_32": max(minimum, min(32, limit))}
        points = {**{f"grid_top{i}": (b, None) for i, b in enumerate(top)}, **{k: (b, None) for k, b in sizes.items()}}
        per_round = _interleaved(runner, points, rounds, 2 * min_time)
    best = max(range(len(top)), key=lambda i: statistics.median(per_round[f"grid_top{i}"]))
    sizes["oracle"], per_round["oracle"] = top[best], per_round[f"grid_top{best}"]
    return {
        "sizes": sizes,
        "samples_per_s": {label: statistics.median(values) for label, values in per_round.items()},
        "samples_per_s_per_round": per_round,
        "tuned_vs_oracle": _ratio(per_round, "tuned", "oracle"),
        "tuned_vs_max_batch": _ratio(per_round, "tuned", "max_batch"),
        "tuned_vs_default_32": _ratio(per_round, "tuned", "default_32"),
        "grid_ceiling_vs_max_batch": max(grid.values()) / grid[limit],
        "grid": {str(b): r for b, r in grid.items()},
        "grid_seconds": grid_seconds,
        "cold_seconds": cold.seconds,
        "cold_probes": len(cold.probes),
        "cold_probe_list": [list(p) for p in cold.probes],
        "cold_vs_grid": cold.seconds / grid_seconds,
        "warm_seconds": warm.seconds,
        "warm_probes": len(warm.probes),
        "warm_probe_list": [list(p) for p in warm.probes],
        "warm_vs_cold": warm.seconds / cold.seconds,
        "warm_batch": warm.batch_size,
    }


def run_threads_under_load(case: Case, *, hog_seconds: int, rounds: int, min_time: float, max_batch: int) -> dict[str, Any]:
    """With one busy-loop process per core, joint (threads, batch) tuning up to ``max_batch`` vs
    torch's default threads at the tuned batch."""
    import psutil

    torch.manual_seed(0)
    model, samples = case.build(), case.samples()
    optimizer, loss_fn = case.optimizer(model), nn.CrossEntropyLoss()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(seconds=hog_seconds)]) for _ in range(psutil.cpu_count() or 2)]
    try:
        with tempfile.TemporaryDirectory() as cache_dir, preserved_rng():
            torch.set_num_threads(DEFAULT_THREADS)
            tuner = BatchSizeTuner(max_batch_size=max_batch, cache_dir=cache_dir, tune_threads=True, min_probe_time=min_time)
            result = tuner.tune(model, optimizer, loss_fn, samples)
            runner = ProbeRunner(model, optimizer, loss_fn, samples)
            points = {"joint": (result.batch_size, result.threads), "default_threads": (result.batch_size, DEFAULT_THREADS)}
            per_round = _interleaved(runner, points, rounds, 2 * min_time)
            steps = max(3, math.ceil(2 * min_time * result.samples_per_s / result.batch_size))
            work = {label: _fixed_work(runner, point, steps, rounds) for label, point in points.items()}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return {
        "model": case.name,
        "max_batch": max_batch,
        "default_threads": DEFAULT_THREADS,
        "tuned_batch": result.batch_size,
        "tuned_threads": result.threads,
        "samples_per_s": {label: statistics.median(values) for label, values in per_round.items()},
        "samples_per_s_per_round": per_round,
        "joint_vs_default_threads": _ratio(per_round, "joint", "default_threads"),
        # the same work (rounds x steps steps) in each setting: total samples over total seconds,
        # where a slow spell counts in full (a median of rounds hides a round 100x slower)
        "fixed_work": {"steps_per_round": steps, "rounds": rounds, "seconds_per_round": work},
        "joint_vs_default_threads_fixed_work": sum(work["default_threads"]) / sum(work["joint"]),
        "tune_seconds": result.seconds,
        "probes": [list(p) for p in result.probes],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("batch-size", __doc__.splitlines()[0], threads=0)
    parser.add_argument("--zoo", action="store_true", help="all six models (default: the CNN only)")
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), help="these models instead")
    parser.add_argument("--max-batch", type=int, default=None, help="lower every model's search ceiling to this")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the side-by-side comparison")
    parser.add_argument("--min-probe-time", type=float, default=0.15, help="seconds each probe measures at least")
    parser.add_argument("--threads-model", default="mlp", choices=sorted(CASES), help="model of the thread check under load")
    parser.add_argument(
        "--threads-max-batch",
        type=int,
        nargs="+",
        default=[32, 1024],
        help="search ceilings of the thread check: an online step (the plugin never exceeds the effective batch), the whole range",
    )
    parser.add_argument("--skip-threads", action="store_true", help="skip the threads-under-load check")
    args = parse(parser, argv)
    names = args.models or (list(CASES) if args.zoo else ["cnn"])
    results: dict[str, Any] = {}
    threads: list[dict[str, Any]] | None = None
    for name in names:
        print(f"{name} ...", flush=True)
        results[name] = run_case(CASES[name], max_batch=args.max_batch, rounds=args.rounds, min_time=args.min_probe_time)
        done = results[name]
        tuned, ratio, cold = done["sizes"]["tuned"], done["tuned_vs_oracle"], done["cold_seconds"]
        print(f"  tuned batch {tuned}: {ratio:.2f} of the oracle's samples/s, cold tune {cold:.1f} s", flush=True)
    if not args.skip_threads:
        case = CASES[args.threads_model]
        threads = [
            run_threads_under_load(case, hog_seconds=600, rounds=args.rounds, min_time=args.min_probe_time, max_batch=limit)
            for limit in args.threads_max_batch
        ]

    rows = []
    for name, r in results.items():
        s = r["sizes"]
        rows.append(
            [
                name,
                s["oracle"],
                s["tuned"],
                s["max_batch"],
                r["tuned_vs_oracle"],
                r["tuned_vs_max_batch"],
                r["grid_ceiling_vs_max_batch"],
                r["tuned_vs_default_32"],
                r["cold_seconds"],
                r["cold_vs_grid"],
                r["warm_vs_cold"],
            ]
        )
    print(
        format_table(
            ["model", "oracle", "tuned", "max", "tuned/oracle", "tuned/max", "grid ceil/max", "tuned/32", "cold s", "cold/grid", "warm/cold"], rows
        )
    )
    for check in threads or []:
        print(
            f"\nunder a CPU hog ({args.threads_model}, batches up to {check['max_batch']}): joint tune -> batch {check['tuned_batch']} x "
            f"{check['tuned_threads']} threads = {check['joint_vs_default_threads_fixed_work']:.2f}x the samples/s of torch's default "
            f"{DEFAULT_THREADS} threads at that batch over the same work (median of per-round rates: {check['joint_vs_default_threads']:.2f}x)"
        )
    save_result(args.out, "batch_size", {"models": results, "threads_under_load": threads}, summary=_headline(results, threads))
    if plotting_available():
        _plot(results, Path(args.out) / "batch_size.png")
    else:
        print(f"no plot: {PLOT_HINT}")
    return 0


def _headline(results: dict[str, dict[str, Any]], threads: list[dict[str, Any]] | None) -> str:
    """The README row: the ranges over the models, the CNN's ceiling, the thread check."""

    def span(key: str) -> str:
        values = [r[key] for r in results.values()]
        return f"{format_number(min(values))}-{format_number(max(values))}" if len(values) > 1 else format_number(values[0])

    parts = [
        f"{len(results)} model{'s' if len(results) > 1 else ''} ({', '.join(results)}): tuned {span('tuned_vs_oracle')} of the grid "
        f"oracle's samples/s; cold tune {span('cold_vs_grid')} of the grid's time, warm retune {span('warm_vs_cold')} of the cold"
    ]
    if "cnn" in results:
        cnn = results["cnn"]
        parts.append(
            f"CNN {format_number(cnn['tuned_vs_max_batch'])}x its max batch (the grid's ceiling {format_number(cnn['grid_ceiling_vs_max_batch'])}x)"
        )
    if threads:
        ratios = ", ".join(f"{format_number(t['joint_vs_default_threads_fixed_work'])}x (batches up to {t['max_batch']})" for t in threads)
        parts.append(f"under a CPU hog, joint threads x batch vs torch's default threads over the same work: {ratios}")
    return "; ".join(parts)


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        grid = {int(b): v for b, v in r["grid"].items()}
        peak = max(grid.values())
        (line,) = ax.plot(list(grid), [v / peak for v in grid.values()], marker=".", label=name)
        tuned = r["sizes"]["tuned"]
        ax.plot([tuned], [grid.get(tuned, float("nan")) / peak], "*", markersize=12, color=line.get_color())
    ax.set(xscale="log", xlabel="batch size", ylabel="samples/s / grid peak", title="throughput curves (* = tuned batch)")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    raise SystemExit(main())
