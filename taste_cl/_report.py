"""Plain-text tables and JSON result files for the CLI, demo and benchmarks."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taste_cl.checkpoint import atomic_write_bytes

__all__ = ["format_table", "write_json"]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if abs(value) >= 1e7:
            return f"{value:.4g}"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Align ``rows`` under ``headers`` in columns; floats get three decimals
    (whole numbers from 100 on, four significant digits from 1e7)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([line, rule, *body])


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Atomically write ``payload`` as indented JSON; return the path."""
    target = Path(path)
    atomic_write_bytes(target, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())
    return target
