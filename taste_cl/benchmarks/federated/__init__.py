"""Fleet personalization on Flower: local-only vs federated shared + local personal, one run.

Each simulated device sees its own non-IID class-incremental slice of sklearn digits (2-4
classes in sequence, disjoint samples), one pass, spread over the rounds. Both variants
observe exactly the same batches with the same learner (reference MLP, reservoir replay):
*local* never communicates; *federated* averages the shared part with Flower's FedAvgM
(FedAvg with server momentum; ``--server-momentum 0`` is plain FedAvg) and keeps the
personal part on the device: by default the output-layer bias, i.e. the device's own
label prior (keeping a whole layer local does not help on this tiny non-IID stream). Accuracy is per device on held-out digits of all
classes ("all") and of the device's own classes ("own"). Also reports payload bytes,
time and memory per round, and writes JSON.
Run: ``taste-cl bench federated`` (needs ``pip install 'taste-cl[federated]'``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from taste_cl.adapters.flower.digits_fleet import Fleet, make_fleet
from taste_cl.adapters.flower.tables import accuracy_table, rounds_table
from taste_cl.adapters.flower.updates import personal_predicate
from taste_cl.benchmarks._common import base_parser, parse, save_result

if TYPE_CHECKING:
    from taste_cl.adapters.flower.app import FleetConfig

__all__ = ["main", "run_local", "run_offline"]


def run_local(
    fleet: Fleet, *, device: str = "torch", refit: FleetConfig | None = None, noise: FleetConfig | None = None
) -> dict[int, dict[str, float]]:
    """Each device alone: the same batches, no communication, on the fleet's runtime.

    ``device="torch"`` trains the reference :class:`OnlineLearner`; ``"artifacts"`` the
    torch-free ONNX Runtime learner of its parity-gated export, as a deployed device does:
    the two draw replayed rows from different random streams, which on these short
    class-incremental streams moves a device's own-class accuracy by up to 0.3, so a fleet
    is compared with local learning on its own runtime. With ``refit`` (the fleet's config,
    when :attr:`~taste_cl.adapters.flower.app.FleetConfig.finetunes_head`) each device
    re-fits its head on everything it has seen before it is scored, exactly as the fleet's
    devices do, so the comparison measures federation and not the re-fit. With ``noise`` (a
    fleet config with central or client DP) each device adds, after each round, the Gaussian
    noise that DP adds to that fleet's aggregate (:attr:`~taste_cl.adapters.flower.app.FleetConfig.aggregate_noise_std`)
    to its shared tensors: weight noise alone regularizes these short streams, so a DP fleet
    is also compared with local learning under the same noise.
    """
    if device not in ("torch", "artifacts"):
        raise ValueError(f"`device == {device!r}`, must be 'torch' or 'artifacts'")
    if refit is not None and not refit.finetunes_head:
        refit = None
    perturb = _weight_noise(noise, fleet.seed)
    if device == "artifacts":
        return _run_local_artifacts(fleet, refit, perturb)
    results = {}
    for d in range(len(fleet.classes)):
        torch.manual_seed(fleet.seed)
        learner = fleet.build_learner(d)
        for server_round in range(1, fleet.num_rounds + 1):
            for batch in fleet.train_batches(d, server_round):
                learner.observe(batch)
            if perturb is not None:
                state = {name: value.numpy() for name, value in learner.model.state_dict().items()}
                learner.model.load_state_dict({name: torch.from_numpy(value) for name, value in perturb(d, state).items()}, strict=False)
        results[d] = fleet.scores(learner.model, d, fleet.num_rounds, refit)
    return results


def run_offline(fleet: Fleet, *, refit: FleetConfig, pooled: bool, steps: int = 1000) -> dict[int, dict[str, float]]:
    """A reference no stream reaches: the reference model trained offline, shuffled, ``steps`` SGD steps of 32 rows at
    the learner's learning rate, on every device's data in one place (``pooled=True``: more than any federated method
    sees) or on each device's own data alone; then each device re-fits its head and is scored as the fleet's devices are.

    On this fleet the two give a device's own classes the same accuracy (3 x 2 and 10 x 10, seeds 0-4, within half a
    point): its own data suffices for them, so on them federation can add training steps but not data. A class new to
    the device is where pooled data helps (see docs/federated.md).
    """
    reference = fleet.build_learner(0)
    lr = float(reference.optimizer.param_groups[0]["lr"])

    def trained(x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
        model = copy.deepcopy(reference.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(fleet.seed)
        model.train()
        for _ in range(steps):
            rows = torch.randint(x.shape[0], (min(32, x.shape[0]),), generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
        return model

    everyone = trained(torch.cat(fleet.x_train), torch.cat(fleet.y_train)) if pooled else None
    return {
        d: fleet.scores(everyone if everyone is not None else trained(fleet.x_train[d], fleet.y_train[d]), d, fleet.num_rounds, refit)
        for d in range(len(fleet.classes))
    }


Perturb = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]
"""(device, its tensors by name) -> its shared tensors with this round's noise added."""


