"""Device runtimes side by side: ONNX Runtime and ExecuTorch training steps vs the PyTorch eager step.

For each model, the same trained learner is exported through each backend
(``learner.export(backend=...)``, parity gate included) and the export time, artifact size
and refusals are recorded; then the eager step and every published device step are timed
alternately over ``--repeats`` rounds of ``--steps`` SGD steps on one batch (so shared load
hits all of them) and the medians reported as samples/s and as ratios over eager PyTorch.
``--zoo`` adds MobileNetV3-small and the BatchNorm MLP (ExecuTorch with frozen BatchNorm).
Run: ``taste-cl bench device`` (needs the ``[onnx]`` and ``[executorch]`` extras).
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
from taste_cl.benchmarks._common import alternating_rounds, base_parser, parse, save_result
from taste_cl.learner import OnlineLearner
from taste_cl.replay import ReservoirReplay

BACKENDS = ("onnxruntime", "executorch")
TRANSFORMS = ["freeze_batchnorm", "disable_dropout"]  # applied by the ExecuTorch export only


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )  # fmt: skip


def _ln_hardswish() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Hardswish(), nn.Linear(128, 10))


def _zoo(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        if name == "batchnorm_mlp":
            return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
        return getattr(torchvision.models, name)(weights=None, num_classes=10)

    return build


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp 64-128-128-10": (_mlp, (64,)),
    "cnn stride-2 16x16": (_cnn, (3, 16, 16)),
    "mlp layernorm+hardswish": (_ln_hardswish, (64,)),
}
ZOO_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "batchnorm+dropout mlp": (_zoo("batchnorm_mlp"), (64,)),
    "mobilenet_v3_small 32x32": (_zoo("mobilenet_v3_small"), (3, 32, 32)),
}


def _export_all(learner: OnlineLearner, folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Export through each backend; return the loaded device learners and per-backend facts."""
    from taste_cl.adapters.executorch.learner import EtOnlineLearner
    from taste_cl.adapters.onnxruntime.learner_export import OrtOnlineLearner

    loaders: dict[str, Callable[[Path], Any]] = {
        "onnxruntime": OrtOnlineLearner.from_artifacts,
        "executorch": EtOnlineLearner.from_artifacts,
    }
    devices: dict[str, Any] = {}
    facts: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        options = {"transforms": TRANSFORMS} if backend == "executorch" else {}
        start = time.perf_counter()
        try:
            target = learner.export(folder / backend, backend=backend, **options)
        except Exception as error:  # noqa: BLE001 - any failure to export is reported as that backend's refusal
            facts[backend] = {"refused": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            continue
        seconds = time.perf_counter() - start
        size = sum(path.stat().st_size for path in target.iterdir() if path.name != "replay.npz")
        facts[backend] = {"export_s": seconds, "artifact_bytes": size}
        devices[backend] = loaders[backend](target)
    return devices, facts


def _variants(learner: OnlineLearner, devices: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """One training step per runtime on the same batch: eager PyTorch and each device learner."""
    x_np, y_np = x.numpy(), y.numpy()
    variants: dict[str, Callable[[], Any]] = {"torch": lambda: learner.train_step(x, y)}
    for name, device in devices.items():
        variants[name] = _device_step(device, x_np, y_np)
    return variants


def _device_step(device: Any, x: Any, y: Any) -> Callable[[], Any]:
    return lambda: device.train_step(x, y)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("device", __doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per training step")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per variant")
    parser.add_argument("--zoo", action="store_true", help="add MobileNetV3-small and the BatchNorm+Dropout MLP")
    parser.add_argument("--models", nargs="+", metavar="WORD", help="only the models whose name contains one of these words")
    args = parse(parser, argv)
    models = {**MODELS, **(ZOO_MODELS if args.zoo else {})}
    if args.models:
        models = {name: spec for name, spec in models.items() if any(word in name for word in args.models)}
        if not models:
            parser.error(f"--models {args.models} matches none of {sorted({**MODELS, **ZOO_MODELS})}")
    rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for model_name, (build, shape) in models.items():
            torch.manual_seed(args.seed)
            model = build()
            learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), replay=ReservoirReplay(64))
            generator = torch.Generator().manual_seed(args.seed)
            x = torch.rand((args.batch_size, *shape), generator=generator)
            y = torch.randint(0, 10, (args.batch_size,), generator=generator)
            learner.observe((x, y))
            devices, facts = _export_all(learner, Path(scratch) / f"m{len(runs)}")
            variants = _variants(learner, devices, x, y)
            seconds = alternating_rounds(variants, steps=args.steps, repeats=args.repeats)
            timings = {name: [args.batch_size / s for s in values] for name, values in seconds.items()}  # samples/s
            medians = {name: statistics.median(values) for name, values in timings.items()}
            for backend in BACKENDS:
                fact = facts[backend]
                if "refused" in fact:
                    rows.append([model_name, backend, medians["torch"], "refused", "", "", "", fact["refused"][:70]])
                    continue
                rows.append(
                    [
                        model_name, backend, medians["torch"], medians[backend], medians[backend] / medians["torch"],
                        fact["artifact_bytes"] / 1024, fact["export_s"], "",
                    ]
                )  # fmt: skip
                fact.update(samples_per_s=medians[backend], over_torch=medians[backend] / medians["torch"])
            runs.append({"model": model_name, "torch_samples_per_s": medians["torch"], "backends": facts, "rounds": timings})
    headers = ["model", "backend", "torch samples/s", "device samples/s", "device/torch", "KiB", "export s", "refused"]
    print(format_table(headers, rows))
    save_result(
        args.out,
        "device_runtimes",
        {"batch_size": args.batch_size, "steps": args.steps, "repeats": args.repeats, "transforms": TRANSFORMS, "runs": runs},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
