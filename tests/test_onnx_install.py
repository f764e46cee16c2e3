"""The `[onnx]` extra is plain, current onnxruntime: its floor, what `backend="auto"` picks without the training build,
and the refusal of a training-build folder where the build is missing.

The floor (:data:`~taste_cl.adapters.onnx_engine.optimizers.MIN_ONNXRUNTIME`) was found by training exported folders
in venvs of each release: 1.17.3 refuses IR 10, 1.18.0 fails to import beside numpy 2 (its metadata allows it), 1.18.1
(numpy < 2) and later train. One test here repeats that in a venv with the floor's onnxruntime
(``TASTE_CL_ORT_MIN_VENV``, default ``/tmp/ort_min``; ``.ci/run`` makes it; skipped without one).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_without_torch
from torch import nn

from taste_cl import OnlineLearner
from taste_cl.adapters.device import backends, loader
from taste_cl.adapters.device.artifacts import read_manifest, write_manifest
from taste_cl.adapters.device.loader import load_learner, training_build_installed
from taste_cl.exceptions import MissingDependencyError

ROOT = Path(__file__).resolve().parents[1]
ORT_MIN = Path(os.environ.get("TASTE_CL_ORT_MIN_VENV", "/tmp/ort_min")) / "bin" / "python"
# what each onnxruntime release reads (onnxruntime's docs/compatibility table): newest IR version and default-domain opset
ORT_READS = {"1.17": (9, 20), "1.18": (10, 21), "1.19": (10, 21)}


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _learner() -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), input_shape=(6,), num_classes=3)


def test_the_onnx_extra_is_plain_onnxruntime_from_the_tested_floor_and_the_training_build_has_its_own() -> None:
    from taste_cl.adapters.onnx_engine.optimizers import MIN_ONNXRUNTIME

    extras = _extras()
    assert f"onnxruntime>={MIN_ONNXRUNTIME}" in extras["onnx"]
    assert not any("training" in requirement for requirement in extras["onnx"])
    assert any(requirement.startswith("onnxruntime-training-cpu==") for requirement in extras["onnx-training"])
    assert "onnx-training" not in extras["all"][0] and "onnx," in extras["all"][0]  # plain and training cannot share a venv
    setup = (ROOT / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    onnx_row = next(line for line in setup.splitlines() if line.startswith("| `.[onnx]`"))
    assert f"onnxruntime` >= {MIN_ONNXRUNTIME}" in onnx_row
    assert any(line.startswith("| `.[onnx-training]`") for line in setup.splitlines())


def test_the_exported_graphs_are_what_the_floor_reads(tmp_path: Path) -> None:
    pytest.importorskip("onnxscript")
    import onnx

    from taste_cl.adapters.onnx_engine.optimizers import MIN_ONNXRUNTIME

    folder = _learner().export(tmp_path / "engine", backend="onnx_engine")
    ir, opset = ORT_READS[".".join(MIN_ONNXRUNTIME.split(".")[:2])]
    graphs = {path.name: onnx.load(str(path)) for path in folder.glob("*.onnx")}
    assert set(graphs) >= {"forward.onnx", "backward.onnx", "optimizer.onnx"}
    for name, model in graphs.items():
        assert ORT_READS["1.17"][0] < model.ir_version <= ir, name  # IR 10: why the floor is not 1.17
        assert {(o.domain or "ai.onnx") for o in model.opset_import} == {"ai.onnx"}, name  # no contrib or custom ops
        assert max(o.version for o in model.opset_import) <= opset, name


_TRAIN = """
import json, sys
import numpy as np
import onnxruntime
from taste_cl.adapters.device import load_learner

device = load_learner(sys.argv[1])
rng = np.random.default_rng(0)
losses = [device.observe((rng.standard_normal((8, 6)).astype(np.float32), np.arange(8) % 3)).loss for _ in range(5)]
print(json.dumps({"ort": onnxruntime.__version__, "torch": "torch" in sys.modules, "kind": type(device).__name__, "losses": losses}))
"""


@pytest.mark.skipif(
    not ORT_MIN.exists(),
    reason=f"no venv with the floor's onnxruntime at {ORT_MIN.parent.parent} "
    "(python3 -m venv /tmp/ort_min && /tmp/ort_min/bin/pip install onnxruntime==1.18.1 'numpy<2' lazy_loader psutil)",
)
def test_the_device_learner_trains_on_the_floors_onnxruntime(tmp_path: Path) -> None:
    from taste_cl.adapters.onnx_engine.optimizers import MIN_ONNXRUNTIME

    folder = _learner().export(tmp_path / "engine", backend="onnx_engine")
    done = run_without_torch(_TRAIN, str(folder), python=ORT_MIN, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["ort"] == MIN_ONNXRUNTIME and info["torch"] is False and info["kind"] == "OnnxEngineLearner"
    assert all(np.isfinite(info["losses"]))


def test_auto_picks_the_onnx_engine_where_the_training_build_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("onnxscript")
    monkeypatch.setattr(backends, "training_build_installed", lambda: True)
    assert backends.auto_order() == backends.AUTO_ORDER == ("onnxruntime", "executorch")
    monkeypatch.setattr(backends, "training_build_installed", lambda: False)
    assert backends.auto_order() == ("onnx_engine", "executorch")
    folder = _learner().export(tmp_path / "auto")
    manifest = read_manifest(folder)
    assert manifest["backend"] == "onnx_engine"
    assert manifest["selection"] == {"backend": "onnx_engine", "order": ["onnx_engine", "executorch"], "refused": {}}
    stats = load_learner(folder).observe((np.ones((4, 6), np.float32), np.array([0, 1, 2, 0])))
    assert stats.steps == 1 and np.isfinite(stats.loss)
    # named explicitly, the training engine is refused as not installed, naming its extra, and the next one is tried
    folder = _learner().export(tmp_path / "named", order=("onnxruntime", "onnx_engine"))
    refused = read_manifest(folder)["selection"]["refused"]
    assert refused == {"onnxruntime": "not installed (pip install 'taste-cl[onnx-training]')"}


@pytest.mark.parametrize("manifest", [{"backend": "onnxruntime"}, {}], ids=["named", "predates-the-field"])
def test_a_training_build_folder_without_the_build_is_refused_saying_how_to_go_on(
    manifest: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "training_build_installed", lambda: False)
    (tmp_path / "training.onnx").write_bytes(b"not read")
    write_manifest(tmp_path, manifest)
    with pytest.raises(MissingDependencyError, match=re.escape('pip install "taste-cl[onnx-training]"')) as error:
        load_learner(tmp_path)
    assert 'backend="onnx_engine"' in str(error.value) and error.value.package == "onnxruntime-training-cpu"


def test_the_training_build_is_told_apart_from_plain_onnxruntime_without_importing_it() -> None:
    code = "import sys; from taste_cl.adapters.device.loader import training_build_installed as t; print(t(), 'onnxruntime' in sys.modules)"
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(training_build_installed()), "False"]


@pytest.mark.skipif(training_build_installed(), reason="the training build is installed here")
def test_exporting_to_the_training_engine_without_the_build_names_its_extra(tmp_path: Path) -> None:
    with pytest.raises(MissingDependencyError, match=re.escape("'.[onnx-training]'")):
        _learner().export(tmp_path / "ort", backend="onnxruntime")
    assert not (tmp_path / "ort").exists()
