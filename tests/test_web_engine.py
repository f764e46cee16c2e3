"""The browser learner on current onnxruntime-web (``web/taste_cl_engine.js``) over the ONNX engine's graphs.

Without a browser: :func:`~taste_cl.adapters.web.engine_web.export_web` writes what the page loads (the
engine's tensors and buffer as raw binaries, hashes and sizes), the same bytes without torch; it refuses,
naming it, what the JS loop does not run (strategies, a file or a setting it does not know, the monitor
unless dropped on request) and an onnxruntime folder; serve-demo serves an engine folder through it.

In headless Chromium (skipped, with the reason, without Chromium, Node >= 20.10 or ``npm install`` in web/),
one browser run checks: 20 web steps (batches of 8 and 13 rows: chunked and padded) against eager torch on
the same exported learner, for an MLP with SGD (momentum, Nesterov, weight decay) and a CNN with AdamW (loss
within 1e-5 at every step, logits within 1e-4 after: the issue's bar), and against the Python engine (1e-6,
1e-5); the device update guard undoing a step at 1e5 x the learning rate and skipping a NaN loss, as the
Python OnnxEngineLearner does on the same folder, with the same parameters after; observe() with replay and
a reload that resumes from IndexedDB; the demo page's correct(); and tampered files (a changed byte, a
truncated file, an out-of-bounds web.json value, a re-signed buffer with a bad label) refused before use.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rehash, run_without_torch
from torch import nn

pytest.importorskip("onnxscript")

from taste_cl import OnlineLearner
from taste_cl.adapters.onnx_engine.learner import OnnxEngineLearner
from taste_cl.adapters.web.engine_web import ENGINE_WEB_FORMAT, export_web
from taste_cl.cli.serve_demo import DemoServer, browser_tools, drive_browser
from taste_cl.datasets import make_mlp, split_digits
from taste_cl.engine.losses import experience_replay
from taste_cl.exceptions import WebCompatibilityError
from taste_cl.replay import ReservoirReplay

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20


def _digits() -> tuple[np.ndarray, np.ndarray]:
    task = split_digits(1)[0]
    return task.x_train.numpy(), task.y_train.numpy()


def _learners() -> dict[str, OnlineLearner]:
    """The MLP with SGD (momentum, Nesterov, weight decay) and a reservoir, and a CNN with AdamW and no buffer."""
    mlp = make_mlp(seed=0)
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    return {
        "mlp_sgd": OnlineLearner(
            mlp,
            optimizer=torch.optim.SGD(mlp.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
            replay=ReservoirReplay(200, seed=0),
            replay_batch_size=10,
            train_iterations=3,
        ),
        "cnn_adamw": OnlineLearner(cnn, optimizer=torch.optim.AdamW(cnn.parameters(), lr=0.01, weight_decay=0.01), replay=None),
    }


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = _digits()
    sizes = [8 if i % 2 == 0 else 13 for i in range(STEPS)]  # 13 rows: two chunks of the graphs' 8, the second padded
    starts = np.cumsum([0, *sizes[:-1]]) + 100
    return [(x[s : s + n], y[s : s + n]) for s, n in zip(starts, sizes)]


def _torch_reference(twin: tuple[nn.Module, torch.optim.Optimizer], batches, probe: np.ndarray) -> dict[str, object]:
    """Eager torch from the exported state (model and optimizer state): each step's loss, then the probe's logits."""
    model, optimizer = twin
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        return {"losses": losses, "logits": model(torch.from_numpy(probe)).numpy()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[nn.Module, torch.optim.Optimizer]]]:
    """The browser folders of two exported learners (``mlp_sgd``, ``cnn_adamw``; graphs at batch 8, their onnx_engine
    folders under ``engines/``) and each learner's eager twin at export (model and optimizer copied together)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("web-engine")
    x, y = _digits()
    twins = {}
    for name, learner in _learners().items():
        for start in range(0, 60, 10):
            learner.observe((torch.from_numpy(x[start : start + 10]), torch.from_numpy(y[start : start + 10])))
        twins[name] = copy.deepcopy((learner.model, learner.optimizer))
        learner.export(root / "engines" / name, backend="onnx_engine", batch_size=8)
        export_web(root / "engines" / name, root / name, drop_monitor=True)
    return root, twins


