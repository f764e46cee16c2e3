"""Models whose forward returns a dict, a tuple, a dataclass or a transformers ModelOutput.

The learner picks one tensor (``OnlineLearner(output=...)``, or inferred on the first batch)
and every model call uses it: training, predict (before the first batch too), the monitor,
strategies, the tuner's probes, elastic profiling, the probe guard, checkpoints and export.
The strongest check: a dict-output model trains bit for bit like its twin returning the
logits tensor, under every strategy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch
from helpers import snapshot
from torch import nn

from taste_cl import CheckpointError, InvalidBatchError, OnlineLearner, ReservoirReplay, StabilityPlasticityMonitor
from taste_cl.outputs import OutputSelector, infer_output, selecting
from taste_cl.strategies import LwF

FEATURES, HIDDEN, CLASSES = 6, 16, 3


class DictMLP(nn.Module):
    """An MLP returning ``{"logits": (n, 3), "hidden_states": (n, 16)}``: the hidden width
    differs from the logits', so training on or storing the wrong tensor shows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> Any:
        hidden = self.body(x)
        return {"logits": self.head(hidden), "hidden_states": hidden}


class PlainMLP(DictMLP):
    """The same network returning the logits tensor: the reference a dict-output learner must equal."""

    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(x)["logits"]


class TupleMLP(DictMLP):
    """Returns ``(logits, hidden)``, as many models return ``(output, aux)``."""

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return out["logits"], out["hidden_states"]


@dataclasses.dataclass
class Output:
    hidden_states: torch.Tensor
    logits: torch.Tensor


class DataclassMLP(DictMLP):
    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return Output(out["hidden_states"], out["logits"])


class NoLogitsMLP(DictMLP):
    """A dict without a ``logits`` entry: nothing to infer."""

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return {"scores": out["logits"], "hidden_states": out["hidden_states"]}


def _build(cls: type[nn.Module], **kwargs: Any) -> OnlineLearner:
    torch.manual_seed(0)
    model = cls()
    kwargs.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    return OnlineLearner(model, **kwargs)


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return x, (x[:, :CLASSES].argmax(1) + (x[:, 3] > 1).long()) % CLASSES


