"""Test-time adaptation on corrupted digits: source, BN-adapt, TENT, EATA, guarded TENT and EATA.

scikit-learn's handwritten digits (8x8, upsampled to 16x16), a BatchNorm CNN pretrained on
1000 of them inside the benchmark, and the other 797 under seven corruptions built offline
(:mod:`taste_cl.adaptation.corruptions`), in three settings after TENT and RDumb/CCC:

- **episodic**: every corruption at every severity, the model reset before each;
- **continual**: the seven at severity 5 in sequence, never reset, at each ``--batch-sizes``;
- **long**: ``--long-samples`` rows (default 20,000) in segments of 500, each a random
  corruption at a random severity, so shifts recur; errors over consecutive windows of
  1000 rows, each paired with the source's on the same rows.

Every method sees the same rows in the same order. Prints the mean error per setting and
method, the long stream's worst window against the source, the guard's resets, and the
memory of the guard's anchor against a frozen model copy; writes JSON.
Run: ``taste-cl bench adapt`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from taste_cl.adaptation import CollapseGuard, Eata, Tent, TestTimeAdapter
from taste_cl.adaptation.corruptions import IMAGE_CORRUPTIONS, SEVERITIES, corrupt
from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.exceptions import AdaptationWarning
from taste_cl.learner import OnlineLearner
from taste_cl.report import format_table

Stream = list[tuple[torch.Tensor, torch.Tensor]]
METHOD_NAMES = ("source", "bn", "tent", "eata", "guarded tent", "guarded eata")


def digits_images(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as 1x16x16 images in [0, 1], shuffled by ``seed``: 1000 to pretrain on, 797 to test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
    x = nn.functional.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:1000], y[:1000], x[1000:], y[1000:]


def bn_cnn(seed: int) -> nn.Module:
    """Three Conv-BatchNorm-ReLU-pool blocks and a linear head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for c_in, c_out in ((1, 16), (16, 32), (32, 64)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def pretrain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for rows in torch.randperm(len(y), generator=generator).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
    model.eval()


def make_adapter(name: str, lr: float) -> TestTimeAdapter | None:
    """The adapter of one compared method (None: the source model, never adapted)."""
    makers: dict[str, Callable[[], TestTimeAdapter | None]] = {
        "source": lambda: None,
        "bn": lambda: TestTimeAdapter("bn", guard=None),
        "tent": lambda: TestTimeAdapter(Tent(lr=lr), guard=None),
        "eata": lambda: TestTimeAdapter(Eata(lr=lr), guard=None),
        "guarded tent": lambda: TestTimeAdapter(Tent(lr=lr), guard=CollapseGuard()),
        "guarded eata": lambda: TestTimeAdapter(Eata(lr=lr), guard=CollapseGuard()),
    }
    return makers[name]()


def run_stream(
    model: nn.Module, state: dict[str, torch.Tensor], method: str, stream: Stream, *, batch_size: int, lr: float, reset_each: bool = False
) -> tuple[torch.Tensor, int]:
    """Per-row mistakes (1.0 wrong, 0.0 right) of ``method`` over ``stream``, and its guard's resets."""
    model.load_state_dict(state)
    learner = OnlineLearner(model, adaptation=make_adapter(method, lr))
    wrong: list[torch.Tensor] = []
    resets = 0
    for x, y in stream:
        if reset_each and learner.adapter is not None:
            model.load_state_dict(state)
            learner.adapter = make_adapter(method, lr)
        for rows in torch.arange(len(y)).split(batch_size):
            outputs = learner.predict(x[rows]) if learner.adapter is None else learner.adapt(x[rows]).outputs
            wrong.append((outputs.argmax(1) != y[rows]).float())
        resets += learner.adapter.resets if reset_each and learner.adapter is not None else 0
    if not reset_each and learner.adapter is not None:
        resets = learner.adapter.resets
    return torch.cat(wrong), resets


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("adapt", __doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-3, help="TENT's and EATA's learning rate (Adam)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 4, 1], help="batch sizes of the continual setting")
    parser.add_argument("--long-batch-size", type=int, default=16, help="batch size of the long recurring stream")
    parser.add_argument("--long-samples", type=int, default=20_000, help="rows in the long recurring stream (a multiple of 1000)")
    parser.add_argument("--epochs", type=int, default=15, help="pretraining epochs of the source model")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rows, one batch size, a 2000-row long stream")
    args = parse(parser, argv)
    # at batch size 1 every adapter warns once that BatchNorm keeps its running statistics: said once here instead
    warnings.filterwarnings("ignore", category=AdaptationWarning)
    if 1 in args.batch_sizes:
        print("batch size 1: below min_batch=2 no method adapts (BatchNorm keeps its running statistics, TENT and EATA take no step)")
    if args.quick:
        args.batch_sizes, args.long_samples, args.epochs = [64], 2000, 3
    if args.long_samples < 1000 or args.long_samples % 1000:
        parser.error(f"--long-samples must be a positive multiple of 1000; got {args.long_samples}")
    train_x, train_y, test_x, test_y = digits_images(args.seed)
    if args.quick:
        test_x, test_y = test_x[:200], test_y[:200]
    model = bn_cnn(args.seed)
    pretrain(model, train_x, train_y, epochs=args.epochs, seed=args.seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        clean_error = float((model(test_x).argmax(1) != test_y).float().mean())
    names = list(IMAGE_CORRUPTIONS)
    episodic = [(corrupt(test_x, name, s, seed=10 * i + s), test_y) for i, name in enumerate(names) for s in SEVERITIES]
    continual = [(corrupt(test_x, name, 5, seed=i), test_y) for i, name in enumerate(names)]
    long_stream = _long_stream(test_x, test_y, args.long_samples, seed=args.seed)
    errors: dict[str, dict[str, float]] = {}
    resets: dict[str, dict[str, int]] = {}
    windows: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    settings = [("episodic", episodic, 64, True)] + [(f"continual bs={b}", continual, b, False) for b in args.batch_sizes]
    settings.append((f"long bs={args.long_batch_size}", long_stream, args.long_batch_size, False))
    jobs = [(setting, method) for setting, *_ in settings for method in METHOD_NAMES]
    table = {setting: (stream, batch, reset_each) for setting, stream, batch, reset_each in settings}
    for setting, method in progress_bar(jobs, enabled=not args.no_progress, desc="adapt"):
        stream, batch, reset_each = table[setting]
        start = time.perf_counter()
        wrong, count = run_stream(model, state, method, stream, batch_size=batch, lr=args.lr, reset_each=reset_each)
        seconds[f"{setting} / {method}"] = time.perf_counter() - start
        errors.setdefault(setting, {})[method] = float(wrong.mean())
        resets.setdefault(setting, {})[method] = count
        if setting.startswith("long"):
            windows[method] = wrong.view(-1, 1000).mean(dim=1).tolist()
    rows = [[setting, *(errors[setting][m] for m in METHOD_NAMES)] for setting in errors]
    print(f"clean error of the source model: {clean_error:.3f}; mean error per setting (lower is better), lr {args.lr}:")
    print(format_table(["setting", *METHOD_NAMES], rows))
    worst = {m: max(w - s for w, s in zip(windows[m], windows["source"])) for m in METHOD_NAMES if m != "source"}
    print(f"long stream, {args.long_samples} rows: worst 1000-row window minus the source's on the same rows")
    long_resets = resets[f"long bs={args.long_batch_size}"]
    worse = {m: sum(w - s > 0.01 for w, s in zip(windows[m], windows["source"])) for m in worst}
    rows = [[m, worst[m], worse[m], long_resets[m]] for m in worst]
    print(format_table(["method", "worst window vs source", "windows worse by > 1 point", "guard resets"], rows))
    adapter = TestTimeAdapter()
    adapter.bind(model)
    print(f"guard anchor: {adapter.anchor_bytes} bytes; a frozen model copy: {adapter.model_copy_bytes} bytes")
    continual_64 = errors.get("continual bs=64", {})
    summary = (
        f"continual severity 5, bs 64: source {continual_64.get('source', float('nan')):.3f}, bn {continual_64.get('bn', float('nan')):.3f}, "
        f"tent {continual_64.get('tent', float('nan')):.3f}, guarded tent {continual_64.get('guarded tent', float('nan')):.3f}; "
        f"long stream worst window vs source: tent {worst['tent']:+.3f}, guarded tent {worst['guarded tent']:+.3f}"
    )
    save_result(
        args.out,
        "adapt",
        {
            "lr": args.lr,
            "clean_error": clean_error,
            "errors": errors,
            "resets": resets,
            "long_windows": windows,
            "worst_window_vs_source": worst,
            "seconds": seconds,
            "median_seconds": statistics.median(seconds.values()),
            "anchor_bytes": adapter.anchor_bytes,
            "model_copy_bytes": adapter.model_copy_bytes,
        },
        summary=summary,
    )
    return 0


def _long_stream(x: torch.Tensor, y: torch.Tensor, samples: int, *, seed: int) -> Stream:
    """Segments of 500 rows, each a random corruption at a random severity (recurring)."""
    generator = torch.Generator().manual_seed(seed + 1)
    names = list(IMAGE_CORRUPTIONS)
    stream: Stream = []
    for k in range(samples // 500):
        rows = torch.randint(0, len(y), (500,), generator=generator)
        name = names[int(torch.randint(0, len(names), (1,), generator=generator))]
        severity = int(torch.randint(1, 6, (1,), generator=generator))
        stream.append((corrupt(x[rows], name, severity, seed=seed * 100_000 + k), y[rows]))
    return stream
