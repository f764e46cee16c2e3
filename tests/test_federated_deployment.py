"""The fleet on Flower's deployment engine: a real SuperLink and SuperNodes as processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is first imported
pytest.importorskip("flwr")

import flwr.server.strategy as legacy_strategies

from taste_cl.adapters.flower import app as flower_app
from taste_cl.adapters.flower import deployment as flower_deployment
from taste_cl.adapters.flower import secagg as flower_secagg
from taste_cl.adapters.flower.app import FleetConfig
from taste_cl.adapters.flower.deployment import DeploymentError, LoopbackDeployment, _app_module, _pyproject, _serverapp_failure, launch_command
from taste_cl.adapters.flower.fleet import InvalidUpdateError
from taste_cl.adapters.flower.tls import write_node_key
from taste_cl.adapters.flower.updates import array_spec, check_secagg_upload, named_arrays
from taste_cl.benchmarks.federated.deployment import _simulate
from taste_cl.datasets import make_mlp


def test_fleet_config_round_trips_through_the_run_config() -> None:
    config = FleetConfig(devices=4, rounds=3, server="fedadam", privacy="local", evaluate_every_round=False)
    assert FleetConfig.from_run_config(config.to_run_config()) == config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 0}, r"`devices == 0`, must be an int >= 1"),
        ({"privacy": "on"}, r"`privacy == 'on'`, must be one of"),
        ({"clip": 0.0}, r"`clip == 0.0`, must be > 0"),
        ({"server": "fedprox"}, r"`server == 'fedprox'`, must be one of"),
        ({"server_momentum": 1.0}, r"`server_momentum == 1.0`, must be in \[0, 1\)"),
        ({"server_eta": 0.0}, r"`server_eta == 0.0`, must be > 0"),
        ({"server_lr": -1.0}, r"`server_lr == -1.0`, must be > 0"),
        ({"personal": ","}, r"must name at least one state_dict prefix"),
        ({"secagg": True, "devices": 2}, r"`devices == 2` with `secagg=True`, must be >= 3"),
        ({"secagg": True, "privacy": "central"}, r"the server cannot clip updates it cannot see"),
    ],
)
def test_bad_fleet_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FleetConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_generated_app_carries_the_config_as_its_run_config() -> None:
    import tomllib

    config = FleetConfig(devices=5, finetune_steps=0, personal="4.,2.bias", evaluate_every_round=False)
    app = tomllib.loads(_pyproject(config))["tool"]["flwr"]["app"]
    assert FleetConfig.from_run_config(app["config"]) == config
    assert app["components"] == {"serverapp": "taste_cl_fleet_app:server_app", "clientapp": "taste_cl_fleet_app:client_app"}


@pytest.mark.parametrize(
    ("privacy", "wrapper"),
    [
        ("off", "FedAvgM"),
        ("local", "FedAvgM"),  # LocalDpMod works on the device alone
        ("central", "DifferentialPrivacyServerSideFixedClipping"),
        ("client", "DifferentialPrivacyClientSideFixedClipping"),
    ],
)
def test_privacy_option_picks_flowers_wrapper(privacy: str, wrapper: str) -> None:
    guard = flower_app._strategy(FleetConfig(privacy=privacy, clip=0.5, noise=0.3))
    assert type(guard.strategy).__name__ == wrapper
    if wrapper != "FedAvgM":
        assert (guard.strategy.clipping_norm, guard.strategy.noise_multiplier) == (0.5, 0.3)
        assert type(guard.strategy.strategy).__name__ == "FedAvgM"


@pytest.mark.parametrize(
    ("kwargs", "strategy", "setting"),
    [
        ({}, "FedAvgM", ("server_momentum", 0.5)),  # FedPer needs server momentum to beat local-only at 10 x 10
        ({}, "FedAvgM", ("server_learning_rate", 2.0)),  # and twice the mean update
        ({"server_lr": 1.0}, "FedAvgM", ("server_learning_rate", 1.0)),
        ({"server": "fedadam", "server_eta": 0.01}, "FedAdam", ("eta", 0.01)),
        ({"server_momentum": 0.9}, "FedAvgM", ("server_momentum", 0.9)),
        ({"server": "fedavg"}, "FedAvg", None),
    ],
)
def test_server_option_picks_flowers_strategy_in_both_apps(kwargs: dict[str, object], strategy: str, setting: tuple[str, float] | None) -> None:
    cfg = FleetConfig(**kwargs)  # type: ignore[arg-type]
    plain = flower_app._strategy(cfg).strategy
    secure = FleetConfig(**{**cfg.__dict__, "secagg": True})
    legacy = flower_secagg._strategy_class(cfg.server)(secure, _FakeGrid(), flower_secagg._initial(secure))
    assert type(plain).__name__ == strategy and type(legacy).__name__ == f"SecAgg{strategy}"
    assert isinstance(legacy, getattr(legacy_strategies, strategy))
    if setting is not None:
        assert getattr(plain, setting[0]) == getattr(legacy, setting[0]) == setting[1]


def test_head_refit_moves_only_a_copy_of_the_head() -> None:
    model = make_mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(40, 64), torch.randint(0, 10, (40,))
    tuned = flower_app.refit_head(model, FleetConfig(finetune_steps=5), x, y).state_dict()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for name, value in tuned.items():
        assert torch.equal(value, before[name]) != name.startswith("4.")
    assert all(p.requires_grad for p in model.parameters())


def test_local_only_re_fits_its_head_as_the_fleets_devices_do() -> None:
    """``run_local(refit=config)`` scores each device after the fleet's head re-fit on all it has seen;
    a config with the re-fit off scores the learner as it is."""
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.benchmarks.federated import run_local
    from taste_cl.monitor.evaluation import accuracy

    fleet, config = make_fleet(2, num_rounds=1), FleetConfig(devices=2, rounds=1, finetune_steps=20)
    plain, refit = run_local(fleet), run_local(fleet, refit=config)
    assert run_local(fleet, refit=FleetConfig(devices=2, rounds=1, finetune_steps=0)) == plain
    torch.manual_seed(fleet.seed)
    learner = fleet.build_learner(1)
    for batch in fleet.train_batches(1, 1):
        learner.observe(batch)
    x, y = fleet.eval_sets(1)["own"]
    assert accuracy(learner.predict, x, y) == plain[1]["accuracy-own"]
    tuned = flower_app.refit_head(learner.model, config, *fleet.seen(1, 1))
    with torch.no_grad():
        assert accuracy(tuned, x, y) == refit[1]["accuracy-own"]
        assert not torch.equal(tuned(x), learner.model(x))


def test_generated_app_module_imports_only_the_chosen_app() -> None:
    assert "taste_cl.adapters.flower.app import" in _app_module(FleetConfig())
    assert "taste_cl.adapters.flower.secagg import" in _app_module(FleetConfig(secagg=True))


def test_each_app_factory_refuses_the_other_mode() -> None:
    with pytest.raises(TypeError, match="secagg=False"):
        flower_app.make_fleet_apps(FleetConfig(secagg=True))
    with pytest.raises(TypeError, match="secagg=True"):
        flower_secagg.make_secagg_apps(FleetConfig())


def test_secagg_device_names_casts_and_checks_its_own_update() -> None:
    initial = flower_secagg._initial(FleetConfig(secagg=True))
    spec = array_spec(initial)
    named = named_arrays(initial, [a.astype(np.float64) for a in initial.values()])
    assert list(named) == list(initial) and all(a.dtype == np.float32 for a in named.values())
    check_secagg_upload(named, spec, 1000)
    with pytest.raises(InvalidUpdateError, match="expected 4 shared arrays; got 3"):
        named_arrays(initial, list(initial.values())[:3])
    named["0.bias"][0] = np.nan
    with pytest.raises(InvalidUpdateError, match="non-finite"):
        check_secagg_upload(named, spec, 1000)
    named["0.bias"][0] = 100.0  # SecAgg+ clips weight / MAX_WEIGHT * value to +-8: 100 passes at weight 10 ...
    check_secagg_upload(named, spec, 10)
    with pytest.raises(InvalidUpdateError, match=r"refusing to upload: `0\.bias` holds \|value\| 100 > 8, which SecAgg\+ would clip"):
        check_secagg_upload(named, spec, 1000)  # ... and would be clipped at weight 1000


def test_message_bytes_count_every_record_even_empty_lists() -> None:
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    arrays = ArrayRecord({"w": Array(np.zeros(10, np.float32))})
    content = RecordDict({"a": arrays, "c": ConfigRecord({"ids": [], "keys": [b"abc", b"de"], "n": 3})})
    assert flower_secagg._payload_bytes(content) == arrays.count_bytes() + 3 + 4 + 5 + 1 + 8


class _FakeGrid:
    def __init__(self) -> None:
        self.down = {"1": 7}
        self.up = {"1": 11}


def test_secagg_strategy_checks_the_secure_aggregate() -> None:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    cfg = FleetConfig(secagg=True, server_lr=1.0)  # the first FedAvgM step then lands on the aggregate
    strategy = flower_secagg._strategy_class(cfg.server)(cfg, _FakeGrid(), flower_secagg._initial(cfg))
    good = [a.astype(np.float64) + 0.5 for a in flower_secagg._initial(cfg).values()]

    def replies(arrays: list[np.ndarray]) -> list[tuple[None, FitRes]]:
        metrics = {"rss-mb": 100.0, "train-seconds": 1.0, "partition-id": 0}
        return [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 10, metrics)) for _ in range(3)]

    params, _ = strategy.aggregate_fit(1, replies(good), [])
    out = parameters_to_ndarrays(params)
    assert all(a.dtype == np.float32 for a in out) and np.allclose(out[0], good[0])
    assert (strategy.rounds[0].accepted, strategy.rounds[0].bytes_down, strategy.rounds[0].bytes_up) == (3, 7, 11)
    bad = [a.copy() for a in good]
    bad[1][0] = np.inf
    assert strategy.aggregate_fit(1, replies(bad), []) == (None, {})
    assert "aggregate: `0.bias` has 1 non-finite values" in strategy.dropped[-1].reason


def test_deployment_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`devices == 0`"):
        LoopbackDeployment(0)
    with pytest.raises(ValueError, match=r"`timeout_s == -1`"):
        LoopbackDeployment(3, timeout_s=-1)
    with pytest.raises(ValueError, match=r"`start_window_s == 10`, must be a number in \[30, 900\]"):
        LoopbackDeployment(3, start_window_s=10)
    with pytest.raises(ValueError, match=r"`executable == 'flwr'`, must be one of"):
        launch_command("flwr", 60)


def test_superlink_and_supernodes_start_with_a_wider_task_start_window() -> None:
    """flwr's 30 s window is set before flwr reads it: the launcher's own check passes, and a stale value would fail it."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}  # flower-superlink starts the same way (the slow tests run it)
    done = subprocess.run([*launch_command("flower-supernode", 123), "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "Flower version" in done.stdout + done.stderr, done.stderr[-2000:]
    code = launch_command("flower-supernode", 123)[2].replace("constant.HEARTBEAT_DEFAULT_INTERVAL = 123", "")
    done = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "flwr read its task start window before it was set" in done.stderr


def test_tracking_finds_descendants_and_their_memory_in_one_scan() -> None:
    deployment = LoopbackDeployment(1)
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    deployment.procs.append(subprocess.Popen([sys.executable, "-c", child]))
    try:
        deadline = time.monotonic() + 30
        while len(deployment.pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        victims = [psutil.Process(pid) for pid in deployment.pids]
        assert len(victims) == 2 and deployment._peak_rss >= sum(v.memory_info().rss for v in victims) * 0.5
    finally:
        deployment.stop()
    assert not any(v.is_running() and v.status() != psutil.STATUS_ZOMBIE for v in victims)


class _Launch:
    """Records what a deployment would start, starting nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, deployment: LoopbackDeployment) -> None:
        self.commands: list[list[str]] = []
        self.registered: list[str] = []
        monkeypatch.setattr(flower_deployment, "_wait_for_port", lambda *args: None)
        monkeypatch.setattr(deployment, "_spawn", lambda name, args: self.commands.append(args) or _Proc())
        monkeypatch.setattr(deployment, "register", lambda keys, deadline=None: self.registered.extend(k.public_key.name for k in keys))


class _Proc:
    pid = 2**22 + 1  # no such process

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_deployment_is_secure_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = LoopbackDeployment(2, keep=True)
    launch = _Launch(monkeypatch, deployment)
    deployment.start()
    try:
        assert deployment.work is not None and deployment.tls is not None
        link, *nodes = launch.commands
        assert link[0] == "flower-superlink" and "--insecure" not in link and "--enable-supernode-auth" in link
        assert link[link.index("--ssl-ca-certfile") + 1] == str(deployment.tls.ca_cert)
        assert launch.registered == ["supernode-0.pub", "supernode-1.pub"]  # before any SuperNode starts
        for i, node in enumerate(nodes):
            assert "--insecure" not in node and node[node.index("--root-certificates") + 1] == str(deployment.tls.ca_cert)
            assert node[node.index("--auth-supernode-private-key") + 1] == str(deployment.keys[i].private_key)
        home = (deployment.work / "flwr-home" / "config.toml").read_text()
        assert f'root-certificates = "{deployment.tls.ca_cert}"' in home and "insecure" not in home
        with pytest.raises(ValueError, match="needs a key"):
            deployment.supernode_args(0, None)
        assert "--root-certificates" not in deployment.supernode_args(0, deployment.keys[0], trust_ca=False)
    finally:
        deployment.keep = False
        deployment.stop()


def test_insecure_deployment_only_when_asked_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = LoopbackDeployment(2, insecure=True)
    launch = _Launch(monkeypatch, deployment)
    with pytest.warns(UserWarning, match="insecure deployment: no TLS .* no SuperNode authentication"):
        deployment.start()
    try:
        assert all("--insecure" in command for command in launch.commands) and not launch.registered
        assert deployment.tls is None and not any("--ssl-certfile" in c or "--auth-supernode-private-key" in c for c in launch.commands)
    finally:
        deployment.stop()
    with pytest.raises(TypeError, match="insecure must be a bool"):
        LoopbackDeployment(2, insecure="yes")  # type: ignore[arg-type]


def _exit_log(proc: object, log: object, timeout: float) -> tuple[int, str]:
    code = proc.wait(timeout=timeout)  # type: ignore[attr-defined]
    return code, log.read_text(errors="replace")  # type: ignore[attr-defined]


FAILED_RUN_LOG = """\
INFO :      Start `flwr-serverapp` process
ERROR :     ServerApp raised an exception
Traceback (most recent call last):
  File "/work/main/adapters/flower/app.py", line 146, in __post_init__
    raise ValueError(f"`server == {self.server!r}`, must be one of {SERVERS}")
ValueError: `server == 'auto'`, must be one of ('fedavg', 'fedavgm', 'fedadam')
ERROR :     Exit Code: 201

An unhandled exception occurred in the ServerApp.
"""


def test_a_failed_serverapp_is_read_from_the_flwr_run_log() -> None:
    """``flwr run --stream`` keeps running after its ServerApp dies (flwr 1.42): the log is how the driver knows."""
    assert _serverapp_failure(FAILED_RUN_LOG) == "ValueError: `server == 'auto'`, must be one of ('fedavg', 'fedavgm', 'fedadam')"
    assert _serverapp_failure(FAILED_RUN_LOG.split("ERROR")[0]) is None  # still running
    assert _serverapp_failure("An unhandled exception occurred in the ServerApp.") == "An unhandled exception occurred in the ServerApp"


def test_a_run_whose_serverapp_fails_ends_with_its_error_not_at_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run config the ServerApp refuses: the driver raises the ServerApp's error within seconds (it waited for the
    whole timeout before), and the deployment still stops every process."""
    monkeypatch.setattr(flower_deployment, "_pyproject", lambda config: _pyproject(config).replace('server = "fedavgm"', 'server = "auto"'))
    deployment = LoopbackDeployment(1, timeout_s=600)
    with deployment:
        start = time.monotonic()
        with pytest.raises(DeploymentError, match=r"the ServerApp failed: ValueError: `server == 'auto'`"):
            deployment.run(FleetConfig(devices=1, rounds=1, device="artifacts"))
        assert time.monotonic() - start < 300
        procs = list(deployment.procs)
    assert all(p.poll() is not None for p in procs)


@pytest.mark.slow
def test_superlink_and_three_supernodes_on_loopback() -> None:
    """2 rounds of FedPer across 3 SuperNode processes over TLS with SuperNode authentication.

    A SuperNode with an unregistered key and one that does not trust the run's CA are
    refused; shared weights agree, personal ones differ, the run equals the simulation,
    no process is left.
    """
    config = FleetConfig(devices=3, rounds=2, personal="4.", evaluate_every_round=False)
    deployment = LoopbackDeployment(3, timeout_s=420)
    with deployment:
        assert deployment.work is not None
        started = deployment.pids
        assert len(started) >= 4  # a SuperLink and three SuperNodes, plus their helpers
        stranger = write_node_key(deployment.work / "tls", "stranger")  # never registered
        unregistered = deployment._spawn("stranger", deployment.supernode_args(0, stranger, max_retries=1))
        no_ca = deployment._spawn("no-ca", deployment.supernode_args(1, deployment.keys[1], trust_ca=False, max_retries=1))
        result, server, devices = deployment.run(config)
        code, log = _exit_log(unregistered, deployment.work / "stranger.log", 120)
        assert code != 0 and "Failed to activate SuperNode" in log
        code, log = _exit_log(no_ca, deployment.work / "no-ca.log", 120)
        assert code != 0 and "CERTIFICATE_VERIFY_FAILED" in log
        started = deployment.pids
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert _simulate(config)["evaluations"] == result["evaluations"]
    assert [r["accepted"] for r in result["rounds"]] == [3, 3]
    assert sorted(devices) == [0, 1, 2]
    assert set(server) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for state in devices.values():
        for name, array in server.items():
            np.testing.assert_array_equal(state[name], array)
    heads = [devices[d]["4.weight"] for d in range(3)]
    assert not np.array_equal(heads[0], heads[1]) and not np.array_equal(heads[1], heads[2])
    assert all(0.0 <= m["accuracy-own"] <= 1.0 for m in result["evaluations"]["2"].values())


@pytest.mark.slow
@pytest.mark.parametrize("device", ["torch", pytest.param("artifacts", marks=pytest.mark.training_build)])  # the device runtime trains ORT training artifacts
def test_secagg_aggregate_equals_plain_fedavg_on_loopback(device: str) -> None:
    """One round on 3 SuperNodes, plain then SecAgg+: the same shared weights within quantization, the same accuracy.

    ``artifacts``: the torch-free device runtime under ``secaggplus_mod``.
    """
    plain = FleetConfig(devices=3, rounds=1, evaluate_every_round=False, device=device)
    with LoopbackDeployment(3, timeout_s=1200) as deployment:  # SecAgg+ took > 600 s for one round at load 30
        result, server, _ = deployment.run(plain)
        secure, secure_server, devices = deployment.run(FleetConfig(**{**plain.__dict__, "secagg": True}))
    assert [r["accepted"] for r in secure["rounds"]] == [3] and not secure["dropped"]
    for name, array in server.items():
        assert secure_server[name].dtype == array.dtype
        np.testing.assert_allclose(secure_server[name], array, rtol=0, atol=1e-4)  # quantization steps of ~4e-6
        for state in devices.values():
            np.testing.assert_array_equal(state[name], secure_server[name])
    assert secure["evaluations"]["1"] == result["evaluations"]["1"]
    assert secure["rounds"][0]["bytes_up"] > result["rounds"][0]["bytes_up"]  # masked int64 values plus key shares
