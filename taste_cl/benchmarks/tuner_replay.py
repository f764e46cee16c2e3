"""Offline replay of the batch-size tuner's search against recorded throughput curves.

Wall-clock timings on a shared machine say little about a search; this replays the tuner's
own search code (initial design, surrogate, stop rule, warm check) against a curve of
samples/s per batch size, with seeded noise, and reports what the real benchmark measures:

- tuned/oracle: the true curve at the chosen size over the curve's maximum;
- cold/grid: simulated seconds of the cold tune (the smallest-trainable check and every
  probe) over those of one grid pass (every candidate measured as a probe is);
- warm/cold: simulated seconds of a cached retune over the cold tune's.

A probe runs the tuner's timing rule (:func:`taste_cl.tuning.probe.timed_rate`: warm-up, at least
three steps and ``min_probe_time``, early stop below 80 % of the best) on simulated steps:
a step at batch ``b`` takes ``b / rate(b)`` seconds, times a per-probe factor (the load
during that probe, log-normal with ``--noise``) and a per-step jitter (2 %).

Curves come from ``batch_size.json`` files of ``taste-cl bench batch-size`` (their grids,
smoothed by a three-point median on log scale, since a grid measured on a loaded machine
holds lone spikes) or from the built-in synthetic shapes. Run:
``taste-cl bench tuner-replay [--from batch_size.json ...] [--seeds 200] [--noise 0.05]``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.report import format_table
from taste_cl.tuning.probe import timed_rate
from taste_cl.tuning.tuner import BatchSizeTuner, candidate_batch_sizes

Curve = Callable[[int], float]
_JITTER = 0.02  # per-step spread of a step's time on a quiet machine


def _saturating(peak: float, half: float) -> Curve:
    return lambda b: peak * b / (b + half)


SYNTHETIC: dict[str, tuple[Curve, int, int]] = {  # name -> (samples/s at a batch, min batch, max batch)
    "rising_then_flat": (_saturating(1000.0, 16.0), 1, 1024),
    "peaked": (lambda b: 1000.0 * b / (b + 8) * math.exp(-0.5 * max(0.0, math.log2(b / 96)) ** 2), 1, 1024),
    "cliff": (lambda b: 1000.0 * b / (b + 32) * (0.3 if b > 400 else 1.0), 1, 1024),
    "rising_to_cap": (_saturating(200.0, 64.0), 2, 256),
    "noisy_plateau": (lambda b: 500.0 * b / (b + 4) * (1 + 0.03 * math.sin(7.0 * math.log2(b))), 1, 512),
}


class SimulatedRunner:
    """Stands in for :class:`~taste_cl.tuning.probe.ProbeRunner` in the search
    (:class:`~taste_cl.tuning.searcher.ProbeSearch`): probes a curve, advancing a clock by the
    seconds the probe's steps would take."""

    def __init__(self, curve: Curve, *, min_batch: int, noise: float, rng: np.random.Generator) -> None:
        self.curve, self.min_batch, self.noise, self.rng = curve, min_batch, noise, rng
        self.clock = 0.0

    def _steps(self, batch: int) -> Callable[[], float]:
        seconds = batch / self.curve(batch) / math.exp(self.rng.normal(0.0, self.noise))

        def step() -> float:
            taken = seconds * math.exp(self.rng.normal(0.0, _JITTER))
            self.clock += taken
            return taken

        return step

    def measure(
        self, batch_size: int, *, threads: int | None = None, min_time: float = 0.15, min_steps: int = 3, stop_below: float | None = None
    ) -> float:
        return timed_rate(self._steps(batch_size), batch_size, min_time=min_time, min_steps=min_steps, stop_below=stop_below)

    def smallest_trainable(self, limit: int) -> tuple[int, list[tuple[int, str]]]:
        """One step at each size tried (a failing size costs about a step, too)."""
        batch = 1
        while batch < self.min_batch:
            self._steps(batch)()
            batch *= 2
        self._steps(batch)()
        return batch, [(b, "simulated") for b in (1, 2, 4) if b < batch]


@dataclass(frozen=True)
class Replay:
    """One seeded replay: the chosen size, its share of the curve's best, and simulated costs."""

    batch: int
    vs_oracle: float
    cold_seconds: float
    grid_seconds: float
    warm_seconds: float
    probes: int


