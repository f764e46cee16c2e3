"""``taste-cl serve-demo``: personalise a digits model in the browser, served on 127.0.0.1.

Serves the demo page (``examples/web/``), the browser learners (``web/``, with
``onnxruntime-web`` installed by ``npm install`` in that folder) and an artifact folder.
Without ``--artifacts`` it trains the reference digits learner (as ``taste-cl export`` does),
exports it with ``backend="onnx_engine"`` and writes its browser folder
(:func:`taste_cl.adapters.web.engine_web.export_web`, the monitor left out): the page trains it with
``web/taste_cl_engine.js`` on current onnxruntime-web. ``--artifacts`` takes a browser folder (a
``web.json``: the page picks the learner its format names), an ``onnx_engine`` folder (its browser
folder is written first, the monitor left out) or an ``onnxruntime`` folder (made web-compatible
for the deprecated training build's learner, ``web/taste_cl_web.js``, with
:func:`taste_cl.adapters.web.compat.make_web_compatible`). Needs a source checkout (the page and
the learners are not part of the wheel) and the ``[onnx]`` extra (``[onnx-training]`` for an ``onnxruntime`` folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from taste_cl.cli.console import plain_text

__all__ = ["HOST", "DemoServer", "browser_tools", "drive_browser", "main", "repo_root"]

HOST = "127.0.0.1"  # never another interface: the page trains on what the user draws
_MIME_TYPES = {
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".wasm": "application/wasm",
    ".json": "application/json",
}
_ORT_BUNDLE = Path("node_modules/onnxruntime-web-training/dist/ort.training.wasm.min.mjs")  # taste_cl_web.js (onnxruntime-web 1.19.2)
_ENGINE_BUNDLE = Path("node_modules/onnxruntime-web/dist/ort.wasm.min.mjs")  # taste_cl_engine.js (current onnxruntime-web)
_BUNDLES = (_ORT_BUNDLE, _ENGINE_BUNDLE)


def repo_root() -> Path:
    """The source checkout holding ``web/`` and ``examples/web/``: this module's, else the working folder.

    An installed wheel has neither folder, so from one run the command in a checkout.
    """
    for candidate in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (candidate / "web" / "taste_cl_web.js").is_file() and (candidate / "examples" / "web").is_dir():
            return candidate
    raise FileNotFoundError("web/ and examples/web/ not found: run this from a taste_cl source checkout")


_INDEX_PAGES = ("index.html", "index.htm")  # what SimpleHTTPRequestHandler serves for a folder


def _plain(path: Path, root: Path) -> bool:
    """Whether ``path`` is a regular file or a folder inside ``root`` (resolved) reached through no symbolic link."""
    try:
        mode = path.lstat().st_mode
        resolved = path.resolve(strict=True)
    except (OSError, ValueError, RuntimeError):  # missing, a NUL in the name, a link loop
        return False
    return resolved == path and resolved.is_relative_to(root) and (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _servable(path: Path, root: Path) -> bool:
    """Whether ``path`` may be served from ``root``: a regular file, or a folder whose index pages (served
    in its place) are, inside the root and reached through no symbolic link (a link in the artifacts folder
    could lead anywhere: ``/etc/passwd``, the user's home); FIFOs and devices are never opened."""
    if not _plain(path, root):
        return False
    return not path.is_dir() or all(_plain(path / page, root) for page in _INDEX_PAGES if os.path.lexists(path / page))


class _Handler(SimpleHTTPRequestHandler):
    """Static files from three roots: ``/web/``, ``/artifacts/`` and the page for everything else.

    Only regular files (and folder listings) inside the roots, reached through no symbolic link,
    are served; anything else is a 404, answered without opening it."""

    def __init__(self, *args: object, roots: dict[str, Path], **kwargs: object) -> None:
        self.roots = roots
        self.extensions_map = {**self.extensions_map, **_MIME_TYPES}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def translate_path(self, path: str) -> str:
        forbidden = str(self.roots[""] / "__forbidden__")  # a 404: never leave the served roots
        parts = [p for p in unquote(urlsplit(path).path).split("/") if p]
        if any(p in (".", "..") or "\\" in p for p in parts):
            return forbidden
        prefix = parts[0] if parts and parts[0] in self.roots else ""
        rest = parts[1:] if prefix else parts
        target = self.roots[prefix].joinpath(*rest)
        return str(target) if _servable(target, self.roots[prefix]) else forbidden

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")  # a re-export must never be mixed with a cached one
        super().end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


class DemoServer:
    """The demo's static server on ``127.0.0.1:port`` (``port=0``: a free one), in a thread.

    >>> server = DemoServer("artifacts")  # doctest: +SKIP
    >>> server.start(); print(server.url); server.stop()  # doctest: +SKIP
    """

    def __init__(self, artifacts: str | Path, *, port: int = 0, root: Path | None = None) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"`port == {port!r}`, must be an int in [0, 65535]")
        base = repo_root() if root is None else root
        roots = {  # resolved: a served path must resolve to itself (no link on the way), inside one of them
            "": (base / "examples" / "web").resolve(),
            "web": (base / "web").resolve(),
            "artifacts": Path(artifacts).resolve(),
        }
        for name, folder in roots.items():
            if not folder.is_dir():
                raise FileNotFoundError(f"demo folder {str(folder)!r} ({name or 'page'}) is missing; serve-demo needs a source checkout")
        if not all((roots["web"] / bundle).is_file() for bundle in _BUNDLES):
            raise FileNotFoundError(f"onnxruntime-web is not installed: run `npm install` in {str(roots['web'])!r}")
        self._httpd = ThreadingHTTPServer((HOST, port), partial(_Handler, roots=roots))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._httpd.server_address[1]}/"

    def start(self) -> DemoServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="taste-cl-demo", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()


