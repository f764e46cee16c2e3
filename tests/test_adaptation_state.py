"""Test-time adaptation state in checkpoints: a resumed learner adapts on bit for bit, and a hostile state changes nothing.

The ``adaptation`` section holds the adapter's method (name, settings; EATA's anchor, Fisher
weights and moving mean of probabilities), its settings, counters and flags, the anchor's
normalisation tensors, the step moments and the collapse guard's settings and window.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from helpers import Edit, Snapshot, snapshot
from helpers import delete_at as _delete
from helpers import nan_first as _nan_first
from helpers import set_at as _set
from torch import nn

from taste_cl import CheckpointError, OnlineLearner
from taste_cl.adaptation import CollapseGuard, Eata, Tent, TestTimeAdapter
from taste_cl.state.checkpoint import CHECKPOINT_FILE, decode_state, encode_state
from taste_cl.testing import states_equal

ROWS = 4


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 4),
    )  # fmt: skip


def _x(seed: int, shift: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(ROWS, 1, 6, 6, generator=g) * 2.0 + shift


def _labelled(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def _adapter(method: str, optimizer: str = "adam") -> TestTimeAdapter:
    chosen = Tent(lr=0.05) if method == "tent" else Eata(lr=0.05, e_margin=1.0, d_margin=0.001, anchor_weight=0.5)
    # min_rows 24 of batches of 4: the guard reads every sixth batch since it was cleared, and (ratio 0.999) resets there
    guard = CollapseGuard(window=24, min_rows=24, min_marginal_ratio=0.999, class_prior=[1.0, 1.0, 1.0, 1.0])
    return TestTimeAdapter(chosen, guard=guard, optimizer=optimizer, momentum=0.8, backoff=0.5)


def _learner(method: str, optimizer: str = "adam", model: nn.Module | None = None) -> OnlineLearner:
    model = _cnn() if model is None else model
    return OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), adaptation=_adapter(method, optimizer))


def _stream(learner: OnlineLearner, steps: range) -> list[torch.Tensor]:
    """Unlabelled batches, and a labelled one after step 5 (the anchor moves to the trained model before step 6).

    With :func:`_adapter`'s guard: a reset at step 5, the window cleared at step 6 (the anchor moved), a reset at step 11."""
    outputs = []
    for step in steps:
        outputs.append(learner.adapt(_x(step)).outputs)
        if step == 5:
            learner.observe(_labelled(step))
    return outputs


def _round_trip(state: dict[str, Any]) -> dict[str, Any]:
    return decode_state(encode_state(state))


@pytest.mark.parametrize(("method", "optimizer"), [("tent", "adam"), ("eata", "adam"), ("tent", "sgd")])
def test_a_resumed_learner_adapts_bit_identically_to_the_uninterrupted_one(tmp_path, method, optimizer):
    base = _cnn()
    uninterrupted = _learner(method, optimizer, copy.deepcopy(base))
    expected = _stream(uninterrupted, range(14))

    first = _learner(method, optimizer, copy.deepcopy(base))
    _stream(first, range(9))  # saved mid-window: steps 9 and 10 adapt with the saved moments, window and EATA's memory
    adapter = first.adapter
    assert adapter is not None and adapter.guard is not None
    saved = adapter.state_dict()
    assert adapter.resets >= 1 and adapter.lr_scale < 1  # the guard reset before the save
    assert saved["guard"]["window"] and saved["steps"]["updates"] >= 1 and saved["steps"]["velocity"]  # mid-window, mid-steps
    first.save(tmp_path)

    resumed = OnlineLearner.load(tmp_path, model=copy.deepcopy(base))
    assert resumed.adapter is not None and resumed.adapter.method.name == method
    assert states_equal(_round_trip(resumed.adapter.state_dict()), _round_trip(saved))
    outputs = _stream(resumed, range(9, 14))
    assert resumed.adapter.resets > adapter.resets  # the guard reset after the load too
    for got, want in zip(outputs, expected[9:]):
        assert torch.equal(got, want)
    assert states_equal(resumed.model.state_dict(), uninterrupted.model.state_dict())
    assert snapshot(resumed) == snapshot(uninterrupted)


