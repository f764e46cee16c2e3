"""Export behaviour: transforms, structured inputs, the parity gate catching a broken graph, clear refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.training_build

from zoo import ZOO

from taste_cl.adapters.onnxruntime import build as _onnx_export
from taste_cl.adapters.onnxruntime.build import export_model
from taste_cl.exceptions import ParityError, UnsupportedOperatorError
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner
from taste_cl.exceptions import InvalidBatchError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def _example(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _export(model: nn.Module, folder: Path, **kwargs) -> Path:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return export_model(model, nn.CrossEntropyLoss(), optimizer, _example(), folder, **kwargs)


def test_dropout_is_kept_in_training_and_off_in_eval(tmp_path: Path) -> None:
    folder = _export(_mlp(), tmp_path / "art")
    graph = onnx.load(str(folder / "training_model.onnx"))
    assert "Dropout" in {node.op_type for node in graph.graph.node}
    device = OrtOnlineLearner.from_artifacts(folder)
    x, y = (t.numpy() for t in _example())
    training = device.session._run([x], y, True)[1]  # dropout active: zeroed units change the outputs
    assert np.abs(training - device.predict(x)).max() > 1e-2
    np.testing.assert_array_equal(device.predict(x), device.predict(x))


def test_text_transformer_manifest_names_dict_inputs_and_dtypes(tmp_path: Path) -> None:
    model, loss_fn, optimizer = ZOO["text_transformer"].build(0)
    folder = export_model(model, loss_fn, optimizer, ZOO["text_transformer"].batch(4), tmp_path / "art")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["structure"] == "dict"
    assert manifest["inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", 12], "bound": 50},  # the embedding's rows: checked on the device
        {"name": "attention_mask", "dtype": "int64", "shape": ["batch", 12]},
    ]
    assert any("LayerNorm -> ExportLayerNorm" in line for line in manifest["transforms"])
    assert manifest["optimizer"]["type"] == "adamw" and manifest["parity"]["max_output_diff"] < 1e-4


def _break_training_graph(original):
    """Wrap the eval-graph fix so it also turns the first Relu of the training graph into a Sigmoid."""

    def broken(path: Path) -> None:
        original(path)
        graph = onnx.load(str(path.parent / "training_model.onnx"))
        next(node for node in graph.graph.node if node.op_type == "Relu").op_type = "Sigmoid"
        onnx.save(graph, str(path.parent / "training_model.onnx"))

    return broken


def test_parity_gate_refuses_a_broken_graph_with_the_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_onnx_export, "_fix_eval_graph", _break_training_graph(_onnx_export._fix_eval_graph))
    with pytest.raises(ParityError, match=r"FAILED over 3 steps: outputs .* losses .* parameters") as caught:
        _export(_mlp(), tmp_path / "art")
    assert caught.value.report.max_loss_diff > 1e-2
    assert not (tmp_path / "art").exists() and list(tmp_path.iterdir()) == []  # nothing published
    folder = _export(_mlp(), tmp_path / "art", verify=False)  # documented escape hatch: no gate
    assert json.loads((folder / "manifest.json").read_text())["parity"] is None


def test_export_leaves_model_and_optimizer_untouched(tmp_path: Path) -> None:
    # no bias before BatchNorm: its gradient is exactly 0, which Adam would turn into noise-driven steps
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_model(model, nn.CrossEntropyLoss(), optimizer, _example(), tmp_path / "art", batchnorm="batch")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not optimizer.state
    assert model.training and isinstance(model[1], nn.BatchNorm1d) and type(model[1]) is nn.BatchNorm1d


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_low_and_high_precision_models_export_as_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    model = _mlp().to(dtype)
    x, y = _example()
    folder = export_model(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1),
                          (x.to(dtype), y), tmp_path / "art")  # fmt: skip
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source_dtype"] == str(dtype).removeprefix("torch.")
    assert manifest["inputs"][0]["dtype"] == "float32"
    OrtOnlineLearner.from_artifacts(folder).observe((x.float().numpy(), y.numpy()))


class _Mixer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ni,ni->ni", x, x)


class _FunctionalNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (8,))


@pytest.mark.parametrize(
    ("layer", "op", "module"), [(_Mixer(), "Einsum", "block.mix"), (_FunctionalNorm(), "LayerNormalization", "block.mix")]
)
def test_unsupported_operator_is_named_with_its_module(tmp_path: Path, layer: nn.Module, op: str, module: str) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    model.block = nn.Module()
    model.block.mix = layer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = model.block, model[1]
            self.stem = model[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block.mix(self.stem(x)))

    with pytest.raises(UnsupportedOperatorError) as caught:
        _export(Net(), tmp_path / "art")
    assert (caught.value.op, caught.value.module) == (op, module)
    assert f"operator {op!r} (used by module {module!r})" in str(caught.value)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batchnorm": "running"}, ValueError, r"`batchnorm == 'running'`"),
        ({"parity_steps": 0}, ValueError, r"`parity_steps == 0`"),
        ({"lr": float("nan")}, ValueError, r"`lr == nan`"),
        ({"optimizer": torch.optim.Adam([nn.Parameter(torch.zeros(1))], weight_decay=0.1)}, Exception, "cannot run"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path: Path, kwargs, error, match) -> None:
    model = _mlp()
    optimizer = kwargs.pop("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(error, match=match):
        export_model(model, nn.CrossEntropyLoss(), optimizer, _example(), tmp_path / "art", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_frozen_batchnorm_needs_running_statistics(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="module '1' is a BatchNorm without running statistics"):
        _export(model, tmp_path / "art")


def test_export_prints_no_onnxruntime_info_logs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _export(_mlp(), tmp_path / "art")
    OrtOnlineLearner.from_artifacts(tmp_path / "art").observe(tuple(t.numpy() for t in _example()))
    assert "[I:onnxruntime" not in capfd.readouterr().err


def test_token_tagger_trains_on_device_with_ignored_padding(tmp_path: Path) -> None:
    case = ZOO["token_tagger"]
    model, loss_fn, optimizer = case.build(0)
    folder = export_model(model, loss_fn, optimizer, case.batch(4), tmp_path / "art")
    device = OrtOnlineLearner.from_artifacts(folder)
    x, y = case.batch(6, 1)
    assert (y == -100).any()  # padded positions carry the ignore index
    stats = device.observe((x.numpy(), y.numpy()))
    with torch.no_grad():
        expected = float(loss_fn(model(x), y))
    assert stats.loss == pytest.approx(expected, rel=1e-5)
    with pytest.raises(InvalidBatchError, match=r"must be in \[0, 3\] \(or -100, ignored\)"):
        device.observe((x.numpy(), np.full_like(y.numpy(), 7)))


def test_adamw_state_and_batch_statistics_travel_unchanged(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _example()
    for _ in range(2):  # moments, step and running statistics all non-trivial
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, (x, y), tmp_path / "art", batchnorm="batch")
    exported = OrtOnlineLearner.from_artifacts(folder).parameters()
    for name, value in model.state_dict().items():
        if name in exported:
            np.testing.assert_array_equal(exported[name], value.numpy(), err_msg=name)


class _ConvBranches(nn.Module):
    """A conv + BatchNorm chain (folded), one with a bias (folded), one whose conv output is also read elsewhere (kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b, self.bn_b = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c, self.bn_c = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_b(self.b(torch.relu(self.bn_a(self.a(x))))))
        c = self.c(x)
        return self.head((self.bn_c(c) + c).mean((2, 3)))


