"""Recorded data: class-incremental streams against Avalanche, the offline bound, and enrolling a new class.

Datasets people recorded, bundled inside aeon's wheel (:mod:`taste_cl.recorded`; nothing is
downloaded; extra ``[real]``, and ``[avalanche]``, ``[onnx]``): by default JapaneseVowels (9
speakers, 12 LPC channels, 7-29 steps), BasicMotions (4 activities, 6 wrist IMU channels),
PickupGestureWiimoteZ (10 subjects' pick-up gesture, 29-361 steps) and OSULeaf (6 leaf
species, outlines of 427 points). Every channel is standardized with the training split's
statistics; variable-length series are zero-padded and the mask travels as the input's last
channel (:meth:`~taste_cl.recorded.RecordedSplit.with_mask_channel`). Two networks written for
this: ``cnn``, three 1-D convs (32 channels, kernels 7/5/3, inputs and activations multiplied
by the mask) and masked global average pooling; ``gru``, a GRU (64 units) over the series
average-pooled to at most 64 steps, read at each series' last recorded step.

Part 1, class-incremental streams. Seeded class orders (``--seeds``, 5 by default, seed s
permutes the classes with ``numpy.random.default_rng(s)``), ``CLASSES_PER_TASK`` new classes
per task, one pass in batches of 10 (Avalanche ``split_online_stream``, the same batches
for both libraries). Both libraries, at equal compute: SGD lr ``--lr``, ``--iterations``
steps per stream batch (taste_cl ``train_iterations``, Avalanche ``train_epochs`` on each
experience of 10), each over the 10 stream samples plus 10 replayed ones from a
class-balanced buffer of ``--capacity`` (taste_cl ``ClassBalancedReplay``, Avalanche
``ClassBalancedBuffer``). Strategies: replay (taste_cl ``ExperienceReplay``; Avalanche
``Naive`` + ``ReplayPlugin``), ER-ACE (``ERACE`` / ``ER_ACE``), DER++ (``DERPlusPlus`` /
``DER``, alpha 0.5, beta 2 as in ``bench strategies``) and LwF (no buffer; alpha 1,
temperature 2; Avalanche's online LwF snapshots the model after every experience, that is
every stream batch, so taste_cl's runs ``LwF(every=1)`` to match). Reported: final accuracy
on all test data, forgetting (mean over tasks of best minus final accuracy), training
seconds (training calls only: evaluation at task ends is excluded) and Avalanche's
seconds over taste_cl's (``x faster``). Means over seeds.

Beside them, a **bare torch loop** (:func:`run_bare`) on the same batches: the same number of
SGD steps per batch on the same number of rows (the batch plus 10 drawn from a plain
reservoir of ``--capacity``; without a buffer for LwF), plain cross-entropy, nothing else: no
validation, update guard, monitor, strategy or class balancing. ``ceiling`` is Avalanche's
seconds over the bare loop's, the most that any library's ``x faster`` could reach on that
stream: on these small networks most of every library's time is the network's own forward and
backward passes, so ``x faster`` is read against ``ceiling``, not against a fixed 3x.

Part 2, the offline bound: the same networks trained i.i.d. on all training data (AdamW
3e-3, ``--offline-epochs`` epochs of batches of 16), aeon's ``MultiRocketHydraClassifier``
(the strongest of aeon's convolution classifiers that trains here within a minute per
dataset; fed the same padded, standardized arrays), and the archive's published accuracy
(``PUBLISHED``, with its source).

Part 3, enrolling a new class (a new speaker, gesture, activity, leaf) on a pretrained
network: per seed, the last class of the seed's order is held out; the network is
pretrained i.i.d. on the others (as in part 2), wrapped in an ``OnlineLearner`` and then
observes ``--enrol-samples`` recordings of the new class (at most all its training
recordings) in batches of 5. The learner: SGD ``--enrol-lr`` (0.05) on every layer
(``--enrol-train all``; ``head`` trains the classifier only), ``--enrol-iterations`` (30) steps
per batch, each over the 5 new recordings plus 20 replayed from a reservoir of ``--capacity``
filled with the pretraining data (a policy every device backend keeps). Why these defaults:
the new class's output starts untrained, below the old classes', and 2 batches of 10 steps at
lr 0.005 (the first defaults) did not lift it past them: the GRU learned the new class on no
dataset, nor the CNN on BasicMotions. A grid on JapaneseVowels and
BasicMotions (lr 0.005-0.2, 10 or 30 steps, head or all layers, 10/20/40 replayed, reservoir or
class-balanced; 3 seeds, torch learner) found lr 0.05 with 30 steps on every layer the one
setting that learns the new class on both datasets and both networks (new-class accuracy
0.84-1.00) while keeping the old ones (retention 0.86-1.00; the GRU on BasicMotions, whose
pretraining reaches only 0.67-0.87 on the old classes, is the low end); training the head alone
lost more of the old classes on BasicMotions' CNN (0.81), 20 replayed rows per step was the best
compromise (10 kept less of the old classes on BasicMotions' GRU, 0.55; 40 less on its CNN,
0.88), and a class-balanced buffer changed little.

The same learner is exported before enrolment with ``learner.export(folder,
backend=--device-backend)``, by default ``"onnx_engine"``: standard ONNX graphs that plain
``onnxruntime`` runs, loaded torch-free with
:func:`~taste_cl.adapters.device.load_learner` as an
:class:`~taste_cl.adapters.onnx_engine.learner.OnnxEngineLearner`
(``"onnxruntime"``, ONNX Runtime's training artifacts, is the older device learner); it observes
the same batches. Both learners draw their replayed rows from generators seeded alike: where
the draws coincide they agree to float rounding, otherwise different replayed rows alone
make them differ by a point or two, and so can float rounding amplified over 60 steps at
lr 0.05. Reported: the new class's test accuracy (before: 0, its output
never trained), retention (old classes' accuracy after / before), accuracy on all test data,
seconds per observe, the export's seconds, and whether the device is within 1 point of torch on
all test data (or 2 test samples where 1 point is fewer). An export refusal is reported with
its message.

Cost: the export of the GRU is the slowest step of the run (tens of seconds per seed:
``torch.onnx`` traces and optimizes the GRU's unrolled steps; the CNN takes a few seconds);
``--no-device`` skips it.

Writes a table per dataset, ``real.json`` and ``real.png`` (accuracy over the stream for
each strategy, offline bounds as lines; with the ``plot`` extra).
Run: ``taste-cl bench real [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from taste_cl.benchmarks._common import base_parser, parse, progress_bar, save_result
from taste_cl.datasets import Task
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import average_forgetting
from taste_cl.plotting import PLOT_HINT, plotting_available, pyplot, save_figure
from taste_cl.recorded import RecordedDataset, class_incremental_tasks, class_order, load_recorded
from taste_cl.replay import ClassBalancedReplay, ReservoirReplay
from taste_cl.report import format_number, format_table
from taste_cl.strategies import ERACE, DERPlusPlus, ExperienceReplay, LwF, Strategy

__all__ = ["CLASSES_PER_TASK", "PUBLISHED", "MaskedCNN", "MaskedGRU", "build_model", "enrol", "main", "offline_network", "run_stream"]

DATASETS = ("JapaneseVowels", "BasicMotions", "PickupGestureWiimoteZ", "OSULeaf")
CLASSES_PER_TASK = {"JapaneseVowels": 3, "BasicMotions": 2, "PickupGestureWiimoteZ": 2, "OSULeaf": 2, "ACSF1": 2}
BATCH = 10
ENROL_BATCH = 5
ENROL_REPLAY = 20  # replayed samples per enrolment step
ENROL_LR, ENROL_ITERATIONS = 0.05, 30  # the enrolment's defaults (see the module's part 3)
DEVICE_BACKENDS = {"onnx_engine": "onnx_engine (plain onnxruntime)", "onnxruntime": "ONNX Runtime training"}
ALPHA, BETA = 0.5, 2.0  # DER++ weights, both libraries (as in `bench strategies`)
GRU_STEPS = 64  # the GRU reads the series average-pooled to at most this many steps
STRATEGIES = ("replay", "ER-ACE", "DER++", "LwF")
MODELS = ("cnn", "gru")

# The archive's published accuracy on each dataset's default train/test split, hard-coded (no download).
# Source: timeseriesclassification.com (the UEA & UCR Time Series Classification Repository).
#  - ACSF1, OSULeaf: HIVE-COTE 2 (HC2), resample 0 (the default split), Middlehurst et al., "HIVE-COTE 2.0",
#    Machine Learning 110, 2021; the same figures ship in aeon's wheel
#    (aeon/testing/example_results_files/classification/accuracy/HC2_accuracy.csv).
#  - BasicMotions, JapaneseVowels: the dependent-DTW 1-NN benchmark (DTW_D) of Bagnall et al., "The UEA multivariate
#    time series classification archive, 2018", arXiv:1811.00075, Table 3.
#  - PickupGestureWiimoteZ: no published figure is available offline here (None).
PUBLISHED: dict[str, tuple[float | None, str]] = {
    "ACSF1": (0.91, "HC2, timeseriesclassification.com (Middlehurst et al. 2021)"),
    "OSULeaf": (0.9669, "HC2, timeseriesclassification.com (Middlehurst et al. 2021)"),
    "BasicMotions": (0.975, "1-NN DTW_D, UEA MTSC archive paper (Bagnall et al. 2018)"),
    "JapaneseVowels": (0.949, "1-NN DTW_D, UEA MTSC archive paper (Bagnall et al. 2018)"),
    "PickupGestureWiimoteZ": (None, "no published figure available offline"),
}


class MaskedCNN(nn.Module):
    """Three 1-D convs and masked global average pooling; the input's last channel is the mask."""

    def __init__(self, channels: int, n_classes: int, width: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, width, 7, padding=3)
        self.conv2 = nn.Conv1d(width, width, 5, padding=2)
        self.conv3 = nn.Conv1d(width, width, 3, padding=1)
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, mask = x[:, :-1], x[:, -1:]
        h = F.relu(self.conv1(values * mask)) * mask
        h = F.relu(self.conv2(h)) * mask
        h = F.relu(self.conv3(h)) * mask
        return self.head(h.sum(-1) / mask.sum(-1).clamp_min(1.0))


