"""Elastic training: fine-tune pretrained models with full, last-layer-only and ElasticTrainer updates.

A model is pretrained inside the benchmark on generated 3x32x32 images whose class is an
arrangement of two stroke patterns on a 3x3 grid (random colour and jitter, so shape and
position matter; nothing is downloaded). It is then fine-tuned with a fresh head on new
arrangements of the same strokes, once per variant, all variants taking the same stream
batches in turn (order rotated every step) so shared CPU load hits them alike. Variants:
full training, the head only, ElasticTrainer at rho 0.5 (tensor units), and with
``--variants`` also module units and a memory budget of half of full training's measured
training memory. Reports median ms per step and speedup over full training, training time
until test accuracy first reaches ``--target`` x full's final accuracy, final accuracy,
selected units, predicted vs measured step time, and estimated vs measured training
memory; several seeds give the spread. Step times are read from ``--clock``: ``cpu``
(default) is this process's CPU time per step, which equals the wall time of a one-thread
step on an idle device but, unlike the wall clock, does not count the time a shared
machine's other processes hold the cores (the elastic trainers profile and check on the
same clock); the other clock's median speedup is reported alongside. ``--zoo`` runs the
small CNN, torchvision ResNet-18 and MobileNetV2 (32x32, ``weights=None``). Writes JSON (and, with ``--plot``, a PNG).
Run: ``taste-cl bench elastic [--zoo]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from taste_cl import ElasticTrainer, OnlineLearner
from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.elastic import measure_training_memory
from taste_cl.plotting import PLOT_HINT, plotting_available, pyplot, save_figure
from taste_cl.plugins import LearnerPlugin
from taste_cl.report import format_number, format_table

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats

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


def _zoo_model(name: str, n_classes: int, width: int) -> nn.Module:
    if name == "cnn":
        return build_cnn(n_classes, width)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=n_classes)


def _head(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the final linear layer and its attribute name."""
    if isinstance(model, nn.Sequential):
        return model, str(len(model) - 1)
    if hasattr(model, "fc"):
        return model, "fc"
    classifier = model.classifier
    if not isinstance(classifier, nn.Sequential):
        raise TypeError(f"{type(model).__name__} has no fc and its classifier is not an nn.Sequential: no final linear layer found")
    return classifier, str(len(classifier) - 1)


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


def _fresh(pretrained: nn.Module, n_classes: int, seed: int) -> nn.Module:
    model = copy.deepcopy(pretrained)
    torch.manual_seed(seed)
    owner, attr = _head(model)
    setattr(owner, attr, nn.Linear(getattr(owner, attr).in_features, n_classes))
    return model


