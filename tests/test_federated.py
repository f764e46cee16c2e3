"""Federated personalization on Flower: shared/personal split, update validation, a tiny fleet."""

from __future__ import annotations

import logging
import os
import re
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is first imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from taste_cl.adapters.flower import fleet as flower
from taste_cl.adapters.flower.digits_fleet import make_fleet
from taste_cl.datasets import make_mlp
from taste_cl.exceptions import MissingDependencyError

PERSONAL = ["4.bias"]


def test_missing_flwr_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(MissingDependencyError, match=r"pip install '\.\[federated\]'"):
        flower.require_flwr()


def test_shared_state_leaves_out_personal_entries() -> None:
    shared = flower.shared_state(make_mlp(), personal=PERSONAL)
    assert set(shared) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"}
    assert set(flower.shared_state(make_mlp(), personal=lambda name: name.startswith("0."))) == {"2.weight", "2.bias", "4.weight", "4.bias"}


@pytest.mark.parametrize(
    ("personal", "error", "match"),
    [
        ("4.bias", TypeError, "sequence of name prefixes or a predicate"),
        ([""], ValueError, "selects every state_dict entry"),
    ],
)
def test_bad_personal_spec(personal: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        flower.shared_state(make_mlp(), personal=personal)  # type: ignore[arg-type]


def test_load_shared_updates_shared_and_keeps_personal() -> None:
    model, other = make_mlp(seed=0), make_mlp(seed=1)
    personal_before = model.state_dict()["4.bias"].clone()
    flower.load_shared(model, flower.shared_state(other, personal=PERSONAL), personal=PERSONAL)
    assert torch.equal(model.state_dict()["0.weight"], other.state_dict()["0.weight"])
    assert torch.equal(model.state_dict()["4.bias"], personal_before)
    assert not torch.equal(model.state_dict()["4.bias"], other.state_dict()["4.bias"])


def _tampered(change: str) -> dict[str, np.ndarray]:
    arrays = flower.shared_state(make_mlp(seed=1), personal=PERSONAL)
    if change == "missing":
        del arrays["2.bias"]
    elif change == "extra":
        arrays["4.bias"] = np.zeros(10, np.float32)
    elif change == "shape":
        arrays["2.weight"] = arrays["2.weight"][:, :5]
    elif change == "dtype":
        arrays["0.bias"] = arrays["0.bias"].astype(np.float64)
    elif change == "nan":
        arrays["4.weight"][0, 0] = np.nan
    return arrays


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("missing", r"missing \['2.bias'\]"),
        ("extra", r"unexpected \['4.bias'\]"),
        ("shape", r"`2.weight` must be float32 of shape \(128, 128\); got float32 of shape \(128, 5\)"),
        ("dtype", r"`0.bias` must be float32 of shape \(128,\); got float64"),
        ("nan", r"`4.weight` has 1 non-finite values"),
    ],
)
def test_load_shared_rejects_bad_update_and_changes_nothing(change: str, match: str) -> None:
    model = make_mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(flower.InvalidUpdateError, match=match):
        flower.load_shared(model, _tampered(change), personal=PERSONAL)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _reply(arrays: dict[str, np.ndarray], metrics: dict[str, float], n_array_records: int = 1) -> RecordDict:
    content = {f"arrays{i}": _record(arrays) for i in range(n_array_records)}
    return RecordDict({**content, "metrics": MetricRecord(metrics)})


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (_reply(_tampered("nan"), {"num-examples": 5}), "non-finite"),
        (_reply(_tampered("shape"), {"num-examples": 5}), "shape"),
        (_reply(_tampered("none"), {"loss": 1.0}), r"`num-examples` must be a finite number > 0; got None"),
        (_reply(_tampered("none"), {"num-examples": 0}), r"got 0"),
        (_reply(_tampered("none"), {"num-examples": 5}, n_array_records=2), "expected one ArrayRecord"),
    ],
)
def test_reply_problem_names_the_fault(content: RecordDict, match: str) -> None:
    expected = {k: (a.shape, a.dtype) for k, a in _tampered("none").items()}
    assert flower._reply_problem(_reply(_tampered("none"), {"num-examples": 5}), expected, "num-examples") is None
    problem = flower._reply_problem(content, expected, "num-examples")
    assert problem is not None and re.search(match, problem)