def browser_tools(root: Path | None = None) -> tuple[str, list[str]]:
    """Chromium's path and the Node command that runs the driver; FileNotFoundError names what is missing.

    Node >= 20.10 is needed for its WebSocket client (behind a flag before Node 22).
    """
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    node = shutil.which("node")
    missing = [name for name, path in (("chromium", chromium), ("node", node)) if path is None]
    if missing or chromium is None or node is None:
        raise FileNotFoundError(f"{' and '.join(missing)} not found on PATH (apt-get install -y chromium nodejs)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    major_minor = tuple(int(part) for part in version.lstrip("v").split(".")[:2] if part.isdigit())
    if major_minor < (20, 10):
        raise FileNotFoundError(f"node {version or '(unknown version)'} is too old: the browser driver needs Node >= 20.10")
    if not all(((root or repo_root()) / "web" / bundle).is_file() for bundle in _BUNDLES):
        raise FileNotFoundError("onnxruntime-web is not installed: run `npm install` in web/")
    return chromium, [node, "--experimental-websocket"] if major_minor < (22, 0) else [node]


def _wait(process: subprocess.Popen[bytes], pause: Path, on_pause: Callable[[str], None] | None, deadline: float) -> None:
    """Wait for the driver, serving its pauses; TimeoutExpired past ``deadline``."""
    while process.poll() is None:
        if pause.is_file() and on_pause is not None:
            on_pause(pause.read_text())
            pause.unlink()
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(process.args, 0)
        time.sleep(0.02)


def _stop_group(pid_file: Path) -> None:
    """Kill the process group whose id ``pid_file`` holds, if it is still there (drive.mjs stops it itself)."""
    try:
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass


def drive_browser(
    steps: list[dict[str, Any]],
    *,
    timeout_s: float = 600.0,
    root: Path | None = None,
    on_pause: Callable[[str], None] | None = None,
    js_flags: str = "",
) -> dict[str, Any]:
    """Run ``steps`` in one headless Chromium via ``web/tools/drive.mjs``; return its results.

    Steps are ``{"goto": url}``, ``{"reload": True}``, ``{"eval": js, "as": name}``,
    ``{"screenshot": path}`` and ``{"pause": label}``, which calls ``on_pause(label)`` here
    while the page waits (to interleave timings with the browser's). Node and Chromium each
    run in their own process group; Node stops Chromium's, and both are killed by id here if
    still running (e.g. after ``timeout_s``). A failed step raises RuntimeError with the
    page's error. ``js_flags`` go to V8 (``--js-flags``).
    """
    root = root or repo_root()
    chromium, node = browser_tools(root)
    with tempfile.TemporaryDirectory(prefix="taste-cl-drive-") as scratch:
        spec, out = Path(scratch) / "spec.json", Path(scratch) / "out.json"
        spec.write_text(json.dumps({"chromium": chromium, "out": str(out), "steps": steps, "timeout_ms": 300000, "js_flags": js_flags}))
        script = root / "web" / "tools" / "drive.mjs"
        log = Path(scratch) / "driver.log"
        with log.open("w") as sink:
            process = subprocess.Popen(
                [*node, str(script), str(spec)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait(process, Path(f"{out}.pause"), on_pause, time.monotonic() + timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            _stop_group(Path(f"{out}.pid"))
        if not out.is_file():
            raise RuntimeError(f"browser driver wrote no results (exit {process.returncode}): {log.read_text()[-2000:]}")
        results: dict[str, Any] = json.loads(out.read_text())
    if "error" in results:
        raise RuntimeError(f"browser step failed: {results['error']}\n{results.get('browser_stderr', '')[-1500:]}")
    return results


def _export_default(folder: Path, seed: int) -> None:
    """Train the reference digits learner on the five split-digits tasks and export it to the ONNX engine (lr 0.05 on the device)."""
    import torch

    from taste_cl.datasets import split_digits, stream
    from taste_cl.reference import build_digits_learner

    torch.manual_seed(seed)
    learner = build_digits_learner(seed=seed)
    for _, x, y in stream(split_digits(5, seed=seed), 10, seed=seed):
        learner.observe((x, y))
    for group in learner.optimizer.param_groups:
        group["lr"] = 0.05
    learner.export(folder, backend="onnx_engine")


def _browser_folder(folder: Path, scratch: Path) -> Path:
    """The folder the page loads for ``folder``: itself when it has a ``web.json``, else its browser folder (written)."""
    from taste_cl.adapters.onnx_engine.engine import MANIFEST as ENGINE_MANIFEST
    from taste_cl.adapters.web.engine_web import ENGINE_WEB_MANIFEST, export_web

    if (folder / ENGINE_WEB_MANIFEST).is_file():  # either learner's: the page reads its format
        return folder
    if (folder / ENGINE_MANIFEST).is_file():
        web = export_web(folder, scratch / "web", drop_monitor=True).parent
        print(f"wrote the browser folder of {folder} to {web} (the stability-plasticity monitor left out: the browser does not run it)")
        return web
    from taste_cl.adapters.web.compat import make_web_compatible  # the deprecated training build's learner

    make_web_compatible(folder)
    print(f"made {folder} web-compatible (added {ENGINE_WEB_MANIFEST}, optimizer_model.web.onnx, replay.bin)")
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taste-cl serve-demo", description=plain_text(__doc__.splitlines()[0]))
    parser.add_argument(
        "--artifacts",
        help="browser, onnx_engine or onnxruntime artifact folder (default: export the reference learner to the ONNX engine now)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the default export")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="taste-cl-demo-") as scratch:
        folder = Path(args.artifacts) if args.artifacts else Path(scratch) / "artifacts"
        if not args.artifacts:
            _export_default(folder, args.seed)
        folder = _browser_folder(folder, Path(scratch))
        server = DemoServer(folder, port=args.port).start()
        print(f"serving the demo at {server.url} (Ctrl-C to stop)", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl-C: clean up the export
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
