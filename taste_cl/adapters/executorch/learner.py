"""The ExecuTorch device learner: load an exported folder and keep the model learning, with replay.

:class:`EtOnlineLearner` reads a folder written by :mod:`.build` (or by its own
:meth:`~EtOnlineLearner.save`), every file hash-checked, and offers ``observe``/``predict``/``save``.
This is the runtime side: it imports the runtime and replay modules, nothing from the export.

>>> from taste_cl.adapters.executorch.learner import EtOnlineLearner
>>> device = EtOnlineLearner.from_artifacts("art")  # doctest: +SKIP
>>> stats = device.observe((x, y))  # doctest: +SKIP
"""

from __future__ import annotations

import io
import math
import os
import threading
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl._batch import split_batch
from taste_cl.adapters.device.artifacts import ArtifactError, read_manifest, read_verified, staged_folder, write_manifest
from taste_cl.adapters.device.class_slots import ClassSlots, parse_active_classes
from taste_cl.adapters.device.guard import guard_from_manifest
from taste_cl.adapters.executorch.replay import load_replay, save_replay
from taste_cl.adapters.executorch.runtime import (
    BACKEND,
    FORMAT,
    MAX_FILE_BYTES,
    PARAMS,
    PROGRAM,
    REPLAY,
    WEIGHTS,
    EtTrainer,
    IOSpec,
    check_sgd,
    executorch_runtime,
)
from taste_cl.adapters.onnxruntime.manifest import MAX_ITERATIONS, MAX_REPLAY_BATCH, manifest_error, manifest_int, replay_size
from taste_cl.adapters.onnxruntime.replay import npz_headers
from taste_cl.guards.device import DeviceUpdateGuard, check_finite_outputs
from taste_cl.learner import ObserveStats
from taste_cl.replay import ReservoirReplay

__all__ = ["EtOnlineLearner"]


@dataclass(frozen=True)
class _Plan:
    """The manifest's batch plan, counters, classes in use and buffer size, validated before any file is read."""

    replay_batch_size: int
    train_iterations: int
    samples_seen: int
    steps: int
    active_classes: tuple[int, ...] | None
    replay: tuple[int, int] | None  # the buffer's (capacity, size)

    @classmethod
    def parse(cls, manifest: Mapping[str, Any], spec: IOSpec) -> _Plan:
        """Within the ONNX Runtime manifest's bounds; a folder exported without a learner has no plan or counters (defaults)."""
        counters = manifest.get("counters") or {}
        if not isinstance(counters, Mapping):
            raise manifest_error("counters", counters, "an object with samples_seen and steps")
        plan, counters = {"replay_batch_size": 0, "train_iterations": 1, **manifest}, {"samples_seen": 0, "steps": 0, **counters}
        return cls(
            replay_batch_size=manifest_int(plan, "replay_batch_size", 0, MAX_REPLAY_BATCH),
            train_iterations=manifest_int(plan, "train_iterations", 1, MAX_ITERATIONS),
            samples_seen=manifest_int(counters, "samples_seen", 0, 2**62, "counters."),
            steps=manifest_int(counters, "steps", 0, 2**62, "counters."),
            active_classes=parse_active_classes(manifest.get("active_classes"), spec.num_classes),
            replay=None if manifest.get("replay") is None else replay_size(manifest["replay"]),
        )


def _read(folder: Path, manifest: dict[str, Any], name: str) -> bytes:
    """The listed file ``name``, hash-checked; refused unread when it is over its largest size (``MAX_FILE_BYTES``)."""
    return read_verified(folder, manifest, name, max_bytes=MAX_FILE_BYTES[name])


