"""Fleet personalization with devices as processes: Flower's deployment engine on loopback.

One SuperLink and ``--devices`` SuperNode processes (:class:`LoopbackDeployment`) run
the digits fleet app once per variant: FedPer, FedPer with differential privacy
(``--privacy``: central / client / local, Flower's wrappers and mods), and FedPer under
SecAgg+ secure aggregation (unless ``--no-secagg``), all with FedAvgM on the server,
TLS and SuperNode authentication (a CA and keys made for the run). Each device's
accuracy is compared with *local only* (the same batches, no communication) and with the
same FedPer run in Flower's simulation engine (same seeds); payload bytes and seconds per
round come from the server (SecAgg+ counts all four of its message exchanges per round,
config records included); each run's wall time and the fleet's peak resident memory
(every process of the deployment, summed, sampled about once a second) from
:class:`LoopbackDeployment`.

Each variant is judged against local only on two measures (:data:`JUDGED`): the device's
own classes, and its own classes plus one it never saw but another device holds, learned
from 5 examples after the rounds (``accuracy-new``). Local only trains on the deployment's
runtime (``--device``) and, like every device of the fleet, re-fits its head on everything
it has seen before it is scored (``FleetConfig.finetunes_head``: the re-fit alone lifts
local only from 0.792 to 0.961 at 3 x 2, so without it the comparison would credit
federation with the re-fit's gain). It also prints the largest per-device gaps deployment
vs simulation and SecAgg+ vs plain in held-out samples. ``--seeds K`` then runs every
variant but SecAgg+ and local only in the simulation engine (which computes what the
deployment does) over K seeds, beside two offline references (every device's data pooled,
each device alone), and judges each variant on the mean: one seed's verdict is mostly
replay-draw noise.
Run: ``taste-cl bench federated --deployment [--devices 3 --rounds 2] [--seeds 5]``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from typing import Any

import numpy as np

from taste_cl.adapters.flower.tables import accuracy_table, last_evaluation
from taste_cl.benchmarks._common import save_result
from taste_cl.report import format_table

__all__ = ["run_deployment_bench"]


def _simulate(config: Any) -> dict[str, Any]:
    """The same app in Flower's simulation engine (Ray), outputs in a temporary folder."""
    from flwr.simulation import run_simulation

    from taste_cl.adapters.flower.app import make_fleet_apps, read_outputs
    from taste_cl.adapters.flower.fleet import without_simulation_deprecation

    with without_simulation_deprecation(), tempfile.TemporaryDirectory(prefix="taste-cl-sim-") as out:
        server_app, client_app = make_fleet_apps(type(config)(**{**config.__dict__, "out_dir": out}))
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=config.devices,
            backend_config={
                "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
                "init_args": {"logging_level": "ERROR", "log_to_driver": False},
            },
        )
        return read_outputs(out)[0]


def _per_round(result: dict[str, Any]) -> dict[str, float]:
    """Means per round from the server, plus the run's wall time and the fleet's peak RSS (deployment runs only)."""
    rounds = result["rounds"]
    fleet = result.get("deployment", {})
    return {
        "run_s": float(fleet.get("wall_s", float("nan"))),
        "fleet_rss_mb": float(fleet.get("peak_rss_mb", float("nan"))),
        "bytes_down": float(np.mean([r["bytes_down"] for r in rounds])),
        "bytes_up": float(np.mean([r["bytes_up"] for r in rounds])),
        "seconds": float(result["seconds"]) / len(rounds),
        "dropped": float(sum(r["dropped"] for r in rounds)),
        "client_rss_mb": float(np.nanmax([r["max_client_rss_mb"] for r in rounds])),
        "client_train_s": float(np.nanmean([r["mean_client_train_s"] for r in rounds])),
    }


JUDGED = {"accuracy-own": "own classes", "accuracy-new": "own classes + a new one from 5 examples"}
"""The metrics each variant is judged on against local only, and how the verdicts name them."""


def _mean(per_device: dict[int, dict[str, float]], key: str = "accuracy-own") -> float:
    """Mean over devices of one accuracy (printed as each run ends, so a cut-short bench still tells)."""
    return float(np.mean([m[key] for m in per_device.values()]))


