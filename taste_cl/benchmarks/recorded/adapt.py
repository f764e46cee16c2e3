"""Test-time adaptation on corrupted digits: source, BN-adapt, TENT, EATA, guarded TENT and EATA.

scikit-learn's handwritten digits (8x8, upsampled to 16x16), a BatchNorm CNN pretrained on
1000 of them inside the benchmark, and the other 797 under seven corruptions built offline
(:mod:`taste_cl.adaptation.corruptions`), in three settings after TENT and RDumb/CCC:

- **episodic**: every corruption at every severity, the model reset before each;
- **continual**: the seven at severity 5 in sequence, never reset, at each ``--batch-sizes``;
- **long**: ``--long-samples`` rows (default 20,000) in segments of 500, each a random
  corruption at a random severity, so shifts recur, at each ``--long-batch-sizes`` (16, and
  4: the batch size at which unguarded TENT collapses on this data); errors over consecutive
  windows of 1000 rows, each paired with the source's on the same rows.

Sequences (unless ``--no-sequences``): a 1-D BatchNorm CNN pretrained on the recorded
JapaneseVowels (``JapaneseVowels_eq``, 12 channels x 25 steps, bundled in aeon) and its test
rows under the three sequence corruptions (sensor noise, drift, time warp) at severity 5 in
sequence, continual, at each ``--batch-sizes``; and once more at batch 64 and 4 (those of
``--batch-sizes``) in the archive's own row order, sorted by class: a stream whose batches hold
one class, which batch statistics cannot tell from a shift.

Every method sees the same rows in the same order. Prints the mean error per setting and
method, the long stream's worst window against the source, the guard's resets, the
memory of the guard's anchor against a frozen model copy, and how well the label-free accuracy
estimate (AETTA, :mod:`~taste_cl.adaptation.estimate`) follows the true accuracy: per window
(1000 rows on the long stream, one corruption elsewhere) the estimate over the window's rows
against the accuracy of the predictions returned, as mean absolute error and correlation;
writes JSON.

Device rows: in the continual setting, BN-adapt, TENT and guarded TENT also run torch-free on the
ONNX engine (:func:`~taste_cl.adapters.onnx_engine.adapt_export.export_adapter`, then
:func:`~taste_cl.adapters.onnx_engine.learner.load_adapter`), beside torch's, with the gap in points.
Run: ``taste-cl bench adapt`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from taste_cl.adaptation import CollapseGuard, Eata, Tent, TestTimeAdapter
from taste_cl.adaptation.corruptions import IMAGE_CORRUPTIONS, SEQUENCE_CORRUPTIONS, SEVERITIES, corrupt
from taste_cl.adaptation.estimate import DropoutProbe
from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.engine.adapt import aetta_accuracy
from taste_cl.exceptions import AdaptationWarning
from taste_cl.learner import OnlineLearner
from taste_cl.report import format_table

Stream = list[tuple[torch.Tensor, torch.Tensor]]
METHOD_NAMES = ("source", "bn", "tent", "eata", "guarded tent", "guarded eata")
DEVICE_METHODS = ("bn", "tent", "guarded tent")
DEFAULT = "guarded eata"  # the guarded method's one default configuration: Eata() under CollapseGuard(), as TestTimeAdapter("eata")


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
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Per-row mistakes (1.0 wrong, 0.0 right) of ``method`` over ``stream``, its guard's resets, and per row the
    dropout summary of the predictions returned (what AETTA's estimate reads; the source's from its own probe)."""
    model.load_state_dict(state)
    learner = OnlineLearner(model, adaptation=make_adapter(method, lr))
    probe = DropoutProbe(model)
    wrong: list[torch.Tensor] = []
    summaries: list[torch.Tensor] = []
    resets = 0
    for x, y in stream:
        if reset_each and learner.adapter is not None:
            model.load_state_dict(state)
            learner.adapter = make_adapter(method, lr)
        for rows in torch.arange(len(y)).split(batch_size):
            if learner.adapter is None:
                with probe.capture():
                    outputs = learner.predict(x[rows])
                summary = probe.summary(outputs, len(wrong))
            else:
                stats = learner.adapt(x[rows])
                outputs, summary = stats.outputs, stats.summary
            if summary is None:
                raise RuntimeError("the benchmark's models end in their classifier: every batch has a dropout summary")
            wrong.append((outputs.argmax(1) != y[rows]).float())
            summaries.append(summary)
        resets += learner.adapter.resets if reset_each and learner.adapter is not None else 0
    if not reset_each and learner.adapter is not None:
        resets = learner.adapter.resets
    return torch.cat(wrong), resets, torch.cat(summaries)


