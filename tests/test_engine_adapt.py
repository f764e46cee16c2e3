"""Test-time adaptation over an engine (taste_cl.engine.adapt): the numpy loop against the torch TestTimeAdapter,
the ONNX engine's batch-statistics graphs against torch, the shared guard, and refusals."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from helpers import run_without_torch

from taste_cl.adaptation import CollapseGuard, Tent, TestTimeAdapter
from taste_cl.adaptation.methods import affine_parameters
from taste_cl.adapters.onnx_engine.adapt_export import export_adapter
from taste_cl.adapters.onnx_engine.learner import load_adapter
from taste_cl.engine.adapt import ArrayCollapseGuard, EngineAdapter
from taste_cl.engine.base import AdaptableEngine
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.exceptions import AdaptationWarning, ArtifactError, CheckpointError, ExportError, InvalidBatchError

LR = 5e-3
GUARD = {"window": 16, "min_rows": 16, "min_marginal_ratio": 0.556, "accuracy_margin": None}  # between this stream's ratios: some batches reset;
# no fallback on the estimate, which the ONNX engine cannot give yet (it returns no classifier features)


def bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )  # fmt: skip
    with torch.no_grad():
        for bn in (model[1], model[5]):
            bn.running_mean.uniform_(-0.3, 0.3)
            bn.running_var.uniform_(0.5, 1.5)
        model[9].weight.mul_(4)  # confident predictions: their marginal moves from batch to batch
    return model.eval()


def stream(sizes: tuple[int, ...] = (16, 16, 10, 1, 16, 3), seed: int = 0, shift: float = 0.7) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [(g.standard_normal((n, 1, 8, 8)) + shift).astype(np.float32) for n in sizes]


def torch_adapter(model: nn.Module, method: str, guard: CollapseGuard | None = None) -> TestTimeAdapter:
    adapter = TestTimeAdapter(Tent(lr=LR) if method == "tent" else "bn", guard=guard)
    adapter.bind(model)
    return adapter


def torch_engine_adapter(model: nn.Module, method: str, guard: ArrayCollapseGuard | None = None) -> EngineAdapter:
    params = affine_parameters(model)
    optimizer = torch.optim.Adam(params.values(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    return EngineAdapter(TorchEngine(model, optimizer, trainable=list(params)), method, lr=LR, guard=guard)


@pytest.fixture(scope="module", params=["bn", "tent"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    method = request.param
    folder = tmp_path_factory.mktemp(f"adapt_{method}")
    adapter = TestTimeAdapter(Tent(lr=LR) if method == "tent" else "bn", guard=CollapseGuard(**GUARD))
    return method, export_adapter(bn_cnn(), torch.zeros(16, 1, 8, 8), folder, adapter)


def run(adapt, batches: list[np.ndarray]) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AdaptationWarning)
        return [np.asarray(adapt(x)) for x in batches]


@pytest.mark.parametrize("method", ["bn", "tent"])
def test_the_numpy_loop_on_torch_eager_is_the_torch_adapter(method: str) -> None:
    reference, model = bn_cnn(), bn_cnn()
    torch_side = torch_adapter(reference, method)
    engine_side = torch_engine_adapter(model, method)
    expected = run(lambda x: torch_side.adapt(torch.from_numpy(x)).outputs.numpy(), stream())
    got = run(lambda x: engine_side.adapt(x).outputs, stream())
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, atol=1e-5)
    for name, buffer in reference.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), buffer.numpy(), atol=1e-5, err_msg=name)


def test_the_onnx_engine_adapts_as_torch_eager(exported: tuple[str, Path]) -> None:
    method, folder = exported
    device = load_adapter(folder)
    assert isinstance(device.engine, AdaptableEngine) and device.method == method
    device.guard = None
    eager = torch_engine_adapter(bn_cnn(), method)
    for e, g in zip(run(lambda x: eager.adapt(x).outputs, stream()), run(lambda x: device.adapt(x).outputs, stream())):
        np.testing.assert_allclose(g, e, atol=1e-4)
    expected = eager.engine.norm_statistics()  # type: ignore[attr-defined]
    for name, value in device.engine.norm_statistics().items():  # type: ignore[attr-defined]
        np.testing.assert_allclose(value, expected[name], atol=1e-4, err_msg=name)
    np.testing.assert_allclose(device.engine.forward(stream()[0], train=False), eager.engine.forward(stream()[0], train=False), atol=1e-4)


def test_the_guard_resets_at_the_same_batch_as_torch(exported: tuple[str, Path]) -> None:
    method, folder = exported
    collapsing = stream((16,) * 12, seed=3, shift=0.0)
    model = bn_cnn()
    torch_side = torch_adapter(model, method, CollapseGuard(**GUARD))
    expected = [torch_side.adapt(torch.from_numpy(x)) for x in collapsing]
    device = load_adapter(folder)
    got = [device.adapt(x) for x in collapsing]
    assert [s.reset for s in got] == [s.reset for s in expected]
    assert any(s.reset for s in expected)
    assert device.resets == torch_side.resets and device.lr_scale == torch_side.lr_scale
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.outputs, e.outputs.numpy(), atol=1e-4)
        if e.verdict is not None:
            assert g.verdict is not None and g.verdict.marginal_ratio == pytest.approx(e.verdict.marginal_ratio, abs=1e-5)


def test_the_torch_and_numpy_guards_judge_alike() -> None:
    g = np.random.default_rng(0)
    torch_guard, numpy_guard = (
        CollapseGuard(window=24, min_rows=8, class_prior=[1, 2, 3]),
        ArrayCollapseGuard(window=24, min_rows=8, class_prior=[1, 2, 3]),
    )
    for k in range(10):
        logits = (g.standard_normal((6, 3)) * (1 + k)).astype(np.float32)
        logits[:, 0] += 3 * k  # collapsing onto class 0
        a, b = torch_guard.update(torch.from_numpy(logits)), numpy_guard.update(logits)
        assert (a.reset, a.rows) == (b.reset, b.rows)
        assert a.marginal_ratio == pytest.approx(b.marginal_ratio, abs=1e-6) and a.entropy == pytest.approx(b.entropy, abs=1e-6)
    assert torch_guard.resets == numpy_guard.resets > 0


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (np.full((4, 1, 8, 8), np.nan, np.float32), "NaN"),
        (np.zeros((4, 1, 9, 8), np.float32), "must be shaped"),
        (np.zeros((17, 1, 8, 8), np.float32), "2 to 16 rows"),
        (np.zeros((0, 1, 8, 8), np.float32), "at least one row"),
        (np.array([["a"]]), "numeric"),
    ],
)
def test_a_bad_batch_is_refused_and_changes_nothing(exported: tuple[str, Path], batch: np.ndarray, match: str) -> None:
    device = load_adapter(exported[1])
    device.adapt(stream()[0])
    engine = device.engine
    before = (engine.parameters(), engine.norm_statistics(), engine.optimizer_state(), device.batches)  # type: ignore[attr-defined]
    with pytest.raises(InvalidBatchError, match=match):
        device.adapt(batch)
    after = (engine.parameters(), engine.norm_statistics(), engine.optimizer_state(), device.batches)  # type: ignore[attr-defined]
    for one, two in zip(before[:3], after[:3]):
        assert one.keys() == two.keys() and all(np.array_equal(one[k], two[k]) for k in one)
    assert before[3] == after[3]


def test_bad_statistics_are_refused_and_change_nothing(exported: tuple[str, Path]) -> None:
    engine = load_adapter(exported[1]).engine
    good = engine.norm_statistics()  # type: ignore[attr-defined]
    for bad in ({**good, "1.running_var": -good["1.running_var"] - 1}, {k: v for k, v in good.items() if k != "5.num_batches_tracked"},
                {**good, "1.running_mean": np.full_like(good["1.running_mean"], np.nan)}):  # fmt: skip
        with pytest.raises(CheckpointError):
            engine.load_norm_statistics(bad)  # type: ignore[attr-defined]
        assert all(np.array_equal(v, good[k]) for k, v in engine.norm_statistics().items())  # type: ignore[attr-defined]


def test_small_batches_warn_once_and_take_no_step(exported: tuple[str, Path]) -> None:
    device = load_adapter(exported[1])
    before = device.engine.norm_statistics()  # type: ignore[attr-defined]
    with pytest.warns(AdaptationWarning, match="below min_batch"):
        stats = device.adapt(stream((1,))[0])
    assert not stats.batch_statistics and stats.rows_used == 0
    assert all(np.array_equal(v, before[k]) for k, v in device.engine.norm_statistics().items())  # type: ignore[attr-defined]


def test_export_refusals(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="'bn' or 'tent'"):
        export_adapter(bn_cnn(), torch.zeros(4, 1, 8, 8), tmp_path / "a", TestTimeAdapter("eata"))
    with pytest.raises(ExportError, match="no normalisation layer"):
        export_adapter(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), torch.zeros(4, 1, 8, 8), tmp_path / "b")
    with pytest.raises(ExportError, match="no BatchNorm"):
        export_adapter(nn.Sequential(nn.Flatten(), nn.LayerNorm(64), nn.Linear(64, 3)), torch.zeros(4, 1, 8, 8), tmp_path / "c")


def test_a_bad_adapter_record_is_refused(exported: tuple[str, Path], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(exported[1], folder)
    (folder / "adapter.json").write_text(
        '{"format": "taste_cl.onnx_engine.adapter/1", "method": "eata", "lr": 1, "min_batch": 2, "backoff": 0.5, "guard": null}'
    )
    with pytest.raises(ArtifactError, match="does not build an adapter"):
        load_adapter(folder)


def test_the_device_adapter_runs_without_torch(exported: tuple[str, Path]) -> None:
    script = """
        import sys, numpy as np
        from taste_cl.adapters.onnx_engine.learner import load_adapter
        adapter = load_adapter(sys.argv[1])
        x = np.random.default_rng(0).standard_normal((16, 1, 8, 8)).astype(np.float32)
        print(adapter.adapt(x).outputs.shape)
    """
    result = run_without_torch(script, str(exported[1]), timeout=300)
    assert result.stdout.strip() == "(16, 5)", result.stderr


def test_the_torch_engine_is_adaptable_and_copies_its_statistics() -> None:
    model = bn_cnn()
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(engine, AdaptableEngine)
    stats = engine.norm_statistics()
    stats["1.running_mean"][:] = 5.0  # a copy: the model's buffer stays
    assert float(model[1].running_mean.abs().max()) < 1
    with pytest.raises(ValueError, match="statistics"):
        engine.load_norm_statistics({**stats, "1.running_var": np.full(4, np.inf, np.float32)})
    engine.load_norm_statistics(stats)
    assert float(model[1].running_mean[0]) == 5.0
    copy.deepcopy(engine.model)