# ----------------------------------------------------------------------------- no browser
def test_the_web_folder_holds_the_engines_tensors_and_the_loop_it_runs(folders) -> None:
    root, _ = folders
    web = json.loads((root / "mlp_sgd" / "web.json").read_text())
    assert web["format"] == ENGINE_WEB_FORMAT and web["dropped"] == ["monitor"] and web["batch_size"] == 8
    assert web["settings"] == {"lr": 0.05, "replay": "reservoir", "capacity": 200, "replay_batch_size": 10, "train_iterations": 3,
                               "max_grad_norm": None, "seed": 0, "strategy": "er"}  # fmt: skip
    assert web["guard"]["settings"] == {"mode": "auto", "max_lr": 1e6, "update_bound": 1e4, "update_jump": 1e3, "protect_first": 0}
    device = OnnxEngineLearner.from_artifacts(root / "engines" / "mlp_sgd")
    for kind, arrays in (("parameters", device.engine.parameters()), ("optimizer", device.engine.optimizer_state())):
        raw = (root / "mlp_sgd" / web[kind]["file"]).read_bytes()
        assert [t["name"] for t in web[kind]["tensors"]] == list(arrays)
        for entry in web[kind]["tensors"]:
            value = np.frombuffer(raw, "<f4", count=int(np.prod(entry["shape"])), offset=4 * entry["offset"]).reshape(entry["shape"])
            np.testing.assert_array_equal(value, arrays[entry["name"]], err_msg=entry["name"])
    assert web["optimizer"]["tensors"][0] == {"name": "step", "shape": [], "offset": 0}  # the scalar stays a scalar
    replay, raw = web["replay"], (root / "mlp_sgd" / "replay.bin").read_bytes()
    assert replay["size"] == replay["seen"] == 60 and replay["labels_offset"] == 60 * 64 * 4
    _, arrays = device.state()
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4", count=60 * 64).reshape(60, 64), arrays["replay.x"])
    np.testing.assert_array_equal(np.frombuffer(raw, "<i4", offset=replay["labels_offset"]), arrays["replay.y"])
    assert json.loads((root / "cnn_adamw" / "web.json").read_text())["replay"] is None


def _settings(**changes: object):
    """A damage: the learner folder's manifest settings changed, the folder re-signed (a valid folder of another learner)."""
    return lambda folder: rehash(folder, lambda m: m["settings"].update(changes))


def _extra_file(folder: Path) -> None:
    """A damage: a file the export does not know (as a later feature would add), listed and signed."""
    (folder / "cut_1.onnx").write_bytes(b"a graph of a later feature")
    rehash(folder)


@pytest.mark.parametrize(
    ("damage", "feature"),
    [
        (_settings(strategy="er_ace"), "the strategy 'er_ace'"),
        (_settings(strategy="der++"), "the strategy 'der++'"),
        (_settings(strategy="lwf"), "the strategy 'lwf'"),
        (_extra_file, "what the files ['cut_1.onnx'] hold"),
        (None, "the stability-plasticity monitor"),
    ],
    ids=["er-ace", "der++", "lwf", "unknown-file", "monitor"],
)
def test_what_the_js_loop_does_not_run_is_refused_by_name(folders, tmp_path: Path, damage, feature: str) -> None:
    source = Path(shutil.copytree(folders[0] / "engines" / "mlp_sgd", tmp_path / "learner"))
    if damage is not None:
        damage(source)
    with pytest.raises(WebCompatibilityError, match=re.escape(f"the browser learner does not run {feature}")):
        export_web(source, tmp_path / "web", drop_monitor=damage is not None)
    assert not (tmp_path / "web").exists()  # nothing written


