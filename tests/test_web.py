"""Personalize in the browser: web-compatible artifacts, and the JS learner in headless Chromium.

The browser test serves the demo on 127.0.0.1, drives one headless Chromium over the
DevTools protocol (``web/tools/drive.mjs``) and checks, for SGD and AdamW exports of the
digits MLP and for a small CNN: the artifacts load; 5 training steps match the Python
device learner on the same batches at the exported LR; observe() with replay works; a
reload resumes from IndexedDB. It also writes a screenshot of the demo after a few corrections.
A second browser run checks reserved class slots: masked until their first label, as in Python.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash
from hostile_npz import edit_npz
from torch import nn

pytestmark = pytest.mark.training_build

import onnx

from taste_cl import CheckpointError, OnlineLearner
from taste_cl.adapters.device.artifacts import read_manifest
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.adapters.web.compat import (
    WEB_MANIFEST,
    WEB_OPTIMIZER_MODEL,
    WebCompatibilityError,
    check_strict_shapes,
    make_web_compatible,
)
from taste_cl.reference import build_digits_learner
from taste_cl.cli.serve_demo import DemoServer, browser_tools, drive_browser
from taste_cl.datasets import split_digits
from taste_cl.replay import ReservoirReplay

ROOT = Path(__file__).resolve().parent.parent  # the checkout (taste_cl may be installed elsewhere)
SCREENSHOT = Path(os.environ.get("TASTE_CL_WEB_SCREENSHOT", "/tmp/taste-cl-web-demo.png"))


def _cnn_learner() -> OnlineLearner:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
    )
    return OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        replay=ReservoirReplay(50, seed=0),
    )


def _digits() -> tuple[np.ndarray, np.ndarray]:
    task = split_digits(1)[0]
    return task.x_train.numpy(), task.y_train.numpy()


def _export(learner: OnlineLearner, folder: Path, **kwargs: object) -> Path:
    x, y = _digits()
    for start in range(0, 60, 10):
        learner.observe(
            (
                torch.from_numpy(x[start : start + 10]),
                torch.from_numpy(y[start : start + 10]),
            )
        )
    learner.export(folder, backend="onnxruntime", **kwargs)
    assert read_manifest(folder)["web"] == {"manifest": WEB_MANIFEST}  # the exporter made it web-compatible
    return folder


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("web-artifacts")
    torch.set_num_threads(1)
    _export(build_digits_learner(lr=0.05), root / "sgd")
    _export(build_digits_learner(), root / "adamw", optimizer="adamw", lr=0.01)
    _export(_cnn_learner(), root / "cnn")
    # a device learner's save: AdamW moments and step are in the checkpoint, and must reach the browser
    device = OrtOnlineLearner.from_artifacts(root / "adamw")
    x, y = _digits()
    for start in range(60, 84, 8):
        device.train_step(x[start : start + 8], y[start : start + 8])
    assert read_manifest(device.save(root / "adamw_saved"))["web"] == {"manifest": WEB_MANIFEST}
    return root


@pytest.fixture(scope="module")
def reserved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits MLP exported with 2 reserved output slots (10 and 11, masked until first labelled)."""
    torch.set_num_threads(1)
    learner = build_digits_learner(lr=0.05)
    x, y = _digits()
    learner.observe((torch.from_numpy(x[:40]), torch.from_numpy(y[:40])))
    return learner.export(tmp_path_factory.mktemp("web-reserved") / "reserved", backend="onnxruntime", reserved_classes=2)


# ----------------------------------------------------------- artifacts (no browser)
def test_web_json_lists_the_active_classes_and_a_device_save_keeps_them_current(artifacts: Path, reserved: Path, tmp_path: Path) -> None:
    web = json.loads((reserved / WEB_MANIFEST).read_text())
    assert web["num_classes"] == 12 and web["active_classes"] == list(range(10))
    assert json.loads((artifacts / "sgd" / WEB_MANIFEST).read_text())["active_classes"] is None  # no reserved slots: all active
    device = OrtOnlineLearner.from_artifacts(reserved)
    x, _ = _digits()
    device.observe((x[:4], np.array([10, 10, 3, 3])))
    saved = device.save(tmp_path / "saved")
    assert json.loads((saved / WEB_MANIFEST).read_text())["active_classes"] == list(range(11))  # what the browser resumes from


