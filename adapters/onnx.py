"""ONNX Runtime on-device training: export a learner, keep it learning without PyTorch autograd.

:func:`export` turns an :class:`~taste_cl.OnlineLearner` into ONNX Runtime training
artifacts (``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx``,
``checkpoint``), an ``inference_model.onnx``, the replay buffer (``replay.npz``) and a
``manifest.json`` holding the input/output names and shapes, the optimizer settings, the
trainable/frozen split and the SHA-256 of every file. :class:`OrtOnlineLearner` loads
that folder with ``onnxruntime.training.api`` and offers ``observe``/``predict``/``save``
like the PyTorch learner, rehearsing the exported buffer.

Needs the ``[onnx]`` extra (``onnx==1.17.0``, ``onnxruntime-training-cpu==1.19.2``).

>>> import torch
>>> from taste_cl.demo import build_digits_learner
>>> from taste_cl.adapters.onnx import OrtOnlineLearner, export
>>> learner = build_digits_learner()
>>> _ = learner.observe((torch.rand(10, 64), torch.randint(0, 10, (10,))))
>>> path = export(learner, "artifacts")  # doctest: +SKIP
>>> device = OrtOnlineLearner.from_artifacts("artifacts")  # doctest: +SKIP
>>> stats = device.observe((torch.rand(10, 64).numpy(), torch.randint(0, 10, (10,)).numpy()))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl import __version__
from taste_cl._batch import split_batch, to_features, to_labels
from taste_cl.exceptions import CheckpointError, MissingDependencyError, TasteCLError
from taste_cl.learner import ObserveStats, OnlineLearner
from taste_cl.replay import ReplayStrategy, ReservoirReplay

__all__ = [
    "ARTIFACT_FILES",
    "MANIFEST_FILE",
    "OrtOnlineLearner",
    "UnsupportedOperatorError",
    "export",
    "read_manifest",
]

ARTIFACT_FORMAT = 1
MANIFEST_FILE = "manifest.json"
REPLAY_FILE = "replay.npz"
TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT = (
    "training_model.onnx",
    "eval_model.onnx",
    "optimizer_model.onnx",
    "checkpoint",
)
INFERENCE_MODEL = "inference_model.onnx"
ARTIFACT_FILES = (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT, INFERENCE_MODEL)
INPUT_NAME, LABEL_NAME, OUTPUT_NAME = "input", "labels", "logits"
OPTIMIZERS = ("sgd", "adamw")
# Ops ONNX Runtime 1.19 has no gradient for (checked on this release).
NON_DIFFERENTIABLE_OPS = frozenset({"HardSwish", "HardSigmoid", "Einsum"})
_TORCH_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


class UnsupportedOperatorError(TasteCLError, ValueError):
    """The model uses an operator ONNX Runtime cannot differentiate, so it cannot train on device."""


def _ort() -> Any:
    """Import ``onnx`` and ``onnxruntime.training`` lazily, with an install hint when missing."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
        import onnxruntime.training.api  # noqa: F401
        from onnxruntime.training import artifacts, onnxblock  # noqa: F401
    except ImportError as error:
        missing = "onnx" if (error.name or "").split(".")[0] == "onnx" else "onnxruntime-training-cpu"
        raise MissingDependencyError(missing, "onnx") from error
    onnxruntime.set_default_logger_severity(3)  # artifact generation logs every graph pass at INFO
    return onnxruntime


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _publish(staging: Path, target: Path) -> None:
    """Move a completed ``staging`` folder to ``target``, replacing an earlier artifact folder."""
    if not target.exists():
        os.replace(staging, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.replace(target, backup / target.name)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(backup / target.name, target)  # put the earlier folder back
        raise
    finally:
        shutil.rmtree(backup)


def _staging_dir(target: Path) -> Path:
    """A fresh temporary folder next to ``target`` (same file system, so the final move is atomic)."""
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"`directory == {str(target)!r}` is a file, must be a folder")
        if any(target.iterdir()) and not (target / MANIFEST_FILE).is_file():
            raise ValueError(
                f"`directory == {str(target)!r}` is a non-empty folder without {MANIFEST_FILE}; "
                "give a new or empty folder (or an earlier artifact folder to replace)"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))


def _write_atomically(directory: str | os.PathLike[str], fill: Any) -> Path:
    """Call ``fill(staging)`` on a temporary folder and publish it as ``directory`` only if it succeeds."""
    target = Path(directory).absolute()
    staging = _staging_dir(target)
    try:
        fill(staging)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# ------------------------------------------------------------------ export
