"""Shared command-line plumbing of the benchmarks: an output folder and a JSON summary."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import Any

import torch

from taste_cl._report import write_json

__all__ = ["base_parser", "environment", "save_result"]


def base_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"taste-cl bench {prog}", description=description)
    parser.add_argument("--out", default="bench_results", help="folder for the JSON (and PNG) results")
    parser.add_argument("--seed", type=int, default=0)
    return parser


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
