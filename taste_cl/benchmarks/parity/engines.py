"""One loop, several engines: the same stream, seeds and strategies on torch eager and on the standard-ONNX engine.

:class:`~taste_cl.engine.loop.EngineLearner` runs each variant (plain replay, ER-ACE, DER++,
LwF, and plain replay from a class-balanced buffer) on a class-incremental stream, once on
:class:`~taste_cl.engine.torch_engine.TorchEngine` and once on
:class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine` (extra ``[onnx]``) exported from the
same initial weights, for ``--seeds`` seeds; on the digits MLP also on the SDK's torch learner,
``OnlineLearner``, with the same strategy, buffer, seed and learning rate (its buffers take their
decisions from the same seeded stream, :mod:`taste_cl.replay.draws`, so it keeps and replays the
same rows; "same buffer as learner" checks its final buffer against the ONNX engine's).
Reported per variant, from the clean stream: the mean final accuracy on each side, their
differences, and the spread of torch's own accuracy across the seeds (what "within 1 point" is
measured against), and whether every step replayed the same rows on both engines. From a copy
of the stream whose observes ``--poison`` run at a learning rate 1e5 times too large: the
observes whose steps the update guard refused on each side, and whether each seed's refusals
are the same on every side. (Accuracy after a poisoned window is chaotic: one side's float
rounding can tip a borderline step, so it is not what the accuracy columns compare.)

Models: the digits MLP (split digits, 5 tasks of 2 classes) and, with ``--mobilenet``,
torchvision's MobileNetV3-small (random weights, BatchNorm frozen on both engines: the ONNX
engine's graphs are captured in eval mode) on generated 32x32 images in 5 tasks. At 32x32,
with its BatchNorm frozen, MobileNetV3-small learns nothing in the stream's 40 steps on either
engine (0.098, chance, on both; in plain torch too, from random or briefly pretrained weights),
so its rows show only that the two engines compute the same steps and refuse the same ones.
ExecuTorch has no engine on this interface yet. Run: ``taste-cl bench engines``.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.datasets import Task, make_pattern_images, split_digits
from taste_cl.engine.base import Engine
from taste_cl.engine.loop import EngineLearner
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.learner import OnlineLearner
from taste_cl.replay import ClassBalancedReplay, ReservoirReplay, SeededStrategy
from taste_cl.report import format_table
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy

VARIANTS: dict[str, dict[str, Any]] = {
    "replay": {"strategy": "er"},
    "er_ace": {"strategy": "er_ace"},
    "der++": {"strategy": "der++"},
    "lwf": {"strategy": "lwf", "lwf_every": 20},
    "class_balanced": {"strategy": "er", "replay": "class_balanced"},
}


def _mlp(seed: int, tasks: Sequence[Task]) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _mobilenet(seed: int, tasks: Sequence[Task]) -> nn.Module:
    """MobileNetV3-small, random weights, its BatchNorm statistics set from the stream's images
    (one pass in train mode without gradients) before they are frozen. It still does not learn
    here: see the module."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10)
    model.train()
    with torch.no_grad():
        for task in tasks:
            model(task.x_train)
    return model.eval()


def _image_tasks(seed: int, rows: int) -> list[Task]:
    x, y = make_pattern_images(rows * 2, size=32, seed=seed)
    tasks = []
    for t in range(5):
        classes = torch.tensor([2 * t, 2 * t + 1])
        picked = torch.isin(y, classes).nonzero().squeeze(1)
        half = len(picked) // 2
        tasks.append(Task(tuple(classes.tolist()), x[picked[:half]], y[picked[:half]], x[picked[half:]], y[picked[half:]]))
    return tasks


def _stream(tasks: Sequence[Task], batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (t.x_train[rows].numpy(), t.y_train[rows].numpy()) for t in tasks for rows in torch.arange(len(t.y_train)).split(batch) if len(rows) == batch
    ]


def _accuracy(learner: EngineLearner | OnlineLearner, tasks: Sequence[Task]) -> float:
    x = np.concatenate([t.x_test.numpy() for t in tasks])
    y = np.concatenate([t.y_test.numpy() for t in tasks])
    outputs = learner.predict(torch.from_numpy(x)).numpy() if isinstance(learner, OnlineLearner) else learner.predict(x)
    return float((outputs.argmax(1) == y).mean())


