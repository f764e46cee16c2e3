"""Avalanche (avalanche-lib 0.6) both ways: its storage policies in taste_cl, taste_cl in its strategies.

- :class:`AvalancheReplay`: any ``avalanche.training.storage_policy.ExemplarsBuffer``
  (reservoir, class-balanced, parametric/herding, ...) as a taste_cl
  :class:`~taste_cl.replay.ReplayStrategy` for ``OnlineLearner(replay=...)``.
- :class:`TasteMonitorPlugin`: an Avalanche ``SupervisedPlugin`` that feeds a taste_cl
  :class:`~taste_cl.monitor.monitor.StabilityPlasticityMonitor` from any Avalanche strategy and
  publishes stability, plasticity, forgetting and drift as Avalanche metric values.
- :class:`TasteBatchSizePlugin`: an Avalanche ``SupervisedPlugin`` that tunes the training
  micro-batch with taste_cl's throughput-aware :class:`~taste_cl.tuning.tuner.BatchSizeTuner`
  and trains each strategy mini-batch as micro-batches with gradient accumulation.
- :func:`run_on_avalanche_stream`: run an ``OnlineLearner`` over an Avalanche benchmark
  or (online) stream in one call; :func:`avalanche_metrics` names the results the way
  Avalanche's evaluation plugin does.

Avalanche is imported lazily: importing this module is cheap, and using it without
``pip install '.[avalanche]'`` (from the checkout) raises :class:`~taste_cl.exceptions.MissingDependencyError`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import random
import time
import warnings
from collections.abc import Iterable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from taste_cl._checks import check_int
from taste_cl.datasets import Task
from taste_cl.exceptions import MissingDependencyError
from taste_cl.experiment import StreamResult
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import accuracy, average_forgetting, backward_transfer
from taste_cl.monitor.monitor import MonitorEvent, StabilityPlasticityMonitor
from taste_cl.replay import SeededStrategy, State
from taste_cl.tuning.tuner import BatchSizeTuner, TuningResult

__all__ = [
    "AvalancheReplay",
    "TasteBatchSizePlugin",
    "TasteMonitorPlugin",
    "avalanche_metrics",
    "benchmark_from_tasks",
    "experience_tensors",
    "run_on_avalanche_stream",
    "tensor_dataset",
]

_ID_ATTRIBUTE = "taste_sample_id"


def _avalanche(module: str = "") -> ModuleType:
    """Import ``avalanche[.module]`` or raise MissingDependencyError with the install hint."""
    try:
        with warnings.catch_warnings():
            # avalanche imports qpsolvers for GEM (unused here), which warns that no QP solver is installed
            warnings.filterwarnings("ignore", message="no QP solver found", category=UserWarning)
            imported = importlib.import_module("avalanche" + (f".{module}" if module else ""))
    except ImportError as error:
        if error.name is not None and error.name.split(".")[0] != "avalanche":
            raise  # avalanche is there but one of its own imports failed: show that
        raise MissingDependencyError("avalanche-lib", "avalanche") from error
    _drop_internal_deprecation()
    return imported


def _drop_internal_deprecation() -> None:
    """Stop Avalanche 0.6 warning about its own internal call.

    Avalanche's ``ReplayPlugin`` calls ``ExemplarsBuffer.update``, which Avalanche itself
    marks deprecated (removal in 0.7): every replayed experience prints a
    DeprecationWarning the user cannot act on. A warnings filter cannot hide it, because
    the deprecation decorator re-enables DeprecationWarning (``simplefilter("once")``) on
    every call, ahead of any filter; so the undecorated method is restored (it already
    calls the non-deprecated ``post_adapt``). Deprecations of the user's own calls are kept.
    """
    try:
        buffer = importlib.import_module("avalanche.training.storage_policy").ExemplarsBuffer
    except ImportError:  # a partial install: the caller's own import reports it
        return
    undecorated = getattr(buffer.update, "__wrapped__", None)
    if undecorated is not None:
        buffer.update = undecorated


def tensor_dataset(x: torch.Tensor, y: torch.Tensor, *, task_label: int = 0) -> Any:
    """A classification ``AvalancheDataset`` over tensors ``x`` (features) and ``y`` (labels)."""
    utils = _avalanche("benchmarks.utils")
    return utils._make_taskaware_tensor_classification_dataset(x, y, task_labels=task_label)


def benchmark_from_tasks(tasks: Iterable[Task]) -> Any:
    """An Avalanche benchmark (``train_stream``/``test_stream``, one experience per task) of taste_cl tasks."""
    scenario = _avalanche("benchmarks.scenarios.dataset_scenario")
    tasks = list(tasks)
    return scenario.benchmark_from_datasets(
        train=[tensor_dataset(task.x_train, task.y_train) for task in tasks],
        test=[tensor_dataset(task.x_test, task.y_test) for task in tasks],
    )


# ------------------------------------------------------- direction 1: replay
class AvalancheReplay(SeededStrategy):
    """Use an Avalanche storage policy (``ExemplarsBuffer``) as a taste_cl replay strategy.

    Every ``add`` hands the batch to ``policy.post_adapt`` as a one-batch experience (an
    ``AvalancheDataset`` over the tensors, tagged with sample ids); the policy decides
    what to keep, and the kept samples are copied into a flat tensor store, so ``sample``
    costs the same as for the built-in strategies. The policy's random draws use a
    private, seeded RNG (torch and ``random``), so runs are reproducible and the global
    RNG is left alone.

    Parameters
    ----------
    policy:
        An ``ExemplarsBuffer`` with ``max_size >= 1``; ``capacity`` is its ``max_size``.
    seed:
        Seed of the sampling generator and of the policy's private RNG.
    task_label:
        Task label given to the stored data (policies grouping by task read it).
    agent:
        What the policy sees as the strategy state in ``post_adapt``; policies with a
        feature-based selection need ``device`` and ``eval_mb_size`` there. Default: a
        namespace with those two fields, the current ``experience`` and a ``clock``.

    Checkpoints hold plain tensors and numbers. Objects a policy holds that are not data
    (selection strategies, feature extractors) are not saved: ``load_state_dict`` keeps
    those of the policy given to the constructor, so build it the same way.

    >>> import torch
    >>> from avalanche.training.storage_policy import ClassBalancedBuffer
    >>> replay = AvalancheReplay(ClassBalancedBuffer(max_size=4), seed=0)
    >>> replay.add(torch.randn(6, 3), torch.tensor([0, 0, 0, 1, 1, 1]))
    >>> len(replay), sorted(replay.labels.tolist())
    (4, [0, 0, 1, 1])
    """

    def __init__(self, policy: Any, *, seed: int = 0, task_label: int = 0, agent: Any = None) -> None:
        storage_policy = _avalanche("training.storage_policy")
        if not isinstance(policy, storage_policy.ExemplarsBuffer):
            raise TypeError(f"policy must be an avalanche.training.storage_policy.ExemplarsBuffer; got {type(policy).__name__}")
        super().__init__(policy.max_size, seed)
        self.policy = policy
        self.task_label = task_label
        self.agent = agent
        self.seen = 0
        self._ids = torch.empty(0, dtype=torch.long)
        self._adds = 0
        self._torch_rng = torch.Generator().manual_seed(seed).get_state()
        self._python_rng = random.Random(seed).getstate()

    def _dataset(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> Any:
        return tensor_dataset(x, y, task_label=self.task_label).update_data_attribute(_ID_ATTRIBUTE, ids.tolist())

    def _agent_state(self, experience: Any, device: torch.device) -> Any:
        if self.agent is not None:
            return self.agent
        clock = SimpleNamespace(train_exp_counter=self._adds)
        return SimpleNamespace(experience=experience, device=device, eval_mb_size=256, clock=clock)

    def add_validated(self, x: Any, y: torch.Tensor, **fields: torch.Tensor) -> None:
        if fields:  # the Avalanche policy's dataset holds (x, y) only
            raise ValueError(f"AvalancheReplay keeps no extra per-sample fields; got {sorted(fields)}. Use ReservoirReplay or ClassBalancedReplay")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"AvalancheReplay stores tensor inputs only; got x of type {type(x).__name__}")
        ids = torch.arange(self.seen, self.seen + x.shape[0])
        experience = SimpleNamespace(dataset=self._dataset(x.detach().cpu(), y.cpu(), ids), current_experience=self._adds)
        with self._private_rng():
            self.policy.post_adapt(self._agent_state(experience, x.device), experience)
        old_x, old_y = self._stored()
        self._keep(_ids_in(self.policy.buffer), torch.cat([self._ids, ids]), torch.cat([old_x, x]), torch.cat([old_y, y]))
        self.seen += x.shape[0]
        self._adds += 1

    def _stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not len(self._storage):
            return torch.empty(0), torch.empty(0, dtype=torch.long)
        return self._storage.gather(torch.arange(len(self._storage)))

    def _keep(self, keep: torch.Tensor, pool_ids: torch.Tensor, pool_x: torch.Tensor, pool_y: torch.Tensor) -> None:
        """Store the samples of the pool whose ids are ``keep``, in that order."""
        if len(keep) > self.capacity:
            raise RuntimeError(f"the Avalanche policy holds {len(keep)} samples, more than its max_size {self.capacity}")
        positions = _positions(pool_ids, keep)
        self._storage.load_state_dict({"capacity": self.capacity, "size": len(keep), "x": pool_x[positions], "y": pool_y[positions]})
        self._ids = keep

    @contextlib.contextmanager
    def _private_rng(self) -> Iterator[None]:
        """Make torch's and ``random``'s global RNGs this buffer's own for the duration."""
        torch_state, python_state = torch.get_rng_state(), random.getstate()
        torch.set_rng_state(self._torch_rng)
        random.setstate(self._python_rng)
        try:
            yield
        finally:
            self._torch_rng, self._python_rng = torch.get_rng_state(), random.getstate()
            torch.set_rng_state(torch_state)
            random.setstate(python_state)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> State:
        version, internal, gauss = self._python_rng
        return {
            **self._base_state(),
            "seen": self.seen,
            "adds": self._adds,
            "ids": self._ids.clone(),
            "torch_rng": self._torch_rng.clone(),
            "python_rng": {"version": version, "state": torch.tensor(internal, dtype=torch.long), "gauss": gauss},
            "policy": _encode(self.policy),
        }

    def load_state_dict(self, state: State) -> None:
        self._load_base_state(state)
        self.seen = int(state["seen"])
        self._adds = int(state["adds"])
        self._ids = state["ids"].clone()
        self._torch_rng = state["torch_rng"].clone()
        python = state["python_rng"]
        self._python_rng = (int(python["version"]), tuple(int(v) for v in python["state"].tolist()), python["gauss"])
        x, y = self._stored()

        def dataset(ids: torch.Tensor) -> Any:
            positions = _positions(self._ids, ids)
            return self._dataset(x[positions], y[positions], ids)

        _decode_into(self.policy, state["policy"], dataset, self.policy)


