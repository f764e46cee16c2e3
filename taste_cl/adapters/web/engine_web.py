"""An ONNX engine learner folder as what the browser learner (``web/taste_cl_engine.js``) trains on current onnxruntime-web.

:func:`export_web` reads a folder written by ``learner.export(folder, backend="onnx_engine")`` (or saved
by :class:`~taste_cl.adapters.onnx_engine.learner.OnnxEngineLearner`), loads it as the Python device
learner does (:func:`~taste_cl.adapters.device.loader.load_learner`: every hash, setting, shape and array
is checked first, so a tampered or out-of-bounds folder is refused before anything is written) and
writes a new folder:

- ``forward.onnx``, ``backward.onnx``, ``optimizer.onnx``: the engine's graphs, byte for byte;
- ``parameters.bin`` and ``optimizer_state.bin``: the trainable tensors and the optimizer state
  (``step`` first) as raw little-endian float32, one tensor after another (npz is awkward in JS);
- ``replay.bin``: the buffer's rows, float32 features then int32 labels (when the learner has a buffer);
- ``web.json``: format, the SHA-256 and byte size of every file, the input's name and shape, the
  graphs' batch size, each tensor's name, shape and offset, the optimizer, the loop's settings (lr,
  replay, batch plan, clipping, seed), the device update guard's settings and history
  (:mod:`taste_cl.guards.device`), the counters, and what the export left out on request (``dropped``).

What the browser's JS loop runs: plain experience replay over a reservoir (or no buffer), the batch
plan (``replay_batch_size`` rows replayed in each of ``train_iterations`` steps), mean cross-entropy
(:func:`taste_cl.engine.losses.experience_replay`), clipping by total norm, the optimizer graph, and
the device update guard (a non-finite loss or gradient skipped; a step measured when it may be unusual
and undone when :mod:`taste_cl.guards.size_rule` refuses it). Refused with
:class:`~taste_cl.exceptions.WebCompatibilityError` naming the feature: the strategies ER-ACE, DER++
and LwF, class-balanced replay, the probe guard (``ProbeGuard``), inputs other than one float32 tensor,
batch-statistics (adaptation) graphs, and any setting or file of the folder this export does not know
(a later feature would otherwise be dropped). The stability-plasticity monitor only observes, but the
browser does not run it: since every exported learner has one, the export is refused unless
``drop_monitor=True``, which ``web.json`` records.

The browser draws replay from its own seeded generator, so its draws differ from the Python loop's.
A bare :func:`~taste_cl.adapters.onnx_engine.export.export_engine` folder (no ``manifest.json``) is not
taken: this package may not import the engine's (the ``no-cycles`` import contract), only the device loader.

>>> from taste_cl.adapters.web.engine_web import export_web
>>> export_web("engine_artifacts", "web_artifacts", drop_monitor=True)  # doctest: +SKIP
PosixPath('web_artifacts/web.json')
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import MANIFEST_FILE, read_manifest, read_verified, staged_folder
from taste_cl.adapters.device.loader import load_learner
from taste_cl.exceptions import ArtifactError, WebCompatibilityError
from taste_cl.guards.device import DeviceUpdateGuard

__all__ = ["ENGINE_WEB_FORMAT", "ENGINE_WEB_MANIFEST", "export_web"]

ENGINE_WEB_FORMAT = "taste_cl.web_engine/1"
ENGINE_WEB_MANIFEST = "web.json"
PARAMETERS, OPTIMIZER_STATE, REPLAY = "parameters.bin", "optimizer_state.bin", "replay.bin"
GRAPHS = {"forward": "forward.onnx", "backward": "backward.onnx", "optimizer": "optimizer.onnx"}  # copied as they are
ENGINE_MANIFEST = "engine.json"
# what an onnx_engine learner folder holds that the browser folder carries; anything else is a feature it would drop
_CARRIED = {*GRAPHS.values(), ENGINE_MANIFEST, "parameters.npz", "optimizer_state.npz", "loop_state.npz", MANIFEST_FILE}
_MAX_GRAPH_BYTES = 1 << 31
_MAX_ENGINE_JSON = 1 << 20
_KNOWN_SETTINGS = {
    "lr", "num_classes", "strategy", "replay", "capacity", "replay_batch_size", "train_iterations", "max_grad_norm",
    "alpha", "beta", "temperature", "lwf_every", "lwf_on_drift", "seed", "monitor", "probe_guard",
}  # fmt: skip


def _refuse(feature: str, why: str) -> WebCompatibilityError:
    return WebCompatibilityError(f"the browser learner does not run {feature}: {why}")


def _learner_settings(learner: Any, files: Mapping[str, Any], drop_monitor: bool) -> tuple[dict[str, Any], list[str]]:
    """The loop settings the browser takes from a learner folder (``files``: its manifest's listing), and what is
    dropped; refusals name the feature, including settings and files this export does not know (a later feature)."""
    settings = learner.current_settings()
    unknown = sorted(key for key, value in settings.items() if key not in _KNOWN_SETTINGS and value is not None)
    if unknown:
        raise _refuse(f"the settings {unknown}", "its JS loop knows none of them")
    extra = sorted(set(files) - _CARRIED)
    if extra:
        raise _refuse(f"what the files {extra} hold", "it loads the forward, backward and optimizer graphs and the state only")
    if settings["strategy"] != "er":
        raise _refuse(f"the strategy {settings['strategy']!r}", "its JS loop forms plain experience replay's cross-entropy only")
    if settings["replay"] not in (None, "reservoir"):
        raise _refuse(f"{settings['replay']!r} replay", "its buffer is a reservoir")
    if settings["probe_guard"] is not None:
        raise _refuse("the probe guard (ProbeGuard)", "it has no probe rows, windows or rollbacks")
    if not drop_monitor:
        raise _refuse(
            "the stability-plasticity monitor",
            "the folder's learner has one (every exported learner does); pass drop_monitor=True to export without it "
            "(the monitor only observes: training is the same)",
        )
    keys = ("lr", "replay", "capacity", "replay_batch_size", "train_iterations", "max_grad_norm", "seed")
    return {key: settings[key] for key in keys}, ["monitor"]


def _check_engine(spec: Mapping[str, Any]) -> tuple[str, list[int]]:
    """The one float32 input's name and shape (batch first) of ``engine.json``; refusals name the feature."""
    inputs = spec.get("inputs")
    if spec.get("keyword_inputs") or not isinstance(inputs, Mapping) or len(inputs) != 1:
        raise _refuse("structured inputs", "it feeds one positional float32 tensor")
    ((name, entry),) = inputs.items()
    if entry.get("dtype") != "float32":
        raise _refuse(f"a {entry.get('dtype')} input", f"it feeds one float32 tensor ({name!r} is {entry.get('dtype')})")
    if "batch" in spec:
        raise _refuse("the batch-statistics (adaptation) graphs", "it trains on the running-statistics graphs only")
    return str(name), [int(d) for d in entry["shape"]]


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[dict[str, Any]]]:
    """The arrays as one little-endian float32 buffer, and each one's name, shape and offset (in floats)."""
    parts, entries, offset = [], [], 0
    for name, array in arrays.items():
        data = np.array(array, dtype="<f4", order="C")  # a copy that keeps a 0-d tensor 0-d (the optimizer's step)
        parts.append(data.tobytes())
        entries.append({"name": name, "shape": list(data.shape), "offset": offset})
        offset += data.size
    return b"".join(parts), entries