def _params(learner: OnlineLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


# ------------------------------------------------------------------ inference
@pytest.mark.parametrize(("cls", "expected"), [(DictMLP, "logits"), (TupleMLP, 0), (DataclassMLP, "logits")])
def test_output_is_inferred_logged_and_trains_like_the_tensor_model(cls, expected, caplog):
    learner, plain = _build(cls), _build(PlainMLP)
    with caplog.at_level(logging.INFO, logger="taste_cl"):
        for seed in range(6):
            stats = learner.observe(_batch(seed))
            assert stats.loss == plain.observe(_batch(seed)).loss
    assert learner.output == OutputSelector(expected) and plain.output is None
    assert learner.output_shape == (CLASSES,) and learner.num_classes == CLASSES
    assert all(torch.equal(a, b) for a, b in zip(_params(learner), _params(plain)))
    assert torch.equal(learner.predict(_batch(9)[0]), plain.predict(_batch(9)[0]))
    lines = [r.getMessage() for r in caplog.records if "OnlineLearner(output=...)" in r.getMessage()]
    assert len(lines) == 1 and str(OutputSelector(expected)) in lines[0], lines


def test_transformers_model_output_is_inferred():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import SequenceClassifierOutput

    class HFStyle(DictMLP):
        def forward(self, x: torch.Tensor) -> Any:
            out = super().forward(x)
            return SequenceClassifierOutput(logits=out["logits"], hidden_states=(out["hidden_states"],))

    learner, plain = _build(HFStyle), _build(PlainMLP)
    for seed in range(4):
        assert learner.observe(_batch(seed)).loss == plain.observe(_batch(seed)).loss
    assert learner.output == OutputSelector("logits")
    assert torch.equal(learner.predict(_batch(9)[0]), plain.predict(_batch(9)[0]))


def test_explicit_key_index_and_callable_pick_the_tensor():
    class Nested(DictMLP):
        def forward(self, x: torch.Tensor) -> Any:
            out = super().forward(x)
            return {"heads": {"main": out["logits"]}, "hidden_states": out["hidden_states"]}

    class AuxFirst(TupleMLP):
        def forward(self, x: torch.Tensor) -> Any:
            return tuple(reversed(super().forward(x)))

    plain = _build(PlainMLP)
    learners = [
        _build(NoLogitsMLP, output="scores"),
        _build(AuxFirst, output=1),
        _build(Nested, output=lambda out: out["heads"]["main"]),
        _build(DataclassMLP, output="logits"),
    ]
    for seed in range(3):
        loss = plain.observe(_batch(seed)).loss
        assert all(learner.observe(_batch(seed)).loss == loss for learner in learners)
    for learner in learners:
        assert all(torch.equal(a, b) for a, b in zip(_params(learner), _params(plain)))
        assert learner.predict(_batch(9)[0]).shape == (8, CLASSES)


def test_infer_output_rules():
    t = torch.zeros(2, 3)
    assert infer_output(t, 2) is None
    assert infer_output({"logits": t, "loss": torch.tensor(1.0)}, 2) == OutputSelector("logits")
    assert infer_output([t, "aux"], 2) == OutputSelector(0)
    with pytest.raises(InvalidBatchError, match=r"a tuple of 2 \(tensor \(3,\), tensor \(2, 3\)\)"):
        infer_output((torch.zeros(3), t), 2)  # the first element is not batch-sized
    with pytest.raises(InvalidBatchError, match="a str"):
        infer_output("logits", 2)


@pytest.mark.parametrize(("value", "error"), [(1.5, TypeError), (True, TypeError), ([0], TypeError), ("", ValueError)])
def test_bad_output_argument_is_refused_at_construction(value, error):
    with pytest.raises(error, match="output"):
        OnlineLearner(DictMLP(), output=value)


# ------------------------------------------------------------------ refusals
def test_a_dict_without_logits_is_refused_with_what_came_back_and_the_hint():
    learner = _build(NoLogitsMLP, replay=ReservoirReplay(20))
    before = snapshot(learner)
    with pytest.raises(InvalidBatchError) as caught:
        learner.observe(_batch(0))
    message = str(caught.value)
    assert "a dict with keys ['scores', 'hidden_states']" in message
    assert "output='logits'" in message and "output=0" in message and "callable" in message
    assert snapshot(learner) == before and learner.output is None and learner.output_shape is None
    with pytest.raises(InvalidBatchError) as again:  # predict refuses it the same way
        learner.predict(_batch(0)[0])
    assert str(again.value) == message and snapshot(learner) == before


def test_a_missing_key_and_an_output_without_batch_rows_say_what_happened():
    learner = _build(DictMLP, output="scores")
    with pytest.raises(InvalidBatchError, match=r"no entry or attribute 'scores': it returned a dict with keys \['logits', 'hidden_states'\]"):
        learner.observe(_batch(0))
    learner = _build(DictMLP, output=lambda out: out["logits"][0])  # drops the batch axis
    with pytest.raises(InvalidBatchError, match=r"on the first sample of the first batch \(1 row\) it returned shape \(3,\)"):
        learner.observe(_batch(0))
    with pytest.raises(InvalidBatchError, match=r"on the batch given to predict \(8 rows\) it returned shape \(3,\)"):
        learner.predict(_batch(0)[0])


def test_predict_before_the_first_batch_selects_like_observe_and_changes_nothing():
    learner = _build(DictMLP, replay=ReservoirReplay(20))
    x = _batch(0)[0]
    before = snapshot(learner)
    out = learner.predict(x)
    learner.model.eval()
    with torch.no_grad():
        assert torch.equal(out, learner.model(x)["logits"])
    learner.model.train()
    assert snapshot(learner) == before and learner.output is None and learner.output_shape is None
    learner.observe(_batch(1))
    assert learner.output == OutputSelector("logits") and learner.predict(x).shape == out.shape


# ------------------------------------------------------------------ strategies, monitor
@pytest.mark.parametrize("strategy", ["er", "er_ace", "der++", "lwf"])
def test_strategies_and_the_monitor_work_on_the_selected_output(strategy):
    def build(cls: type[nn.Module]) -> OnlineLearner:
        chosen = LwF(every=2) if strategy == "lwf" else strategy
        monitor = StabilityPlasticityMonitor(probe_capacity=16, eval_every=2)
        return _build(cls, replay=ReservoirReplay(30, seed=0), replay_batch_size=4, strategy=chosen, monitor=monitor)

    learner, plain = build(DictMLP), build(PlainMLP)
    for seed in range(8):
        assert learner.observe(_batch(seed)).loss == plain.observe(_batch(seed)).loss
    assert all(torch.equal(a, b) for a, b in zip(_params(learner), _params(plain)))
    assert learner.monitor.report() == plain.monitor.report() and learner.monitor.report()["stability"] is not None
    if strategy == "der++":  # the stored outputs are the logits, not the 16-wide hidden states
        assert learner.replay.sample(4, with_fields=True)[2]["logits"].shape == (4, CLASSES)
    if strategy == "lwf":
        assert learner.strategy.teacher is not None


# ------------------------------------------------------------------ plugins
def test_tuner_elastic_and_probe_guard_use_the_learners_output(tmp_path, recwarn):
    """A dataclass output: the loss, ``.shape`` and a pytree walk all fail on it unless the pick is applied."""
    from taste_cl.elastic import ElasticTrainer, measure_training_memory, profile_tensors
    from taste_cl.guards.probe import ProbeGuard
    from taste_cl.tuning import BatchSizeTuner

    picks = []

    def pick(out: Output) -> torch.Tensor:
        picks.append(out.logits.shape)
        return out.logits

    tuner = BatchSizeTuner(cache_dir=tmp_path, max_batch_size=32, n_calls=4, n_initial_points=2, min_probe_time=0.005)
    elastic = ElasticTrainer(rho=0.5, reselect_every=2, cache_dir=None, warmup=0, repeats=2, max_rounds=2, check_steps=1)
    guard = ProbeGuard(window=2)
    learner = _build(DataclassMLP, replay=ReservoirReplay(30), replay_batch_size=4, plugins=[tuner, elastic, guard], output=pick)
    for seed in range(6):
        assert math.isfinite(learner.observe(_batch(seed)).loss)
    assert not [w for w in recwarn if "tuning failed" in str(w.message)]  # a failed tune only warns
    assert tuner.result_ is not None and tuner.result_.batch_size >= 1
    assert elastic.selected and guard.windows == 3
    assert guard.predict(_batch(9)[0]).shape == (8, CLASSES)
    before = len(picks)
    elastic.reprofile(8)  # its forward and full backward start from the picked logits
    assert len(picks) > before and set(picks[before:]) == {torch.Size([8, CLASSES])}

    x, y = _batch(0)
    selector = OutputSelector("logits")
    assert profile_tensors(learner.model, x, warmup=0, repeats=2, output=selector).units[-1] == "head.bias"
    assert measure_training_memory(learner.model, x, y, nn.CrossEntropyLoss(), output=selector)["grads"] > 0


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_keeps_a_key_or_index(tmp_path):
    for cls, output in ((DictMLP, None), (TupleMLP, 0), (NoLogitsMLP, "scores")):
        learner = _build(cls, replay=ReservoirReplay(20), strategy="der++", output=output)
        for seed in range(3):
            learner.observe(_batch(seed))
        folder = tmp_path / cls.__name__
        learner.save(folder)
        loaded = OnlineLearner.load(folder, model=cls())
        assert learner.output is not None and loaded.output == learner.output
        assert torch.equal(loaded.predict(_batch(9)[0]), learner.predict(_batch(9)[0]))
        loaded.observe(_batch(5))
        with pytest.raises(CheckpointError, match=r"trained with output=.*this learner has output='other'"):
            OnlineLearner.load(folder, model=cls(), output="other")


def test_a_callable_output_must_be_passed_again_on_load(tmp_path):
    def pick(out: Any) -> torch.Tensor:
        return out["scores"]

    learner = _build(NoLogitsMLP, output=pick)
    learner.observe(_batch(0))
    learner.save(tmp_path / "ckpt")
    model = NoLogitsMLP()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=r"callable output= \(.*pick\).*pass it again, OnlineLearner.load\(\.\.\., output=\.\.\.\)"):
        OnlineLearner.load(tmp_path / "ckpt", model=model)
    with pytest.raises(CheckpointError, match="callable"):
        OnlineLearner.load(tmp_path / "ckpt", model=model, output="scores")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused loads change nothing
    loaded = OnlineLearner.load(tmp_path / "ckpt", model=model, output=pick)
    assert loaded.output == OutputSelector(pick)
    assert torch.equal(loaded.predict(_batch(9)[0]), learner.predict(_batch(9)[0]))