def _weight_noise(config: FleetConfig | None, seed: int) -> Perturb | None:
    """What ``config``'s DP noise does to a device's shared tensors each round (one random stream per device), or None."""
    std = 0.0 if config is None else config.aggregate_noise_std
    if config is None or std == 0.0:
        return None
    is_personal = personal_predicate(config.prefixes)
    streams: dict[int, np.random.Generator] = {}

    def perturb(device: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rng = streams.setdefault(device, np.random.default_rng([seed, device]))
        return {
            name: (value + rng.normal(0.0, std, value.shape)).astype(value.dtype)
            for name, value in tensors.items()
            if not is_personal(name) and np.issubdtype(value.dtype, np.floating)
        }

    return perturb


def _run_local_artifacts(fleet: Fleet, refit: FleetConfig | None, perturb: Perturb | None = None) -> dict[int, dict[str, float]]:
    """:func:`run_local` on the ONNX Runtime device learner, exported once from the reference learner."""
    import tempfile
    from pathlib import Path

    from taste_cl.adapters.device import export
    from taste_cl.adapters.flower.device_client import score_on_device
    from taste_cl.adapters.flower.device_server import export_head
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    results = {}
    with tempfile.TemporaryDirectory(prefix="taste-cl-local-") as tmp:
        reference, example = fleet.build_learner(0), (fleet.x_train[0][:8], fleet.y_train[0][:8])
        folder = export(reference, Path(tmp) / "train", backend="onnxruntime", example=example)  # exports copy the learner
        head = None if refit is None else export_head(reference, Path(tmp) / "head", refit, example)
        for d in range(len(fleet.classes)):
            learner = OrtOnlineLearner.from_artifacts(folder)
            for server_round in range(1, fleet.num_rounds + 1):
                for x, y in fleet.train_batches(d, server_round):
                    learner.observe((x.numpy(), y.numpy()))
                if perturb is not None:
                    learner.load_parameters(perturb(d, learner.parameters()))
            steps, lr = (0, 0.0) if refit is None else (refit.finetune_steps, refit.finetune_lr)
            scores = score_on_device(
                learner, fleet.device_data(d), head, steps=steps, lr=lr, seed=fleet.seed, partition=d, server_round=fleet.num_rounds
            )
            results[d] = {k: v for k, v in scores.items() if k.startswith("accuracy-")}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("federated", __doc__.splitlines()[0], threads=0)
    parser.add_argument("--devices", type=int, default=None, help="devices (1-20; default 10, with --deployment 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 12, with --deployment 2)")
    parser.add_argument(
        "--personal", default=None, help="comma-separated state_dict name prefixes kept on device (default 4.bias, with --deployment 4.)"
    )
    parser.add_argument("--deployment", action="store_true", help="devices as processes: a SuperLink and SuperNodes on loopback")
    parser.add_argument("--privacy", choices=["central", "client", "local"], default="central", help="DP variant (--deployment)")
    parser.add_argument("--clip", type=float, default=1.0, help="DP clipping norm of an update (--deployment)")
    parser.add_argument("--noise", type=float, default=0.1, help="DP noise multiplier, central/client (--deployment)")
    parser.add_argument("--epsilon", type=float, default=10.0, help="local DP epsilon per round (--deployment)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for startup and for each run (--deployment)")
    parser.add_argument("--no-simulation", action="store_true", help="skip the simulation twin of the FedPer run (--deployment)")
    parser.add_argument("--no-secagg", action="store_true", help="skip the FedPer + SecAgg+ run (--deployment)")
    parser.add_argument(
        "--device",
        choices=["artifacts", "torch"],
        default="artifacts",
        help="what a SuperNode trains: the exported ONNX Runtime artifacts without torch, or eager PyTorch (--deployment)",
    )
    parser.add_argument("--compare-torch", action="store_true", help="add the FedPer run with PyTorch ClientApps, side by side (--deployment)")
    parser.add_argument("--simulation-devices", type=int, default=None, help="also simulate FedPer with this many devices, up to 200 (--deployment)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="also run every method but SecAgg+ and local only in the simulation engine over this many seeds from --seed, "
        "on the deployment's runtime, and judge them on the mean (--deployment; 1: the deployment's seed only)",
    )
    parser.add_argument("--server-momentum", type=float, default=0.9, help="FedAvgM server momentum (0 = FedAvg)")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="CPU share of one simulated device")
    args = parse(parser, argv)
    for name, default, deployed in (("devices", 10, 3), ("rounds", 12, 2), ("personal", "4.bias", "4.")):
        if getattr(args, name) is None:
            setattr(args, name, deployed if args.deployment else default)
    if not 1 <= args.devices <= 20:
        parser.error(f"`--devices == {args.devices}`, must be in [1, 20]")
    if args.simulation_devices is not None and not 1 <= args.simulation_devices <= 200:
        parser.error(f"`--simulation-devices == {args.simulation_devices}`, must be in [1, 200]")
    if args.rounds < 1:
        parser.error(f"`--rounds == {args.rounds}`, must be >= 1")
    if args.seeds < 1:
        parser.error(f"`--seeds == {args.seeds}`, must be >= 1")
    if args.deployment:
        from taste_cl.benchmarks.federated.deployment import run_deployment_bench

        return run_deployment_bench(args)
    from taste_cl.adapters.flower.fleet import require_flwr, run_fleet_simulation

    require_flwr()  # telemetry off before flwr is first imported
    from flwr.serverapp.strategy import FedAvgM

    logging.getLogger("flwr").setLevel(logging.WARNING)
    personal = [p for p in args.personal.split(",") if p]
    fleet = make_fleet(args.devices, num_rounds=args.rounds, seed=args.seed)
    local = run_local(fleet)
    fed = run_fleet_simulation(
        build_learner=fleet.build_learner,
        train_batches=fleet.train_batches,
        eval_sets=fleet.eval_sets,
        personal=personal,
        num_devices=args.devices,
        num_rounds=args.rounds,
        strategy=FedAvgM(
            min_train_nodes=args.devices,
            min_evaluate_nodes=args.devices,
            min_available_nodes=args.devices,
            server_momentum=args.server_momentum,
        ),
        client_cpus=args.client_cpus,
        verbose=args.verbose,
    )
    final = fed.final
    classes = {d: ",".join(map(str, c)) for d, c in enumerate(fleet.classes)}
    table, by_key = accuracy_table({"local": local, "fed": final}, details={"classes": classes})
    means = {f"{run}_{key.removeprefix('accuracy-')}": mean for key, runs in by_key.items() for run, mean in runs.items()}
    print(table)
    print()
    print(rounds_table([asdict(r) for r in fed.rounds]))
    print(f"\nmean per-device accuracy on all classes: local {means['local_all']:.3f}  federated {means['fed_all']:.3f}")
    save_result(
        args.out,
        "federated",
        {
            "devices": args.devices,
            "rounds": args.rounds,
            "personal": personal,
            "server_momentum": args.server_momentum,
            "classes": fleet.classes,
            "local": {str(d): v for d, v in local.items()},
            "federated": {str(d): v for d, v in final.items()},
            "mean": means,
            "round_stats": [asdict(r) for r in fed.rounds],
            "dropped": [asdict(d) for d in fed.dropped],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
