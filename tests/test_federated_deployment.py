"""The fleet on Flower's deployment engine: a real SuperLink and SuperNodes as processes on loopback."""

from __future__ import annotations

import os
import sys

import numpy as np
import psutil
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is first imported
pytest.importorskip("flwr")

from taste_cl.adapters import flower_app
from taste_cl.adapters.flower_app import FleetConfig
from taste_cl.adapters.flower_deployment import LoopbackDeployment, _pyproject
from taste_cl.datasets import make_mlp


def test_fleet_config_round_trips_through_the_run_config() -> None:
    config = FleetConfig(devices=4, rounds=3, method="fedbabu", privacy="local", evaluate_every_round=False)
    assert FleetConfig.from_run_config(config.to_run_config()) == config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 0}, r"`devices == 0`, must be an int >= 1"),
        ({"method": "fedrep"}, r"`method == 'fedrep'`, must be one of"),
        ({"privacy": "on"}, r"`privacy == 'on'`, must be one of"),
        ({"clip": 0.0}, r"`clip == 0.0`, must be > 0"),
        ({"personal": ","}, r"must name at least one state_dict prefix"),
    ],
)
def test_bad_fleet_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FleetConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_generated_app_carries_the_config_as_its_run_config() -> None:
    import tomllib

    config = FleetConfig(devices=5, method="fedbabu", personal="4.,2.bias", evaluate_every_round=False)
    app = tomllib.loads(_pyproject(config))["tool"]["flwr"]["app"]
    assert FleetConfig.from_run_config(app["config"]) == config
    assert app["components"] == {"serverapp": "taste_cl_fleet_app:server_app", "clientapp": "taste_cl_fleet_app:client_app"}


@pytest.mark.parametrize(
    ("privacy", "wrapper"),
    [
        ("off", "FedAvg"),
        ("local", "FedAvg"),  # LocalDpMod works on the device alone
        ("central", "DifferentialPrivacyServerSideFixedClipping"),
        ("client", "DifferentialPrivacyClientSideFixedClipping"),
    ],
)
def test_privacy_option_picks_flowers_wrapper(privacy: str, wrapper: str) -> None:
    guard = flower_app._strategy(FleetConfig(privacy=privacy, clip=0.5, noise=0.3))
    assert type(guard.strategy).__name__ == wrapper
    if wrapper != "FedAvg":
        assert (guard.strategy.clipping_norm, guard.strategy.noise_multiplier) == (0.5, 0.3)


def test_fedbabu_finetune_moves_only_a_copy_of_the_head() -> None:
    model = make_mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(40, 64), torch.randint(0, 10, (40,))
    tuned = flower_app._finetune(model, FleetConfig(finetune_steps=5), x, y).state_dict()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for name, value in tuned.items():
        assert torch.equal(value, before[name]) != name.startswith("4.")
    assert all(p.requires_grad for p in model.parameters())


def test_deployment_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`devices == 0`"):
        LoopbackDeployment(0)
    with pytest.raises(ValueError, match=r"`timeout_s == -1`"):
        LoopbackDeployment(3, timeout_s=-1)


@pytest.mark.slow
def test_superlink_and_three_supernodes_on_loopback() -> None:
    """2 rounds of FedPer across 3 SuperNode processes: shared weights agree, personal ones differ, no process left."""
    config = FleetConfig(devices=3, rounds=2, personal="4.", evaluate_every_round=False)
    deployment = LoopbackDeployment(3, timeout_s=420)
    with deployment:
        started = deployment.pids
        assert len(started) >= 4  # a SuperLink and three SuperNodes, plus their helpers
        result, server, devices = deployment.run(config)
        started = deployment.pids
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert [r["accepted"] for r in result["rounds"]] == [3, 3]
    assert sorted(devices) == [0, 1, 2]
    assert set(server) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for state in devices.values():
        for name, array in server.items():
            np.testing.assert_array_equal(state[name], array)
    heads = [devices[d]["4.weight"] for d in range(3)]
    assert not np.array_equal(heads[0], heads[1]) and not np.array_equal(heads[1], heads[2])
    assert all(0.0 <= m["accuracy-own"] <= 1.0 for m in result["evaluations"]["2"].values())
