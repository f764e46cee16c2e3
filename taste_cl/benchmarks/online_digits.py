"""Online class-incremental split digits: reservoir replay vs no replay, in one run.

5 tasks x 2 classes, one pass, stream batch 10, the reference MLP. Prints final accuracy
over all 10 classes, forgetting and samples/s for each, and writes JSON. The
``reservoir_eval_scoring`` row forces the monitor's ``prequential="eval"`` (an extra
eval-mode forward of each stream batch, what models with BatchNorm/dropout get under
``"auto"``): same training, so the same accuracy; the samples/s ratio is its cost.
Run: ``taste-cl bench online-digits`` or ``python benchmarks/online_digits.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.datasets import split_digits
from taste_cl.experiment import run_class_incremental
from taste_cl.reference import build_digits_learner
from taste_cl.report import format_table


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("online-digits", __doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=200, help="reservoir replay capacity")
    args = parse(parser, argv)
    tasks = split_digits(5, seed=args.seed)
    runs: dict[str, dict[str, Any]] = {}
    for label, capacity, prequential in (
        ("reservoir", args.capacity, "auto"),
        ("reservoir_eval_scoring", args.capacity, "eval"),
        ("no_replay", 0, "auto"),
    ):
        torch.manual_seed(args.seed)
        learner = build_digits_learner(replay_capacity=capacity, seed=args.seed)
        learner.monitor.prequential = prequential  # read on the first batch
        result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed)
        runs[label] = {
            "replay_capacity": capacity,
            "prequential": prequential,
            "final_accuracy": result.final_accuracy,
            "forgetting": result.forgetting,
            "backward_transfer": result.backward_transfer,
            "samples_per_s": result.samples_per_s,
            "accuracy_matrix": result.accuracy_matrix,
        }
    rows = [[k, v["replay_capacity"], v["prequential"], v["final_accuracy"], v["forgetting"], v["samples_per_s"]] for k, v in runs.items()]
    print(format_table(["run", "capacity", "prequential", "final acc", "forgetting", "samples/s"], rows))
    cost = runs["reservoir"]["samples_per_s"] / runs["reservoir_eval_scoring"]["samples_per_s"]
    print(f"eval-mode prequential scoring: {cost:.2f}x the time per sample of reusing the training forward")
    save_result(args.out, "online_digits", {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
