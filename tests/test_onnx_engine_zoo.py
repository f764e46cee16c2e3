"""The ONNX engine on the zoo: every architecture exports, and its gradients match torch's (slow: exports take minutes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from zoo import ZOO

pytest.importorskip("onnxscript")
pytest.importorskip("torchvision")

from taste_cl.adapters.onnx_engine.engine import OnnxEngine
from taste_cl.adapters.onnx_engine.export import export_engine

MODELS = [
    "mobilenet_v3_small",
    "mobilenet_v2",
    "resnet18",
    "keyword_spotter",
    "token_tagger",
    "lstm",
    "text_transformer",
    "text_transformer_dict",
    "regression_mlp",
    "multilabel_mlp",
    "batchnorm_mlp",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_exports_with_gradient_parity(name: str, tmp_path: Path) -> None:
    case = ZOO[name]
    model, _, _ = case.build()
    model.eval()  # the engine traces eval mode: BatchNorm frozen on its running statistics, no dropout
    x, _ = case.batch(4)
    output = "logits" if name == "text_transformer_dict" else None
    engine = OnnxEngine(export_engine(model, x, tmp_path, output=output))
    feed = {k: v.numpy() for k, v in x.items()} if isinstance(x, dict) else x.numpy()
    outputs = engine.forward(feed, train=True)
    grad = np.random.default_rng(0).standard_normal(outputs.shape).astype(np.float32)
    gradients = engine.backward(grad)
    reference = model(**x) if isinstance(x, dict) else model(x)
    if isinstance(reference, dict):
        reference = reference["logits"]
    reference.backward(torch.from_numpy(grad))
    assert np.abs(outputs - reference.detach().numpy()).max() <= 1e-5 * max(1.0, float(np.abs(outputs).max()))
    for parameter_name, parameter in model.named_parameters():
        expected = parameter.grad.numpy()
        assert np.abs(gradients[parameter_name] - expected).max() <= 1e-5 * max(float(np.abs(expected).max()), 1e-12), parameter_name
