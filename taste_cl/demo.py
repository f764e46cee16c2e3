"""``taste-cl demo``: an online class-incremental stream on sklearn digits, with replay.

Five tasks of two digit classes arrive one after another, ten samples at a time, seen
once. The learner rehearses a 200-sample reservoir; the demo prints the accuracy
matrix and forgetting, and saves a plot of the accuracy matrix and of accuracy over
the stream.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from taste_cl._report import format_table
from taste_cl.datasets import make_mlp, split_digits
from taste_cl.experiment import StreamResult, run_class_incremental
from taste_cl.learner import OnlineLearner
from taste_cl.replay import ReplayStrategy, ReservoirReplay

__all__ = ["build_digits_learner", "main", "plot_result"]


def build_digits_learner(
    *,
    replay_capacity: int = 200,
    replay: ReplayStrategy | None = None,
    lr: float = 0.1,
    seed: int = 0,
    replay_batch_size: int = 10,
    train_iterations: int = 3,
) -> OnlineLearner:
    """The reference setup: 64-128-128-10 MLP, SGD, replay, 3 rehearsal steps per batch.

    Each stream batch is trained ``train_iterations`` times, each time with
    ``replay_batch_size`` replayed samples. ``replay`` overrides the default
    ``ReservoirReplay(replay_capacity)`` (0 = no replay).
    """
    model = make_mlp(seed=seed)
    if replay is None and replay_capacity:
        replay = ReservoirReplay(replay_capacity, seed=seed)
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        replay=replay,
        replay_batch_size=replay_batch_size,
        train_iterations=train_iterations,
    )


def plot_result(result: StreamResult, path: str | Path, *, title: str = "taste_cl on split digits") -> Path:
    """Save the accuracy matrix (heatmap) and the accuracy-over-stream curve as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    image = left.imshow(result.accuracy_matrix, vmin=0, vmax=1, cmap="viridis")
    left.set(xlabel="evaluated on task", ylabel="after training task", title="accuracy matrix")
    for i, row in enumerate(result.accuracy_matrix):
        for j, value in enumerate(row):
            left.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.6 else "k", fontsize=8)
    fig.colorbar(image, ax=left)
    if result.curve:
        seen, acc = zip(*result.curve)
        right.plot(seen, acc)
    right.set(xlabel="samples seen", ylabel="accuracy on all test data", ylim=(0, 1), title="accuracy over the stream")
    fig.suptitle(title)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taste-cl demo", description=__doc__.splitlines()[0])
    parser.add_argument("--replay", type=int, default=200, help="replay capacity (0 = no replay)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="taste_cl_demo.png", help="where to save the PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    tasks = split_digits(5, seed=args.seed)
    learner = build_digits_learner(replay_capacity=args.replay, seed=args.seed)
    result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed, curve_every=5, progress=not args.no_progress)

    headers = ["after task", *(f"T{j} {tasks[j].classes}" for j in range(len(tasks)))]
    rows = [[f"T{i}", *row] for i, row in enumerate(result.accuracy_matrix)]
    print(format_table(headers, rows))
    report = learner.monitor.report()
    print(
        f"\nfinal accuracy (all 10 classes): {result.final_accuracy:.3f}   forgetting: {result.forgetting:.3f}   "
        f"BWT: {result.backward_transfer:.3f}   {result.samples_per_s:.0f} samples/s"
    )
    print(
        f"monitor: stability {report['stability']:.3f}  plasticity {report['plasticity']:.3f}  "
        f"drift detections {report['drift']['count']}"
    )
    print(f"plot saved to {plot_result(result, args.plot)}")
    return 0
