"""The maintainer's checks run with the tests: ruff lint, ruff format and mypy stay clean.

Configured in pyproject.toml; marked ``checks`` (in the default run; ``-m checks`` runs
only these, ``-m "not slow and not checks"`` skips them). Skipped when a tool is not
installed (the ``[test]`` extra installs both).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["taste_cl"]

pytestmark = pytest.mark.checks
# A hang guard, not a speed bar: a cold mypy run takes minutes on a loaded 2-core machine (the
# three-runs-beside-two-CPU-hogs check hit 300 s).
TOOL_TIMEOUT_S = 1800


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)


def _tool(name: str) -> str:
    """The tool beside this interpreter (a venv's bin/), else on PATH, else skip."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return found


def test_ruff_check() -> None:
    result = _run(_tool("ruff"), "check", *PATHS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_check() -> None:
    result = _run(_tool("ruff"), "format", "--check", *PATHS)
    assert result.returncode == 0, "run `ruff format taste_cl`:\n" + result.stdout + result.stderr


def test_mypy() -> None:
    mypy = _tool("mypy")
    # files and options from [tool.mypy] in pyproject.toml; the cache stays at the root
    command = (mypy, "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
