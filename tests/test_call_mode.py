"""``OnlineLearner(call=...)``: a dict / tuple input passed whole to a ``forward(self, batch)``
(``"positional"``), spread into its parameters (``"keywords"``), or decided from the signature
(``"auto"``); the same decision in training, strategies, checkpoints and device export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl._batch import call_style
from taste_cl.exceptions import CheckpointError, InvalidBatchError
from taste_cl.monitor.monitor import StabilityPlasticityMonitor
from taste_cl.state.checkpoint import write_checkpoint

USERS, ITEMS = 20, 30


class Recommender(nn.Module):
    """The recommender way: ``forward`` takes the batch dict itself."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.items, self.head = nn.Embedding(USERS, 8), nn.Embedding(ITEMS, 8), nn.Linear(8, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.users(batch["user"]) * self.items(batch["item"]))


class KeywordRecommender(Recommender):
    """The same model taking one parameter per key (``model(**x)``)."""

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward({"user": user, "item": item})


def _model(kind: type[Recommender] = Recommender) -> Recommender:
    torch.manual_seed(0)
    return kind()


def _batch(seed: int, n: int = 8) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, USERS, (n,), generator=generator), torch.randint(0, ITEMS, (n,), generator=generator)
    return {"user": user, "item": item}, (user + item) % 2


def _learner(model: nn.Module, **kwargs: Any) -> OnlineLearner:
    return OnlineLearner(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), replay=ReservoirReplay(capacity=40),
        replay_batch_size=4, monitor=StabilityPlasticityMonitor(eval_every=2, probe_capacity=16), **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("strategy", ["er", "lwf"])
@pytest.mark.parametrize("call", ["auto", "positional"])
def test_a_model_taking_the_dict_trains_exactly_as_its_keyword_twin(call: str, strategy: str) -> None:
    """Training, the monitor's probe, a teacher (LwF) and predict all pass the dict whole."""
    learner = _learner(_model(), call=call, strategy=strategy)
    twin = _learner(_model(KeywordRecommender), strategy=strategy)
    for seed in range(12):
        assert learner.observe(_batch(seed)).loss == twin.observe(_batch(seed)).loss
    assert all(torch.equal(p, q) for p, q in zip(learner.model.parameters(), twin.model.parameters()))
    assert learner.monitor.stability == twin.monitor.stability is not None
    x, _ = _batch(99)
    assert torch.equal(learner.predict(x), twin.predict(x))


def test_the_dict_model_learns() -> None:
    model = _model()
    learner = OnlineLearner(model, optimizer=torch.optim.Adam(model.parameters(), lr=0.05), replay=ReservoirReplay(capacity=40))
    losses = [learner.observe(_batch(seed)).loss for seed in range(100)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) / 4


