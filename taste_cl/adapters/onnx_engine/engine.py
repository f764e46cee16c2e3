"""OnnxEngine: forward, vector-Jacobian product and optimizer step on plain ``onnxruntime`` (numpy only, no torch).

The folder written by :func:`~taste_cl.adapters.onnx_engine.export.export_engine` holds three
standard ONNX graphs and the state:

- ``forward.onnx``: inputs and trainable tensors -> ``output`` and the saved activations;
- ``backward.onnx``: saved activations (plus the inputs and weights they need) and ``grad_output``
  -> ``grad.<name>`` of each trainable tensor; the activations are computed once, in the forward;
- ``optimizer.onnx``: one SGD or AdamW step; ``parameters.npz`` and ``optimizer_state.npz``;
- ``engine.json``: names, shapes and dtypes, all checked on load;
- with cuts (an elastic learner's export), ``backward.cut<k>.onnx``: the backward pruned to the gradients of the
  tensors from one module on (``cuts`` of the manifest); :meth:`OnnxEngine.select` trains a subset of the
  tensors on the latest cut that holds them, reading the same parameters (see :mod:`taste_cl.engine.elastic`);
- with ``batchnorm="adapt"`` at export, ``forward_batch.onnx`` / ``backward_batch.onnx`` (BatchNorm on
  the batch's statistics) and ``statistics.npz`` (the running statistics, inputs of the graphs):
  :meth:`OnnxEngine.forward_batch_statistics`, :meth:`OnnxEngine.norm_statistics` and
  :meth:`OnnxEngine.load_norm_statistics` make it an :class:`~taste_cl.engine.base.AdaptableEngine`.

The graphs have a fixed batch size (the export example's). A batch of another size runs as chunks
of that size, the last padded by repeating its first row; padded rows get zero ``grad_output``,
so the gradients are exact (eval-mode models treat rows independently).

Nothing here imports torch or the export side: the engine runs on ``onnxruntime`` >= 1.19 (the
deprecated training build's plain ``InferenceSession`` included) with numpy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.engine.arrays import checked_floats, npz_bytes, read_npz
from taste_cl.exceptions import ArtifactError, CheckpointError, InvalidBatchError, MissingDependencyError
from taste_cl.state.files import atomic_write_bytes, read_regular_file

__all__ = ["FORMAT", "MANIFEST", "OnnxEngine"]

FORMAT = "taste_cl.onnx_engine/1"
MANIFEST = "engine.json"
GRAPHS = ("forward.onnx", "backward.onnx", "optimizer.onnx")
BATCH_GRAPHS = ("forward_batch.onnx", "backward_batch.onnx")
STATISTICS = "statistics.npz"
_MAX_MANIFEST = 1 << 20
_MAX_STATE = 1 << 34


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as error:
        raise MissingDependencyError("onnxruntime", command="pip install onnxruntime") from error
    return onnxruntime


@dataclass(frozen=True)
class _Graphs:
    """A forward/backward pair: the sessions, their input names, what the backward is fed from the forward, the forward's outputs."""

    forward: Any
    backward: Any
    forward_inputs: list[str]
    backward_inputs: list[str]
    fed: set[str]
    outputs: list[str]
    grads: tuple[str, ...]