def test_load_state_dict_into_a_live_learner_keeps_its_adapter_object_and_resumes(tmp_path):
    learner = _learner("eata")
    _stream(learner, range(7))
    state = _round_trip(learner.state_dict())
    live_adapter, live_guard = learner.adapter, learner.adapter.guard if learner.adapter else None
    expected = _stream(learner, range(7, 13))
    learner.load_state_dict(state)  # back to the saved point
    assert learner.adapter is live_adapter and live_adapter is not None and live_adapter.guard is live_guard
    assert snapshot(learner) == Snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(_stream(learner, range(7, 13)), expected))


def test_an_unbound_adapter_and_no_adapter_round_trip():
    learner = _learner("tent")  # built with an adapter that never adapted: unbound
    state = _round_trip(learner.state_dict())
    assert state["adaptation"]["bound"] is False and state["adaptation"]["anchor"] is None
    loaded = OnlineLearner(_cnn())
    loaded.load_state_dict(state)
    assert loaded.adapter is not None and not loaded.adapter.bound and loaded.adapter.guard is not None
    assert snapshot(loaded) == snapshot(learner)

    plain = OnlineLearner(_cnn())
    assert plain.state_dict()["adaptation"] is None
    learner.load_state_dict(_round_trip(plain.state_dict()))  # the checkpoint's learner had no adapter: neither has this one
    assert learner.adapter is None


def test_a_checkpoint_from_before_adapters_were_saved_still_loads(tmp_path):
    learner = _learner("tent")
    _stream(learner, range(4))
    state = _round_trip(learner.state_dict())
    del state["adaptation"]  # as written before the section existed
    before = _round_trip(learner.adapter.state_dict()) if learner.adapter else None
    adapter = learner.adapter
    learner.load_state_dict(state)
    assert learner.adapter is adapter and before is not None and adapter is not None
    assert states_equal(_round_trip(adapter.state_dict()), before)  # kept as the learner has it
    (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))
    loaded = OnlineLearner.load(tmp_path, model=_cnn())
    assert loaded.adapter is None
    loaded.adapt(_x(0))  # and adapts afresh: the default adapter, bound on the first batch
    assert loaded.adapter is not None and loaded.adapter.bound


def test_a_learner_that_adapted_before_any_label_checkpoints_and_resumes(tmp_path):
    base = _cnn()
    uninterrupted = _learner("tent", model=copy.deepcopy(base))
    expected = [uninterrupted.adapt(_x(step)).outputs for step in range(6)]
    first = _learner("tent", model=copy.deepcopy(base))
    for step in range(3):
        first.adapt(_x(step))
    first.save(tmp_path)  # input spec settled by adapt, no output shape yet
    resumed = OnlineLearner.load(tmp_path, model=copy.deepcopy(base))
    assert resumed.input_shape == (1, 6, 6) and resumed.output_shape is None
    assert all(torch.equal(resumed.adapt(_x(step)).outputs, expected[step]) for step in range(3, 6))
    resumed.observe(_labelled(0))  # the first labelled batch still settles the task


def test_a_guard_state_from_before_the_accuracy_estimate_loads_without_it():
    learner = _learner("eata")
    _stream(learner, range(5))
    adapter = learner.adapter
    assert adapter is not None and adapter.guard is not None
    old = _round_trip(adapter.guard.state_dict())
    del old["settings"]["accuracy_margin"]  # as written before the estimate: [adapted, source] pairs, no margin
    old["window"] = [entry[:2] for entry in old["window"]]
    guard = CollapseGuard()
    guard.parse_state(old)()
    assert guard.accuracy_margin is None and not guard.needs_source()
    assert [len(entry) for entry in guard.state_dict()["window"]] == [4] * len(old["window"])
    assert guard.read(None).accuracy is None  # no summaries in the window: no estimate, the marginal ratio still read


def test_parts_refuse_on_their_own_and_change_nothing():
    learner = _learner("eata")
    _stream(learner, range(5))
    adapter = learner.adapter
    assert adapter is not None and adapter.guard is not None
    before = _round_trip(adapter.state_dict())
    bad = _round_trip(adapter.state_dict())
    bad["guard"]["resets"] = -2
    with pytest.raises(CheckpointError, match=r"adaptation.guard.resets == -2"):
        adapter.guard.parse_state(bad["guard"])
    bad["method"]["config"]["lr"] = math.inf
    with pytest.raises(CheckpointError, match=r"adaptation.method.config.lr == inf"):
        adapter.method.parse_state(bad["method"], dict(learner.model.named_parameters()))
    with pytest.raises(CheckpointError, match=r"adaptation.method.config.lr == inf"):
        adapter.load_state_dict(bad, learner.model)
    assert states_equal(_round_trip(adapter.state_dict()), before)


