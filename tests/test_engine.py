"""The engine interface: numpy losses equal the torch strategies', and torch eager keeps the contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import run_without_torch
from torch import nn
from torch.nn import functional as F

from taste_cl.engine import check_engine
from taste_cl.engine.losses import clip_by_total_norm, der_plus_plus, er_ace, experience_replay, lwf, mean_entropy
from taste_cl.engine.torch_engine import TorchEngine
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF
from taste_cl.testing import check_engine as shipped_check_engine


def _batch(seed: int = 0, rows: int = 12, n_stream: int = 7, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outputs = torch.randn(rows, classes, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, classes, (rows,), generator=g)
    y[:n_stream] = torch.tensor([0, 2, 2, 0, 2, 0, 2])[:n_stream]  # the stream part holds classes 0 and 2 only
    return outputs, y


def _torch_loss_and_grad(strategy, outputs: torch.Tensor, y: torch.Tensor, n_stream: int, fields=None) -> tuple[float, np.ndarray]:
    out = outputs.clone().requires_grad_(True)
    loss = strategy.loss(nn.CrossEntropyLoss(), out, y, x=out, n_stream=n_stream, fields=fields or {})
    (grad,) = torch.autograd.grad(loss, out)
    return float(loss.detach()), grad.numpy()


@pytest.mark.parametrize("n_stream", [7, 12])
def test_numpy_experience_replay_and_er_ace_equal_the_torch_strategies(n_stream):
    outputs, y = _batch()
    for strategy, numpy_loss in ((ExperienceReplay(), experience_replay), (ERACE(), er_ace)):
        expected_loss, expected_grad = _torch_loss_and_grad(strategy, outputs, y, n_stream)
        loss, grad = numpy_loss(outputs.numpy(), y.numpy(), n_stream)
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_numpy_der_plus_plus_equals_the_torch_strategy():
    outputs, y = _batch()
    stored = torch.randn(5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    strategy = DERPlusPlus(alpha=0.5, beta=2.0)
    expected_loss, expected_grad = _torch_loss_and_grad(strategy, outputs, y, 7, {"logits": stored})
    loss, grad = der_plus_plus(outputs.numpy(), y.numpy(), 7, stored.numpy(), alpha=0.5, beta=2.0)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match="stored outputs"):
        der_plus_plus(outputs.numpy(), y.numpy(), 7, None)


def test_numpy_lwf_equals_the_torch_strategy():
    outputs, y = _batch()
    teacher_model = nn.Linear(5, 5).double()
    strategy = LwF(alpha=0.7, temperature=3.0, every=1, on_drift=False)
    strategy.teacher = teacher_model  # the teacher's outputs for x (here: x is the outputs themselves)
    with torch.no_grad():
        teacher = teacher_model(outputs)
    expected_loss, expected_grad = _torch_loss_and_grad(strategy, outputs, y, 7)
    loss, grad = lwf(outputs.numpy(), y.numpy(), 7, teacher.numpy(), alpha=0.7, temperature=3.0)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_numpy_mean_entropy_and_clipping_equal_torch():
    outputs, _ = _batch()
    out = outputs.clone().requires_grad_(True)
    p = F.softmax(out, dim=1)
    expected = -(p * F.log_softmax(out, dim=1)).sum(1).mean()
    (expected_grad,) = torch.autograd.grad(expected, out)
    loss, grad = mean_entropy(outputs.numpy())
    assert loss == pytest.approx(float(expected), rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad.numpy(), rtol=1e-10, atol=1e-14)
    params = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    grads = {"w": params[0].numpy().copy(), "b": params[1].numpy().copy()}
    for p_ in params:
        p_.grad = p_.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    clipped, numpy_norm = clip_by_total_norm(grads, 0.5)
    assert numpy_norm == pytest.approx(float(norm))
    np.testing.assert_allclose(clipped["w"], params[0].grad.numpy(), rtol=1e-12)
    unclipped, _ = clip_by_total_norm(grads, 1e9)
    assert np.array_equal(unclipped["w"], grads["w"])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_torch_eager_keeps_the_engine_contract(optimizer):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = TorchEngine(model, opt)
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    check_engine(engine, x)
    assert shipped_check_engine is check_engine


def test_torch_engine_with_numpy_losses_trains_as_the_torch_loop():
    """One step of the engine driven by a numpy loss equals one plain torch step."""
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (10,), generator=torch.Generator().manual_seed(2))
    reference = _mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    model = _mlp()
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(3):
        outputs = engine.forward(x.numpy(), train=True)
        _, grad = experience_replay(outputs, y.numpy(), 10)
        engine.step(engine.backward(grad), 0.1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _Broken(TorchEngine):
    def parameters(self):  # views, not copies
        return {n: p.detach().numpy() for n, p in zip(self.trainable, self._params)}


def test_check_engine_catches_an_engine_that_hands_out_views():
    model = _mlp()
    engine = _Broken(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(AssertionError, match="must return copies"):
        check_engine(engine, np.zeros((4, 6), dtype=np.float32))


def test_the_engine_interface_and_losses_import_without_torch():
    result = run_without_torch("import taste_cl.engine, taste_cl.engine.losses, taste_cl.engine.check\nprint('ok')", timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
