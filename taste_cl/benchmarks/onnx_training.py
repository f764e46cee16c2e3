"""ONNX Runtime training step vs PyTorch eager step, artifact sizes and export time (parity gate included).

For each model both sides start from the same weights and optimizer; the torch step
(forward, loss, backward, optimizer step; BatchNorm with frozen statistics, as exported)
and the device runtime's ``train_step`` (numpy in, ORT forward/backward, update) are timed
alternately over ``--repeats`` rounds of ``--steps`` steps on one batch, so shared load hits
both, and the medians are reported with the ORT/torch ratio. Export time covers the whole
:func:`~taste_cl.adapters.onnxruntime.learner_export.export_model` call: transforms, tracing, ORT artifact
generation, optimizer state and the parity gate. ``--zoo`` runs the real-model zoo of
``tests/zoo.py`` (a source checkout): ResNet-18, MobileNetV2/V3-small at 32x32, LSTM
(AdamW), Transformer on dict token inputs, MSE and BCE MLPs; without it, two small models.
Run: ``taste-cl bench onnx [--zoo]`` (needs the ``[onnx-training]`` extra).
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl.benchmarks._common import alternating_rounds, base_parser, parse, save_result
from taste_cl.report import format_table

ZOO_MODELS = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "lstm", "text_transformer", "regression_mlp",
              "multilabel_mlp")  # fmt: skip
# the zoo's CNN optimizer (lr 0.05) is tuned for batch statistics; exported with frozen statistics
_CNN_LR = 0.01


def small_cases() -> dict[str, Callable[[int], tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]]]:
    def mlp(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        return model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01), _batches((64,))

    def cnn(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
        )  # fmt: skip
        return model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01), _batches((1, 8, 8))

    return {"mlp 64-128-128-10": mlp, "cnn 8x8 16-32": cnn}


def _batches(shape: tuple[int, ...]) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return torch.rand((n, *shape), generator=generator), torch.randint(0, 10, (n,), generator=generator)

    return batch


def _zoo_cases() -> dict[str, Callable[[int], tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]]]:
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "zoo.py").is_file():
        raise SystemExit("--zoo needs a source checkout: tests/zoo.py was not found next to benchmarks/")
    sys.path.insert(0, str(tests))
    from zoo import ZOO  # type: ignore[import-not-found]

    def case(name: str) -> Callable[[int], tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]]:
        def build(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, Any]:
            model, loss_fn, optimizer = ZOO[name].build(seed)
            if ZOO[name].has_batchnorm:
                optimizer = torch.optim.SGD(model.parameters(), lr=_CNN_LR, momentum=0.9)
            return model, loss_fn, optimizer, ZOO[name].batch

        return build

    return {name: case(name) for name in ZOO_MODELS}


def _call(model: nn.Module, x: Any) -> torch.Tensor:
    return model(**x) if isinstance(x, dict) else model(x)


def _torch_step(model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer, x: Any, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    out = _call(model, x)
    loss_fn(out, y.reshape(out.shape) if y.is_floating_point() and y.shape != out.shape else y).backward()
    optimizer.step()


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("onnx", __doc__.splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="run the real-model zoo (tests/zoo.py) instead of two small models")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per training step")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per variant")
    args = parse(parser, argv)

    import onnxruntime

    from taste_cl.adapters.device.transforms import disable_random_layers
    from taste_cl.adapters.onnxruntime.build import export_model
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    threads = torch.get_num_threads()  # --threads applied by parse()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    cases = _zoo_cases() if args.zoo else small_cases()
    rows: list[list[Any]] = []
    size_rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, build in cases.items():
            model, loss_fn, optimizer, batch = build(args.seed)
            disable_random_layers(model)  # both sides train the same function (dropout is random in each)
            x, y = batch(args.batch_size, args.seed)
            start = time.perf_counter()
            folder = export_model(model, loss_fn, optimizer, (x, y), Path(scratch) / name.split()[0])
            export_s = time.perf_counter() - start
            sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir())}
            device = OrtOnlineLearner.from_artifacts(folder, session_options=options)
            x_np = {k: v.numpy() for k, v in x.items()} if isinstance(x, dict) else x.numpy()
            y_np = y.numpy()
            model.train()
            for module in model.modules():  # frozen statistics, as exported
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
            variants: dict[str, Callable[[], Any]] = {
                "torch": functools.partial(_torch_step, model, loss_fn, optimizer, x, y),
                "ort": functools.partial(device.train_step, x_np, y_np),
            }
            timings = alternating_rounds(variants, steps=args.steps, repeats=args.repeats)
            medians = {variant: statistics.median(values) for variant, values in timings.items()}
            ratio = medians["torch"] / medians["ort"]
            total_kib = sum(sizes.values()) / 1024
            rows.append([name, medians["torch"] * 1e3, medians["ort"] * 1e3, ratio, export_s, total_kib])
            runs.append({"model": name, "batch_size": args.batch_size, "torch_ms_per_step": medians["torch"] * 1e3,
                         "ort_ms_per_step": medians["ort"] * 1e3, "ort_speedup": ratio, "export_s_with_gate": export_s,
                         "rounds_s_per_step": timings, "artifact_bytes": sizes})  # fmt: skip
            size_rows.extend([name, file, size / 1024] for file, size in sizes.items())
    print(format_table(["model", "torch ms/step", "ort ms/step", "torch/ort", "export s (gate incl.)", "artifacts KiB"], rows))
    print()
    print(format_table(["model", "artifact", "KiB"], size_rows))
    save_result(
        args.out,
        "onnx_training_zoo" if args.zoo else "onnx_training",
        {
            "threads": threads,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "repeats": args.repeats,
            "onnxruntime": onnxruntime.__version__,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