def _guard(guard: DeviceUpdateGuard) -> dict[str, Any]:
    settings = {"mode": guard.mode, "max_lr": guard.max_lr, "update_bound": guard.update_bound, "update_jump": guard.update_jump}
    return {"settings": settings | {"protect_first": guard.protect_first}, "state": guard.state_dict()}


def export_web(source: str | os.PathLike[str], target: str | os.PathLike[str], *, drop_monitor: bool = False) -> Path:
    """Write the browser folder of the ONNX engine learner folder ``source`` at ``target`` (a new or empty folder;
    staged, then swapped into place) and return the path of its ``web.json``; see the module for what travels
    and what is refused."""
    folder = Path(source)
    manifest = read_manifest(folder)  # every hash checked
    if manifest.get("backend") != "onnx_engine":
        raise WebCompatibilityError(
            f"{str(folder)!r} holds {manifest.get('backend', 'onnxruntime')!r} artifacts; export_web takes an onnx_engine learner folder "
            "(learner.export(folder, backend='onnx_engine')); onnxruntime folders go through make_web_compatible"
        )
    learner = load_learner(folder)  # the device learner's checks: settings, shapes, arrays, graphs
    try:
        spec = json.loads(read_verified(folder, manifest, ENGINE_MANIFEST, max_bytes=_MAX_ENGINE_JSON))
    except ValueError as error:
        raise ArtifactError(f"{ENGINE_MANIFEST} in {folder} is not JSON: {error}") from None
    input_name, input_shape = _check_engine(spec)
    settings, dropped = _learner_settings(learner, manifest["files"], drop_monitor)
    plain, arrays = learner.state()
    files = {name: read_verified(folder, manifest, name, max_bytes=_MAX_GRAPH_BYTES) for name in GRAPHS.values()}
    files[PARAMETERS], parameters = _layout(learner.engine.parameters())
    files[OPTIMIZER_STATE], state = _layout(learner.engine.optimizer_state())
    replay, replay_entry = plain.get("replay"), None
    if replay is not None:
        rows = np.ascontiguousarray(arrays.get("replay.x", np.zeros((0, *input_shape[1:]))), dtype="<f4")
        labels = np.ascontiguousarray(arrays.get("replay.y", np.zeros(0)), dtype="<i4")
        files[REPLAY] = rows.tobytes() + labels.tobytes()
        replay_entry = {"file": REPLAY, "size": int(replay["size"]), "seen": int(replay["seen"]), "capacity": settings["capacity"],
                        "labels_offset": rows.nbytes}  # fmt: skip
    web = {
        "format": ENGINE_WEB_FORMAT,
        "files": {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} for name, data in files.items()},
        "graphs": GRAPHS,
        "input": {"name": input_name, "dtype": "float32", "shape": input_shape},
        "batch_size": int(spec["batch_size"]),
        "num_classes": int(spec["output_shape"][-1]),
        "parameters": {"file": PARAMETERS, "tensors": parameters},
        "optimizer": {"file": OPTIMIZER_STATE, "tensors": state, "spec": spec["optimizer"]},
        "settings": {**settings, "strategy": "er"},
        "replay": replay_entry,
        "guard": _guard(learner.guard),
        "counters": {"samples_seen": int(learner.samples_seen)},
        "dropped": dropped,
    }
    with staged_folder(target) as stage:
        for name, data in files.items():
            (stage / name).write_bytes(data)
        (stage / ENGINE_WEB_MANIFEST).write_text(json.dumps(web, indent=1))
    return Path(target) / ENGINE_WEB_MANIFEST
