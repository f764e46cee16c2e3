"""Device runtimes side by side: ONNX Runtime and ExecuTorch training steps vs eager PyTorch, every tensor and an elastic selection.

For each model, a learner with an :class:`~taste_cl.elastic.ElasticTrainer` (``--rho``)
observes a few batches, so it has profiled its tensors and selected those worth their
time; it is then exported through each backend twice, every trainable tensor and
``trainable=`` the elastic selection (parity gate included), and the export time, artifact
size and refusals are recorded. Eager PyTorch training everything, eager PyTorch training
the same selection (what ElasticTrainer does on the host) and every published device
learner then take SGD steps on one batch, timed alternately over ``--repeats`` rounds of
``--steps`` steps (so shared load hits all of them alike); medians are reported as
samples/s, as ratios over eager PyTorch training the same tensors at the same batch, and
for the selection as its speed-up over the same runtime training everything. BatchNorm is
frozen everywhere (as exported), so all variants compute the same step. Each variant's
peak memory during a step is the process's resident high-water mark above its level
before the step (Linux; blank elsewhere). ONNX Runtime sessions get as many intra-op
threads as torch (``--threads``).

The default models are the zoo CNNs at 32x32 (ResNet-18, MobileNetV2, MobileNetV3-small);
``--models`` picks others by a word of their name (``mlp``, ``cnn``, ``layernorm``, ``batchnorm``).
Run: ``taste-cl bench device`` (needs the ``[onnx]`` and ``[executorch]`` extras).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import statistics
import sys
import tempfile
import time
import warnings
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
TRANSFORMS = ["freeze_batchnorm", "disable_random_layers"]  # applied by the ExecuTorch export only
CLASSES = 10


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, CLASSES),
    )  # fmt: skip


def _ln_hardswish() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Hardswish(), nn.Linear(128, CLASSES))


def _batchnorm_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, CLASSES))


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=CLASSES)

    return build


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18 32x32": (_torchvision("resnet18"), (3, 32, 32)),
    "mobilenet_v2 32x32": (_torchvision("mobilenet_v2"), (3, 32, 32)),
    "mobilenet_v3_small 32x32": (_torchvision("mobilenet_v3_small"), (3, 32, 32)),
    "mlp 64-128-128-10": (_mlp, (64,)),
    "cnn stride-2 16x16": (_cnn, (3, 16, 16)),
    "mlp layernorm+hardswish": (_ln_hardswish, (64,)),
    "batchnorm+dropout mlp": (_batchnorm_mlp, (64,)),
}
DEFAULT_MODELS = ("resnet18 32x32", "mobilenet_v2 32x32", "mobilenet_v3_small 32x32")


# ------------------------------------------------------------------ memory
def _resident_kib() -> tuple[int, int] | None:
    """(current, peak) resident set size in KiB from /proc (Linux), or None."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def peak_step_mib(step: Callable[[], Any], calls: int = 2) -> float | None:
    """Peak resident memory (MiB) above the level before ``calls`` calls of ``step``; None where /proc cannot tell.

    The kernel's high-water mark is reset first (``/proc/self/clear_refs``), so the peak is this step's own,
    after the C heap's free memory is handed back (glibc's ``malloc_trim``), so a step reusing memory
    an earlier export freed still counts it.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        step()
        return None
    before = _resident_kib()
    for _ in range(calls):
        step()
    after = _resident_kib()
    if before is None or after is None:
        return None
    return max(0, after[1] - before[0]) / 1024


# ------------------------------------------------------------------ variants
def _eager_step(model: nn.Module, trained: Sequence[str], x: torch.Tensor, y: torch.Tensor, lr: float) -> Callable[[], None]:
    """PyTorch training ``trained`` on a copy of ``model`` (BatchNorm frozen and dropout off, as exported), with the learner's SGD."""
    work = copy.deepcopy(model).train()
    for module in work.modules():
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.Dropout)):
            module.eval()
    for name, parameter in work.named_parameters():
        parameter.requires_grad_(name in trained)
    optimizer = torch.optim.SGD([p for p in work.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(work(x), y).backward()
        optimizer.step()

    return step


def _session_options(threads: int) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return options


def _export(learner: OnlineLearner, backend: str, folder: Path, threads: int, trainable: Any) -> tuple[Any, dict[str, Any]]:
    """Export through ``backend`` and load the device learner; (None, {"refused": why}) when it is refused."""
    from taste_cl.adapters.executorch.learner import EtOnlineLearner
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    options: dict[str, Any] = {"transforms": TRANSFORMS} if backend == "executorch" else {}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExecuTorch's experimental-API and memory-planning warnings
            target = learner.export(folder, backend=backend, trainable=trainable, **options)
    except Exception as error:  # noqa: BLE001 - any failure to export is reported as that backend's refusal
        return None, {"refused": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    facts: dict[str, Any] = {"export_s": time.perf_counter() - start}
    facts["artifact_bytes"] = sum(path.stat().st_size for path in target.iterdir() if path.name != "replay.npz")
    if backend == "onnxruntime":
        return OrtOnlineLearner.from_artifacts(target, session_options=_session_options(threads)), facts
    return EtOnlineLearner.from_artifacts(target), facts


def _elastic_learner(build: Callable[[], nn.Module], shape: tuple[int, ...], args: Any) -> tuple[OnlineLearner, Any, torch.Tensor, torch.Tensor]:
    """A learner whose ElasticTrainer has selected at ``--rho``, and the batch every variant trains on."""
    from taste_cl.elastic import ElasticTrainer

    torch.manual_seed(args.seed)
    model = build()
    elastic = ElasticTrainer(rho=args.rho, reselect_every=3, cache_dir=None, warmup=1, repeats=3, max_rounds=6, check_steps=1, clock="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, replay=ReservoirReplay(64), plugins=[elastic])
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.rand((args.batch_size, *shape), generator=generator)
    y = torch.randint(0, CLASSES, (args.batch_size,), generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no selection fits rho" on tiny models: every unit trains, recorded below
        for _ in range(8):
            learner.observe((x, y))
            if elastic.selected:
                break
    return learner, elastic, x, y


def _median_rate(seconds: Sequence[float], batch: int) -> float:
    return statistics.median(batch / s for s in seconds)


def run_model(name: str, args: Any, scratch: Path) -> tuple[dict[str, Any], list[list[Any]]]:
    """Export, measure and time one model; its JSON record and table rows."""
    from taste_cl.adapters.device.trainable import selected_parameters

    build, shape = MODELS[name]
    learner, elastic, x, y = _elastic_learner(build, shape, args)
    every = selected_parameters(learner)
    chosen = selected_parameters(learner, elastic) if elastic.selected else every
    sets = {"all": (None, every), "selection": (elastic, chosen)}
    variants: dict[str, Callable[[], Any]] = {}
    facts: dict[str, dict[str, Any]] = {backend: {} for backend in args.backends}
    for key, (trainable, names) in sets.items():
        variants[f"torch {key}"] = _eager_step(learner.model, names, x, y, args.lr)
        for backend in args.backends:
            device, fact = _export(learner, backend, scratch / f"{backend}-{key}", args.threads, trainable)
            facts[backend][key] = fact
            if device is not None:
                variants[f"{backend} {key}"] = (lambda d: lambda: d.train_step(x.numpy(), y.numpy()))(device)
    memory = {variant: peak_step_mib(step) for variant, step in variants.items()}
    seconds = alternating_rounds(variants, steps=args.steps, repeats=args.repeats)
    rates = {variant: _median_rate(values, args.batch_size) for variant, values in seconds.items()}
    rows = []
    for backend in args.backends:
        for key in sets:
            fact, variant = facts[backend][key], f"{backend} {key}"
            trains = "all" if key == "all" else f"rho {args.rho}: {len(chosen)}/{len(every)}"
            if "refused" in fact:
                rows.append([name, backend, trains, rates[f"torch {key}"], "refused", "", "", "", "", "", fact["refused"][:70]])
                continue
            fact.update(samples_per_s=rates[variant], over_torch=rates[variant] / rates[f"torch {key}"], peak_step_mib=memory[variant])
            over_all: float | str = ""
            if key == "selection" and f"{backend} all" in rates:
                fact["over_all"] = over_all = rates[variant] / rates[f"{backend} all"]
            rows.append([name, backend, trains, rates[f"torch {key}"], rates[variant], fact["over_torch"], over_all,
                         memory[variant], fact["artifact_bytes"] / 1024, fact["export_s"], ""])  # fmt: skip
    record = {
        "model": name,
        "selection": {"rho": args.rho, "trainable": chosen, "tensors": len(chosen), "of": len(every)},
        "torch_samples_per_s": rates["torch all"],
        "torch_selection_samples_per_s": rates["torch selection"],
        "torch_peak_step_mib": {"all": memory["torch all"], "selection": memory["torch selection"]},
        # compatible with earlier results: the all-tensor facts per backend, the selection's beside them
        "backends": {backend: {**facts[backend]["all"], "selection": facts[backend]["selection"]} for backend in args.backends},
        "rounds_samples_per_s": {variant: [args.batch_size / s for s in values] for variant, values in seconds.items()},
    }
    return record, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("device", __doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per training step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per variant")
    parser.add_argument("--rho", type=float, default=0.5, help="the ElasticTrainer's time budget for the selection")
    parser.add_argument("--lr", type=float, default=0.001, help="SGD learning rate (momentum 0.9; a personalisation rate the export gates accept)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="device runtimes to export to")
    parser.add_argument(
        "--models", nargs="+", metavar="WORD", help=f"models whose name contains one of these words (default: {', '.join(DEFAULT_MODELS)})"
    )
    args = parse(parser, argv)
    names = list(DEFAULT_MODELS)
    if args.models:
        names = [name for name in MODELS if any(word in name for word in args.models)]
        if not names:
            parser.error(f"--models {args.models} matches none of {sorted(MODELS)}")
    rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr)
            record, model_rows = run_model(name, args, Path(scratch) / f"m{i}")
            runs.append(record)
            rows.extend(model_rows)
    headers = ["model", "backend", "trains", "torch samples/s", "device samples/s", "device/torch", "sel/all", "step peak MiB",
               "KiB", "export s", "refused"]  # fmt: skip
    print(format_table(headers, rows))
    print("indicative on a shared machine: ratios come from alternating rounds; the tuner columns await the device tuner")
    save_result(
        args.out,
        "device_runtimes",
        {"batch_size": args.batch_size, "steps": args.steps, "repeats": args.repeats, "rho": args.rho, "transforms": TRANSFORMS, "runs": runs},
        summary=", ".join(
            f"{run['model'].split()[0]} {backend} {facts['over_torch']:.2f}x eager"
            for run in runs
            for backend, facts in run["backends"].items()
            if "over_torch" in facts
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