class EtOnlineLearner:
    """Keep personalising an exported model with ExecuTorch training, with replay.

    Build it with :meth:`from_artifacts`. :meth:`observe` scores a batch (test-then-train),
    trains ``train_iterations`` SGD steps on it mixed with ``replay_batch_size`` buffered
    samples, and offers it to the reservoir. Inputs may be numpy arrays or tensors (a dict
    of them for dict-input models); :meth:`predict` returns numpy outputs.

    Every step goes through :attr:`guard`, as on ONNX Runtime (see
    :class:`~taste_cl.adapters.onnxruntime.runtime.OrtOnlineLearner`): a step that would blow the
    model up is undone, parameters and SGD momentum bit for bit; :meth:`predict` raises
    :class:`~taste_cl.exceptions.NonFiniteOutputError` rather than return NaN; a folder whose
    parameters are not finite is refused at load.
    """

    def __init__(
        self, *, directory: Path, manifest: dict[str, Any], trainer: EtTrainer, replay: ReservoirReplay | None, plan: _Plan, guard: DeviceUpdateGuard
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self.trainer = trainer
        self.replay = replay
        self.spec = trainer.spec
        self.replay_batch_size = plan.replay_batch_size
        self.train_iterations = plan.train_iterations
        self.samples_seen = plan.samples_seen
        self.steps = plan.steps
        # reserved classifier slots activate on their first label (see taste_cl/adapters/device/class_slots.py)
        self.classes = ClassSlots(plan.active_classes, self.spec.num_classes)
        self.tuner: Any = None  # a DeviceBatchTuner (taste_cl/adapters/device/tuning.py) once attached
        self.guard = trainer.guard = guard
        self._lock = threading.RLock()

    @classmethod
    def from_artifacts(cls, directory: str | os.PathLike[str], *, tuner: Any | None = None) -> EtOnlineLearner:
        """Load a folder written by the export (:mod:`.build`) or :meth:`save`, every file hash-checked.

        ``tuner``: a :class:`~taste_cl.adapters.device.tuning.DeviceBatchTuner` that tunes the training
        micro-batch (and threads) from the first ``observe`` on, resuming the folder's saved tuner state.
        """
        executorch_runtime()
        folder = Path(directory)
        manifest = read_manifest(folder, required=(PROGRAM, WEIGHTS))
        if manifest.get("backend") != BACKEND or manifest.get("format") != FORMAT:
            raise ArtifactError(
                f"{str(folder)!r} holds a {manifest.get('backend')!r} artifact of format {manifest.get('format')!r}; "
                f"this loader reads {BACKEND!r} format {FORMAT}"
            )
        optimizer = manifest.get("optimizer")
        try:  # every value is bounded before a file is read
            spec = IOSpec.from_json(manifest.get("io"))
            sgd = check_sgd({k: v for k, v in optimizer.items() if k != "type"} if isinstance(optimizer, Mapping) else optimizer)
            plan = _Plan.parse(manifest, spec)
        except ValueError as error:
            raise ArtifactError(f"{str(folder)!r} has an invalid manifest: {error}") from None
        program = _read(folder, manifest, PROGRAM)
        data = _read(folder, manifest, WEIGHTS)
        try:
            trainer = EtTrainer(program, data, spec, sgd)
        except RuntimeError as error:
            raise ArtifactError(f"ExecuTorch could not load the program in {str(folder)!r}: {error}") from error
        if manifest.get("params") is not None:
            data = _read(folder, manifest, PARAMS)
            try:
                trainer.check_parameters(npz_headers(data))  # before np.load allocates what the headers claim
                with np.load(io.BytesIO(data), allow_pickle=False) as saved:
                    trainer.load_parameters({name: saved[name] for name in saved.files})
            except (ValueError, OSError, zipfile.BadZipFile) as error:
                raise ArtifactError(f"{str(folder)!r}: {PARAMS}: {error}") from None
        damaged = sorted(name for name, value in trainer.parameters().items() if value.dtype.kind == "f" and not np.isfinite(value).all())
        if damaged:
            raise ArtifactError(
                f"{str(folder)!r}: the parameters {damaged[:5]} hold NaN or infinite values: the model is damaged; load an earlier folder"
            )
        replay = None if plan.replay is None else load_replay(_read(folder, manifest, REPLAY), spec, plan.replay)
        learner = cls(directory=folder, manifest=manifest, trainer=trainer, replay=replay, plan=plan, guard=guard_from_manifest(manifest))
        if tuner is not None:
            tuner.attach(learner, manifest.get("tuner"))
        return learner

    @property
    def lock(self) -> threading.RLock:
        """The lock every public call holds; hold it to act on the learner between two calls (a tune, a snapshot)."""
        return self._lock

    @property
    def lr(self) -> float:
        """The SGD learning rate; set it to change it (momentum is kept)."""
        return float(self.trainer.sgd["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`lr == {value!r}`, must be a finite number > 0")
        with self._lock:
            self.trainer.set_lr(float(value))

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters, by their PyTorch names."""
        with self._lock:
            return self.trainer.parameters()

    def observe(self, batch: Any) -> ObserveStats:
        """Test-then-train on one batch ``(x, y)`` or ``{"x": x, "y": y}``."""
        with self._lock:
            raw_x, raw_y = split_batch(batch)
            inputs = self.spec.flat_inputs(raw_x)
            n = inputs[0].shape[0]
            y = self.spec.targets(raw_y, n)
            self.classes.activate(y.numpy())
            start = time.perf_counter()
            n_replay = min(self.replay_batch_size, len(self.replay)) if self.replay is not None else 0
            self.trainer.check_batch(n + n_replay)  # before the buffer draws: a refused batch changes nothing
            if self.tuner is not None:
                self.tuner.before_observe(inputs, y)
            steps, losses = 0, []
            for iteration in range(self.train_iterations):
                train_inputs, train_y = inputs, y
                if n_replay:
                    assert self.replay is not None
                    replay_x, replay_y = self.replay.sample(n_replay)
                    replay_inputs = self.spec.flat_inputs(replay_x)
                    train_inputs = [torch.cat([a, b]) for a, b in zip(inputs, replay_inputs)]
                    train_y = torch.cat([y, replay_y.to(y.dtype)])
                if self.tuner is None:
                    loss, outputs, skipped = self.trainer.run(train_inputs, train_y, step=True)
                else:
                    loss, outputs, skipped = self.tuner.step(train_inputs, train_y)
                if iteration == 0:
                    stream_outputs = outputs[:n]
                steps += not skipped
                losses.append(loss)
            elapsed = time.perf_counter() - start
            if self.replay is not None:
                stored: Any = dict(zip(self.spec.keys, inputs)) if self.spec.keys is not None else inputs[0]
                self.replay.add(stored, y)
            self.samples_seen += n
            self.steps += 1
            if self.tuner is not None:
                self.tuner.after_observe((n + n_replay) * self.train_iterations, elapsed)
            return ObserveStats(
                loss=sum(losses) / len(losses),
                accuracy=self._accuracy(stream_outputs, y),
                samples=n,
                replay_samples=n_replay * self.train_iterations,
                batch_size=n + n_replay,
                micro_batches=self.train_iterations * (1 if self.tuner is None else self.tuner.micro_batches(n + n_replay)),
                steps=steps,
                step_time_s=elapsed,
                skipped=steps < self.train_iterations,
            )

    def train_step(self, x: Any, y: Any) -> tuple[np.ndarray, float, bool]:
        """One SGD step on a batch (no replay, no counters); return ``(outputs, loss, skipped)``.

        A non-finite loss or gradient skips the update, as in the PyTorch learner.
        """
        with self._lock:
            inputs = self.spec.flat_inputs(x)
            loss, outputs, skipped = self.trainer.run(inputs, self.spec.targets(y, inputs[0].shape[0]), step=True)
            return outputs.numpy(), loss, skipped

    def _accuracy(self, outputs: torch.Tensor, y: torch.Tensor) -> float:
        """The stream rows' accuracy; NaN without class labels, and when the outputs are not finite (no score from NaN)."""
        if self.spec.num_classes is None or y.is_floating_point() or outputs.dim() != 2 or not bool(torch.isfinite(outputs).all()):
            return math.nan
        return float((self.classes.mask(outputs.numpy()).argmax(axis=1) == y.numpy()).mean())

    def predict(self, x: Any) -> np.ndarray:
        """Model outputs for ``x`` (reserved slots not yet in use: ``-inf``); changes no parameter.

        Raises :class:`~taste_cl.exceptions.NonFiniteOutputError` instead of returning NaN or infinite outputs."""
        with self._lock:
            outputs = self.trainer.predict(x)
            check_finite_outputs(outputs, self.guard)
            return self.classes.mask(outputs)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the program, the current parameters (``params.npz``) and the buffer as a new artifact folder.

        The ``.pte``/``.ptd`` are copied unchanged (after re-checking their hashes); the trained
        values go to ``params.npz``, applied on load. SGD momentum is not saved (see :mod:`.runtime`).
        """
        with self._lock, staged_folder(directory) as stage:
            for name in (PROGRAM, WEIGHTS):
                (stage / name).write_bytes(_read(self.directory, self.manifest, name))
            params: dict[str, Any] = self.trainer.parameters()
            np.savez(stage / PARAMS, **params)
            manifest = {key: value for key, value in self.manifest.items() if key != "files"}
            manifest.update(
                params=PARAMS,
                optimizer={"type": "sgd", **self.trainer.sgd},
                counters={"samples_seen": self.samples_seen, "steps": self.steps},
                replay=None,
                **self.classes.manifest(),
            )
            if self.tuner is not None:
                manifest["tuner"] = self.tuner.state_dict()
            manifest["guard"] = self.guard.state_dict()
            if self.replay is not None:
                manifest["replay"] = save_replay(stage / REPLAY, self.replay)
            write_manifest(stage, manifest)
        return Path(directory).absolute()
