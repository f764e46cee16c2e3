"""Fleet personalization on Flower: devices share what generalizes, keep what is personal.

Each device runs an :class:`~taste_cl.learner.OnlineLearner` on its own stream inside a
Flower ``ClientApp`` (the Message API that flwr 1.21+ recommends). Raw data and the
replay buffer never leave the device: the learner state is kept in the node's
``context.state``. Only the *shared* entries of the model's ``state_dict`` travel; the
*personal* ones (selected by name prefixes or a predicate, e.g. the first layer) stay
local. The server runs any Flower strategy (``FedAvg``, ``FedProx``, ...) wrapped in a
:class:`ValidatingStrategy`, which drops malformed updates with a logged reason, keeps
the round going, and records communication bytes, time and memory per round. An
:class:`AggregationPolicy` bounds what any one client can do to the global model:
overflow-safe weights, a cap on claimed ``num-examples`` and on any client's share,
and a bound on the magnitude of update values; every dropped or capped update is
logged with its reason.

Needs the ``[federated]`` extra: ``pip install '.[federated]'`` (from the checkout). Flower's
telemetry is switched off (``FLWR_TELEMETRY_ENABLED=0``) unless the user set it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import numpy as np
import psutil
import torch
from torch import nn

from taste_cl._batch import BatchLike
from taste_cl.adapters.flower.updates import ArraySpec, InvalidUpdateError, PersonalSpec, check_update, require_flwr
from taste_cl.adapters.flower.updates import array_spec as _spec
from taste_cl.adapters.flower.updates import personal_predicate as _personal_predicate
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import accuracy
from taste_cl.state.checkpoint import decode_state, encode_state

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import Strategy

__all__ = [
    "AdjustedUpdate",
    "AggregationPolicy",
    "DroppedUpdate",
    "FleetResult",
    "InvalidUpdateError",
    "RoundStats",
    "ValidatingStrategy",
    "apply_policy",
    "check_update",
    "load_shared",
    "make_client_app",
    "require_flwr",
    "run_fleet_simulation",
    "shared_state",
]

logger = logging.getLogger(__name__)

_STATE_KEY = "taste_cl"
_ARRAYS_KEY = "arrays"
_METRICS_KEY = "metrics"


# ------------------------------------------------------------ shared / personal split
def shared_state(model: nn.Module, *, personal: PersonalSpec) -> dict[str, np.ndarray]:
    """The ``state_dict`` entries that the fleet shares, as numpy arrays (copies).

    Raises ``ValueError`` when ``personal`` selects every entry (nothing to share).
    """
    is_personal = _personal_predicate(personal)
    shared = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if not is_personal(k)}
    if not shared:
        raise ValueError(f"personal={personal!r} selects every state_dict entry: nothing left to share")
    return shared


def load_shared(model: nn.Module, arrays: Mapping[str, np.ndarray], *, personal: PersonalSpec) -> None:
    """Copy the fleet's shared ``arrays`` into ``model`` in place; personal entries are untouched.

    Checks everything first (:func:`check_update`), so a bad update changes nothing.
    In-place copies keep the optimizer's references to the parameters valid.
    """
    state = model.state_dict()
    is_personal = _personal_predicate(personal)
    check_update(arrays, {k: (tuple(v.shape), _numpy_dtype(v)) for k, v in state.items() if not is_personal(k)})
    with torch.no_grad():
        for name, array in arrays.items():
            state[name].copy_(torch.from_numpy(np.ascontiguousarray(array)))


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


# ------------------------------------------------------------------------ client side
def record_to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """A Flower ArrayRecord as numpy arrays by name."""
    return {name: array.numpy() for name, array in record.items()}


def restore_from_context(context: Context, learner: OnlineLearner) -> OnlineLearner:
    """Load the device's learner state (model, optimizer, replay, monitor) from ``context.state``."""
    saved = context.state.config_records.get(_STATE_KEY)
    if saved is not None:
        learner.load_state_dict(decode_state(cast(bytes, saved["learner"]), source="the device's saved learner state"))
    return learner