def _optimizer_config(learner: OnlineLearner, optimizer: str | None, lr: float | None) -> dict[str, Any]:
    torch_optimizer = learner.optimizer
    kind = optimizer
    if kind is None:
        kinds = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw"}
        kind = kinds.get(type(torch_optimizer))  # type: ignore[call-overload]
        if kind is None:
            raise ValueError(
                f"learner uses {type(torch_optimizer).__name__}, which ONNX Runtime does not train with; "
                f"pass optimizer= one of {OPTIMIZERS}"
            )
    if kind not in OPTIMIZERS:
        raise ValueError(f"`optimizer == {kind!r}`, must be one of {OPTIMIZERS}")
    group = torch_optimizer.param_groups[0]
    rate = float(group["lr"]) if lr is None else lr
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"`lr == {rate!r}`, must be a finite number > 0")
    config: dict[str, Any] = {"type": kind, "lr": float(rate)}
    if kind == "sgd" and isinstance(torch_optimizer, torch.optim.SGD):
        extras = {key: group[key] for key in ("momentum", "weight_decay", "dampening") if group.get(key)}
        if extras or group.get("nesterov"):
            raise ValueError(
                f"ONNX Runtime's SGD is plain SGD; the learner's SGD has {extras or {'nesterov': True}}: "
                "use optimizer='adamw' or a plain SGD"
            )
    if kind == "adamw":
        source = group if isinstance(torch_optimizer, torch.optim.AdamW) else _TORCH_ADAMW_DEFAULTS
        config.update(
            betas=[float(b) for b in source["betas"]], eps=float(source["eps"]), weight_decay=float(source["weight_decay"])
        )
    return config


def _trainable_names(model: torch.nn.Module, trainable: Sequence[str] | None) -> list[str]:
    names = [name for name, _ in model.named_parameters()]
    if trainable is None:
        chosen = [name for name, p in model.named_parameters() if p.requires_grad]
    else:
        if isinstance(trainable, str):
            raise TypeError(f"trainable must be a sequence of parameter names, not a str; got {trainable!r}")
        chosen = list(trainable)
        unknown = [name for name in chosen if name not in names]
        if unknown:
            raise ValueError(f"`trainable` names unknown parameters {unknown}; the model has {names}")
    if not chosen:
        raise ValueError("no trainable parameters: set requires_grad on some parameters or pass trainable=[...]")
    return chosen


def _to_onnx(model: torch.nn.Module, input_shape: tuple[int, ...], opset: int) -> Any:
    """Export ``model`` with the legacy exporter in training mode, batch axis dynamic.

    Raises :class:`UnsupportedOperatorError` naming any op ORT cannot differentiate.
    """
    import onnx

    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the legacy exporter is deprecated but is what ORT 1.19 training needs
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (torch.zeros((2, *input_shape)),),
            buffer,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            export_params=True,
            dynamo=False,
        )
    graph = onnx.load_from_string(buffer.getvalue())
    found = sorted({node.op_type for node in graph.graph.node} & NON_DIFFERENTIABLE_OPS)
    if found:
        raise UnsupportedOperatorError(
            f"model uses {found}, which ONNX Runtime cannot differentiate, so it cannot train on device; "
            "replace them (e.g. nn.Hardswish by x * relu6(x + 3) / 6) or freeze those layers out of the model"
        )
    return graph


def _optimizer_block(config: dict[str, Any]) -> Any:
    from onnxruntime.training import onnxblock

    if config["type"] == "sgd":
        return onnxblock.optim.SGD()
    return onnxblock.optim.AdamW(
        betas=tuple(config["betas"]), eps=config["eps"], weight_decay=config["weight_decay"]
    )


def _save_replay(path: Path, replay: ReplayStrategy) -> dict[str, Any]:
    """Write the buffer contents as plain arrays (``np.load(allow_pickle=False)`` reads them)."""
    state = replay.state_dict()
    storage = state.get("storage")
    if not isinstance(storage, dict) or "size" not in storage:
        raise ValueError(
            f"cannot export a {type(replay).__name__} buffer: its state_dict() has no 'storage' "
            "(a BufferStorage state); pass include_replay=False"
        )
    size = int(storage["size"])
    seen = state.get("seen")
    arrays = {
        "x": storage["x"].cpu().numpy() if size else np.zeros((0,), np.float32),
        "y": storage["y"].cpu().numpy() if size else np.zeros((0,), np.int64),
        "capacity": np.int64(replay.capacity),
        "seed": np.int64(int(state.get("seed", 0))),
        # a non-reservoir strategy keeps class-wise counts: on device it continues as a reservoir
        "seen": np.int64(seen if isinstance(seen, int) else size),
    }
    if isinstance(replay, ReservoirReplay):
        arrays["generator"] = state["generator"].numpy()
    np.savez(path, **arrays)
    return {"file": REPLAY_FILE, "strategy": type(replay).__name__, "capacity": replay.capacity, "size": size}


