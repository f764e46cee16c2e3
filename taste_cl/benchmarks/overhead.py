"""Per-observe overhead: ``OnlineLearner.observe`` against the raw torch loop doing the same math.

For each model (the digits MLP, a small CNN, MobileNetV2 at 32x32) one run interleaves, in
blocks of ``--steps`` steps repeated ``--repeats`` times, the raw loop (forward, backward,
SGD step on the stream batch plus samples from a reservoir kept in plain tensors, and the
eval-mode scoring forward where the learner scores in eval mode) and ``observe`` with its
defaults, the monitor's probe off (a huge ``eval_every``), the update guard off, replay off
(the raw loop without replay is its reference) and with the batch-size tuner and elastic
plugins attached but idle. It prints median seconds per step and ratios to the raw loop
(with the spread of the per-block ratios), a per-phase breakdown of the default ``observe``
and the CNN's achieved FLOP/s against this machine's sgemm peak, and writes JSON.
Run: ``taste-cl bench overhead``.
"""

from __future__ import annotations

import copy
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.datasets import make_cnn, make_mlp, make_pattern_images, split_digits
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.replay import ReservoirReplay
from taste_cl.report import format_table

VARIANTS = ("raw", "defaults", "monitor off", "guard off", "replay off", "plugins idle", "raw no replay")
CAPACITY = 200
PHASES = ("validation", "forward/backward", "step+guard", "replay", "monitor", "plugins")


@dataclass(frozen=True)
class Case:
    """One model of the benchmark: builder, data, stream batch and replay share."""

    name: str
    build: Callable[[int], nn.Module]
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    batch: int
    replay: int
    lr: float


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tasks = split_digits(5, seed=seed)
    return torch.cat([t.x_train for t in tasks]), torch.cat([t.y_train for t in tasks])


def _mobilenet(seed: int) -> nn.Module:
    from torchvision.models import mobilenet_v2  # torchvision is a benchmark-only dependency

    torch.manual_seed(seed)
    return mobilenet_v2(weights=None, num_classes=10)


CASES = {
    "mlp": Case("digits MLP", lambda seed: make_mlp(seed=seed), _digits, 10, 10, 0.1),
    "cnn": Case("small CNN", lambda seed: make_cnn(seed=seed), lambda seed: make_pattern_images(2000, seed=seed), 32, 32, 0.05),
    "mobilenet_v2": Case("MobileNetV2 32x32", _mobilenet, lambda seed: make_pattern_images(1000, seed=seed), 16, 16, 0.05),
}


