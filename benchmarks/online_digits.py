"""Online class-incremental split digits: reservoir replay vs no replay, in one run.

5 tasks x 2 classes, one pass, stream batch 10, the reference MLP. Prints final accuracy
over all 10 classes, forgetting and samples/s for each, and writes JSON.
Run: ``taste-cl bench online-digits`` or ``python benchmarks/online_digits.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from taste_cl._report import format_table
from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.datasets import split_digits
from taste_cl.demo import build_digits_learner
from taste_cl.experiment import run_class_incremental


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("online-digits", __doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=200, help="reservoir replay capacity")
    args = parse(parser, argv)
    tasks = split_digits(5, seed=args.seed)
    runs = {}
    for label, capacity in (("reservoir", args.capacity), ("no_replay", 0)):
        torch.manual_seed(args.seed)
        learner = build_digits_learner(replay_capacity=capacity, seed=args.seed)
        result = run_class_incremental(learner, tasks, batch_size=10, seed=args.seed)
        runs[label] = {
            "replay_capacity": capacity,
            "final_accuracy": result.final_accuracy,
            "forgetting": result.forgetting,
            "backward_transfer": result.backward_transfer,
            "samples_per_s": result.samples_per_s,
            "accuracy_matrix": result.accuracy_matrix,
        }
    rows = [[k, v["replay_capacity"], v["final_accuracy"], v["forgetting"], v["samples_per_s"]] for k, v in runs.items()]
    print(format_table(["run", "capacity", "final acc", "forgetting", "samples/s"], rows))
    save_result(args.out, "online_digits", {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
