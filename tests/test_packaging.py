"""The package as users get it: light import, adapters in the wheel, README and CI in sync."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import taste_cl

ROOT = Path(__file__).resolve().parents[1]


def test_import_taste_cl_does_not_import_optional_extras():
    code = (
        "import sys, taste_cl; "
        "heavy = [m for m in ('avalanche', 'onnxruntime', 'onnx', 'flwr', 'ray', 'torchvision', 'skopt') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_api_is_explicit_and_sorted():
    assert taste_cl.__all__ == sorted(taste_cl.__all__)
    for name in taste_cl.__all__:
        assert hasattr(taste_cl, name), name


def test_adapters_and_benchmarks_import_as_subpackages():
    import taste_cl.adapters
    import taste_cl.benchmarks.online_digits

    assert Path(taste_cl.adapters.__file__).name == "__init__.py"
    assert callable(taste_cl.benchmarks.online_digits.main)


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_built_wheel_ships_adapters_benchmarks_and_py_typed(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("taste_cl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "taste_cl/__init__.py",
        "taste_cl/py.typed",
        "taste_cl/adapters/__init__.py",
        "taste_cl/benchmarks/online_digits.py",
    ):
        assert expected in names, expected
    assert not any(name.startswith(("tests/", "adapters/", "benchmarks/")) for name in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "taste-cl = taste_cl.cli:main" in entry_points


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="needs the source tree")
def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme.split("## Set up", 1)[1].split("##", 1)[0])
    assert len(commands) == 2, commands
    assert "taste-cl demo" in commands[0] and "pytest" in commands[1]
    assert "readme_test_command" in (ROOT / ".ci" / "run").read_text()