def test_keywords_spreads_the_dict_and_gives_todays_error_naming_the_fix() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    learner = _learner(model, call="keywords")
    with pytest.raises(InvalidBatchError, match=r"unexpected keyword argument 'user'.*call='positional'"):
        learner.observe(_batch(0))
    assert learner.output_shape is None and learner.samples_seen == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class _Starred(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args, kwargs


class _Pair(nn.Module):
    def forward(self, pair: Any) -> Any:
        return pair


class _Masked(nn.Module):
    def forward(self, x: Any, mask: Any = None) -> Any:
        return x, mask


class _WithOptions(nn.Module):
    def forward(self, batch: Any, **options: Any) -> Any:
        return batch


_T = torch.zeros(2, 1)


@pytest.mark.parametrize(
    ("model", "x", "style"),
    [
        (Recommender(), {"user": _T, "item": _T}, "positional"),
        (KeywordRecommender(), {"user": _T, "item": _T}, "keywords"),
        (Recommender(), {"batch": _T}, "keywords"),  # its keys name the parameter: spread, as before
        (_Starred(), {"user": _T, "item": _T}, "keywords"),  # the signature says nothing
        (_WithOptions(), {"user": _T, "item": _T}, "keywords"),
        (_Pair(), (_T, _T), "positional"),
        (_Pair(), [_T], "keywords"),
        (_Masked(), (_T, _T), "keywords"),
        (_Masked(), {"x": _T, "mask": _T}, "keywords"),
        (_Masked(), {"x": _T, "other": _T}, "positional"),
        (_Pair(), _T, "keywords"),  # a tensor is passed as it is whatever the mode
    ],
)
def test_auto_decides_from_the_signature_and_the_keys(model: nn.Module, x: Any, style: str) -> None:
    assert call_style(model, x) == style
    assert call_style(model, x, "positional") == "positional" and call_style(model, x, "keywords") == "keywords"


def test_auto_spreads_into_a_model_taking_one_argument_per_key() -> None:
    learner = _learner(_model(KeywordRecommender))
    assert learner.call == "auto" and call_style(learner.model, _batch(0)[0], learner.call) == "keywords"
    learner.observe(_batch(0))
    assert learner.predict(_batch(1)[0]).shape == (8, 2)


def test_positional_reaches_a_model_auto_cannot_read() -> None:
    class Logged(nn.Module):  # forward(batch, **options): auto spreads, so the mode must be given
        def __init__(self) -> None:
            super().__init__()
            self.inner = _model()

        def forward(self, batch: dict[str, torch.Tensor], **options: Any) -> torch.Tensor:
            return self.inner(batch)

    with pytest.raises(InvalidBatchError, match="call='positional'"):
        _learner(Logged()).observe(_batch(0))
    _learner(Logged(), call="positional").observe(_batch(0))


def test_a_forced_positional_mode_reaches_the_tuner_head_growth_and_the_probe_guard(tmp_path: Path) -> None:
    """Everything that runs the model on a batch passes the dict whole when told to: the batch-size
    tuner's probes and memory estimate (a probe that called the model wrongly would fail, and every
    failed probe ends in a TuningWarning), growing the classifier for a new class, ProbeGuard's model."""
    import warnings

    from taste_cl import BatchSizeTuner
    from taste_cl.exceptions import TuningWarning
    from taste_cl.guards.probe import ProbeGuard

    class Logged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _model()

        def forward(self, batch: dict[str, torch.Tensor], **options: Any) -> torch.Tensor:
            return self.inner(batch)

    tuner = BatchSizeTuner(max_batch_size=16, n_calls=3, warm_calls=1, min_probe_time=0.005, cache_dir=tmp_path)
    learner = _learner(Logged(), call="positional", plugins=[tuner], max_classes=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        for seed in range(3):
            learner.observe(_batch(seed))
    assert tuner.result_ is not None
    x, _ = _batch(5)
    learner.observe((x, torch.full((8,), 3)))  # a class the model never saw: the head grows to 4 outputs
    assert learner.model.inner.head.out_features == 4
    guard = ProbeGuard()
    guarded = _learner(Logged(), call="positional", plugins=[guard])
    for seed in range(3):
        guarded.observe(_batch(seed))
    assert guard.predict(_batch(9)[0]).shape == (8, 2)


@pytest.mark.parametrize("value", ["kw", "Positional", None, 1, ["auto"]])
def test_a_bad_call_mode_is_refused_at_construction(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`call == .*`, must be one of 'auto', 'keywords', 'positional'"):
        OnlineLearner(_model(), call=value)


def test_checkpoints_keep_the_call_mode(tmp_path: Path) -> None:
    learner = _learner(_model(), call="positional")
    learner.observe(_batch(0))
    learner.save(tmp_path / "ckpt")
    fresh = _model()
    restored = OnlineLearner.load(tmp_path / "ckpt", model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.2))
    assert restored.call == "positional"
    live = _learner(_model())
    live.load_state_dict(learner.state_dict())
    assert live.call == "positional"
    assert restored.observe(_batch(1)).loss == learner.observe(_batch(1)).loss


def test_a_checkpoint_without_the_key_loads_as_keywords(tmp_path: Path) -> None:
    """Written before the option: every model then took ``model(**x)``."""
    learner = _learner(_model(KeywordRecommender))
    learner.observe(_batch(0))
    state = learner.state_dict()
    del state["config"]["call"]
    write_checkpoint(tmp_path / "old", state)
    fresh = _model(KeywordRecommender)
    assert OnlineLearner.load(tmp_path / "old", model=fresh).call == "keywords"


@pytest.mark.parametrize("value", ["kw", None, 3])
def test_a_bad_call_mode_in_a_checkpoint_is_refused_and_changes_nothing(tmp_path: Path, value: Any) -> None:
    learner = _learner(_model(), call="positional")
    learner.observe(_batch(0))
    state = learner.state_dict()
    state["config"]["call"] = value
    target = _learner(_model())
    target.observe(_batch(5))
    before = [p.detach().clone() for p in target.model.parameters()]
    with pytest.raises(CheckpointError, match=r"config\.call"):
        target.load_state_dict(state)
    assert target.call == "auto" and target.samples_seen == 8
    assert all(torch.equal(p, q) for p, q in zip(target.model.parameters(), before))
    write_checkpoint(tmp_path / "bad", state)
    with pytest.raises(CheckpointError, match=r"config\.call"):
        OnlineLearner.load(tmp_path / "bad", model=_model())


def test_the_elastic_profiler_calls_the_model_as_the_learner_does() -> None:
    from taste_cl.elastic.profiling import unit_names

    x, _ = _batch(0)
    assert unit_names(_model(), x, call="positional") == ["users.weight", "items.weight", "head.weight", "head.bias"]
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        unit_names(_model(), x, call="keywords")


@pytest.mark.training_build
def test_the_dict_model_exports_to_onnx_runtime_and_trains_there_without_torch(tmp_path: Path) -> None:
    """The graph's inputs are the dict's leaves by key, whichever way the model takes the dict: the device feeds numpy arrays by name."""
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    learner = _learner(_model())
    for seed in range(6):
        learner.observe(_batch(seed))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    device = OrtOnlineLearner.from_artifacts(folder)
    x, y = _batch(50)
    arrays = {key: value.numpy() for key, value in x.items()}
    np.testing.assert_allclose(device.predict(arrays), learner.predict(x).numpy(), rtol=1e-5, atol=1e-6)
    before = device.predict(arrays)
    stats = device.observe((arrays, y.numpy()))
    assert stats.samples == 8 and np.isfinite(stats.loss)
    assert not np.array_equal(device.predict(arrays), before)  # it trained
