"""Make an ONNX Runtime artifact folder loadable by every ORT training client, the browser included.

:func:`make_web_compatible` post-processes a finished folder written by
:func:`taste_cl.adapters.onnxruntime.learner_export.export` (or ``OrtOnlineLearner.save``):

- **Declared shapes.** ``onnxblock``'s SGD graph declares its ``update_completed`` output
  ``[1]`` while the op infers a scalar. The Python runtime only warns and merges leniently;
  ``onnxruntime-web`` (and any build with strict inference) refuses to load it. The output is
  re-declared rank-0, then every graph is checked with onnx's strict shape inference *and*
  an ONNX Runtime session with ``session.strict_shape_type_inference`` on (onnx alone does
  not know the ``com.microsoft`` training ops).
- **Learning rate.** ORT clients start every optimizer at 0.001; only some can call
  ``set_learning_rate``, and a checkpoint's learning rate is not restored on load (only
  ``initial_lr`` and ``step`` are). So the checkpoint is rewritten with its optimizer state
  (``initial_lr`` = the exported rate, step, moments) and a ``taste_cl.learning_rate``
  property, and ``optimizer_model.web.onnx`` is written: the same optimizer with the exported
  rate as a constant, for clients that cannot set it (onnxruntime-web 1.19). A folder
  without an optimizer graph (plain SGD left to numpy on the device) gets onnxblock's SGD.
- **Replay buffer.** ``replay.npz`` is rewritten as ``replay.bin``: raw little-endian
  buffers (features float32, then labels int64) described by a JSON header in ``web.json``.
- **``web.json``** records what a client needs: file names and SHA-256, input and label
  names/dtypes/shapes, the logits and loss outputs, the learning rate, the batch plan, and
  the classes in use when output slots are reserved (``active_classes``, None: all).

Every value written is first checked as the device learner checks it, since the folder's
hashes prove nothing against whoever can write it: the manifest within the device's bounds
(:func:`~taste_cl.adapters.onnxruntime.manifest.parse_manifest`: a finite learning rate > 0,
bounded counts), ``num_classes`` the eval graph's output width, and the buffer as the device
reads it (finite features) with every label a class of the output; a value out of bounds is a
:class:`WebCompatibilityError` naming it, and nothing is written.

The manifest's SHA-256 table is refreshed to cover the rewritten and added files.

The ONNX Runtime exporter and ``OrtOnlineLearner.save`` call :func:`add_web_artifacts`
on every folder they write: it runs :func:`make_web_compatible` and records the outcome in
the manifest's ``"web"`` entry, ``{"manifest": "web.json"}`` or ``{"skipped": reason}`` for
a model the browser learner cannot train (it takes one float32 input and class labels, and
needs graphs that pass strict shape inference); the Python device learner works either way.

>>> from taste_cl.adapters.web.compat import make_web_compatible
>>> make_web_compatible("artifacts")  # doctest: +SKIP
PosixPath('artifacts/web.json')
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from taste_cl import __version__
from taste_cl.exceptions import ArtifactError, CheckpointError, MissingDependencyError, WebCompatibilityError

if TYPE_CHECKING:
    from taste_cl.adapters.onnxruntime.manifest import DeviceSpec

__all__ = [
    "WEB_FORMAT",
    "WEB_MANIFEST",
    "WEB_OPTIMIZER_MODEL",
    "WebCompatibilityError",
    "add_web_artifacts",
    "check_strict_shapes",
    "make_web_compatible",
]

WEB_FORMAT = 1
WEB_MANIFEST = "web.json"
WEB_OPTIMIZER_MODEL = "optimizer_model.web.onnx"
REPLAY_BINARY = "replay.bin"
LR_PROPERTY = "taste_cl.learning_rate"
_MANIFEST, _REPLAY_NPZ = "manifest.json", "replay.npz"
_TRAINING, _EVAL, _OPTIMIZER, _CHECKPOINT, _INFERENCE = (
    "training_model.onnx",
    "eval_model.onnx",
    "optimizer_model.onnx",
    "checkpoint",
    "inference_model.onnx",
)
_LR_INPUT = "learning_rate"
_FLAG_OUTPUT = "update_completed"  # onnxblock names it onnx::update_completed::N
_STRICT_CONFIG = "session.strict_shape_type_inference"


def _imports() -> tuple[Any, Any]:
    try:
        import onnx
        import onnxruntime
        import onnxruntime.training.api
    except ImportError as error:
        missing = "onnx" if (error.name or "").split(".")[0] == "onnx" else "onnxruntime-training-cpu"
        raise MissingDependencyError(missing, "onnx-training") from error
    onnxruntime.set_default_logger_severity(3)
    return onnx, onnxruntime


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _declare_flag_scalar(model: Any) -> None:
    """Re-declare the optimizer's ``update_completed`` output rank-0 (the op's inferred shape)."""
    for output in model.graph.output:
        if _FLAG_OUTPUT in output.name:
            output.type.tensor_type.shape.ClearField("dim")


def _optimizer_graph(folder: Path, config: dict[str, Any]) -> Any:
    """The folder's optimizer graph, its flag declared rank-0; built from ``config`` if the folder has none.

    An exporter may leave plain SGD to the Python device learner (no optimizer graph); the
    browser can only step through one, so plain SGD gets onnxblock's. SGD with momentum,
    weight decay or Nesterov has no ORT optimizer graph and is refused.
    """
    import onnx
    from onnxruntime.training import onnxblock

    if (folder / _OPTIMIZER).is_file():
        model = onnx.load(str(folder / _OPTIMIZER))
    elif (folder / WEB_OPTIMIZER_MODEL).is_file():  # built on an earlier run: reuse it (onnxblock's names vary)
        model = _without_constant_lr(onnx.load(str(folder / WEB_OPTIMIZER_MODEL)))
    else:
        extras = {key: config[key] for key in ("momentum", "weight_decay", "dampening", "nesterov") if config.get(key)}
        if config.get("type") != "sgd" or extras:
            raise WebCompatibilityError(
                f"no {_OPTIMIZER} and the optimizer is {config.get('type')!r} with {extras}: ONNX Runtime Web trains with plain SGD or AdamW only"
            )
        block = onnxblock.optim.SGD()
        with onnxblock.empty_base(opset_version=17):  # the graph only needs the parameters' dtype
            block(([onnx.helper.make_tensor("p", onnx.TensorProto.FLOAT, [1], [0.0])], []))
            model = block.to_model_proto()
    _declare_flag_scalar(model)
    return model


def _with_constant_lr(model: Any, lr: float) -> Any:
    """A copy of the optimizer graph that reads ``lr`` from an initializer, not its input.

    The ``learning_rate`` input stays declared (ORT checks the optimizer's input names) but
    nothing consumes it, so a client that never sets the rate trains at ``lr``.
    """
    import onnx
    from onnx import numpy_helper

    web = onnx.ModelProto()
    web.CopyFrom(model)
    declared = [i for i in web.graph.input if i.name == _LR_INPUT]
    if not declared:
        raise CheckpointError(f"{_OPTIMIZER} has no {_LR_INPUT!r} input; not an onnxblock optimizer graph")
    dims = [d.dim_value for d in declared[0].type.tensor_type.shape.dim]
    constant = f"taste_cl.{_LR_INPUT}"
    web.graph.initializer.append(numpy_helper.from_array(np.full(dims, lr, np.float32), constant))
    for node in web.graph.node:
        for index, name in enumerate(node.input):
            if name == _LR_INPUT:
                node.input[index] = constant
    return web


def _without_constant_lr(web: Any) -> Any:
    """Undo :func:`_with_constant_lr`: the optimizer graph reads its ``learning_rate`` input again."""
    constant = f"taste_cl.{_LR_INPUT}"
    kept = [init for init in web.graph.initializer if init.name != constant]
    del web.graph.initializer[:]
    web.graph.initializer.extend(kept)
    for node in web.graph.node:
        node.input[:] = [_LR_INPUT if name == constant else name for name in node.input]
    return web


def check_strict_shapes(path: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` unless ``path`` passes strict shape inference.

    Runs onnx's ``infer_shapes(strict_mode=True)`` and loads the graph in an ONNX Runtime
    session with strict shape/type inference, which is what clients without the lenient
    fallback (onnxruntime-web) do.
    """
    onnx, ort = _imports()
    file = Path(path)
    try:
        onnx.shape_inference.infer_shapes(onnx.load(str(file)), check_type=True, strict_mode=True)
        options = ort.SessionOptions()
        options.add_session_config_entry(_STRICT_CONFIG, "1")
        ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnx and ORT raise their own unrelated exception types
        raise CheckpointError(f"{file.name} fails strict shape inference, so strict ORT clients reject it: {error}") from error


def _rewrite_checkpoint(staging: Path, folder: Path, lr: float) -> None:
    """Save the checkpoint with its optimizer state, ``initial_lr = lr`` and the LR as a property."""
    from onnxruntime.capi import _pybind_state
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(str(folder / _CHECKPOINT))
    module = Module(str(folder / _TRAINING), state, str(folder / _EVAL))
    graph = staging / (_OPTIMIZER if (staging / _OPTIMIZER).is_file() else WEB_OPTIMIZER_MODEL)
    optimizer = Optimizer(str(graph), module)
    # the binding's scheduler is the one call that sets initial_lr, which checkpoints keep
    _pybind_state.LinearLRScheduler(optimizer._optimizer, 0, 1, lr)
    optimizer.set_learning_rate(lr)
    state.properties[LR_PROPERTY] = lr
    CheckpointState.save_checkpoint(state, str(staging / _CHECKPOINT), include_optimizer_state=True)


def _write_replay(staging: Path, folder: Path, manifest: dict[str, Any], spec: DeviceSpec) -> dict[str, Any] | None:
    """Write the buffer as raw little-endian ``x`` (float32), then ``y`` (int64) 8-byte aligned; return its header.

    ``replay.npz`` is read as the device reads it (bounded, finite features), with no ignored
    label: the browser trains on every one, so each must be a class of the output.
    """
    from taste_cl.adapters.device.artifacts import read_verified
    from taste_cl.adapters.onnxruntime.replay import NumpyReplay

    if spec.replay is None:
        return None
    try:
        replay = NumpyReplay.from_bytes(read_verified(folder, manifest, _REPLAY_NPZ), spec.replay, dataclasses.replace(spec, ignore_index=None))
    except ArtifactError as error:
        raise WebCompatibilityError(str(error)) from None
    (features,), labels = replay.rows(replay.size)
    x, y = np.ascontiguousarray(features, dtype="<f4"), np.ascontiguousarray(labels, dtype="<i8")
    size = replay.size
    x_bytes, y_bytes = x.tobytes() if size else b"", y.tobytes()
    y_offset = -(-len(x_bytes) // 8) * 8  # int64 views (JS BigInt64Array) need 8-byte alignment
    (staging / REPLAY_BINARY).write_bytes(x_bytes + bytes(y_offset - len(x_bytes)) + y_bytes)
    feature_shape = list(x.shape[1:]) if size else []
    return {
        "file": REPLAY_BINARY,
        "byte_order": "little",
        "size": size,
        **{key: spec.replay[key] for key in ("capacity", "seen", "seed")},
        "arrays": {
            "x": {"dtype": "float32", "shape": [size, *feature_shape], "offset": 0, "nbytes": len(x_bytes)},
            "y": {"dtype": "int64", "shape": [size], "offset": y_offset, "nbytes": len(y_bytes)},
        },
    }


def _loss_output(eval_model: Any, logits: str) -> str:
    names = [output.name for output in eval_model.graph.output if output.name != logits]
    if len(names) != 1:
        raise CheckpointError(f"{_EVAL} should have one loss output beside {logits!r}; got {names}")
    return names[0]


def _device_spec(manifest: dict[str, Any]) -> DeviceSpec:
    """The manifest within the device learner's bounds; a value out of them is a :class:`WebCompatibilityError` naming it."""
    from taste_cl.adapters.onnxruntime.manifest import parse_manifest  # that module imports this one

    try:
        return parse_manifest(manifest)
    except ArtifactError as error:
        raise WebCompatibilityError(f"{_MANIFEST}: {error}") from None


def _check_output_width(evaluation: Any, spec: DeviceSpec) -> None:
    """Refuse a ``num_classes`` that is not the eval graph's output width (the browser sizes its labels by it)."""
    declared = [output for output in evaluation.graph.output if output.name == spec.output.name]
    width = [dim.dim_value for dim in declared[0].type.tensor_type.shape.dim[1:]] if declared else None
    if width != [spec.num_classes]:
        raise WebCompatibilityError(
            f"{_MANIFEST}: `num_classes == {spec.num_classes}`, must be the output width of {_EVAL}'s {spec.output.name!r}, {width}"
        )


def _web_manifest(
    folder: Path, staging: Path, evaluation: Any, spec: DeviceSpec, manifest: dict[str, Any], replay: dict[str, Any] | None
) -> dict[str, Any]:
    graph_inputs = [i.name for i in evaluation.graph.input]
    named = [item.name for item in spec.inputs] + [spec.labels.name]
    if any(name not in graph_inputs for name in named):
        raise CheckpointError(f"{_EVAL} inputs {graph_inputs} do not match the manifest's input and labels names {named}")
    files = [_TRAINING, _EVAL, WEB_OPTIMIZER_MODEL, _CHECKPOINT, _INFERENCE] + ([REPLAY_BINARY] if replay else [])
    digests = {name: _sha256((staging if (staging / name).exists() else folder) / name) for name in files}
    return {
        "format": WEB_FORMAT,
        "producer": f"taste_cl {__version__}",
        "models": {
            "training": _TRAINING,
            "eval": _EVAL,
            "optimizer": WEB_OPTIMIZER_MODEL,
            "checkpoint": _CHECKPOINT,
            "inference": _INFERENCE,
        },
        "inputs": [item.as_json() for item in spec.inputs],
        "labels": spec.labels.as_json(),
        "outputs": {
            "logits": spec.output.name,
            "loss": _loss_output(evaluation, spec.output.name),
        },
        "num_classes": spec.num_classes,
        # reserved slots not yet in use are masked (device/class_slots.py)
        "active_classes": None if spec.active_classes is None else list(spec.active_classes),
        "optimizer": {**spec.optimizer, "lr_in_graph": True},
        "batch_plan": {
            "batch_size": manifest.get("batch_size"),  # bounded by parse_manifest
            "replay_batch_size": spec.replay_batch_size,
            "train_iterations": spec.train_iterations,
        },
        "trainable": list(spec.trainable),
        "counters": {"samples_seen": spec.samples_seen, "steps": spec.steps},
        "replay": replay,
        "files": digests,
    }


def _check_browser_trainable(manifest: dict[str, Any]) -> None:
    """Raise :class:`WebCompatibilityError` for what the browser learner (``web/taste_cl_web.js``) cannot train."""
    inputs = manifest.get("inputs") or []
    labels = manifest.get("labels") or {}
    if len(inputs) != 1 or inputs[0].get("dtype") != "float32":
        got = ", ".join(f"{spec.get('name')}: {spec.get('dtype')}" for spec in inputs)
        raise WebCompatibilityError(f"the browser learner takes one float32 input; this model takes [{got}]")
    if labels.get("dtype") != "int64" or labels.get("shape") not in ([], ["batch"], None) or manifest.get("num_classes") is None:
        task = (manifest.get("task") or {}).get("name", "these targets")
        raise WebCompatibilityError(
            f"the browser learner trains with one class label per sample; {task} has {labels.get('dtype')} targets of shape {labels.get('shape')}"
        )
    if manifest.get("running_stats"):
        raise WebCompatibilityError(
            "batchnorm='batch' writes BatchNorm running statistics back after each step, which the browser learner "
            "does not; export with batchnorm='frozen'"
        )


def add_web_artifacts(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Make ``folder`` web-compatible, or record why not; return the manifest's new ``"web"`` entry.

    A :class:`WebCompatibilityError` (an optimizer, input, target or graph the browser cannot
    run), or a device without ONNX Runtime's Python training API, is recorded as
    ``{"skipped": reason}`` with the folder otherwise unchanged; a damaged folder still
    raises :class:`~taste_cl.CheckpointError`.
    """
    from taste_cl.adapters.device.artifacts import read_manifest, write_manifest

    target = Path(folder)
    try:
        make_web_compatible(target)
        entry: dict[str, Any] = {"manifest": WEB_MANIFEST}
    except (WebCompatibilityError, MissingDependencyError) as error:
        entry = {"skipped": str(error)}
    manifest = {key: value for key, value in read_manifest(target).items() if key != "files"}
    write_manifest(target, {**manifest, "web": entry})
    return entry


def make_web_compatible(folder: str | os.PathLike[str]) -> Path:
    """Fix and extend the artifact ``folder`` in place for every ORT client; return ``web.json``'s path.

    Idempotent. New files are built in a temporary folder and moved in only once all are
    built and the graphs pass :func:`check_strict_shapes`, the manifest last; on any error
    the folder is left as it was. Raises :class:`WebCompatibilityError` for an optimizer,
    inputs or targets the browser learner cannot train, a value out of the device's bounds
    (named in the message) or a graph failing strict shape inference, and
    :class:`~taste_cl.CheckpointError` for a damaged folder.
    """
    onnx, _ = _imports()
    from taste_cl.adapters.device.artifacts import read_manifest  # verifies every file's SHA-256

    target = Path(folder)
    manifest = read_manifest(target)
    spec = _device_spec(manifest)
    _check_browser_trainable(manifest)
    evaluation = onnx.load(str(target / _EVAL), load_external_data=False)
    _check_output_width(evaluation, spec)
    lr = spec.optimizer["lr"]
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.web.", dir=target.absolute().parent))
    try:
        optimizer = _optimizer_graph(target, spec.optimizer)
        if (target / _OPTIMIZER).is_file():
            onnx.save(optimizer, str(staging / _OPTIMIZER))
        onnx.save(_with_constant_lr(optimizer, lr), str(staging / WEB_OPTIMIZER_MODEL))
        try:
            for path in [*(target / name for name in (_TRAINING, _EVAL, _INFERENCE)), *staging.glob("*.onnx")]:
                check_strict_shapes(path)
        except CheckpointError as error:
            raise WebCompatibilityError(str(error)) from error
        _rewrite_checkpoint(staging, target, lr)
        replay = _write_replay(staging, target, manifest, spec)
        web = _web_manifest(target, staging, evaluation, spec, manifest, replay)
        (staging / WEB_MANIFEST).write_text(json.dumps(web, indent=2, sort_keys=True) + "\n")
        files = {path.name for path in target.iterdir()} | {path.name for path in staging.iterdir()}
        files.discard(_MANIFEST)
        digests = {name: _sha256((staging if (staging / name).exists() else target) / name) for name in sorted(files)}
        (staging / _MANIFEST).write_text(json.dumps({**manifest, "files": digests}, indent=2, sort_keys=True) + "\n")
        for path in sorted(staging.iterdir(), key=lambda p: p.name == _MANIFEST):  # manifest last
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / WEB_MANIFEST