def export(
    learner: OnlineLearner,
    directory: str | os.PathLike[str],
    *,
    trainable: Sequence[str] | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    batch_size: int | None = None,
    include_replay: bool = True,
    opset: int = 17,
) -> Path:
    """Write ONNX Runtime training artifacts, an inference model, the buffer and a manifest.

    ``trainable`` defaults to the parameters with ``requires_grad`` (so an elastic or
    last-layers-only selection exports as is); everything else becomes frozen.
    ``optimizer`` (``"sgd"`` or ``"adamw"``) and ``lr`` default to the learner's own;
    ``batch_size`` (default: the tuned micro-batch, if a tuner set one) is recorded in the manifest.
    Files are written to a temporary folder and moved to ``directory`` only when all
    are complete. Returns the folder.
    """
    _ort()
    if not isinstance(learner, OnlineLearner):
        raise TypeError(f"learner must be a taste_cl.OnlineLearner; got {type(learner).__name__}")
    if learner.input_shape is None or learner.num_classes is None:
        raise ValueError("learner has not observed a batch yet, so its input shape is unknown; call observe() first")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"`batch_size == {batch_size!r}`, must be None or an int >= 1")
    config = _optimizer_config(learner, optimizer, lr)
    with learner._lock:
        model = copy.deepcopy(learner.model).cpu().float()
        replay = copy.deepcopy(learner.replay) if include_replay else None
        counters = {"samples_seen": learner.samples_seen, "steps": learner.steps}
        if batch_size is None and learner.batch_plan is not None:
            batch_size = learner.batch_plan.micro_batch_size  # the tuner's choice
    chosen = _trainable_names(model, trainable)
    graph = _to_onnx(model, learner.input_shape, opset)
    initializers = [init.name for init in graph.graph.initializer]
    missing = [name for name in chosen if name not in initializers]
    if missing:
        raise ValueError(f"trainable parameters {missing} do not appear in the exported graph (unused or tied?)")
    frozen = [name for name in initializers if name not in chosen]

    def fill(staging: Path) -> None:
        from onnxruntime.training import artifacts

        try:
            artifacts.generate_artifacts(
                graph,
                requires_grad=chosen,
                frozen_params=frozen,
                loss=artifacts.LossType.CrossEntropyLoss,
                optimizer=_optimizer_block(config),
                artifact_directory=staging,
                additional_output_names=[OUTPUT_NAME],
            )
        except Exception as error:  # ORT reports a missing gradient as a bare RuntimeError
            raise UnsupportedOperatorError(f"ONNX Runtime could not build the training graph: {error}") from error
        _export_inference(staging, staging / INFERENCE_MODEL)
        replay_info = None
        if replay is not None:
            replay_info = _save_replay(staging / REPLAY_FILE, replay)
        manifest = {
            "format": ARTIFACT_FORMAT,
            "producer": f"taste_cl {__version__}",
            "opset": opset,
            "input": {"name": INPUT_NAME, "shape": ["batch", *learner.input_shape], "dtype": "float32"},
            "labels": {"name": LABEL_NAME, "shape": ["batch"], "dtype": "int64"},
            "output": {"name": OUTPUT_NAME, "shape": ["batch", learner.num_classes], "dtype": "float32"},
            "dynamic_axes": {INPUT_NAME: [0], LABEL_NAME: [0], OUTPUT_NAME: [0]},
            "num_classes": learner.num_classes,
            "optimizer": config,
            "batch_size": batch_size,
            "replay_batch_size": learner.replay_batch_size,
            "train_iterations": learner.train_iterations,
            "trainable": chosen,
            "frozen": frozen,
            "replay": replay_info,
            "counters": counters,
        }
        _write_manifest(staging, manifest)

    return _write_atomically(directory, fill)