def test_frozen_batchnorm_folds_into_the_convolution_before_it_and_trains_like_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _ConvBranches()
    model(torch.randn(16, 3, 6, 6) * 2 + 1)  # running statistics away from 0 and 1
    with torch.no_grad():
        for bn in (model.bn_a, model.bn_b, model.bn_c):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    g = torch.Generator().manual_seed(2)
    example = (torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, example, tmp_path / "art", parity_steps=4)
    graph = onnx.load(str(folder / "training_model.onnx")).graph
    convs = [node for node in graph.node if node.op_type == "Conv"]
    mul_inputs = {name for node in graph.node if node.op_type == "Mul" for name in node.input}
    assert sum(conv.output[0] in mul_inputs for conv in convs) == 1  # only c's output still meets a Mul (its BatchNorm)
    assert sum("taste_cl_fold" in conv.input[1] for conv in convs) == 2
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parity"]["max_param_diff"] < 1e-4  # the BatchNorm's weight and bias train through the folded conv
    assert {"model.bn_a.weight", "model.bn_b.bias"} <= set(manifest["trainable"])


class _AtTheBounds(nn.Module):
    """ReLU6, Hardsigmoid and Hardswish on inputs exactly at their bounds, where PyTorch's gradients have their own rules."""

    def __init__(self) -> None:
        super().__init__()
        self.at = nn.Parameter(torch.tensor([0.0, 6.0, -3.0, 3.0]))
        self.relu6, self.hardsigmoid, self.hardswish = nn.ReLU6(), nn.Hardsigmoid(), nn.Hardswish()
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x[:, :4] * 0 + self.at  # exactly the bounds
        return self.head(torch.cat([x[:, :4] + self.relu6(z), self.hardsigmoid(z), self.hardswish(z)], 1))


