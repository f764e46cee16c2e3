"""The package as users get it: light import, adapters in the wheel, README and CI in sync."""

from __future__ import annotations

import os
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
        "heavy = [m for m in ('avalanche', 'onnxruntime', 'onnx', 'flwr', 'ray', 'torchvision', 'skopt', 'peft', 'transformers', 'accelerate') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_api_is_explicit_and_sorted():
    assert taste_cl.__all__ == sorted(taste_cl.__all__)
    for name in taste_cl.__all__:
        assert hasattr(taste_cl, name), name


# every import path users had before the restructuring (the old flat modules) -> its home now
PUBLIC_MODULES = {
    "taste_cl.learner": "taste_cl.learner",
    "taste_cl.replay": "taste_cl.replay",
    "taste_cl.strategies": "taste_cl.strategies",
    "taste_cl.tasks": "taste_cl.tasks",
    "taste_cl.plugins": "taste_cl.plugins",
    "taste_cl.datasets": "taste_cl.datasets",
    "taste_cl.experiment": "taste_cl.experiment",
    "taste_cl.testing": "taste_cl.testing",
    "taste_cl.exceptions": "taste_cl.exceptions",
    "taste_cl.elastic": "taste_cl.elastic",
    "taste_cl.tuning": "taste_cl.tuning",
    "taste_cl.monitor": "taste_cl.monitor",
    "taste_cl.cli": "taste_cl.cli",
    "taste_cl.checkpoint": "taste_cl.state.checkpoint",
    "taste_cl.demo": "taste_cl.cli.demo",
    "taste_cl.drift": "taste_cl.monitor.drift",
    "taste_cl.evaluation": "taste_cl.monitor.evaluation",
    "taste_cl.export": "taste_cl.cli.export",
    "taste_cl.fleet": "taste_cl.cli.fleet",
    "taste_cl.guard": "taste_cl.guards.probe",
    "taste_cl.load": "taste_cl.tuning.load",
    "taste_cl.safety": "taste_cl.guards.update",
    "taste_cl.serve_demo": "taste_cl.cli.serve_demo",
    "taste_cl.benchmarks.online_digits": "taste_cl.benchmarks.online_digits",
    "taste_cl.adapters.avalanche": "taste_cl.adapters.avalanche",
    "taste_cl.adapters.executorch": "taste_cl.adapters.executorch",
    "taste_cl.adapters.flower": "taste_cl.adapters.flower",
    "taste_cl.adapters.device_export": "taste_cl.adapters.device.backends",
    "taste_cl.adapters.flower_app": "taste_cl.adapters.flower.app",
    "taste_cl.adapters.flower_deployment": "taste_cl.adapters.flower.deployment",
    "taste_cl.adapters.flower_secagg": "taste_cl.adapters.flower.secagg",
    "taste_cl.adapters.onnx": "taste_cl.adapters.onnxruntime.learner_export",
    "taste_cl.adapters.onnx_device": "taste_cl.adapters.onnxruntime.runtime",
}
# public names read from the old modules (documented in README and docs/ before the move)
PUBLIC_NAMES = {
    "taste_cl.tuning": ["BatchSizeTuner", "TuningResult", "LoadMeter"],
    "taste_cl.monitor": ["StabilityPlasticityMonitor", "MonitorEvent", "sample_correct"],
    "taste_cl.safety": ["UpdateGuard", "GUARD_MODES"],
    "taste_cl.guard": ["ProbeGuard"],
    "taste_cl.adapters.onnx": ["export", "export_model", "OrtOnlineLearner", "ParityError", "ARTIFACT_FILES"],
    "taste_cl.adapters.onnx_device": ["OrtOnlineLearner", "DeviceObserveStats", "parse_manifest"],
    "taste_cl.adapters.executorch": ["export", "export_model", "EtOnlineLearner", "UnsupportedModelError"],
    "taste_cl.adapters.flower": ["make_client_app", "AggregationPolicy", "run_fleet_simulation", "shared_state"],
    "taste_cl.adapters.device_export": ["export", "AUTO_ORDER"],
}


@pytest.mark.parametrize("old", sorted(PUBLIC_MODULES))
def test_every_public_import_path_of_before_the_move_still_works(old):
    code = (
        "import importlib, sys; "
        f"old = importlib.import_module({old!r}); new = importlib.import_module({PUBLIC_MODULES[old]!r}); "
        "assert old is new, (old, new); assert new.__spec__.name == new.__name__ == "
        f"{PUBLIC_MODULES[old]!r}, new.__spec__.name; "
        f"[getattr(old, name) for name in {PUBLIC_NAMES.get(old, [])!r}]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_symbolic_links_in_the_repository():
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert [line for line in listed.splitlines() if line.startswith("120000")] == []


def test_no_module_folder_holds_more_than_fifteen_modules():
    for folder in [ROOT / "taste_cl", ROOT / "adapters", *(ROOT / "taste_cl").glob("*/"), *(ROOT / "adapters").glob("*/")]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, (folder, len(modules))


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
        "taste_cl/adapters/onnxruntime/runtime.py",
        "taste_cl/adapters/device/artifacts.py",
        "taste_cl/adapters/flower/app.py",
        "taste_cl/benchmarks/online_digits.py",
    ):
        assert expected in names, expected
    assert not any(name.startswith(("tests/", "adapters/", "benchmarks/")) for name in names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "taste-cl = taste_cl.cli:main" in entry_points
    # installed from the wheel alone (no source tree on the path), every public module imports
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    code = f"import importlib, taste_cl; assert taste_cl.__file__.startswith({str(site)!r}); [importlib.import_module(m) for m in {sorted(PUBLIC_MODULES)!r}]"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="needs the source tree")
def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme.split("## Set up", 1)[1].split("##", 1)[0])
    assert len(commands) == 2, commands
    assert "taste-cl demo" in commands[0] and "pytest" in commands[1]
    assert "readme_test_command" in (ROOT / ".ci" / "run").read_text()


LAZY_PACKAGES = [
    "taste_cl",
    "taste_cl.tuning",
    "taste_cl.monitor",
    "taste_cl.guards",
    "taste_cl.state",
    "taste_cl.adapters.device",
    "taste_cl.adapters.onnxruntime",
    "taste_cl.adapters.executorch",
    "taste_cl.adapters.web",
    "taste_cl.adapters.flower",
]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_folders_public_names_stay_what_they_are_after_its_modules_are_imported(package):
    """Importing ``pkg.name`` sets the attribute ``name`` on ``pkg``: no public name may be a module's name too."""
    code = (
        "import importlib, pkgutil, types; "
        f"pkg = importlib.import_module({package!r}); "
        "[importlib.import_module(f'{pkg.__name__}.{m.name}') for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg and m.name != '__main__']; "
        "bad = [n for n in pkg.__all__ if isinstance(getattr(pkg, n), types.ModuleType)]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