def test_validating_strategy_wants_a_flower_strategy() -> None:
    with pytest.raises(TypeError, match="must be a flwr.serverapp.strategy.Strategy; got dict"):
        flower.ValidatingStrategy({})


def _corrupt_partition(partition: int):
    """A client mod that shrinks one array in every train reply of ``partition``."""

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == partition:
            arrays = reply.content["arrays"]
            arrays["2.weight"] = Array(arrays["2.weight"].numpy()[:, :5].copy())
        return reply

    return mod


def test_three_device_fleet_drops_a_malformed_client_and_keeps_going() -> None:
    fleet = make_fleet(3, num_rounds=2, seed=0)
    initial = flower.shared_state(fleet.build_learner(0).model, personal=PERSONAL)
    result = flower.run_fleet_simulation(
        build_learner=fleet.build_learner,
        train_batches=fleet.train_batches,
        eval_sets=fleet.eval_sets,
        personal=PERSONAL,
        num_devices=3,
        num_rounds=2,
        client_mods=[_corrupt_partition(2)],
        client_cpus=2.0,
    )
    assert [(r.server_round, r.sampled, r.accepted, r.dropped) for r in result.rounds] == [(1, 3, 2, 1), (2, 3, 2, 1)]
    assert [d.server_round for d in result.dropped] == [1, 2]
    assert all("`2.weight` must be float32 of shape (128, 128)" in d.reason for d in result.dropped)
    assert all(r.bytes_up > 0 and r.bytes_down == 3 * _record(initial).count_bytes() for r in result.rounds)
    # the personal bias never travels; the shared part was aggregated from the two good devices
    assert set(result.shared) == set(initial)
    assert not np.allclose(result.shared["0.weight"], initial["0.weight"])
    assert all(np.isfinite(a).all() for a in result.shared.values())
    assert sorted(result.final) == [0, 1, 2]
    # learning goes on across rounds: the devices' mean own-class accuracy rises from round 1 to 2
    own = {rnd: np.mean([m["accuracy-own"] for m in per_device.values()]) for rnd, per_device in result.evaluations.items()}
    assert own[2] > own[1] + 0.1


# ------------------------------------------------- issue 15, class 9: hostile aggregation
FLOAT_MAX = float(np.finfo(np.float64).max)


@pytest.mark.parametrize(
    ("policy", "claims", "shares"),
    [
        (flower.AggregationPolicy(), [1e300, 10.0, 10.0], [0.5, 0.25, 0.25]),  # a liar gets at most max_share
        (flower.AggregationPolicy(), [FLOAT_MAX, FLOAT_MAX], [0.5, 0.5]),  # no overflow to inf/0
        (flower.AggregationPolicy(max_share=1.0), [FLOAT_MAX, FLOAT_MAX, 1.0], [0.5, 0.5, 0.0]),  # capped to 1e7 each
        (flower.AggregationPolicy(max_share=0.4), [100.0, 1.0, 1.0, 1.0, 1.0], [0.4, 0.15, 0.15, 0.15, 0.15]),
        (flower.AggregationPolicy(max_share=0.3), [5.0, 3.0], [0.5, 0.5]),  # cap unreachable: equal shares
        (flower.AggregationPolicy(max_share=1.0, max_num_examples=1e9), [30.0, 10.0], [0.75, 0.25]),  # honest: FedAvg
        (flower.AggregationPolicy(), [5e-324, 5e-324, 5e-324], [1 / 3, 1 / 3, 1 / 3]),  # denormal claims
    ],
)
def test_policy_shares_are_overflow_safe_and_capped(policy, claims, shares) -> None:
    got, notes = policy.shares(claims)
    assert got == pytest.approx(shares, abs=1e-6) and sum(got) == pytest.approx(1.0)
    assert len(notes) == len(claims)


