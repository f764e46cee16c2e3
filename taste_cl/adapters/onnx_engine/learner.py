"""OnnxEngineLearner: the engine loop over an :class:`~taste_cl.adapters.onnx_engine.engine.OnnxEngine`, as a device learner.

``learner.export(folder, backend="onnx_engine")`` writes an artifact folder that
:func:`~taste_cl.adapters.device.loader.load_learner` (or :meth:`OnnxEngineLearner.from_artifacts`)
opens with numpy and plain ``onnxruntime`` only. The folder holds plain files, each listed with
its SHA-256 in ``manifest.json`` (:mod:`taste_cl.adapters.device.artifacts`):

- the engine's files: ``forward.onnx``, ``backward.onnx``, ``optimizer.onnx``, ``engine.json``,
  ``parameters.npz``, ``optimizer_state.npz``;
- ``loop_state.npz``: the loop's arrays (``replay.x``, ``replay.y``, ``replay.outputs``, ``teacher.<name>``, and the
  monitor's ``monitor.*``: its probe rows, labels and ids, recent scores and last probe verdicts);
- ``manifest.json``: ``format``, ``backend: "onnx_engine"``, ``settings`` (what builds the
  :class:`~taste_cl.engine.loop.EngineLearner`: lr, num_classes, strategy, replay, capacity, batch
  sizes, clipping, strategy weights, seed, and ``monitor``: the
  :class:`~taste_cl.engine.monitor.LoopMonitor`'s settings, defaults when absent), ``loop`` (the plain part of
  :meth:`~taste_cl.engine.loop.EngineLearner.state`: counters, generator, replay counts, guard
  history, the monitor's state), ``counters`` and what the export recorded (``export``);
- for an elastic learner (an :class:`~taste_cl.elastic.ElasticTrainer` exported with it), the pruned backward graphs
  ``backward.cut<k>.onnx``, ``settings.elastic`` (its settings and units) and ``elastic`` (the cycle's state: the
  selection, the importance, each cut's measured seconds and the counters): the device re-selects with its own
  costs and gradients (:class:`~taste_cl.engine.elastic.ElasticEngine`), and a saved folder resumes that too.

Loading checks everything before it builds anything: the manifest and every hash, each setting
against its bounds, the engine's shapes, and every array's dtype and shape from its ``.npy``
header before ``np.load(..., allow_pickle=False)`` allocates it. A bad value is an
:class:`~taste_cl.exceptions.ArtifactError` naming the field. :meth:`OnnxEngineLearner.save` writes
the same format (staged, then swapped into place), so a saved folder loads and continues bit for
bit. Nothing here imports torch or the export side.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import MANIFEST_FILE, check_plain_name, read_manifest, read_verified, staged_folder, write_manifest
from taste_cl.adapters.onnx_engine.engine import GRAPHS, OnnxEngine
from taste_cl.adapters.onnx_engine.engine import MANIFEST as ENGINE_MANIFEST
from taste_cl.adapters.onnxruntime.manifest import MAX_CAPACITY, MAX_CLASSES, MAX_ITERATIONS, MAX_REPLAY_BATCH, manifest_error, manifest_int
from taste_cl.adapters.onnxruntime.replay import MAX_REPLAY_BYTES, npz_headers
from taste_cl.engine.adapt import ArrayCollapseGuard, EngineAdapter
from taste_cl.engine.elastic import SETTINGS as ELASTIC_SETTINGS
from taste_cl.engine.elastic import ElasticEngine
from taste_cl.engine.loop import BUFFERS, STRATEGIES, EngineLearner, EngineStats
from taste_cl.engine.monitor import LoopMonitor
from taste_cl.engine.probe_guard import LoopProbeGuard
from taste_cl.exceptions import ArtifactError, CheckpointError, InvalidBatchError
from taste_cl.guards.device import DeviceUpdateGuard
from taste_cl.state.files import read_regular_file

__all__ = ["ADAPTER_FILE", "BACKEND", "ENGINE_FILES", "FORMAT", "LOOP_FILE", "OnnxEngineLearner", "load_adapter"]

ADAPTER_FILE = "adapter.json"
ADAPTER_FORMAT = "taste_cl.onnx_engine.adapter/1"

BACKEND = "onnx_engine"
FORMAT = 1
LOOP_FILE = "loop_state.npz"
ENGINE_FILES = (*GRAPHS, ENGINE_MANIFEST, "parameters.npz", "optimizer_state.npz")
MAX_LWF_EVERY = 2**31
_MAX_ENGINE_JSON = 1 << 20
_MAX_STATE_BYTES = 1 << 34
_SETTINGS = (
    "lr", "num_classes", "strategy", "replay", "capacity", "replay_batch_size", "train_iterations",
    "max_grad_norm", "alpha", "beta", "temperature", "lwf_every", "seed",
)  # fmt: skip


def _number(settings: Mapping[str, Any], key: str, *, low: float, high: float = math.inf, open_low: bool = False) -> float:
    value = settings.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise manifest_error(f"settings.{key}", value, "a finite number")
    if value < low or (open_low and value == low) or value > high:
        raise manifest_error(f"settings.{key}", value, f"in {'(' if open_low else '['}{low:g}, {high:g}]")
    return float(value)


def parse_settings(settings: Any, guard: DeviceUpdateGuard) -> dict[str, Any]:
    """The manifest's ``settings`` checked against their bounds (``ArtifactError`` naming the first bad one),
    as the keyword arguments of :class:`~taste_cl.engine.loop.EngineLearner`."""
    if not isinstance(settings, Mapping) or set(settings) - {"monitor", "lwf_on_drift", "probe_guard", "elastic"} != set(_SETTINGS):
        given = sorted(settings) if isinstance(settings, Mapping) else type(settings).__name__
        raise ArtifactError(f"manifest `settings` must be an object with exactly the keys {sorted(_SETTINGS)}; got {given}")
    strategy, replay = settings["strategy"], settings["replay"]
    if strategy not in STRATEGIES:
        raise manifest_error("settings.strategy", strategy, f"one of {list(STRATEGIES)}")
    if replay is not None and replay not in BUFFERS:
        raise manifest_error("settings.replay", replay, f"null or one of {list(BUFFERS)}")
    if strategy == "der++" and replay is None:
        raise manifest_error("settings.replay", replay, "a buffer for DER++, which replays stored outputs")
    clip, on_drift, every = settings["max_grad_norm"], settings.get("lwf_on_drift", False), settings["lwf_every"]
    if not isinstance(on_drift, bool):
        raise manifest_error("settings.lwf_on_drift", on_drift, "a bool")
    if every is None and not on_drift:
        raise manifest_error("settings.lwf_every", every, "an int when settings.lwf_on_drift is false")
    return {
        "lr": _number(settings, "lr", low=0.0, high=guard.max_lr, open_low=True),
        "num_classes": manifest_int(settings, "num_classes", 2, MAX_CLASSES, "settings."),
        "strategy": strategy,
        "replay": replay,
        "capacity": manifest_int(settings, "capacity", 1, MAX_CAPACITY, "settings."),
        "replay_batch_size": manifest_int(settings, "replay_batch_size", 0, MAX_REPLAY_BATCH, "settings."),
        "train_iterations": manifest_int(settings, "train_iterations", 1, MAX_ITERATIONS, "settings."),
        "max_grad_norm": None if clip is None else _number(settings, "max_grad_norm", low=0.0, open_low=True),
        "alpha": _number(settings, "alpha", low=0.0),
        "beta": _number(settings, "beta", low=0.0),
        "temperature": _number(settings, "temperature", low=0.0, open_low=True),
        "lwf_every": None if every is None else manifest_int(settings, "lwf_every", 1, MAX_LWF_EVERY, "settings."),
        "lwf_on_drift": on_drift,
        "seed": manifest_int(settings, "seed", 0, 2**63 - 1, "settings."),
        "monitor": _monitor(settings.get("monitor")),
        "probe_guard": _probe_guard(settings.get("probe_guard")),
        "elastic": _elastic(settings.get("elastic")),
    }


def _elastic(settings: Any) -> dict[str, Any] | None:
    """The manifest's ``settings.elastic`` with its keys and types checked (null or absent: no elastic cycle); the
    values are checked by :class:`~taste_cl.engine.elastic.ElasticEngine` against the engine when it loads."""
    if settings is None:
        return None
    keys = {*ELASTIC_SETTINGS, "units", "names"}
    if not isinstance(settings, Mapping) or set(settings) != keys:
        raise manifest_error(
            "settings.elastic", settings if not isinstance(settings, Mapping) else sorted(settings), f"an object with the keys {sorted(keys)}"
        )
    units, names = settings["units"], settings["names"]
    if not isinstance(units, list) or not all(isinstance(u, list) and all(isinstance(n, str) for n in u) for u in units):
        raise manifest_error("settings.elastic.units", units, "a list of lists of tensor names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise manifest_error("settings.elastic.names", names, "a list of unit names")
    for key in ("rho", "drift_rho"):
        value = settings[key]
        if (value is not None or key == "rho") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise manifest_error(f"settings.elastic.{key}", value, "a number in (0, 1]")
    for key in ("reselect_every", "drift_steps", "resolution"):
        manifest_int(settings, key, 1, 2**31, "settings.elastic.")
    return dict(settings)


def _monitor(settings: Any) -> LoopMonitor:
    """The monitor the manifest's ``settings.monitor`` describes (folders written before the loop had one: the default)."""
    if settings is None:
        return LoopMonitor()
    try:
        return LoopMonitor.from_settings(settings)
    except ValueError as error:
        raise ArtifactError(f"manifest `settings`: {error}") from None


