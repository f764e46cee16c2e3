"""Cost of the update guard (``guard_updates``): the reference digits learner, guard modes side by side.

The three modes run the same seeded split-digits stream, alternated over ``--repeats``
runs so shared machine load hits all; prints median samples/s, ratios to "never" and the
final accuracies (which must match: the guard never changes a step that stays finite), and writes JSON.
Run: ``taste-cl bench update-guard``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from taste_cl._report import format_table
from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.cli.demo import build_digits_learner
from taste_cl.datasets import split_digits
from taste_cl.experiment import run_class_incremental
from taste_cl.guards.update import UpdateGuard


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("update-guard", __doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each guard mode, interleaved")
    args = parse(parser, argv)
    tasks = split_digits(5, seed=args.seed)
    modes = ("never", "auto", "always")
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    accuracies: dict[str, set[float]] = {mode: set() for mode in modes}
    for _ in progress_bar(range(args.repeats), enabled=not args.no_progress, desc="repeats"):
        for label in rates:
            torch.manual_seed(args.seed)
            learner = build_digits_learner(seed=args.seed)
            learner.guard = UpdateGuard(label)
            result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed)
            rates[label].append(result.samples_per_s)
            accuracies[label].add(round(result.final_accuracy, 6))
    medians = {label: statistics.median(values) for label, values in rates.items()}
    ratio = {mode: medians[mode] / medians["never"] for mode in modes}
    rows = [[mode, medians[mode], ratio[mode], ", ".join(map(str, sorted(accuracies[mode])))] for mode in modes]
    print(format_table(["guard_updates", "median samples/s", "vs never", "final acc"], rows))
    save_result(
        args.out,
        "update_guard",
        {
            "repeats": args.repeats,
            "samples_per_s": rates,
            "median_samples_per_s": medians,
            "ratio": ratio,
            "final_accuracy": {label: sorted(values) for label, values in accuracies.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
