"""Every fenced ```python block of README.md and docs/*.md runs on its own, so the docs cannot drift.

Each block runs alone (nothing from the blocks before it), in a fresh namespace, in a
temporary working directory, under a time limit. A block that is not meant to run alone
(it shows a call inside a larger program) is marked by the line ``<!-- fragment -->``
right before its opening fence. A block that starts real processes for minutes (the
Flower deployment) is marked ``<!-- slow -->``: it runs under the ``slow`` marker, with a
longer limit, in CI's slow step. A block needing an optional extra that is not installed
is skipped (the ``[all]`` extra installs them all). A block needing ONNX Runtime's training
build (``backend="onnxruntime"``; the ``[onnx-training]`` extra, outside ``[all]``) is marked
``<!-- training-build -->``: it carries the ``training_build`` marker, skipped without the build
and run in CI's training venv.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from taste_cl.exceptions import MissingDependencyError

ROOT = Path(__file__).resolve().parents[1]
FRAGMENT = "<!-- fragment -->"
SLOW = "<!-- slow -->"
TRAINING_BUILD = "<!-- training-build -->"
TIMEOUT_S = 600  # a hang guard, not a speed bar: a fleet block took 115 s alone at load 8, and more beside two CPU hogs
SLOW_TIMEOUT_S = 900
# top-level modules of the optional extras: a block that needs a missing one is skipped
EXTRAS = {"avalanche", "flwr", "onnx", "onnxruntime", "peft", "ray", "torchvision", "transformers"}
_FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, code)`` of each ```python block of ``path`` not marked as a fragment."""
    for line, code, _ in _marked_blocks(path):
        yield line, code


def _marked_blocks(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, code, the line before its fence)`` of each runnable block of ``path``."""
    text = path.read_text()
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before != FRAGMENT:
            yield text.count("\n", 0, match.start()) + 1, match.group(1), before


def _cases() -> list[pytest.param]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    marks = {SLOW: [pytest.mark.slow], TRAINING_BUILD: [pytest.mark.training_build]}
    return [
        pytest.param(code, SLOW_TIMEOUT_S if before == SLOW else TIMEOUT_S, id=f"{path.relative_to(ROOT)}:{line}", marks=marks.get(before, []))
        for path in files
        for line, code, before in _marked_blocks(path)
    ]


def test_the_extraction_finds_blocks_and_honours_the_fragment_marker(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n<!-- fragment -->\n```python\nundefined_name\n```\n\n```bash\nls\n```\n")
    assert list(python_blocks(page)) == [(3, "x = 1\n")]
    assert len(_cases()) >= 10


def _timeout(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("the block ran past its time limit")


@pytest.mark.parametrize(("code", "limit_s"), _cases())
def test_block_runs_alone(code: str, limit_s: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files a block writes (ckpt/, artifacts/) land here
    monkeypatch.setenv("TASTE_CL_CACHE_DIR", str(tmp_path / "cache"))  # tuner/profiler caches too
    if not hasattr(signal, "SIGALRM"):
        pytest.skip("the time limit needs SIGALRM (POSIX)")
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(limit_s)
    try:
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__main__"})
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in EXTRAS:
            raise
        pytest.skip(f"needs the optional {error.name!r}")
    except MissingDependencyError as error:
        pytest.skip(str(error))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ docs/architecture.md tells the truth
_ENTRY = re.compile(r"^[\w.]+(?:\.py|/)$")


def architecture_tree(text: str) -> set[str]:
    """Repository paths the page's first ```text tree names: a line's first word is an entry when it is a
    module (``name.py``) or a folder (``name/``), nested by two-space indentation; a line of module names
    alone (``a.py  b.py``) names them all. Other lines continue a description."""
    block = text.split("## The rooms", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    folders: list[tuple[int, str]] = []
    paths: set[str] = set()
    for line in block.splitlines():
        words = line.split()
        if not words or not _ENTRY.match(words[0]):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        folders = [(d, f) for d, f in folders if d < depth]
        parent = "".join(f for _, f in folders)
        entries = words if all(w.endswith(".py") for w in words) else words[:1]
        for entry in entries:
            paths.add(parent + entry)
            if entry.endswith("/"):
                folders.append((depth, entry))
    return paths


def test_the_architecture_tree_reader_nests_by_indentation() -> None:
    page = "## The rooms\n\n```text\npkg/\n  a.py    about a\n          b.py: named in a description\n  sub/   a folder\n    c.py  d.py\n  e.py\n```\n"
    assert architecture_tree(page) == {"pkg/", "pkg/a.py", "pkg/sub/", "pkg/sub/c.py", "pkg/sub/d.py", "pkg/e.py"}


def test_every_path_on_the_architecture_page_exists_and_every_module_is_on_it() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = architecture_tree(text)
    named = tree | set(re.findall(r"`(taste_cl/[\w/]+(?:\.py|/)?)`", text))
    assert [p for p in sorted(named) if not (ROOT / p).exists()] == []
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "taste_cl").rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - tree) == []
    folders = {str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "taste_cl").rglob("__init__.py")}
    assert sorted(folders - tree) == []