# ------------------------------------------------------------------ hostile states
def _window_overfull(state: dict[str, Any]) -> None:
    rows = [torch.full((n, 4), 0.25) for n in (4, 9, 9, 9)]
    state["adaptation"]["guard"]["window"] = [[t, None] for t in rows]  # 27 rows after the oldest batch; the window keeps < 24


def _anchor_name(state: dict[str, Any], float_only: bool = True) -> str:
    return next(name for name, t in state["adaptation"]["anchor"].items() if t.is_floating_point() or not float_only)


def _on_anchor(value: Any) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        _set(("adaptation", "anchor", _anchor_name(state)), value)(state)

    return edit


def _on_moment(kind: str, value: Any) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        name = next(iter(state["adaptation"]["steps"][kind]))
        _set(("adaptation", "steps", kind, name), value)(state)

    return edit


def _on_eata(key: str, value: Any) -> Edit:
    def edit(state: dict[str, Any]) -> None:
        name = next(iter(state["adaptation"]["method"][key]))
        _set(("adaptation", "method", key, name), value)(state)

    return edit


# (id, edit, message): each refused with CheckpointError naming the field, the learner left exactly as it was
CASES: list[tuple[str, Edit, str]] = [
    ("unknown method name", _set("adaptation.method.name", "dream"), r"`adaptation.method.name == 'dream'`"),
    ("method swapped", _set("adaptation.method.name", "tent"), r"`adaptation.method"),
    ("method lr NaN", _set("adaptation.method.config.lr", math.nan), r"adaptation.method.config.lr == nan"),
    ("eata e_margin 2", _set("adaptation.method.config.e_margin", 2.0), r"adaptation.method.config.e_margin == 2.0"),
    ("eata source of the wrong shape", _on_eata("source", lambda t: torch.zeros(7)), r"adaptation.method.source\..* must have shape"),
    ("eata fisher negative", _on_eata("fisher", lambda t: -torch.ones_like(t)), r"adaptation.method.fisher\..* negative"),
    ("eata mean probabilities NaN", _set("adaptation.method.mean_probs", _nan_first), r"adaptation.method.mean_probs` holds 1 non-finite"),
    ("settings optimizer unknown", _set("adaptation.settings.optimizer", "lion"), r"adaptation.settings.optimizer == 'lion'"),
    ("settings momentum 1", _set("adaptation.settings.momentum", 1.0), r"adaptation.settings.momentum == 1.0"),
    ("settings min_batch 1", _set("adaptation.settings.min_batch", 1), r"adaptation.settings.min_batch == 1"),
    ("lr_scale above 1", _set("adaptation.lr_scale", 1.5), r"adaptation.lr_scale == 1.5"),
    ("lr_scale negative", _set("adaptation.lr_scale", -0.25), r"adaptation.lr_scale == -0.25"),
    ("lr_scale NaN", _set("adaptation.lr_scale", math.nan), r"adaptation.lr_scale == nan"),
    ("batches negative", _set("adaptation.batches", -1), r"adaptation.batches == -1"),
    ("resets negative", _set("adaptation.resets", -3), r"adaptation.resets == -3"),
    ("resets over batches", _set("adaptation.resets", 10**6), r"adaptation.resets == 1000000"),
    ("bound not a bool", _set("adaptation.bound", 1), r"adaptation.bound == 1"),
    ("unknown adapter key", _set("adaptation.rng", 0), r"`adaptation` keys differ .* unexpected \['rng'\]"),
    ("anchor of the wrong shape", _on_anchor(lambda t: torch.zeros(3)), r"adaptation.anchor`: anchor tensor .* shape"),
    ("anchor NaN", _on_anchor(_nan_first), r"adaptation.anchor`: anchor tensor .* non-finite"),
    ("anchor missing a tensor", lambda s: _delete(("adaptation", "anchor", _anchor_name(s)))(s), r"adaptation.anchor`: the anchor names"),
    ("bound without an anchor", _set("adaptation.anchor", None), r"adaptation.anchor` must be a dict of tensors"),
    ("velocity of the wrong shape", _on_moment("velocity", lambda t: torch.zeros(2, 2)), r"adaptation.steps.velocity\..* must have shape"),
    ("velocity NaN", _on_moment("velocity", _nan_first), r"adaptation.steps.velocity\..* holds 1 non-finite"),
    ("second moment NaN", _on_moment("second", _nan_first), r"adaptation.steps.second\..* holds 1 non-finite"),
    ("second moment negative", _on_moment("second", lambda t: -t - 1), r"adaptation.steps.second\..* negative"),
    ("second moment of another dtype", _on_moment("second", lambda t: t.double()), r"adaptation.steps.second\..* dtype torch.float32"),
    (
        "moment of an unknown parameter",
        _set(("adaptation", "steps", "velocity", "9.weight"), torch.zeros(6)),
        r"adaptation.steps.velocity` names \['9.weight'\]",
    ),
    ("updates negative", _set("adaptation.steps.updates", -1), r"adaptation.steps.updates == -1"),
    ("guard resets negative", _set("adaptation.guard.resets", -1), r"adaptation.guard.resets == -1"),
    ("guard window setting 0", _set("adaptation.guard.settings.window", 0), r"adaptation.guard.settings`: `window == 0`"),
    ("guard class prior negative", _set("adaptation.guard.class_prior", lambda p: -p), r"adaptation.guard.class_prior` must be None or"),
    ("window rows over the guard's window", _window_overfull, r"adaptation.guard.window` holds 27 rows after its oldest batch"),
    ("window rows NaN", _set("adaptation.guard.window.0.0", _nan_first), r"adaptation.guard.window\[0\]\[0\]` holds 1 non-finite"),
    (
        "window rows not probabilities",
        _set("adaptation.guard.window.0.0", lambda t: t + 2),
        r"adaptation.guard.window\[0\]\[0\]` must hold probabilities",
    ),
    (
        "window classes differ",
        _set("adaptation.guard.window.0", lambda entry: [entry[0][:, :3], None, None, None]),
        r"adaptation.guard.window\[1\]\[0\]` has 4 classes",
    ),
    (
        "window summary of other rows",
        _set("adaptation.guard.window.0.2", lambda t: t[:1]),
        r"adaptation.guard.window\[0\]\[2\]` must be a float32 tensor of shape \(\d+, 5\)",
    ),
    ("guard accuracy margin over 1", _set("adaptation.guard.settings.accuracy_margin", 1.5), r"`accuracy_margin == 1.5`"),
    ("window not pairs", _set("adaptation.guard.window.0", lambda pair: pair[:1]), r"adaptation.guard.window\[0\]` must be an \[adapted"),
]


