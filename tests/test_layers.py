"""The layering is written down and checked, not remembered.

The contracts live in pyproject.toml (``[tool.importlinter]``) and import-linter checks them
here, imports inside functions included: the library never imports its benchmarks,
``exceptions.py`` sits at the bottom, a device runtime imports nothing from an export side, and
the torch-free device learner and ClientApp import no torch. import-linter cannot see a module
named by a string (``importlib.import_module("taste_cl.benchmarks.soak")``), so the strings are
checked too: only the ``taste-cl bench`` dispatcher names a benchmark module.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers import public_modules

import taste_cl
from taste_cl.exceptions import TasteCLError, TasteCLWarning

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "taste_cl"
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
DISPATCHER = PACKAGE / "cli" / "main.py"


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed (pip install '.[test]')")
    return found


def test_every_import_contract_is_kept() -> None:
    result = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def test_the_benchmark_contract_covers_every_part_of_the_library_but_the_benchmarks() -> None:
    (contract,) = [c for c in CONTRACTS if c["id"] == "benchmarks-one-way"]
    parts = {f"taste_cl.{p.stem if p.suffix == '.py' else p.name}" for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    parts -= {"taste_cl.__init__"}
    assert set(contract["source_modules"]) == parts - {"taste_cl.benchmarks"}


def _benchmark_strings(path: Path) -> list[str]:
    """String constants in ``path`` that name a module under taste_cl.benchmarks."""
    tree = ast.parse(path.read_text())
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("taste_cl.benchmarks")
    ]


def test_only_the_bench_dispatcher_names_a_benchmark_module_by_string() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if PACKAGE / "benchmarks" not in p.parents]
    naming = {str(p.relative_to(ROOT)): _benchmark_strings(p) for p in outside}
    assert {path for path, strings in naming.items() if strings} == {"taste_cl/cli/main.py"}
    from taste_cl.cli.main import BENCHMARKS

    assert sorted(naming["taste_cl/cli/main.py"]) == sorted(module for module, _ in BENCHMARKS.values())
    for module, _ in BENCHMARKS.values():
        assert callable(importlib.import_module(module).main), module


def _exported_classes() -> dict[str, type]:
    """``module.Name`` -> every class in a public module's ``__all__`` (the optional extras are installed in CI)."""
    found: dict[str, type] = {}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if isinstance(value, type):
                found[f"{module_name}.{name}"] = value
    return found


def test_every_public_exception_is_a_taste_cl_error_and_every_warning_a_taste_cl_warning() -> None:
    classes = _exported_classes()
    errors = {n: c for n, c in classes.items() if issubclass(c, BaseException) and not issubclass(c, Warning)}
    warnings = {n: c for n, c in classes.items() if issubclass(c, Warning)}
    assert len(errors) >= 20 and len(warnings) >= 5
    assert [n for n, c in errors.items() if not issubclass(c, TasteCLError)] == []
    assert [n for n, c in warnings.items() if not issubclass(c, TasteCLWarning)] == []


def test_every_exception_class_is_defined_in_exceptions_py() -> None:
    import taste_cl.exceptions as exceptions

    defined_elsewhere = {
        n: c.__module__ for n, c in _exported_classes().items() if issubclass(c, BaseException) and c.__module__ != exceptions.__name__
    }
    assert defined_elsewhere == {}
    hierarchy = {c for c in vars(exceptions).values() if isinstance(c, type) and issubclass(c, BaseException) and c.__module__ == exceptions.__name__}
    assert {c.__name__ for c in hierarchy} == set(exceptions.__all__)


@pytest.mark.parametrize(
    ("name", "builtin"),
    [
        ("InvalidBatchError", ValueError),
        ("CheckpointNotFoundError", FileNotFoundError),
        ("MissingDependencyError", ImportError),
        ("ExportError", ValueError),
        ("ArtifactError", ValueError),
        ("TuningError", RuntimeError),
        ("DeploymentError", RuntimeError),
        ("TuningWarning", UserWarning),
        ("ProfileCacheWarning", RuntimeWarning),
        ("ElasticWarning", RuntimeWarning),
    ],
)
def test_each_error_still_subclasses_the_builtin_callers_catch(name: str, builtin: type) -> None:
    import taste_cl.exceptions as exceptions

    assert issubclass(getattr(exceptions, name), builtin)


def test_the_root_exports_export_error_and_the_warning_base() -> None:
    assert {"ExportError", "TasteCLError", "TasteCLWarning"} <= set(taste_cl.__all__)


def test_the_cycle_contract_covers_the_whole_package_and_catches_a_cycle(tmp_path: Path) -> None:
    """The no-cycles contract starts at the package root, and its contract type refuses a cycle made of
    an import inside a function (a package ``cyclic`` whose ``a`` and ``b`` import each other)."""
    (contract,) = [c for c in CONTRACTS if c["id"] == "no-cycles"]
    assert contract["ancestors"] == ["taste_cl"] and "depth" not in contract  # every depth (import-linter's default: 10)
    files = {
        "cyclic/__init__.py": "",
        "cyclic/a/__init__.py": "",
        "cyclic/a/one.py": "def late():\n    from cyclic.b import two  # noqa: F401\n",
        "cyclic/b/__init__.py": "",
        "cyclic/b/two.py": "from cyclic.a import one  # noqa: F401\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_package = "cyclic"\n\n[[tool.importlinter.contracts]]\n'
        f'name = "no cycles"\ntype = "{contract["type"]}"\nancestors = ["cyclic"]\n'
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([_lint_imports(), "--no-cache", "--no-logo"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "No cycles are allowed in cyclic" in result.stdout