def test_web_artifacts_pass_strict_inference_and_keep_the_lr(artifacts: Path) -> None:
    from onnxruntime.training.api import CheckpointState

    for name in ("sgd", "adamw", "cnn", "adamw_saved"):
        folder = artifacts / name
        read_manifest(folder)  # the manifest covers the rewritten and added files
        for graph in sorted(folder.glob("*.onnx")):
            check_strict_shapes(graph)
        web = json.loads((folder / WEB_MANIFEST).read_text())
        assert web["models"]["optimizer"] == WEB_OPTIMIZER_MODEL
        assert web["optimizer"]["lr"] == pytest.approx(0.01 if name.startswith("adamw") else 0.05)
        state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        assert state.properties["taste_cl.learning_rate"] == pytest.approx(web["optimizer"]["lr"])
        assert OrtOnlineLearner.from_artifacts(folder).lr == pytest.approx(web["optimizer"]["lr"])  # the device loads it


def test_strict_check_rejects_the_raw_sgd_optimizer(tmp_path: Path) -> None:
    """onnxblock's SGD graph as it comes (``update_completed`` declared [1], inferred rank-0) fails strict clients."""
    from onnxruntime.training import onnxblock

    block = onnxblock.optim.SGD()
    with onnxblock.empty_base(opset_version=17):
        block(([onnx.helper.make_tensor("p", onnx.TensorProto.FLOAT, [1], [0.0])], []))
        onnx.save(block.to_model_proto(), str(tmp_path / "optimizer_model.onnx"))
    with pytest.raises(CheckpointError, match=r"optimizer_model\.onnx fails strict shape inference"):
        check_strict_shapes(tmp_path / "optimizer_model.onnx")


