"""Shared command-line plumbing of the benchmarks: an output folder and a JSON summary."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from taste_cl._report import write_json

__all__ = ["base_parser", "environment", "parse", "save_result"]


def base_parser(prog: str, description: str, *, threads: int = 1) -> argparse.ArgumentParser:
    """Options every benchmark has. ``threads`` is the default of ``--threads``.

    Small models on a small, shared CPU run faster and far steadier on one intra-op
    thread: with two, a busy neighbour process can make each tiny op wait for a core.
    """
    parser = argparse.ArgumentParser(prog=f"taste-cl bench {prog}", description=description)
    parser.add_argument("--out", default="bench_results", help="folder for the JSON (and PNG) results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=threads, help=f"torch intra-op threads (0: torch's default; default {threads})")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and apply ``--threads``."""
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def environment() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }


def save_result(out: str, name: str, result: dict[str, Any]) -> Path:
    path = write_json(Path(out) / f"{name}.json", {"benchmark": name, "environment": environment(), **result})
    print(f"results written to {path}")
    return path
