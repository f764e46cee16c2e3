"""Shared command-line plumbing of the benchmarks: common options, quiet logs,
progress bars, alternating timing rounds, an output folder, figures and a JSON summary."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from taste_cl.cli.console import HelpFormatter, plain_text, progress_bar, set_third_party_logging
from taste_cl.report import write_json

__all__ = ["alternating_rounds", "base_parser", "environment", "parse", "progress_bar", "save_result"]


def base_parser(prog: str, description: str, *, threads: int = 1) -> argparse.ArgumentParser:
    """Options every benchmark has. ``description`` may be reST (a docstring); ``threads``
    is the default of ``--threads``.

    Small models on a small, shared CPU run faster and far steadier on one intra-op
    thread: with two, a busy neighbour process can make each tiny op wait for a core.
    """
    parser = argparse.ArgumentParser(prog=f"taste-cl bench {prog}", description=plain_text(description), formatter_class=HelpFormatter)
    parser.add_argument("--out", default="bench_results", help="folder for the JSON (and PNG) results")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, models and replay")
    parser.add_argument("--threads", type=int, default=threads, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--verbose", action="store_true", help="show the INFO logs of third-party libraries (Flower, Ray, Avalanche)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars (hidden anyway when not a terminal)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``, apply ``--threads`` and set third-party logging from ``--verbose``."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_third_party_logging(args.verbose)
    return args


def environment() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def save_result(out: str, name: str, result: dict[str, Any], *, summary: str | None = None) -> Path:
    """Write ``result`` with the environment to ``<out>/<name>.json`` and say where.

    ``summary`` is the headline in one line (the figures, rounded); ``taste-cl bench
    report`` puts it in the README's performance table.
    """
    payload = {"benchmark": name, "environment": environment(), **result}
    if summary is not None:
        payload["summary"] = summary
    path = write_json(Path(out) / f"{name}.json", payload)
    print(f"results written to {path}")
    return path


def alternating_rounds(variants: Mapping[str, Callable[[], Any]], *, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one value per round.

    Every variant is called once first (first-call allocations, graph setup); then each of
    ``repeats`` rounds times ``steps`` calls of every variant, in reverse order every other
    round, so a slow drift or a busy neighbour weighs on all variants alike.
    """
    for step in variants.values():
        step()
    names = list(variants)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(steps):
                variants[name]()
            timings[name].append((time.perf_counter() - start) / steps)
    return timings
