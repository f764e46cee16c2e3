"""Hostile strategy fields in re-signed checkpoints: refused with CheckpointError before anything applies.

A strategy contributes three things to a learner state: its description in
``config.strategy`` (name and hyperparameters), its own ``strategy`` section (LwF's
snapshot and chunk count) and the per-sample fields it keeps in the replay buffer
(DER++'s stored outputs, ``replay.storage.fields``). Each case edits one of them in a real
checkpoint of a learner mid-stream and re-signs it, so only validation stands between the
file and the learner. Every edit is refused with a CheckpointError naming the field and
the rule, and afterwards the live learner (after some observe) and every object passed to
``load`` are bit-identical to before.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import torch
from helpers import Edit, batch, delete_at, nan_first, set_at, snapshot, state_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from zoo import ZOO

from taste_cl import (
    BufferStorage,
    CheckpointError,
    ClassBalancedReplay,
    OnlineLearner,
    ReplayStrategy,
    ReservoirReplay,
    StabilityPlasticityMonitor,
)
from taste_cl.state.checkpoint import CHECKPOINT_FILE, decode_state, encode_state
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy
from taste_cl.testing import states_equal

LOGITS = "replay.storage.fields.logits"
TEACHER = ("strategy", "teacher")


def _strategy(setup: str) -> Strategy:
    return {
        "er": ExperienceReplay,
        "er_ace": ERACE,
        "der++": lambda: DERPlusPlus(0.5, 2.0),
        "der++ balanced": lambda: DERPlusPlus(0.5, 2.0),
        "lwf": lambda: LwF(0.5, temperature=3.0, every=2),
    }[setup]()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


def _learner(setup: str) -> OnlineLearner:
    torch.manual_seed(0)
    model = _model()
    replay = ClassBalancedReplay(20, seed=1) if setup.endswith("balanced") else ReservoirReplay(20)
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         replay=replay, replay_batch_size=4, strategy=_strategy(setup))


def _trained(setup: str) -> OnlineLearner:
    """A learner mid-stream: full buffer (with DER++'s stored logits), LwF snapshot taken."""
    learner = _learner(setup)
    for seed in range(6):
        learner.observe(batch(seed=seed))
    return learner


def _encoded(learner: OnlineLearner) -> bytes:
    return encode_state(learner.state_dict())


_SETUPS = ("er", "er_ace", "der++", "der++ balanced", "lwf")
_BASE = {setup: _encoded(_trained(setup)) for setup in _SETUPS}


def _state(setup: str) -> dict[str, Any]:
    """A fresh decoded copy of the checkpoint of ``_trained(setup)``."""
    return decode_state(_BASE[setup])


def _rows(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t[:1]])


PROBE_IDS = "monitor.probe.storage.fields.sid"


def _probe_logits(state: dict[str, Any]) -> None:
    """The monitor's probe (a buffer too, keeping each sample's stream id) given DER++-like logits it never stores."""
    storage = state["monitor"]["probe"]["storage"]
    storage["fields"]["logits"] = torch.zeros(storage["size"], 3)