def test_a_setting_the_export_does_not_know_is_refused(folders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner that gains a setting (a later feature) is refused by name, not exported without it."""
    known = OnnxEngineLearner.current_settings
    monkeypatch.setattr(OnnxEngineLearner, "current_settings", lambda self: {**known(self), "elastic": {"budget": 0.5}})
    with pytest.raises(WebCompatibilityError, match=re.escape("does not run the settings ['elastic']")):
        export_web(folders[0] / "engines" / "mlp_sgd", tmp_path / "web", drop_monitor=True)


def test_export_web_runs_without_torch_and_writes_the_same_folder(folders, tmp_path: Path) -> None:
    root, _ = folders
    script = """
        import sys
        from taste_cl.adapters.web.engine_web import export_web
        export_web(sys.argv[1], sys.argv[2], drop_monitor=True)
        assert "torch" not in sys.modules
    """
    result = run_without_torch(script, str(root / "engines" / "mlp_sgd"), str(tmp_path / "web"))
    assert result.returncode == 0, result.stderr[-2000:]
    written = sorted(p.name for p in (tmp_path / "web").iterdir())
    assert written == sorted(p.name for p in (root / "mlp_sgd").iterdir())
    for name in written:
        assert (tmp_path / "web" / name).read_bytes() == (root / "mlp_sgd" / name).read_bytes(), name


def test_an_onnxruntime_folder_is_sent_to_make_web_compatible(folders, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(folders[0] / "engines" / "mlp_sgd", tmp_path / "ort"))
    rehash(folder, lambda m: m.update(backend="onnxruntime"))
    with pytest.raises(WebCompatibilityError, match="holds 'onnxruntime' artifacts; export_web takes an onnx_engine learner folder"):
        export_web(folder, tmp_path / "web", drop_monitor=True)


def test_serve_demo_serves_an_onnx_engine_folder_through_its_browser_folder(folders, tmp_path: Path) -> None:
    from taste_cl.cli.serve_demo import _browser_folder

    web = _browser_folder(folders[0] / "engines" / "mlp_sgd", tmp_path)
    assert web == tmp_path / "web" and json.loads((web / "web.json").read_text())["format"] == ENGINE_WEB_FORMAT
    assert _browser_folder(web, tmp_path / "again") == web  # a browser folder is served as it is
    assert not (tmp_path / "again").exists()


# ------------------------------------------------------------------------------ in the browser
def _why_no_browser() -> str:
    try:
        browser_tools(ROOT)
    except FileNotFoundError as error:
        return f"browser test needs Chromium, Node and web/node_modules: {error}"
    return ""


_NO_BROWSER = _why_no_browser()


def _js(value: object) -> str:
    return json.dumps(value)


def _rows(x: np.ndarray) -> list[float]:
    return x.ravel().tolist()


@pytest.mark.browser
@pytest.mark.skipif(bool(_NO_BROWSER), reason=_NO_BROWSER)
def test_web_steps_match_torch_the_guard_refuses_as_python_and_tampering_is_refused(folders) -> None:
    root, twins = folders
    x, y = _digits()
    batches, probe = _batches(), x[400:406]
    tampered = ("flipped", "truncated", "bad_lr", "bad_label")
    for name in tampered:
        shutil.copytree(root / "mlp_sgd", root / name)
    raw = bytearray((root / "flipped" / "parameters.bin").read_bytes())
    raw[100] ^= 0x40
    (root / "flipped" / "parameters.bin").write_bytes(bytes(raw))
    (root / "truncated" / "backward.onnx").write_bytes((root / "mlp_sgd" / "backward.onnx").read_bytes()[:-10])
    web = json.loads((root / "mlp_sgd" / "web.json").read_text())
    web["settings"]["lr"] = float("1e9")
    (root / "bad_lr" / "web.json").write_text(json.dumps(web))
    replay = bytearray((root / "mlp_sgd" / "replay.bin").read_bytes())  # the last label 99, the file re-signed
    replay[-4:] = (99).to_bytes(4, "little")
    (root / "bad_label" / "replay.bin").write_bytes(bytes(replay))
    web = json.loads((root / "mlp_sgd" / "web.json").read_text())
    web["files"]["replay.bin"]["sha256"] = hashlib.sha256(bytes(replay)).hexdigest()
    (root / "bad_label" / "web.json").write_text(json.dumps(web))

    learn = (
        "(async () => { const l = demo.learner; const losses = [];"
        f" for (const [x, y] of {_js([[_rows(b), c.tolist()] for b, c in batches])}) losses.push((await l.trainStep(x, y)).loss);"
        f" return {{losses, logits: Array.from(await l.predict({_js(_rows(probe))})), backend: l.ort.env.versions}}; }})()"
    )
    healthy, poison = (x[200:210], y[200:210]), (x[210:220], y[210:220])
    guard = (
        "(async () => { const l = demo.learner; l.replayBatchSize = 0; l.trainIterations = 1; const out = []; const lr = l.lr;"
        f" for (let i = 0; i < 3; i += 1) out.push(await l.observe({_js(_rows(healthy[0]))}, {_js(healthy[1].tolist())}));"
        f" const before = Array.from(await l.predict({_js(_rows(probe))}));"
        f" l.lr = lr * 1e5; out.push(await l.observe({_js(_rows(poison[0]))}, {_js(poison[1].tolist())})); l.lr = lr;"
        f" out.push(await l.observe(new Array(640).fill(3e38), {_js(poison[1].tolist())}));"  # finite rows, a NaN loss
        f" const after = Array.from(await l.predict({_js(_rows(probe))}));"
        f" out.push(await l.observe({_js(_rows(poison[0]))}, {_js(poison[1].tolist())}));"
        f" return {{stats: out, before, after, logits: Array.from(await l.predict({_js(_rows(probe))}))}}; }})()"
    )
    stream = [[_rows(x[i : i + 3]), y[i : i + 3].tolist()] for i in (300, 303)]
    observe = (
        "(async () => { const l = demo.learner; const out = [];"
        f" for (const [x, y] of {_js(stream)}) out.push(await l.observe(x, y));"
        f" return {{stats: out, seen: l.samplesSeen, replay: l.replay.size, logits: Array.from(await l.predict({_js(_rows(probe))}))}}; }})()"
    )
    resumed = (
        f"(async () => ({{resumed: demo.learner.resumed, seen: demo.learner.samplesSeen, replay: demo.learner.replay.size,"
        f" logits: Array.from(await demo.learner.predict({_js(_rows(probe))}))}}))()"
    )
    refusals = (
        "(async () => { const l = demo.learner; const out = {};"
        f" for (const name of {_js(list(tampered))})"
        "   try { await l.constructor.load(`/artifacts/${name}/`, { ort: l.ort, fresh: true }); out[name] = 'loaded'; }"
        "   catch (e) { out[name] = e.constructor.name + ': ' + e.message; }"
        " return out; })()"
    )
    steps: list[dict[str, object]] = []
    for name in ("mlp_sgd", "cnn_adamw"):
        steps += [{"goto": f"{{url}}?artifacts=/artifacts/{name}/&fresh=1"}, {"eval": learn, "as": name}]
    steps += [
        {"goto": "{url}?artifacts=/artifacts/mlp_sgd/&fresh=1"},
        {"eval": guard, "as": "guard"},
        {"goto": "{url}?artifacts=/artifacts/mlp_sgd/&fresh=1"},
        {"eval": observe, "as": "observe"},
        {"reload": True},  # the page dropped fresh=1: resume from IndexedDB
        {"eval": resumed, "as": "resumed"},
        {"eval": refusals, "as": "refusals"},
        {  # the demo page's own path: draw, correct, status line
            "eval": f"demo.setPixels({_js(_rows(x[500:501]))}).then(() => demo.correct({int(y[500])}))"
            ".then((stats) => ({stats, status: document.getElementById('status').textContent}))",
            "as": "demo",
        },
    ]
    server = DemoServer(root, root=ROOT).start()
    try:
        results = drive_browser([{k: v.replace("{url}", server.url) if k == "goto" else v for k, v in s.items()} for s in steps], root=ROOT)
    finally:
        server.stop()

    for name in ("mlp_sgd", "cnn_adamw"):
        got = results[name]
        assert got["backend"]["web"] == json.loads((ROOT / "web" / "package.json").read_text())["dependencies"]["onnxruntime-web"]
        reference = _torch_reference(twins[name], batches, probe)  # the issue's bar
        np.testing.assert_allclose(got["losses"], reference["losses"], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.reshape(got["logits"], (6, 10)), reference["logits"], rtol=0, atol=1e-4, err_msg=name)
        # what is left is the engine's own distance from torch (AdamW's first steps amplify it): the browser is the Python engine
        engine = OnnxEngineLearner.from_artifacts(root / "engines" / name).engine
        lr = json.loads((root / name / "web.json").read_text())["settings"]["lr"]
        python_losses = []
        for bx, by in batches:
            loss, grad = experience_replay(engine.forward(bx, train=True), by, len(by))
            engine.step(engine.backward(grad), lr)
            python_losses.append(loss)
        np.testing.assert_allclose(got["losses"], python_losses, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.reshape(got["logits"], (6, 10)), engine.forward(probe, train=False), rtol=0, atol=1e-5, err_msg=name)

    # the same stream on the Python device learner of the same folder: the same decisions, the same weights after
    python = OnnxEngineLearner.from_artifacts(root / "engines" / "mlp_sgd")
    python.replay_batch_size, python.train_iterations = 0, 1
    decisions: list[str | None] = []
    lr = python.lr
    for i, (bx, by) in enumerate([healthy] * 3 + [poison, (np.full((10, 64), 3e38, np.float32), poison[1]), poison]):
        python.lr, refused = (lr * 1e5 if i == 3 else lr), python.guard.refused_steps
        python.observe(bx.astype(np.float32), by)
        decisions.append(python.guard.last_cause if python.guard.refused_steps > refused else None)
    browser = [s["causes"][0] if s["causes"] else None for s in results["guard"]["stats"]]
    assert [d is None for d in browser] == [d is None for d in decisions] == [True, True, True, False, False, True], (browser, decisions)
    assert browser[3].startswith("step changed the parameters by") and decisions[3].startswith("step changed the parameters by")
    assert browser[4] == decisions[4] == "non-finite loss or gradient"
    np.testing.assert_array_equal(results["guard"]["after"], results["guard"]["before"])  # both refusals left the model as it was
    np.testing.assert_allclose(np.reshape(results["guard"]["logits"], (6, 10)), python.predict(probe), rtol=0, atol=1e-4)

    observed = results["observe"]
    for stats in observed["stats"]:
        assert stats["samples"] == 3 and stats["steps"] == 3 and stats["refused"] == 0 and stats["replaySamples"] == 30
    assert observed["seen"] == 60 + 6 and observed["replay"] == 66
    again = results["resumed"]
    assert again["resumed"] and again["seen"] == observed["seen"] and again["replay"] == observed["replay"]
    np.testing.assert_array_equal(again["logits"], observed["logits"])  # exactly the saved weights

    refused = results["refusals"]
    assert refused["flipped"] == "ArtifactError: artifact file parameters.bin is corrupt or was modified: SHA-256 mismatch"
    assert refused["truncated"].startswith("ArtifactError: artifact file backward.onnx has ")
    assert refused["bad_label"] == "ArtifactError: replay.bin: label 99 is not a class index in [0, 10)"
    assert results["demo"]["stats"]["samples"] == 1 and "sgd lr=0.05" in results["demo"]["status"]
    assert refused["bad_lr"].startswith("ArtifactError: web.json `settings.lr == 1000000000`, must be a finite number in (0, 1000000]")