def _export_inference(folder: Path, target: Path) -> None:
    """Write the inference graph with the weights of the checkpoint in ``folder``."""
    from onnxruntime.training.api import CheckpointState, Module

    state = CheckpointState.load_checkpoint(str(folder / CHECKPOINT))
    module = Module(str(folder / TRAINING_MODEL), state, str(folder / EVAL_MODEL))
    module.export_model_for_inferencing(str(target), [OUTPUT_NAME])


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Hash every file of ``folder`` into the manifest and write it."""
    files = sorted(path.name for path in folder.iterdir() if path.name != MANIFEST_FILE)
    manifest = {**manifest, "files": {name: _sha256(folder / name) for name in files}}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``manifest.json`` and check every listed file exists with its recorded SHA-256."""
    folder = Path(directory)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"no {MANIFEST_FILE} in {str(folder)!r}: not a taste_cl artifact folder")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{str(path)!r} has format {got!r}; this taste_cl reads format {ARTIFACT_FORMAT}")
    files = manifest.get("files", {})
    for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT):
        if name not in files:
            raise CheckpointError(f"{str(path)!r} does not list the required artifact {name!r}")
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"artifact file {name!r} is missing from {str(folder)!r}")
        if _sha256(file) != digest:
            raise CheckpointError(f"artifact file {name!r} in {str(folder)!r} is corrupt or was modified: SHA-256 mismatch")
    return manifest


def _load_replay(path: Path) -> ReservoirReplay:
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    replay = ReservoirReplay(int(arrays["capacity"]), seed=int(arrays["seed"]))
    size = int(arrays["y"].shape[0])
    storage: dict[str, Any] = {"capacity": replay.capacity, "size": size}
    if size:
        storage.update(x=torch.from_numpy(arrays["x"]), y=torch.from_numpy(arrays["y"]).long())
    if "generator" in arrays:
        generator = torch.from_numpy(arrays["generator"])
    else:  # exported from another strategy: start the reservoir's random stream from its seed
        generator = torch.Generator().manual_seed(replay.seed).get_state()
    replay.load_state_dict(
        {"capacity": replay.capacity, "storage": storage, "generator": generator, "seen": int(arrays["seen"])}
    )
    return replay


