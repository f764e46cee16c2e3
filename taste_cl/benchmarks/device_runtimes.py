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

The tuner table: each backend's every-tensor folder is loaded twice as an app loads it,
``load_learner(folder)`` (the runtime's default threads) and ``load_learner(folder,
tuner=DeviceBatchTuner(tune_threads=True))``; both observe the same batches (stream plus
the same number of replayed rows, so the same work), timed alternately beside eager PyTorch
training that many rows, after the tuner's first observe has tuned (its probe seconds are
reported apart; retunes are off during the timing, so the plan alone is timed).
``--hog N`` starts N busy-loop processes before the tuning and kills them after the timing,
so the plan is found and timed under that load.

With ONNX Runtime among the backends, a third selection is timed the same way: the
ElasticTrainer's choice at ``--rho`` budgeted with ONNX Runtime's own step costs
(:func:`~taste_cl.adapters.onnxruntime.step_costs.measure_step_costs`, two profiled
exports; ``ElasticTrainer.selection_for``), with the share of the measured importance each
selection keeps.

``--cuts`` adds two fixed trainable sets per model, timed the same way: the first tensor
with the head (the backward runs the whole dX chain but computes few weight gradients)
and the later half of the tensors (half the chain, all of its weight gradients). Their
speed-ups over training everything show where a runtime's backward time goes; ElasticTrainer
selects with torch's cost profile, so a runtime whose split differs gains less from it.

The default models are the zoo CNNs at 32x32 (ResNet-18, MobileNetV2, MobileNetV3-small);
``--models`` picks others by a word of their name (``mlp``, ``cnn``, ``layernorm``, ``batchnorm``).
Run: ``taste-cl bench device`` (needs the ``[onnx-training]`` and ``[executorch]`` extras).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl.benchmarks._common import alternating_rounds, base_parser, parse, save_result
from taste_cl.learner import OnlineLearner
from taste_cl.replay import ReservoirReplay
from taste_cl.report import format_table

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
DEVICE_COSTS = "ort costs"
"""The variant whose selection ElasticTrainer budgeted with ONNX Runtime's measured step costs (:mod:`taste_cl.adapters.onnxruntime.step_costs`)."""
CUTS = ("first+head", "later half")
"""``--cuts``: fixed trainable sets that show whether a runtime's backward time is in the dX chain or in the weight gradients."""


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
        return None, {"refused": f"{type(error).__name__}: {error}"}  # whole: the advice ends the message; the table cuts it
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


@contextlib.contextmanager
def cpu_hog(processes: int) -> Iterator[None]:
    """``processes`` busy-loop Python subprocesses while the block runs, killed and reaped after it."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes))
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _at_threads(step: Callable[[], Any], threads: int | None) -> Callable[[], Any]:
    """``step`` with ExecuTorch's process-wide thread pool at ``threads`` (None: left as it is), so the
    untuned learner does not run at the count the tuner set for the other one."""
    if threads is None:
        return step
    from taste_cl.adapters.executorch.runtime import executorch_runtime

    pool = executorch_runtime()

    def pinned() -> Any:
        if pool._threadpool_get_thread_count() != threads:
            pool._unsafe_reset_threadpool(threads)
        return step()

    return pinned


def tuner_comparison(
    folder: Path, backend: str, model: nn.Module, trained: Sequence[str], x: torch.Tensor, y: torch.Tensor, args: Any
) -> dict[str, Any]:
    """The untuned device learner vs the :class:`DeviceBatchTuner`'s plan on the folder, over the same
    observes, beside eager PyTorch training as many rows; under ``--hog`` busy loops when asked."""
    from taste_cl.adapters.device import load_learner
    from taste_cl.adapters.device.tuning import DeviceBatchTuner

    batch = (x.numpy(), y.numpy())
    with cpu_hog(args.hog):
        untuned = load_learner(folder)
        default_threads = None
        if backend == "executorch":
            from taste_cl.adapters.executorch.runtime import executorch_runtime

            default_threads = int(executorch_runtime()._threadpool_get_thread_count())
        stats = untuned.observe(batch)
        rows = (stats.samples + stats.replay_samples) * untuned.train_iterations
        tuner = DeviceBatchTuner(tune_threads=True, n_calls=args.tuner_calls, min_probe_time=0.05, cache_dir=folder.parent / "tuner-cache")
        tuned = load_learner(folder, tuner=tuner)
        tuned.observe(batch)  # tunes
        tuner.min_retune_interval = 10**9  # the plan alone is timed (a retune's probes would land in a round)
        index = torch.arange(rows) % len(y)
        variants = {
            "torch": _eager_step(model, trained, x[index], y[index], args.lr),
            "untuned": _at_threads(lambda: untuned.observe(batch), default_threads),
            "tuned": _at_threads(lambda: tuned.observe(batch), tuner.threads_ if default_threads is not None else None),
        }
        memory = {name: peak_step_mib(step) for name, step in variants.items()}
        seconds = alternating_rounds(variants, steps=args.steps, repeats=args.repeats)
    rates = {name: _median_rate(values, rows) for name, values in seconds.items()}
    result = tuner.result_
    return {
        "hog_processes": args.hog,
        "rows_per_observe": rows,
        "torch_samples_per_s": rates["torch"],
        "untuned_samples_per_s": rates["untuned"],
        "tuned_samples_per_s": rates["tuned"],
        "tuned_over_untuned": rates["tuned"] / rates["untuned"],
        "untuned_over_torch": rates["untuned"] / rates["torch"],
        "tuned_over_torch": rates["tuned"] / rates["torch"],
        "micro_batch_size": tuner.micro_batch_size_,
        "threads": None if result is None else result.threads,
        "probe_seconds": tuner.probe_seconds_,
        "tunes": tuner.tunes_,
        "peak_observe_mib": {"untuned": memory["untuned"], "tuned": memory["tuned"]},
        "rounds_samples_per_s": {name: [rows / s for s in values] for name, values in seconds.items()},
    }


def _importance_share(elastic: Any, names: Sequence[str]) -> float | None:
    """The share of the ElasticTrainer's last measured importance that the units holding ``names`` carry."""
    if elastic.importance_ is None or not sum(elastic.importance_):
        return None
    return sum(elastic.importance_[i] for i in elastic.units_holding(names)) / sum(elastic.importance_)