# (setup, id, edit, message): the message names the field and the rule
CASES: list[tuple[str, str, Edit, str]] = [
    # DER++'s stored outputs in the buffer
    ("der++", "stored logits wider than the outputs", set_at(LOGITS, lambda t: torch.zeros(t.shape[0], 5)),
     r"`replay.storage.fields.logits` must have shape \(20, 3\).*; got \(20, 5\)"),
    ("der++", "stored logits narrower", set_at(LOGITS, lambda t: t[:, :2].clone()), r"fields.logits` must have shape \(20, 3\).*got \(20, 2\)"),
    ("der++", "one stored value per sample", set_at(LOGITS, lambda t: t[:, 0].clone()), r"fields.logits` must have shape \(20, 3\).*got \(20,\)"),
    ("der++", "stored logits with an extra dim", set_at(LOGITS, lambda t: t[:, :, None].clone()), r"got \(20, 3, 1\)"),
    ("der++", "stored logits missing", delete_at(LOGITS), r"`replay.storage.fields` .*strategy 'der\+\+'.*missing \['logits'\]"),
    ("der++", "no fields at all", delete_at("replay.storage.fields"), r"strategy 'der\+\+'.*missing \['logits'\]"),
    ("der++", "an extra stored field", set_at("replay.storage.fields.loss", torch.zeros(20)), r"strategy 'der\+\+'.*unexpected \['loss'\]"),
    ("der++", "stored logits float64", set_at(LOGITS, lambda t: t.double()), r"fields.logits` must have dtype torch.float32; got torch.float64"),
    ("der++", "stored logits float16", set_at(LOGITS, lambda t: t.half()), r"fields.logits` must have dtype torch.float32; got torch.float16"),
    ("der++", "stored logits int64", set_at(LOGITS, lambda t: t.long()), r"fields.logits` must have dtype torch.float32; got torch.int64"),
    ("der++", "stored logits bool", set_at(LOGITS, lambda t: t > 0), r"fields.logits` must have dtype torch.float32; got torch.bool"),
    ("der++", "stored logits NaN", set_at(LOGITS, nan_first), r"`fields.logits` holds 1 non-finite"),
    ("der++", "stored logits inf", set_at(LOGITS, lambda t: t + torch.tensor([0.0, math.inf, 0.0])), r"`fields.logits` holds 20 non-finite"),
    ("der++", "stored logits one row short", set_at(LOGITS, lambda t: t[:-1].clone()), r"`fields.logits` holds 19 rows; the storage state claims 20 samples"),
    ("der++", "stored logits one row too many", set_at(LOGITS, _rows), r"`fields.logits` holds 21 rows; the storage state claims 20 samples"),
    ("der++", "stored logits a list", set_at(LOGITS, lambda t: t.tolist()), r"`fields.logits` must be a tensor; got list"),
    ("der++ balanced", "class-balanced: stored logits wider", set_at(LOGITS, lambda t: torch.zeros(t.shape[0], 4)), r"got \(20, 4\)"),
    ("der++ balanced", "class-balanced: stored logits missing", delete_at(LOGITS), r"missing \['logits'\]"),
    ("der++", "the probe with stored logits", _probe_logits,
     r"monitor state `probe.storage.fields` must hold exactly the sample ids `sid`; got \['logits', 'sid'\]"),
    ("er", "the probe without sample ids", delete_at(PROBE_IDS), r"`probe.storage.fields` must hold exactly the sample ids `sid`; got \[\]"),
    ("er", "the probe's sample ids float", set_at(PROBE_IDS, lambda t: t.double()),
     r"`probe.storage.fields.sid` must be an int64 tensor of shape \(\d+,\); got torch.float64"),
    ("er", "the probe's sample ids 2-D", set_at(PROBE_IDS, lambda t: t[:, None].clone()),
     r"`probe.storage.fields.sid` must be an int64 tensor of shape \(\d+,\); got torch.int64 \(\d+, 1\)"),
    # the flip metrics pair probe samples across evaluations by id: ids are distinct stream positions
    ("er", "the probe's sample ids all -1", set_at(PROBE_IDS, lambda t: torch.full_like(t, -1)),
     r"`probe.storage.fields.sid` must hold ids of samples seen, in \[0, \d+\); got ids in \[-1, -1\]"),
    ("er", "the probe's sample ids all 0", set_at(PROBE_IDS, torch.zeros_like), r"`probe.storage.fields.sid` must hold distinct ids; got \d+"),
    ("er", "a probe id past the samples seen", set_at(PROBE_IDS, lambda t: t + 10**6), r"ids of samples seen, in \[0, \d+\); got ids in \["),
    # DER++'s hyperparameters
    ("der++", "alpha inf", set_at("config.strategy.config.alpha", math.inf), r"`config.strategy.config`: `alpha == inf`, must be a finite number >= 0"),
    ("der++", "alpha NaN", set_at("config.strategy.config.alpha", math.nan), r"`alpha == nan`"),
    ("der++", "beta negative", set_at("config.strategy.config.beta", -1.0), r"`beta == -1.0`"),
    ("der++", "beta a bool", set_at("config.strategy.config.beta", True), r"`beta == True`"),
    ("der++", "alpha a string", set_at("config.strategy.config.alpha", "big"), r"`alpha == 'big'`"),
    ("der++", "an extra hyperparameter", set_at("config.strategy.config.gamma", 1.0), r"`config.strategy.config` keys differ from DERPlusPlus's: missing \[\], unexpected \['gamma'\]"),
    ("der++", "a hyperparameter missing", delete_at("config.strategy.config.beta"), r"`config.strategy.config` keys differ from DERPlusPlus's: missing \['beta'\]"),
    ("der++", "strategy state with an extra key", set_at("strategy.logits", torch.zeros(3)), r"`strategy` keys differ from what strategy 'der\+\+' keeps: missing \[\], unexpected \['logits'\]"),
    ("der++", "strategy state a list", set_at("strategy", []), r"section `strategy` must be a dict"),
    # ER-ACE keeps no fields and no state
    ("er_ace", "ER-ACE buffer with stored logits", set_at("replay.storage.fields", {"logits": torch.zeros(20, 3)}),
     r"`replay.storage.fields` .*strategy 'er_ace'.*unexpected \['logits'\]"),
    ("er_ace", "ER-ACE hyperparameter added", set_at("config.strategy.config", {"alpha": 1.0}), r"`config.strategy.config` keys differ from ERACE's: missing \[\], unexpected \['alpha'\]"),
    ("er_ace", "ER-ACE state with a key", set_at("strategy", {"chunks": 3}), r"`strategy` keys differ from what strategy 'er_ace' keeps: .*unexpected \['chunks'\]"),
    ("er_ace", "ER-ACE description not a dict", set_at("config.strategy", "er_ace"), r"`config.strategy == 'er_ace'`, must be"),
    # LwF's snapshot, counter and hyperparameters
    ("lwf", "teacher weight of another shape", set_at((*TEACHER, "3.weight"), lambda w: w[:2].clone()), r"`strategy.teacher.3.weight` must have shape \(3, 16\)"),
    ("lwf", "teacher weight NaN", set_at((*TEACHER, "0.weight"), nan_first), r"`strategy.teacher.0.weight` holds 1 non-finite"),
    ("lwf", "teacher weight float64", set_at((*TEACHER, "0.bias"), lambda b: b.double()), r"`strategy.teacher.0.bias` must have dtype torch.float32"),
    ("lwf", "teacher key missing", delete_at((*TEACHER, "3.bias")), r"`strategy.teacher` keys differ from the model's state: missing \['3.bias'\]"),
    ("lwf", "teacher key extra", set_at((*TEACHER, "4.weight"), torch.zeros(2)), r"`strategy.teacher` keys differ from the model's state: missing \[\], unexpected \['4.weight'\]"),
    ("lwf", "teacher a string", set_at(TEACHER, "model"), r"`strategy.teacher` must be None or a model state"),
    ("lwf", "teacher entry missing", delete_at(TEACHER), r"`strategy` keys differ from what strategy 'lwf' keeps: missing \['teacher'\]"),
    ("lwf", "chunks negative", set_at("strategy.chunks", -1), r"`strategy.chunks == -1`, must be an int"),
    ("lwf", "chunks a float", set_at("strategy.chunks", 2.5), r"`strategy.chunks == 2.5`"),
    ("lwf", "temperature inf", set_at("config.strategy.config.temperature", math.inf), r"`temperature == inf`, must be a finite number > 0"),
    ("lwf", "temperature 0", set_at("config.strategy.config.temperature", 0.0), r"`temperature == 0.0`"),
    ("lwf", "alpha NaN", set_at("config.strategy.config.alpha", math.nan), r"`alpha == nan`"),
    ("lwf", "every 0", set_at("config.strategy.config.every", 0), r"`every == 0`"),
    ("lwf", "every a string", set_at("config.strategy.config.every", "2"), r"`every == '2'`"),
    ("lwf", "on_drift a string", set_at("config.strategy.config.on_drift", "no"), r"`on_drift == 'no'`, must be a bool"),
]


