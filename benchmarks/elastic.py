"""Elastic training: fine-tune a pretrained CNN with full, last-layer-only and ElasticTrainer updates.

A small CNN (four 3x3 convs, the first two at 32x32, then global pooling and a linear head)
is pretrained inside the benchmark on generated 3x32x32 images whose class is an
arrangement of two stroke patterns on a 3x3 grid (random colour and jitter, so shape and
position matter). It is then fine-tuned with a fresh head on new arrangements of the same
strokes, once per variant, all variants taking the same stream batches in turn (order
rotated every step) so shared CPU load hits them alike. Reports the median wall-clock per
training step and speedup over full training, the training time until test accuracy first
reaches ``--target`` x full training's final accuracy, and final test accuracy. Writes
JSON and a PNG of test accuracy against training time.
Run: ``taste-cl bench elastic``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taste_cl import ElasticTrainer, OnlineLearner
from taste_cl._report import format_table
from taste_cl.benchmarks._common import base_parser, parse, save_result

_SIZE, _CELL = 32, 10
_STROKES = 6  # horizontal, vertical, diagonal, anti-diagonal, ring, cross


def _stroke(kind: int) -> torch.Tensor:
    patch = torch.zeros(_CELL, _CELL)
    idx = torch.arange(_CELL)
    if kind in (0, 5):
        patch[_CELL // 2 - 1 : _CELL // 2 + 1, :] = 1
    if kind in (1, 5):
        patch[:, _CELL // 2 - 1 : _CELL // 2 + 1] = 1
    if kind == 2:
        patch[idx, idx] = 1
    if kind == 3:
        patch[idx, _CELL - 1 - idx] = 1
    if kind == 4:
        patch[[0, -1], :] = 1
        patch[:, [0, -1]] = 1
    return patch


def arrangements(n_classes: int, *, generator: torch.Generator) -> list[tuple[tuple[int, int], ...]]:
    """``n_classes`` distinct classes, each two (stroke, cell) pairs in different cells of a 3x3 grid."""
    classes: list[tuple[tuple[int, int], ...]] = []
    while len(classes) < n_classes:
        strokes = torch.randint(0, _STROKES, (2,), generator=generator).tolist()
        cells = torch.randperm(9, generator=generator)[:2].tolist()
        candidate = tuple(sorted(zip(strokes, cells)))
        if candidate not in classes:
            classes.append(candidate)
    return classes


def render(classes: Sequence[tuple[tuple[int, int], ...]], n: int, *, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images of the given classes (random colour per sample, +-1 px jitter)."""
    strokes = [_stroke(kind) for kind in range(_STROKES)]
    y = torch.randint(0, len(classes), (n,), generator=generator)
    x = torch.zeros(n, 3, _SIZE, _SIZE)
    colours = torch.rand(n, 3, 1, 1, generator=generator) * 0.7 + 0.3
    jitter = torch.randint(0, 3, (n, 2, 2), generator=generator)
    for i, label in enumerate(y.tolist()):
        for part, (kind, cell) in enumerate(classes[label]):
            top = 1 + (cell // 3) * _CELL + int(jitter[i, part, 0])
            left = 1 + (cell % 3) * _CELL + int(jitter[i, part, 1])
            top, left = min(top, _SIZE - _CELL), min(left, _SIZE - _CELL)
            x[i, :, top : top + _CELL, left : left + _CELL] += strokes[kind]
    x = x * colours + 0.3 * torch.randn(x.shape, generator=generator)
    return x, y


def build_cnn(n_classes: int, width: int = 16) -> nn.Sequential:
    """Early convs at full resolution dominate the backward time, as in most vision backbones."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, n_classes),
    )  # fmt: skip


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        hits = torch.cat([model(chunk).argmax(1) for chunk in x.split(500)]) == y
    model.train()
    return float(hits.float().mean())


def pretrain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_size: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        index = torch.randint(0, x.shape[0], (batch_size,), generator=generator)
        loss = nn.functional.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _variants(pretrained: nn.Module, n_classes: int, lr: float, reselect_every: int) -> dict[str, tuple[OnlineLearner, ElasticTrainer | None]]:
    variants: dict[str, tuple[OnlineLearner, ElasticTrainer | None]] = {}
    for name in ("full", "last_layer", "elastic_0.5", "elastic_0.3"):
        model = copy.deepcopy(pretrained)
        torch.manual_seed(0)
        model[-1] = nn.Linear(model[-1].in_features, n_classes)
        if name == "last_layer":
            for p in model[:-1].parameters():
                p.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        plugin = None
        if name.startswith("elastic"):
            plugin = ElasticTrainer(rho=float(name.split("_")[1]), reselect_every=reselect_every, cache_dir=None)
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        learner = OnlineLearner(model, optimizer=optimizer, plugins=[plugin] if plugin else [])
        variants[name] = (learner, plugin)
    return variants


def _plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([t for t, _ in points], [a for _, a in points], label=name, marker=".")
    ax.set_xlabel("cumulative training time (s)")
    ax.set_ylabel("test accuracy (new classes)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("elastic", __doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=10, help="classes in pretraining and in fine-tuning")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="pretraining steps on the old classes")
    parser.add_argument("--steps", type=int, default=400, help="fine-tuning steps per variant")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size of pretraining and fine-tuning")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate of fine-tuning")
    parser.add_argument("--reselect-every", type=int, default=50, help="steps between elastic reselections")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between test-accuracy points")
    parser.add_argument("--target", type=float, default=0.95, help="fraction of full training's final accuracy")
    parser.add_argument("--width", type=int, default=16, help="channels of the first convs")
    args = parse(parser, argv)
    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    all_classes = arrangements(2 * args.classes, generator=generator)
    old, new = all_classes[: args.classes], all_classes[args.classes :]

    start = time.perf_counter()
    pretrained = build_cnn(args.classes, args.width)
    old_x, old_y = render(old, 4000, generator=generator)
    pretrain(pretrained, old_x, old_y, steps=args.pretrain_steps, batch_size=args.batch_size)
    old_test = render(old, 1000, generator=generator)
    pretrain_acc = _accuracy(pretrained, *old_test)
    print(f"pretrained on {args.classes} classes: test accuracy {pretrain_acc:.3f} ({time.perf_counter() - start:.1f} s)")

    train_x, train_y = render(new, args.steps * args.batch_size, generator=generator)
    test_x, test_y = render(new, 2000, generator=generator)
    variants = _variants(pretrained, args.classes, args.lr, args.reselect_every)
    names = list(variants)
    step_times: dict[str, list[float]] = {name: [] for name in names}
    first_call: dict[str, float] = {}
    curves: dict[str, list[tuple[float, float]]] = {name: [(0.0, _accuracy(variants[name][0].model, test_x, test_y))] for name in names}
    for step in range(args.steps):
        batch = (train_x[step * args.batch_size : (step + 1) * args.batch_size], train_y[step * args.batch_size : (step + 1) * args.batch_size])
        for name in names[step % len(names) :] + names[: step % len(names)]:
            call = time.perf_counter()
            stats = variants[name][0].observe(batch)
            if step == 0:
                first_call[name] = time.perf_counter() - call - stats.step_time_s  # profiling, not training
            step_times[name].append(stats.step_time_s)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            for name in names:
                curves[name].append((sum(step_times[name]), _accuracy(variants[name][0].model, test_x, test_y)))

    full_median = statistics.median(step_times["full"])
    full_final = curves["full"][-1][1]
    target = args.target * full_final
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        learner, plugin = variants[name]
        median = statistics.median(step_times[name])
        reach = next((t for t, acc in curves[name] if acc >= target), None)
        runs[name] = {
            "median_step_s": median,
            "speedup_vs_full": full_median / median,
            "total_train_s": sum(step_times[name]),
            "time_to_target_s": reach,
            "final_accuracy": curves[name][-1][1],
            "accuracy_vs_full_points": 100 * (curves[name][-1][1] - full_final),
            "setup_s": first_call[name],
            "curve": curves[name],
            "drift_events": learner.monitor.report()["events"].get("drift_detected", 0),
        }
        if plugin is not None:
            runs[name].update(
                selected=plugin.selected,
                probes=plugin.probes_,
                predicted_speedup=plugin.predicted_speedup(),
                profile=plugin.profile_.to_dict() if plugin.profile_ else None,
            )
    rows = [
        [name, 1000 * r["median_step_s"], r["speedup_vs_full"], r["time_to_target_s"] if r["time_to_target_s"] is not None else "never",
         r["final_accuracy"], r["accuracy_vs_full_points"]]
        for name, r in runs.items()
    ]  # fmt: skip
    print(f"fine-tuning on {args.classes} new classes, {args.steps} steps of batch {args.batch_size}; target accuracy {target:.3f}")
    print(format_table(["variant", "ms/step", "speedup", "s to target", "final acc", "vs full (pts)"], rows))
    for name, r in runs.items():
        if "selected" in r:
            print(f"{name}: trains units {r['selected']} (predicted speedup {r['predicted_speedup']:.2f}x, {r['probes']} probes, profiling {r['setup_s']:.2f} s)")
    config = {key: value for key, value in vars(args).items() if key != "out"}
    save_result(args.out, "elastic", {"config": config, "pretrain_accuracy": pretrain_acc, "target_accuracy": target, "runs": runs})
    print(f"plot written to {_plot(curves, Path(args.out) / 'elastic.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