def _statistic_shapes(manifest: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The running statistics the graphs take (``statistics`` of the manifest) and each layer's batch count (shape ``()``)."""
    shapes = {str(name): tuple(int(d) for d in shape) for name, shape in manifest.get("statistics", {}).items()}
    for layer in manifest.get("batch", {}).get("layers", {}):
        shapes[f"{layer}.num_batches_tracked" if layer else "num_batches_tracked"] = ()
    return shapes


def _check_statistics(
    what: str, values: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], layers: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """``values`` checked as running statistics: float32 means and variances (>= 0) and int64 batch counts (>= 0)."""
    counts = {name: shape for name, shape in expected.items() if name.endswith("num_batches_tracked")}
    floats = checked_floats(what, {k: v for k, v in values.items() if k not in counts}, {k: s for k, s in expected.items() if k not in counts})
    checked = dict(floats)
    for name in counts:
        count = np.asarray(values.get(name))
        if count.shape != () or count.dtype.kind not in "iu" or int(count) < 0:
            raise CheckpointError(f"{what}: {name!r} must be an integer count >= 0; got {count.dtype} {count.shape}")
        checked[name] = np.asarray(int(count), np.int64)
    negative = [name for name in floats if name.endswith("running_var") and bool((floats[name] < 0).any())]
    if negative:
        raise CheckpointError(f"{what}: {negative[0]!r} holds negative variances")
    return checked


class OnnxEngine:
    """The ONNX engine over an exported folder: the engine interface of the learning loop.

    ``threads``: ONNX Runtime's intra-op threads. Graph optimizations are all on
    (``ORT_ENABLE_ALL``). ``forward(x, train=True)`` keeps what ``backward`` needs, once;
    ``backward(grad_outputs)`` returns the gradients of :attr:`trainable` for that forward;
    ``step(gradients, lr)`` runs the optimizer graph.
    """

    def __init__(self, folder: str | os.PathLike[str], *, threads: int = 1) -> None:
        ort = _ort()
        self.folder = Path(folder)
        try:
            manifest = json.loads(read_regular_file(self.folder / MANIFEST, _MAX_MANIFEST))
        except (OSError, ValueError) as error:
            raise ArtifactError(f"{self.folder} has no readable {MANIFEST}: {error}") from error
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ArtifactError(f"{self.folder / MANIFEST} is not an ONNX engine manifest (format {FORMAT!r} expected)")
        self._manifest = manifest
        self.trainable: tuple[str, ...] = tuple(manifest["trainable"])
        self._shapes = {name: tuple(int(d) for d in shape) for name, shape in manifest["trainable"].items()}
        self._inputs = {name: (np.dtype(spec["dtype"]), tuple(spec["shape"][1:])) for name, spec in manifest["inputs"].items()}
        self.batch_size = int(manifest["batch_size"])
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        sessions = {}
        for graph in GRAPHS:
            path = self.folder / graph
            if not path.is_file() or path.is_symlink():
                raise ArtifactError(f"{self.folder} lacks {graph} (or it is not a regular file)")
            sessions[graph] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._forward, self._backward, self._optimizer = (sessions[g] for g in GRAPHS)
        self._statistic_shapes = _statistic_shapes(manifest)
        self._rows_name = str(manifest["batch"]["rows"]) if "batch" in manifest else ""
        self._layers: dict[str, dict[str, Any]] = dict(manifest.get("batch", {}).get("layers", {}))
        self._check_signatures(manifest)
        self._cuts = [self._graphs, *self._load_cuts(manifest, ort, options)]
        self.cuts: tuple[tuple[str, ...], ...] = tuple(graphs.grads for graphs in self._cuts)
        self._active, self._selected = self._graphs, self.trainable
        self.cut = 0  # the cut training runs on (select)
        self._batch = self._load_batch_graphs(manifest, ort, options)
        self._statistics = self._load_statistics() if self._batch is not None else {}
        self._parameters = checked_floats("parameters.npz", read_npz(self.folder / "parameters.npz", _MAX_STATE), self._shapes)
        self._state_shapes = self._optimizer_state_shapes()
        self._state = checked_floats("optimizer_state.npz", read_npz(self.folder / "optimizer_state.npz", _MAX_STATE), self._state_shapes)
        self._saved: list[tuple[dict[str, np.ndarray], int]] | None = None
        self._saved_by: _Graphs = self._graphs
        self._output_shape: tuple[int, ...] | None = None

    @property
    def inputs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Each input's dtype and shape without the batch axis, by name."""
        return dict(self._inputs)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The output's shape at the graphs' batch size (rows first)."""
        return tuple(int(d) for d in self._manifest["output_shape"])

    # ------------------------------------------------------------------ loading
    def _check_signatures(self, manifest: Mapping[str, Any]) -> None:
        self._graphs = self._graph_pair(self._forward, self._backward, manifest, "forward.onnx", "backward.onnx")
        self._forward_inputs, self._backward_inputs, self._fed = self._graphs.forward_inputs, self._graphs.backward_inputs, self._graphs.fed

    def _graph_pair(
        self, forward: Any, backward: Any, entry: Mapping[str, Any], forward_name: str, backward_name: str, grads: tuple[str, ...] | None = None
    ) -> _Graphs:
        """The forward/backward pair checked against the manifest ``entry`` (its ``forward`` and ``backward``); the backward
        returns the gradients of ``grads`` (default: every trainable tensor) in order."""
        for session, key, file in ((forward, "forward", forward_name), (backward, "backward", backward_name)):
            names = [i.name for i in session.get_inputs()]
            outputs = [o.name for o in session.get_outputs()]
            if set(names) - set(entry[key]["inputs"]) or outputs != list(entry[key]["outputs"]):
                raise ArtifactError(f"{file}'s inputs/outputs {names} -> {outputs} differ from {MANIFEST}'s")
        backward_inputs = [i.name for i in backward.get_inputs()]
        fed = {name for name in backward_inputs if name != "grad_output" and not name.startswith("saved_")}
        unknown = fed - set(self._shapes) - set(self._inputs) - set(self._statistic_shapes) - {"output", self._rows_name}
        if unknown:
            raise ArtifactError(f"{backward_name} takes inputs the engine cannot feed: {sorted(unknown)}")
        grads = self.trainable if grads is None else grads
        if [o.name for o in backward.get_outputs()] != [f"grad.{name}" for name in grads]:
            which = "the trainable tensors" if grads == self.trainable else "its cut's tensors"
            raise ArtifactError(f"{backward_name} does not return the gradients of {which} in order")
        forward_inputs, outputs = [i.name for i in forward.get_inputs()], [o.name for o in forward.get_outputs()]
        return _Graphs(forward, backward, forward_inputs, backward_inputs, fed, outputs, grads)

    def _load_cuts(self, manifest: Mapping[str, Any], ort: Any, options: Any) -> list[_Graphs]:
        """The pruned backward graphs of ``cuts``, each the gradients of a subset of the cut before's (in order)."""
        cuts, previous = [], self.trainable
        for k, entry in enumerate(manifest.get("cuts", []), start=1):
            file = f"backward.cut{k}.onnx"
            grads = tuple(entry["trainable"]) if isinstance(entry, Mapping) and isinstance(entry.get("trainable"), list) else None
            ordered = grads is not None and set(grads) < set(previous) and list(grads) == [n for n in previous if n in grads]
            if not isinstance(entry, Mapping) or entry.get("file") != file or not grads or not ordered:
                raise ArtifactError(f"{MANIFEST} `cuts[{k - 1}]` must name {file} and fewer of the cut before's tensors, in order")
            path = self.folder / file
            if not path.is_file() or path.is_symlink():
                raise ArtifactError(f"{self.folder} lacks {file} (or it is not a regular file)")
            backward = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            cuts.append(self._graph_pair(self._forward, backward, {"forward": manifest["forward"], "backward": entry}, "forward.onnx", file, grads))
            previous = grads
        return cuts

    @property
    def graph_files(self) -> tuple[str, ...]:
        """The graph files of the folder (the batch-statistics graphs left out)."""
        return (*GRAPHS, *(f"backward.cut{k}.onnx" for k in range(1, len(self._cuts))))

    def select(self, names: Sequence[str]) -> int:
        """Train only the tensors ``names`` from now on, on the latest cut holding them all (returned): :meth:`backward`
        returns and :meth:`step` takes their gradients only, and the other tensors and their optimizer state stay as they
        are (as torch's optimizers skip a parameter without a gradient). ``ValueError`` for a name that is not trainable."""
        chosen = set(names)
        unknown = sorted(chosen - set(self.trainable))
        if unknown or not chosen:
            raise ValueError(f"select names tensors the engine does not train: {unknown}" if unknown else "select needs one tensor or more")
        cut = max(k for k, graphs in enumerate(self._cuts) if chosen <= set(graphs.grads))
        self._active, self._selected = self._cuts[cut], tuple(name for name in self.trainable if name in chosen)
        self.cut = cut
        return cut

    def _optimizer_state_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"step": ()}
        for item in self._optimizer.get_inputs():
            if item.name not in ("lr", "step") and not item.name.startswith(("param.", "grad.")):
                shapes[item.name] = self._shapes[item.name.split(".", 1)[1]]
        return shapes

    # ------------------------------------------------------------------ the engine interface
    def _as_inputs(self, x: np.ndarray | Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        given = dict(x) if isinstance(x, Mapping) else {next(iter(self._inputs)): x} if len(self._inputs) == 1 else None
        if given is None or set(given) != set(self._inputs):
            raise InvalidBatchError(f"the engine's inputs are {sorted(self._inputs)}; got {sorted(given) if given else type(x).__name__}")
        arrays, rows = {}, -1
        for name, (dtype, shape) in self._inputs.items():
            array = np.asarray(given[name])
            if array.shape[1:] != shape or array.shape[0] < 1 or (rows >= 0 and array.shape[0] != rows):
                raise InvalidBatchError(
                    f"input {name!r} must be shaped (n, {', '.join(map(str, shape))}) with n >= 1 rows like the other inputs; got {array.shape}"
                )
            if array.dtype.kind != dtype.kind:
                raise InvalidBatchError(f"input {name!r} must be of kind {dtype} ; got {array.dtype}")
            arrays[name], rows = np.ascontiguousarray(array, dtype=dtype), array.shape[0]
        return arrays, rows

    def _chunks(self, arrays: Mapping[str, np.ndarray], rows: int) -> list[tuple[dict[str, np.ndarray], int]]:
        size = self.batch_size
        if rows == size:
            return [(dict(arrays), rows)]
        chunks = []
        for start in range(0, rows, size):
            taken = min(size, rows - start)
            index = np.concatenate([np.arange(start, start + taken), np.full(size - taken, start)])
            chunks.append(({name: a[index] for name, a in arrays.items()}, taken))
        return chunks

    def forward(self, x: np.ndarray | Mapping[str, np.ndarray], *, train: bool) -> np.ndarray:
        """The model's output for ``x``; with ``train=True`` the activations for one :meth:`backward` are kept."""
        arrays, rows = self._as_inputs(x)
        return self._run_forward(self._active if train else self._graphs, self._chunks(arrays, rows), train)[0]

    def _value(self, name: str, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        """What the graphs' input ``name`` is fed: the batch's, a trainable tensor's or a running statistic's value."""
        if name in chunk:
            return chunk[name]
        return self._parameters[name] if name in self._parameters else self._statistics[name]

    def _run_forward(self, graphs: _Graphs, chunks: list[tuple[dict[str, np.ndarray], int]], train: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The output of ``graphs``' forward over ``chunks`` and its other outputs before the activations (of the last chunk)."""
        outputs, saved = [], []
        names = graphs.outputs
        extra = [name for name in names[1:] if not name.startswith("saved_")]
        extras: dict[str, np.ndarray] = {}
        for chunk, taken in chunks:
            feed = {name: self._value(name, chunk) for name in graphs.forward_inputs}
            result = graphs.forward.run(names if train else names[: 1 + len(extra)], feed)
            outputs.append(result[0][:taken])
            extras = dict(zip(extra, result[1 : 1 + len(extra)]))
            if train:
                kept = dict(zip(names, result))
                kept.update({name: chunk[name] for name in graphs.fed if name in chunk})
                saved.append((kept, taken))
        output = outputs[0] if len(outputs) == 1 else np.concatenate(outputs)
        self._saved, self._saved_by = (saved, graphs) if train else (None, self._graphs)
        self._output_shape = output.shape
        return output, extras

    def backward(self, grad_outputs: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of the trainable tensors for the last ``forward(..., train=True)``, given dLoss/dOutput."""
        if self._saved is None:
            raise RuntimeError("backward needs a forward(x, train=True) first (each forward's activations serve one backward)")
        grad = np.asarray(grad_outputs, dtype=np.float32)
        if grad.shape != self._output_shape:
            raise InvalidBatchError(f"grad_outputs must be shaped like the outputs {self._output_shape}; got {grad.shape}")
        saved, self._saved = self._saved, None
        graphs = self._saved_by
        total: dict[str, np.ndarray] = {}
        start = 0
        for kept, taken in saved:
            part = grad[start : start + taken]
            if taken < self.batch_size:
                part = np.concatenate([part, np.zeros((self.batch_size - taken, *grad.shape[1:]), np.float32)])
            start += taken
            feed = {name: part if name == "grad_output" else self._value(name, kept) for name in graphs.backward_inputs}
            for name, value in zip(graphs.grads, graphs.backward.run(None, feed)):
                if name in self._selected:
                    total[name] = value if name not in total else total[name] + value
        return total

    def step(self, gradients: Mapping[str, np.ndarray], lr: float) -> None:
        """One optimizer step with ``gradients`` (one per selected tensor: every trainable one unless :meth:`select`
        chose fewer) at learning rate ``lr``; the others, and their optimizer state, are left as they are."""
        checked = checked_floats("gradients", gradients, {name: self._shapes[name] for name in self._selected})
        skipped = [name for name in self.trainable if name not in checked]
        checked |= {name: np.zeros(self._shapes[name], np.float32) for name in skipped}
        if not np.isfinite(lr) or lr < 0:
            raise InvalidBatchError(f"`lr == {lr}`, must be finite and >= 0")
        feed = {"lr": np.asarray(lr, np.float32), **self._state}
        for name in self.trainable:
            feed[f"param.{name}"], feed[f"grad.{name}"] = self._parameters[name], checked[name]
        outputs = self._optimizer.get_outputs()
        for item, value in zip(outputs, self._optimizer.run(None, feed)):
            key = item.name[len("new.") :]
            if key.partition(".")[2] in skipped:
                continue
            if key.startswith("param."):
                self._parameters[key[len("param.") :]] = value
            else:
                self._state[key] = value.reshape(self._state_shapes[key])

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self._parameters.items()}

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        self._parameters = checked_floats("parameters", values, self._shapes)

    def optimizer_state(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self._state.items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._state = checked_floats("optimizer state", state, self._state_shapes)

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write the graphs, the manifest, the weights and the optimizer state to ``folder``."""
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        if target.resolve() != self.folder.resolve():
            for name in (*self.graph_files, MANIFEST):
                atomic_write_bytes(target / name, (self.folder / name).read_bytes())
        atomic_write_bytes(target / "parameters.npz", npz_bytes(self._parameters))
        atomic_write_bytes(target / "optimizer_state.npz", npz_bytes(self._state))
        if self._batch is not None:
            if target.resolve() != self.folder.resolve():
                for name in BATCH_GRAPHS:
                    atomic_write_bytes(target / name, (self.folder / name).read_bytes())
            atomic_write_bytes(target / STATISTICS, npz_bytes(self._statistics))

    # ------------------------------------------------------------------ test-time adaptation (folders exported with batchnorm="adapt")
    @property
    def adaptable(self) -> bool:
        """Whether the folder has the batch-statistics graphs (``export_engine(..., batchnorm="adapt")``)."""
        return self._batch is not None

    def forward_batch_statistics(self, x: np.ndarray | Mapping[str, np.ndarray], *, train: bool) -> np.ndarray:
        """The output with BatchNorm on ``x``'s own statistics, whose running statistics then follow them as torch's
        train-mode BatchNorm's do (momentum, unbiased variance, batch count); ``train=True`` keeps what
        :meth:`backward` needs. ``x`` holds 2 to :attr:`batch_size` rows (one padded run of the graphs)."""
        if self._batch is None:
            raise RuntimeError(f"{self.folder} has no batch-statistics graphs: export it with export_engine(..., batchnorm='adapt')")
        arrays, rows = self._as_inputs(x)
        if not 2 <= rows <= self.batch_size:
            raise InvalidBatchError(f"batch statistics take 2 to {self.batch_size} rows (the graphs' batch size); got {rows}")
        ((chunk, taken),) = self._chunks(arrays, rows)
        chunk[self._rows_name] = (np.arange(self.batch_size) < taken).astype(np.float32)
        output, extras = self._run_forward(self._batch, [(chunk, taken)], train)
        self._statistics = self._followed(extras, taken)
        return output

    def _followed(self, extras: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """The running statistics after one batch's ``batch_mean.<layer>`` / ``batch_var.<layer>`` (torch's update)."""
        updated = dict(self._statistics)
        for layer, spec in self._layers.items():
            prefix = f"{layer}." if layer else ""
            count = updated[f"{prefix}num_batches_tracked"] + 1
            factor = np.float32(1.0 / float(count) if spec["momentum"] is None else spec["momentum"])
            n = rows * int(spec["positions"])
            unbiased = extras[f"batch_var.{layer}"] * np.float32(n / (n - 1))
            mean_name, var_name = f"{prefix}running_mean", f"{prefix}running_var"
            updated[mean_name] = (1 - factor) * updated[mean_name] + factor * extras[f"batch_mean.{layer}"]
            updated[var_name] = (1 - factor) * updated[var_name] + factor * unbiased
            updated[f"{prefix}num_batches_tracked"] = np.asarray(count, np.int64)
        return updated

    def norm_statistics(self) -> dict[str, np.ndarray]:
        """BatchNorm's running statistics and batch counts by buffer name (copies; empty without the adaptation graphs)."""
        return {name: value.copy() for name, value in self._statistics.items()}

    def load_norm_statistics(self, values: Mapping[str, np.ndarray]) -> None:
        """Replace the running statistics with ``values`` (:meth:`norm_statistics`' names, shapes and kinds; finite;
        variances and counts >= 0); ``CheckpointError`` and nothing changed otherwise."""
        self._statistics = _check_statistics("statistics", values, self._statistic_shapes, self._layers)

    def _load_batch_graphs(self, manifest: Mapping[str, Any], ort: Any, options: Any) -> _Graphs | None:
        if "batch" not in manifest:
            return None
        sessions = []
        for graph in BATCH_GRAPHS:
            path = self.folder / graph
            if not path.is_file() or path.is_symlink():
                raise ArtifactError(f"{self.folder} lacks {graph} (or it is not a regular file)")
            sessions.append(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
        return self._graph_pair(sessions[0], sessions[1], manifest["batch"], *BATCH_GRAPHS)

    def _load_statistics(self) -> dict[str, np.ndarray]:
        try:
            return _check_statistics(STATISTICS, read_npz(self.folder / STATISTICS, _MAX_STATE), self._statistic_shapes, self._layers)
        except CheckpointError as error:
            raise ArtifactError(str(error)) from None