def _fresh(setup: str) -> tuple[nn.Module, torch.optim.Optimizer, ReservoirReplay | ClassBalancedReplay, StabilityPlasticityMonitor]:
    """What a caller passes to ``load``: a model of another init, a buffer that is not empty (a half-load would show)."""
    torch.manual_seed(123)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replay = ClassBalancedReplay(20, seed=1) if setup.endswith("balanced") else ReservoirReplay(20)
    fields = {"logits": torch.randn(5, 3)} if setup.startswith("der++") else {}
    replay.add(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]), **fields)
    return model, optimizer, replay, StabilityPlasticityMonitor()


def _refused_by_load(tmp_path: Any, state: dict[str, Any], setup: str, message: str, **kwargs: Any) -> None:
    """``OnlineLearner.load`` of the re-signed ``state`` raises ``message``; nothing passed in changes."""
    (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))
    model, optimizer, replay, monitor = _fresh(setup)
    before = [state_copy(obj) for obj in (model, optimizer, replay, monitor)]
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=model, optimizer=optimizer, replay=replay, monitor=monitor, **kwargs)
    assert all(states_equal(a, b) for a, b in zip(before, [state_copy(obj) for obj in (model, optimizer, replay, monitor)]))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def _strategy_facts(strategy: Strategy) -> tuple[Any, ...]:
    return type(strategy), strategy.config(), strategy.task