def test_each_capped_claim_is_explained() -> None:
    _, notes = flower.AggregationPolicy().shares([1e300, 10.0, 10.0])
    assert notes[0] == "num-examples 1e+300 capped to max_num_examples=1e+07; share 1 capped to 0.5 (max_share=0.5)"
    assert notes[1:] == [None, None]


def _contents(values: list[float], claims: list[float]) -> list[RecordDict]:
    return [
        RecordDict({"arrays": _record({"w": np.full(3, v, np.float32)}), "metrics": MetricRecord({"num-examples": c})})
        for v, c in zip(values, claims)
    ]


def test_near_float_max_counts_average_correctly_where_plain_fedavg_returns_zero() -> None:
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    contents = _contents([1.0, 3.0], [FLOAT_MAX, FLOAT_MAX])
    control = aggregate_arrayrecords(_contents([1.0, 3.0], [FLOAT_MAX, FLOAT_MAX]), "num-examples")["w"].numpy()
    assert not np.allclose(control, 2.0)  # the unprotected weighted mean collapses (sum of weights is inf)
    flower.apply_policy(contents, "num-examples", flower.AggregationPolicy())
    assert np.allclose(aggregate_arrayrecords(contents, "num-examples")["w"].numpy(), 2.0)


def test_one_client_claiming_1e300_examples_does_not_take_over_the_mean() -> None:
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    contents = _contents([100.0, 0.0, 0.0], [1e300, 10.0, 10.0])
    flower.apply_policy(contents, "num-examples", flower.AggregationPolicy())
    assert np.allclose(aggregate_arrayrecords(contents, "num-examples")["w"].numpy(), 50.0)  # not 100


def test_apply_policy_refuses_a_weight_that_is_not_a_finite_positive_number_and_changes_nothing() -> None:
    contents = _contents([1.0, 3.0], [2.0, 0.0])
    with pytest.raises(ValueError, match=r"metric `num-examples` must be a finite number > 0 in every reply; got 0.0"):
        flower.apply_policy(contents, "num-examples", flower.AggregationPolicy())
    assert [next(iter(c.metric_records.values()))["num-examples"] for c in contents] == [2.0, 0.0]


@pytest.mark.parametrize(
    ("value", "dropped"),
    [(3e38, True), (-2e6, True), (1e6, False), (0.5, False)],
)
def test_update_values_beyond_the_magnitude_bound_are_dropped(value: float, dropped: bool) -> None:
    arrays = _tampered("none")
    arrays["4.weight"][0, 0] = value
    expected = {k: (a.shape, a.dtype) for k, a in arrays.items()}
    problem = flower._reply_problem(_reply(arrays, {"num-examples": 5}), expected, "num-examples", flower.AggregationPolicy())
    assert (problem is not None) == dropped
    if dropped:
        assert re.search(r"`4.weight` holds \|value\| .* > max_abs_value=1e\+06", problem)


def test_integer_arrays_are_not_magnitude_bounded() -> None:
    policy = flower.AggregationPolicy()
    assert policy.value_problem({"num_batches_tracked": np.array(10**12, np.int64)}) is None


class _Reply:
    """The part of a Flower reply Message the strategies read."""

    def __init__(self, content: RecordDict, node: int) -> None:
        from types import SimpleNamespace

        self.content, self.metadata = content, SimpleNamespace(src_node_id=node)

    def has_error(self) -> bool:
        return False


