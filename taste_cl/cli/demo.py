"""``taste-cl demo``: an online class-incremental stream on sklearn digits, with replay.

Five tasks of two digit classes arrive one after another, ten samples at a time, seen
once. The learner rehearses a 200-sample reservoir; the demo prints the accuracy
matrix and forgetting, and saves a plot of the accuracy matrix and of accuracy over
the stream, beside the same stream without replay (the plot needs matplotlib, the ``plot``
extra; without it the demo prints its tables and says how to get the plot).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from taste_cl.cli.console import HelpFormatter, plain_text, progress_enabled
from taste_cl.datasets import split_digits
from taste_cl.experiment import StreamResult, run_class_incremental
from taste_cl.plotting import PLOT_HINT, plotting_available, pyplot, save_figure
from taste_cl.reference import build_digits_learner
from taste_cl.report import format_table

__all__ = ["main", "plot_result"]


def _curve_to_the_end(result: StreamResult) -> list[tuple[int, float]]:
    """The accuracy curve, ending at the final accuracy the run reports."""
    curve = list(result.curve)
    if not curve or curve[-1][0] < result.samples:
        curve.append((result.samples, result.final_accuracy))
    return curve


def plot_result(
    result: StreamResult,
    path: str | Path,
    *,
    title: str = "taste_cl on split digits",
    task_classes: Sequence[Sequence[int]] | None = None,
    baseline: StreamResult | None = None,
) -> Path:
    """Save the accuracy matrix (heatmap) and the accuracy-over-stream curve as one PNG.

    ``task_classes`` labels the tasks with their classes; ``baseline`` (e.g. the same
    stream without replay) is drawn beside the curve for comparison.
    """
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    image = left.imshow(result.accuracy_matrix, vmin=0, vmax=1, cmap="viridis")
    n_tasks = len(result.accuracy_matrix)
    names = [f"T{i}" + (f"\n{','.join(map(str, task_classes[i]))}" if task_classes else "") for i in range(n_tasks)]
    left.set_xticks(range(n_tasks), names)
    left.set_yticks(range(n_tasks), [name.replace("\n", " ") for name in names])
    left.set(xlabel="evaluated on task (its digits)", ylabel="after training task", title="accuracy matrix")
    for i, row in enumerate(result.accuracy_matrix):
        for j, value in enumerate(row):
            left.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.6 else "k", fontsize=8)
    fig.colorbar(image, ax=left, label="test accuracy on the task")
    for run, label, style in ((result, "with replay", "-"), (baseline, "no replay", "--")):
        if run is not None:
            seen, acc = zip(*_curve_to_the_end(run))
            right.plot(seen, acc, style, label=f"{label} (final {run.final_accuracy:.2f})")
    right.set(xlabel="samples seen", ylabel="accuracy on all test data", ylim=(0, 1), title="accuracy over the stream")
    right.legend(loc="upper left")
    fig.suptitle(title)
    return save_figure(fig, path, bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taste-cl demo", description=plain_text(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("--replay", type=int, default=200, help="replay capacity (0 = no replay)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task order, stream, model and replay")
    parser.add_argument("--plot", default="taste_cl_demo.png", help="where to save the PNG (needs matplotlib: pip install '.[plot]')")
    parser.add_argument("--no-baseline", action="store_true", help="skip the comparison run without replay")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar (hidden anyway when not a terminal)")
    args = parser.parse_args(argv)
    show = progress_enabled(not args.no_progress)

    tasks = split_digits(5, seed=args.seed)
    torch.manual_seed(args.seed)
    learner = build_digits_learner(replay_capacity=args.replay, seed=args.seed)
    result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed, curve_every=5, progress=show)
    baseline = None
    if args.replay and not args.no_baseline:
        torch.manual_seed(args.seed)
        plain = build_digits_learner(replay_capacity=0, seed=args.seed)
        baseline = run_class_incremental(plain, tasks, batch_size=10, seed=args.seed, curve_every=5, progress=show)

    headers = ["after task", *(f"T{j} {tasks[j].classes}" for j in range(len(tasks)))]
    rows = [[f"T{i}", *row] for i, row in enumerate(result.accuracy_matrix)]
    print(format_table(headers, rows))
    report = learner.monitor.report()
    print(
        f"\nfinal accuracy (all 10 classes): {result.final_accuracy:.3f}   forgetting: {result.forgetting:.3f}   "
        f"BWT: {result.backward_transfer:.3f}   {result.samples_per_s:.0f} samples/s"
    )
    if baseline is not None:
        print(f"without replay: final accuracy {baseline.final_accuracy:.3f}   forgetting {baseline.forgetting:.3f}")
    print(f"monitor: {report}")
    if plotting_available():
        path = plot_result(result, args.plot, task_classes=[task.classes for task in tasks], baseline=baseline)
        print(f"plot saved to {path}")
    else:
        print(f"no plot: {PLOT_HINT}")
    return 0
