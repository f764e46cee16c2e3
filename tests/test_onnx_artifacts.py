"""The backend-neutral artifact folder (staging, manifest, confinement) and the parity gate."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from taste_cl import CheckpointError
from taste_cl.adapters.device.artifacts import (
    MANIFEST_FILE,
    ArtifactError,
    read_manifest,
    read_verified,
    staged_folder,
    write_manifest,
)
from taste_cl.adapters.device.parity import ParityError, TorchTrainer, check_parity


def _folder(root: Path, files: dict[str, bytes] | None = None, **manifest: object) -> Path:
    with staged_folder(root / "art") as stage:
        for name, data in (files or {"a.bin": b"alpha", "b.bin": b"beta"}).items():
            (stage / name).write_bytes(data)
        write_manifest(stage, {"format": 1, **manifest})
    return root / "art"


def _rewrite(folder: Path, edit) -> None:
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    edit(manifest)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))


# ------------------------------------------------------------------ staging
def test_staged_folder_publishes_only_complete_folders(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert read_manifest(folder, required=["a.bin"])["files"].keys() == {"a.bin", "b.bin"}
    with pytest.raises(RuntimeError, match="boom"), staged_folder(folder) as stage:
        (stage / "c.bin").write_bytes(b"half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in folder.iterdir()) == ["a.bin", "b.bin", MANIFEST_FILE]
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no staging folder left behind
    _folder(tmp_path, {"c.bin": b"new"})  # replacing an earlier artifact folder
    assert sorted(p.name for p in folder.iterdir()) == ["c.bin", MANIFEST_FILE]


def test_staged_folder_refuses_a_foreign_folder_or_a_file(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="non-empty folder without manifest.json"), staged_folder(tmp_path / "mine"):
        pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"), staged_folder(tmp_path / "file"):
        pass
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


# ------------------------------------------------------------ confinement
@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.bin", "sub/a.bin", "..", "", "a\\b", "x\0y"])
def test_manifest_file_names_must_be_plain(tmp_path: Path, name: str) -> None:
    folder = _folder(tmp_path)
    (tmp_path / "outside.bin").write_bytes(b"secret")
    _rewrite(folder, lambda m: m["files"].update({name: "0" * 64}))
    with pytest.raises(ArtifactError, match="not a plain file name"):
        read_manifest(folder)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda f: (f / "extra.bin").write_bytes(b"x"), "does not list"),
        (lambda f: (f / "a.bin").unlink(), "missing"),
        (lambda f: (f / "a.bin").write_bytes(b"tampered"), "SHA-256 mismatch"),
        (lambda f: os.symlink("/etc/hostname", f / "link.bin"), "not a regular file"),
        (lambda f: (f / "sub").mkdir(), "not a regular file"),
        (lambda f: (f / MANIFEST_FILE).write_text("[" * 40 + "]" * 40), "nests 40 levels"),
        (lambda f: (f / MANIFEST_FILE).write_text('{"files": {}, "lr": NaN}'), "non-finite"),
        (lambda f: (f / MANIFEST_FILE).write_text("{"), "not valid JSON"),
        (lambda f: (f / MANIFEST_FILE).write_text("[]"), "must be a JSON object"),
        (lambda f: (f / MANIFEST_FILE).write_bytes(b" " * (1 << 20) + b"{}"), "byte bound"),
        (lambda f: _rewrite(f, lambda m: m["files"].update({"a.bin": "zz"})), "64 lowercase hex"),
        (lambda f: _rewrite(f, lambda m: m.pop("files")), "no 'files'"),
    ],
)
def test_read_manifest_refuses_tampered_folders(tmp_path: Path, edit, match: str) -> None:
    folder = _folder(tmp_path)
    edit(folder)
    with pytest.raises(ArtifactError, match=match):
        read_manifest(folder)


def test_required_files_and_verified_reads(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    with pytest.raises(ArtifactError, match="required file 'c.bin'"):
        read_manifest(folder, required=["c.bin"])
    manifest = read_manifest(folder)
    assert read_verified(folder, manifest, "a.bin") == b"alpha"
    with pytest.raises(ArtifactError, match="not listed"):
        read_verified(folder, manifest, "c.bin")
    (folder / "a.bin").write_bytes(b"swapped")  # changed after the check
    with pytest.raises(ArtifactError, match="changed after it was checked"):
        read_verified(folder, manifest, "a.bin")
    assert issubclass(ArtifactError, CheckpointError)


# ------------------------------------------------------------- parity gate
def _trainer(seed: int = 0, lr: float = 0.1) -> TorchTrainer:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return TorchTrainer(model, optimizer, nn.CrossEntropyLoss())


def _batches(n: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((5, 4)).astype(np.float32), rng.integers(0, 3, 5)) for _ in range(n)]


def test_identical_trainers_pass_and_copies_leave_the_model_alone() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    reference = TorchTrainer(model, optimizer, nn.CrossEntropyLoss())
    report = check_parity(reference, TorchTrainer(model, optimizer, nn.CrossEntropyLoss()), _batches(), backend="torch")
    assert report.passed and report.steps == 3 and report.max_param_diff == 0.0
    assert "passed over 3 steps" in str(report)
    assert torch.equal(model.weight, before) and not optimizer.state  # the trainers trained copies


def test_gate_catches_a_different_learning_rate_with_the_numbers() -> None:
    with pytest.raises(ParityError, match=r"FAILED over 3 steps: outputs .* losses .* parameters") as caught:
        check_parity(_trainer(), _trainer(lr=0.12), _batches(), backend="broken")
    report = caught.value.report
    assert not report.passed and report.max_param_diff > report.param_tol == 1e-4
    assert report.max_output_diff > 0 and report.max_loss_diff > 0


def test_gate_catches_different_initial_weights_and_nan() -> None:
    with pytest.raises(ParityError):
        check_parity(_trainer(0), _trainer(1), _batches(1), backend="other-init")

    class NaNTrainer:
        def train_step(self, x, y):
            return float("nan")

        def parameters(self):
            return _trainer().parameters()

        def predict(self, x):
            return _trainer().predict(x)

    with pytest.raises(ParityError, match="losses inf"):
        check_parity(_trainer(), NaNTrainer(), _batches(1), backend="nan")


def test_gate_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="`batches` is empty"):
        check_parity(_trainer(), _trainer(), [], backend="x")
    with pytest.raises(ValueError, match="`tolerance == 0`"):
        check_parity(_trainer(), _trainer(), _batches(1), backend="x", tolerance=0)

    class Partial:
        def train_step(self, x, y):
            return 0.0

        def parameters(self):
            return {}

        def predict(self, x):
            return _trainer().predict(x)

    with pytest.raises(ValueError, match="no values for the trainable parameters"):
        check_parity(_trainer(), Partial(), _batches(1), backend="x", tolerance=1e9)


class _Fixed:
    """A trainer with fixed outputs of magnitude ``scale`` and losses of 4 (plus ``loss_shift``)."""

    def __init__(self, scale: float, loss_shift: float = 0.0) -> None:
        self.scale, self.loss_shift = scale, loss_shift

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        return 4.0 + self.loss_shift

    def parameters(self) -> dict[str, np.ndarray]:
        return {"w": np.ones(2, np.float32)}

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.full((len(x), 3), self.scale, np.float32)


@pytest.mark.parametrize(("scale", "passes"), [(150.0, True), (1.5, False)])
def test_a_loss_is_held_to_the_rounding_of_the_outputs_it_comes_from(scale: float, passes: bool) -> None:
    """A cross-entropy of 4 from logits near 150 carries their float32 rounding (5e-4 in the personalize
    benchmark's last-layer CNN, torch float32 against float64 as much as ExecuTorch): the loss is scaled by
    the outputs' magnitude too, so that passes, while the same loss difference from outputs near 1.5 fails."""
    batches = _batches(3)
    if passes:
        report = check_parity(_Fixed(scale), _Fixed(scale, 5e-4), batches, backend="rounded")
        assert report.max_loss_diff == pytest.approx(5e-4 / scale, rel=1e-3)
    else:
        with pytest.raises(ParityError, match=r"losses 0\.000125 \(tol 0\.0001\)"):
            check_parity(_Fixed(scale), _Fixed(scale, 5e-4), batches, backend="rounded")