def test_plain_sgd_gets_an_optimizer_graph_when_the_folder_has_none(artifacts: Path, tmp_path: Path) -> None:
    """An exporter may leave SGD to numpy on the device; the browser gets onnxblock's SGD graph, same updates."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from taste_cl.adapters.web.compat import _optimizer_graph

    source = artifacts / "sgd"
    for name in ("training_model.onnx", "eval_model.onnx"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    onnx.save(_optimizer_graph(tmp_path, {"type": "sgd", "lr": 0.05}), str(tmp_path / "built.onnx"))
    x, y = _digits()
    state = CheckpointState.load_checkpoint(str(source / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "built.onnx"), module)
    optimizer.set_learning_rate(0.05)
    device = OrtOnlineLearner.from_artifacts(source)  # the Python device steps plain SGD in numpy
    for start in (0, 8):
        module(x[start : start + 8], y[start : start + 8])
        optimizer.step()
        module.lazy_reset_grad()
        device.train_step(x[start : start + 8], y[start : start + 8])
    trained = {name.removeprefix("model."): np.array(p.data) for name, p in state.parameters}
    for name, value in device.parameters().items():
        np.testing.assert_allclose(trained[name], value, rtol=0, atol=1e-6, err_msg=name)
    with pytest.raises(WebCompatibilityError, match="plain SGD or AdamW only"):
        _optimizer_graph(tmp_path, {"type": "sgd", "lr": 0.05, "momentum": 0.9})


def _skipped_reason(folder: Path) -> str:
    assert not (folder / WEB_MANIFEST).exists() and not (folder / "replay.bin").exists()
    return read_manifest(folder)["web"]["skipped"]


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "trains with plain SGD or AdamW only"),
        ("regression", "one class label per sample; regression has float32 targets"),
    ],
    ids=["sgd-momentum", "regression"],
)
def test_export_records_why_the_browser_cannot_train_and_the_device_still_works(tmp_path: Path, build, reason) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3 if build != "regression" else 1)
    if build == "regression":
        learner = OnlineLearner(model, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        y = torch.randn(6)
    else:
        learner = OnlineLearner(model, optimizer=build(model))
        y = torch.tensor([0, 1, 2, 0, 1, 2])
    x = torch.randn(6, 4)
    folder = learner.export(tmp_path / "art", example=(x, y), backend="onnxruntime")
    assert reason in _skipped_reason(folder)
    device = OrtOnlineLearner.from_artifacts(folder)
    np.testing.assert_allclose(device.predict(x.numpy()), learner.predict(x).numpy(), atol=1e-5)
    assert reason in _skipped_reason(device.save(tmp_path / "saved"))  # a device save decides the same


def test_a_graph_failing_strict_inference_skips_the_web_step_not_the_export(tmp_path: Path, monkeypatch) -> None:
    from taste_cl.adapters.web import compat as _web_compat

    def strict(path: object) -> None:
        raise CheckpointError("training_model.onnx fails strict shape inference, so strict ORT clients reject it: test")

    monkeypatch.setattr(_web_compat, "check_strict_shapes", strict)
    learner = build_digits_learner()
    learner.observe((torch.rand(10, 64), torch.randint(0, 10, (10,))))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    assert "fails strict shape inference" in _skipped_reason(folder)
    assert OrtOnlineLearner.from_artifacts(folder).observe((np.random.rand(4, 64), np.arange(4))).steps == 3


def test_replay_binary_matches_the_npz(artifacts: Path) -> None:
    folder = artifacts / "sgd"
    header = json.loads((folder / WEB_MANIFEST).read_text())["replay"]
    raw = (folder / header["file"]).read_bytes()
    x = np.frombuffer(raw, "<f4", count=header["arrays"]["x"]["nbytes"] // 4).reshape(header["arrays"]["x"]["shape"])
    y = np.frombuffer(raw, "<i8", offset=header["arrays"]["y"]["offset"])
    info = read_manifest(folder)["replay"]
    with np.load(folder / "replay.npz") as data:
        np.testing.assert_array_equal(x, data["x0"])
        np.testing.assert_array_equal(y, data["y"])
    assert (header["seen"], header["capacity"], header["seed"]) == (info["seen"], info["capacity"], info["seed"])


def test_replay_labels_are_8_byte_aligned_after_odd_sized_features(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(4))
    learner.observe((torch.rand(1, 3), torch.tensor([1])))
    folder = learner.export(tmp_path / "odd", example=(torch.rand(2, 3), torch.tensor([1, 0])), backend="onnxruntime")
    header = json.loads(make_web_compatible(folder).read_text())["replay"]
    assert header["arrays"]["x"]["nbytes"] == 12 and header["arrays"]["y"]["offset"] == 16
    raw = (folder / header["file"]).read_bytes()
    assert np.frombuffer(raw, "<i8", offset=16).tolist() == [1]


def test_make_web_compatible_is_idempotent_and_refuses_tampering(artifacts: Path, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    folder.mkdir()
    for file in (artifacts / "sgd").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    before = (folder / WEB_MANIFEST).read_text()
    make_web_compatible(folder)
    assert json.loads((folder / WEB_MANIFEST).read_text())["files"] == json.loads(before)["files"]
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        make_web_compatible(tmp_path)
    (folder / "eval_model.onnx").write_bytes(b"tampered")
    listing = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        make_web_compatible(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == listing  # left exactly as it was


def _manifest(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], None]:
    """A damage: the manifest edited and the folder re-signed, as an attacker would."""
    return lambda folder: rehash(folder, edit)


def _replay(**options: Any) -> Callable[[Path], None]:
    """A damage: ``replay.npz`` rewritten (see ``edit_npz``), the folder re-signed as an attacker would."""

    def damage(folder: Path) -> None:
        edit_npz(folder / "replay.npz", **options)
        rehash(folder)

    return damage


def _first(key: str, value: float) -> Callable[[dict[str, np.ndarray]], None]:
    """A change of a replay archive: the first entry of array ``key`` set to ``value``."""
    return lambda arrays: arrays[key].reshape(-1).__setitem__(0, value)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        # every value web.json copies is bounded as the device bounds it: the hashes were recomputed
        (
            _manifest(lambda m: m["optimizer"].update(lr="nan")),
            r"manifest\.json: manifest `optimizer\.lr == 'nan'`, must be a finite number",
        ),
        (_manifest(lambda m: m["optimizer"].update(lr=-0.05)), r"manifest `optimizer\.lr == -0\.05`, must be in \(0\.0, 1000000\.0\]"),
        (_manifest(lambda m: m.update(num_classes=1e9)), r"manifest `num_classes == 1000000000\.0`, must be an int in \[1, 100000\]"),
        (
            _manifest(lambda m: m.update(train_iterations=10**9)),
            r"manifest `train_iterations == 1000000000`, must be an int in \[1, 1000\]",
        ),
        # a width the manifest repeats consistently, but not the graph's
        (
            _manifest(lambda m: (m.update(num_classes=7), m["output"].update(shape=["batch", 7]))),
            r"`num_classes == 7`, must be the output width of eval_model\.onnx's 'logits', \[10\]",
        ),
        # the buffer, read as the device reads it, with no ignored label (the browser trains on each)
        (_replay(change=_first("y", 10)), r"replay\.npz: labels in \[0, 10\], must be in \[0, 9\]$"),
        (_replay(change=_first("y", -100)), r"replay\.npz: labels in \[-100, 9\], must be in \[0, 9\]$"),
        (_replay(change=_first("x0", math.nan)), r"replay\.npz: array 'x0' holds NaN or infinite values"),
        (_replay(claims={"x0": (10**9, 64)}), r"replay\.npz: array 'x0' is float32 \(1000000000, 64\), must be float32 \(\d+, 64\)"),
    ],
    ids=["lr-nan", "lr-negative", "classes-1e9", "iterations", "classes-not-the-graphs", "label-10", "label-ignored", "feature-nan", "x-rows"],
)
def test_values_out_of_bounds_are_refused_and_nothing_is_written(artifacts: Path, tmp_path: Path, damage, match) -> None:
    folder = Path(shutil.copytree(artifacts / "sgd", tmp_path / "hostile"))
    damage(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(WebCompatibilityError, match=match):
        make_web_compatible(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert [p.name for p in tmp_path.iterdir()] == ["hostile"]  # no staging folder left behind


def test_optimizer_state_survives_the_rewrite(artifacts: Path, tmp_path: Path) -> None:
    """A saved AdamW device learner (step, moments) continues identically after make_web_compatible."""
    x, y = _digits()
    device = OrtOnlineLearner.from_artifacts(artifacts / "adamw")
    for start in (0, 8, 16):
        device.train_step(x[start : start + 8], y[start : start + 8])
    plain = device.save(tmp_path / "plain")
    web = device.save(tmp_path / "web")
    make_web_compatible(web)
    continued = []
    for folder in (plain, web):
        resumed = OrtOnlineLearner.from_artifacts(folder)
        resumed.train_step(x[24:32], y[24:32])
        continued.append(resumed.parameters())
    for name, value in continued[0].items():
        np.testing.assert_array_equal(continued[1][name], value, err_msg=name)


def test_demo_server_serves_only_its_roots_on_loopback(artifacts: Path) -> None:
    import http.client

    if not (ROOT / "web" / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("the demo server needs onnxruntime-web: run `npm install` in web/")
    server = DemoServer(artifacts, root=ROOT).start()
    try:
        host, port = server.url.split("/")[2].split(":")
        assert host == "127.0.0.1"
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        for path, status in [
            ("/sgd/../../pyproject.toml", 404),
            ("/artifacts/../pyproject.toml", 404),
            ("/artifacts/sgd/web.json", 200),
            ("/web/taste_cl_web.js", 200),
            ("/", 200),
        ]:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
            assert response.status == status, (path, response.status)
        assert b"personalize" in body
        connection.close()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="port"):
        DemoServer(artifacts, port=70000, root=ROOT)


# ------------------------------------------------------------------- in the browser
def _why_no_browser() -> str:
    try:
        browser_tools(ROOT)
    except FileNotFoundError as error:
        return f"browser test needs Chromium, Node and web/node_modules: {error}"
    return ""


_NO_BROWSER = _why_no_browser()


def _python_reference(folder: Path, batches: list[tuple[np.ndarray, np.ndarray]], probe: np.ndarray) -> dict[str, object]:
    device = OrtOnlineLearner.from_artifacts(folder)
    losses = [device.train_step(x, y)[1] for x, y in batches]
    return {"losses": losses, "logits": device.predict(probe).tolist(), "lr": device.lr}


def _js(value: object) -> str:
    return json.dumps(value)


@pytest.mark.browser
@pytest.mark.skipif(bool(_NO_BROWSER), reason=_NO_BROWSER)
def test_browser_learner_matches_python_and_resumes(artifacts: Path) -> None:
    x, y = _digits()
    rng = np.random.default_rng(0)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(100, 140, 8)]
    probe = x[200:206]
    stream_x, stream_y = x[300:306], y[300:306]
    server = DemoServer(artifacts, root=ROOT).start()
    steps: list[dict[str, object]] = []
    names = ("sgd", "adamw", "cnn", "adamw_saved")
    for name in names:
        page = f"{server.url}?artifacts=/artifacts/{name}/"
        train = (
            "(async () => { const l = demo.learner; const losses = [];"
            f" for (const [x, y] of {_js([[b.ravel().tolist(), c.tolist()] for b, c in batches])})"
            "   losses.push((await l.trainStep(x, y)).loss);"
            f" return {{losses, logits: Array.from(await l.predict({_js(probe.ravel().tolist())})), lr: l.lr}}; }})()"
        )
        observe = (
            "(async () => { const l = demo.learner; const out = [];"
            f" for (const [x, y] of {_js([[stream_x[i : i + 3].ravel().tolist(), stream_y[i : i + 3].tolist()] for i in (0, 3)])})"
            "   out.push(await l.observe(x, y));"
            f" return {{stats: out, seen: l.samplesSeen, replay: l.replay.size,"
            f" logits: Array.from(await l.predict({_js(probe.ravel().tolist())}))}}; }})()"
        )
        resumed = (
            f"(async () => ({{resumed: demo.learner.resumed, seen: demo.learner.samplesSeen, replay: demo.learner.replay.size,"
            f" logits: Array.from(await demo.learner.predict({_js(probe.ravel().tolist())}))}}))()"
        )
        steps += [
            {"goto": page + "&fresh=1"},
            {"eval": train, "as": f"{name}_train"},
            {"eval": observe, "as": f"{name}_observe"},
            {"reload": True},  # the page dropped fresh=1 from its URL: resume from IndexedDB
            {"eval": resumed, "as": f"{name}_resumed"},
        ]
    digits = [(x[i].tolist(), int(y[i])) for i in rng.choice(len(x), 6, replace=False)]
    refusals = (
        "(async () => { const l = demo.learner; const before = [l.samplesSeen, l.replay.seen]; const errors = [];"
        " for (const [x, y] of [[new Float32Array(63), [1]], [new Float32Array(64), [10]], [new Float32Array(64), [1, 2]],"
        "   [new Float32Array(64).fill(NaN), [1]]])"
        "   try { await l.observe(x, y); } catch (e) { errors.push(e.constructor.name + ': ' + e.message); }"
        " return {errors, unchanged: before[0] === l.samplesSeen && before[1] === l.replay.seen}; })()"
    )
    steps += [
        {"eval": refusals, "as": "refusals"},
        {"goto": f"{server.url}?artifacts=/artifacts/sgd/&fresh=1"},
        {
            "eval": "(async () => { for (const [p, c] of " + _js(digits) + ") { await demo.setPixels(p); await demo.correct(c); }"
            " return demo.setPixels(" + _js(digits[0][0]) + "); })()",
            "as": "demo",
        },
        {"screenshot": str(SCREENSHOT)},
    ]
    try:
        results = drive_browser(steps, root=ROOT)
    finally:
        server.stop()

    for name in names:
        reference = _python_reference(artifacts / name, batches, probe)
        got = results[f"{name}_train"]
        assert got["lr"] == pytest.approx(reference["lr"]), name  # trains at the exported LR
        np.testing.assert_allclose(got["losses"], reference["losses"], atol=1e-5, err_msg=name)
        np.testing.assert_allclose(
            np.reshape(got["logits"], (6, 10)),
            reference["logits"],
            atol=1e-4,
            err_msg=name,
        )

        observed = results[f"{name}_observe"]
        web = json.loads((artifacts / name / WEB_MANIFEST).read_text())
        plan = web["batch_plan"]
        for stats in observed["stats"]:
            assert stats["samples"] == 3 and stats["steps"] == plan["train_iterations"]
            assert stats["replaySamples"] == min(plan["replay_batch_size"], web["replay"]["size"]) * plan["train_iterations"]
            assert math.isfinite(stats["loss"])
        assert observed["seen"] == web["counters"]["samples_seen"] + 6
        assert observed["replay"] == min(web["replay"]["capacity"], web["replay"]["size"] + 6)
        assert not np.allclose(observed["logits"], got["logits"])  # observe() trained

        again = results[f"{name}_resumed"]
        assert again["resumed"] and again["seen"] == observed["seen"] and again["replay"] == observed["replay"]
        np.testing.assert_array_equal(again["logits"], observed["logits"])  # exactly the saved weights
    refused = results["refusals"]
    assert refused["unchanged"], refused
    assert [e.split(":")[0] for e in refused["errors"]] == ["RangeError"] * 4
    assert "multiple of 64" in refused["errors"][0] and "label 10" in refused["errors"][1]
    assert "64 non-finite" in refused["errors"][3]
    assert results["demo"]["label"] in range(10)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.browser
@pytest.mark.skipif(bool(_NO_BROWSER), reason=_NO_BROWSER)
def test_browser_learner_masks_reserved_slots_until_their_first_label(reserved: Path) -> None:
    """As OrtOnlineLearner: predict() gives inactive slots -Infinity, observe() activates a label's
    slot (scoring with it active), the saved state keeps it, and a bad ``active_classes`` is refused."""
    bad = reserved.parent / "bad"
    shutil.copytree(reserved, bad)
    web = json.loads((bad / WEB_MANIFEST).read_text())
    (bad / WEB_MANIFEST).write_text(json.dumps({**web, "active_classes": [0, 12]}))
    x, _ = _digits()
    probe, batch = x[200:204], (x[300:306], np.array([10, 10, 10, 1, 2, 3]))
    # per row: the slots at -Infinity, the finite logits (JSON has no -Infinity)
    read = (
        f"(async () => {{ const l = demo.learner; const logits = Array.from(await l.predict({_js(probe.ravel().tolist())}));"
        " const rows = [0, 1, 2, 3].map((i) => logits.slice(i * 12, (i + 1) * 12));"
        " return {active: l.classes.toJSON(), resumed: l.resumed,"
        " inactive: rows.map((r) => r.flatMap((v, c) => (v === -Infinity ? [c] : []))),"
        " finite: rows.map((r) => r.filter((v) => v !== -Infinity))}; })()"
    )
    observe = f"demo.learner.observe({_js(batch[0].ravel().tolist())}, {_js(batch[1].tolist())})"
    refused = (
        "(async () => { const l = demo.learner;"
        " try { await l.constructor.load('/artifacts/bad/', { ort: l.ort, fresh: true }); return 'loaded'; }"
        " catch (e) { return e.constructor.name + ': ' + e.message; } })()"
    )
    server = DemoServer(reserved.parent, root=ROOT).start()
    try:
        results = drive_browser(
            [
                {"goto": f"{server.url}?artifacts=/artifacts/reserved/&fresh=1"},
                {"eval": read, "as": "fresh"},
                {"eval": observe, "as": "stats"},
                {"eval": read, "as": "observed"},
                {"reload": True},  # resume from IndexedDB
                {"eval": read, "as": "resumed"},
                {"eval": refused, "as": "refused"},
            ],
            root=ROOT,
        )
    finally:
        server.stop()

    python = OrtOnlineLearner.from_artifacts(reserved)
    expected = python.predict(probe)
    fresh = results["fresh"]
    assert fresh["active"] == list(range(10)) and fresh["inactive"] == [[10, 11]] * 4
    np.testing.assert_allclose(fresh["finite"], expected[:, :10], atol=1e-4)  # the same logits as Python's, same slots masked
    assert np.isneginf(expected[:, 10:]).all()
    stats = python.observe(batch)
    assert results["stats"]["accuracy"] == pytest.approx(stats.accuracy)  # scored on the same masked outputs
    assert math.isfinite(results["stats"]["loss"])
    for name in ("observed", "resumed"):
        assert results[name]["active"] == sorted(python.classes.active) == list(range(11)), name
        assert results[name]["inactive"] == [[11]] * 4, name
    assert results["resumed"]["resumed"]
    np.testing.assert_array_equal(results["resumed"]["finite"], results["observed"]["finite"])
    assert results["refused"].startswith("ArtifactError: web.json active_classes must be null or a non-empty, increasing list")
    assert "[0, 12) (the output width); got [0,12]" in results["refused"]