def replay(curve: Curve, *, min_batch: int, max_batch: int, seed: int, noise: float = 0.05, **tuner_args: Any) -> Replay:
    """Cold tune, warm retune and one grid pass on ``curve`` with this seed's noise."""
    tuner = BatchSizeTuner(max_batch_size=max_batch, **tuner_args)
    candidates = candidate_batch_sizes(max_batch, per_octave=tuner.per_octave, min_batch_size=min_batch)
    oracle = max(curve(b) for b in candidates)
    rng = np.random.default_rng(seed)
    grid = SimulatedRunner(curve, min_batch=min_batch, noise=noise, rng=rng)
    for batch in candidates:
        grid.measure(batch, min_time=tuner.min_probe_time)
    probes = tuner.probe_search()
    cold = SimulatedRunner(curve, min_batch=min_batch, noise=noise, rng=rng)
    minimum = probes.smallest_trainable(cold, max_batch, 1, [])  # type: ignore[arg-type]  # no fixed-work windows: no threads tuned
    search, _, _ = probes.search(cold, candidates, [1], [], anchored=False)  # type: ignore[arg-type]
    best = search.best()
    assert best is not None and minimum == min_batch
    known = [(b, t, r) for (b, t), rates in search.rates.items() for r in rates]
    warm = SimulatedRunner(curve, min_batch=min_batch, noise=noise, rng=rng)
    probes.search(warm, candidates, [1], known, anchored=False)  # type: ignore[arg-type]
    return Replay(best[0], curve(best[0]) / oracle, cold.clock, grid.clock, warm.clock, len(known))


def curve_from_grid(grid: dict[int, float]) -> Curve:
    """A recorded grid as a curve: three-point median of log-rates (a lone spike of a loaded
    machine is not the truth), log-log interpolation between recorded sizes."""
    sizes = sorted(grid)
    logs = [math.log(grid[b]) for b in sizes]
    smooth = [statistics.median(logs[max(0, i - 1) : i + 2]) for i in range(len(sizes))]
    x = np.log(np.array(sizes, dtype=float))
    return lambda b: float(math.exp(np.interp(math.log(b), x, smooth)))


def summarize(replays: list[Replay]) -> dict[str, float]:
    ratios = sorted(r.vs_oracle for r in replays)
    cold = [r.cold_seconds / r.grid_seconds for r in replays]
    warm = [r.warm_seconds / r.cold_seconds for r in replays]
    return {
        "vs_oracle_mean": statistics.fmean(ratios),
        "vs_oracle_p5": ratios[len(ratios) // 20],
        "share_below_095": sum(r < 0.95 for r in ratios) / len(ratios),
        "cold_vs_grid_mean": statistics.fmean(cold),
        "cold_vs_grid_p95": sorted(cold)[(len(cold) * 19) // 20],
        "warm_vs_cold_mean": statistics.fmean(warm),
        "probes_mean": statistics.fmean(r.probes for r in replays),
    }


def load_curves(paths: Sequence[str]) -> dict[str, tuple[Curve, int, int]]:
    """Curves from ``batch_size.json`` results, named ``model@file's folder``."""
    curves: dict[str, tuple[Curve, int, int]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        models = data.get("result", data)["models"]
        for name, record in models.items():
            grid = {int(b): float(r) for b, r in record["grid"].items()}
            curves[f"{name}@{Path(path).parent.name}"] = (curve_from_grid(grid), min(grid), max(grid))
    return curves


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("tuner-replay", __doc__.splitlines()[0], threads=0)
    parser.add_argument("--from", dest="sources", nargs="*", default=[], help="batch_size.json files whose grids to replay")
    parser.add_argument("--seeds", type=int, default=200, help="noise seeds per curve")
    parser.add_argument("--noise", type=float, default=0.05, help="per-probe load noise (log-normal sigma)")
    parser.add_argument("--no-synthetic", action="store_true", help="only the recorded curves")
    args = parse(parser, argv)
    curves = {} if args.no_synthetic else dict(SYNTHETIC)
    curves.update(load_curves(args.sources))
    results = {}
    for name, (curve, low, high) in curves.items():
        results[name] = summarize([replay(curve, min_batch=low, max_batch=high, seed=s, noise=args.noise) for s in range(args.seeds)])
    keys = ["vs_oracle_mean", "vs_oracle_p5", "share_below_095", "cold_vs_grid_mean", "cold_vs_grid_p95", "warm_vs_cold_mean", "probes_mean"]
    print(format_table(["curve", *keys], [[name, *(r[k] for k in keys)] for name, r in results.items()]))
    worst = min(results.values(), key=lambda r: r["vs_oracle_p5"])
    summary = (
        f"{len(results)} curves x {args.seeds} seeds, {args.noise:.0%} probe noise: tuned/oracle 5th percentile >= "
        f"{worst['vs_oracle_p5']:.2f}, cold/grid <= {max(r['cold_vs_grid_mean'] for r in results.values()):.2f} (means)"
    )
    save_result(args.out, "tuner_replay", {"noise": args.noise, "seeds": args.seeds, "curves": results}, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