def _positions(pool_ids: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """Index in ``pool_ids`` (distinct) of each id in ``wanted``; every wanted id must be there."""
    if not len(wanted):
        return torch.empty(0, dtype=torch.long)
    sorted_ids, order = pool_ids.sort()
    found = torch.searchsorted(sorted_ids, wanted).clamp(max=max(len(sorted_ids) - 1, 0))
    positions = order[found]
    if not len(pool_ids) or not bool((pool_ids[positions] == wanted).all()):
        raise RuntimeError("the Avalanche policy holds samples that were not added through this AvalancheReplay")
    return positions


# The policy's data-bearing attributes are saved structurally: datasets as the ids of
# their samples, nested buffers (per-class/per-group) by class name, containers as lists.
def _ids_in(dataset: Any) -> torch.Tensor:
    """The sample ids an Avalanche dataset built by :class:`AvalancheReplay` carries."""
    if len(dataset) == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.as_tensor(list(getattr(dataset, _ID_ATTRIBUTE)), dtype=torch.long)


def _encode(value: Any) -> Any:
    data = _avalanche("benchmarks.utils")
    storage_policy = _avalanche("training.storage_policy")
    if isinstance(value, data.AvalancheDataset):
        return {"kind": "dataset", "ids": _ids_in(value)}
    if isinstance(value, storage_policy.ExemplarsBuffer):
        fields = {name: _encode(item) for name, item in vars(value).items()}
        return {
            "kind": "buffer",
            "class": type(value).__name__,
            "fields": {name: item for name, item in fields.items() if item is not _SKIP},
            "skipped": sorted(name for name, item in fields.items() if item is _SKIP),
        }
    if isinstance(value, (torch.Tensor, int, float, str, bool)) or value is None:
        return value.clone() if isinstance(value, torch.Tensor) else value
    if isinstance(value, (set, list, tuple)):
        items = [_encode(item) for item in (sorted(value) if isinstance(value, set) else value)]
        return _SKIP if _SKIP in items else {"kind": type(value).__name__, "items": items}
    if isinstance(value, dict):
        pairs = [[key, _encode(item)] for key, item in value.items()]
        return _SKIP if any(item is _SKIP for _, item in pairs) else {"kind": "dict", "items": pairs}
    return _SKIP  # selection strategies, models: rebuilt by the user with the policy


_SKIP = SimpleNamespace()


def _decode(value: Any, dataset: Any, root: Any) -> Any:
    if not isinstance(value, dict):
        return value.clone() if isinstance(value, torch.Tensor) else value
    kind = value["kind"]
    if kind == "dataset":
        ids = value["ids"]
        return dataset(ids) if len(ids) else _avalanche("benchmarks.utils.utils").concat_datasets([])
    if kind == "buffer":
        cls = getattr(_avalanche("training.storage_policy"), value["class"], None)
        if not (isinstance(cls, type) and issubclass(cls, _avalanche("training.storage_policy").ExemplarsBuffer)):
            raise ValueError(f"checkpoint names an unknown Avalanche buffer class {value['class']!r}")
        buffer: Any = object.__new__(cls)  # no __init__: the fields are restored below
        for name in value["skipped"]:  # non-data fields (selection strategy) come from the live policy
            setattr(buffer, name, getattr(root, name, None))
        _decode_into(buffer, value, dataset, root)
        return buffer
    if kind == "dict":
        return {key: _decode(item, dataset, root) for key, item in value["items"]}
    items = [_decode(item, dataset, root) for item in value["items"]]
    return {"set": set, "tuple": tuple, "list": list}[kind](items)


def _decode_into(buffer: Any, encoded: dict[str, Any], dataset: Any, root: Any) -> None:
    if type(buffer).__name__ != encoded["class"]:
        raise ValueError(f"checkpoint holds a {encoded['class']} policy; this AvalancheReplay wraps a {type(buffer).__name__}")
    for name, item in encoded["fields"].items():
        setattr(buffer, name, _decode(item, dataset, root))


def _batches(dataset: Any, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(x, y, task_labels)`` mini-batches of an Avalanche dataset, in order, eval transforms."""
    data = dataset.eval() if hasattr(dataset, "eval") else dataset
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=getattr(data, "collate_fn", None))
    for x, y, t, *_ in loader:
        yield x, y, t


def experience_tensors(experience: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """All of an Avalanche experience's inputs and targets, each as one tensor."""
    batches = list(_batches(experience.dataset, 1024))
    return torch.cat([x for x, _, _ in batches]), torch.cat([y for _, y, _ in batches])


# ------------------------------------------------- direction 2: Avalanche plugin
METRIC_NAMES = ("stability", "plasticity", "forgetting", "drift_count")


def _eval_logits(strategy: Any, x: torch.Tensor, task_labels: torch.Tensor) -> torch.Tensor:
    """The strategy model's logits for ``x`` in eval mode without gradients, on the CPU."""
    model = strategy.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _avalanche("models").avalanche_forward(model, x.to(strategy.device), task_labels.to(strategy.device)).cpu()
    finally:
        model.train(was_training)


@functools.cache
def _plugin_class() -> type[Any]:
    core = _avalanche("core")
    metric_results = _avalanche("evaluation.metric_results")

    class TasteMonitorPlugin(core.SupervisedPlugin):  # type: ignore[name-defined]
        """Feed a taste_cl stability-plasticity monitor from any Avalanche strategy.

        Before the strategy trains on an experience, the plugin scores the experience's
        data with the current model (prequential plasticity) and adds it to the
        monitor's probe; after training, it re-evaluates the probe (stability,
        forgetting) every ``monitor.eval_every`` scored batches, and publishes
        ``Taste/stability``, ``Taste/plasticity``, ``Taste/forgetting`` and
        ``Taste/drift_count`` through the strategy's evaluator, so Avalanche loggers and
        ``evaluator.get_all_metrics()`` see them. Works with online (``split_online_stream``)
        and batch streams. The probe is scored with task label 0 (single-head models).
        """

        def __init__(self, monitor: StabilityPlasticityMonitor | None = None, *, batch_size: int = 256) -> None:
            super().__init__()
            check_int("batch_size", batch_size, 1)
            self.monitor = monitor if monitor is not None else StabilityPlasticityMonitor()
            self.batch_size = batch_size
            self._evaluated_at = 0

        def _logits(self, strategy: Any, x: torch.Tensor, task_labels: torch.Tensor) -> torch.Tensor:
            return _eval_logits(strategy, x, task_labels)

        def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            for x, y, t in _batches(strategy.experience.dataset, self.batch_size):
                self.monitor.record(x, y, self._logits(strategy, x, t))

        def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            monitor = self.monitor
            if monitor.steps // monitor.eval_every > self._evaluated_at // monitor.eval_every:
                monitor.evaluate(lambda x: self._logits(strategy, x, torch.zeros(len(x), dtype=torch.long)))
                self._evaluated_at = monitor.steps
            monitor.dispatch()
            evaluator = getattr(strategy, "evaluator", None)
            if evaluator is None:
                return
            report = monitor.report()
            values = {**report, "drift_count": report["drift"]["count"]}
            for name in METRIC_NAMES:
                if values[name] is not None:
                    evaluator.publish_metric_value(metric_results.MetricValue(self, f"Taste/{name}", values[name], strategy.clock.train_iterations))

    return TasteMonitorPlugin


class _MicroBatches:
    """A strategy's train loader whose mini-batches come out as micro-batches of at most ``size``.

    While a micro-batch is being trained, ``weight`` is its share of its mini-batch's
    samples and ``last`` says whether it closes the mini-batch (the accumulation window).
    ``len`` counts mini-batches (optimizer steps), not micro-batches.
    """

    def __init__(self, loader: Iterable[Any], size: int) -> None:
        self.loader = loader
        self.size = size
        self.weight = 1.0
        self.last = True

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        for mbatch in self.loader:
            n = len(mbatch[0])
            for start in range(0, n, self.size):
                self.weight = min(self.size, n - start) / n
                self.last = start + self.size >= n
                yield [part[start : start + self.size] for part in mbatch]


@functools.cache
def _batch_plugin_class() -> type:
    core = _avalanche("core")
    metric_results = _avalanche("evaluation.metric_results")

    class TasteBatchSizePlugin(core.SupervisedPlugin):  # type: ignore[name-defined]
        """Train any Avalanche strategy with the throughput-best micro-batch of this machine.

        Before the first experience the plugin tunes the micro-batch with
        :meth:`taste_cl.tuning.tuner.BatchSizeTuner.tune` (real training steps of the strategy's
        model, optimizer and criterion at the shape of the experience's samples; a GP
        surrogate cached on disk, so later tunes are warm and cost one probe). Every
        mini-batch the strategy's loader yields (``train_mb_size`` samples, plus replay
        with ``ReplayPlugin``) is then trained as micro-batches of at most the tuned size:
        each micro-batch's gradient is weighted by its share of the mini-batch and
        accumulated, and the optimizer steps once per mini-batch. The effective batch and
        the learning rate stay what the strategy was configured with, so training
        follows the same trajectory (up to float rounding; BatchNorm statistics are per
        micro-batch); only the speed and the peak memory change. A mini-batch no larger
        than the tuned size trains unchanged.

        It retunes (warm) before the next experience when a :class:`TasteMonitorPlugin`
        on the same strategy reports ``drift_detected`` (``retune_on_drift``) and every
        ``retune_every`` experiences. ``strategy.clock.train_iterations`` counts
        micro-batches; optimizer steps are skipped between them by setting the gradients
        to ``None`` (torch optimizers leave such parameters and their state alone), so
        plugins that act on every iteration's update (LR schedulers per iteration) see
        micro-batches. The tuned size is published as ``Taste/micro_batch_size``.
        Single-head models (the tuner calls ``model(x)``); place it after plugins that
        change the gradients in ``after_backward``.

        Parameters
        ----------
        tuner:
            The :class:`~taste_cl.tuning.tuner.BatchSizeTuner` whose search settings
            (``max_batch_size``, ``memory_budget_bytes``, ``n_calls``, ``warm_calls``,
            ``cache_dir``, ...) are used; its learner-side settings (effective batch,
            LR scaling, its own retune triggers) do not apply here. Default: ``BatchSizeTuner()``.
        retune_every:
            Also retune before every this many experiences (None: only on drift).
        retune_on_drift:
            Retune after the monitor of an attached :class:`TasteMonitorPlugin` reports drift.
        """

        def __init__(self, tuner: BatchSizeTuner | None = None, *, retune_every: int | None = None, retune_on_drift: bool = True) -> None:
            super().__init__()
            if tuner is not None and not isinstance(tuner, BatchSizeTuner):
                raise TypeError(f"tuner must be a taste_cl.tuning.tuner.BatchSizeTuner or None; got {type(tuner).__name__}")
            bad = isinstance(retune_every, bool) or not isinstance(retune_every, int) or retune_every < 1
            if retune_every is not None and bad:
                raise ValueError(f"`retune_every == {retune_every!r}`, must be an int >= 1 or None")
            self.tuner = tuner if tuner is not None else BatchSizeTuner()
            self.retune_every = retune_every
            self.retune_on_drift = retune_on_drift
            self.result_: TuningResult | None = None
            self.history_: list[dict[str, Any]] = []  # (re)tunes: when, why, what
            self._experiences = 0
            self._pending_reason: str | None = None
            self._monitors: list[StabilityPlasticityMonitor] = []
            self._loader: _MicroBatches | None = None
            self._stash: list[torch.Tensor | None] | None = None

        # ------------------------------------------------------------ tuning
        def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            if self.retune_on_drift:
                self._subscribe(strategy)
            reason = "first experience" if self.result_ is None else self._pending_reason
            if reason is None and self.retune_every and self._experiences % self.retune_every == 0:
                reason = f"schedule (every {self.retune_every} experiences)"
            if reason is not None:
                self._pending_reason = None
                self._retune(strategy, reason)

        def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            self._experiences += 1

        def _subscribe(self, strategy: Any) -> None:
            for plugin in strategy.plugins:
                if isinstance(plugin, _plugin_class()) and not any(m is plugin.monitor for m in self._monitors):
                    plugin.monitor.subscribe(self._on_drift, event="drift_detected")
                    self._monitors.append(plugin.monitor)

        def _on_drift(self, event: MonitorEvent) -> None:
            self._pending_reason = self._pending_reason or f"stream drift at monitor step {event.step}"

        def _retune(self, strategy: Any, reason: str) -> None:
            dataset = strategy.adapted_dataset  # real training samples, train transforms applied
            items = [dataset[i] for i in range(min(len(dataset), self.tuner.probe_samples))]
            samples = (torch.stack([item[0] for item in items]), torch.as_tensor([int(item[1]) for item in items]))
            result = self.tuner.tune(strategy.model, strategy.optimizer, strategy._criterion, samples)
            self.result_ = result
            entry = {
                "experience": self._experiences,
                "reason": reason,
                "batch_size": result.batch_size,
                "samples_per_s": result.samples_per_s,
                "probes": len(result.probes),
                "seconds": result.seconds,
                "warm": result.warm,
            }
            self.history_.append(entry)
            evaluator = getattr(strategy, "evaluator", None)
            if evaluator is not None:
                evaluator.publish_metric_value(
                    metric_results.MetricValue(self, "Taste/micro_batch_size", result.batch_size, strategy.clock.train_iterations)
                )

        # ------------------------------------------------------ accumulation
        def before_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            assert self.result_ is not None
            if not isinstance(strategy.dataloader, _MicroBatches):  # after every before_training_exp (ReplayPlugin's loader)
                strategy.dataloader = _MicroBatches(strategy.dataloader, self.result_.batch_size)
            self._loader = strategy.dataloader
            self._stash = None

        def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            if self._loader is None or (self._stash is None and self._loader.weight == 1.0):
                return  # a whole mini-batch in one micro-batch: nothing to weight or add
            stash = self._stash or [None] * len(list(strategy.model.parameters()))
            for param, held in zip(strategy.model.parameters(), stash):
                if param.grad is not None:
                    param.grad.mul_(self._loader.weight)
                if held is not None:
                    param.grad = held if param.grad is None else param.grad.add_(held)
            self._stash = None

        def before_update(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
            if self._loader is None or self._loader.last:
                return
            params = list(strategy.model.parameters())
            self._stash = [param.grad for param in params]
            for param in params:
                param.grad = None  # the optimizer skips them: no step until the window closes

    return TasteBatchSizePlugin


_PLUGIN_CLASSES = {"TasteMonitorPlugin": _plugin_class, "TasteBatchSizePlugin": _batch_plugin_class}


def __getattr__(name: str) -> Any:
    if name in _PLUGIN_CLASSES:  # built on first use: subclassing SupervisedPlugin imports avalanche
        return _PLUGIN_CLASSES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------- streams
def run_on_avalanche_stream(
    learner: OnlineLearner,
    benchmark_or_stream: Any,
    *,
    test_stream: Iterable[Any] | None = None,
    batch_size: int = 10,
) -> StreamResult:
    """Run ``learner`` once over an Avalanche benchmark's train stream (or any stream of experiences).

    Experiences are fed to ``learner.observe`` in order, in mini-batches of ``batch_size``
    (an experience of ``split_online_stream`` is usually exactly one batch). The learner
    is evaluated on every experience of ``test_stream`` (default: the benchmark's
    ``test_stream``) whenever a task ends — an online sub-experience's
    ``origin_experience`` changes, or any experience of a batch stream ends — giving
    the accuracy matrix, forgetting and BWT (:func:`avalanche_metrics` names them the
    Avalanche way). ``train_seconds`` counts only ``observe`` calls.
    """
    check_int("batch_size", batch_size, 1)
    train_stream = getattr(benchmark_or_stream, "train_stream", benchmark_or_stream)
    if test_stream is None:
        test_stream = getattr(benchmark_or_stream, "test_stream", None)
    if test_stream is None:
        raise ValueError("test_stream is required when benchmark_or_stream is a stream (a benchmark brings its own)")
    tests = [experience_tensors(experience) for experience in test_stream]
    if not tests:
        raise ValueError("test_stream has no experiences")

    def row() -> list[float]:
        return [accuracy(learner.predict, x, y) for x, y in tests]

    matrix: list[list[float]] = []
    seen, train_seconds, current = 0, 0.0, None
    for experience in train_stream:
        origin = getattr(experience, "origin_experience", experience)
        task = origin.current_experience
        if current is not None and task != current:
            matrix.append(row())
        current = task
        for x, y, _ in _batches(experience.dataset, batch_size):
            start = time.perf_counter()
            learner.observe((x, y))
            train_seconds += time.perf_counter() - start
            seen += x.shape[0]
    matrix.append(row())
    return StreamResult(
        accuracy_matrix=matrix,
        final_accuracy=accuracy(learner.predict, torch.cat([x for x, _ in tests]), torch.cat([y for _, y in tests])),
        forgetting=average_forgetting(matrix),
        backward_transfer=backward_transfer(matrix),
        samples=seen,
        train_seconds=train_seconds,
    )


def avalanche_metrics(result: StreamResult, *, stream_name: str = "test_stream") -> dict[str, float]:
    """The results of a run under the names Avalanche's ``EvaluationPlugin`` uses (task 0)."""
    metrics = {
        f"Top1_Acc_Stream/eval_phase/{stream_name}/Task000": result.final_accuracy,
        f"StreamForgetting/eval_phase/{stream_name}": result.forgetting,
        f"StreamBWT/eval_phase/{stream_name}": result.backward_transfer,
    }
    for j, value in enumerate(result.accuracy_matrix[-1]):
        metrics[f"Top1_Acc_Exp/eval_phase/{stream_name}/Task000/Exp{j:03d}"] = value
    return metrics