def test_validating_strategy_drops_huge_values_caps_liars_and_logs_both(caplog: pytest.LogCaptureFixture) -> None:
    from flwr.serverapp.strategy import FedAvg

    strategy = flower.ValidatingStrategy(FedAvg())
    strategy._expected = {"w": ((3,), np.dtype(np.float32))}
    contents = _contents([3e38, 100.0, 0.0, 0.0], [5.0, 1e300, 10.0, 10.0])
    with caplog.at_level("WARNING"):
        arrays, _ = strategy.aggregate_train(1, [_Reply(c, node) for node, c in enumerate(contents)])
    assert np.allclose(arrays["w"].numpy(), 50.0)
    assert [(d.node_id, d.reason[:30]) for d in strategy.dropped] == [(0, "`w` holds |value| 3e+38 > max_")]
    assert [a.node_id for a in strategy.adjusted] == [1]
    assert "dropped the update of node 0" in caplog.text and "capped the weight of node 1" in caplog.text


def test_a_node_that_replies_twice_in_a_round_counts_once(caplog: pytest.LogCaptureFixture) -> None:
    from flwr.serverapp.strategy import FedAvg

    strategy = flower.ValidatingStrategy(FedAvg())
    strategy._expected = {"w": ((3,), np.dtype(np.float32))}
    first, second, again = _contents([0.0, 6.0, 6.0], [10.0, 10.0, 10.0])
    with caplog.at_level("WARNING"):
        arrays, _ = strategy.aggregate_train(1, [_Reply(first, 1), _Reply(second, 2), _Reply(again, 2)])
    assert np.allclose(arrays["w"].numpy(), 3.0)  # the mean of nodes 1 and 2; counting node 2 twice gives 4
    assert [(d.server_round, d.node_id) for d in strategy.dropped] == [(1, 2)]
    assert strategy.dropped[0].reason == "a second reply in round 1: only the node's first reply counts"
    assert (strategy.rounds[-1].accepted, strategy.rounds[-1].dropped) == (2, 1)
    assert "dropped the update of node 2: a second reply" in caplog.text
    arrays, _ = strategy.aggregate_train(2, [_Reply(c, node) for node, c in zip((1, 2), _contents([0.0, 6.0], [10.0, 10.0]))])
    assert np.allclose(arrays["w"].numpy(), 3.0) and len(strategy.dropped) == 1  # a new round: each node replies once again


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_share": 0.0}, "max_share == 0.0"),
        ({"max_share": 1.5}, "max_share == 1.5"),
        ({"max_num_examples": float("inf")}, "max_num_examples == inf"),
        ({"max_abs_value": -1.0}, "max_abs_value == -1.0"),
    ],
)
def test_bad_policy_settings_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        flower.AggregationPolicy(**kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_device_gets_its_own_classes_whatever_the_seed(seed: int) -> None:
    """``split_digits`` orders its tasks by the seed: the fleet looks each class up (seed 1 indexed past a task's rows)."""
    fleet = make_fleet(10, num_rounds=10, seed=seed)
    for classes, y in zip(fleet.classes, fleet.y_train):
        assert set(y.unique().tolist()) == set(classes)


@pytest.mark.parametrize(("devices", "seed"), [(3, 0), (10, 1)])
def test_the_new_class_is_one_the_device_never_saw_that_another_device_holds(devices: int, seed: int) -> None:
    """``accuracy-new``: the device meets a class it never saw (one the rest of the fleet holds) with 5 held-out
    examples; it re-fits on its own data plus those (repeated to about one own class's weight) and is scored on the
    other held-out digits of its own classes and the new one, never on the 5."""
    from taste_cl.adapters.flower.device_data import NEW_CLASS_SHOTS

    fleet = make_fleet(devices, num_rounds=2, seed=seed)
    for d, own in enumerate(fleet.classes):
        new = fleet.new_class(d)
        assert new not in own and any(new in fleet.classes[other] for other in range(devices) if other != d)
        (refit_x, refit_y), (x, y) = fleet.new_class_sets(d, 2)
        seen_x, seen_y = fleet.seen(d, 2)
        assert torch.equal(refit_x[: len(seen_y)], seen_x) and torch.equal(refit_y[: len(seen_y)], seen_y)
        shots = refit_x[len(seen_y) :]
        assert (refit_y[len(seen_y) :] == new).all() and len(torch.unique(shots, dim=0)) == NEW_CLASS_SHOTS
        assert len(seen_y) // len(own) - NEW_CLASS_SHOTS < len(shots) <= len(seen_y) // len(own)  # about one own class
        assert set(y.tolist()) == {*own, new}
        assert len(y) == int(torch.isin(fleet.y_test, torch.tensor([*own, new])).sum()) - NEW_CLASS_SHOTS
        assert not (x[:, None, :] == torch.unique(shots, dim=0)[None]).all(-1).any()  # none of the 5 is scored
    assert fleet.new_class(0) == make_fleet(devices, num_rounds=2, seed=seed).new_class(0)


def test_local_only_scores_the_new_class_after_its_own_refit() -> None:
    """``run_local(refit=config)`` scores ``accuracy-new`` with the head re-fit on the device's data plus the new
    class's examples: what doing it by hand gives. Without a re-fit there is no new class to learn."""
    from taste_cl.adapters.flower.app import FleetConfig, refit_head
    from taste_cl.benchmarks.federated import run_local
    from taste_cl.monitor.evaluation import accuracy

    fleet, config = make_fleet(3, num_rounds=2), FleetConfig(devices=3, rounds=2, finetune_steps=50)
    found = run_local(fleet, refit=config)
    assert "accuracy-new" not in run_local(fleet)[0]
    torch.manual_seed(fleet.seed)
    learner = fleet.build_learner(2)
    for server_round in (1, 2):
        for batch in fleet.train_batches(2, server_round):
            learner.observe(batch)
    refit_set, (x, y) = fleet.new_class_sets(2, 2)
    tuned = refit_head(learner.model, config, *refit_set).eval()
    with torch.no_grad():
        assert accuracy(tuned, x, y) == found[2]["accuracy-new"]


def test_offline_references_pool_every_devices_data_or_keep_each_alone() -> None:
    """``run_offline``: pooled data teaches every device the classes others hold (its new class), learning alone
    does not; on a device's own classes both are near perfect. Deterministic."""
    from taste_cl.adapters.flower.app import FleetConfig
    from taste_cl.benchmarks.federated import run_offline

    fleet, config = make_fleet(10, num_rounds=10), FleetConfig(devices=10, rounds=10)
    pooled, alone = run_offline(fleet, refit=config, pooled=True, steps=300), run_offline(fleet, refit=config, pooled=False, steps=300)
    mean = {name: {key: np.mean([m[key] for m in run.values()]) for key in run[0]} for name, run in (("pooled", pooled), ("alone", alone))}
    assert mean["pooled"]["accuracy-all"] > mean["alone"]["accuracy-all"] + 0.2
    assert mean["pooled"]["accuracy-new"] > mean["alone"]["accuracy-new"] + 0.03
    assert min(mean["pooled"]["accuracy-own"], mean["alone"]["accuracy-own"]) > 0.95
    assert run_offline(fleet, refit=config, pooled=True, steps=300) == pooled


def test_simulations_drop_only_flowers_run_simulation_deprecation() -> None:
    """A seed sweep runs ~20 simulations: flwr's four-line deprecation of ``run_simulation`` is dropped, other warnings stay."""
    from flwr.supercore.logger import warn_deprecated_feature

    from taste_cl.adapters.flower.fleet import without_simulation_deprecation

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    flwr_logger, handler = logging.getLogger("flwr"), Collect()
    flwr_logger.addHandler(handler)
    try:
        with without_simulation_deprecation():
            warn_deprecated_feature("The `run_simulation` function is deprecated")
            warn_deprecated_feature("The `other` function is deprecated")
        warn_deprecated_feature("The `run_simulation` function is deprecated")  # outside the block it shows
    finally:
        flwr_logger.removeHandler(handler)
    assert len(seen) == 2 and "`other`" in seen[0] and "`run_simulation`" in seen[1]
