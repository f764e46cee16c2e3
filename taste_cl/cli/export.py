"""``taste-cl export``: write the digits learner's on-device training artifacts.

Without ``--checkpoint`` it trains the reference digits learner (MLP, SGD, 200-sample
reservoir) on the first ``--tasks`` split-digits tasks, then exports it; with
``--checkpoint DIR`` it loads a saved reference learner instead. ``--backend`` is
``learner.export``'s: ``onnx_engine`` (standard ONNX graphs on plain onnxruntime, extra
``[onnx]``), ``onnxruntime`` (the deprecated training build, extra ``[onnx-training]``; the only
one that takes ``--optimizer`` and ``--lr``, since the engine trains with the learner's own
optimizer), ``executorch``, or ``auto`` (the default: the first that passes). Load the folder on the
device with ``taste_cl.adapters.device.loader.load_learner``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from taste_cl.adapters.device.artifacts import read_manifest
from taste_cl.adapters.device.backends import BACKENDS
from taste_cl.cli.console import plain_text
from taste_cl.datasets import make_mlp, split_digits, stream
from taste_cl.learner import OnlineLearner
from taste_cl.reference import build_digits_learner

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taste-cl export", description=plain_text(__doc__))
    parser.add_argument("--out", default="artifacts", help="artifact folder to write (replaced if it holds artifacts)")
    parser.add_argument("--checkpoint", help="folder of a saved reference digits learner to export instead of training")
    parser.add_argument("--tasks", type=int, default=2, help="split-digits tasks (of 5) to train on before exporting")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), help="on-device optimizer (default: the learner's)")
    parser.add_argument("--lr", type=float, help="on-device learning rate (default: the learner's)")
    parser.add_argument("--batch-size", type=int, help="stream batch size to record in the manifest for the app")
    parser.add_argument("--last-layer-only", action="store_true", help="train only the output layer on device")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training stream and model")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto", help="device runtime (default: the first that passes)")
    args = parser.parse_args(argv)
    if not 1 <= args.tasks <= 5:
        parser.error(f"--tasks must be in [1, 5]; got {args.tasks}")
    optimizer_options = {key: value for key, value in (("optimizer", args.optimizer), ("lr", args.lr)) if value is not None}
    if optimizer_options and args.backend != "onnxruntime":
        parser.error("--optimizer and --lr set the onnxruntime backend's on-device optimizer; pass --backend onnxruntime")

    torch.manual_seed(args.seed)
    if args.checkpoint:
        model = make_mlp(seed=args.seed)
        learner = OnlineLearner.load(args.checkpoint, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        learner = build_digits_learner(seed=args.seed)
        tasks = split_digits(5, seed=args.seed)
        for _, x, y in stream(tasks[: args.tasks], 10, seed=args.seed):
            learner.observe((x, y))
    names = [name for name, _ in learner.model.named_parameters()]
    trainable = names[-2:] if args.last_layer_only else None  # the output layer's weight and bias
    folder = learner.export(args.out, backend=args.backend, trainable=trainable, batch_size=args.batch_size, **optimizer_options)
    sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir()) if path.is_file()}
    backend = read_manifest(folder).get("backend", "onnxruntime")  # ONNX Runtime folders predate the field
    print(f"exported {learner.samples_seen} samples' worth of learning to {folder} ({backend})")
    for name, size in sizes.items():
        print(f"  {name:24s} {size / 1024:8.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
