"""Cost of the update guard (``guard_updates``): the reference digits learner, guard modes side by side.

The three modes run the same seeded split-digits stream, alternated over ``--repeats``
runs so shared machine load hits all; prints median samples/s, ratios to "never", the
optimizer steps each mode copy-protected and measured ("always": every step; "auto": the
work it adds to "never", a count rather than a timing, so it holds on a busy machine),
the steps refused and the final accuracies (which must match: the guard changes no
healthy step), and writes JSON.
Run: ``taste-cl bench update-guard``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.datasets import split_digits
from taste_cl.experiment import run_class_incremental
from taste_cl.guards.update import UpdateGuard
from taste_cl.reference import build_digits_learner
from taste_cl.report import format_table


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("update-guard", __doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each guard mode, interleaved")
    args = parse(parser, argv)
    tasks = split_digits(5, seed=args.seed)
    modes = ("never", "auto", "always")
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    accuracies: dict[str, set[float]] = {mode: set() for mode in modes}
    protected: dict[str, set[int]] = {mode: set() for mode in modes}
    refused: dict[str, set[int]] = {mode: set() for mode in modes}
    for _ in progress_bar(range(args.repeats), enabled=not args.no_progress, desc="repeats"):
        for label in rates:
            torch.manual_seed(args.seed)
            learner = build_digits_learner(seed=args.seed)
            learner.guard = UpdateGuard(label)
            result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed)
            rates[label].append(result.samples_per_s)
            accuracies[label].add(round(result.final_accuracy, 6))
            protected[label].add(learner.guard.protected_steps)
            refused[label].add(learner.monitor.report()["events"].get("numerical_fault", 0))
    medians = {label: statistics.median(values) for label, values in rates.items()}
    ratio = {mode: medians[mode] / medians["never"] for mode in modes}
    rows = [[mode, medians[mode], ratio[mode], _join(protected[mode]), _join(refused[mode]), _join(accuracies[mode])] for mode in modes]
    print(format_table(["guard_updates", "median samples/s", "vs never", "protected steps", "refused", "final acc"], rows))
    save_result(
        args.out,
        "update_guard",
        {
            "repeats": args.repeats,
            "samples_per_s": rates,
            "median_samples_per_s": medians,
            "ratio": ratio,
            "final_accuracy": {label: sorted(values) for label, values in accuracies.items()},
            "protected_steps": {label: sorted(values) for label, values in protected.items()},
            "refused_steps": {label: sorted(values) for label, values in refused.items()},
        },
    )
    return 0


def _join(values: set[int] | set[float]) -> str:
    """The distinct values seen over the repeats (one when the runs agree)."""
    return ", ".join(map(str, sorted(values)))


if __name__ == "__main__":
    raise SystemExit(main())