def _refused_by_live(learner: OnlineLearner, state: dict[str, Any], message: str, then: Any = batch(seed=50)) -> None:
    """``learner.load_state_dict(state)`` raises ``message``; the learner is bit-identical and
    keeps working (observes ``then``, unless None)."""
    before, facts = snapshot(learner), _strategy_facts(learner.strategy)
    with pytest.raises(CheckpointError, match=message):
        learner.load_state_dict(state)
    assert snapshot(learner) == before
    assert _strategy_facts(learner.strategy) == facts
    if then is not None:
        learner.observe(then)


@pytest.mark.parametrize(("setup", "name", "edit", "message"), CASES, ids=[c[1] for c in CASES])
def test_hostile_strategy_field_is_refused_by_load_and_nothing_passed_in_changes(tmp_path, setup, name, edit, message):
    state = _state(setup)
    edit(state)
    _refused_by_load(tmp_path, state, setup, message)


@pytest.mark.parametrize(("setup", "name", "edit", "message"), CASES, ids=[c[1] for c in CASES])
def test_hostile_strategy_field_is_refused_by_a_live_learner_that_stays_bit_identical(setup, name, edit, message):
    state = _state(setup)
    edit(state)
    _refused_by_live(_trained(setup), state, message)


@pytest.mark.parametrize("setup", _SETUPS)
def test_the_unedited_states_load_and_resume(tmp_path, setup):
    original = _trained(setup)
    (tmp_path / CHECKPOINT_FILE).write_bytes(_BASE[setup])
    model, optimizer, replay, monitor = _fresh(setup)
    loaded = OnlineLearner.load(tmp_path, model=model, optimizer=optimizer, replay=replay, monitor=monitor)
    assert snapshot(loaded) == snapshot(original)
    assert _strategy_facts(loaded.strategy) == _strategy_facts(original.strategy)
    live = _learner(setup)  # mid-stream in another place: loading the state puts it where the original is
    live.observe(batch(seed=40))
    live.load_state_dict(decode_state(_BASE[setup]))
    assert snapshot(live) == snapshot(original)
    for learner in (loaded, live):
        learner.observe(batch(seed=51))


# ------------------------------------------------------- one strategy's state, another learner
_NAMES = ("er", "er_ace", "der++", "lwf")


@pytest.mark.parametrize(("saved", "live"), list(itertools.permutations(_NAMES, 2)))
def test_a_state_saved_with_one_strategy_is_refused_by_a_learner_with_another(tmp_path, saved, live):
    message = f"trained with strategy '{re.escape(saved)}'"
    _refused_by_live(_trained(live), _state(saved), message + f"; this learner uses '{re.escape(live)}'")
    _refused_by_load(tmp_path, _state(saved), live, message, strategy=_strategy(live))


@pytest.mark.parametrize(("saved", "renamed"), [("der++", "er"), ("der++", "er_ace"), ("er", "der++"), ("lwf", "er"), ("er_ace", "lwf")])
def test_a_description_renamed_to_another_strategy_is_refused(tmp_path, saved, renamed):
    """The name in ``config.strategy`` matches the learner, the fields and state it names do not."""
    state = _state(saved)
    state["config"]["strategy"] = decode_state(_BASE[renamed])["config"]["strategy"]
    message = f"strategy '{re.escape(renamed)}'"
    _refused_by_live(_trained(renamed), state, message)
    _refused_by_load(tmp_path, state, renamed, message)