class MaskedGRU(nn.Module):
    """A GRU over the series average-pooled by ``pool``, read at each series' last recorded (pooled) step."""

    def __init__(self, channels: int, n_classes: int, length: int, hidden: int = 64) -> None:
        super().__init__()
        self.pool = max(1, math.ceil(length / GRU_STEPS))
        self.gru = nn.GRU(channels, hidden, batch_first=True)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, mask = x[:, :-1], x[:, -1:]
        if self.pool > 1:
            values = F.avg_pool1d(values, self.pool, ceil_mode=True)
            mask = F.max_pool1d(mask, self.pool, ceil_mode=True)
        out, _ = self.gru(values.transpose(1, 2))
        last = (mask[:, 0].sum(-1).long() - 1).clamp_min(0)
        return self.head(out.gather(1, last[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0])


def build_model(kind: str, dataset: RecordedDataset, seed: int) -> nn.Module:
    """``kind`` (``"cnn"`` or ``"gru"``) for ``dataset``, initialised from ``seed`` (the global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "cnn":
            return MaskedCNN(dataset.n_channels, dataset.n_classes)
        if kind == "gru":
            return MaskedGRU(dataset.n_channels, dataset.n_classes, dataset.length)
    raise ValueError(f"`kind == {kind!r}`, must be one of {list(MODELS)}")


def _predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(chunk) for chunk in x.split(256)])
    model.train(was_training)
    return out


def _accuracy(outputs: Any, y: torch.Tensor) -> float:
    return float((torch.as_tensor(np.asarray(outputs)).argmax(1) == y).float().mean()) if y.numel() else float("nan")


# ----------------------------------------------------------------- part 1: streams
@dataclass
class StreamRun:
    """One strategy on one seed's stream."""

    final_accuracy: float
    forgetting: float
    train_seconds: float
    samples: int
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, accuracy on the classes seen) at task ends