# --------------------------------------------------------- on-device learner
class OrtOnlineLearner:
    """Keep personalising an exported model with ONNX Runtime training, with replay.

    Build it with :meth:`from_artifacts`. Like :class:`~taste_cl.OnlineLearner`,
    :meth:`observe` scores a batch (test-then-train), trains ``train_iterations`` steps on
    it mixed with ``replay_batch_size`` buffered samples, and offers it to the reservoir.
    It has no stability-plasticity monitor or plugins. Inputs may be numpy arrays or
    tensors; :meth:`predict` returns numpy logits.
    """

    def __init__(
        self,
        *,
        directory: Path,
        manifest: dict[str, Any],
        state: Any,
        module: Any,
        optimizer: Any,
        replay: ReservoirReplay | None,
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self.state = state
        self.module = module
        self.optimizer = optimizer
        self.replay = replay
        self.input_shape = tuple(int(d) for d in manifest["input"]["shape"][1:])
        self.num_classes = int(manifest["num_classes"])
        self.replay_batch_size = int(manifest["replay_batch_size"])
        self.train_iterations = int(manifest["train_iterations"])
        self.trainable = list(manifest["trainable"])
        self.samples_seen = int(manifest["counters"]["samples_seen"])
        self.steps = int(manifest["counters"]["steps"])
        self._logits_index = list(module.output_names()).index(OUTPUT_NAME)
        self._lock = threading.RLock()

    @classmethod
    def from_artifacts(
        cls, directory: str | os.PathLike[str], *, session_options: Any | None = None
    ) -> OrtOnlineLearner:
        """Load a folder written by :func:`export` or :meth:`save`, verifying every file's SHA-256."""
        _ort()
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        folder = Path(directory)
        manifest = read_manifest(folder)
        try:
            state = CheckpointState.load_checkpoint(str(folder / CHECKPOINT))
            module = Module(
                str(folder / TRAINING_MODEL), state, str(folder / EVAL_MODEL), session_options=session_options
            )
            optimizer = Optimizer(str(folder / OPTIMIZER_MODEL), module)
        except RuntimeError as error:
            raise CheckpointError(f"ONNX Runtime could not load the artifacts in {str(folder)!r}: {error}") from error
        optimizer.set_learning_rate(float(manifest["optimizer"]["lr"]))
        replay_info = manifest.get("replay")
        replay = _load_replay(folder / replay_info["file"]) if replay_info else None
        return cls(directory=folder, manifest=manifest, state=state, module=module, optimizer=optimizer, replay=replay)

    @property
    def lr(self) -> float:
        """The learning rate; set it to change it (drives ``Optimizer.set_learning_rate``)."""
        return float(self.optimizer.get_learning_rate())

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`lr == {value!r}`, must be a finite number > 0")
        self.optimizer.set_learning_rate(float(value))

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current trainable and frozen parameters, by their PyTorch names."""
        with self._lock:
            return {name: np.array(parameter.data) for name, parameter in self.state.parameters}

    # -------------------------------------------------------------- learning
    def observe(self, batch: Any) -> ObserveStats:
        """Test-then-train on one batch ``(x, y)`` or ``{"x": x, "y": y}`` (numpy or torch)."""
        with self._lock:
            x, y = self._validate(batch)
            start = time.perf_counter()
            n_replay = min(self.replay_batch_size, len(self.replay)) if self.replay is not None else 0
            steps, losses = 0, []
            for iteration in range(self.train_iterations):
                train_x, train_y = x, y
                if n_replay:
                    assert self.replay is not None
                    replay_x, replay_y = self.replay.sample(n_replay)
                    train_x, train_y = torch.cat([x, replay_x]), torch.cat([y, replay_y])
                logits, loss, skipped = self.train_step(train_x.numpy(), train_y.numpy())
                if iteration == 0:
                    stream_logits = logits[: x.shape[0]]
                steps += not skipped
                losses.append(loss)
            elapsed = time.perf_counter() - start
            if self.replay is not None:
                self.replay.add(x, y)
            self.samples_seen += x.shape[0]
            self.steps += 1
            return ObserveStats(
                loss=sum(losses) / len(losses),
                accuracy=float((stream_logits.argmax(axis=1) == y.numpy()).mean()),
                samples=x.shape[0],
                replay_samples=n_replay * self.train_iterations,
                batch_size=x.shape[0] + n_replay,
                micro_batches=self.train_iterations,
                steps=steps,
                step_time_s=elapsed,
                skipped=steps < self.train_iterations,
            )

    def train_step(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, bool]:
        """One optimizer step on float32 ``x`` and int64 ``y``; return (logits, loss, skipped).

        A non-finite loss or gradient skips the update, as in the PyTorch learner.
        """
        with self._lock:
            self.module.train()
            outputs = self.module(x, y)
            loss = float(outputs[0])
            skipped = not math.isfinite(loss) or not all(
                np.isfinite(self.state.parameters[name].grad).all() for name in self.trainable
            )
            if not skipped:
                self.optimizer.step()
            self.module.lazy_reset_grad()
            return outputs[self._logits_index], loss, skipped

    def predict(self, x: Any) -> np.ndarray:
        """Logits for ``x`` with the eval graph; changes no state."""
        with self._lock:
            features = to_features(x, feature_shape=self.input_shape, dtype=torch.float32, device=torch.device("cpu"))
            self.module.eval()
            try:
                labels = np.zeros(features.shape[0], dtype=np.int64)  # the eval graph computes a loss too
                return self.module(features.numpy(), labels)[self._logits_index]
            finally:
                self.module.train()

    def _validate(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raw_x, raw_y = split_batch(batch)
        x = to_features(raw_x, feature_shape=self.input_shape, dtype=torch.float32, device=torch.device("cpu"))
        y = to_labels(raw_y, n=x.shape[0], num_classes=self.num_classes, device=torch.device("cpu"))
        return x, y

    # ------------------------------------------------------------- persisting
    def export_inference_model(self, path: str | os.PathLike[str]) -> Path:
        """Atomically write an inference-only ONNX model with the current weights."""
        target = Path(path).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            os.close(fd)
            try:
                self.module.export_model_for_inferencing(tmp_name, [OUTPUT_NAME])
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        return target

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the current weights, optimizer state and buffer as a new artifact folder.

        The folder is complete or absent (staged, then moved); :meth:`from_artifacts` resumes it.
        """
        from onnxruntime.training.api import CheckpointState

        def fill(staging: Path) -> None:
            for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL):
                data = (self.directory / name).read_bytes()
                if hashlib.sha256(data).hexdigest() != self.manifest["files"][name]:
                    raise CheckpointError(f"artifact file {name!r} in {str(self.directory)!r} changed since it was loaded")
                (staging / name).write_bytes(data)
            CheckpointState.save_checkpoint(self.state, str(staging / CHECKPOINT), include_optimizer_state=True)
            self.module.export_model_for_inferencing(str(staging / INFERENCE_MODEL), [OUTPUT_NAME])
            replay_info = None
            if self.replay is not None:
                replay_info = _save_replay(staging / REPLAY_FILE, self.replay)
            manifest = {key: value for key, value in self.manifest.items() if key != "files"}
            manifest.update(
                optimizer={**self.manifest["optimizer"], "lr": self.lr},
                replay=replay_info,
                counters={"samples_seen": self.samples_seen, "steps": self.steps},
            )
            _write_manifest(staging, manifest)

        with self._lock:
            return _write_atomically(directory, fill)