def _mid_stream() -> OnlineLearner:
    learner = _learner("eata")
    _stream(learner, range(9))  # a reset at step 5; 3 batches in the window, moments of 3 steps since the anchor moved
    adapter = learner.adapter
    assert adapter is not None and adapter.resets >= 1 and len(adapter.state_dict()["guard"]["window"]) == 3
    return learner


@pytest.mark.parametrize(("name", "edit", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_adaptation_state_is_refused_and_changes_nothing(name, edit, message):
    learner = _mid_stream()
    state = _round_trip(learner.state_dict())
    edit(state)
    adapter, before = learner.adapter, snapshot(learner)
    with pytest.raises(CheckpointError, match=message):
        learner.load_state_dict(state)
    assert learner.adapter is adapter and snapshot(learner) == before
    learner.adapt(_x(50))  # and it keeps adapting


@pytest.mark.parametrize(("name", "edit", "message"), CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_a_hostile_adaptation_checkpoint_is_refused_by_load_and_the_model_passed_in_is_untouched(tmp_path, name, edit, message):
    state = _round_trip(_mid_stream().state_dict())
    edit(state)
    (tmp_path / CHECKPOINT_FILE).write_bytes(encode_state(state))  # re-signed: only validation stands between
    model = _cnn(seed=7)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=message):
        OnlineLearner.load(tmp_path, model=model)
    assert states_equal(model.state_dict(), before)