def _drive(
    train: Callable[[Any], object],
    predict: Callable[[torch.Tensor], torch.Tensor],
    payloads: Sequence[Any],
    batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    tasks: Sequence[Task],
) -> StreamRun:
    """Feed ``payloads`` (one per stream batch) to ``train``; evaluate at every task end, outside the timing."""
    x_all = torch.cat([t.x_test for t in tasks])
    y_all = torch.cat([t.y_test for t in tasks])
    owner = torch.cat([torch.full((t.y_test.shape[0],), i) for i, t in enumerate(tasks)])

    def evaluate(upto: int) -> tuple[list[float], float]:
        right = predict(x_all).argmax(1) == y_all
        seen = owner <= upto
        return [float(right[owner == i].float().mean()) for i in range(len(tasks))], float(right[seen].float().mean())

    matrix: list[list[float]] = []
    curve: list[tuple[int, float]] = []
    seconds, seen = 0.0, 0
    for step, (payload, (task, _, y)) in enumerate(zip(payloads, batches)):
        begin = time.perf_counter()
        train(payload)
        seconds += time.perf_counter() - begin
        seen += int(y.shape[0])
        if step + 1 == len(batches) or batches[step + 1][0] != task:
            row, on_seen = evaluate(task)
            matrix.append(row)
            curve.append((seen, on_seen))
    return StreamRun(curve[-1][1], average_forgetting(matrix), seconds, seen, curve)


def _bare_reference(strategy: str) -> str:
    """The bare loop a strategy's time is compared with: with replay, or without a buffer (LwF)."""
    return "no buffer" if strategy == "LwF" else "replay"


def _taste_strategy(name: str) -> Strategy:
    return {"replay": ExperienceReplay, "ER-ACE": ERACE, "DER++": lambda: DERPlusPlus(ALPHA, BETA),
            "LwF": lambda: LwF(every=1, on_drift=False)}[name]()  # fmt: skip


def run_taste(name: str, model: nn.Module, batches: Sequence[Any], tasks: Sequence[Task], args: argparse.Namespace, seed: int) -> StreamRun:
    learner = OnlineLearner(
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=args.lr),
        replay=None if name == "LwF" else ClassBalancedReplay(args.capacity, seed=seed),
        replay_batch_size=BATCH,
        train_iterations=args.iterations,
        strategy=_taste_strategy(name),
    )
    return _drive(learner.observe, learner.predict, [(x, y) for _, x, y in batches], batches, tasks)


