"""Step time and step memory of the ONNX engine against eager torch and the onnxruntime-training engine.

Not a test (pytest does not collect it). Run the export in the dev venv, then time in each venv:

    .venv/bin/python tests/bench_onnx_engine.py export /tmp/onnx_engine_bench
    .venv/bin/python tests/bench_onnx_engine.py time /tmp/onnx_engine_bench --engines engine,torch,ort_training
    PYTHONPATH=. /tmp/ort131/bin/python tests/bench_onnx_engine.py time /tmp/onnx_engine_bench --engines engine
    .venv/bin/python tests/bench_onnx_engine.py memory /tmp/onnx_engine_bench --engines engine,torch,ort_training

One thread everywhere (torch.set_num_threads(1), ORT intra_op_num_threads=1, graph optimizations
all on). Timing alternates the engines round by round and reports medians of per-step times.
Memory: peak RSS during 20 steps minus RSS after load, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MODELS = {"mlp": 32, "cnn3": 32, "mobilenet_v3_small": 16, "resnet18": 16}  # name -> batch
CLASSES = {"mlp": 10, "cnn3": 4, "mobilenet_v3_small": 4, "resnet18": 4}


def build(name: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "cnn3":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 4),
        )  # fmt: skip
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=4)


def batch(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    n = MODELS[name]
    x = rng.standard_normal((n, 64) if name == "mlp" else (n, 3, 32, 32)).astype(np.float32)
    return x, rng.integers(0, CLASSES[name], n).astype(np.int64)


def ce_grad(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(1, keepdims=True))
    p = shifted / shifted.sum(1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    return (p / len(labels)).astype(np.float32)


def export(root: Path) -> None:
    import torch

    from taste_cl.adapters.onnx_engine.export import export_engine

    torch.set_num_threads(1)
    for name in MODELS:
        model = build(name).eval()
        x, y = batch(name)
        started = time.perf_counter()
        export_engine(model, torch.from_numpy(x), root / name / "engine", optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        print(f"{name}: engine exported in {time.perf_counter() - started:.1f} s", flush=True)
        if name == "mobilenet_v3_small":
            continue  # the training build has no gradient for HardSwish (DEPENDENCY-NOTES)
        from taste_cl.adapters.onnxruntime import export_model

        started = time.perf_counter()
        export_model(
            model, torch.nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            example=(torch.from_numpy(x), torch.from_numpy(y)), directory=root / name / "ort_training", verify=False,
        )  # fmt: skip
        print(f"{name}: onnxruntime-training artifacts in {time.perf_counter() - started:.1f} s", flush=True)


def steppers(root: Path, name: str, engines: list[str]) -> dict[str, Callable[[], None]]:
    x, y = batch(name)
    made: dict[str, Callable[[], None]] = {}
    if "engine" in engines:
        from taste_cl.adapters.onnx_engine.engine import OnnxEngine

        engine = OnnxEngine(root / name / "engine", threads=1)

        def engine_step() -> None:
            outputs = engine.forward(x, train=True)
            engine.step(engine.backward(ce_grad(outputs, y)), 0.01)

        made["engine"] = engine_step
    if "torch" in engines:
        import torch

        torch.set_num_threads(1)
        model = build(name).eval()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)

        def torch_step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(tx), ty).backward()
            optimizer.step()

        made["torch"] = torch_step
    if "ort_training" in engines and (root / name / "ort_training").is_dir():
        from taste_cl.adapters.onnxruntime import OrtOnlineLearner
        from taste_cl.adapters.onnxruntime.session import ort_bindings

        options = ort_bindings().SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = 1, 1, 3
        learner = OrtOnlineLearner.from_artifacts(root / name / "ort_training", session_options=options)
        made["ort_training"] = lambda: learner.observe((x, y)) and None
    return made


def time_steps(root: Path, engines: list[str], rounds: int) -> dict[str, Any]:
    import onnxruntime

    results: dict[str, Any] = {"onnxruntime": onnxruntime.__version__, "models": {}}
    for name in MODELS:
        made = steppers(root, name, engines)
        reps = 10 if name in ("mlp", "cnn3") else 3
        times: dict[str, list[float]] = {key: [] for key in made}
        for step in made.values():
            step()  # warm-up
        for _ in range(rounds):
            for key, step in made.items():
                started = time.perf_counter()
                for _ in range(reps):
                    step()
                times[key].append((time.perf_counter() - started) / reps)
        medians = {key: float(np.median(values)) * 1e3 for key, values in times.items()}
        results["models"][name] = medians
        print(name, {k: f"{v:.2f} ms" for k, v in medians.items()}, flush=True)
    return results


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_one(root: Path, name: str, engine: str) -> float:
    step = steppers(root, name, [engine])[engine]
    base, peak, running = _rss(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    for _ in range(20):
        step()
    running[0] = False
    sampler.join()
    return (max(peak[0], _rss()) - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["export", "time", "memory", "memory-one"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--engines", default="engine")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engines = args.engines.split(",")
    if args.mode == "export":
        export(args.root)
        return
    if args.mode == "memory-one":
        print(json.dumps(memory_one(args.root, args.model, engines[0])))
        return
    if args.mode == "time":
        result = time_steps(args.root, engines, args.rounds)
    else:
        result = {"models": {}}
        for name in MODELS:
            result["models"][name] = {}
            for engine in engines:
                if engine == "ort_training" and not (args.root / name / "ort_training").is_dir():
                    continue
                done = subprocess.run(
                    [sys.executable, __file__, "memory-one", str(args.root), "--model", name, "--engines", engine], capture_output=True, text=True
                )
                result["models"][name][engine] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else done.stderr[-300:]
            print(name, result["models"][name], flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