class _StepClock(LearnerPlugin):
    """CPU time of each observe's training: from its first step's start (before any other
    plugin's ``before_step``) to the end of training, the window ``ObserveStats.step_time_s``
    times on the wall clock. Listed first, so it times the elastic trainer's probes too."""

    name = "step_clock"

    def __init__(self) -> None:
        self.last_s = 0.0
        self._start: float | None = None

    def before_step(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if self._start is None:
            self._start = time.process_time()

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        self.last_s = 0.0 if self._start is None else time.process_time() - self._start
        self._start = None


def _variants(
    pretrained: nn.Module, names: Sequence[str], n_classes: int, lr: float, seed: int, args: argparse.Namespace, memory_budget: int
) -> dict[str, tuple[OnlineLearner, ElasticTrainer | None, _StepClock]]:
    variants: dict[str, tuple[OnlineLearner, ElasticTrainer | None, _StepClock]] = {}
    for name in names:
        model = _fresh(pretrained, n_classes, seed)
        if name == "last_layer":
            owner, attr = _head(model)
            head = getattr(owner, attr)
            for p in model.parameters():
                p.requires_grad_(False)
            for p in head.parameters():
                p.requires_grad_(True)
        plugin = None
        if name.startswith("elastic"):
            plugin = ElasticTrainer(
                rho=args.rho, reselect_every=args.reselect_every, cache_dir=None,
                granularity="module" if name == "elastic_module" else "tensor",
                memory_budget_bytes=memory_budget if name == "elastic_memory" else None, clock=args.clock,
            )  # fmt: skip
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
        clock = _StepClock()
        variants[name] = (OnlineLearner(model, optimizer=optimizer, plugins=[clock, plugin] if plugin else [clock]), plugin, clock)
    return variants


def _memory(learner: OnlineLearner, x: torch.Tensor, y: torch.Tensor) -> int:
    return measure_training_memory(learner.model, x, y, nn.functional.cross_entropy, learner.optimizer)["total"]


def finetune(
    pretrained: nn.Module, data: dict[str, torch.Tensor], names: Sequence[str], seed: int, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Fine-tune every variant on the same stream, interleaved; return per-variant results."""
    b = args.batch_size
    probe_x, probe_y = data["train_x"][:b], data["train_y"][:b]
    full_model = _fresh(pretrained, args.classes, seed)
    full_memory = measure_training_memory(
        full_model, probe_x, probe_y, nn.functional.cross_entropy, torch.optim.SGD(full_model.parameters(), lr=0.1, momentum=0.9)
    )["total"]
    memory_budget = int(args.memory_fraction * full_memory)
    variants = _variants(pretrained, names, args.classes, args.lr, seed, args, memory_budget)
    step_times: dict[str, list[float]] = {name: [] for name in names}  # on --clock
    other_times: dict[str, list[float]] = {name: [] for name in names}  # on the other clock
    first_call: dict[str, float] = {}
    test_x, test_y = data["test_x"], data["test_y"]
    curves = {name: [(0.0, _accuracy(variants[name][0].model, test_x, test_y))] for name in names}
    offset = seed * args.steps * b % max(1, data["train_x"].shape[0] - args.steps * b + 1)
    for step in range(args.steps):
        rows = slice(offset + step * b, offset + (step + 1) * b)
        batch = (data["train_x"][rows], data["train_y"][rows])
        for name in [*names[step % len(names) :], *names[: step % len(names)]]:
            call = time.perf_counter()
            stats = variants[name][0].observe(batch)
            if step == 0:
                first_call[name] = time.perf_counter() - call - stats.step_time_s  # profiling, not training
            wall, cpu = stats.step_time_s, variants[name][2].last_s
            step_times[name].append(cpu if args.clock == "cpu" else wall)
            other_times[name].append(wall if args.clock == "cpu" else cpu)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            for name in names:
                curves[name].append((sum(step_times[name]), _accuracy(variants[name][0].model, test_x, test_y)))
    full_median = statistics.median(step_times["full"])
    full_final = curves["full"][-1][1]
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        learner, plugin, _ = variants[name]
        median = statistics.median(step_times[name])
        runs[name] = {
            "median_step_s": median,
            "speedup_vs_full": full_median / median,
            "other_clock_median_step_s": statistics.median(other_times[name]),
            "other_clock_speedup_vs_full": statistics.median(other_times["full"]) / statistics.median(other_times[name]),
            "time_to_target_s": next((t for t, acc in curves[name] if acc >= args.target * full_final), None),
            "final_accuracy": curves[name][-1][1],
            "accuracy_vs_full_points": 100 * (curves[name][-1][1] - full_final),
            "setup_s": first_call[name],
            "curve": curves[name],
            "memory_bytes": _memory(learner, probe_x, probe_y),
            "full_memory_bytes": full_memory,
        }
        if plugin is not None:
            assert plugin.timing_ is not None and plugin.profile_ is not None
            index = [plugin.profile_.units.index(u) for u in plugin.selected]
            runs[name].update(
                selected=plugin.selected,
                units=len(plugin.profile_.units),
                probes=plugin.probes_,
                predicted_step_s=plugin.timing_.predict(index),
                raw_predicted_step_s=plugin.timing_.raw_prediction(index),
                prediction_errors=plugin.prediction_errors(),
                memory_estimate_bytes=plugin.memory_estimate(),
                memory_budget_bytes=plugin.memory_budget_bytes,
                profile_rounds=plugin.profile_.rounds,
                profile_noise=plugin.profile_.relative_noise(),
                profile_noisy=plugin.profile_.noisy,
            )
    return runs


def _data(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], list[Any], list[Any]]:
    generator = torch.Generator().manual_seed(args.seed)
    all_classes = arrangements(2 * args.classes, generator=generator)
    old, new = all_classes[: args.classes], all_classes[args.classes :]
    old_x, old_y = render(old, 4000, generator=generator)
    old_test = render(old, 1000, generator=generator)
    train_x, train_y = render(new, args.steps * args.batch_size * max(1, args.seeds), generator=generator)
    test_x, test_y = render(new, 2000, generator=generator)
    data = {"old_x": old_x, "old_y": old_y, "old_test_x": old_test[0], "old_test_y": old_test[1],
            "train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}  # fmt: skip
    return data, old, new


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def _print_model(model_name: str, seeds: dict[int, dict[str, dict[str, Any]]], clock: str) -> None:
    names = list(next(iter(seeds.values())))
    rows = []
    for name in names:
        runs = [seeds[s][name] for s in seeds]
        reach = [r["time_to_target_s"] for r in runs]
        reached = [t for t in reach if t is not None]
        rows.append([
            name,
            _spread([1000 * r["median_step_s"] for r in runs]),
            _spread([r["speedup_vs_full"] for r in runs]),
            _spread([r["other_clock_speedup_vs_full"] for r in runs]),
            f"{len(reached)}/{len(reach)}" + (f" {statistics.median(reached):.1f}s" if reached else ""),
            _spread([r["final_accuracy"] for r in runs]),
            _spread([r["accuracy_vs_full_points"] for r in runs]),
            _spread([r["memory_bytes"] / r["full_memory_bytes"] for r in runs]),
        ])  # fmt: skip
    print(f"\n== {model_name}: median [min, max] over seeds {list(seeds)}; ms/step and speedup on the {clock} clock")
    other = "wall" if clock == "cpu" else "cpu"
    headers = ["variant", "ms/step", "speedup", f"{other} speedup", "reached target", "final acc", "vs full (pts)", "memory / full"]
    print(format_table(headers, rows))
    for name in names:
        for seed, run in seeds.items():
            if "selected" in run[name]:
                errors = run[name]["prediction_errors"]
                raw, corrected = errors["raw"], errors["corrected_after_first"] or errors["corrected"]
                budget = run[name]["memory_budget_bytes"]
                print(
                    f"  {name} seed {seed}: {len(run[name]['selected'])}/{run[name]['units']} units, step predicted "
                    f"{1000 * run[name]['predicted_step_s']:.1f} ms (raw profile {1000 * run[name]['raw_predicted_step_s']:.1f}) "
                    f"vs measured {1000 * run[name]['median_step_s']:.1f}; prediction error raw "
                    f"{'-' if raw is None else f'{raw:.0%}'} -> corrected {'-' if corrected is None else f'{corrected:.0%}'}; "
                    f"memory est {run[name]['memory_estimate_bytes'] / 2**20:.2f} MiB measured {run[name]['memory_bytes'] / 2**20:.2f} MiB"
                    + ("" if budget is None else f" (budget {budget / 2**20:.2f} MiB, {'within' if run[name]['memory_bytes'] <= budget else 'OVER'})")
                    + f"; profile {run[name]['profile_rounds']} rounds, noise {run[name]['profile_noise']:.0%}"
                )


def _plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([t for t, _ in points], [a for _, a in points], label=name, marker=".")
    ax.set_xlabel("cumulative training time (s)")
    ax.set_ylabel("test accuracy (new classes)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("elastic", __doc__.splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="run the CNN, ResNet-18 and MobileNetV2 (32x32)")
    parser.add_argument("--models", default=None, help="comma-separated models (cnn, resnet18, mobilenet_v2)")
    parser.add_argument("--variants", default="full,last_layer,elastic,elastic_module,elastic_memory",
                        help="comma-separated from full, last_layer, elastic, elastic_module, elastic_memory")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=None, help="fine-tuning seeds per model (default 1, 2 with --zoo)")
    parser.add_argument("--classes", type=int, default=10, help="classes in pretraining and in fine-tuning")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="pretraining steps (the CNN is still at chance after 200)")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps per variant (default 400, 150 with --zoo)")
    parser.add_argument("--batch-size", type=int, default=32, help="fine-tuning batch size")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
    parser.add_argument("--rho", type=float, default=0.5, help="elastic time budget: fraction of a full step's forward+backward")
    parser.add_argument("--reselect-every", type=int, default=50, help="steps between reselections")
    parser.add_argument("--memory-fraction", type=float, default=0.5, help="memory budget as a fraction of full training's measured memory")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between accuracy evaluations")
    parser.add_argument("--target", type=float, default=0.95, help="fraction of full training's final accuracy")
    parser.add_argument("--width", type=int, default=16, help="channels of the CNN's first convs")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="step-time clock of the measurements and the elastic trainers: cpu (process CPU time, "
                        "steady on a shared machine) or wall")  # fmt: skip
    parser.add_argument("--plot", action="store_true", help="also write a PNG of accuracy against training time")
    args = parse(parser, argv)
    models = args.models.split(",") if args.models else (["cnn", "resnet18", "mobilenet_v2"] if args.zoo else ["cnn"])
    args.seeds = args.seeds or (2 if args.zoo else 1)
    args.steps = args.steps or (150 if args.zoo else 400)
    names = ["full", *[n for n in args.variants.split(",") if n != "full"]]
    torch.manual_seed(args.seed)
    data, _, _ = _data(args)
    results: dict[str, Any] = {}
    for model_name in models:
        start = time.perf_counter()
        torch.manual_seed(args.seed)
        pretrained = _zoo_model(model_name, args.classes, args.width)
        pretrain(pretrained, data["old_x"], data["old_y"], steps=args.pretrain_steps, batch_size=args.batch_size)
        pretrain_acc = _accuracy(pretrained, data["old_test_x"], data["old_test_y"])
        print(f"{model_name}: pretrained on {args.classes} classes, test accuracy {pretrain_acc:.3f} ({time.perf_counter() - start:.1f} s)")
        seeds = {seed: finetune(pretrained, data, names, seed, args) for seed in range(args.seeds)}
        _print_model(model_name, seeds, args.clock)
        results[model_name] = {"pretrain_accuracy": pretrain_acc, "seeds": seeds}
        if args.plot and not plotting_available():
            print(f"no plot: {PLOT_HINT}")
        elif args.plot:
            print(f"plot written to {_plot({n: r['curve'] for n, r in seeds[0].items()}, Path(args.out) / f'elastic_{model_name}.png')}")
    config = {key: value for key, value in vars(args).items() if key != "out"}
    save_result(args.out, "elastic_zoo" if args.zoo else "elastic", {"config": config, "models": results}, summary=_headline(results, args.clock))
    return 0


def _median(runs: list[dict[str, dict[str, Any]]], variant: str, key: str) -> float:
    return float(statistics.median(run[variant][key] for run in runs))


def _headline(results: dict[str, Any], clock: str) -> str:
    """The README row: per model, each variant's median speedup per step and accuracy against full training."""
    other = "wall" if clock == "cpu" else "cpu"
    parts = []
    for model_name, result in results.items():
        runs = list(result["seeds"].values())
        variants = [name for name in runs[0] if name != "full"]

        cells = [
            f"{name} {format_number(_median(runs, name, 'speedup_vs_full'))}x "
            f"({other} {format_number(_median(runs, name, 'other_clock_speedup_vs_full'))}x) "
            f"at {_median(runs, name, 'accuracy_vs_full_points'):+.2f} points"
            for name in variants
        ]
        parts.append(f"{model_name}, {len(runs)} seed{'s' if len(runs) > 1 else ''}: " + "; ".join(cells))
    return f"speed per step on the {clock} clock vs full training, and final accuracy vs full: " + " | ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