def estimate_windows(wrong: torch.Tensor, summaries: torch.Tensor, window: int) -> dict[str, Any]:
    """AETTA's estimate against the true accuracy over consecutive windows of ``window`` rows: both per window,
    their mean absolute error and their correlation (None over fewer than 3 windows or a constant side)."""
    n = len(wrong) // window
    true = [1.0 - float(wrong[i * window : (i + 1) * window].mean()) for i in range(n)]
    estimated = [aetta_accuracy(summaries[i * window : (i + 1) * window].cpu().numpy()) for i in range(n)]
    mae = sum(abs(e - t) for e, t in zip(estimated, true)) / max(n, 1)
    pair = torch.tensor([estimated, true], dtype=torch.float64)
    corr = float(torch.corrcoef(pair)[0, 1]) if n >= 3 and bool((pair.std(dim=1) > 0).all()) else None
    return {"estimated": estimated, "true": true, "mae": mae, "corr": corr}


def run_device_stream(
    model: nn.Module, state: dict[str, torch.Tensor], method: str, stream: Stream, *, batch_size: int, lr: float
) -> tuple[torch.Tensor, int]:
    """:func:`run_stream` for ``method`` exported to the ONNX engine and adapted there, torch-free."""
    from taste_cl.adapters.onnx_engine.adapt_export import export_adapter
    from taste_cl.adapters.onnx_engine.learner import load_adapter

    model.load_state_dict(state)
    adapter = make_adapter(method, lr)
    wrong: list[torch.Tensor] = []
    with tempfile.TemporaryDirectory() as folder:
        device = load_adapter(export_adapter(model, torch.zeros(max(batch_size, 2), *stream[0][0].shape[1:]), folder, adapter))
        for x, y in stream:
            for rows in torch.arange(len(y)).split(batch_size):
                outputs = device.adapt(x[rows].numpy()).outputs
                wrong.append(torch.from_numpy(outputs.argmax(1) != y[rows].numpy()).float())
    return torch.cat(wrong), device.resets


def sequence_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The recorded JapaneseVowels (equal-length version, standardised): train rows, test rows in the
    archive's order (sorted by class), and the class count."""
    from taste_cl.recorded import load_recorded

    data = load_recorded("JapaneseVowels_eq", standardize=True)
    as_tensors = lambda split: (torch.from_numpy(split.x).float(), torch.from_numpy(split.y).long())  # noqa: E731
    return (*as_tensors(data.train), *as_tensors(data.test), data.n_classes)


