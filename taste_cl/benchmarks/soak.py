"""Soak: a long synthetic stream through a small model, resident memory sampled as it goes.

Gaussian class clusters whose centres move every ``--drift-every`` samples (so drift
events keep firing); reservoir replay, the default monitor, optionally the batch-size
tuner. Prints RSS after warm-up and at the end, the growth, and the size of every
history (buffer, monitor events, tuner history, checkpoint bytes with and without the
capped histories), and writes JSON.
Run: ``taste-cl bench soak`` (200k samples) or ``--samples 20000`` for a short one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.replay import ReservoirReplay
from taste_cl.report import format_number, format_table
from taste_cl.state.checkpoint import encode_state
from taste_cl.tuning.tuner import BatchSizeTuner

__all__ = ["main", "run_soak"]


def _state_bytes(learner: OnlineLearner) -> tuple[int, int]:
    """The checkpoint's bytes, and its bytes without the capped histories (monitor events, tuner history).

    The histories fill up to their caps (asserted separately), possibly long after warm-up;
    everything else must not grow with the stream at all.
    """
    state = learner.state_dict()
    total = len(encode_state(state))
    state["monitor"]["events"] = []
    if "batch_size_tuner" in state["plugins"]:
        state["plugins"]["batch_size_tuner"]["history"] = []
    return total, len(encode_state(state))


def run_soak(
    *,
    samples: int = 200_000,
    batch_size: int = 20,
    features: int = 16,
    classes: int = 10,
    drift_every: int = 10_000,
    replay_capacity: int = 500,
    max_events: int = 200,
    tuner_cache_dir: str | Path | None = None,
    rss_every: int = 100,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Stream ``samples`` samples; return RSS samples, growth after warm-up (first 20 %) and history sizes.

    With ``tuner_cache_dir`` a :class:`BatchSizeTuner` (small, quick probes) is attached;
    ``progress`` shows a bar on a terminal.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))
    plugins = []
    if tuner_cache_dir is not None:
        plugins.append(BatchSizeTuner(max_batch_size=64, n_calls=3, warm_calls=1, min_probe_time=0.02, cache_dir=tuner_cache_dir))
    learner = OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        replay=(replay := ReservoirReplay(replay_capacity, seed=seed)),
        monitor=StabilityPlasticityMonitor(max_events=max_events),
        plugins=plugins,
    )
    process = psutil.Process()
    centres = torch.randn(classes, features, generator=generator) * 2
    rss: list[tuple[int, float]] = []
    losses: list[float] = []
    warm_up = samples // 5
    warm_bytes = warm_uncapped = 0
    start = time.perf_counter()
    offsets = range(0, samples, batch_size)
    for i, offset in enumerate(progress_bar(offsets, enabled=progress, desc="soak", unit="batch")):
        if offset and offset % drift_every < batch_size:
            centres = torch.randn(classes, features, generator=generator) * 2
        y = torch.randint(0, classes, (batch_size,), generator=generator)
        x = centres[y] + torch.randn(batch_size, features, generator=generator)
        stats = learner.observe((x, y))
        if stats.loss is not None:
            losses.append(stats.loss)
        if i % rss_every == 0:
            rss.append((learner.samples_seen, process.memory_info().rss / 2**20))
        if not warm_bytes and learner.samples_seen >= warm_up:
            warm_bytes, warm_uncapped = _state_bytes(learner)
    seconds = time.perf_counter() - start
    rss.append((learner.samples_seen, process.memory_info().rss / 2**20))
    after_warm_up = [mb for seen, mb in rss if seen >= warm_up]
    tuner = plugins[0] if plugins else None
    tenth = max(1, len(losses) // 10)
    final_bytes, final_uncapped = _state_bytes(learner)
    return {
        "samples": learner.samples_seen,
        "seconds": seconds,
        "samples_per_s": learner.samples_seen / seconds,
        "rss_mb": rss,
        "rss_warm_mb": after_warm_up[0],
        "rss_final_mb": after_warm_up[-1],
        "rss_peak_after_warm_up_mb": max(after_warm_up),
        "rss_growth_mb": max(after_warm_up) - after_warm_up[0],
        "replay_len": len(replay),
        "replay_capacity": replay_capacity,
        "monitor_events": len(learner.monitor.events),
        "max_events": max_events,
        "event_counts": learner.monitor.report()["events"],
        "tuner_history": None if tuner is None else len(tuner.history_),
        "tuner_history_max": None if tuner is None else tuner.history_.maxlen,
        "state_bytes_warm": warm_bytes,
        "state_bytes_final": final_bytes,
        "state_bytes_uncapped_warm": warm_uncapped,
        "state_bytes_uncapped_final": final_uncapped,
        "loss_first_tenth": sum(losses[:tenth]) / tenth,
        "loss_last_tenth": sum(losses[-tenth:]) / tenth,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("soak", __doc__, threads=0)
    parser.add_argument("--samples", type=int, default=200_000, help="stream length")
    parser.add_argument("--batch-size", type=int, default=20, help="stream samples per observe call")
    parser.add_argument("--tuner", action="store_true", help="attach the batch-size tuner (cache under --out)")
    args = parse(parser, argv)
    result = run_soak(
        samples=args.samples,
        batch_size=args.batch_size,
        seed=args.seed,
        tuner_cache_dir=Path(args.out) / "soak_tuner_cache" if args.tuner else None,
        progress=not args.no_progress,
    )
    rows = [
        ["samples", result["samples"]],
        ["samples/s", result["samples_per_s"]],
        ["RSS after warm-up (MB)", result["rss_warm_mb"]],
        ["RSS final (MB)", result["rss_final_mb"]],
        ["RSS growth after warm-up (MB)", result["rss_growth_mb"]],
        ["replay buffer / capacity", f"{result['replay_len']} / {result['replay_capacity']}"],
        ["monitor events kept / max", f"{result['monitor_events']} / {result['max_events']}"],
        ["events fired", result["event_counts"]],
        ["tuner history kept / max", f"{result['tuner_history']} / {result['tuner_history_max']}"],
        ["checkpoint bytes warm -> final", f"{result['state_bytes_warm']} -> {result['state_bytes_final']}"],
        [
            "  without capped histories",
            f"{result['state_bytes_uncapped_warm']} -> {result['state_bytes_uncapped_final']}",
        ],
        ["mean loss first -> last tenth", f"{result['loss_first_tenth']:.3f} -> {result['loss_last_tenth']:.3f}"],
    ]
    print(format_table(["measure", "value"], rows))
    summary = (
        f"RSS growth {format_number(result['rss_growth_mb'])} MB after warm-up over {result['samples']} samples; "
        f"replay {result['replay_len']}/{result['replay_capacity']}, events kept {result['monitor_events']}/{result['max_events']}; "
        f"{format_number(result['samples_per_s'])} samples/s"
    )
    save_result(args.out, "soak", result, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
