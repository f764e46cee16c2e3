"""The ``taste-cl`` command: ``demo``, ``bench NAME`` and ``export``.

Each sub-command lives in its own module and is imported only when used, so
``taste-cl --help`` is fast and optional extras are needed only by the commands that use them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["BENCHMARKS", "main"]

# benchmark name -> module with a ``main(argv) -> int``
BENCHMARKS: dict[str, str] = {
    "batch-size": "taste_cl.benchmarks.batch_size",
    "elastic": "taste_cl.benchmarks.elastic",
    "federated": "taste_cl.benchmarks.federated",
    "online-digits": "taste_cl.benchmarks.online_digits",
    "onnx": "taste_cl.benchmarks.onnx_training",
    "soak": "taste_cl.benchmarks.soak",
    "update-guard": "taste_cl.benchmarks.update_guard",
    "vs-avalanche": "taste_cl.benchmarks.vs_avalanche",
}
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("taste_cl.demo", "online class-incremental stream on sklearn digits, with a plot"),
    "export": ("taste_cl.export", "train the digits learner (or load a checkpoint), export ONNX Runtime artifacts"),
    "fleet": ("taste_cl.fleet", "run the digits fleet on Flower's deployment engine: SuperLink + SuperNodes on loopback"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="taste-cl", description="Continual learning on edge devices.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS), add_help=False)
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "bench":
        if args.name is None:
            print("usage: taste-cl bench NAME [options]; NAME is one of: " + ", ".join(sorted(BENCHMARKS)))
            return 2
        module = BENCHMARKS[args.name]
    else:
        module = COMMANDS[args.command][0]
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