def test_checkpoint_output_field_is_checked(tmp_path):
    plain = _build(PlainMLP)
    plain.observe(_batch(0))
    plain.save(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="returned one tensor"):
        OnlineLearner.load(tmp_path / "plain", model=DictMLP(), output="logits")

    learner = _build(DictMLP)
    learner.observe(_batch(0))
    state = learner.state_dict()
    for bad in (1.5, True, "", ["logits"], {"callable": 3}, {"name": "f"}):
        target = _build(DictMLP)
        before = snapshot(target)
        with pytest.raises(CheckpointError, match=r"config\.output"):
            target.load_state_dict({**state, "config": {**state["config"], "output": bad}})
        assert snapshot(target) == before
    older = {**state, "config": {k: v for k, v in state["config"].items() if k != "output"}}  # written before output=
    restored = _build(PlainMLP)
    restored.load_state_dict(older)
    assert restored.output is None


# ------------------------------------------------------------------ export
def test_selecting_keeps_names_and_outputs_the_picked_tensor():
    import copy

    model = DictMLP()
    picked = selecting(copy.deepcopy(model), OutputSelector("logits"))
    assert list(picked.state_dict()) == list(model.state_dict()) and type(picked).__name__ == "DictMLP"
    x = _batch(0)[0]
    assert torch.equal(picked(x), model(x)["logits"])
    assert torch.equal(copy.deepcopy(picked)(x), model(x)["logits"])
    assert isinstance(model(x), dict)  # the original is untouched
    assert selecting(model, None) is model