def persist_to_context(context: Context, learner: OnlineLearner) -> None:
    """Keep the device's learner state in ``context.state`` for its next round (see :func:`restore_from_context`)."""
    from flwr.app import ConfigRecord

    context.state[_STATE_KEY] = ConfigRecord({"learner": encode_state(learner.state_dict())})


def reply_to(msg: Message, content: dict[str, Any]) -> Message:
    """The reply to ``msg`` carrying ``content``."""
    from flwr.app import Message, RecordDict

    return Message(content=RecordDict(content), reply_to=msg)


def make_client_app(
    *,
    build_learner: Callable[[int], OnlineLearner],
    train_batches: Callable[[int, int], Iterable[BatchLike]],
    eval_sets: Callable[[int], Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    personal: PersonalSpec,
    mods: Sequence[Callable[..., Message]] = (),
) -> ClientApp:
    """A Flower ``ClientApp`` running one :class:`OnlineLearner` per device.

    ``build_learner(partition_id)`` builds a fresh learner (same architecture on every
    device); ``train_batches(partition_id, server_round)`` yields the batches the device
    observes in that round (its own stream, never sent); ``eval_sets(partition_id)``
    maps names to held-out ``(x, y)`` scored after each round with the fleet's shared
    part and the device's personal part (reported as ``accuracy-<name>``). ``mods`` are
    Flower client mods (e.g. differential-privacy clipping).
    """
    require_flwr()
    from flwr.app import Array, ArrayRecord, MetricRecord
    from flwr.clientapp import ClientApp

    _personal_predicate(personal)  # validate at the boundary, not inside a Ray actor
    app = ClientApp(mods=list(mods))

    def _learner(msg: Message, context: Context) -> tuple[int, OnlineLearner]:
        torch.set_num_threads(1)  # simulated devices share the host's cores
        partition = int(context.node_config["partition-id"])
        learner = restore_from_context(context, build_learner(partition))
        load_shared(learner.model, record_to_numpy(msg.content.array_records[_ARRAYS_KEY]), personal=personal)
        return partition, learner

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        partition, learner = _learner(msg, context)
        start, samples, losses = time.perf_counter(), 0, []
        for batch in train_batches(partition, int(cast(int, msg.content.config_records["config"]["server-round"]))):
            stats = learner.observe(batch)
            samples += stats.samples
            if stats.loss is not None:  # None: nothing trained yet (samples wait for a full micro-batch)
                losses.append(stats.loss)
        seconds = time.perf_counter() - start
        persist_to_context(context, learner)
        metrics = {
            "num-examples": max(samples, 1),
            "train-loss": float(np.mean(losses)) if losses else float("nan"),
            "train-seconds": seconds,
            "rss-mb": psutil.Process().memory_info().rss / 2**20,
        }
        shared = shared_state(learner.model, personal=personal)
        record = ArrayRecord({name: Array(array) for name, array in shared.items()})
        return reply_to(msg, {_ARRAYS_KEY: record, _METRICS_KEY: MetricRecord(metrics)})

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        partition, learner = _learner(msg, context)
        metrics: dict[str, Any] = {"partition-id": partition}
        for name, (x, y) in eval_sets(partition).items():
            metrics[f"accuracy-{name}"] = accuracy(learner.predict, x, y)
            metrics["num-examples"] = int(x.shape[0])
        return reply_to(msg, {_METRICS_KEY: MetricRecord(metrics)})

    return app


# ------------------------------------------------------------------------ server side
@dataclass(frozen=True)
class DroppedUpdate:
    """A client update the server refused, and why."""

    server_round: int
    node_id: int
    reason: str


@dataclass
class RoundStats:
    """Bookkeeping of one round: payload bytes each way, time, memory, accepted/dropped updates.

    Bytes count the array payloads (``ArrayRecord.count_bytes``), not the transport framing.
    ``seconds`` spans configure-train to the end of the round's evaluation.
    """

    server_round: int
    sampled: int
    accepted: int
    dropped: int
    bytes_down: int
    bytes_up: int
    server_rss_mb: float
    max_client_rss_mb: float
    mean_client_train_s: float
    seconds: float = float("nan")


@dataclass(frozen=True)
class AdjustedUpdate:
    """A client update the server kept with less weight than it claimed, and why."""

    server_round: int
    node_id: int
    reason: str


@dataclass(frozen=True)
class AggregationPolicy:
    """What one client may contribute to an aggregate.

    Parameters
    ----------
    max_num_examples:
        A claimed weight (``num-examples``) above this is capped to it.
    max_share:
        No client's share of the total weight exceeds this (the excess goes to the
        others in proportion to their weights); with fewer than ``1 / max_share``
        clients every client gets an equal share. ``1.0`` turns the cap off.
    max_abs_value:
        An update holding a floating-point value with ``|value| > max_abs_value`` is
        dropped (integer arrays such as BatchNorm's step counter are not bounded).

    Shares are computed in float64 after capping and normalising, so no sum of claims
    can overflow; the inner strategy then sees each kept reply's weight metric
    rewritten to its share (the shares sum to 1).

    >>> AggregationPolicy(max_share=0.5).shares([1e300, 10.0, 10.0])[0]
    [0.5, 0.25, 0.25]
    """

    max_num_examples: float = 1e7
    max_share: float = 0.5
    max_abs_value: float = 1e6

    def __post_init__(self) -> None:
        for name in ("max_num_examples", "max_abs_value"):
            if not _finite_positive(getattr(self, name)):
                raise ValueError(f"`{name} == {getattr(self, name)!r}`, must be a finite number > 0")
        if not (_finite_positive(self.max_share) and self.max_share <= 1.0):
            raise ValueError(f"`max_share == {self.max_share!r}`, must be in (0, 1]")

    def value_problem(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Why an update's values are out of bounds, or None."""
        for name, array in arrays.items():
            if np.issubdtype(array.dtype, np.floating) and array.size:
                largest = float(np.max(np.abs(array.astype(np.float64, copy=False))))
                if largest > self.max_abs_value:
                    return f"`{name}` holds |value| {largest:.3g} > max_abs_value={self.max_abs_value:g}"
        return None

    def shares(self, claims: Sequence[float]) -> tuple[list[float], list[str | None]]:
        """Each client's share of the aggregate (summing to 1), and why it was reduced (None if not).

        ``claims`` are finite numbers > 0 (the weight metric, already validated).
        """
        n = len(claims)
        if n == 0:
            return [], []
        notes: list[str | None] = [None] * n
        capped = []
        for i, claim in enumerate(claims):
            if claim > self.max_num_examples:
                notes[i] = f"num-examples {claim:.3g} capped to max_num_examples={self.max_num_examples:g}"
            capped.append(min(float(claim), self.max_num_examples))
        if n * self.max_share < 1.0:  # the cap cannot be met: equal shares
            shares = [1.0 / n] * n
        else:
            largest = max(capped)
            weights = [c / largest for c in capped]  # in (0, 1]: the sum cannot overflow
            shares = _water_fill(weights, self.max_share)
        raw_total = sum(c / max(capped) for c in capped)
        for i, share in enumerate(shares):
            wanted = capped[i] / max(capped) / raw_total
            if share < wanted - 1e-12:
                note = f"share {wanted:.3g} capped to {share:.3g} (max_share={self.max_share:g})"
                notes[i] = note if notes[i] is None else f"{notes[i]}; {note}"
        return shares, notes


def _water_fill(weights: list[float], cap: float) -> list[float]:
    """Normalise ``weights`` to shares, capping each at ``cap`` and giving the excess to the rest pro rata."""
    shares = [0.0] * len(weights)
    free = list(range(len(weights)))
    budget = 1.0
    while free:
        total = sum(weights[i] for i in free)
        over = [i for i in free if weights[i] / total * budget > cap]
        if not over:
            for i in free:
                shares[i] = weights[i] / total * budget
            break
        for i in over:
            shares[i] = cap
            free.remove(i)
        budget -= cap * len(over)
    return shares


def _finite_positive(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _reply_problem(content: RecordDict, expected: ArraySpec, weight_key: str, policy: AggregationPolicy | None = None) -> str | None:
    """Why a train reply cannot be aggregated, or None when it is fine."""
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        return f"expected one ArrayRecord and one MetricRecord; got {len(content.array_records)} and {len(content.metric_records)}"
    (record,) = content.array_records.values()
    try:
        arrays = record_to_numpy(record)
        check_update(arrays, expected)
        if policy is not None and (problem := policy.value_problem(arrays)) is not None:
            return problem
    except InvalidUpdateError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - undecodable payload: report it, never crash the round
        return f"arrays cannot be decoded: {error}"
    (metrics,) = content.metric_records.values()
    if not _finite_positive(metrics.get(weight_key)):
        return f"metric `{weight_key}` must be a finite number > 0; got {metrics.get(weight_key)!r}"
    return None


def apply_policy(contents: Sequence[RecordDict], weight_key: str, policy: AggregationPolicy) -> list[str | None]:
    """Rewrite the weight metric of each (validated) reply to its share under ``policy``.

    Returns, per reply, why its weight was reduced (None when it was not).
    """
    metrics = [next(iter(content.metric_records.values())) for content in contents]
    weights: list[float] = []
    for m in metrics:
        weight = m[weight_key]
        if not _finite_positive(weight):
            raise ValueError(f"metric `{weight_key}` must be a finite number > 0 in every reply; got {weight!r}")
        weights.append(float(weight))
    shares, notes = policy.shares(weights)
    for record, share in zip(metrics, shares):
        record[weight_key] = share
    return notes


def _in_sent_dtypes(arrays: ArrayRecord, spec: ArraySpec) -> ArrayRecord:
    """``arrays`` with each array in the dtype the server sent it in.

    Flower's ``FedAdam`` keeps its moments in float64 and returns its aggregate in float64;
    a device checks every array it receives against its own (float32) and refuses others.
    """
    from flwr.app import Array, ArrayRecord

    named = record_to_numpy(arrays)
    if all(named[name].dtype == dtype for name, (_, dtype) in spec.items() if name in named):
        return arrays
    return ArrayRecord({name: Array(value.astype(spec[name][1]) if name in spec else value) for name, value in named.items()})


def _build_validating_strategy() -> type:
    require_flwr()
    from flwr.serverapp.strategy import Strategy

    class ValidatingStrategy(Strategy):
        """Wrap a Flower strategy: drop malformed train replies, log why, record round stats.

        A reply is dropped when its arrays do not have exactly the names, shapes and
        dtypes of the arrays the server sent, hold non-finite values, or its weight
        metric (the inner strategy's ``weighted_by_key``) is not a finite number > 0,
        or a value exceeds the ``policy``'s magnitude bound, or its node (the message's
        ``src_node_id``) already replied in the round (its first reply counts). The weights of the rest
        are capped by the :class:`AggregationPolicy` (default one if None) and
        rewritten to shares; the inner strategy aggregates them; with none left, the
        global model stays. Dropped updates are in ``dropped``, capped ones in
        ``adjusted``, per-round stats in ``rounds`` and the per-node evaluation
        metrics in ``evaluations[server_round][partition_id]``.
        """

        def __init__(self, strategy: Strategy, policy: AggregationPolicy | None = None) -> None:
            if not isinstance(strategy, Strategy):
                raise TypeError(f"strategy must be a flwr.serverapp.strategy.Strategy; got {type(strategy).__name__}")
            if policy is not None and not isinstance(policy, AggregationPolicy):
                raise TypeError(f"policy must be an AggregationPolicy or None; got {type(policy).__name__}")
            self.strategy = strategy
            self.policy = policy if policy is not None else AggregationPolicy()
            self.adjusted: list[AdjustedUpdate] = []
            self.dropped: list[DroppedUpdate] = []
            self.rounds: list[RoundStats] = []
            self.evaluations: dict[int, dict[int, dict[str, float]]] = {}
            self._expected: ArraySpec = {}
            self._started = 0.0
            self._sent = 0
            self._bytes_down = 0

        @property
        def weighted_by_key(self) -> str:
            return str(getattr(self.strategy, "weighted_by_key", "num-examples"))

        def summary(self) -> None:
            self.strategy.summary()

        def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
            self._started = time.perf_counter()
            self._expected = _spec(record_to_numpy(arrays))
            messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
            self._sent = len(messages)
            self._bytes_down = arrays.count_bytes() * len(messages)
            return messages

        def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
            kept, bytes_up, client_rss, client_s = [], 0, [], []
            replied: set[int] = set()  # one reply per node per round: a second one would count its update twice
            for msg in replies:
                node = msg.metadata.src_node_id
                if not msg.has_error():
                    bytes_up += sum(r.count_bytes() for r in msg.content.array_records.values())
                if node in replied:
                    self._drop(server_round, node, f"a second reply in round {server_round}: only the node's first reply counts")
                    continue
                replied.add(node)
                if msg.has_error():
                    kept.append(msg)  # the inner strategy logs transport/client errors itself
                    continue
                problem = _reply_problem(msg.content, self._expected, self.weighted_by_key, self.policy)
                if problem is not None:
                    self._drop(server_round, node, problem)
                    continue
                kept.append(msg)
                (metrics,) = msg.content.metric_records.values()
                client_rss.append(float(cast(float, metrics.get("rss-mb", float("nan")))))
                client_s.append(float(cast(float, metrics.get("train-seconds", float("nan")))))
            good = [m for m in kept if not m.has_error()]
            for msg, note in zip(good, apply_policy([m.content for m in good], self.weighted_by_key, self.policy)):
                if note is not None:
                    node = msg.metadata.src_node_id
                    logger.warning("round %d: capped the weight of node %d: %s", server_round, node, note)
                    self.adjusted.append(AdjustedUpdate(server_round, node, note))
            accepted = len(good)
            self.rounds.append(
                RoundStats(
                    server_round=server_round,
                    sampled=self._sent,
                    accepted=accepted,
                    dropped=sum(d.server_round == server_round for d in self.dropped),
                    bytes_down=self._bytes_down,
                    bytes_up=bytes_up,
                    server_rss_mb=psutil.Process().memory_info().rss / 2**20,
                    max_client_rss_mb=max(client_rss, default=float("nan")),
                    mean_client_train_s=float(np.mean(client_s)) if client_s else float("nan"),
                )
            )
            aggregate, summary = self.strategy.aggregate_train(server_round, kept)
            return (None if aggregate is None else _in_sent_dtypes(aggregate, self._expected)), summary

        def _drop(self, server_round: int, node: int, reason: str) -> None:
            """Leave a reply out of the aggregate: logged, and kept in ``dropped``."""
            logger.warning("round %d: dropped the update of node %d: %s", server_round, node, reason)
            self.dropped.append(DroppedUpdate(server_round, node, reason))

        def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)

        def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
            replies = list(replies)
            per_node = self.evaluations.setdefault(server_round, {})
            for msg in replies:
                if not msg.has_error():
                    for metrics in msg.content.metric_records.values():
                        node = int(cast(float, metrics.get("partition-id", msg.metadata.src_node_id)))
                        per_node[node] = {name: cast(float, value) for name, value in metrics.items()}
            if self.rounds and self.rounds[-1].server_round == server_round:
                self.rounds[-1].seconds = time.perf_counter() - self._started
            aggregated = self.strategy.aggregate_evaluate(server_round, replies)
            if aggregated is not None and "partition-id" in aggregated:
                del aggregated["partition-id"]  # an id, not a metric: its weighted mean means nothing
            return aggregated

    ValidatingStrategy.__module__ = __name__
    return ValidatingStrategy


_VALIDATING_STRATEGY: list[type] = []


def validating_strategy_class() -> type:
    """The validating Flower strategy class, built on first use (Flower is an optional extra)."""
    if not _VALIDATING_STRATEGY:
        _VALIDATING_STRATEGY.append(_build_validating_strategy())
    return _VALIDATING_STRATEGY[0]


def __getattr__(name: str) -> Any:
    """Build :class:`ValidatingStrategy` on first use, so importing this module needs no flwr."""
    if name == "ValidatingStrategy":
        return validating_strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------- simulation
class _WithoutSimulationDeprecation(logging.Filter):
    """Drops flwr 1.42's warning that ``run_simulation`` is deprecated (four lines per call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("DEPRECATED FEATURE") and "run_simulation" in str(record.args))


@contextlib.contextmanager
def without_simulation_deprecation() -> Iterator[None]:
    """Within the block, the ``flwr`` logger drops only its ``run_simulation`` deprecation warning.

    The simulation engine is used on purpose (``flwr run`` is the deployment path); a seed
    sweep would print the warning once per simulation.
    """
    flwr_logger, dropping = logging.getLogger("flwr"), _WithoutSimulationDeprecation()
    flwr_logger.addFilter(dropping)
    try:
        yield
    finally:
        flwr_logger.removeFilter(dropping)


@dataclass
class FleetResult:
    """What a simulated fleet run produced.

    ``evaluations[server_round][partition_id]`` holds each device's metrics
    (``accuracy-<name>``) with the fleet's shared part and its own personal part.
    """

    rounds: list[RoundStats]
    dropped: list[DroppedUpdate]
    evaluations: dict[int, dict[int, dict[str, float]]]
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    adjusted: list[AdjustedUpdate] = field(default_factory=list)

    @property
    def final(self) -> dict[int, dict[str, float]]:
        """Per-device metrics after the last round."""
        return self.evaluations[max(self.evaluations)] if self.evaluations else {}


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name} == {value!r}`, must be an int >= {low}")


def run_fleet_simulation(
    *,
    build_learner: Callable[[int], OnlineLearner],
    train_batches: Callable[[int, int], Iterable[BatchLike]],
    eval_sets: Callable[[int], Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
    personal: PersonalSpec,
    num_devices: int,
    num_rounds: int,
    strategy: Strategy | None = None,
    client_mods: Sequence[Callable[..., Message]] = (),
    client_cpus: float = 1.0,
    round_timeout_s: float = 600.0,
    policy: AggregationPolicy | None = None,
    verbose: bool = False,
) -> FleetResult:
    """Run ``num_devices`` simulated devices for ``num_rounds`` with Flower's simulation engine.

    Arguments are those of :func:`make_client_app`; ``strategy`` defaults to ``FedAvg``
    over all devices and is wrapped in :class:`ValidatingStrategy` with ``policy``. Everything runs on
    this machine (Ray backend, ``client_cpus`` per simulated device). Flower and Ray log
    only warnings and errors unless ``verbose``.
    """
    _check_count("num_devices", num_devices, 1)
    _check_count("num_rounds", num_rounds, 1)
    if not (isinstance(client_cpus, (int, float)) and client_cpus > 0):
        raise ValueError(f"`client_cpus == {client_cpus!r}`, must be > 0")
    require_flwr()
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app = make_client_app(build_learner=build_learner, train_batches=train_batches, eval_sets=eval_sets, personal=personal, mods=client_mods)
    initial = shared_state(build_learner(0).model, personal=personal)
    inner = strategy if strategy is not None else FedAvg(min_train_nodes=num_devices, min_evaluate_nodes=num_devices, min_available_nodes=num_devices)
    guard = validating_strategy_class()(inner, policy)
    outcome: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        record = ArrayRecord({name: Array(array) for name, array in initial.items()})
        outcome["result"] = guard.start(grid=grid, initial_arrays=record, num_rounds=num_rounds, timeout=round_timeout_s)

    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.INFO if verbose else logging.WARNING)  # a round logs ~20 INFO lines
    try:
        with contextlib.nullcontext() if verbose else without_simulation_deprecation():
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=num_devices,
                backend_config={
                    "client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0},
                    "init_args": {"logging_level": "INFO" if verbose else "ERROR", "log_to_driver": verbose},
                },
            )
    finally:
        flwr_logger.setLevel(level)
    if "result" not in outcome:
        raise RuntimeError("the Flower simulation ended without a result; see the Flower log above")
    final = outcome["result"].arrays
    return FleetResult(
        rounds=guard.rounds,
        dropped=guard.dropped,
        evaluations=guard.evaluations,
        adjusted=guard.adjusted,
        shared=record_to_numpy(final) if final is not None else {},
    )
