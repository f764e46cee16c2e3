"""A fleet of device runtimes: SuperNodes train the exported artifacts without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is first imported
pytest.importorskip("flwr")
pytestmark = pytest.mark.training_build

from taste_cl.adapters.flower.app import FleetConfig, cached_fleet
from taste_cl.adapters.flower.deployment import LoopbackDeployment, _app_module, _client_module, _pyproject
from taste_cl.adapters.flower.device_client import refit_head_on_device
from taste_cl.adapters.flower.device_server import export_fleet
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

ROOT = Path(__file__).resolve().parents[1]
SHARED = {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.fixture(scope="module")
def fleet_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[FleetConfig, Path, dict[str, np.ndarray]]:
    """The server's export for a 2-device FedPer fleet: train and fine-tune artifacts, each device's data."""
    cfg = FleetConfig(devices=2, rounds=2, device="artifacts")
    folder = tmp_path_factory.mktemp("fleet")
    return cfg, folder, export_fleet(cfg, cached_fleet(cfg.devices, cfg.rounds, cfg.seed), folder)


def test_server_exports_the_shared_part_and_an_empty_buffer_of_the_learners_capacity(fleet_export) -> None:
    cfg, folder, initial = fleet_export
    assert set(initial) == SHARED
    device = OrtOnlineLearner.from_artifacts(folder / "train")
    assert device.replay is not None and (device.replay.capacity, len(device.replay)) == (200, 0)
    assert sorted(device.spec.param_names[n] for n in device.spec.trainable) == sorted({*SHARED, "4.weight", "4.bias"})  # all train
    tuner = OrtOnlineLearner.from_artifacts(folder / "finetune")
    assert sorted(tuner.spec.param_names[n] for n in tuner.spec.trainable) == ["4.bias", "4.weight"] and tuner.lr == cfg.finetune_lr
    assert sorted(p.name for p in (folder / "data").iterdir()) == ["partition-0.npz", "partition-1.npz"]


def test_load_parameters_checks_everything_first_and_changes_nothing_on_error(fleet_export) -> None:
    device = OrtOnlineLearner.from_artifacts(fleet_export[1] / "train")
    before = device.parameters()
    good = np.full_like(before["0.bias"], 0.5)
    for bad, match in (
        ({"0.bias": good, "nope": good}, "`nope` is not a parameter"),
        ({"0.bias": good, "2.bias": good[:3]}, r"`2\.bias` must be float32 of shape \(128,\)"),
        ({"0.bias": good, "4.bias": np.full(10, np.nan, np.float32)}, "NaN or infinite"),
    ):
        with pytest.raises(ValueError, match=match):
            device.load_parameters(bad)
        assert all(np.array_equal(v, before[k]) for k, v in device.parameters().items())
    device.load_parameters({"0.bias": good, "4.bias": np.ones(10, np.float32)})  # frozen parameters load too
    assert np.array_equal(device.parameters()["0.bias"], good) and np.array_equal(device.parameters()["4.bias"], np.ones(10, np.float32))


def test_device_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"`device == 'gpu'`, must be one of"):
        FleetConfig(device="gpu")
    assert FleetConfig(devices=3, secagg=True, device="artifacts").device == "artifacts"  # SecAgg+ runs the device runtime too


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_artifacts_app_takes_its_client_from_the_torch_free_module() -> None:
    import tomllib

    components = tomllib.loads(_pyproject(FleetConfig(device="artifacts")))["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "taste_cl_fleet_app:server_app", "clientapp": "taste_cl_fleet_client:client_app"}
    assert "import client_app\n" in _client_module(FleetConfig(device="artifacts"))
    secure = FleetConfig(devices=3, secagg=True, device="artifacts")
    assert "device_client import secagg_client_app as client_app" in _client_module(secure)
    assert "taste_cl.adapters.flower.secagg import" in _app_module(secure)  # the SecAgg+ ServerApp


def test_device_client_app_trains_and_evaluates_without_importing_torch(fleet_export, tmp_path: Path) -> None:
    """The ClientApp itself in a fresh process: two rounds, the node's state kept, the evaluation (a new class too), the SecAgg+ client's
    fit and evaluate on the legacy lists, and torch never imported.

    Nothing is blocked (torch is installed here): a blocked import inside a library's
    ``try/except ImportError`` (ONNX Runtime's build check has one) would go unnoticed.
    """
    cfg, folder, initial = fleet_export
    np.savez(tmp_path / "shared.npz", **initial)
    settings = {**cfg.to_run_config(), "artifacts": str(folder)}
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np, psutil
        from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
        from flwr.supercore.task_identity import TaskIdentity
        from taste_cl.adapters.flower.device_client import client_app
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1  # what flwr-clientapp sets
        shared = dict(np.load({str(tmp_path / "shared.npz")!r}))
        context = Context(run_id=1, node_id=7, node_config={{"partition-id": 1}}, state=RecordDict(), run_config={{}})

        def send(kind, server_round, arrays):
            config = ConfigRecord({{**{settings!r}, "server-round": server_round}})
            content = RecordDict({{"arrays": ArrayRecord({{k: Array(v) for k, v in arrays.items()}}), "config": config}})
            reply = client_app(Message(content=content, dst_node_id=7, message_type=kind), context)
            assert not reply.has_error(), reply.error
            return reply.content

        first = send("train", 1, shared)
        back = {{k: a.numpy() for k, a in first.array_records["arrays"].items()}}
        assert sorted(back) == {sorted(SHARED)!r} and not np.array_equal(back["0.weight"], shared["0.weight"])
        assert first.metric_records["metrics"]["num-examples"] > 0
        assert "taste_cl-device" in context.state.config_records  # replay, head, optimizer state stay on the node
        send("train", 2, back)
        metrics = send("evaluate", 2, back).metric_records["metrics"]
        assert metrics["partition-id"] == 1 and 0.5 < metrics["accuracy-own"] <= 1.0 and 0.5 < metrics["accuracy-new"] <= 1.0, dict(metrics)

        from taste_cl.adapters.flower.device_client import _secagg_client_class, secagg_client_app  # what secaggplus_mod wraps
        node = Context(run_id=1, node_id=8, node_config={{"partition-id": 0}}, state=RecordDict(), run_config={{}})
        secure, config = _secagg_client_class()(node), {{**{settings!r}, "server-round": 1}}
        arrays, weight, _ = secure.fit([a.astype(np.float64) for a in shared.values()], config)  # SecAgg+ sends float64
        assert [a.dtype for a in arrays] == [np.float32] * 4 and 0 < weight <= 1000
        assert [a.shape for a in arrays] == [a.shape for a in shared.values()]
        loss, _, scores = secure.evaluate(arrays, config)
        assert scores["partition-id"] == 0 and loss == 1.0 - scores["accuracy-all"]
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        print("rss-mb", psutil.Process().memory_info().rss / 2**20)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("rss-mb")[-1]) <= 300


@pytest.mark.slow
def test_device_runtime_supernodes_equal_the_simulation_and_stay_small() -> None:
    """3 SuperNode processes x 2 rounds of FedPer on the device runtime: no torch, <= 300 MB each, as in Flower's simulation."""
    from taste_cl.benchmarks.federated.deployment import _simulate

    config = FleetConfig(devices=3, rounds=2, device="artifacts", evaluate_every_round=False)
    with LoopbackDeployment(3, timeout_s=600) as deployment:
        result, server, devices = deployment.run(config)
    assert [r["accepted"] for r in result["rounds"]] == [3, 3] and set(server) == SHARED
    assert max(r["max_client_rss_mb"] for r in result["rounds"]) <= 300
    for state in devices.values():
        for name, array in server.items():
            np.testing.assert_array_equal(state[name], array)
    simulated = _simulate(config)
    fleet = cached_fleet(config.devices, config.rounds, config.seed)
    for d, metrics in result["evaluations"]["2"].items():
        twin = simulated["evaluations"]["2"][d]
        for name, (_, y) in fleet.eval_sets(int(d)).items():  # at most one held-out sample apart (aggregation order)
            assert abs(metrics[f"accuracy-{name}"] - twin[f"accuracy-{name}"]) <= 1.0 / y.shape[0] + 1e-9


def test_the_aggregate_reaches_devices_in_the_dtype_the_server_sent() -> None:
    """Flower's FedAdam aggregates in float64; devices refuse anything but their own float32, so the
    server casts back. Before, every device of an artifacts fleet under ``server="fedadam"`` refused
    round 2 (``0.bias must be float32``) and the run ended with no evaluation."""
    from flwr.app import Array, ArrayRecord

    from taste_cl.adapters.flower.fleet import _in_sent_dtypes, record_to_numpy
    from taste_cl.adapters.flower.tables import last_evaluation
    from taste_cl.benchmarks.federated.deployment import _simulate

    spec = {"w": ((2,), np.dtype(np.float32)), "b": ((1,), np.dtype(np.float32))}
    wide = ArrayRecord({"w": Array(np.array([0.1, 0.2])), "b": Array(np.array([1.0]))})
    cast = record_to_numpy(_in_sent_dtypes(wide, spec))
    assert {k: v.dtype for k, v in cast.items()} == {"w": np.float32, "b": np.float32} and np.allclose(cast["w"], [0.1, 0.2])
    same = ArrayRecord({"w": Array(np.zeros(2, np.float32)), "b": Array(np.zeros(1, np.float32))})
    assert _in_sent_dtypes(same, spec) is same
    result = _simulate(FleetConfig(devices=3, rounds=2, server="fedadam", device="artifacts", evaluate_every_round=False))
    assert all(r["dropped"] == 0 for r in result["rounds"])
    assert all(0.0 < m["accuracy-own"] <= 1.0 for m in last_evaluation(result).values()) and len(last_evaluation(result)) == 3


def test_local_only_on_the_artifacts_runtime_trains_the_device_learner(fleet_export) -> None:
    """The bench's local-only baseline on ``device="artifacts"`` is the torch-free learner of the parity-gated
    export, fed the device's batches: the same numbers as driving that learner by hand."""
    from taste_cl.adapters.device import export
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.benchmarks.federated import run_local

    cfg, folder, _ = fleet_export
    fleet = make_fleet(2, num_rounds=2)
    found = run_local(fleet, device="artifacts")
    assert sorted(found) == [0, 1] and all(set(m) == {"accuracy-all", "accuracy-own"} for m in found.values())  # no re-fit, no new class
    art = export(fleet.build_learner(0), folder / "local", backend="onnxruntime", example=(fleet.x_train[0][:8], fleet.y_train[0][:8]))
    device = OrtOnlineLearner.from_artifacts(art)
    for server_round in (1, 2):
        for x, y in fleet.train_batches(1, server_round):
            device.observe((x.numpy(), y.numpy()))
    x, y = fleet.eval_sets(1)["own"]
    assert found[1]["accuracy-own"] == float((device.predict(x.numpy()).argmax(axis=1) == y.numpy()).mean())
    seen_x, seen_y = (t.numpy() for t in fleet.seen(1, 2))  # with the fleet's head re-fit, as its devices are scored
    tuned = refit_head_on_device(device, folder / "finetune", seen_x, seen_y, steps=cfg.finetune_steps, lr=cfg.finetune_lr, seed=cfg.seed)
    assert not np.array_equal(tuned.predict(x.numpy()), device.predict(x.numpy()))
    refit = run_local(fleet, device="artifacts", refit=cfg)
    assert refit[1]["accuracy-own"] == float((tuned.predict(x.numpy()).argmax(axis=1) == y.numpy()).mean())
    (new_x, new_y), (x, y) = fleet.device_data(1).new_class_sets(2, seed=fleet.seed, partition=1)  # a class it never saw
    tuned = refit_head_on_device(device, folder / "finetune", new_x, new_y, steps=cfg.finetune_steps, lr=cfg.finetune_lr, seed=cfg.seed)
    assert refit[1]["accuracy-new"] == float((tuned.predict(x).argmax(axis=1) == y).mean())
    with pytest.raises(ValueError, match="`device == 'browser'`, must be 'torch' or 'artifacts'"):
        run_local(fleet, device="browser")


def test_local_only_with_the_dp_fleets_weight_noise_adds_it_to_the_shared_tensors_each_round() -> None:
    """``run_local(noise=config)``: a DP fleet's per-round aggregate noise (``noise * clip / devices``) on each
    device's shared tensors, its personal ones untouched; reproducible, and absent without DP."""
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.benchmarks.federated import _weight_noise, run_local

    dp = FleetConfig(devices=2, rounds=2, personal="4.", privacy="central", noise=0.4, clip=1.0, device="artifacts")
    assert dp.aggregate_noise_std == pytest.approx(0.2)
    assert FleetConfig(devices=2, rounds=2, privacy="local").aggregate_noise_std == 0.0  # each device noises its own update
    perturb = _weight_noise(dp, seed=0)
    tensors = {"0.weight": np.zeros((64, 32), np.float32), "4.bias": np.zeros(10, np.float32)}
    noised = perturb(1, tensors)
    assert set(noised) == {"0.weight"} and noised["0.weight"].dtype == np.float32
    assert noised["0.weight"].std() == pytest.approx(0.2, rel=0.1)
    assert np.array_equal(noised["0.weight"], _weight_noise(dp, seed=0)(1, tensors)["0.weight"])  # one stream per (seed, device)
    assert not np.array_equal(noised["0.weight"], _weight_noise(dp, seed=0)(0, tensors)["0.weight"])
    assert _weight_noise(FleetConfig(devices=2, rounds=2), seed=0) is None
    fleet = make_fleet(2, num_rounds=2)
    for device in ("torch", "artifacts"):
        plain = run_local(fleet, device=device)
        assert run_local(fleet, device=device, noise=FleetConfig(devices=2, rounds=2)) == plain
        loud = run_local(fleet, device=device, noise=FleetConfig(**{**dp.__dict__, "noise": 20.0}))
        assert loud == run_local(fleet, device=device, noise=FleetConfig(**{**dp.__dict__, "noise": 20.0}))
        assert loud != plain


@pytest.mark.slow
def test_the_seed_sweep_judges_each_variant_on_its_mean_over_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench federated --deployment --seeds K``: every variant per seed in the simulation engine, beside local only
    on the same runtime; the verdict compares the means."""
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.adapters.flower.tables import last_evaluation
    from taste_cl.benchmarks.federated import run_local
    from taste_cl.benchmarks.federated.deployment import JUDGED, _means, _seed_sweep, _simulate

    config = FleetConfig(devices=2, rounds=1, device="artifacts", evaluate_every_round=False)
    dp = FleetConfig(**{**config.__dict__, "privacy": "central", "noise": 0.2})
    sweep = _seed_sweep({"fedper": config, "fedper+dp": dp}, [0, 1], "artifacts")
    twin = _means(last_evaluation(_simulate(FleetConfig(**{**config.__dict__, "seed": 1}))))
    local = _means(run_local(make_fleet(2, num_rounds=1, seed=1), device="artifacts", refit=FleetConfig(**{**config.__dict__, "seed": 1})))
    seeded = FleetConfig(**{**dp.__dict__, "seed": 1})  # the DP fleet is also judged against local only under its noise
    noised = _means(run_local(make_fleet(2, num_rounds=1, seed=1), device="artifacts", refit=seeded, noise=seeded))
    for key in JUDGED:  # own classes, and own classes plus a new one
        assert sweep[key]["fedper"]["1"] == twin[key]
        assert sweep[key]["local only"]["1"] == local[key]
        assert sweep[key]["local only + noise 0.1"]["1"] == noised[key]
        means = {name: np.mean(list(by_seed.values())) for name, by_seed in sweep[key].items()}
        assert sweep["beats_local_mean"][key] == {name: bool(means[name] > means["local only"]) for name in ("fedper", "fedper+dp")}
        assert sweep["beats_noised_local_mean"][key] == {"fedper+dp": bool(means["fedper+dp"] > means["local only + noise 0.1"])}
    assert set(sweep["accuracy-own"]) == {"local only", "local only + noise 0.1", "fedper", "fedper+dp",
                                           "offline, every device's data pooled", "offline, each device alone"}  # fmt: skip
    assert "seeds beating local" in capsys.readouterr().out
