"""No module reads or writes a private attribute of another object.

An expression ``obj._x`` is an access to another object's private state unless ``obj`` is
``self`` or ``cls``; ``from module import _x`` is one to another module's. Each part owns its
state and offers public methods for what others need from it. The scan covers every module of
the package, the benchmarks included; the allowlist holds third-party privates only, each keyed
by the file and the attribute, with the reason it is needed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "taste_cl"

# (file relative to the repository root, private name): why the third-party private is used.
ALLOWED: dict[tuple[str, str], str] = {
    # torch: the base class of every BatchNorm*d, which torch exports under no public name
    ("taste_cl/adapters/device/transforms.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    ("taste_cl/adapters/onnxruntime/build.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    ("taste_cl/adapters/onnxruntime/learner_export.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    ("taste_cl/benchmarks/device_runtimes.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    ("taste_cl/benchmarks/onnx_training.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    # torch: the base class of BatchNorm and InstanceNorm (their affine weight and bias), exported under no public name
    ("taste_cl/adaptation/methods.py", "_NormBase"): "torch.nn.modules.batchnorm._NormBase",
    # torch: the aten backward op of adaptive average pooling, which the ONNX engine decomposes
    ("taste_cl/adapters/onnx_engine/decompositions.py", "_adaptive_avg_pool2d_backward"): "torch.ops.aten",
    # torch.onnx: the exporter's operator registry (which ops it can translate), and the OpOverload type
    ("taste_cl/adapters/onnx_engine/export.py", "_registration"): "torch.onnx._internal.exporter",
    ("taste_cl/adapters/onnx_engine/export.py", "_ops"): "torch._ops.OpOverload",
    # torch: the fused multi-tensor kernels clip_grad_norm_ and the optimizers use themselves
    ("taste_cl/guards/update.py", "_foreach_mul"): "torch._foreach_mul",
    ("taste_cl/guards/update.py", "_foreach_sub"): "torch._foreach_sub",
    ("taste_cl/guards/update.py", "_foreach_copy_"): "torch._foreach_copy_",
    ("taste_cl/guards/update.py", "_foreach_norm"): "torch._foreach_norm",
    ("taste_cl/learner/batching.py", "_foreach_norm"): "torch._foreach_norm",
    ("taste_cl/learner/learner.py", "_foreach_mul_"): "torch._foreach_mul_",
    # torch: the aten op torch.export emits for a view, which ExecuTorch's kernel list names
    ("taste_cl/adapters/executorch/build.py", "_unsafe_view"): "torch.ops.aten._unsafe_view",
    # torch: the joint forward-backward graph ExecuTorch's training export is built from
    ("taste_cl/adapters/executorch/build.py", "_export_forward_backward"): "torch.export.experimental",
    # ExecuTorch's runtime: its operator registry, thread pool and program loader have no public API
    ("taste_cl/adapters/executorch/build.py", "_get_operator_names"): "executorch runtime",
    ("taste_cl/adapters/executorch/runtime.py", "_load_for_executorch_from_buffer"): "executorch runtime",
    ("taste_cl/adapters/device/tuning.py", "_threadpool_get_thread_count"): "executorch runtime",
    ("taste_cl/adapters/device/tuning.py", "_unsafe_reset_threadpool"): "executorch runtime",
    ("taste_cl/benchmarks/device_runtimes.py", "_threadpool_get_thread_count"): "executorch runtime",
    ("taste_cl/benchmarks/device_runtimes.py", "_unsafe_reset_threadpool"): "executorch runtime",
    # peft: a LoHa layer's active adapters and its delta, which peft computes only inside forward
    ("taste_cl/adapters/executorch/loha.py", "_available_adapters"): "peft LoHa layer",
    ("taste_cl/adapters/executorch/loha.py", "_get_delta_activations"): "peft LoHa layer",
    # ONNX Runtime: the C++ bindings (the training API without onnxruntime-training's Python package)
    ("taste_cl/adapters/onnxruntime/session.py", "_pybind_state"): "onnxruntime.capi._pybind_state",
    ("taste_cl/adapters/onnxruntime/trial.py", "_pybind_state"): "onnxruntime.capi._pybind_state",
    ("taste_cl/adapters/web/compat.py", "_pybind_state"): "onnxruntime.capi._pybind_state",
    ("taste_cl/adapters/web/compat.py", "_optimizer"): "onnxruntime.training.api.Optimizer's binding",
    # flatbuffers: the generated ORT-format checkpoint readers expose their table only as _tab
    ("taste_cl/adapters/onnxruntime/build.py", "_tab"): "flatbuffers table",
    # torch: the pytree utilities torch.export uses, imported as a module
    ("taste_cl/elastic/profiling.py", "_pytree"): "torch.utils._pytree",
    ("taste_cl/elastic/trainer.py", "_pytree"): "torch.utils._pytree",
    # Avalanche: a strategy's loss (its public criterion() computes the loss of the current batch) and the
    # dataset builder that keeps task labels, which Avalanche exports under no public name
    ("taste_cl/adapters/avalanche.py", "_criterion"): "avalanche strategy",
    ("taste_cl/adapters/avalanche.py", "_make_taskaware_tensor_classification_dataset"): "avalanche.benchmarks.utils",
}

OWN = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_package_module(module: str, name: str) -> bool:
    """Whether ``module.name`` is a private module of taste_cl itself (``taste_cl._batch``): private to the package, not to a module."""
    if not module.startswith("taste_cl"):
        return False
    base = ROOT.joinpath(*module.split("."), name)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def private_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every private attribute ``source`` reads or writes on an object other than
    ``self`` / ``cls``, and of every private name it imports from another module."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = node.module
            found.extend((node.lineno, alias.name) for alias in node.names if _private(alias.name) and not _is_package_module(module, alias.name))
    return sorted(found)


def test_the_scan_flags_another_objects_private_and_not_its_own() -> None:
    source = "class A:\n    def f(self, other):\n        self._x = other._y\n        return cls._z, other.__len__, A.__name__\n"
    assert private_accesses(source) == [(3, "_y")]
    assert private_accesses("from taste_cl.monitor.monitor import _parse_state\n") == [(1, "_parse_state")]
    assert private_accesses("from taste_cl import _batch\nimport taste_cl._checks\n") == []
    assert private_accesses("x = obj.method()._cache\n") == [(1, "_cache")]


def test_no_module_reads_another_objects_private_attributes() -> None:
    offences = []
    used: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        for line, name in private_accesses(path.read_text()):
            key = (relative, name)
            if key in ALLOWED:
                used.add(key)
            else:
                offences.append(f"{relative}:{line}: {name}")
    assert not offences, "private attributes of other objects:\n" + "\n".join(offences)
    assert not set(ALLOWED) - used, f"allowlist entries no longer used: {sorted(set(ALLOWED) - used)}"