@pytest.mark.parametrize("live", ["der++", "lwf", "er_ace"])
def test_a_state_without_a_strategy_description_is_plain_er(tmp_path, live):
    state = _state("er")
    state["config"]["strategy"] = None  # older states: trained with plain experience replay
    message = f"trained with strategy 'er'; this learner uses '{re.escape(live)}'"
    _refused_by_live(_trained(live), state, message)
    _refused_by_load(tmp_path, state, live, message, strategy=_strategy(live))
    loaded = _learner("er")
    loaded.load_state_dict(state)  # and plain ER takes it
    assert snapshot(loaded) == snapshot(_trained("er"))


# ------------------------------------------------------------------- the task
def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss taste_cl infers no task from (as _bce): the task stays open until given or loaded."""
    return nn.functional.mse_loss(outputs, targets)


def _bce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(outputs, targets)


def test_a_strategy_that_refuses_the_checkpoints_task_is_refused(tmp_path):
    case = ZOO["regression_mlp"]
    model, loss_fn, optimizer = case.build(0)
    trained = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(16), replay_batch_size=4)
    for seed in range(3):
        trained.observe(case.batch(8, seed))
    state = decode_state(encode_state(trained.state_dict()))
    state["config"]["strategy"] = {"name": "er_ace", "config": {}}  # ER-ACE is classification only
    message = r"`config.strategy`: ERACE supports the classification task\(s\); this learner's task is regression"
    model, _, optimizer = case.build(0)
    live = OnlineLearner(model, loss_fn=_mse, optimizer=optimizer, replay=ReservoirReplay(16), replay_batch_size=4, strategy="er_ace")
    _refused_by_live(live, state, message, then=None)  # its task is open: only the checkpoint's settles it
    (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))
    model = ZOO["regression_mlp"].build(1)[0]
    before = state_copy(model)
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=model, loss_fn=nn.MSELoss())
    assert states_equal(before, state_copy(model))


def test_a_load_into_a_learner_with_an_open_task_gives_its_strategy_the_checkpoints_task():
    case = ZOO["multilabel_mlp"]

    def build(**kwargs: Any) -> OnlineLearner:
        model, _, optimizer = case.build(0)
        return OnlineLearner(model, loss_fn=_bce, optimizer=optimizer, strategy=LwF(every=1), **kwargs)

    trained = build(task="multilabel")
    for seed in range(3):
        trained.observe(case.batch(8, seed))
    fresh = build()  # its task stays open: the loss names none, and it has seen no batch
    fresh.load_state_dict(decode_state(encode_state(trained.state_dict())))
    assert fresh.task == trained.task and fresh.strategy.task == trained.task  # LwF distills by the task: BCE here, not KL
    fresh.observe(case.batch(8, 5))
    trained.observe(case.batch(8, 5))
    assert fresh.strategy.task == fresh.task


# -------------------------------------------- a custom buffer keeping the fields
class _FirstSamples(ReplayStrategy):
    """A custom buffer keeping the first ``capacity`` samples (with their fields) in a BufferStorage."""

    def __init__(self, capacity: int = 20) -> None:
        self.capacity, self.storage = capacity, BufferStorage(capacity)

    def add(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        n = min(y.shape[0], self.capacity - len(self.storage))
        if n:
            self.storage.append(x[:n], y[:n], **{k: v[:n] for k, v in fields.items()})

    add_validated = add

    def sample(self, n: int, *, with_fields: bool = False) -> Any:
        x, y, fields = self.storage.contents()
        picked = (x[:n].clone(), y[:n].clone(), {k: v[:n].clone() for k, v in fields.items()})
        return picked if with_fields else picked[:2]

    def __len__(self) -> int:
        return len(self.storage)

    def state_dict(self) -> dict[str, Any]:
        return self.storage.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.storage.load_state_dict(state)


def test_stored_fields_of_a_custom_buffer_are_checked_too():
    def build() -> OnlineLearner:
        torch.manual_seed(0)
        model = _model()
        return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=_FirstSamples(),
                             replay_batch_size=4, strategy="der++")

    trained = build()
    for seed in range(4):
        trained.observe(batch(seed=seed))
    base = encode_state(trained.state_dict())
    for edit, message in [
        (set_at("replay.fields.logits", lambda t: torch.zeros(t.shape[0], 7)), r"`replay.fields.logits` must have shape \(20, 3\)"),
        (set_at("replay.fields.logits", lambda t: t.double()), r"`replay.fields.logits` must have dtype torch.float32"),
        (delete_at("replay.fields"), r"`replay.fields` .*missing \['logits'\]"),
    ]:
        state = decode_state(base)
        edit(state)
        _refused_by_live(trained, state, message)
    build().load_state_dict(decode_state(base))


# ------------------------------------------------------------ a custom strategy
class _Counting(Strategy):
    """A custom strategy with state: the chunks it has seen (its load refuses a negative count)."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def after_chunk(self, learner: OnlineLearner) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state["count"], bool) or not isinstance(state["count"], int) or state["count"] < 0:
            raise ValueError(f"`count == {state['count']!r}`, must be an int >= 0")
        self.count = state["count"]


