"""``taste-cl serve-demo``'s server answers with regular files inside its roots only.

A symbolic link in the artifacts folder (to ``/etc/passwd``, to a folder outside the roots, even
to a file inside them) and a FIFO are answered with 404, without being opened. The server runs on
127.0.0.1 on a minimal checkout (the page and stand-ins for the onnxruntime-web bundles).
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from taste_cl.cli.serve_demo import _BUNDLES, _ORT_BUNDLE, DemoServer


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


@pytest.fixture
def served(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout (page, web folder with the bundle) and an artifacts folder planted with links and a FIFO."""
    checkout, artifacts, outside = tmp_path / "checkout", tmp_path / "artifacts", tmp_path / "outside"
    (checkout / "examples" / "web").mkdir(parents=True)
    (checkout / "examples" / "web" / "index.html").write_text("the demo page")
    for bundle in _BUNDLES:  # the training build's (taste_cl_web.js) and current onnxruntime-web's (taste_cl_engine.js)
        (checkout / "web" / bundle).parent.mkdir(parents=True)
        (checkout / "web" / bundle).write_text("export {}")
    outside.mkdir()
    (outside / "secret.txt").write_text("a secret")
    artifacts.mkdir()
    (artifacts / "web.json").write_text('{"classes": 10}')
    (artifacts / "passwd").symlink_to("/etc/passwd")
    (artifacts / "outside").symlink_to(outside)
    (artifacts / "inner").symlink_to(artifacts / "web.json")
    (artifacts / "sub").mkdir()
    (artifacts / "sub" / "index.html").symlink_to(outside / "secret.txt")  # served in the folder's place
    os.mkfifo(artifacts / "fifo")
    return checkout, artifacts


@pytest.mark.skipif(not Path("/etc/passwd").is_file(), reason="needs /etc/passwd to link to")
def test_links_and_special_files_in_the_artifacts_folder_are_never_served(served: tuple[Path, Path]) -> None:
    checkout, artifacts = served
    server = DemoServer(artifacts, root=checkout).start()
    try:
        for path, status, body in [
            ("artifacts/web.json", 200, b'{"classes": 10}'),
            ("", 200, b"the demo page"),
            ("web/" + _ORT_BUNDLE.as_posix(), 200, b"export {}"),
            ("artifacts/passwd", 404, b""),
            ("artifacts/outside/secret.txt", 404, b""),
            ("artifacts/outside/", 404, b""),
            ("artifacts/inner", 404, b""),
            ("artifacts/sub/", 404, b""),
            ("artifacts/fifo", 404, b""),
            ("artifacts/%00", 404, b""),
        ]:
            assert _get(server.url + path) == (status, body), path
        status, listing = _get(server.url + "artifacts/")
        assert status == 200 and b"web.json" in listing  # a folder still lists its names
    finally:
        with contextlib.suppress(OSError):  # a server that opened the FIFO is waiting for a writer: release it
            os.close(os.open(artifacts / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        server.stop()
