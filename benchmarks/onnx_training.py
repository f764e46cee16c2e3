"""ONNX Runtime training step vs PyTorch eager step: samples/s for the same model and batch.

For the digits MLP and a small CNN at two batch sizes, both learners start from the same
weights; the two are timed alternately over ``--repeats`` rounds of ``--steps`` SGD steps
(so shared load hits both) and the medians are reported, with the ORT/torch ratio and
the size of each exported artifact. Both run the learners' ``train_step`` (forward,
backward, finiteness check, update) with the same number of threads (``--threads``, default 1).
Run: ``taste-cl bench onnx`` (needs the ``[onnx]`` extra).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl._report import format_table
from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.datasets import make_mlp
from taste_cl.learner import OnlineLearner


def _small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
    )  # fmt: skip


MODELS: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...]]] = {
    "mlp 64-128-128-10": (lambda seed: make_mlp(seed=seed), (64,)),
    "cnn 8x8 16-32": (_small_cnn, (1, 8, 8)),
}


def _samples_per_s(step: Callable[[], Any], steps: int, batch: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("onnx", __doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[20, 64])
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per variant")
    args = parse(parser, argv)

    import onnxruntime

    from taste_cl.adapters.onnx import OrtOnlineLearner, export

    threads = torch.get_num_threads()  # --threads applied by parse()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    rows: list[list[Any]] = []
    size_rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for model_name, (build, shape) in MODELS.items():
            model = build(args.seed)
            learner = OnlineLearner(
                model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), input_shape=shape, num_classes=10
            )
            folder = export(learner, Path(scratch) / model_name.split()[0])
            sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir())}
            device = OrtOnlineLearner.from_artifacts(folder, session_options=options)
            for batch in args.batch_sizes:
                generator = torch.Generator().manual_seed(args.seed)
                x = torch.rand((batch, *shape), generator=generator)
                y = torch.randint(0, 10, (batch,), generator=generator)
                x_np, y_np = x.numpy(), y.numpy()
                variants = {
                    "torch": lambda: learner.train_step(x, y),
                    "ort": lambda: device.train_step(x_np, y_np),
                }
                for step in variants.values():  # warm-up: first-call allocations and graph setup
                    step()
                timings: dict[str, list[float]] = {name: [] for name in variants}
                for round_ in range(args.repeats):
                    order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
                    for name in order:
                        timings[name].append(_samples_per_s(variants[name], args.steps, batch))
                medians = {name: statistics.median(values) for name, values in timings.items()}
                ratio = medians["ort"] / medians["torch"]
                rows.append([model_name, batch, medians["torch"], medians["ort"], ratio])
                runs.append(
                    {
                        "model": model_name,
                        "batch_size": batch,
                        "torch_samples_per_s": medians["torch"],
                        "ort_samples_per_s": medians["ort"],
                        "ort_over_torch": ratio,
                        "rounds": timings,
                        "artifact_bytes": sizes,
                    }
                )
            size_rows.extend([model_name, name, size / 1024] for name, size in sizes.items())
    print(format_table(["model", "batch", "torch samples/s", "ort samples/s", "ort/torch"], rows))
    print()
    print(format_table(["model", "artifact", "KiB"], size_rows))
    save_result(
        args.out,
        "onnx_training",
        {"threads": threads, "steps": args.steps, "repeats": args.repeats, "onnxruntime": onnxruntime.__version__, "runs": runs},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
