"""Caches are read as regular files only (:func:`taste_cl.state.files.read_regular_file`).

A FIFO, a device (``/dev/zero``, ``/dev/urandom``) or a link in place of the tuner's or the
elastic profiler's cache file is refused at once with the cache's warning, and the learner
measures afresh: never a read that hangs or that grows until memory runs out. The cache reads
run in a child process with a timeout and a memory cap, so a missing check fails the test
instead of hanging it or filling this machine's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from taste_cl.state.files import atomic_write_bytes, read_regular_file

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="FIFOs, /dev/zero and /proc/self/status as on Linux")

ROOT = Path(__file__).resolve().parents[1]
HAZARDS = ["fifo", "/dev/zero", "/dev/urandom"]


def _plant(path: Path, hazard: str) -> None:
    """Put ``hazard`` (a FIFO, or a link to a device) where the cache file ``path`` belongs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if hazard == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(hazard)


# ------------------------------------------------------------------ the shared reader
def _read_in_thread(path: Path, max_bytes: int) -> bytes | BaseException:
    """``read_regular_file(path, max_bytes)``'s bytes or error; fails the test if it blocks (a FIFO is released)."""
    outcome: list[bytes | BaseException] = []

    def read() -> None:
        try:
            outcome.append(read_regular_file(path, max_bytes))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer that closes: the blocked read ends
        pytest.fail(f"reading {path} blocked")
    return outcome[0]


def test_a_regular_file_within_the_bound_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    atomic_write_bytes(path, b"x" * 100)
    assert _read_in_thread(path, 100) == b"x" * 100  # the bound is inclusive


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: os.mkfifo(p), "is not a regular file"),
        (lambda p: p.symlink_to("/dev/zero"), "is a symbolic link"),
        (lambda p: p.symlink_to(p.with_name("good.json")), "is a symbolic link"),  # links are never followed
        (lambda p: p.mkdir(), "is not a regular file"),
        (lambda p: p.write_bytes(b"x" * 101), "is 101 bytes, over the bound of 100"),
    ],
    ids=["fifo", "link-to-dev-zero", "link-to-a-regular-file", "folder", "oversize"],
)
def test_anything_but_a_regular_file_within_the_bound_is_refused_without_blocking(tmp_path: Path, make, message: str) -> None:
    atomic_write_bytes(tmp_path / "good.json", b"{}")
    path = tmp_path / "cache.json"
    make(path)
    outcome = _read_in_thread(path, 100)
    assert isinstance(outcome, ValueError) and message in str(outcome) and repr(str(path)) in str(outcome)


def test_no_file_is_a_miss_not_a_refusal(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("x")
    for path, error in [(tmp_path / "none.json", FileNotFoundError), (tmp_path / "a_file" / "cache.json", NotADirectoryError)]:
        assert isinstance(_read_in_thread(path, 100), error)


# ------------------------------------------------------------------ the caches, in a child
_CHILD = """
import json, resource, sys, warnings
from pathlib import Path
{imports}
# Cap the address space just above what the imports took: a read that never ends runs out here, fast.
size_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + (1 << 30), resource.RLIM_INFINITY))
folder = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
{body}
print(json.dumps({{"result": result, "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught]}}))
"""

_TUNER = (
    "from taste_cl.tuning.cache import SurrogateCache",
    "    result = SurrogateCache(folder).load('KEY') is None",
)
_ELASTIC = (
    "import torch\nfrom torch import nn\nfrom taste_cl.elastic.cache import load_or_profile",
    "    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))\n"
    "    result = load_or_profile(model, torch.randn(8, 6), cache_dir=folder, warmup=0, repeats=2)[1]",
)


def _in_child(code: tuple[str, str], folder: Path) -> dict:
    script = _CHILD.format(imports=code[0], body=code[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TASTE_CL_CACHE_DIR": str(folder / "default")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), str(folder)], env=env, capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("reading the cache blocked for 120 s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hazard", HAZARDS)
def test_the_tuner_cache_refuses_a_fifo_or_device_and_tunes_afresh(tmp_path: Path, hazard: str) -> None:
    from taste_cl.tuning.cache import SurrogateCache

    _plant(SurrogateCache(tmp_path).path("KEY"), hazard)
    outcome = _in_child(_TUNER, tmp_path)
    assert outcome["result"] is True  # no cached surface: the tuner measures afresh
    assert any(w.startswith("TunerCacheWarning: ignoring corrupt tuner cache") for w in outcome["warnings"]), outcome


@pytest.mark.parametrize("hazard", HAZARDS)
def test_the_elastic_profile_cache_refuses_a_fifo_or_device_and_profiles_afresh(tmp_path: Path, hazard: str) -> None:
    from taste_cl.elastic.cache import CACHE_FILE

    path = tmp_path / CACHE_FILE
    _plant(path, hazard)
    outcome = _in_child(_ELASTIC, tmp_path)
    assert outcome["result"] is False  # profiled afresh, not read from the cache
    assert any(w.startswith("ProfileCacheWarning: elastic profile cache") and "unusable" in w for w in outcome["warnings"]), outcome
    assert path.is_file() and not path.is_symlink() and "profiles" in json.loads(path.read_text())  # written anew in its place
