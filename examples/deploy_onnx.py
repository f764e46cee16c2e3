"""Train in PyTorch, export ONNX Runtime artifacts, keep personalising on ORT, compare.

The reference digits learner learns tasks 0-2 of split digits in PyTorch and is exported
(the parity gate trains 3 steps in both backends on buffered rows before publishing).
Tasks 3-4 then arrive twice: to the PyTorch learner, and to an :class:`OrtOnlineLearner`
loaded from the artifacts (the torch-free device runtime). Both end with close accuracy
over all 10 classes; the updated inference model is checked under a plain
``onnxruntime.InferenceSession``. Needs the ``[onnx]`` extra. Run:
``python examples/deploy_onnx.py``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime
import torch

from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.datasets import split_digits, stream
from taste_cl.reference import build_digits_learner


def main() -> None:
    torch.manual_seed(0)
    tasks = split_digits(5)
    x_test = torch.cat([task.x_test for task in tasks])
    y_test = torch.cat([task.y_test for task in tasks]).numpy()
    learner = build_digits_learner()
    for _, x, y in stream(tasks[:3], 10):
        learner.observe((x, y))
    with tempfile.TemporaryDirectory() as scratch:
        folder = learner.export(Path(scratch) / "artifacts", batch_size=10, backend="onnxruntime")
        parity = json.loads((folder / "manifest.json").read_text())["parity"]
        device = OrtOnlineLearner.from_artifacts(folder)
        for _, x, y in stream(tasks[3:], 10, seed=1):
            learner.observe((x, y))
            device.observe((x.numpy(), y.numpy()))
        torch_acc = float((learner.predict(x_test).argmax(1).numpy() == y_test).mean())
        ort_acc = float((device.predict(x_test).argmax(1) == y_test).mean())
        session = onnxruntime.InferenceSession(str(device.export_inference_model(Path(scratch) / "model.onnx")))
        (logits,) = session.run(None, {"input": x_test.numpy()})
        gap = float(np.abs(logits - device.predict(x_test)).max())
    print(f"parity gate at export: max loss diff {parity['max_loss_diff']:.1e}, max parameter diff {parity['max_param_diff']:.1e}")
    print(f"accuracy on all 10 classes after tasks 3-4:  torch {torch_acc:.3f}   onnxruntime {ort_acc:.3f}")
    print(f"InferenceSession vs OrtOnlineLearner.predict: max |logit difference| {gap:.2e}")


if __name__ == "__main__":
    main()
