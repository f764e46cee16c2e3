"""The ``taste-cl`` command: ``demo``, ``export`` and ``bench NAME``.

Each sub-command lives in its own module with a ``main(argv) -> int`` and is imported only
when run, so ``taste-cl --help`` is fast and an optional extra is needed only by the
commands that use it. ``taste-cl COMMAND --help`` is answered by the command's own parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from taste_cl import __version__

__all__ = ["BENCHMARKS", "COMMANDS", "build_parser", "main"]

# benchmark name -> (module with a ``main(argv) -> int``, one-line summary)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "adapt": ("taste_cl.benchmarks.recorded.adapt", "test-time adaptation on corrupted digits: source, BN-adapt, TENT, EATA, guarded"),
    "batch-size": ("taste_cl.benchmarks.batch_size", "throughput-aware batch size: tuned vs grid oracle vs fixed sizes"),
    "device": ("taste_cl.benchmarks.device_runtimes", "ORT training build and ExecuTorch steps vs torch (extras [onnx-training], [executorch])"),
    "elastic": ("taste_cl.benchmarks.elastic", "elastic trainable-tensor selection vs full and last-layer training"),
    "engines": ("taste_cl.benchmarks.parity.engines", "one loop on torch eager and the standard-ONNX engine: accuracy, replay draws, guard refusals"),
    "federated": ("taste_cl.benchmarks.federated", "simulated Flower fleet vs local-only learning (extra [federated])"),
    "online-digits": ("taste_cl.benchmarks.online_digits", "split-digits stream: reservoir replay vs no replay"),
    "onnx": ("taste_cl.benchmarks.onnx_training", "ONNX Runtime training build step vs torch eager step (extra [onnx-training])"),
    "overhead": ("taste_cl.benchmarks.overhead", "per-observe overhead: observe variants vs the raw torch loop, phases, FLOP/s"),
    "personalize": ("taste_cl.benchmarks.personalize", "personalize a pretrained CNN: last layer, bias-only, LoRA, ElasticTrainer, full fine-tuning"),
    "real": ("taste_cl.benchmarks.recorded.real", "UEA/UCR streams vs Avalanche, offline bound, enrolment (extras [real], [avalanche], [onnx])"),
    "report": ("taste_cl.benchmarks.report", "the README performance table from the benchmarks' JSON results"),
    "soak": ("taste_cl.benchmarks.soak", "long stream: resident memory and history sizes stay bounded"),
    "strategies": ("taste_cl.benchmarks.strategies", "ER, ER-ACE, DER++, LwF and Avalanche's ER_ACE/DER on split digits and a drifting stream"),
    "tuner-replay": ("taste_cl.benchmarks.tuner_replay", "the batch-size tuner's search replayed offline on recorded curves"),
    "update-guard": ("taste_cl.benchmarks.update_guard", "cost of the non-finite update guard on healthy steps"),
    "vs-avalanche": ("taste_cl.benchmarks.vs_avalanche", "the online stream in Avalanche vs OnlineLearner (extra [avalanche])"),
    "web-step": ("taste_cl.benchmarks.web_step", "browser vs Python device learner: time per training step (needs Chromium, Node)"),
}
# command -> (module with a ``main(argv) -> int``, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("taste_cl.cli.demo", "online class-incremental stream on sklearn digits, with a plot"),
    "export": ("taste_cl.cli.export", "train the digits learner (or load a checkpoint), export on-device training artifacts (extra [onnx])"),
    "serve-demo": ("taste_cl.cli.serve_demo", "personalize a digits model in the browser (serves 127.0.0.1 only)"),
    "fleet": ("taste_cl.cli.fleet", "run the digits fleet on Flower's deployment engine: SuperLink + SuperNodes on loopback (extra [federated])"),
}


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``bench`` parser; options after a command go to its module."""
    parser = argparse.ArgumentParser(
        prog="taste-cl",
        description="Continual learning on edge devices: a demo, ONNX Runtime export and benchmarks.",
        epilog="Run 'taste-cl COMMAND --help' or 'taste-cl bench NAME --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"taste-cl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    names = "\n".join(f"  {name:<14} {summary}" for name, (_, summary) in BENCHMARKS.items())
    bench = sub.add_parser(
        "bench",
        help="run a benchmark (prints a table, writes JSON under bench_results/)",
        description="Run a benchmark: it prints a table and writes JSON (and a PNG where there is a plot) under --out.",
        epilog=f"benchmarks:\n{names}\n\nRun 'taste-cl bench NAME --help' for a benchmark's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", nargs="?", choices=list(BENCHMARKS), metavar="NAME", help="the benchmark to run")
    return parser, bench


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``taste-cl`` with ``argv`` (default: the process arguments); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, bench = build_parser()
    # the first argument chooses the command; everything after it is the command's own
    if argv and argv[0] in COMMANDS:
        return int(importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:]) or 0)
    if argv and argv[0] == "bench" and len(argv) > 1 and argv[1] in BENCHMARKS:
        return int(importlib.import_module(BENCHMARKS[argv[1]][0]).main(argv[2:]) or 0)
    args = parser.parse_args(argv)  # --help, --version, bench --help and unknown names end here
    if args.command == "bench":
        bench.print_usage(sys.stderr)
        print("taste-cl bench: error: name a benchmark; 'taste-cl bench --help' lists them", file=sys.stderr)
        return 2
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