class RawLoop:
    """The physical limit: the same step in plain torch, with a reservoir kept in two tensors."""

    def __init__(self, model: nn.Module, case: Case, sample: torch.Tensor, *, replay: bool, score_eval: bool, seed: int) -> None:
        self.model, self.loss_fn = model, nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
        self.replay_n = case.replay if replay else 0
        self.score_eval = score_eval
        self.buf_x = torch.empty((CAPACITY, *sample.shape[1:]), dtype=sample.dtype)
        self.buf_y = torch.empty(CAPACITY, dtype=torch.long)
        self.seen = 0
        self.generator = torch.Generator().manual_seed(seed)

    def observe(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.score_eval:  # the prequential score, test before train
            self.model.eval()
            with torch.no_grad():
                scores = self.model(x)
            self.model.train()
        stored = min(self.seen, CAPACITY)
        k = min(self.replay_n, stored)
        if k:
            idx = torch.randint(stored, (k,), generator=self.generator)
            x_in, y_in = torch.cat([x, self.buf_x[idx]]), torch.cat([y, self.buf_y[idx]])
        else:
            x_in, y_in = x, y
        logits = self.model(x_in)
        loss = self.loss_fn(logits, y_in)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        correct = int(((scores if self.score_eval else logits[: len(y)]).argmax(1) == y).sum())
        self._add(x, y)
        return correct / len(y)

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        n = len(y)
        positions = torch.arange(self.seen, self.seen + n)
        slots = torch.where(positions < CAPACITY, positions, (torch.rand(n, generator=self.generator) * (positions + 1)).long())
        keep = slots < CAPACITY
        self.buf_x[slots[keep]] = x[keep]
        self.buf_y[slots[keep]] = y[keep]
        self.seen += n


class Phases:
    """Exclusive wall time per phase: wraps learner methods so nested calls are not counted twice."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._stack: list[tuple[str, float]] = []

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            now = time.perf_counter()
            if self._stack:  # pause the enclosing phase
                outer, since = self._stack[-1]
                self.seconds[outer] += now - since
            self._stack.append((phase, now))
            try:
                return inner(*args, **kwargs)
            finally:
                _, since = self._stack.pop()
                end = time.perf_counter()
                self.seconds[phase] += end - since
                if self._stack:
                    self._stack[-1] = (self._stack[-1][0], end)

        setattr(owner, method, timed)

    def attach(self, learner: OnlineLearner) -> None:
        self.wrap(learner, "_validate", "validation")
        self.wrap(learner, "_micro_step", "forward/backward")
        self.wrap(learner, "_apply_accumulated", "step+guard")
        self.wrap(learner, "_draw_replay", "replay")
        self.wrap(learner, "_with_replay", "replay")
        if learner.replay is not None:
            self.wrap(learner.replay, "add_validated", "replay")
        self.wrap(learner, "_logits", "monitor")  # the eval-mode score and the probe's forwards
        for method in ("record", "evaluate", "dispatch"):
            self.wrap(learner.monitor, method, "monitor")
        for plugin in learner.plugins:
            for method in ("before_step", "after_observe"):
                self.wrap(plugin, method, "plugins")


def _learner(case: Case, variant: str, seed: int, cache_dir: str) -> OnlineLearner:
    model = case.build(seed)
    monitor = StabilityPlasticityMonitor(eval_every=10**9) if variant == "monitor off" else None
    plugins: list[Any] = []
    if variant == "plugins idle":
        from taste_cl.elastic import ElasticTrainer
        from taste_cl.tuning.tuner import BatchSizeTuner

        plugins = [
            BatchSizeTuner(retune_on_drift=False, load_tolerance=1e9, min_retune_interval=10**9, cache_dir=cache_dir),
            ElasticTrainer(rho=1.0, reselect_every=10**9, cache_dir=None),
        ]
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=case.lr),
        replay=None if variant == "replay off" else ReservoirReplay(CAPACITY, seed=seed),
        replay_batch_size=case.replay,
        monitor=monitor,
        guard_updates="never" if variant == "guard off" else "auto",
        plugins=plugins,
    )


def _first_observe(learner: OnlineLearner, x: torch.Tensor, y: torch.Tensor) -> None:
    """The first batch, with the plugins' first-batch work (a tune, a profile) skipped: they stay idle."""
    plugins, learner.plugins = learner.plugins, []
    try:
        learner.observe((x, y))
    finally:
        learner.plugins = plugins


def _gemm_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best float32 matrix-multiply FLOP/s of torch.mm on this machine (current thread count)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one training forward+backward (torch's flop counter; the SGD update is negligible)."""
    from torch.utils.flop_counter import FlopCounterMode

    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(twin(x), y).backward()
    return int(counter.get_total_flops())


def run_case(case: Case, args: Any, cache_dir: str) -> dict[str, Any]:
    """Interleaved blocks of every variant on ``case``; medians, spreads and a phase breakdown."""
    steps, repeats = args.steps, args.repeats
    if case.name.startswith("MobileNet"):
        steps, repeats = max(2, steps // 5), max(3, repeats // 2 + 1)
    x_all, y_all = case.data(args.seed)
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(args.seed))
    x_all, y_all = x_all[order], y_all[order]
    learners = {v: _learner(case, v, args.seed, cache_dir) for v in VARIANTS if not v.startswith("raw")}
    cursor = dict.fromkeys((*VARIANTS, "phases"), 0)

    def next_batch(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        start = cursor[variant] % (len(y_all) - case.batch)
        cursor[variant] = start + case.batch
        return x_all[start : start + case.batch], y_all[start : start + case.batch]

    for variant, learner in learners.items():
        _first_observe(learner, *next_batch(variant))
    score_eval = learners["defaults"].score_eval
    raws = {
        "raw": RawLoop(case.build(args.seed), case, x_all, replay=True, score_eval=score_eval, seed=args.seed),
        "raw no replay": RawLoop(case.build(args.seed), case, x_all, replay=False, score_eval=score_eval, seed=args.seed),
    }
    for raw in raws.values():
        raw.observe(*next_batch("raw"))
    # The breakdown's timers cost time themselves, so they go on a twin of the defaults
    # learner that runs beside the others and never enters the ratio table.
    instrumented = _learner(case, "defaults", args.seed, cache_dir)
    _first_observe(instrumented, *next_batch("phases"))
    phases = Phases()
    phases.attach(instrumented)
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    phase_total = 0.0
    for block in progress_bar(range(repeats + 1), enabled=not args.no_progress, desc=case.name):
        for variant in (*VARIANTS, "phases"):
            batches = [next_batch(variant) for _ in range(steps)]
            step: Callable[[torch.Tensor, torch.Tensor], Any]
            if variant in raws:
                step = raws[variant].observe
            else:
                step = partial(_observe, instrumented if variant == "phases" else learners[variant])
            if variant == "phases" and block == 1:  # count the timed blocks only
                phases.seconds = dict.fromkeys(PHASES, 0.0)
            start = time.perf_counter()
            for x, y in batches:
                step(x, y)
            if not block:  # block 0 warms every variant up
                continue
            if variant == "phases":
                phase_total += time.perf_counter() - start
            else:
                per_step[variant].append((time.perf_counter() - start) / steps)
    plans = {v: learner.batch_plan for v, learner in learners.items()}
    if plans["plugins idle"] is not None:
        raise RuntimeError(f"the idle plugins changed the batch plan to {plans['plugins idle']}")
    medians = {v: statistics.median(t) for v, t in per_step.items()}
    ratios: dict[str, list[float]] = {}
    for variant in VARIANTS:
        reference = "raw no replay" if variant == "replay off" else "raw"
        ratios[variant] = [a / b for a, b in zip(per_step[variant], per_step[reference])]
    timed_steps = repeats * steps
    breakdown = {phase: seconds / timed_steps for phase, seconds in phases.seconds.items()}
    breakdown["other"] = max(0.0, phase_total / timed_steps - sum(breakdown.values()))
    x0, y0 = next_batch("raw")
    flops = _step_flops(raws["raw"].model, torch.cat([x0, x0[: case.replay]]), torch.cat([y0, y0[: case.replay]]))
    return {
        "model": case.name,
        "stream_batch": case.batch,
        "replay_batch": case.replay,
        "steps_per_block": steps,
        "blocks": repeats,
        "score_eval": score_eval,
        "seconds_per_step": per_step,
        "median_seconds_per_step": medians,
        "median_ratio_to_raw": {v: statistics.median(r) for v, r in ratios.items()},
        "ratio_spread": {v: [min(r), max(r)] for v, r in ratios.items()},
        "phase_seconds_per_step": breakdown,
        "train_flops_per_step": flops,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("overhead", __doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="observes per timed block (a fifth for MobileNetV2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per variant, interleaved (about half for MobileNetV2)")
    parser.add_argument("--models", nargs="+", choices=list(CASES), default=list(CASES), help="which models to run")
    args = parse(parser, argv)
    peak = _gemm_peak()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for key in args.models:
            torch.manual_seed(args.seed)
            results[key] = run_case(CASES[key], args, cache_dir)
    rows = []
    for res in results.values():
        for variant in VARIANTS[1:]:
            ratio, (low, high) = res["median_ratio_to_raw"][variant], res["ratio_spread"][variant]
            reference = "raw no replay" if variant == "replay off" else "raw"
            rows.append([res["model"], variant, res["median_seconds_per_step"][variant] * 1e3, ratio, f"{low:.2f}-{high:.2f}", reference])
    print(format_table(["model", "variant", "ms/step", "ratio", "spread", "vs"], rows))
    phase_rows = []
    for res in results.values():
        phase = res["phase_seconds_per_step"]
        total = sum(phase.values())
        phase_rows.append([res["model"], *(f"{1e3 * phase[p]:.3f} ({100 * phase[p] / total:.0f}%)" for p in (*PHASES, "other"))])
    print("\nper-phase time of the default observe (a timed twin, not the one above), ms/step (share):")
    print(format_table(["model", *PHASES, "other"], phase_rows))
    flops_line = {}
    if "cnn" in results:
        cnn = results["cnn"]
        flops = cnn["train_flops_per_step"]
        flops_line = {
            "sgemm_peak_flops": peak,
            "raw_flops_per_s": flops / cnn["median_seconds_per_step"]["raw"],
            "observe_flops_per_s": flops / cnn["median_seconds_per_step"]["defaults"],
        }
        print(
            f"\nsmall CNN: {flops / 1e6:.1f} MFLOP per training step; raw loop {flops_line['raw_flops_per_s'] / 1e9:.2f} GFLOP/s, "
            f"observe {flops_line['observe_flops_per_s'] / 1e9:.2f} GFLOP/s, sgemm peak {peak / 1e9:.2f} GFLOP/s "
            f"({100 * flops_line['observe_flops_per_s'] / peak:.0f}% of peak)"
        )
    summary = ", ".join(f"{res['model']} {res['median_ratio_to_raw']['defaults']:.2f}x" for res in results.values())
    save_result(
        args.out,
        "overhead",
        {"steps": args.steps, "repeats": args.repeats, "cases": results, "flops": flops_line},
        summary=f"observe vs raw torch loop (defaults): {summary}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _observe(learner: OnlineLearner, x: torch.Tensor, y: torch.Tensor) -> Any:
    return learner.observe((x, y))
