"""The first run of freshly built ONNX Runtime artifacts, in a child process.

ONNX Runtime's training kernels can kill the process that runs them instead of raising
(1.19's ``AveragePoolGrad`` divides by zero on a dynamic batch: SIGFPE, no exception). A
known crash is refused from the graph before anything runs (:mod:`.build`); as a net for the
unknown ones, :func:`trial_run` loads the staged artifacts with the device runtime
(:class:`~taste_cl.adapters.onnxruntime.session.OrtSession`) in a child Python and trains
one step on the example batch and one on a batch of another size, then runs the eval
graph. A child killed by a signal or failing in ONNX Runtime becomes an
:class:`~taste_cl.adapters.device.artifacts.ExportError` naming the signal, the step and
ONNX Runtime's message; the exporting process lives on.

The child imports ONNX Runtime's bindings only, as on a device (its package otherwise imports
``onnxruntime.training`` and with it torch and onnx, seconds that nothing here needs), and
reads only what the parent wrote: the staged folder, a JSON manifest and an ``.npz`` feed
loaded without pickle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from taste_cl.adapters.device.artifacts import ExportError
from taste_cl.exceptions import TrialFailure

__all__ = ["TIMEOUT_S", "TrialFailure", "trial_run"]

TIMEOUT_S = 600.0  # the child's whole run; a first training step that takes longer is refused as hung
_STEP = "taste_cl-trial step: "
_ERROR = "taste_cl-trial error: "
_MANIFEST, _FEED = "manifest.json", "feed.npz"
_TRAINING_PACKAGE = "onnxruntime.training"


def trial_run(folder: Path, manifest: Mapping[str, Any], inputs: Sequence[np.ndarray], labels: np.ndarray,
              *, timeout: float = TIMEOUT_S) -> None:  # fmt: skip
    """Load ``folder`` with ``manifest`` (its ``"files"`` may be empty) in a child and train on the feed; raise :class:`TrialFailure`."""
    with tempfile.TemporaryDirectory(prefix="taste_cl_trial_") as scratch:
        Path(scratch, _MANIFEST).write_text(json.dumps(dict(manifest)))
        np.savez(Path(scratch, _FEED), y=labels, **{f"x{i}": array for i, array in enumerate(inputs)})  # type: ignore[arg-type]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}  # what the parent imports from
        command = [sys.executable, "-m", __name__, str(folder), scratch]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        except subprocess.TimeoutExpired as error:
            raise TrialFailure(_last(error.stdout, _STEP, "loading the artifacts"), None, f"no result after {timeout:g} s") from error
        except OSError as error:
            raise ExportError(f"cannot start a child Python ({sys.executable!r}) to try the artifacts: {error}") from error
    if done.returncode == 0:
        return
    step = _last(done.stdout, _STEP, "loading the artifacts")
    if done.returncode < 0:
        raise TrialFailure(step, _signal_name(-done.returncode), "a crash inside ONNX Runtime, which would kill the app on the device too")
    fallback = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    raise TrialFailure(step, None, _last(done.stdout, _ERROR, fallback)[:1000])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last(output: str | bytes | None, marker: str, default: str) -> str:
    """The text after ``marker`` on the child's last line carrying it."""
    text = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    lines = [line.removeprefix(marker) for line in text.splitlines() if line.startswith(marker)]
    return lines[-1] if lines else default


def _import_onnxruntime_bindings() -> None:
    """Import ONNX Runtime as a device would: its package imports ``onnxruntime.training`` (torch, onnx: seconds) when present."""
    saved = sys.modules.get(_TRAINING_PACKAGE)
    sys.modules[_TRAINING_PACKAGE] = None  # type: ignore[assignment]  # its import fails; ORT then skips its torch parts
    try:
        from onnxruntime.capi import _pybind_state  # noqa: F401
    finally:
        if saved is None:
            del sys.modules[_TRAINING_PACKAGE]
        else:
            sys.modules[_TRAINING_PACKAGE] = saved


def _child(folder: Path, scratch: Path) -> None:
    def step(what: str) -> None:
        print(_STEP + what, flush=True)

    _import_onnxruntime_bindings()
    from taste_cl.adapters.onnxruntime.manifest import parse_manifest
    from taste_cl.adapters.onnxruntime.session import OrtSession

    spec = parse_manifest(json.loads((scratch / _MANIFEST).read_text()))
    with np.load(scratch / _FEED, allow_pickle=False) as feed:
        labels = feed["y"]
        inputs = [feed[f"x{i}"] for i in range(len(feed.files) - 1)]
    step("loading the artifacts")
    session = OrtSession(folder, spec)
    for batch in (inputs, [np.concatenate([array, array[:1]]) for array in inputs]):
        rows = batch[0].shape[0]
        step(f"a training step on {rows} rows")
        session.train_step(batch, np.concatenate([labels, labels[:1]])[:rows])
    step("an eval step")
    session.predict(inputs)


if __name__ == "__main__":
    try:
        _child(Path(sys.argv[1]), Path(sys.argv[2]))
    except Exception as error:  # noqa: BLE001 - any failure is reported to the parent as one line
        print(_ERROR + f"{type(error).__name__}: " + " ".join(str(error).split()), flush=True)
        sys.exit(3)