def test_a_custom_strategys_state_is_tried_on_a_copy_before_anything_applies():
    def build() -> OnlineLearner:
        torch.manual_seed(0)
        model = _model()
        return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replay=ReservoirReplay(20),
                             replay_batch_size=4, strategy=_Counting())

    trained = build()
    for seed in range(3):
        trained.observe(batch(seed=seed))
    base = encode_state(trained.state_dict())
    live = build()
    live.observe(batch(seed=9))
    for edit, message in [
        (set_at("strategy.count", -4), r"section `strategy`: strategy state: `count == -4`, must be an int >= 0"),
        (set_at("strategy.count", "3"), r"`count == '3'`"),
        (set_at("strategy.extra", 1), r"`strategy` keys differ from what strategy 'counting' keeps: missing \[\], unexpected \['extra'\]"),
        (set_at("config.strategy.config", {"every": 2}), r"`config.strategy.config` keys differ from _Counting's: missing \[\], unexpected \['every'\]"),
    ]:
        state = decode_state(base)
        edit(state)
        _refused_by_live(live, state, message)
    live.load_state_dict(decode_state(base))
    assert live.strategy.count == trained.strategy.count == 3


# ----------------------------------------------------- a real model with dict inputs
def test_der_on_a_text_transformer_with_dict_inputs(tmp_path):
    case = ZOO["text_transformer"]
    model, loss_fn, optimizer = case.build(0)
    trained = OnlineLearner(model, loss_fn=loss_fn, optimizer=optimizer, replay=ReservoirReplay(16), replay_batch_size=4, strategy="der++")

    for seed in range(4):
        trained.observe(case.batch(8, seed))
    width = trained.output_shape[0]
    base = encode_state(trained.state_dict())

    def passed_in() -> list[Any]:
        """What a caller passes to load: a model of another init, a buffer holding samples and logits."""
        model, _, optimizer = case.build(1)
        replay = ReservoirReplay(16)
        replay.add(*case.batch(2, 7), logits=torch.randn(2, width))
        return [model, optimizer, replay]

    cases = [
        (set_at(LOGITS, lambda t: torch.zeros(t.shape[0], width + 2)), rf"fields.logits` must have shape \(16, {width}\)"),
        (set_at(LOGITS, nan_first), r"`fields.logits` holds 1 non-finite"),
        (delete_at(LOGITS), r"missing \['logits'\]"),
        (set_at(LOGITS, lambda t: t.double()), "must have dtype torch.float32"),
        (set_at(LOGITS, lambda t: t[:-3].clone()), r"`fields.logits` holds 13 rows"),
        (set_at("config.strategy.config.alpha", math.inf), r"`alpha == inf`"),
    ]
    for edit, message in cases:
        state = decode_state(base)
        edit(state)
        before = snapshot(trained)
        with pytest.raises(CheckpointError, match=message):
            trained.load_state_dict(state)
        assert snapshot(trained) == before
        (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))
        passed = passed_in()
        copies = [state_copy(obj) for obj in passed]
        with pytest.raises(CheckpointError, match=message):
            OnlineLearner.load(tmp_path, model=passed[0], optimizer=passed[1], replay=passed[2])
        assert all(states_equal(a, state_copy(b)) for a, b in zip(copies, passed))
    (tmp_path / CHECKPOINT_FILE).write_bytes(base)
    model, loss_fn, optimizer = case.build(1)
    loaded = OnlineLearner.load(tmp_path, model=model, loss_fn=loss_fn, optimizer=optimizer)
    assert snapshot(loaded) == snapshot(trained)
    loaded.observe(case.batch(8, 9))


# ------------------------------------------- hypothesis: any corruption of a strategy field
_NON_TENSORS = [None, 0, 1.5, "x", [], {}, True]
_DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


