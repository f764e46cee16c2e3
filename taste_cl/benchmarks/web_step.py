"""Browser vs Python device learner: time per ONNX Runtime training step, same artifacts, same run.

For the digits MLP and a small CNN, the artifacts are exported once and made
web-compatible; the Python device learner (``OrtOnlineLearner``, onnxruntime-training,
``--threads`` intra-op threads) and the browser learner (``web/taste_cl_web.js`` in
headless Chromium, onnxruntime-web's single-threaded wasm) then train on the same batch,
alternating rounds of ``--steps`` steps (so shared load hits both). Medians of the rounds
and the best rounds (the least disturbed by other load) are reported per step, with the
browser/Python ratios, and the time to load the artifacts in each.
Run: ``taste-cl bench web-step`` (needs the ``[onnx-training]`` extra, Chromium, Node and
``npm install`` in ``web/``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from taste_cl.benchmarks._common import base_parser, parse, save_result
from taste_cl.benchmarks.onnx_training import small_cases
from taste_cl.learner import OnlineLearner
from taste_cl.report import format_table

_BROWSER_WARM_UP_MS = 3000


def _browser_round(x: list[float], y: list[int], steps: int) -> str:
    """A page expression timing ``steps`` training steps of the loaded learner, in ms per step."""
    return (
        f"(async () => {{ const l = demo.learner; const x = new Float32Array({json.dumps(x)}); const y = {json.dumps(y)};"
        f" const t = performance.now(); for (let i = 0; i < {steps}; i += 1) await l.trainStep(x, y);"
        f" return (performance.now() - t) / {steps}; }})()"
    )


def _browser_warm_up(x: list[float], y: list[int]) -> str:
    """A page expression training for ``_BROWSER_WARM_UP_MS``; returns the number of steps it took."""
    return (
        f"(async () => {{ const l = demo.learner; const x = new Float32Array({json.dumps(x)}); const y = {json.dumps(y)};"
        f" const end = performance.now() + {_BROWSER_WARM_UP_MS}; let n = 0;"
        " while (performance.now() < end) { await l.trainStep(x, y); n += 1; } return n; })()"
    )


def _browser_load(key: str) -> str:
    """A page expression timing a second load of the artifacts (fetch, SHA-256, session creation), in ms."""
    return (
        "(async () => { const t = performance.now(); const l = await demo.learner.constructor.load("
        f"'/artifacts/{key}/', {{ ort: demo.learner.ort, fresh: true, key: 'bench' }});"
        " const ms = performance.now() - t; await l.release(); return ms; })()"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("web-step", __doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=20, help="samples per training step")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="alternating rounds per learner")
    parser.add_argument(
        "--js-flags",
        default="--no-liftoff",
        help="V8 flags for Chromium (default: compile wasm optimised up front; under load V8's lazy tier-up "
        "can leave the learner in baseline code for seconds). '' keeps the browser's default",
    )
    args = parse(parser, argv)

    import onnxruntime

    from taste_cl.adapters.device.artifacts import read_manifest
    from taste_cl.adapters.onnxruntime.learner_export import export
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
    from taste_cl.cli.serve_demo import DemoServer, drive_browser

    threads = torch.get_num_threads()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    devices: dict[str, Any] = {}
    batches: dict[str, tuple[Any, Any]] = {}
    load_ms: dict[str, float] = {}
    python_ms: dict[str, list[float]] = {}

    def python_round(key: str) -> None:
        device, (x, y) = devices[key], batches[key]
        start = time.perf_counter()
        for _ in range(args.steps):
            device.train_step(x, y)
        python_ms[key].append((time.perf_counter() - start) * 1000 / args.steps)

    cases = small_cases()
    with tempfile.TemporaryDirectory(prefix="taste-cl-web-bench-") as scratch:
        server = DemoServer(scratch).start()
        try:
            steps: list[dict[str, Any]] = []
            for model_name, build in cases.items():
                key = model_name.split()[0]
                model, _, _, batch = build(args.seed)
                x, y = batch(args.batch_size, args.seed)
                learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
                folder = export(learner, Path(scratch) / key, example=(x, y))  # made web-compatible by the exporter
                web = read_manifest(folder)["web"]
                if "skipped" in web:
                    raise RuntimeError(f"{model_name}: the browser learner cannot train it: {web['skipped']}")
                start = time.perf_counter()
                devices[key] = OrtOnlineLearner.from_artifacts(folder, session_options=options)
                load_ms[key] = (time.perf_counter() - start) * 1000
                batches[key] = (x.numpy(), y.numpy())
                devices[key].train_step(*batches[key])  # warm-up: first-call allocations
                python_ms[key] = []
                batch = (x.numpy().ravel().tolist(), y.tolist())
                timed = _browser_round(*batch, args.steps)
                steps += [
                    {"goto": f"{server.url}?artifacts=/artifacts/{key}/&fresh=1"},
                    {"eval": _browser_load(key), "as": f"{key}_load_ms"},
                    # V8 first runs wasm unoptimised and recompiles hot functions later: warm up well
                    {"eval": _browser_warm_up(*batch), "as": f"{key}_warm_up_steps"},
                ]
                for round_ in range(args.repeats):
                    browser = {"eval": timed, "as": f"{key}_browser_{round_}"}
                    python = {"pause": key}
                    steps += [python, browser] if round_ % 2 == 0 else [browser, python]
            results = drive_browser(steps, on_pause=python_round, timeout_s=600, js_flags=args.js_flags)
        finally:
            server.stop()

    rows: list[list[Any]] = []
    runs: list[dict[str, Any]] = []
    for model_name in cases:
        key = model_name.split()[0]
        browser_ms = [float(results[f"{key}_browser_{r}"]) for r in range(args.repeats)]
        median = {"python": statistics.median(python_ms[key]), "browser": statistics.median(browser_ms)}
        best = {"python": min(python_ms[key]), "browser": min(browser_ms)}
        load = {"python": load_ms[key], "browser": float(results[f"{key}_load_ms"])}
        medians = [median["python"], median["browser"], median["browser"] / median["python"]]
        bests = [best["python"], best["browser"], best["browser"] / best["python"]]
        rows.append([model_name, args.batch_size, *medians, *bests, load["python"], load["browser"]])
        runs.append(
            {
                "model": model_name,
                "batch_size": args.batch_size,
                "median_ms_per_step": median,
                "best_ms_per_step": best,
                "browser_over_python_median": median["browser"] / median["python"],
                "browser_over_python_best": best["browser"] / best["python"],
                "rounds_ms": {"python": python_ms[key], "browser": browser_ms},
                "load_ms": load,
                "browser_warm_up_steps": results[f"{key}_warm_up_steps"],
            }
        )
    headers = ["model", "batch", "python ms", "browser ms", "ratio", "python best", "browser best", "ratio best"]
    headers += ["python load ms", "browser load ms"]
    print(format_table(headers, rows))
    save_result(
        args.out,
        "web_step",
        {
            "threads": threads,
            "steps": args.steps,
            "repeats": args.repeats,
            "onnxruntime": onnxruntime.__version__,
            "browser": results.get("user_agent"),
            "js_flags": args.js_flags,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
