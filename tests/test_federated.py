"""Federated personalization on Flower: shared/personal split, update validation, a tiny fleet."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is first imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict  # noqa: E402

from taste_cl.adapters import flower  # noqa: E402
from taste_cl.benchmarks.federated import make_fleet  # noqa: E402
from taste_cl.datasets import make_mlp  # noqa: E402
from taste_cl.exceptions import MissingDependencyError  # noqa: E402

PERSONAL = ["4.bias"]


def test_missing_flwr_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(MissingDependencyError, match=r"pip install '\.\[federated\]'"):
        flower.require_flwr()


def test_shared_state_leaves_out_personal_entries() -> None:
    shared = flower.shared_state(make_mlp(), personal=PERSONAL)
    assert set(shared) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"}
    assert set(flower.shared_state(make_mlp(), personal=lambda name: name.startswith("0."))) == {
        "2.weight", "2.bias", "4.weight", "4.bias"
    }


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


def _corrupt_partition(partition: int):  # noqa: ANN202 - a Flower client mod
    """A client mod that shrinks one array in every train reply of ``partition``."""

    def mod(msg, context, call_next):  # noqa: ANN001, ANN202
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
