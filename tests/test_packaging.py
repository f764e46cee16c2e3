"""The package as users get it: light import, adapters in the wheel, README and CI in sync."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import public_modules

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


def test_no_symbolic_links_in_the_repository():
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert [line for line in listed.splitlines() if line.startswith("120000")] == []


def test_no_module_folder_holds_more_than_fifteen_modules():
    for folder in [ROOT / "taste_cl", *(ROOT / "taste_cl").glob("**/")]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, (folder, len(modules))


def test_adapters_and_benchmarks_import_as_subpackages():
    import taste_cl.adapters
    import taste_cl.benchmarks.online_digits

    assert Path(taste_cl.adapters.__file__).name == "__init__.py"
    assert callable(taste_cl.benchmarks.online_digits.main)


# where each public module lives, relative to the package root, as one process sees it
_WHERE = (
    "import importlib, json, os, sys, taste_cl; root = os.path.dirname(taste_cl.__file__); "
    "mods = {{m: importlib.import_module(m) for m in {modules!r}}}; "
    "print(json.dumps({{'root': root, 'modules': {{m: [mod.__name__, mod.__spec__.name, os.path.relpath(mod.__file__, root)] for m, mod in mods.items()}}}}))"
)


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_the_wheel_and_the_checkout_resolve_every_public_module_alike(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("taste_cl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"taste_cl/py.typed", "taste_cl/__init__.pyi", "taste_cl/adapters/onnxruntime/__init__.pyi"} <= names
    assert not any(name.startswith(("tests/", "adapters/", "benchmarks/")) for name in names)
    # every file of the package in the checkout is in the wheel, and nothing else of the package
    shipped = {name for name in names if name.startswith("taste_cl/")}
    checkout = {str(p.relative_to(ROOT)) for p in (ROOT / "taste_cl").rglob("*") if p.suffix in (".py", ".pyi", ".typed")}
    assert shipped == checkout
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "taste-cl = taste_cl.cli:main" in entry_points
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    code = _WHERE.format(modules=public_modules())
    from_wheel = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True
    )
    from_checkout = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True
    )
    assert from_wheel.returncode == 0, from_wheel.stderr[-2000:]
    assert from_checkout.returncode == 0, from_checkout.stderr[-2000:]
    wheel_view, checkout_view = json.loads(from_wheel.stdout), json.loads(from_checkout.stdout)
    assert wheel_view["root"].startswith(str(site)) and checkout_view["root"] == str(ROOT / "taste_cl")
    assert wheel_view["modules"] == checkout_view["modules"]
    assert all(name == spec == m for m, (name, spec, _) in checkout_view["modules"].items())


def test_the_package_installs_no_import_finder():
    """Only the torch-free runtime's blocker (which refuses ``torch`` alone) may sit on ``sys.meta_path``;
    importing every public module adds no finder."""
    code = (
        "import importlib, sys; before = list(sys.meta_path); "
        f"[importlib.import_module(m) for m in {public_modules()!r}]; "
        "added = [type(f).__qualname__ for f in sys.meta_path if f not in before]; print(added)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="needs the source tree")
def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme.split("## Set up", 1)[1].split("##", 1)[0])
    assert len(commands) == 2, commands
    assert "taste-cl demo" in commands[0] and "pytest" in commands[1]
    assert "readme_test_command" in (ROOT / ".ci" / "run").read_text()


LAZY_PACKAGES = [
    "taste_cl",
    "taste_cl.learner",
    "taste_cl.monitor",
    "taste_cl.guards",
    "taste_cl.tuning",
    "taste_cl.replay",
    "taste_cl.state",
    "taste_cl.adapters.device",
    "taste_cl.adapters.onnxruntime",
    "taste_cl.adapters.executorch",
    "taste_cl.adapters.flower",
]


def test_only_the_device_path_loads_names_on_first_use():
    """Lazy loading only where the torch-free device runtime (or a device runtime's distance from its
    export side) needs it; each such package lists its names once, in its ``__init__.pyi``."""
    lazy = sorted(
        ".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "taste_cl").rglob("__init__.py") if "lazy_loader" in p.read_text()
    )
    assert lazy == sorted(LAZY_PACKAGES)
    for package in LAZY_PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        stub = (folder / "__init__.pyi").read_text()
        listed = re.findall(r"^from \.[\w.]+ import (\w+) as (\w+)$", stub, re.M)
        assert listed and all(a == b for a, b in listed), package
        names = [a for a, _ in listed]
        assert len(names) == len(set(names)), package


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