def run_avalanche(
    name: str, model: nn.Module, experiences: Sequence[Any], batches: Sequence[Any], tasks: Sequence[Task], args: argparse.Namespace
) -> StreamRun:
    from avalanche.training import DER, ER_ACE, LwF, Naive
    from avalanche.training.plugins import EvaluationPlugin, ReplayPlugin
    from avalanche.training.storage_policy import ClassBalancedBuffer

    common: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=args.lr),
        "criterion": nn.CrossEntropyLoss(),
        "train_mb_size": BATCH,
        "train_epochs": args.iterations,
        "eval_mb_size": 256,
        "evaluator": EvaluationPlugin(),  # no metrics or loggers: evaluation is this module's, the same for both libraries
    }
    memory = {"mem_size": args.capacity, "batch_size_mem": BATCH}
    strategy: Any
    if name == "replay":
        plugin = ReplayPlugin(mem_size=args.capacity, batch_size=BATCH, batch_size_mem=BATCH, storage_policy=ClassBalancedBuffer(args.capacity))
        strategy = Naive(plugins=[plugin], **common)
    elif name == "ER-ACE":
        strategy = ER_ACE(**memory, **common)
    elif name == "DER++":
        strategy = DER(alpha=ALPHA, beta=BETA, **memory, **common)
    else:
        strategy = LwF(alpha=1.0, temperature=2.0, **common)
    shown = warnings.showwarning
    warnings.showwarning = lambda *a, **k: None  # Avalanche re-enables its deprecation warnings on every call
    try:
        return _drive(strategy.train, lambda x: _predict(model, x), experiences, batches, tasks)
    finally:
        warnings.showwarning = shown