@pytest.mark.training_build
def test_dict_output_model_exports_to_onnxruntime_and_trains_on_device(tmp_path):
    import json

    import numpy as np
    from zoo import ZOO

    from taste_cl.adapters.device.loader import load_learner

    case = ZOO["text_transformer_dict"]
    model, loss_fn, optimizer = case.build(0)
    learner = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(32), replay_batch_size=4)
    for seed in range(3):
        learner.observe(case.batch(8, seed))
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["output"]["shape"] == ["batch", 4] and manifest["parity"]["max_output_diff"] < 1e-4
    assert set(manifest["param_names"].values()) == set(dict(model.named_parameters()))  # the model's own names
    device = load_learner(folder)
    x, y = case.batch(6, 9)
    inputs = {key: value.numpy() for key, value in x.items()}
    np.testing.assert_allclose(device.predict(inputs), learner.predict(x).numpy(), atol=1e-4)
    stats = device.observe((inputs, y.numpy()))
    assert stats.steps == 1 and not stats.skipped and math.isfinite(stats.loss)


@pytest.mark.training_build
def test_dict_output_learner_exports_before_its_first_batch(tmp_path):
    from taste_cl.adapters.device.loader import load_learner

    learner = _build(DictMLP, input_shape=(FEATURES,), num_classes=CLASSES)
    folder = learner.export(tmp_path / "art", backend="onnxruntime")
    assert learner.output is None  # the export inferred its pick on a copy; the learner settles on its first batch
    device = load_learner(folder)
    assert device.predict(_batch(0)[0].numpy()).shape == (8, CLASSES)


def test_dict_output_model_exports_to_executorch(tmp_path):
    pytest.importorskip("executorch.extension.training")
    from taste_cl.adapters.device.loader import load_learner

    learner = _build(DictMLP, replay=ReservoirReplay(32), replay_batch_size=4)
    for seed in range(3):
        learner.observe(_batch(seed))
    folder = learner.export(tmp_path / "art", backend="executorch")
    device = load_learner(folder)
    x, y = _batch(9)
    assert device.predict(x.numpy()).shape == (8, CLASSES)
    assert math.isfinite(device.observe((x.numpy(), y.numpy())).loss)