def run_variant(
    engine: Engine, variant: dict[str, Any], stream: list[tuple[np.ndarray, np.ndarray]], *, lr: float, seed: int, poison: set[int]
) -> tuple[EngineLearner, list[int]]:
    """The stream on ``engine``; the observes whose steps the guard refused."""
    learner = EngineLearner(engine, lr=lr, num_classes=10, capacity=200, replay_batch_size=10, seed=seed, **variant)
    refused = []
    for i, (x, y) in enumerate(stream):
        learner.lr = lr * 1e5 if i in poison else lr
        if learner.observe(x, y).refused:
            refused.append(i)
    return learner, refused


_LEARNER_STRATEGIES: dict[str, Callable[[dict[str, Any]], Strategy]] = {
    "er": lambda v: ExperienceReplay(),
    "er_ace": lambda v: ERACE(),
    "der++": lambda v: DERPlusPlus(alpha=v.get("alpha", 1.0), beta=v.get("beta", 1.0)),
    "lwf": lambda v: LwF(alpha=v.get("alpha", 1.0), temperature=v.get("temperature", 2.0), every=v.get("lwf_every", 50), on_drift=False),
}


def run_learner(
    model: nn.Module, variant: dict[str, Any], stream: list[tuple[np.ndarray, np.ndarray]], *, lr: float, seed: int, poison: set[int]
) -> tuple[OnlineLearner, list[int]]:
    """The stream on the SDK's torch learner (``OnlineLearner``) with the variant's strategy and buffer; the observes it skipped."""
    buffer = ClassBalancedReplay if variant.get("replay") == "class_balanced" else ReservoirReplay
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    learner = OnlineLearner(model, optimizer=optimizer, replay=buffer(200, seed=seed), replay_batch_size=10,
                            strategy=_LEARNER_STRATEGIES[variant["strategy"]](variant))  # fmt: skip
    refused = []
    for i, (x, y) in enumerate(stream):
        for group in optimizer.param_groups:
            group["lr"] = lr * 1e5 if i in poison else lr
        if learner.observe((torch.from_numpy(x), torch.from_numpy(y))).skipped:
            refused.append(i)
    return learner, refused


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("engines", __doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per variant (model weights, stream order and replay)")
    parser.add_argument("--mobilenet", action="store_true", help="also MobileNetV3-small on generated 32x32 images (minutes per seed)")
    parser.add_argument("--poison", type=int, nargs="*", default=[20, 21, 22], help="observes run at 1e5 x the learning rate")
    parser.add_argument("--quick", action="store_true", help="one seed, two variants, the MLP only")
    args = parse(parser, argv)
    from taste_cl.adapters.onnx_engine.engine import OnnxEngine
    from taste_cl.adapters.onnx_engine.export import export_engine

    variants = dict(list(VARIANTS.items())[:2]) if args.quick else VARIANTS
    seeds = range(1 if args.quick else args.seeds)
    models: list[tuple[str, Callable[[int, Sequence[Task]], nn.Module], Callable[[int], list[Task]], float, int]] = [
        ("digits MLP", _mlp, lambda s: split_digits(5, seed=s), 0.1, 10),
    ]
    if args.mobilenet and not args.quick:
        models.append(("MobileNetV3-small", _mobilenet, lambda s: _image_tasks(s, 400), 0.02, 10))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    jobs = [(m, s) for m in models for s in seeds]
    accuracy: dict[tuple[str, str, str], list[float]] = {}
    same_draws: dict[tuple[str, str], bool] = {}
    same_buffer: dict[tuple[str, str], bool] = {}
    refusals: dict[tuple[str, str], list[Any]] = {}
    poison = set(args.poison)
    with tempfile.TemporaryDirectory() as scratch:
        for (name, build, make_tasks, lr, batch), seed in progress_bar(jobs, enabled=not args.no_progress, desc="engines"):
            tasks = make_tasks(seed)
            stream = _stream(tasks, batch)
            folder = Path(scratch) / f"{name}-{seed}".replace(" ", "_")
            model = build(seed, tasks)
            export_engine(model, torch.as_tensor(stream[0][0][:batch]), folder, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
            for label, variant in variants.items():
                runs: dict[str, EngineLearner] = {}
                refused_by: dict[str, list[int]] = {}
                for engine_name in ("torch", "onnxruntime"):
                    for poisoned in (False, True):  # accuracy from the clean stream, the guard's refusals from a poisoned copy
                        if engine_name == "torch":
                            fresh = build(seed, tasks)
                            optimizer = torch.optim.SGD(fresh.parameters(), lr=lr, momentum=0.9)
                            engine: Engine = TorchEngine(fresh, optimizer, train_mode=name == "digits MLP")
                        else:
                            engine = OnnxEngine(folder)
                        learner, refused = run_variant(engine, variant, stream, lr=lr, seed=seed, poison=poison if poisoned else set())
                        if poisoned:
                            refused_by[engine_name] = refused
                        else:
                            runs[engine_name] = learner
                            accuracy.setdefault((name, label, engine_name), []).append(_accuracy(learner, tasks))
                draws = all(np.array_equal(a, b) for a, b in zip(runs["torch"].replay_draws, runs["onnxruntime"].replay_draws))
                same_draws[(name, label)] = same_draws.get((name, label), True) and draws
                if name == "digits MLP":  # the SDK's torch learner on the same stream (MobileNet's BatchNorm trains there)
                    sdk, _ = run_learner(build(seed, tasks), variant, stream, lr=lr, seed=seed, poison=set())
                    accuracy.setdefault((name, label, "learner"), []).append(_accuracy(sdk, tasks))
                    _, refused_by["learner"] = run_learner(build(seed, tasks), variant, stream, lr=lr, seed=seed, poison=poison)
                    stored = runs["onnxruntime"].replay
                    held = sdk.replay.labels.numpy() if isinstance(sdk.replay, SeededStrategy) else np.zeros(0, np.int64)
                    same_buffer[(name, label)] = (
                        same_buffer.get((name, label), True) and stored is not None and np.array_equal(stored.rows(np.arange(len(stored)))[1], held)
                    )
                refusals.setdefault((name, label), []).append(refused_by)
    for name, *_ in models:
        for label in variants:
            torch_acc, ort_acc = accuracy[(name, label, "torch")], accuracy[(name, label, "onnxruntime")]
            spread = statistics.stdev(torch_acc) if len(torch_acc) > 1 else 0.0
            gap = statistics.fmean(ort_acc) - statistics.fmean(torch_acc)
            per_run = refusals[(name, label)]
            torch_refused = sorted({i for r in per_run for i in r.get("torch", [])})
            ort_refused = sorted({i for r in per_run for i in r.get("onnxruntime", [])})
            same_refusals = all(len({tuple(v) for v in r.values()}) == 1 for r in per_run)  # every seed: one list for all sides
            sdk_acc = accuracy.get((name, label, "learner"))
            sdk_refused = sorted({i for r in per_run for i in r.get("learner", [])})
            sdk_gap = None if sdk_acc is None else 100 * (statistics.fmean(ort_acc) - statistics.fmean(sdk_acc))
            rows.append(
                [
                    name,
                    label,
                    None if sdk_acc is None else statistics.fmean(sdk_acc),
                    statistics.fmean(torch_acc),
                    statistics.fmean(ort_acc),
                    sdk_gap,
                    100 * gap,
                    100 * spread,
                    same_draws[(name, label)],
                    same_buffer.get((name, label)),
                    str(sdk_refused) if sdk_acc is not None else None,
                    str(torch_refused),
                    str(ort_refused),
                    same_refusals,
                ]
            )
            results[f"{name} / {label}"] = {
                "learner": sdk_acc, "torch": torch_acc, "onnxruntime": ort_acc, "gap_points": 100 * gap, "gap_to_learner_points": sdk_gap,
                "torch_spread_points": 100 * spread, "same_replay_draws": same_draws[(name, label)],
                "same_buffer_as_learner": same_buffer.get((name, label)), "refused_learner": sdk_refused if sdk_acc is not None else None,
                "refused_torch": torch_refused, "refused_onnxruntime": ort_refused, "same_refusals_every_seed": same_refusals,
                "refused_per_seed": per_run,
            }  # fmt: skip
    headers = [
        "model",
        "variant",
        "OnlineLearner acc",
        "torch engine acc",
        "ORT engine acc",
        "ORT - learner (points)",
        "ORT - torch engine (points)",
        "torch spread (points)",
        "same draws",
        "same buffer as learner",
        "skipped (learner)",
        "refused (torch engine)",
        "refused (ORT)",
        "same refusals, every seed",
    ]
    print(format_table(headers, rows))
    worst = max(abs(float(r[6])) for r in rows)
    save_result(
        args.out,
        "engines",
        {"seeds": len(seeds), "poison": args.poison, "results": results},
        summary=f"one loop on torch eager and the standard-ONNX engine, {len(seeds)} seed(s): largest accuracy gap {worst:.2f} points, "
        + ("the same replay draws in every run" if all(r[8] for r in rows) else "replay draws differ in some runs"),
    )
    return 0