def run_bare(model: nn.Module, batches: Sequence[Any], tasks: Sequence[Task], args: argparse.Namespace, seed: int, *, replay: bool) -> StreamRun:
    """The reference loop: per stream batch, ``--iterations`` SGD steps (lr ``--lr``, plain cross-entropy) on the batch
    and (``replay``) ``BATCH`` rows drawn uniformly from a reservoir of ``--capacity``, as both libraries' replay;
    no validation, guard, monitor or strategy. What any library's loop costs at least on this stream."""
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x0 = batches[0][1]
    store_x, store_y = torch.empty((args.capacity, *x0.shape[1:]), dtype=x0.dtype), torch.empty(args.capacity, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    held = seen = 0
    model.train()

    def train(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        nonlocal held, seen
        x, y = batch
        for _ in range(args.iterations):
            if replay and held:
                rows = torch.randint(held, (BATCH,), generator=generator)
                x_step, y_step = torch.cat([x, store_x[rows]]), torch.cat([y, store_y[rows]])
            else:
                x_step, y_step = x, y
            loss = F.cross_entropy(model(x_step), y_step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if replay:
            for i in range(y.shape[0]):  # reservoir sampling, row by row
                seen += 1
                slot = held if held < args.capacity else int(torch.randint(seen, (1,), generator=generator))
                if slot < args.capacity:
                    store_x[slot], store_y[slot] = x[i], y[i]
                    held = max(held, slot + 1)

    return _drive(train, lambda x: _predict(model, x), [(x, y) for _, x, y in batches], batches, tasks)


def run_stream(dataset: RecordedDataset, kind: str, seed: int, args: argparse.Namespace) -> dict[str, dict[str, StreamRun]]:
    """Every strategy of both libraries on one seed's stream, and the bare reference loop with and without replay:
    ``{"taste_cl"|"avalanche": {strategy: run}, "bare": {"replay"|"no buffer": run}}``."""
    from avalanche.benchmarks.scenarios.online import split_online_stream

    from taste_cl.adapters.avalanche import benchmark_from_tasks, experience_tensors

    tasks = class_incremental_tasks(dataset, CLASSES_PER_TASK.get(dataset.name, 2), seed=seed)
    benchmark = benchmark_from_tasks(tasks)

    def online() -> list[Any]:
        return list(split_online_stream(benchmark.train_stream, BATCH, shuffle=True, seed=seed))

    batches = [(e.origin_experience.current_experience, *experience_tensors(e)) for e in online()]
    runs: dict[str, dict[str, StreamRun]] = {"taste_cl": {}, "avalanche": {}, "bare": {}}
    for name in args.strategies:
        gc.collect()
        runs["taste_cl"][name] = run_taste(name, build_model(kind, dataset, seed), batches, tasks, args, seed)
        if not args.no_avalanche:
            gc.collect()
            runs["avalanche"][name] = run_avalanche(name, build_model(kind, dataset, seed), online(), batches, tasks, args)
    for reference in sorted({_bare_reference(name) for name in args.strategies}):  # last: the process is warm, as for the others
        gc.collect()
        runs["bare"][reference] = run_bare(build_model(kind, dataset, seed), batches, tasks, args, seed, replay=reference == "replay")
    return runs


# ----------------------------------------------------------------- part 2: offline bound
def train_offline(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int) -> float:
    """AdamW 3e-3 (weight decay 1e-2), batches of 16, ``epochs`` shuffled passes; returns the seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    begin = time.perf_counter()
    for _ in range(epochs):
        for rows in torch.randperm(y.shape[0], generator=generator).split(16):
            loss = F.cross_entropy(model(x[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return time.perf_counter() - begin


def offline_network(dataset: RecordedDataset, kind: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """``kind`` trained i.i.d. on all training data: test accuracy and training seconds."""
    model = build_model(kind, dataset, seed)
    x, y = torch.from_numpy(dataset.train.with_mask_channel()), torch.from_numpy(dataset.train.y)
    seconds = train_offline(model, x, y, epochs=args.offline_epochs, seed=seed)
    accuracy = _accuracy(_predict(model, torch.from_numpy(dataset.test.with_mask_channel())), torch.from_numpy(dataset.test.y))
    return {"accuracy": accuracy, "train_seconds": seconds}


def offline_aeon(dataset: RecordedDataset, seed: int) -> dict[str, Any]:
    """aeon's MultiRocketHydraClassifier on the padded, standardized arrays (one job): accuracy and seconds.

    It sets torch's intra-op threads (to 2 here, whatever ``n_jobs``) and reseeds torch's global generator; both are
    put back afterwards, or every later stream and enrolment of the run would time torch on those threads instead of
    ``--threads``, and draw differently with and without ``--no-aeon``."""
    from aeon.classification.convolution_based import MultiRocketHydraClassifier

    threads = torch.get_num_threads()
    begin = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]):
            classifier = MultiRocketHydraClassifier(random_state=seed, n_jobs=1)
            classifier.fit(dataset.train.x.astype(np.float64), dataset.train.y)
            predicted = classifier.predict(dataset.test.x.astype(np.float64))
    finally:
        torch.set_num_threads(threads)
    return {"classifier": "MultiRocketHydraClassifier", "accuracy": float((predicted == dataset.test.y).mean()),
            "seconds": time.perf_counter() - begin}  # fmt: skip


# ----------------------------------------------------------------- part 3: enrolling a new class
def _enrol_data(dataset: RecordedDataset, seed: int, n: int) -> tuple[int, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    new = class_order(dataset.n_classes, seed)[-1]
    x = torch.from_numpy(dataset.train.with_mask_channel())
    y = torch.from_numpy(dataset.train.y)
    old = y != new
    rows = torch.nonzero(~old)[:, 0]
    rows = rows[torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(seed))[:n]]
    batches = [(x[r], y[r]) for r in rows.split(ENROL_BATCH)]
    return new, x[old], y[old], batches


def _scores(outputs: Any, y: torch.Tensor, new: int) -> dict[str, float]:
    return {"new_class": _accuracy(outputs[(y == new).numpy()], y[y == new]), "old_classes": _accuracy(outputs[(y != new).numpy()], y[y != new]),
            "all": _accuracy(outputs, y)}  # fmt: skip


def _timed(call: Callable[[Any], object], argument: Any) -> float:
    begin = time.perf_counter()
    call(argument)
    return time.perf_counter() - begin


def _export(learner: OnlineLearner, folder: Path, backend: str) -> str | None:
    """Export ``learner`` for ``backend``; None, or the refusal's type and message."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            learner.export(folder, backend=backend)
    except Exception as error:  # noqa: BLE001 - any refusal is reported, with its message
        return f"{type(error).__name__}: {error}"
    return None


def enrol(dataset: RecordedDataset, kind: str, seed: int, args: argparse.Namespace, *, device: bool) -> dict[str, Any]:
    """Pretrain ``kind`` without one class, enrol it from a few recordings on the torch learner and
    (``device``) on the torch-free device learner of ``args.device_backend``, exported before enrolment."""
    new, x_old, y_old, batches = _enrol_data(dataset, seed, args.enrol_samples)
    model = build_model(kind, dataset, seed)
    train_offline(model, x_old, y_old, epochs=args.offline_epochs, seed=seed)
    x_test, y_test = torch.from_numpy(dataset.test.with_mask_channel()), torch.from_numpy(dataset.test.y)
    before = _scores(_predict(model, x_test).numpy(), y_test, new)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(args.enrol_train == "all" or name.startswith("head."))
    replay = ReservoirReplay(args.capacity, seed=seed)  # a policy every device backend keeps
    learner = OnlineLearner(
        model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.enrol_lr),
        replay=replay,
        replay_batch_size=ENROL_REPLAY,
        train_iterations=args.enrol_iterations,
        num_classes=dataset.n_classes,
        input_shape=tuple(x_test.shape[1:]),
    )
    replay.add(x_old, y_old)
    result: dict[str, Any] = {"new_class": dataset.class_names[new], "recordings": sum(int(b[1].numel()) for b in batches), "before": before}
    with tempfile.TemporaryDirectory(prefix="taste-real-") as work:
        artifacts = Path(work) / "artifacts"
        if device:
            begin = time.perf_counter()
            refusal = _export(learner, artifacts, args.device_backend)
            result["export_seconds"] = time.perf_counter() - begin
            if refusal is not None:
                result["device_refused"] = refusal
        seconds = [_timed(learner.observe, batch) for batch in batches]
        result["torch"] = {**_scores(learner.predict(x_test).numpy(), y_test, new), "seconds_per_observe": statistics.median(seconds)}
        if device and "device_refused" not in result:  # loaded after the torch learner's run: an idle session must not slow torch's timing
            from taste_cl.adapters.device import load_learner

            device_learner = load_learner(artifacts)
            device_seconds = [_timed(device_learner.observe, (x.numpy(), y.numpy())) for x, y in batches]
            outputs = np.concatenate([np.asarray(device_learner.predict(chunk.numpy())) for chunk in x_test.split(256)])
            result["device"] = {**_scores(outputs, y_test, new), "seconds_per_observe": statistics.median(device_seconds)}
    return result


# ----------------------------------------------------------------- summaries, tables, plot
def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else float("nan")


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize_streams(runs: list[dict[str, dict[str, StreamRun]]]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for library in ("taste_cl", "avalanche", "bare"):
        for name in runs[0].get(library, {}):
            found = [r[library][name] for r in runs]
            out.setdefault(library, {})[name] = {
                "final_accuracy": _mean([r.final_accuracy for r in found]),
                "final_accuracy_std": _std([r.final_accuracy for r in found]),
                "forgetting": _mean([r.forgetting for r in found]),
                "train_seconds": _mean([r.train_seconds for r in found]),
                "final_accuracy_runs": [r.final_accuracy for r in found],
                "train_seconds_runs": [r.train_seconds for r in found],
                "curve_seed0": found[0].curve,
            }
    return out


def speed_ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Per strategy: ``x_faster``, Avalanche's mean training seconds over taste_cl's, and ``ceiling``, Avalanche's over
    the bare loop's (:func:`run_bare`), the most any library's ``x_faster`` could be on this stream; None without Avalanche."""
    out: dict[str, dict[str, float | None]] = {}
    for name, mine in summary["taste_cl"].items():
        theirs = summary.get("avalanche", {}).get(name)
        bare = summary.get("bare", {}).get(_bare_reference(name))
        out[name] = {
            "x_faster": theirs["train_seconds"] / mine["train_seconds"] if theirs else None,
            "ceiling": theirs["train_seconds"] / bare["train_seconds"] if theirs and bare else None,
        }
    return out


def _stream_rows(kind: str, summary: dict[str, dict[str, dict[str, Any]]]) -> list[list[Any]]:
    rows = []
    ratios = speed_ratios(summary)
    for name, mine in summary["taste_cl"].items():
        other = summary.get("avalanche", {}).get(name) or {}
        bare = summary.get("bare", {}).get(_bare_reference(name)) or {}
        rows.append([kind, name, mine["final_accuracy"], other.get("final_accuracy"), mine["forgetting"], other.get("forgetting"),
                     mine["train_seconds"], other.get("train_seconds"), bare.get("train_seconds"), ratios[name]["x_faster"],
                     ratios[name]["ceiling"]])  # fmt: skip
    return rows


STREAM_HEADERS = ["model", "strategy", "acc taste_cl", "acc avalanche", "forget taste_cl", "forget avalanche", "train s taste_cl",
                  "train s avalanche", "train s bare", "x faster", "ceiling"]  # fmt: skip


def summarize_enrolment(found: list[dict[str, Any]], test_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"refused": sorted({r["device_refused"] for r in found if "device_refused" in r})}
    for side in ("torch", "device"):
        rows = [r[side] for r in found if side in r]
        if rows:
            out[side] = {key: _mean([r[key] for r in rows]) for key in ("new_class", "old_classes", "all", "seconds_per_observe")}
            out[side]["retention"] = _mean([r[side]["old_classes"] / r["before"]["old_classes"] for r in found if side in r])
    out["before_old_classes"] = _mean([r["before"]["old_classes"] for r in found])
    if any("export_seconds" in r for r in found):
        out["export_seconds"] = _mean([r["export_seconds"] for r in found if "export_seconds" in r])
    tolerance = max(0.01, 2 / test_size)
    out["tolerance"] = tolerance
    out["tolerance_rule"] = (
        "1 point" if tolerance == 0.01 else f"2 test samples ({100 * tolerance:.1f} points: 1 point is fewer than 2 of {test_size})"
    )
    if "torch" in out and "device" in out:
        paired = [r for r in found if "device" in r]
        gap = _mean([r["device"]["all"] - r["torch"]["all"] for r in paired])
        out["device_minus_torch_all"] = gap
        out["device_within_tolerance"] = abs(gap) <= tolerance + 1e-9
    return out


def _enrol_rows(kind: str, summary: dict[str, Any], backend: str) -> list[list[Any]]:
    rows = []
    for side, label in (("torch", "torch OnlineLearner"), ("device", f"device, {DEVICE_BACKENDS[backend]}")):
        if side in summary:
            s = summary[side]
            rows.append([kind, label, s["new_class"], s["retention"], s["all"], 1000 * s["seconds_per_observe"]])
        elif side == "device" and summary["refused"]:
            rows.append([kind, label + " (export refused)", None, None, None, None])
    return rows


def _plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for axis, name in zip(axes[0], names):
        streams = results[name]["streams"].get("cnn") or next(iter(results[name]["streams"].values()))
        for library in ("taste_cl", "avalanche"):
            for strategy, summary in streams.get(library, {}).items():
                seen, acc = zip(*summary["curve_seed0"])
                axis.plot(seen, acc, marker="o", label=f"{library} {strategy}", linestyle="--" if library == "avalanche" else "-")
        offline = results[name]["offline"]
        if "cnn" in offline.get("network", {}):
            axis.axhline(offline["network"]["cnn"]["accuracy"], color="black", linestyle=":", label="CNN offline i.i.d.")
        if "aeon" in offline:
            axis.axhline(offline["aeon"]["accuracy"], color="grey", linestyle="-.", label="MultiRocketHydra offline")
        axis.set(xlabel="samples seen", ylabel="accuracy on classes seen (CNN, seed 0)", ylim=(0, 1.02), title=name)
        axis.legend(fontsize=6)
    save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = base_parser("real", __doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), help="bundled datasets (taste_cl.recorded.bundled_datasets())")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="networks")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), help="strategies of both libraries")
    parser.add_argument("--seeds", type=int, default=5, help="seeds: class orders, models, buffers (seed s is --seed + s)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of the streams")
    parser.add_argument("--iterations", type=int, default=3, help="SGD steps per stream batch, both libraries")
    parser.add_argument("--capacity", type=int, default=100, help="replay buffer capacity (class-balanced), both libraries")
    parser.add_argument("--offline-epochs", type=int, default=30, help="epochs of i.i.d. training (offline bound and pretraining)")
    parser.add_argument("--enrol-samples", type=int, default=10, help="recordings of the new class (at most all of its training split)")
    parser.add_argument("--enrol-iterations", type=int, default=ENROL_ITERATIONS, help="SGD steps per enrolment batch of 5")
    parser.add_argument("--enrol-lr", type=float, default=ENROL_LR, help="SGD learning rate of the enrolment")
    parser.add_argument("--enrol-train", choices=("head", "all"), default="all", help="what enrolment trains: the classifier head or every layer")
    parser.add_argument("--device-backend", choices=list(DEVICE_BACKENDS), default="onnx_engine",
                        help="the device learner: the standard-ONNX engine (plain onnxruntime) or ONNX Runtime training")  # fmt: skip
    parser.add_argument("--no-avalanche", action="store_true", help="taste_cl's strategies only")
    parser.add_argument("--no-aeon", action="store_true", help="skip aeon's offline classifier")
    parser.add_argument("--no-device", action="store_true", help="skip the device learner")
    parser.add_argument("--quick", action="store_true", help="a smoke run: first dataset, 1 seed, CNN, replay and ER-ACE, few epochs, no aeon")
    args = parse(parser, argv)
    if args.quick:
        args.datasets, args.seeds, args.models, args.strategies = args.datasets[:1], 1, ["cnn"], ["replay", "ER-ACE"]
        args.offline_epochs, args.no_aeon = min(args.offline_epochs, 3), True
    for name, value in (("--seeds", args.seeds), ("--iterations", args.iterations), ("--capacity", args.capacity),
                        ("--offline-epochs", args.offline_epochs), ("--enrol-samples", args.enrol_samples),
                        ("--enrol-iterations", args.enrol_iterations)):  # fmt: skip
        if value < 1:
            parser.error(f"`{name} == {value}`, must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    warnings.filterwarnings("ignore", module="qpsolvers")
    warnings.filterwarnings("ignore", message="No loggers specified")
    start = time.perf_counter()
    seeds = [args.seed + s for s in range(args.seeds)]
    results: dict[str, Any] = {}
    for name in args.datasets:
        dataset = load_recorded(name, standardize=True)
        counts = dataset.class_counts()["train"]
        print(f"\n== {name}: {dataset.n_classes} classes, {len(dataset.train)} train / {len(dataset.test)} test, {dataset.n_channels} channels, "
              f"length {dataset.train.lengths.min()}-{dataset.length}, train samples per class "
              f"{min(counts.values())}-{max(counts.values())}")  # fmt: skip
        entry: dict[str, Any] = {"classes": dataset.n_classes, "train": len(dataset.train), "test": len(dataset.test),
                                 "classes_per_task": CLASSES_PER_TASK.get(name, 2), "class_counts": dataset.class_counts(),
                                 "variable_length": dataset.variable_length, "streams": {}, "speed": {}, "offline": {"network": {}},
                                 "enrolment": {}}  # fmt: skip
        rows: list[list[Any]] = []
        for kind in args.models:
            per_seed = [run_stream(dataset, kind, seed, args) for seed in progress_bar(seeds, enabled=not args.no_progress, desc=f"{name} {kind}")]
            entry["streams"][kind] = summarize_streams(per_seed)
            entry["speed"][kind] = speed_ratios(entry["streams"][kind])
            rows += _stream_rows(kind, entry["streams"][kind])
        print(f"class-incremental stream, {len(seeds)} seeds (mean), {entry['classes_per_task']} classes per task:")
        print(format_table(STREAM_HEADERS, rows))
        offline_rows: list[list[Any]] = []
        for kind in args.models:
            found = [offline_network(dataset, kind, seed, args) for seed in seeds]
            net = {"accuracy": _mean([f["accuracy"] for f in found]), "train_seconds": _mean([f["train_seconds"] for f in found])}
            entry["offline"]["network"][kind] = net
            best = max(entry["streams"][kind]["taste_cl"].items(), key=lambda item: item[1]["final_accuracy"])
            offline_rows.append(
                [
                    f"{kind}, i.i.d., {args.offline_epochs} epochs",
                    net["accuracy"],
                    f"best stream: {best[0]} {format_number(best[1]['final_accuracy'])}",
                ]
            )
        if not args.no_aeon:
            entry["offline"]["aeon"] = offline_aeon(dataset, args.seed)
            offline_rows.append(["aeon MultiRocketHydra", entry["offline"]["aeon"]["accuracy"], f"{entry['offline']['aeon']['seconds']:.0f} s"])
        published, source = PUBLISHED.get(name, (None, "not listed"))
        entry["offline"]["published"] = {"accuracy": published, "source": source}
        offline_rows.append(["published", published, source])
        print("offline bound:")
        print(format_table(["offline", "accuracy", "note"], offline_rows))
        enrol_rows: list[list[Any]] = []
        for kind in args.models:
            found = [enrol(dataset, kind, seed, args, device=not args.no_device) for seed in seeds]
            summary = summarize_enrolment(found, len(dataset.test))
            entry["enrolment"][kind] = {"summary": summary, "per_seed": found}
            enrol_rows += _enrol_rows(kind, summary, args.device_backend)
        recordings = entry["enrolment"][args.models[0]]["per_seed"][0]["recordings"]
        print(f"enrolling a held-out class from {recordings} recordings (before: 0 on it), {len(seeds)} seeds (mean):")
        print(format_table(["model", "learner", "new class acc", "retention", "all acc", "ms/observe"], enrol_rows))
        for kind in args.models:
            summary = entry["enrolment"][kind]["summary"]
            for refusal in summary["refused"]:
                print(f"  {kind}: export refused: {refusal[:400]}")
            if "device_within_tolerance" in summary:
                print(f"  {kind}: device - torch on all test data {100 * summary['device_minus_torch_all']:+.2f} points; "
                      f"within {summary['tolerance_rule']}: {summary['device_within_tolerance']}")  # fmt: skip
        results[name] = entry
    print(f"total {time.perf_counter() - start:.0f} s")
    if plotting_available():
        _plot(results, Path(args.out) / "real.png")
        print(f"plot written to {Path(args.out) / 'real.png'}")
    else:
        print(f"no plot: {PLOT_HINT}")
    config = {key: value for key, value in vars(args).items() if key != "out"}
    config |= {"batch": BATCH, "enrol_batch": ENROL_BATCH, "der_alpha_beta": [ALPHA, BETA], "threads": torch.get_num_threads()}
    save_result(args.out, "real", {"config": config, "datasets": results}, summary=_headline(results))
    return 0


def _headline(results: dict[str, Any]) -> str:
    parts = []
    for name, entry in results.items():
        kind = next(iter(entry["streams"]))
        taste = entry["streams"][kind]["taste_cl"]
        best = max(taste, key=lambda s: taste[s]["final_accuracy"])
        parts.append(f"{name} {kind} {best} {format_number(taste[best]['final_accuracy'])} vs offline "
                     f"{format_number(entry['offline']['network'][kind]['accuracy'])}")  # fmt: skip
    ratios = [r for entry in results.values() for by_strategy in entry["speed"].values() for r in by_strategy.values()]
    faster, ceiling = ([r[key] for r in ratios if r[key] is not None] for key in ("x_faster", "ceiling"))
    if faster and ceiling:
        parts.append(f"taste_cl {min(faster):.2f}-{max(faster):.2f}x Avalanche's training speed, where a bare torch loop is "
                     f"{min(ceiling):.2f}-{max(ceiling):.2f}x")  # fmt: skip
    return "; ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
