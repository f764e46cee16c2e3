"""The label-free accuracy estimate (AETTA) of test-time adaptation: its arithmetic, the dropout probe on the
classifier, that it follows a collapse, and the guard's fallback to the source when it says the source is better."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from taste_cl.adaptation import CollapseGuard, Tent, TestTimeAdapter
from taste_cl.adaptation.estimate import DropoutProbe
from taste_cl.engine.adapt import ArrayCollapseGuard, aetta_accuracy, dropout_summary


def _bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


def _images(n: int, seed: int, spread: float = 1.0, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.randn(n, 1, 8, 8, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() * spread + shift, y


def _pretrained(spread: float) -> nn.Module:
    model = _bn_cnn()
    x, y = _images(512, 0, spread)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(5):
        for rows in torch.arange(512).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
    return model.eval()


def test_the_estimate_is_the_dropout_agreement_corrected_by_the_marginal_entropy():
    balanced = np.concatenate([np.full((8, 1), 0.9), np.tile(np.eye(4), (2, 1))], axis=1)  # 90% agreement, every class
    assert aetta_accuracy(balanced) == pytest.approx(0.9)
    one_class = balanced.copy()
    one_class[:, 1:] = [0.97, 0.01, 0.01, 0.01]  # as sure, all on one class: the robustness term floors it at 1/classes
    assert aetta_accuracy(one_class) == pytest.approx(0.25)
    # with a class prior the marginal is measured against the prior's entropy: two classes seen, both predicted
    two = np.concatenate([np.full((8, 1), 0.9), np.tile(np.eye(4)[:2], (4, 1))], axis=1)
    assert aetta_accuracy(two) < 0.25 + 1e-9 and aetta_accuracy(two, np.array([0.5, 0.5, 0.0, 0.0])) == pytest.approx(0.9)
    logits = np.array([[3.0, 0.0], [0.0, 3.0]])
    dropped = np.stack([logits, logits[:, ::-1]])  # the second pass flips both predictions
    summary = dropout_summary(logits, dropped)
    np.testing.assert_allclose(summary[:, 0], [0.5, 0.5])
    np.testing.assert_allclose(summary[:, 1:].sum(axis=1), [1, 1], atol=1e-6)
    with pytest.raises(ValueError, match=r"`dropout_logits` must be \(passes, rows, classes\)"):
        dropout_summary(logits, logits)


def test_the_probe_drops_out_the_classifiers_features_only_and_repeats_its_masks():
    model = _bn_cnn().eval()
    probe = DropoutProbe(model)
    x = torch.randn(6, 1, 8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with probe.capture(), torch.no_grad():
        logits = model(x)
    first, again = probe.summary(logits, seed=3), probe.summary(logits, seed=3)
    assert first is not None and again is not None and first.shape == (6, 5) and torch.equal(first, again)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not model[9]._forward_hooks  # the hook lives only inside capture()
    # something after the classifier: its output is not the model's, so no estimate rather than a wrong one
    scaled = nn.Sequential(model, nn.Softmax(dim=1))
    probe = DropoutProbe(scaled)
    with probe.capture(), torch.no_grad():
        out = scaled(x)
    assert probe.summary(out, seed=0) is None
    with pytest.raises(ValueError, match=r"`rate == 1.0`, must be below 1"):
        DropoutProbe(model, rate=1.0)


def test_the_estimate_follows_a_collapsing_tent_down():
    model = _pretrained(0.5)
    adapter = TestTimeAdapter(Tent(lr=1.0), guard=None)
    adapter.bind(model)
    true, estimated = [], []
    for block in range(5):
        stats = [adapter.adapt(x) for x in (_images(16, 8 * block + s, 0.5, shift=1.5)[0] for s in range(8))]
        ys = torch.cat([_images(16, 8 * block + s, 0.5, shift=1.5)[1] for s in range(8)])
        true.append(float((torch.cat([s.outputs for s in stats]).argmax(1) == ys).float().mean()))
        summaries = [s.summary for s in stats]
        assert all(s is not None for s in summaries)
        estimated.append(aetta_accuracy(torch.cat(summaries).numpy()))  # type: ignore[arg-type]
    assert true[0] - true[-1] > 0.2  # it collapses
    assert estimated[0] - estimated[-1] > 0.3 and abs(estimated[-1] - true[-1]) < 0.05
    assert np.corrcoef(estimated, true)[0, 1] > 0.8


def _class_sorted(blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 8 rows of one class, the classes in turn: batch statistics then normalise each class away."""
    batches = []
    for s in range(blocks):
        x, y = _images(64, 100 + s)
        batches.append((x[y == s % 4][:8], y[y == s % 4][:8]))
    return batches


def test_the_guard_answers_with_the_source_while_the_estimate_says_it_predicts_better():
    model = _pretrained(1.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    accuracy = {}
    for name, guard in (("bn", None), ("guarded", CollapseGuard(window=32, min_rows=16, min_marginal_ratio=0.01))):
        model.load_state_dict(state)
        adapter = TestTimeAdapter("bn", guard=guard)
        adapter.bind(model)
        stats = [(adapter.adapt(x), y) for x, y in _class_sorted(16)]
        accuracy[name] = float(torch.cat([(s.outputs.argmax(1) == y).float() for s, y in stats]).mean())
        if guard is not None:
            verdicts = [s.verdict for s, _ in stats[1:]]  # the first batch has fewer rows than min_rows
            assert all(v is not None and v.fallback and v.accuracy < v.source_accuracy for v in verdicts)
            assert adapter.resets == 0 and not any(s.reset for s, _ in stats)
    model.load_state_dict(state)
    with torch.no_grad():
        source = float(torch.cat([(model(x).argmax(1) == y).float() for x, y in _class_sorted(16)]).mean())
    assert accuracy["bn"] < 0.4 and source > 0.9 and accuracy["guarded"] > source - 0.1


def test_the_torch_and_numpy_guards_judge_the_estimate_alike():
    g = np.random.default_rng(1)
    settings = {"window": 24, "min_rows": 8, "min_marginal_ratio": 0.01, "accuracy_margin": 0.05}
    torch_guard, numpy_guard = CollapseGuard(**settings), ArrayCollapseGuard(**settings)
    falls = []
    for k in range(8):
        logits, source = g.standard_normal((6, 3)).astype(np.float32), g.standard_normal((6, 3)).astype(np.float32) * 3
        noise = g.standard_normal((10, 6, 3)).astype(np.float32) * (0.2 + 0.3 * k)  # the adapted model grows unsure
        summary, source_summary = dropout_summary(logits, logits + noise), dropout_summary(source, source + noise[:, :, :1] * 0.1)
        a = torch_guard.update(torch.from_numpy(logits), torch.from_numpy(source), torch.from_numpy(summary), torch.from_numpy(source_summary))
        b = numpy_guard.update(logits, source, summary, source_summary)
        assert (a.fallback, a.reset) == (b.fallback, b.reset)
        assert a.accuracy == pytest.approx(b.accuracy, abs=1e-6) and a.source_accuracy == pytest.approx(b.source_accuracy, abs=1e-6)
        falls.append(a.fallback)
    assert not falls[0] and falls[-1]  # the estimate says the source is better once the dropout disagreement grows
    assert CollapseGuard().needs_source() and not ArrayCollapseGuard().needs_source(estimates=False)
    with pytest.raises(ValueError, match=r"`accuracy_margin == 2`"):
        CollapseGuard(accuracy_margin=2)