def _device_costed_selection(learner: OnlineLearner, elastic: Any, x: torch.Tensor, y: torch.Tensor, args: Any, scratch: Path) -> dict[str, Any]:
    """The ElasticTrainer's selection at ``--rho`` budgeted with ONNX Runtime's own step costs; what it keeps and predicts."""
    from taste_cl.adapters.onnxruntime.step_costs import measure_step_costs

    start = time.perf_counter()
    try:
        costs = measure_step_costs(learner, elastic, (x, y), threads=args.threads, workdir=scratch / "ort-costs")
        names = elastic.selection_for(costs, rho=args.rho)
    except Exception as error:  # noqa: BLE001 - reported beside the other variants, as a refusal is
        return {"refused": f"{type(error).__name__}: {error}"}
    return {
        "trainable": names,
        "tensors": len(names),
        "importance_share": _importance_share(elastic, names),
        "predicted_speedup": costs.full_step_s / costs.step_s(elastic.units_holding(names)),
        "measure_s": time.perf_counter() - start,
        "ort_ms": {"forward": costs.forward_s * 1e3, "weight_grads": sum(costs.weight_grad_s) * 1e3, "input_grads": sum(costs.act_grad_s[1:]) * 1e3},
    }


def run_model(name: str, args: Any, scratch: Path) -> tuple[dict[str, Any], list[list[Any]], list[list[Any]]]:
    """Export, measure and time one model; its JSON record, its table rows and its tuner table rows."""
    from taste_cl.adapters.device.trainable import selected_parameters

    build, shape = MODELS[name]
    learner, elastic, x, y = _elastic_learner(build, shape, args)
    every = selected_parameters(learner)
    chosen = selected_parameters(learner, elastic) if elastic.selected else every
    sets: dict[str, tuple[Any, list[str]]] = {"all": (None, every), "selection": (elastic, chosen)}
    device_costed = _device_costed_selection(learner, elastic, x, y, args, scratch) if "onnxruntime" in args.backends and elastic.selected else None
    if device_costed is not None and "refused" not in device_costed:
        sets[DEVICE_COSTS] = (device_costed["trainable"], device_costed["trainable"])
    if args.cuts:  # where each runtime's backward time goes: the dX chain or the weight gradients
        first_and_head, later_half = [every[0], *every[-2:]], every[len(every) // 2 :]
        sets.update({CUTS[0]: (first_and_head, first_and_head), CUTS[1]: (later_half, later_half)})
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
            trains = {
                "all": "all",
                "selection": f"rho {args.rho}: {len(chosen)}/{len(every)}",
                DEVICE_COSTS: f"rho {args.rho}, ORT costs: {len(sets[key][1])}/{len(every)}",
            }.get(key, f"{key}: {len(sets[key][1])}/{len(every)}")
            if "refused" in fact:
                rows.append([name, backend, trains, rates[f"torch {key}"], "refused", "", "", "", "", "", fact["refused"].splitlines()[0][:70]])
                continue
            fact.update(samples_per_s=rates[variant], over_torch=rates[variant] / rates[f"torch {key}"], peak_step_mib=memory[variant])
            over_all: float | str = ""
            if key != "all" and f"{backend} all" in rates:
                fact["over_all"] = over_all = rates[variant] / rates[f"{backend} all"]
            rows.append([name, backend, trains, rates[f"torch {key}"], rates[variant], fact["over_torch"], over_all,
                         memory[variant], fact["artifact_bytes"] / 1024, fact["export_s"], ""])  # fmt: skip
    if device_costed is not None and "refused" in device_costed:
        rows.append([name, "onnxruntime", f"rho {args.rho}, ORT costs", "", "refused", "", "", "", "", "", device_costed["refused"][:90]])
    tuner_rows = []
    for backend in args.backends if args.tuner_calls else ():
        fact = facts[backend]["all"]
        if "refused" in fact:
            continue
        tuned = fact["tuner"] = tuner_comparison(scratch / f"{backend}-all", backend, learner.model, every, x, y, args)
        plan = f"micro {tuned['micro_batch_size'] or 'whole'}, {tuned['threads']} thr"
        tuner_rows.append([name, backend, args.hog, tuned["rows_per_observe"], tuned["torch_samples_per_s"], tuned["untuned_samples_per_s"],
                           tuned["tuned_samples_per_s"], tuned["tuned_over_untuned"], tuned["tuned_over_torch"], plan, tuned["probe_seconds"],
                           tuned["peak_observe_mib"]["untuned"], tuned["peak_observe_mib"]["tuned"]])  # fmt: skip
    record = {
        "model": name,
        "selection": {
            "rho": args.rho,
            "trainable": chosen,
            "tensors": len(chosen),
            "of": len(every),
            "importance_share": _importance_share(elastic, chosen),
        },
        "selection_ort_costs": device_costed,
        "torch_samples_per_s": rates["torch all"],
        "torch_selection_samples_per_s": rates["torch selection"],
        "torch_ort_costs_samples_per_s": rates.get(f"torch {DEVICE_COSTS}"),
        "torch_peak_step_mib": {"all": memory["torch all"], "selection": memory["torch selection"]},
        "torch_cuts_samples_per_s": {key: rates[f"torch {key}"] for key in CUTS if key in sets},
        # compatible with earlier results: the all-tensor facts per backend, the selection's beside them
        "backends": {
            backend: {**facts[backend]["all"], **{key: facts[backend][key] for key in ("selection", DEVICE_COSTS, *CUTS) if key in sets}}
            for backend in args.backends
        },
        "rounds_samples_per_s": {variant: [args.batch_size / s for s in values] for variant, values in seconds.items()},
    }
    return record, rows, tuner_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("device", __doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per training step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds per variant")
    parser.add_argument("--rho", type=float, default=0.5, help="the ElasticTrainer's time budget for the selection")
    parser.add_argument("--lr", type=float, default=0.001, help="SGD learning rate (momentum 0.9; a personalisation rate the export gates accept)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="device runtimes to export to")
    parser.add_argument("--tuner-calls", type=int, default=6, help="probes of the device tuner's search (0: no tuner table)")
    parser.add_argument(
        "--hog", type=int, nargs="?", const=1, default=0, metavar="N", help="busy-loop processes to run during the tuner table (--hog alone: 1)"
    )
    parser.add_argument(
        "--cuts",
        action="store_true",
        help="also time two fixed trainable sets: the first tensor with the head (the whole dX chain, few weight gradients) and "
        "the later half of the tensors (half the chain)",
    )
    parser.add_argument(
        "--models", nargs="+", metavar="WORD", help=f"models whose name contains one of these words (default: {', '.join(DEFAULT_MODELS)})"
    )
    args = parse(parser, argv)
    if args.tuner_calls < 0 or args.hog < 0:
        parser.error(f"--tuner-calls {args.tuner_calls} and --hog {args.hog} must be >= 0")
    names = list(DEFAULT_MODELS)
    if args.models:
        names = [name for name in MODELS if any(word in name for word in args.models)]
        if not names:
            parser.error(f"--models {args.models} matches none of {sorted(MODELS)}")
    rows: list[list[Any]] = []
    tuner_rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr)
            record, model_rows, model_tuner_rows = run_model(name, args, Path(scratch) / f"m{i}")
            runs.append(record)
            rows.extend(model_rows)
            tuner_rows.extend(model_tuner_rows)
    headers = ["model", "backend", "trains", "torch samples/s", "device samples/s", "device/torch", "sel/all", "step peak MiB",
               "KiB", "export s", "refused"]  # fmt: skip
    print(format_table(headers, rows))
    if tuner_rows:
        print("\ndevice tuner: the untuned device learner vs the DeviceBatchTuner's plan, same observes (every tensor)")
        print(format_table(["model", "backend", "hog", "rows/step", "torch samples/s", "untuned samples/s", "tuned samples/s", "tuned/untuned",
                            "tuned/torch", "plan", "probe s", "untuned MiB", "tuned MiB"], tuner_rows))  # fmt: skip
    print("indicative on a shared machine: ratios come from alternating rounds")
    settings = {key: getattr(args, key) for key in ("batch_size", "steps", "repeats", "rho", "tuner_calls", "hog")}
    save_result(
        args.out,
        "device_runtimes",
        {**settings, "transforms": TRANSFORMS, "runs": runs},
        summary=", ".join(
            f"{run['model'].split()[0]} {backend} {facts['over_torch']:.2f}x eager"
            + (f" (tuned {facts['tuner']['tuned_over_untuned']:.2f}x untuned)" if "tuner" in facts else "")
            for run in runs
            for backend, facts in run["backends"].items()
            if "over_torch" in facts
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
