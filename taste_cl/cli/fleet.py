"""``taste-cl fleet``: run the digits fleet on Flower's deployment engine on this machine.

Starts one ``flower-superlink`` and ``--devices`` ``flower-supernode`` processes on
127.0.0.1 (free ports), each SuperNode holding its own non-IID digits partition, runs
the fleet app with ``flwr run`` and stops every process it started, also on Ctrl-C or
SIGTERM. By default each SuperNode trains as a device does, without torch: the server
exports the model once and the devices train the ONNX Runtime artifacts
(``--device torch``: eager PyTorch ClientApps), also under ``--secagg``. TLS (a CA
made for the run) and SuperNode authentication (each SuperNode's key registered with
the SuperLink) are on unless ``--insecure``. Flower's logs stay in files unless ``--verbose``. Needs
``pip install 'taste-cl[federated]'``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taste_cl.cli.console import plain_text

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taste-cl fleet", description=plain_text(__doc__.splitlines()[0]))
    parser.add_argument("--devices", type=int, default=3, help="SuperNode processes, one per device")
    parser.add_argument("--rounds", type=int, default=2, help="federated rounds")
    parser.add_argument("--personal", default="4.", help="comma-separated state_dict prefixes kept on the device")
    parser.add_argument(
        "--server",
        choices=["fedavg", "fedavgm", "fedadam"],
        default="fedavgm",
        help="server strategy (Flower's)",
    )
    parser.add_argument("--server-momentum", type=float, default=0.5, help="FedAvgM server momentum")
    parser.add_argument("--server-lr", type=float, default=2.0, help="FedAvgM server learning rate (1: the mean update)")
    parser.add_argument("--server-eta", type=float, default=0.03, help="FedAdam server step size")
    parser.add_argument(
        "--privacy",
        choices=["off", "central", "client", "local"],
        default="off",
        help="differential privacy: central (server clips and adds noise), client (clients clip), local (clients add noise)",
    )
    parser.add_argument(
        "--secagg",
        action="store_true",
        help="secure aggregation (Flower's SecAgg+): the server sees only the sum of the updates; >= 3 devices, not with --privacy central",
    )
    parser.add_argument(
        "--device",
        choices=["artifacts", "torch"],
        default="artifacts",
        help="what a SuperNode trains: the exported ONNX Runtime artifacts without torch (default), or eager PyTorch",
    )
    parser.add_argument("--clip", type=float, default=1.0, help="DP clipping norm of an update")
    parser.add_argument("--noise", type=float, default=0.1, help="DP noise multiplier (central, client)")
    parser.add_argument("--epsilon", type=float, default=10.0, help="local DP epsilon per round")
    parser.add_argument(
        "--finetune-steps",
        type=int,
        default=300,
        help="SGD steps re-fitting each device's head on its own data before evaluation (0: off)",
    )
    parser.add_argument("--evaluate-last-only", action="store_true", help="evaluate the devices after the last round only (fewer messages, faster)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data partitions and models")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for startup and for the run")
    parser.add_argument("--out", default=None, help="write the run's result JSON to this file")
    parser.add_argument("--verbose", action="store_true", help="show Flower's logs instead of writing them to files")
    parser.add_argument("--insecure", action="store_true", help="no TLS and no SuperNode authentication (warns; only to debug on this machine)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from taste_cl.adapters.flower.app import FleetConfig
    from taste_cl.adapters.flower.deployment import LoopbackDeployment
    from taste_cl.adapters.flower.tables import ACCURACIES, accuracy_table, last_evaluation, rounds_table

    try:
        config = FleetConfig(
            devices=args.devices,
            rounds=args.rounds,
            personal=args.personal,
            server=args.server,
            server_momentum=args.server_momentum,
            server_lr=args.server_lr,
            server_eta=args.server_eta,
            privacy=args.privacy,
            secagg=args.secagg,
            device=args.device,
            evaluate_every_round=not args.evaluate_last_only,
            clip=args.clip,
            noise=args.noise,
            epsilon=args.epsilon,
            finetune_steps=args.finetune_steps,
            seed=args.seed,
        )
        deployment = LoopbackDeployment(args.devices, timeout_s=args.timeout, verbose=args.verbose, insecure=args.insecure)
    except ValueError as error:
        parser.error(str(error))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the with-block: processes stop
    try:
        with deployment:
            result: dict[str, Any] = deployment.run(config)[0]
    except KeyboardInterrupt:
        print("interrupted: every process this command started has been stopped", file=sys.stderr)
        return 130
    final = last_evaluation(result)
    keys = [key for key in (*ACCURACIES, "accuracy-new") if all(key in metrics for metrics in final.values())]  # new: with the re-fit
    print(accuracy_table({"accuracy": final}, keys)[0])
    print()
    print(rounds_table(result["rounds"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"result written to {args.out}")
    return 0