@st.composite
def _tensor_corruption(draw: Any, t: torch.Tensor, rows: bool) -> Any:
    """A change that no check may let through: the shape (rows only for per-sample fields), the dtype, a
    non-finite entry, or no tensor at all."""
    kind = draw(st.sampled_from(["width", "rank", "dtype", "non-finite", "not a tensor", *(["rows"] if rows else [])]))
    if kind == "width":
        dim = draw(st.integers(0 if not rows else 1, t.dim() - 1)) if t.dim() > (1 if rows else 0) else None
        if dim is None:
            return torch.zeros(*t.shape, 2)
        size = draw(st.integers(1, t.shape[dim] + 4).filter(lambda s: s != t.shape[dim]))
        shape = list(t.shape)
        shape[dim] = size
        return torch.zeros(shape)
    if kind == "rows":
        return t[: draw(st.integers(0, t.shape[0] - 1))].clone() if draw(st.booleans()) else torch.cat([t, t[: draw(st.integers(1, 4))]])
    if kind == "rank":
        return t.reshape(-1)[:1].clone().reshape(()) if draw(st.booleans()) else t[..., None].clone()
    if kind == "dtype":
        return t.to(draw(st.sampled_from(_DTYPES)))
    if kind == "non-finite":
        t = t.clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return t
    return draw(st.sampled_from(_NON_TENSORS))


_FINITE_NEGATIVE = st.floats(max_value=-1e-6, allow_nan=False)
_NOT_A_NUMBER = st.sampled_from([math.nan, math.inf, -math.inf, None, "1", [1.0], True])
_INVALID = {
    "alpha": st.one_of(_FINITE_NEGATIVE, _NOT_A_NUMBER),
    "beta": st.one_of(_FINITE_NEGATIVE, _NOT_A_NUMBER),
    "temperature": st.one_of(st.floats(max_value=0.0, allow_nan=False), _NOT_A_NUMBER),
    "every": st.one_of(st.integers(max_value=0), st.sampled_from([2.5, "2", True, [], math.nan])),
    "on_drift": st.sampled_from(["yes", 1, 0, None, 1.0, []]),
    "chunks": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.sampled_from([2.5, "3", None, True, math.nan])),
}


def _fields_of(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Paths of every value a strategy contributes to ``state``."""
    paths = [("config", "strategy", "config", key) for key in state["config"]["strategy"]["config"]]
    paths += [("replay", "storage", "fields", key) for key in state["replay"]["storage"].get("fields", {})]
    paths += [("strategy", key) for key in state["strategy"]]
    teacher = state["strategy"].get("teacher")
    return paths + [(*TEACHER, key) for key in (teacher or {})]


@st.composite
def _corrupted(draw: Any) -> tuple[str, dict[str, Any], str]:
    """A checkpoint of ``setup`` with one strategy field corrupted, and a word the refusal must name."""
    setup = draw(st.sampled_from(["der++", "der++ balanced", "lwf", "er_ace"]))
    state = _state(setup)
    holders = [("config", "strategy", "config"), ("strategy",)]
    holders += [("replay", "storage", "fields")] if setup.startswith("der++") else []
    holders += [TEACHER] if setup == "lwf" else []
    paths = _fields_of(state)
    action = draw(st.sampled_from(["extra key", *(["delete", "replace"] if paths else [])]))
    if action == "extra key":
        holder = draw(st.sampled_from(holders))
        set_at((*holder, "bogus"), draw(st.sampled_from([0, 1.0, "x", torch.zeros(20, 3)])))(state)
        return setup, state, "bogus"
    path = draw(st.sampled_from(paths))
    if action == "delete":
        delete_at(path)(state)
        return setup, state, path[-1]
    key = path[-1]
    holder: Any = state
    for step in path[:-1]:
        holder = holder[step]
    old = holder[key]
    if isinstance(old, torch.Tensor):
        holder[key] = draw(_tensor_corruption(old, rows=path[1] == "storage"))
    else:  # a hyperparameter, LwF's chunk count, or its whole snapshot (None is a valid snapshot: no teacher yet)
        holder[key] = draw(_INVALID[key] if key in _INVALID else st.sampled_from([0, 1.5, "x", [], True]))
    return setup, state, key


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_corrupted())
def test_any_corruption_of_a_strategy_field_is_refused_naming_it(case):
    setup, state, word = case
    _refused_by_live(_trained(setup), state, re.escape(word))