def bn_cnn_1d(channels: int, classes: int, seed: int) -> nn.Module:
    """Two Conv1d-BatchNorm-ReLU blocks, global average pooling over time and a linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv1d(channels, 32, 5, padding=2, bias=False),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Conv1d(32, 32, 3, padding=1, bias=False),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def run_settings(
    model: nn.Module, settings: list[tuple[str, Stream, int, bool]], *, lr: float, progress: bool, desc: str
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]], dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]]]:
    """Every method of :data:`METHOD_NAMES` on every ``(name, stream, batch size, reset each)`` setting, from the
    model's current weights: mean errors, guard resets, per-row mistakes and AETTA's estimate against the true
    accuracy (:func:`estimate_windows`: windows of 1000 rows on the long streams, one corruption's rows elsewhere),
    by setting and method."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    errors: dict[str, dict[str, float]] = {}
    resets: dict[str, dict[str, int]] = {}
    wrongs: dict[str, dict[str, torch.Tensor]] = {}
    estimates: dict[str, dict[str, Any]] = {}
    table = {setting: (stream, batch, reset_each) for setting, stream, batch, reset_each in settings}
    jobs = [(setting, method) for setting in table for method in METHOD_NAMES]
    for setting, method in progress_bar(jobs, enabled=progress, desc=desc):
        stream, batch, reset_each = table[setting]
        wrong, count, summaries = run_stream(model, state, method, stream, batch_size=batch, lr=lr, reset_each=reset_each)
        errors.setdefault(setting, {})[method] = float(wrong.mean())
        resets.setdefault(setting, {})[method] = count
        wrongs.setdefault(setting, {})[method] = wrong
        window = 1000 if setting.startswith("long") else len(stream[0][1])
        estimates.setdefault(setting, {})[method] = estimate_windows(wrong, summaries, window)
    model.load_state_dict(state)
    return errors, resets, wrongs, estimates


def print_estimates(estimates: dict[str, dict[str, Any]]) -> None:
    """The estimate's mean absolute error and correlation against the true accuracy, per setting and method."""
    print("label-free accuracy estimate (AETTA) against the true accuracy per window: mean absolute error / correlation")
    cell = lambda e: f"{e['mae']:.3f} / " + ("n/a" if e["corr"] is None else f"{e['corr']:+.2f}")  # noqa: E731
    print(format_table(["setting", *METHOD_NAMES], [[setting, *(cell(by[m]) for m in METHOD_NAMES)] for setting, by in estimates.items()]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser("adapt", __doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-3, help="TENT's and EATA's learning rate (Adam)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 4, 1], help="batch sizes of the continual setting")
    parser.add_argument(
        "--long-batch-sizes", type=int, nargs="+", default=[16, 4], help="batch sizes of the long recurring stream (4: where TENT collapses)"
    )
    parser.add_argument("--long-samples", type=int, default=20_000, help="rows in the long recurring stream (a multiple of 1000)")
    parser.add_argument("--epochs", type=int, default=15, help="pretraining epochs of the source model")
    parser.add_argument("--no-sequences", action="store_true", help="skip the recorded sequence data (JapaneseVowels, needs aeon)")
    parser.add_argument("--no-device", action="store_true", help="skip the torch-free ONNX engine rows (need onnx and onnxruntime)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rows, batch 64 only, a 2000-row long stream at batch 4")
    args = parse(parser, argv)
    for flag in ("batch_sizes", "long_batch_sizes"):
        if min(getattr(args, flag)) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    # at batch size 1 every adapter warns once that BatchNorm keeps its running statistics: said once here instead
    warnings.filterwarnings("ignore", category=AdaptationWarning)
    if args.quick:
        args.batch_sizes, args.long_batch_sizes, args.long_samples, args.epochs = [64], [4], 2000, 3
    if 1 in args.batch_sizes:
        print("batch size 1: below min_batch=2 no method adapts (BatchNorm keeps its running statistics, TENT and EATA take no step)")
    if args.long_samples < 1000 or args.long_samples % 1000:
        parser.error(f"--long-samples must be a positive multiple of 1000; got {args.long_samples}")
    progress = not args.no_progress
    train_x, train_y, test_x, test_y = digits_images(args.seed)
    if args.quick:
        test_x, test_y = test_x[:200], test_y[:200]
    model = bn_cnn(args.seed)
    pretrain(model, train_x, train_y, epochs=args.epochs, seed=args.seed)
    with torch.no_grad():
        clean_error = float((model(test_x).argmax(1) != test_y).float().mean())
    names = list(IMAGE_CORRUPTIONS)
    episodic = [(corrupt(test_x, name, s, seed=10 * i + s), test_y) for i, name in enumerate(names) for s in SEVERITIES]
    continual = [(corrupt(test_x, name, 5, seed=i), test_y) for i, name in enumerate(names)]
    long_stream = _long_stream(test_x, test_y, args.long_samples, seed=args.seed)
    settings = [("episodic", episodic, 64, True)] + [(f"continual bs={b}", continual, b, False) for b in args.batch_sizes]
    settings += [(f"long bs={b}", long_stream, b, False) for b in args.long_batch_sizes]
    start = time.perf_counter()
    errors, resets, wrongs, estimates = run_settings(model, settings, lr=args.lr, progress=progress, desc="adapt")
    seconds = {"images": time.perf_counter() - start}
    windows = {
        setting: {m: w.view(-1, 1000).mean(dim=1).tolist() for m, w in wrongs[setting].items()} for setting in wrongs if setting.startswith("long")
    }
    worst = {setting: {m: max(a - s for a, s in zip(w[m], w["source"])) for m in METHOD_NAMES if m != "source"} for setting, w in windows.items()}
    worse = {setting: {m: sum(a - s > 0.01 for a, s in zip(w[m], w["source"])) for m in worst[setting]} for setting, w in windows.items()}
    print(f"clean error of the source model: {clean_error:.3f}; mean error per setting (lower is better), lr {args.lr}:")
    print(format_table(["setting", *METHOD_NAMES], [[setting, *(errors[setting][m] for m in METHOD_NAMES)] for setting in errors]))
    print(f"long stream, {args.long_samples} rows: worst 1000-row window minus the source's on the same rows")
    rows = [[setting, m, worst[setting][m], worse[setting][m], resets[setting][m]] for setting in worst for m in worst[setting]]
    print(format_table(["setting", "method", "worst window vs source", "windows worse by > 1 point", "guard resets"], rows))
    print_estimates(estimates)
    sequences: dict[str, Any] = {}
    if not args.no_sequences:
        start = time.perf_counter()
        sequences = _sequences(args, progress)
        seconds["sequences"] = time.perf_counter() - start
    device: dict[str, dict[str, float]] = {}
    gaps: dict[str, dict[str, float]] = {}
    if not args.no_device:
        device, gaps = _device_rows(model, continual, errors, args, progress)
    adapter = TestTimeAdapter()
    adapter.bind(model)
    print(f"guard anchor: {adapter.anchor_bytes} bytes; a frozen model copy: {adapter.model_copy_bytes} bytes")
    summary = _summary(errors, worst, gaps, sequences)
    save_result(
        args.out,
        "adapt",
        {
            "lr": args.lr,
            "default": DEFAULT,
            "clean_error": clean_error,
            "errors": errors,
            "resets": resets,
            "long_windows": windows,
            "worst_window_vs_source": worst,
            "windows_worse_by_1_point": worse,
            "estimates": estimates,
            "sequences": sequences,
            "device_errors": device,
            "device_gap_points": gaps,
            "seconds": seconds,
            "anchor_bytes": adapter.anchor_bytes,
            "model_copy_bytes": adapter.model_copy_bytes,
        },
        summary=summary,
    )
    return 0


def _sequences(args: Any, progress: bool) -> dict[str, Any]:
    """The sequence settings (see the module): pretrain the 1-D CNN, run every method, print and return the errors."""
    train_x, train_y, test_x, test_y, classes = sequence_data()
    model = bn_cnn_1d(train_x.shape[1], classes, args.seed)
    pretrain(model, train_x, train_y, epochs=2 * args.epochs, seed=args.seed)
    with torch.no_grad():
        clean_error = float((model(test_x).argmax(1) != test_y).float().mean())
    order = torch.randperm(len(test_y), generator=torch.Generator().manual_seed(args.seed))
    streams = {
        kind: [(corrupt(x, name, 5, seed=i), y) for i, name in enumerate(SEQUENCE_CORRUPTIONS)]
        for kind, (x, y) in {"shuffled": (test_x[order], test_y[order]), "class-sorted": (test_x, test_y)}.items()
    }
    settings = [(f"continual bs={b}", streams["shuffled"], b, False) for b in args.batch_sizes]
    settings += [(f"class-sorted bs={b}", streams["class-sorted"], b, False) for b in sorted({64, 4} & set(args.batch_sizes), reverse=True)]
    errors, resets, _, estimates = run_settings(model, settings, lr=args.lr, progress=progress, desc="adapt sequences")
    print(f"sequences (JapaneseVowels, {', '.join(SEQUENCE_CORRUPTIONS)} at severity 5): clean error {clean_error:.3f}; mean error:")
    print(format_table(["setting", *METHOD_NAMES], [[setting, *(errors[setting][m] for m in METHOD_NAMES)] for setting in errors]))
    print_estimates(estimates)
    return {"clean_error": clean_error, "errors": errors, "resets": resets, "estimates": estimates}


def _device_rows(
    model: nn.Module, continual: Stream, errors: dict[str, dict[str, float]], args: Any, progress: bool
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """The continual setting on the torch-free ONNX engine beside torch's: device errors and gaps in points."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    device: dict[str, dict[str, float]] = {}
    jobs = [(f"continual bs={b}", b, m) for b in args.batch_sizes for m in DEVICE_METHODS]
    for setting, batch, method in progress_bar(jobs, enabled=progress, desc="adapt on the device"):
        wrong, _ = run_device_stream(model, state, method, continual, batch_size=batch, lr=args.lr)
        device.setdefault(setting, {})[method] = float(wrong.mean())
    model.load_state_dict(state)
    gaps = {setting: {m: 100 * (device[setting][m] - errors[setting][m]) for m in DEVICE_METHODS} for setting in device}
    print("torch-free ONNX engine against torch, continual setting (gap in points of error):")
    rows = [[setting, m, errors[setting][m], device[setting][m], gaps[setting][m]] for setting in device for m in DEVICE_METHODS]
    print(format_table(["setting", "method", "torch", "device", "gap (points)"], rows))
    return device, gaps


def _summary(
    errors: dict[str, dict[str, float]], worst: dict[str, dict[str, float]], gaps: dict[str, dict[str, float]], sequences: dict[str, Any]
) -> str:
    """One line: the continual errors at batch 64, each long stream's worst window, the device gap."""
    nan = float("nan")
    c64 = errors.get("continual bs=64", {})
    parts = [
        "continual severity 5, bs 64: " + ", ".join(f"{m} {c64.get(m, nan):.3f}" for m in ("source", "bn", "tent", DEFAULT)),
        *(f"{setting} worst window vs source: tent {w['tent']:+.3f}, {DEFAULT} {w[DEFAULT]:+.3f}" for setting, w in worst.items()),
    ]
    if sequences:
        s64 = sequences["errors"].get("continual bs=64", {})
        parts.append("sequences bs 64: " + ", ".join(f"{m} {s64.get(m, nan):.3f}" for m in ("source", "bn", "tent", DEFAULT)))
    if gaps:
        parts.append("device gap at bs 64 (points): " + ", ".join(f"{m} {gaps.get('continual bs=64', {}).get(m, nan):+.2f}" for m in DEVICE_METHODS))
    return "; ".join(parts)


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