def _means(per_device: dict[int, dict[str, float]]) -> dict[str, float]:
    """The judged accuracies' means over devices."""
    return {key: _mean(per_device, key) for key in JUDGED}


def _eval_sizes(args: argparse.Namespace) -> dict[int, dict[str, int]]:
    """Each device's held-out set sizes, by metric name (``accuracy-all``, ``accuracy-own``, ``accuracy-new``)."""
    from taste_cl.adapters.flower.digits_fleet import make_fleet

    fleet = make_fleet(args.devices, num_rounds=args.rounds, seed=args.seed)
    sizes = {d: {f"accuracy-{k}": int(x.shape[0]) for k, (x, _) in fleet.eval_sets(d).items()} for d in range(args.devices)}
    for d, by_key in sizes.items():
        by_key["accuracy-new"] = int(fleet.new_class_sets(d, args.rounds)[1][1].shape[0])
    return sizes


def _gap_in_samples(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], sizes: dict[int, dict[str, int]]) -> float:
    """The largest per-device accuracy difference of two runs, in held-out samples (1.0 = one sample)."""
    return max(abs(a[d][k] - b[d][k]) * n for d, by_key in sizes.items() for k, n in by_key.items())


def run_deployment_bench(args: argparse.Namespace) -> int:
    """Run the variants on one loopback deployment, print tables, save JSON."""
    from taste_cl.adapters.flower.fleet import require_flwr

    require_flwr()
    from taste_cl.adapters.flower.app import FleetConfig
    from taste_cl.adapters.flower.deployment import LoopbackDeployment
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.benchmarks.federated import run_local

    logging.getLogger("flwr").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    base = FleetConfig(
        devices=args.devices,
        rounds=args.rounds,
        personal=args.personal,
        seed=args.seed,
        clip=args.clip,
        noise=args.noise,
        epsilon=args.epsilon,
        evaluate_every_round=False,
        device=args.device,
    )
    variants = {
        "fedper": base,
        f"fedper+dp-{args.privacy}": FleetConfig(**{**base.__dict__, "privacy": args.privacy}),
    }
    if not args.no_secagg:
        variants["fedper+secagg"] = FleetConfig(**{**base.__dict__, "secagg": True})
    if args.compare_torch and args.device != "torch":
        variants["fedper (torch ClientApp)"] = FleetConfig(**{**base.__dict__, "device": "torch"})
    streams = make_fleet(args.devices, num_rounds=args.rounds, seed=args.seed)  # the devices' data, for local only
    local = run_local(streams, device=args.device, refit=base)
    print(f"local only ({args.device}): mean own-class accuracy {_mean(local):.3f}, with a new class {_mean(local, 'accuracy-new'):.3f}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    servers: dict[str, dict[str, np.ndarray]] = {}
    start = time.perf_counter()
    with LoopbackDeployment(args.devices, timeout_s=args.timeout, verbose=args.verbose) as deployment:
        print(f"deployment started: {args.devices} SuperNodes in {time.perf_counter() - start:.1f} s", flush=True)
        for name, config in variants.items():
            print(f"deployment run: {name} ...", flush=True)
            results[name], servers[name], _ = deployment.run(config)
            fleet = results[name]["deployment"]
            own, new = _means(last_evaluation(results[name])).values()
            print(
                f"  done in {fleet['wall_s']:.1f} s, fleet peak RSS {fleet['peak_rss_mb']:.0f} MB, "
                f"mean own-class accuracy {own:.3f}, with a new class {new:.3f}",
                flush=True,
            )
    deployment_s = time.perf_counter() - start
    simulated = None if args.no_simulation else _simulate(base)
    wide = args.simulation_devices not in (None, args.devices) and not args.no_simulation
    wide_sim = _simulate(FleetConfig(**{**base.__dict__, "devices": args.simulation_devices})) if wide else None
    names = list(variants)
    final = {n: last_evaluation(r) for n, r in results.items()}
    if simulated is not None:
        final["fedper (simulation)"] = last_evaluation(simulated)
    means: dict[str, dict[str, float]] = {}
    for key, label in (
        ("accuracy-all", "all classes"),
        ("accuracy-own", "the device's own classes"),
        ("accuracy-new", "the device's own classes and one new to it, learned from 5 examples after the rounds"),
    ):
        table, by_key = accuracy_table({"local only": local, **final}, [key])
        means[key] = by_key[key]
        print(f"per-device accuracy on held-out digits of {label}, after the last round")
        print(table)
        print()
    stats = {n: _per_round(r) for n, r in results.items()}
    if simulated is not None:
        stats["fedper (simulation)"] = _per_round(simulated)
    if wide_sim is not None:
        stats[f"fedper (simulation, {args.simulation_devices} devices)"] = _per_round(wide_sim)
        wide_means = {k: float(np.mean([m[k] for m in last_evaluation(wide_sim).values()])) for k in ("accuracy-all", "accuracy-own")}
        print(f"simulation with {args.simulation_devices} devices: mean per-device accuracy {wide_means}\n")
    columns = ["bytes_down", "bytes_up", "seconds", "run_s", "fleet_rss_mb", "dropped", "client_rss_mb", "client_train_s"]
    print(
        format_table(
            [
                "variant",
                "bytes down/round",
                "bytes up/round",
                "seconds/round",
                "run s",
                "fleet peak RSS MB",
                "dropped",
                "client RSS MB",
                "client train s",
            ],
            [[n, *(s[c] for c in columns)] for n, s in stats.items()],
        )
    )
    print()
    verdicts = {key: {n: means[key][n] > means[key]["local only"] for n in names} for key in JUDGED}
    noised_local = {name: _means(run_local(streams, device=args.device, refit=base, noise=variants[name])) for name in _noised_baselines(variants)}
    for key, label in JUDGED.items():
        for name in names:
            verdict = "beats" if verdicts[key][name] else "does NOT beat"
            print(f"{name}: {label} {means[key][name]:.3f} {verdict} local only {means[key]['local only']:.3f}")
        for name, noised in noised_local.items():
            verdict = "beats" if means[key][name] > noised[key] else "does NOT beat"
            print(f"{name}: {label} {means[key][name]:.3f} {verdict} local only with the same weight noise {noised[key]:.3f}")
    sizes = _eval_sizes(args)
    gaps: dict[str, float] = {}
    if simulated is not None:
        gaps["fedper deployment vs simulation"] = _gap_in_samples(final["fedper"], final["fedper (simulation)"], sizes)
    secagg_gap = None
    if "fedper+secagg" in servers:
        gaps["fedper+secagg vs fedper"] = _gap_in_samples(final["fedper+secagg"], final["fedper"], sizes)
        secagg_gap = max(float(np.max(np.abs(servers["fedper+secagg"][k] - v))) for k, v in servers["fedper"].items())
        print(f"largest shared-weight difference, fedper+secagg vs fedper after round {args.rounds}: {secagg_gap:.2e}")
    for label, gap in gaps.items():
        print(f"largest per-device accuracy gap, {label} (same seeds): {gap:.2f} held-out samples")
    print(f"deployment wall time (start, {len(names)} runs, stop): {deployment_s:.1f} s")
    swept = {n: c for n, c in variants.items() if not c.secagg and c.device == args.device}  # SecAgg+ equals plain (above)
    sweep = _seed_sweep(swept, list(range(args.seed, args.seed + args.seeds)), args.device) if args.seeds > 1 else None
    save_result(
        args.out,
        "federated_deployment",
        {
            "devices": args.devices,
            "rounds": args.rounds,
            "variants": {n: c.to_run_config() for n, c in variants.items()},
            "local": {str(d): v for d, v in local.items()},
            "deployment": results,
            "simulation": simulated,
            "wide_simulation": wide_sim,
            "per_round": stats,
            "mean_accuracy": means,
            "deployment_seconds": deployment_s,
            "secagg_max_abs_weight_gap": secagg_gap,
            "beats_local": verdicts,
            "local_with_the_same_noise": noised_local,
            "max_gap_samples": gaps,
            "seeds": sweep,
        },
    )
    return 0


def _seed_sweep(variants: dict[str, Any], seeds: list[int], device: str) -> dict[str, Any]:
    """Each variant's mean accuracies (:data:`JUDGED`) per seed in the simulation engine, beside local only on ``device``
    and two offline references (torch): one model trained on every device's data pooled, and each device trained
    alone on its own data shuffled (:func:`~taste_cl.benchmarks.federated.run_offline`).

    One seed decides little here: replay draws move a device's own-class accuracy by up to
    0.3 on these short class-incremental streams, and local only swings as much (3 x 2,
    seeds 0-4 on the artifacts runtime: 0.57-0.95). Prints a table per metric and each
    variant's verdicts on the means over seeds.
    """
    from taste_cl.adapters.flower.app import FleetConfig
    from taste_cl.adapters.flower.digits_fleet import make_fleet
    from taste_cl.benchmarks.federated import run_local, run_offline

    first = next(iter(variants.values()))
    noised = _noised_baselines(variants)
    offline = {"offline, every device's data pooled": True, "offline, each device alone": False}
    names = ["local only", *dict.fromkeys(noised.values()), *variants, *offline]
    scores: dict[str, dict[int, dict[str, float]]] = {name: {} for name in names}
    for seed in seeds:
        fleet = make_fleet(first.devices, num_rounds=first.rounds, seed=seed)
        refit = FleetConfig(**{**first.__dict__, "seed": seed})
        scores["local only"][seed] = _means(run_local(fleet, device=device, refit=refit))
        for name, label in noised.items():
            if seed not in scores[label]:
                config = FleetConfig(**{**variants[name].__dict__, "seed": seed})
                scores[label][seed] = _means(run_local(fleet, device=device, refit=config, noise=config))
        for name, config in variants.items():
            scores[name][seed] = _means(last_evaluation(_simulate(FleetConfig(**{**config.__dict__, "seed": seed}))))
        for label, pooled in offline.items():
            scores[label][seed] = _means(run_offline(fleet, refit=refit, pooled=pooled))
        done = ", ".join(f"{n} {by[seed]['accuracy-own']:.3f}, {by[seed]['accuracy-new']:.3f}" for n, by in scores.items())
        print(f"seed {seed} (own classes, with a new class): {done}", flush=True)
    means = {key: {name: float(np.mean([by_seed[s][key] for s in seeds])) for name, by_seed in scores.items()} for key in JUDGED}
    verdicts = {key: {name: means[key][name] > means[key]["local only"] for name in variants} for key in JUDGED}
    matched = {key: {name: means[key][name] > means[key][label] for name, label in noised.items()} for key in JUDGED}
    for key, label in JUDGED.items():
        local = scores["local only"]
        rows = [
            [name, *(by_seed[s][key] for s in seeds), means[key][name], float(np.std([by_seed[s][key] for s in seeds])),
             f"{sum(by_seed[s][key] > local[s][key] for s in seeds)} of {len(seeds)}" if name in variants else ""]
            for name, by_seed in scores.items()
        ]  # fmt: skip
        print(f"\nmean accuracy per seed on {label}, simulation engine, {device} runtime (offline rows: torch)")
        print(format_table(["variant", *(f"seed {s}" for s in seeds), "mean", "sd", "seeds beating local"], rows))
        for name, beats in verdicts[key].items():
            verdict = "beats" if beats else "does NOT beat"
            print(f"{name}: {label}, mean over {len(seeds)} seeds {means[key][name]:.3f} {verdict} local only {means[key]['local only']:.3f}")
        for name, noise_label in noised.items():
            verdict = "beats" if matched[key][name] else "does NOT beat"
            baseline = f"{noise_label} {means[key][noise_label]:.3f} (the same weight noise, no federation)"
            print(f"{name}: {label}, mean {means[key][name]:.3f} {verdict} {baseline}")
    return {"seeds": seeds, "device": device, "beats_local_mean": verdicts, "beats_noised_local_mean": matched,
            **{key: {n: {str(s): v[key] for s, v in by.items()} for n, by in scores.items()} for key in JUDGED}}  # fmt: skip


def _noised_baselines(variants: dict[str, Any]) -> dict[str, str]:
    """Variant -> the name of its local-only baseline with the same per-round weight noise, for each DP variant
    that noises the aggregate (``run_local(noise=...)``: that noise alone lifts local-only learning here)."""
    return {name: f"local only + noise {c.aggregate_noise_std:.3g}" for name, c in variants.items() if c.aggregate_noise_std > 0}