def _monitor_expected(
    monitor: LoopMonitor, loop: Mapping[str, Any], dtype: np.dtype, row: tuple[int, ...]
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The ``monitor.*`` arrays the plain monitor state in ``loop`` names (none for a state without one); the probe within the device bound."""
    row_bytes = dtype.itemsize * math.prod(row) + 16
    if monitor.probe_capacity * row_bytes > MAX_REPLAY_BYTES:
        bound = f"at most {MAX_REPLAY_BYTES // row_bytes} rows of {row_bytes} bytes"
        raise manifest_error("settings.monitor.probe_capacity", monitor.probe_capacity, bound)
    if "monitor" not in loop:
        return {}
    try:
        return monitor.expected_arrays(loop["monitor"], dtype, row)
    except ValueError as error:
        raise ArtifactError(f"manifest `loop`: {error}") from None


def _probe_guard(settings: Any) -> LoopProbeGuard | None:
    """The probe guard the manifest's ``settings.probe_guard`` describes (null, or absent in older folders: none)."""
    if settings is None:
        return None
    try:
        return LoopProbeGuard.from_settings(settings)
    except ValueError as error:
        raise ArtifactError(f"manifest `settings`: {error}") from None


def _guard_expected(
    settings: Mapping[str, Any], loop: Mapping[str, Any], dtype: np.dtype, row: tuple[int, ...],
    shapes: Mapping[str, tuple[int, ...]], optimizer: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:  # fmt: skip
    """The ``probe_guard.*`` arrays the plain guard state in ``loop`` names, its probe, window rows and snapshot
    buffer within the device bounds (none without a guard; ``ArtifactError`` naming the field)."""
    guard: LoopProbeGuard | None = settings["probe_guard"]
    if guard is None or loop.get("probe_guard") is None:  # a state without one is refused when it loads
        return {}
    row_bytes = dtype.itemsize * math.prod(row) + 16
    if guard.probe_capacity * row_bytes > MAX_REPLAY_BYTES:
        raise manifest_error("settings.probe_guard.probe_capacity", guard.probe_capacity, f"at most {MAX_REPLAY_BYTES // row_bytes} rows")
    plain = loop.get("probe_guard")
    try:
        expected = guard.expected_arrays(plain, dtype, row, shapes, optimizer, settings["num_classes"])
    except ValueError as error:
        raise ArtifactError(f"manifest `loop`: {error}") from None
    pending = expected.get("probe_guard.pending.y", (None, (0,)))[1][0]
    if pending * row_bytes > MAX_REPLAY_BYTES:
        raise manifest_error("loop.probe_guard.pending", pending, f"at most {MAX_REPLAY_BYTES // row_bytes} rows")
    held = expected.get("probe_guard.snapshot.replay.y", (None, (0,)))[1][0]
    if held > settings["capacity"]:
        raise manifest_error("loop.probe_guard.snapshot.replay.size", held, f"at most settings.capacity ({settings['capacity']})")
    return expected


def _engine_shapes(data: bytes) -> tuple[np.dtype, tuple[int, ...], int, dict[str, tuple[int, ...]]]:
    """From ``engine.json``: the input's dtype and row shape, the output width and the trainable shapes (checked)."""
    try:
        spec = json.loads(data)
        inputs, output, trainable = spec["inputs"], spec["output_shape"], spec["trainable"]
        if spec.get("keyword_inputs") or not isinstance(inputs, dict) or len(inputs) != 1:
            raise ValueError("the engine must take one positional input tensor")
        (entry,) = inputs.values()
        dtype = np.dtype(entry["dtype"])
        row = tuple(entry["shape"][1:])
        shapes = {str(name): tuple(shape) for name, shape in trainable.items()}
        dims = [*row, *output, *(d for shape in shapes.values() for d in shape)]
        if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 2**31 for d in dims):
            raise ValueError("shapes must hold ints in [0, 2**31]")
        if len(output) != 2 or dtype.kind not in "fiu":
            raise ValueError(f"the engine must output (batch, classes) logits from a numeric input; got {output} from {dtype}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ArtifactError(f"{ENGINE_MANIFEST} is not a usable engine manifest: {error}") from None
    return dtype, row, int(output[1]), shapes


def _check_headers(name: str, data: bytes, expected: Mapping[str, tuple[np.dtype, tuple[int, ...]]], *, exact: bool = True) -> None:
    """Every array of the ``.npz`` bytes ``data`` has the dtype and shape ``expected`` gives it, read from its header
    before anything is allocated (``exact``: no array missing either)."""
    try:
        headers = npz_headers(data)
    except ValueError as error:
        raise ArtifactError(f"{name} is not a plain .npz archive: {error}") from None
    for key, (dtype, shape) in headers.items():
        if key not in expected:
            raise ArtifactError(f"{name} holds an unexpected array {key!r}")
        want_dtype, want_shape = expected[key]
        if dtype != want_dtype or shape != want_shape:
            raise ArtifactError(f"{name}: `{key}` must be {want_dtype} {want_shape}; its header says {dtype} {shape}")
    missing = sorted(set(expected) - set(headers)) if exact else []
    if missing:
        raise ArtifactError(f"{name} lacks the arrays {missing}")


def _load_npz(name: str, data: bytes) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {key: np.asarray(archive[key]) for key in archive.files}
    except (OSError, ValueError) as error:
        raise ArtifactError(f"{name} is unreadable: {error}") from None


def _loop_expected(
    loop: Mapping[str, Any], settings: Mapping[str, Any], dtype: np.dtype, row: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays ``loop_state.npz`` must hold for the plain loop state ``loop``: checked values of ``loop`` name them."""
    if not isinstance(loop, Mapping) or loop.get("format") != 1:
        raise manifest_error("loop.format", loop.get("format") if isinstance(loop, Mapping) else loop, "1")
    manifest_int(loop, "observes", 0, 2**53, "loop.")
    if not isinstance(loop.get("rng"), Mapping):
        raise manifest_error("loop.rng", loop.get("rng"), "a numpy bit generator state")
    teacher = loop.get("teacher")
    if not isinstance(teacher, bool):
        raise manifest_error("loop.teacher", teacher, "a bool")
    if teacher and settings["strategy"] != "lwf":
        raise manifest_error("loop.teacher", teacher, "false unless the strategy is 'lwf'")
    expected: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    if teacher:
        expected = {f"teacher.{name}": (np.dtype(np.float32), tuple(shape)) for name, shape in shapes.items()}
    replay = loop.get("replay")
    if (replay is None) != (settings["replay"] is None):
        raise manifest_error("loop.replay", replay, "an object with `size` and `seen` exactly when settings.replay names a buffer")
    if replay is not None:
        if not isinstance(replay, Mapping):
            raise manifest_error("loop.replay", replay, "an object with int `size` and `seen`")
        size = manifest_int(replay, "size", 0, settings["capacity"], "loop.replay.")
        manifest_int(replay, "seen", size, 2**53, "loop.replay.")
        row_bytes = dtype.itemsize * math.prod(row) + 8 + 4 * settings["num_classes"]
        if settings["capacity"] * row_bytes > MAX_REPLAY_BYTES:
            raise manifest_error("settings.capacity", settings["capacity"], f"at most {MAX_REPLAY_BYTES // row_bytes} rows of {row_bytes} bytes")
        if size:
            expected |= {
                "replay.x": (dtype, (size, *row)),
                "replay.y": (np.dtype(np.int64), (size,)),
                "replay.outputs": (np.dtype(np.float32), (size, settings["num_classes"])),
            }
    return expected | _monitor_expected(settings["monitor"], loop, dtype, row)


def _loop_arrays(arrays: Mapping[str, np.ndarray], num_classes: int) -> None:
    """Values the headers cannot show: labels in range, finite rows and teacher (``ArtifactError`` naming the array);
    the monitor's arrays are its own to check (:meth:`~taste_cl.engine.monitor.LoopMonitor.check_state`)."""
    y = arrays.get("replay.y")
    if y is not None and y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ArtifactError(f"{LOOP_FILE}: `replay.y` holds labels in [{y.min()}, {y.max()}], must be in [0, {num_classes})")
    for key, value in arrays.items():
        if value.dtype.kind == "f" and not key.startswith("monitor.") and not np.isfinite(value).all():
            raise ArtifactError(f"{LOOP_FILE}: `{key}` holds NaN or infinite values")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class OnnxEngineLearner(EngineLearner):
    """An :class:`~taste_cl.engine.loop.EngineLearner` over an :class:`OnnxEngine`, loaded from and saved to
    an artifact folder (see the module). Build it with :meth:`from_artifacts` or ``load_learner(folder)``.

    ``observe((x, y))`` (or ``observe(x, y)``, or ``{"x": x, "y": y}``) trains on a batch with the
    folder's strategy, replay and clipping, under the device update guard; ``predict(x)`` returns the
    logits. Calls hold :attr:`lock`.
    """

    def __init__(
        self,
        engine: OnnxEngine,
        *,
        guard: DeviceUpdateGuard | None = None,
        source: Mapping[str, Any] | None = None,
        info: Mapping[str, Any] | None = None,
        elastic: Mapping[str, Any] | None = None,
        timer: Any = None,
        **settings: Any,
    ) -> None:
        self.onnx_engine = engine
        self.elastic = None if elastic is None else ElasticEngine(engine, **elastic, timer=timer)
        super().__init__(engine if self.elastic is None else self.elastic, guard=guard, **settings)
        self.engine: OnnxEngine | ElasticEngine  # the loop trains through the elastic cycle when there is one
        if self.elastic is not None:  # as the torch trainer: a drift raises the budget for a while
            self.monitor.subscribe(self.elastic.on_drift, "drift_detected")
        self.seed = int(settings.get("seed", 0))
        self.capacity = int(settings.get("capacity", 200))
        (self.input_dtype, self.input_shape), *more = engine.inputs.values()
        if more:
            raise ValueError("the engine learner takes one input tensor")
        self.samples_seen = 0
        self.info = dict(info or {})  # what the export recorded; saved again unchanged
        self.source = dict(source) if source is not None else None  # the manifest loaded from, whose hashes save re-checks
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """The lock every public call holds."""
        return self._lock

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_artifacts(cls, directory: str | os.PathLike[str], *, threads: int = 1, timer: Any = None) -> OnnxEngineLearner:
        """Load a folder written by the export or :meth:`save`; everything is checked first (``ArtifactError``).
        ``timer``: the clock the elastic cycle measures its steps with (default its ``clock`` setting's; tests inject one)."""
        folder = Path(directory)
        manifest = read_manifest(folder, required=(*ENGINE_FILES, LOOP_FILE))
        if manifest.get("backend") != BACKEND or manifest.get("format") != FORMAT:
            raise ArtifactError(f"{folder / MANIFEST_FILE} is not an ONNX engine learner folder (backend {BACKEND!r}, format {FORMAT})")
        guard = DeviceUpdateGuard()
        settings = parse_settings(manifest.get("settings"), guard)
        counters = manifest.get("counters")
        if not isinstance(counters, Mapping):
            raise manifest_error("counters", counters, "an object with int `samples_seen`")
        samples_seen = manifest_int(counters, "samples_seen", 0, 2**62, "counters.")
        dtype, row, width, shapes = _engine_shapes(read_verified(folder, manifest, ENGINE_MANIFEST, max_bytes=_MAX_ENGINE_JSON))
        if width != settings["num_classes"]:
            raise manifest_error("settings.num_classes", settings["num_classes"], f"the engine's output width {width}")
        float32 = np.dtype(np.float32)
        _check_headers("parameters.npz", read_verified(folder, manifest, "parameters.npz", max_bytes=_MAX_STATE_BYTES),
                       {name: (float32, shape) for name, shape in shapes.items()})  # fmt: skip
        state_shapes = {"step": (float32, ())} | {
            f"{kind}.{n}": (float32, s) for n, s in shapes.items() for kind in ("momentum", "exp_avg", "exp_avg_sq")
        }
        optimizer_data = read_verified(folder, manifest, "optimizer_state.npz", max_bytes=_MAX_STATE_BYTES)
        _check_headers("optimizer_state.npz", optimizer_data, state_shapes, exact=False)
        loop = manifest.get("loop")
        expected = _loop_expected(loop, settings, dtype, row, shapes)  # type: ignore[arg-type]  # checked there
        expected |= _guard_expected(settings, loop, dtype, row, shapes, npz_headers(optimizer_data))  # type: ignore[arg-type]
        data = read_verified(folder, manifest, LOOP_FILE, max_bytes=_MAX_STATE_BYTES)
        _check_headers(LOOP_FILE, data, expected)
        arrays = _load_npz(LOOP_FILE, data)
        _loop_arrays(arrays, settings["num_classes"])
        if isinstance(loop, Mapping) and "monitor" in loop:
            try:
                settings["monitor"].check_state(loop["monitor"], arrays, settings["num_classes"])
            except ValueError as error:
                raise ArtifactError(f"manifest `loop` or {LOOP_FILE}: {error}") from None
        try:
            engine = OnnxEngine(folder, threads=threads)
        except ArtifactError:
            raise
        except (CheckpointError, ValueError, KeyError, TypeError, RuntimeError) as error:
            raise ArtifactError(f"the engine files in {str(folder)!r} do not load: {type(error).__name__}: {error}") from None
        info = manifest.get("export")
        if settings["elastic"] is not None:
            try:  # its values against this engine's tensors and cuts, before the learner is built
                ElasticEngine(engine, **settings["elastic"])
            except (ValueError, TypeError) as error:
                raise ArtifactError(f"manifest `settings.elastic`: {error}") from None
        learner = cls(engine, source=manifest, info=info if isinstance(info, Mapping) else None, guard=guard, timer=timer, **settings)
        elastic_state = None
        if learner.elastic is not None:
            try:
                elastic_state = learner.elastic.check_state(manifest.get("elastic"))
            except ValueError as error:
                raise ArtifactError(f"manifest `elastic`: {error}") from None
        elif "elastic" in manifest:
            raise ArtifactError("manifest `elastic` must be absent: settings.elastic is null, so there is no elastic cycle to restore")
        state = {**arrays, **{f"param.{k}": v for k, v in engine.parameters().items()}}
        state |= {f"optim.{k}": v for k, v in engine.optimizer_state().items()}
        try:
            learner.load_state(loop, state)  # type: ignore[arg-type]  # a Mapping, checked in _loop_expected
        except ValueError as error:
            raise ArtifactError(f"manifest `loop` does not restore: {error}") from None
        if learner.elastic is not None and elastic_state is not None:
            learner.elastic.load_state(elastic_state)
        learner.samples_seen = samples_seen
        return learner

    # ---------------------------------------------------------------- the loop, locked
    def observe(self, x: Any, y: Any = None) -> EngineStats:
        """Test-then-train on one batch: ``observe((x, y))``, ``observe({"x": x, "y": y})`` or ``observe(x, y)``."""
        if y is None:
            if isinstance(x, Mapping) and set(x) == {"x", "y"}:
                x, y = x["x"], x["y"]
            elif isinstance(x, (tuple, list)) and len(x) == 2:
                x, y = x
            else:
                raise InvalidBatchError(f"batch must be (x, y) or {{'x': x, 'y': y}}; got {type(x).__name__}")
        x = np.asarray(x)
        if x.dtype.kind == self.input_dtype.kind:
            x = x.astype(self.input_dtype, copy=False)  # float64 rows are stored as the graph's float32
        with self._lock:
            stats = super().observe(x, y)
            self.samples_seen += int(np.shape(y)[0])
            return stats

    def predict(self, x: np.ndarray) -> np.ndarray:
        with self._lock:
            return super().predict(x)

    # ---------------------------------------------------------------- saving
    def current_settings(self) -> dict[str, Any]:
        """The manifest's ``settings`` for the learner as it is now (its live ``lr`` included)."""
        return {
            "lr": self.lr, "num_classes": self.num_classes, "strategy": self.strategy,
            "replay": None if self.replay is None else self.replay.policy,
            "capacity": self.capacity if self.replay is None else self.replay.capacity,
            "replay_batch_size": self.replay_batch_size, "train_iterations": self.train_iterations,
            "max_grad_norm": self.max_grad_norm, "alpha": self.alpha, "beta": self.beta,
            "temperature": self.temperature, "lwf_every": self.lwf_every, "lwf_on_drift": self.lwf_on_drift, "seed": self.seed,
            "monitor": self.monitor.settings(),
            "probe_guard": None if self.probe_guard is None else self.probe_guard.settings(),
        } | ({} if self.elastic is None else {"elastic": self.elastic.settings()})  # fmt: skip

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the learner as an artifact folder that :meth:`from_artifacts` resumes bit for bit (staged, then
        swapped into place: the folder is complete or absent). Graphs that changed on disk since they were
        loaded (their hashes differ from the loaded manifest's) are refused, not re-hashed."""
        with self._lock, staged_folder(directory) as stage:
            self.engine.save(stage)
            if self.source is not None:
                for name in (*self.onnx_engine.graph_files, ENGINE_MANIFEST):
                    if _sha256(stage / check_plain_name(name)) != self.source["files"][name]:
                        raise ArtifactError(f"{name} changed on disk since the learner was loaded: SHA-256 mismatch; not saved")
            plain, arrays = self.state()
            loop = {k: v for k, v in arrays.items() if not k.startswith(("param.", "optim."))}
            buffer = io.BytesIO()
            np.savez(buffer, **loop)  # type: ignore[arg-type]  # numeric arrays: nothing is pickled
            (stage / LOOP_FILE).write_bytes(buffer.getvalue())
            manifest = {
                "format": FORMAT,
                "backend": BACKEND,
                "settings": self.current_settings(),
                "loop": plain,
                "counters": {"samples_seen": self.samples_seen},
                "export": self.info,
            }
            if self.elastic is not None:
                manifest["elastic"] = self.elastic.state()
            write_manifest(stage, manifest)
        return Path(directory).absolute()


def load_adapter(directory: str | os.PathLike[str], *, threads: int = 1) -> EngineAdapter:
    """The test-time adapter of a folder written by :func:`~taste_cl.adapters.onnx_engine.adapt_export.export_adapter`:
    an :class:`~taste_cl.engine.adapt.EngineAdapter` over its :class:`OnnxEngine`, torch-free. ``ArtifactError`` naming
    the field for an ``adapter.json`` that is not one, or settings the adapter or its guard refuse."""
    folder = Path(directory)
    try:
        record = json.loads(read_regular_file(folder / ADAPTER_FILE, _MAX_ENGINE_JSON))
    except (OSError, ValueError) as error:
        raise ArtifactError(f"{folder} has no readable {ADAPTER_FILE}: {error}") from None
    keys = {"format", "method", "lr", "min_batch", "backoff", "guard"}
    if not isinstance(record, dict) or record.get("format") != ADAPTER_FORMAT or set(record) != keys:
        raise ArtifactError(f"{folder / ADAPTER_FILE} is not an adapter record (format {ADAPTER_FORMAT!r} and exactly the keys {sorted(keys)})")
    guard = record["guard"]
    if guard is not None and not isinstance(guard, dict):
        raise manifest_error("guard", guard, "null or an object of CollapseGuard settings")
    engine = OnnxEngine(folder, threads=threads)
    if not engine.adaptable:
        raise ArtifactError(f"{folder} has no batch-statistics graphs (export it with export_adapter)")
    try:
        return EngineAdapter(
            engine,
            record["method"],
            lr=record["lr"],
            guard=None if guard is None else ArrayCollapseGuard(**guard),
            min_batch=record["min_batch"],
            backoff=record["backoff"],
        )
    except (TypeError, ValueError) as error:
        raise ArtifactError(f"{folder / ADAPTER_FILE} does not build an adapter: {error}") from None
