"""The on-device learner for ONNX Runtime artifacts: numpy and ``onnxruntime-training-cpu`` only, no torch.

:class:`OrtOnlineLearner` loads a folder written by :func:`taste_cl.adapters.onnxruntime.learner_export.export`
(or by its own :meth:`~OrtOnlineLearner.save`), checking everything before use: the
manifest (plain file names, every file listed and hashed, bounded JSON) and every value
in it, the ONNX models (no external data), and the replay buffer (dtypes, shapes, label
range, finiteness). It then keeps personalising the model: ``observe`` (test-then-train
with replay), ``predict``, ``save``/``from_artifacts`` (resume, optimizer state included)
and ``export_inference_model``.

It uses ONNX Runtime's own bindings (``onnxruntime.capi._pybind_state``: ``Module``,
``CheckpointState``, ``Optimizer``), because ``onnxruntime.training.api`` imports torch.
Install on a device (about 270 MB)::

    pip install numpy lazy_loader onnxruntime-training-cpu==1.19.2 && pip install --no-deps taste-cl

>>> from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
>>> device = OrtOnlineLearner.from_artifacts("artifacts")  # doctest: +SKIP
>>> stats = device.observe((x, y))  # numpy arrays  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import (
    ArtifactError,
    check_plain_name,
    read_manifest,
    read_verified,
    staged_folder,
    write_manifest,
)
from taste_cl.adapters.device.class_slots import ClassSlots
from taste_cl.adapters.device.guard import guard_from_manifest
from taste_cl.adapters.onnxruntime.batches import features, split_batch, targets
from taste_cl.adapters.onnxruntime.cross_checks import ADAMW_OP, TRAINING_OPS, check_agreement
from taste_cl.adapters.onnxruntime.manifest import (
    CHECKPOINT,
    EVAL_MODEL,
    INFERENCE_MODEL,
    OPTIMIZER_MODEL,
    OUTPUT_NAME,
    REPLAY_FILE,
    SGD_STATE_FILE,
    TRAINING_MODEL,
    WEB_FILES,
    DeviceSpec,
    parse_manifest,
)
from taste_cl.adapters.onnxruntime.ort_checkpoint import read_checkpoint
from taste_cl.adapters.onnxruntime.proto import Signature, check_no_external_data, read_signature
from taste_cl.adapters.onnxruntime.replay import MAX_REPLAY_BYTES, NumpyReplay
from taste_cl.adapters.onnxruntime.session import OrtSession, load_sgd_state, ort_bindings
from taste_cl.adapters.web.compat import add_web_artifacts
from taste_cl.guards.device import DeviceUpdateGuard, check_finite_outputs
from taste_cl.learner.stats import ObserveStats

__all__ = ["OrtOnlineLearner", "load"]


_NPZ_SLACK = 1 << 16  # an .npz archive's zip and .npy headers, per member


@dataclass
class _Loaded:
    folder: Path
    manifest: dict[str, Any]
    spec: DeviceSpec
    session: OrtSession
    replay: NumpyReplay | None = field(default=None)
    guard: DeviceUpdateGuard = field(default_factory=DeviceUpdateGuard)


def load(directory: str | os.PathLike[str], *, training_model: Path | None = None, session_options: Any | None = None) -> _Loaded:
    """Check an artifact folder completely, then load it (see :meth:`OrtOnlineLearner.from_artifacts`)."""
    ort_bindings()  # the install hint comes before any file is read
    folder = Path(directory)
    manifest = read_manifest(folder, required=(TRAINING_MODEL, EVAL_MODEL, CHECKPOINT))
    spec = parse_manifest(manifest)
    allowed = {TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT, INFERENCE_MODEL, REPLAY_FILE, SGD_STATE_FILE,
               *WEB_FILES}  # fmt: skip
    unknown = sorted(set(manifest["files"]) - allowed)
    if unknown:
        raise ArtifactError(f"the manifest lists files this format does not have: {unknown}")
    if (spec.optimizer["type"] == "adamw") != (OPTIMIZER_MODEL in manifest["files"]):
        raise ArtifactError(f"{OPTIMIZER_MODEL} must be present exactly for the adamw optimizer")
    if (spec.replay is None) == (REPLAY_FILE in manifest["files"]):
        raise ArtifactError(f"the manifest's replay entry and the presence of {REPLAY_FILE} disagree")
    if (SGD_STATE_FILE in manifest["files"]) != ("sgd_state" in manifest):
        raise ArtifactError(f"the manifest's sgd_state entry and the presence of {SGD_STATE_FILE} disagree")
    if SGD_STATE_FILE in manifest["files"] and not spec.optimizer.get("momentum"):
        raise ArtifactError(f"the manifest lists {SGD_STATE_FILE} (SGD momentum buffers), but its optimizer keeps no momentum")
    graphs: dict[str, Signature] = {}
    for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, INFERENCE_MODEL):
        if name in manifest["files"]:
            data = read_verified(folder, manifest, name)
            check_no_external_data(data, name=name)
            graphs[name] = read_signature(data, name=name, ops={TRAINING_MODEL: TRAINING_OPS, OPTIMIZER_MODEL: (ADAMW_OP,)}.get(name, ()))
    if training_model is not None:
        data = training_model.read_bytes()
        check_no_external_data(data, name=str(training_model))
        graphs[TRAINING_MODEL] = read_signature(data, name=str(training_model), ops=TRAINING_OPS)
    info = read_checkpoint(read_verified(folder, manifest, CHECKPOINT), name=CHECKPOINT)
    check_agreement(spec, graphs, info)
    sgd_state = None
    if SGD_STATE_FILE in manifest["files"]:
        shapes = {name: info.trainable[name].dims for name in spec.trainable}
        bound = _NPZ_SLACK + sum(4 * math.prod(dims) + _NPZ_SLACK for dims in shapes.values())  # float32 buffers and their headers
        sgd_state = load_sgd_state(read_verified(folder, manifest, SGD_STATE_FILE, max_bytes=bound), spec, manifest, shapes)
    replay = None
    if spec.replay is not None:
        replay = NumpyReplay.from_bytes(read_verified(folder, manifest, REPLAY_FILE, max_bytes=MAX_REPLAY_BYTES + _NPZ_SLACK), spec.replay, spec)
    # everything is checked: only now does ONNX Runtime load the files
    guard = guard_from_manifest(manifest)
    session = OrtSession(folder, spec, sgd_state, training_model=training_model, session_options=session_options)
    return _Loaded(folder, manifest, spec, session, replay, guard)


class OrtOnlineLearner:
    """Keep personalising an exported model with ONNX Runtime training and replay; no torch.

    Build it with :meth:`from_artifacts`. Like :class:`~taste_cl.OnlineLearner`,
    :meth:`observe` trains ``train_iterations`` steps on the batch mixed with
    ``replay_batch_size`` buffered samples, then offers the batch to the reservoir. Inputs
    are numpy arrays (a dict of arrays for dict-input models); :meth:`predict` returns
    numpy outputs. Calls are serialised by a lock.

    Every step goes through :attr:`guard`, a :class:`~taste_cl.adapters.device.guard.DeviceUpdateGuard`
    that decides as the PyTorch learner's update guard does: a step that would leave a parameter
    non-finite or change the parameters far beyond the typical step is undone (parameters and
    optimizer state restored bit for bit) and reported as skipped. When the export's parity gate
    checked generated rows rather than the user's, the first :data:`~taste_cl.adapters.device.guard.GENERATED_ROWS_PROTECTED` steps
    are all measured. :meth:`predict` raises :class:`~taste_cl.exceptions.NonFiniteOutputError`
    rather than return NaN or infinite outputs, and ``observe`` scores no such outputs
    (its accuracy is NaN). A folder whose weights are not finite is refused at load.
    """

    def __init__(self, loaded: _Loaded) -> None:
        self.directory = loaded.folder
        self.manifest = loaded.manifest
        self.spec = loaded.spec
        self.session = loaded.session
        self.replay = loaded.replay
        self.replay_batch_size = loaded.spec.replay_batch_size
        self.train_iterations = loaded.spec.train_iterations
        self.num_classes = loaded.spec.num_classes
        self.classes = ClassSlots(loaded.spec.active_classes, loaded.spec.num_classes)  # reserved slots activate on first use
        self.samples_seen = loaded.spec.samples_seen
        self.steps = loaded.spec.steps
        self.tuner: Any = None  # a DeviceBatchTuner (taste_cl/adapters/device/tuning.py) once attached
        self.guard = self.session.guard = loaded.guard
        self._lock = threading.RLock()

    @classmethod
    def from_artifacts(cls, directory: str | os.PathLike[str], *, session_options: Any | None = None, tuner: Any | None = None) -> OrtOnlineLearner:
        """Load a folder written by ``export`` or :meth:`save`; everything is checked first (:class:`ArtifactError`).

        ``tuner``: a :class:`~taste_cl.adapters.device.tuning.DeviceBatchTuner` that tunes the training
        micro-batch (and threads) from the first ``observe`` on, resuming the folder's saved tuner state.
        """
        learner = cls(load(directory, session_options=session_options))
        if tuner is not None:
            tuner.attach(learner, learner.manifest.get("tuner"))
        return learner

    @property
    def lock(self) -> threading.RLock:
        """The lock every public call holds; hold it to act on the learner between two calls (a tune, a snapshot)."""
        return self._lock

    @property
    def lr(self) -> float:
        """The learning rate; set it to change it."""
        return self.session.lr

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`lr == {value!r}`, must be a finite number > 0")
        with self._lock:
            self.session.lr = float(value)

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current parameters, by their PyTorch names."""
        with self._lock:
            return self.session.parameters()

    def load_parameters(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite parameters by their PyTorch names (a fleet's aggregate, say); frozen ones too.

        Every array is checked first (a known name, the parameter's shape and dtype, finite
        values), so a bad one raises ``ValueError`` and changes nothing. Optimizer state and
        the buffer are kept.
        """
        with self._lock:
            current = self.session.parameters()
            by_torch_name = {torch_name: name for name, torch_name in self.spec.param_names.items()}
            for name, value in arrays.items():
                if name not in current:
                    raise ValueError(f"`{name}` is not a parameter of this model; its parameters are {sorted(current)}")
                value = np.asarray(value)
                want = current[name]
                if value.shape != want.shape or value.dtype != want.dtype:
                    raise ValueError(f"`{name}` must be {want.dtype} of shape {want.shape}; got {value.dtype} of shape {value.shape}")
                if not np.isfinite(value).all():
                    raise ValueError(f"`{name}` holds NaN or infinite values")
            for name, value in arrays.items():
                self.session.write_parameter(by_torch_name[name], np.asarray(value))

    def observe(self, batch: Any) -> ObserveStats:
        """Train on one batch ``(x, y)`` (or ``{"x": x, "y": y}``) mixed with replay, then buffer it."""
        with self._lock:
            raw_x, raw_y = split_batch(batch)
            x = features(raw_x, self.spec)
            y = targets(raw_y, self.spec, x[0].shape[0])
            self.classes.activate(y, self.spec.ignore_index)
            if self.tuner is not None:
                self.tuner.before_observe(x, y)
            start = time.perf_counter()
            n = y.shape[0]
            n_replay = min(self.replay_batch_size, len(self.replay)) if self.replay is not None else 0
            losses, steps, stream_outputs = [], 0, None
            for _ in range(self.train_iterations):
                train_x, train_y = x, y
                if n_replay:
                    assert self.replay is not None
                    replay_x, replay_y = self.replay.sample(n_replay)
                    train_x = [np.concatenate([a, b]) for a, b in zip(x, replay_x)]
                    train_y = np.concatenate([y, replay_y])
                step = self.session.train_step if self.tuner is None else self.tuner.step
                outputs, loss, skipped = step(train_x, train_y)
                stream_outputs = outputs[:n] if stream_outputs is None else stream_outputs
                steps += not skipped
                losses.append(loss)
            elapsed = time.perf_counter() - start
            if self.replay is not None:
                self.replay.add(x, y)
            self.samples_seen += n
            self.steps += 1
            if self.tuner is not None:
                self.tuner.after_observe((n + n_replay) * self.train_iterations, elapsed)
            accuracy = math.nan  # also when the outputs are not finite: no score from NaN
            scorable = stream_outputs is not None and bool(np.isfinite(stream_outputs).all())
            if self.num_classes is not None and scorable and not self.spec.labels.shape:
                assert stream_outputs is not None
                accuracy = float((self.classes.mask(stream_outputs).argmax(axis=1) == y).mean())
            return ObserveStats(
                loss=sum(losses) / len(losses),
                accuracy=accuracy,
                samples=n,
                replay_samples=n_replay * self.train_iterations,
                batch_size=n + n_replay,
                steps=steps,
                step_time_s=elapsed,
                skipped=steps < self.train_iterations,
                micro_batches=self.train_iterations * (1 if self.tuner is None else self.tuner.micro_batches(n + n_replay)),
            )

    def train_step(self, x: Any, y: Any) -> tuple[np.ndarray, float, bool]:
        """One optimizer step on ``(x, y)`` without replay or counters; returns (outputs, loss, skipped)."""
        with self._lock:
            inputs = features(x, self.spec)
            return self.session.train_step(inputs, targets(y, self.spec, inputs[0].shape[0]))

    def predict(self, x: Any) -> np.ndarray:
        """Outputs for ``x`` from the eval graph (reserved slots not yet in use: ``-inf``); changes no state.

        Raises :class:`~taste_cl.exceptions.NonFiniteOutputError` instead of returning NaN or
        infinite outputs (the masked reserved slots aside)."""
        with self._lock:
            outputs = self.session.predict(features(x, self.spec))
            check_finite_outputs(outputs, self.guard)
            return self.classes.mask(outputs)

    def export_inference_model(self, path: str | os.PathLike[str]) -> Path:
        """Atomically write an inference-only ONNX model with the current weights."""
        target = Path(path).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            try:
                self.session.module.export_model_for_inferencing(tmp_name, [OUTPUT_NAME])
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        return target

    def save(self, directory: str | os.PathLike[str], *, web: bool = True) -> Path:
        """Write weights, optimizer state and buffer as a new artifact folder that :meth:`from_artifacts` resumes.

        The folder is complete or absent (staged, then swapped into place); like an export it
        is made loadable by the browser learner where the model allows (the manifest's
        ``"web"``). ``web=False`` leaves the browser files out: faster, and it needs no
        ``onnx`` and no ONNX Runtime training API (which imports torch where it is installed).
        """
        with self._lock, staged_folder(directory) as stage:
            for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL):
                if name in self.manifest["files"]:
                    (stage / check_plain_name(name)).write_bytes(read_verified(self.directory, self.manifest, name))
            self.session.save(stage)
            manifest = {key: value for key, value in self.manifest.items() if key not in ("files", "sgd_state")}
            if self.session.sgd_state:
                manifest["sgd_state"] = self.session.sgd_order()
            if self.replay is not None:
                (stage / REPLAY_FILE).write_bytes(self.replay.to_bytes())
            manifest.update(
                optimizer={**self.manifest["optimizer"], "lr": self.lr},
                replay=self.replay.info() if self.replay is not None else None,
                counters={"samples_seen": self.samples_seen, "steps": self.steps},
                **self.classes.manifest(),
            )
            if self.tuner is not None:
                manifest["tuner"] = self.tuner.state_dict()
            manifest["guard"] = self.guard.state_dict()
            if not web:
                manifest["web"] = {"skipped": "saved with web=False"}
            write_manifest(stage, manifest)
            if web:
                add_web_artifacts(stage)
        return Path(directory).absolute()