def test_activations_at_their_bounds_train_on_the_device_as_in_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _AtTheBounds()
    x, y = _example()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    folder = export_model(model, nn.CrossEntropyLoss(), optimizer, (x, y), tmp_path / "art")
    ops = [node.op_type for node in onnx.load(str(folder / "training_model.onnx")).graph.node]
    assert "Clip" in ops and not {"GreaterOrEqual", "LessOrEqual"} & set(ops)  # the Clip gradients made strict
    device = OrtOnlineLearner.from_artifacts(folder)
    device.train_step(x.numpy(), y.numpy())
    nn.CrossEntropyLoss()(model(x), y).backward()  # PyTorch's own ReLU6, Hardsigmoid and Hardswish
    optimizer.step()
    np.testing.assert_allclose(device.parameters()["at"], model.at.detach().numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["er_ace", "der++", "lwf"])
def test_a_strategy_the_training_runtimes_cannot_carry_is_refused_not_dropped(tmp_path, strategy):
    """The ONNX Runtime training and ExecuTorch learners train plain replay: exporting ER-ACE, DER++ or LwF
    there would continue as plain replay without a word, so it is refused, naming the backend that carries it."""
    from taste_cl import OnlineLearner, ReservoirReplay
    from taste_cl.adapters.device.learner_data import check_device_trains_alike
    from taste_cl.exceptions import ExportError

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    learner = OnlineLearner(model, replay=ReservoirReplay(8), strategy=strategy)
    with pytest.raises(ExportError, match=rf"strategy is .*'{re.escape(strategy)}'.*backend='onnx_engine'"):
        check_device_trains_alike(learner)
    check_device_trains_alike(OnlineLearner(model, replay=ReservoirReplay(8)))  # plain replay passes


def test_a_probe_guard_the_training_runtimes_cannot_carry_is_refused_not_dropped():
    from taste_cl import OnlineLearner, ReservoirReplay
    from taste_cl.adapters.device.learner_data import check_device_trains_alike
    from taste_cl.exceptions import ExportError
    from taste_cl.guards.probe import ProbeGuard

    learner = OnlineLearner(torch.nn.Sequential(torch.nn.Linear(4, 3)), replay=ReservoirReplay(8), plugins=[ProbeGuard()])
    with pytest.raises(ExportError, match=r"ProbeGuard.*backend='onnx_engine'"):
        check_device_trains_alike(learner)
