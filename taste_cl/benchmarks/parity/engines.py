"""One loop, several engines: the same stream, seeds and strategies on torch eager, the standard-ONNX engine and ExecuTorch.

:class:`~taste_cl.engine.loop.EngineLearner` runs each variant (plain replay, ER-ACE, DER++,
LwF, and plain replay from a class-balanced buffer) on a class-incremental stream, once on
:class:`~taste_cl.engine.torch_engine.TorchEngine`, once on
:class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine` (extra ``[onnx]``) and, when the
``[executorch]`` extra is installed, once on
:class:`~taste_cl.adapters.executorch.engine.ExecuTorchEngine`, each exported from the
same initial weights, for ``--seeds`` seeds; on the digits MLP also on the SDK's torch learner,
``OnlineLearner``, with the same strategy, buffer, seed and learning rate (its buffers take their
decisions from the same seeded stream, :mod:`taste_cl.replay.draws`, so it keeps and replays the
same rows; "same buffer as learner" checks its final buffer against the ONNX engine's).
Reported per variant, from the clean stream: the mean final accuracy on each side, their
differences, and the spread of torch's own accuracy across the seeds (what "within 1 point" is
measured against), and whether every step replayed the same rows on every engine. From a copy
of the stream whose observes ``--poison`` run at a learning rate 1e5 times too large: the
observes whose steps the update guard refused on each side, and whether each seed's refusals
are the same on every side. (Accuracy after a poisoned window is chaotic: one side's float
rounding can tip a borderline step, so it is not what the accuracy columns compare.)

Models: the digits MLP (split digits, 5 tasks of 2 classes) and, with ``--mobilenet``,
torchvision's MobileNetV3-small on generated 32x32 images in 5 tasks. It is pretrained here, as
personalization starts from a pretrained model: one epoch on 3,000 images of 20 other generated
patterns, its BatchNorm statistics recomputed over them (torchvision builds MobileNetV3 with a
BatchNorm momentum of 0.01, so a pass or an epoch leaves the running statistics near their
initial values, and in eval mode such a model predicts one class: that is why the random-weight
setup learned nothing), then a new 10-class head; BatchNorm is frozen on every engine (the ONNX
engine's graphs are captured in eval mode), and the stream trains at lr 0.002 with momentum 0.9.
A model
ExecuTorch cannot train as an engine (its export refuses it) has no ExecuTorch numbers, and the
table says why. Run: ``taste-cl bench engines``.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
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
from taste_cl.exceptions import UnsupportedModelError
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


@functools.cache
def _pretrained_mobilenet(seed: int) -> nn.Module:
    """MobileNetV3-small pretrained on 20 generated patterns unlike the stream's (one epoch), its
    BatchNorm statistics recomputed over them, with a new 10-class head; built once per seed."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=20)
    x, y = make_pattern_images(3000, n_classes=20, size=32, seed=1000 + seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for rows in torch.randperm(len(y)).split(64):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for norm in norms:  # a cumulative average over the pretraining images, not momentum 0.01's trickle
        norm.reset_running_stats()
        norm.momentum = None
    with torch.no_grad():
        for rows in torch.arange(1000).split(100):
            model(x[rows])
    for norm in norms:
        norm.momentum = 0.01
    head = model.classifier[-1]
    assert isinstance(head, nn.Linear)
    model.classifier[-1] = nn.Linear(head.in_features, 10)
    return model.eval()


def _mobilenet(seed: int, tasks: Sequence[Task]) -> nn.Module:
    """A copy of the pretrained MobileNetV3-small for ``seed`` (see :func:`_pretrained_mobilenet`)."""
    return copy.deepcopy(_pretrained_mobilenet(seed))


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

    executorch = importlib.util.find_spec("executorch") is not None

    variants = dict(list(VARIANTS.items())[:2]) if args.quick else VARIANTS
    seeds = range(1 if args.quick else args.seeds)
    models: list[tuple[str, Callable[[int, Sequence[Task]], nn.Module], Callable[[int], list[Task]], float, int]] = [
        ("digits MLP", _mlp, lambda s: split_digits(5, seed=s), 0.1, 10),
    ]
    if args.mobilenet and not args.quick:
        models.append(("MobileNetV3-small", _mobilenet, lambda s: _image_tasks(s, 400), 0.002, 10))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    jobs = [(m, s) for m in models for s in seeds]
    accuracy: dict[tuple[str, str, str], list[float]] = {}
    same_draws: dict[tuple[str, str], bool] = {}
    same_buffer: dict[tuple[str, str], bool] = {}
    refusals: dict[tuple[str, str], list[Any]] = {}
    et_refused: dict[str, str] = {}  # model -> why ExecuTorch's export refused it
    poison = set(args.poison)
    with tempfile.TemporaryDirectory() as scratch:
        for (name, build, make_tasks, lr, batch), seed in progress_bar(jobs, enabled=not args.no_progress, desc="engines"):
            tasks = make_tasks(seed)
            stream = _stream(tasks, batch)
            folder = Path(scratch) / f"{name}-{seed}".replace(" ", "_")
            model = build(seed, tasks)
            export_engine(model, torch.as_tensor(stream[0][0][:batch]), folder, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
            sides = ["torch", "onnxruntime"]
            if executorch and name not in et_refused:
                from taste_cl.adapters.executorch.engine import ExecuTorchEngine
                from taste_cl.adapters.executorch.engine_export import export_engine as export_et

                et_folder = folder.with_name(folder.name + "-executorch")
                try:
                    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
                    export_et(model, torch.as_tensor(stream[0][0][:batch]), et_folder, optimizer=sgd)
                    sides.append("executorch")
                except UnsupportedModelError as error:
                    et_refused[name] = str(error)
            for label, variant in variants.items():
                runs: dict[str, EngineLearner] = {}
                refused_by: dict[str, list[int]] = {}
                for engine_name in sides:
                    for poisoned in (False, True):  # accuracy from the clean stream, the guard's refusals from a poisoned copy
                        if engine_name == "torch":
                            fresh = build(seed, tasks)
                            optimizer = torch.optim.SGD(fresh.parameters(), lr=lr, momentum=0.9)
                            engine: Engine = TorchEngine(fresh, optimizer, train_mode=name == "digits MLP")
                        elif engine_name == "onnxruntime":
                            engine = OnnxEngine(folder)
                        else:
                            engine = ExecuTorchEngine(et_folder)
                        learner, refused = run_variant(engine, variant, stream, lr=lr, seed=seed, poison=poison if poisoned else set())
                        if poisoned:
                            refused_by[engine_name] = refused
                        else:
                            runs[engine_name] = learner
                            accuracy.setdefault((name, label, engine_name), []).append(_accuracy(learner, tasks))
                reference = runs["torch"].replay_draws
                draws = all(
                    len(runs[side].replay_draws) == len(reference) and all(map(np.array_equal, reference, runs[side].replay_draws))
                    for side in sides[1:]
                )
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
            et_acc = accuracy.get((name, label, "executorch"))
            et_gap = None if et_acc is None else 100 * (statistics.fmean(et_acc) - statistics.fmean(torch_acc))
            et_refused_steps = sorted({i for r in per_run for i in r.get("executorch", [])})
            rows.append(
                [
                    name,
                    label,
                    None if sdk_acc is None else statistics.fmean(sdk_acc),
                    statistics.fmean(torch_acc),
                    statistics.fmean(ort_acc),
                    None if et_acc is None else statistics.fmean(et_acc),
                    sdk_gap,
                    100 * gap,
                    et_gap,
                    100 * spread,
                    same_draws[(name, label)],
                    same_buffer.get((name, label)),
                    str(sdk_refused) if sdk_acc is not None else None,
                    str(torch_refused),
                    str(ort_refused),
                    None if et_acc is None else str(et_refused_steps),
                    same_refusals,
                ]
            )
            results[f"{name} / {label}"] = {
                "learner": sdk_acc, "torch": torch_acc, "onnxruntime": ort_acc, "gap_points": 100 * gap, "gap_to_learner_points": sdk_gap,
                "executorch": et_acc, "executorch_gap_points": et_gap, "refused_executorch": None if et_acc is None else et_refused_steps,
                "executorch_refused_export": et_refused.get(name),
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
        "ET engine acc",
        "ORT - learner (points)",
        "ORT - torch engine (points)",
        "ET - torch engine (points)",
        "torch spread (points)",
        "same draws",
        "same buffer as learner",
        "skipped (learner)",
        "refused (torch engine)",
        "refused (ORT)",
        "refused (ET)",
        "same refusals, every seed",
    ]
    print(format_table(headers, rows))
    for name, why in et_refused.items():
        print(f"ExecuTorch, {name}: {why}")
    if not executorch:
        print("ExecuTorch: not installed (pip install 'taste-cl[executorch]'); its columns are empty")
    worst = max(abs(float(gap)) for r in rows for gap in (r[7], r[8]) if gap is not None)
    save_result(
        args.out,
        "engines",
        {"seeds": len(seeds), "poison": args.poison, "results": results, "executorch_refused_export": et_refused},
        summary=f"one loop on torch eager, the standard-ONNX engine{' and ExecuTorch' if executorch else ''}, {len(seeds)} seed(s): "
        f"largest accuracy gap to the torch engine {worst:.2f} points, "
        + ("the same replay draws in every run" if all(r[10] for r in rows) else "replay draws differ in some runs"),
    )
    return 0
