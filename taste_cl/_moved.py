"""Import paths that are not plain files under taste_cl/.

- Old import paths of modules that moved into their concept's folder keep working.
- ``taste_cl.adapters`` is the repository's top-level ``adapters/`` folder: an installed
  package holds it as ``taste_cl/adapters`` (setuptools' package-dir), and a source
  checkout on ``sys.path`` (a script run from the repository root) finds it beside
  ``taste_cl/``: this finder runs after the regular ones, so it only serves that case.

``import taste_cl.safety`` gives the module now at ``taste_cl.guards.update`` (the same
object, so patching either name patches both). Only public modules are listed; moved
private modules (``taste_cl._probe``, ``taste_cl.adapters._artifacts``, ...) have no alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install"]

MOVED = {
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
    "taste_cl.adapters.device_export": "taste_cl.adapters.device.backends",
    "taste_cl.adapters.flower_app": "taste_cl.adapters.flower.app",
    "taste_cl.adapters.flower_deployment": "taste_cl.adapters.flower.deployment",
    "taste_cl.adapters.flower_secagg": "taste_cl.adapters.flower.secagg",
    "taste_cl.adapters.onnx": "taste_cl.adapters.onnxruntime.learner_export",
    "taste_cl.adapters.onnx_device": "taste_cl.adapters.onnxruntime.runtime",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path, leaving that module's spec as it was."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.module: ModuleType | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        self.module = importlib.import_module(self.target)
        self.spec = self.module.__spec__
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's spec on the shared module


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "taste_cl.adapters":
            beside = Path(__file__).resolve().parent.parent / "adapters"
            if (beside / "__init__.py").is_file():
                return importlib.util.spec_from_file_location(fullname, beside / "__init__.py", submodule_search_locations=[str(beside)])
            return None
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder for old names on ``sys.meta_path`` once (after the regular finders)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
