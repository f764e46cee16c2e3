"""Readable output: one number format, plain-text tables, summaries and JSON result files.

Every number a user reads (tables, ``print(stats)``, ``print(monitor.report())``) goes
through :func:`format_number`: three significant digits (three decimals for fractions up
to 1, such as accuracies), whole numbers from 100 on, powers of ten from 1e7; so a table
shows ``102``, ``1.09`` and ``24.2``, never ``102``, ``1.092`` and ``24.234``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from taste_cl.state.files import atomic_write_bytes

__all__ = ["MonitorReport", "format_fields", "format_number", "format_table", "write_json"]

# a cell that reads as a number (maybe with a unit or a ratio sign): right-aligned
_NUMERIC = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+|nan|inf)(e[-+]?\d+)?\s*(x|%|s|ms|MB|MiB|KiB|KB|GB)?$", re.IGNORECASE)


def _decimals(magnitude: float) -> int:
    """Three significant digits, whole from 100; fractions up to 1 (accuracies) keep three decimals."""
    return 3 if magnitude <= 1 else 2 if magnitude < 10 else 1 if magnitude < 100 else 0


def format_number(value: float | int) -> str:
    """``value`` rounded for reading: ints as they are; floats to three significant digits
    (``1.09``, ``24.2``), with three decimals up to 1 (``0.858``, ``1.000``), whole from 100
    (``13840``) and ``3.2e+08`` from 1e7."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1e7:
        return f"{value:.3g}"
    return f"{value:.{_decimals(abs(value))}f}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return format_number(value) if isinstance(value, (int, float)) else str(value)


def _numeric(value: Any) -> bool:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return True
    return isinstance(value, str) and (value == "-" or _NUMERIC.match(value.strip()) is not None)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Align ``rows`` under ``headers``; numbers use :func:`format_number` (``None`` is
    ``-``). Columns whose every cell reads as a number are right-aligned, header included;
    the others are left-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    right = [bool(rows) and all(_numeric(row[i]) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(row) for row in cells)])


def format_fields(fields: Mapping[str, Any]) -> str:
    """``name value`` pairs on one line, numbers rounded: ``loss 0.412  accuracy 0.8``."""
    return "  ".join(f"{name} {_cell(value)}" for name, value in fields.items())


class MonitorReport(dict[str, Any]):
    """The dict :meth:`StabilityPlasticityMonitor.report` returns, printed as a short summary.

    It is a plain ``dict`` for code (``report["stability"]``, JSON); ``print(report)``
    shows a few rounded lines instead of 16-digit floats.
    """

    def __str__(self) -> str:
        drift = self.get("drift") or {}
        lines = [
            format_fields(
                {
                    "steps": self.get("steps"),
                    "samples": self.get("samples_seen"),
                    "stability": self.get("stability"),
                    "plasticity": self.get("plasticity"),
                    "forgetting": self.get("forgetting"),
                    "drift detections": drift.get("count"),
                }
            )
        ]
        per_class = self.get("per_class_accuracy") or {}
        if per_class:
            lines.append("per-class accuracy: " + "  ".join(f"{c}: {format_number(float(a))}" for c, a in per_class.items()))
        fired = {name: count for name, count in (self.get("events") or {}).items() if count}
        if fired:
            lines.append("events: " + "  ".join(f"{name} {count}" for name, count in fired.items()))
        return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Atomically write ``payload`` as indented JSON; return the path."""
    target = Path(path)
    atomic_write_bytes(target, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())
    return target
