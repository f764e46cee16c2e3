"""The digits fleet under Flower's SecAgg+ secure aggregation (``FleetConfig(secagg=True)``).

The same devices and training as :mod:`taste_cl.adapters.flower.app`, but the shared
part travels through Flower's own SecAgg+ protocol: ``secaggplus_mod`` on every device
and ``SecAggPlusWorkflow`` on the server. Each device quantizes its weighted update,
adds pairwise masks agreed with its neighbours plus a private mask, and uploads only
the masked integers; the masks cancel in the sum, so the server learns the weighted
*average* of the shared parts and nothing about any single one (as long as fewer than
the reconstruction threshold of a device's neighbours collude with it).

In flwr 1.42 SecAgg+ exists only for the legacy API: the server runs
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` on a ``LegacyContext`` with a
``flwr.server.strategy`` strategy, and the device is a ``NumPyClient``. This module
wraps both around the app's shared :func:`~taste_cl.adapters.flower.app.fit_device`
and :func:`~taste_cl.adapters.flower.app.evaluate_device`, so training, data and
personalization are identical to the plain app. With ``device="artifacts"`` the server
exports the fleet's artifacts as the plain app does and the devices run the torch-free
twin, :data:`taste_cl.adapters.flower.device_client.secagg_client_app`; the settings
travel in the fit and evaluate configs.

What moves where, compared with the plain app's :class:`AggregationPolicy`:

- Per-update checks (names, shapes, finiteness, and no value that SecAgg+ would clip:
  :func:`~taste_cl.adapters.flower.updates.check_secagg_upload`) run **on the
  device** before masking: a device whose update fails them raises, its reply is an
  error, and SecAgg+ treats it as dropped (its masks are rebuilt from the shares).
  An honest-but-broken device is caught; a malicious one is not.
- The claimed ``num-examples`` is capped on the device at SecAgg+'s ``max_weight``
  (:data:`MAX_WEIGHT`); a value that the quantizer would clip to ``±CLIPPING_RANGE``
  after scaling by ``weight / MAX_WEIGHT`` is refused on the device.
- ``max_share`` (no device above a share of the weight) **cannot** be enforced: the
  server never sees single weights. The server checks the *aggregate* instead (shape,
  finiteness, ``max_abs_value``) and keeps the previous model if it fails.
- Quantization noise: values are stochastically rounded to steps of
  ``2 * CLIPPING_RANGE / 2**22`` (about 4e-6) after scaling by ``weight / MAX_WEIGHT``,
  so the aggregate differs from plain FedAvg by about 1e-5 per value.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import psutil

from taste_cl.adapters.flower.app import FleetConfig, evaluate_device, fit_device, write_outputs
from taste_cl.adapters.flower.fleet import (
    AggregationPolicy,
    DroppedUpdate,
    InvalidUpdateError,
    RoundStats,
    check_update,
    require_flwr,
    shared_state,
)
from taste_cl.adapters.flower.updates import (
    CLIPPING_RANGE,
    MAX_WEIGHT,
    RECONSTRUCTION_THRESHOLD,
    SHARES,
    array_spec,
    check_secagg_upload,
    named_arrays,
    privacy_mod,
)

if TYPE_CHECKING:
    from flwr.app import Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

__all__ = ["CLIPPING_RANGE", "MAX_WEIGHT", "RECONSTRUCTION_THRESHOLD", "SHARES", "make_secagg_apps"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _initial(cfg: FleetConfig) -> dict[str, np.ndarray]:
    """The fleet's common initial shared part; its names, order, shapes and dtypes are the wire format."""
    from taste_cl.adapters.flower.app import cached_fleet

    return shared_state(cached_fleet(cfg.devices, cfg.rounds, cfg.seed).build_learner(0).model, personal=cfg.prefixes)


def _client_class() -> type:
    from flwr.client import NumPyClient

    class SecAggDevice(NumPyClient):
        """One device speaking the legacy NumPyClient API that ``secaggplus_mod`` wraps."""

        def __init__(self, cfg: FleetConfig, context: Context) -> None:
            self.cfg, self.ctx = cfg, context

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            shared, metrics = fit_device(self.cfg, self.ctx, named_arrays(_initial(self.cfg), parameters), int(config["server-round"]))
            weight = min(int(metrics.pop("num-examples")), int(MAX_WEIGHT))
            check_secagg_upload(shared, array_spec(_initial(self.cfg)), weight)  # the server cannot check a masked update
            return list(shared.values()), weight, metrics

        def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
            metrics = evaluate_device(self.cfg, self.ctx, named_arrays(_initial(self.cfg), parameters), int(config["server-round"]))
            return 1.0 - float(metrics["accuracy-all"]), int(metrics["num-examples"]), metrics

    return SecAggDevice


def _content_bytes(msg: Message) -> int:
    return _payload_bytes(msg.content) if msg.has_content() else 0


def _payload_bytes(content: RecordDict) -> int:
    """Payload bytes of a message's content: arrays, metrics and config values (keys included)."""
    total = sum(r.count_bytes() for records in (content.array_records, content.metric_records) for r in records.values())
    for record in content.config_records.values():  # ConfigRecord.count_bytes fails on empty lists (flwr 1.42)
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            total += len(key) + sum(len(v) if isinstance(v, (str, bytes)) else 1 if isinstance(v, bool) else 8 for v in values)
    return total


class _CountingGrid:
    """A Grid that counts the payload bytes of every message each way, per round (``group_id``).

    SecAgg+ spends four message exchanges per round (keys, shares, masked vectors,
    unmasking), all in config records, so the plain app's ArrayRecord count would miss them.
    """

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.down: dict[str, int] = {}
        self.up: dict[str, int] = {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        for msg in messages:
            self.down[msg.metadata.group_id] = self.down.get(msg.metadata.group_id, 0) + _content_bytes(msg)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for msg in replies:
            self.up[msg.metadata.group_id] = self.up.get(msg.metadata.group_id, 0) + _content_bytes(msg)
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


@functools.lru_cache(maxsize=3)
def _strategy_class(aggregator: str) -> type:
    """The SecAgg+ server strategy on Flower's legacy ``FedAvg``, ``FedAvgM`` or ``FedAdam`` (``FleetConfig.server``)."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAdam, FedAvg, FedAvgM

    base: Any = {"fedavg": FedAvg, "fedavgm": FedAvgM, "fedadam": FedAdam}[aggregator]

    class SecAggStrategy(base):
        """Legacy strategy for SecAgg+: the replies already carry the securely averaged shared part.

        SecAgg+ puts its average into every reply; this strategy checks that aggregate
        (shape, finiteness, magnitude), hands it to the base strategy's server step
        (FedAvg keeps it; FedAvgM and FedAdam move from the previous model towards it,
        as in the plain app), casts the result to the shared dtypes, and keeps the
        bookkeeping of the plain app (``rounds``, ``dropped``, ``evaluations``).
        """

        def __init__(
            self, cfg: FleetConfig, grid: _CountingGrid, initial: Mapping[str, np.ndarray], settings: Mapping[str, Any] | None = None
        ) -> None:
            """``initial``: the shared part (its names, order and dtypes are the wire format); ``settings``: sent with every config."""
            n = cfg.devices
            extra = dict(settings or {})
            fedavgm = {"server_momentum": cfg.server_momentum, "server_learning_rate": cfg.server_lr}
            options = {"fedavgm": fedavgm, "fedadam": {"eta": cfg.server_eta}}.get(aggregator, {})
            super().__init__(
                **options,
                fraction_fit=1.0,
                fraction_evaluate=1.0,
                min_fit_clients=n,
                min_evaluate_clients=n,
                min_available_clients=n,
                initial_parameters=ndarrays_to_parameters(list(initial.values())),
                on_fit_config_fn=lambda r: {**extra, "server-round": r},
                on_evaluate_config_fn=lambda r: {**extra, "server-round": r},
            )
            self.cfg, self.grid, self.initial = cfg, grid, dict(initial)
            self.rounds: list[RoundStats] = []
            self.dropped: list[DroppedUpdate] = []
            self.evaluations: dict[int, dict[int, dict[str, float]]] = {}
            self._started = 0.0

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            self._started = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> tuple[Any, dict[str, Any]]:
            for failure in failures:
                reason = f"device failed or refused its update: {failure}"
                logger.warning("round %d: %s", server_round, reason)
                self.dropped.append(DroppedUpdate(server_round, -1, reason))
            metrics = [fitres.metrics for _, fitres in results]
            group = str(server_round)
            self.rounds.append(
                RoundStats(
                    server_round=server_round,
                    sampled=self.cfg.devices,
                    accepted=len(results),
                    dropped=len(failures),
                    bytes_down=self.grid.down.get(group, 0),
                    bytes_up=self.grid.up.get(group, 0),
                    server_rss_mb=psutil.Process().memory_info().rss / 2**20,
                    max_client_rss_mb=max((float(m.get("rss-mb", float("nan"))) for m in metrics), default=float("nan")),
                    mean_client_train_s=float(np.mean([float(m.get("train-seconds", float("nan"))) for m in metrics])) if metrics else float("nan"),
                )
            )
            if not results:
                return None, {}
            try:  # every reply holds the same aggregate (SecAgg+ wrote it there)
                aggregate = named_arrays(self.initial, parameters_to_ndarrays(results[0][1].parameters))
                check_update(aggregate, array_spec(self.initial))
                problem = AggregationPolicy().value_problem(aggregate)
            except InvalidUpdateError as error:
                problem = str(error)
            if problem is not None:
                logger.warning("round %d: kept the previous model, the secure aggregate is invalid: %s", server_round, problem)
                self.dropped.append(DroppedUpdate(server_round, -1, f"aggregate: {problem}"))
                return None, {}
            average = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(list(aggregate.values())), 1, {})
            stepped, _ = super().aggregate_fit(server_round, [(results[0][0], average)], [])
            return ndarrays_to_parameters(list(named_arrays(self.initial, parameters_to_ndarrays(stepped)).values())), {}

        def configure_evaluate(self, server_round: int, parameters: Any, client_manager: Any) -> Any:
            if not self.cfg.evaluate_every_round and server_round != self.cfg.rounds:
                return []
            return super().configure_evaluate(server_round, parameters, client_manager)

        def aggregate_evaluate(self, server_round: int, results: Any, failures: Any) -> tuple[float | None, dict[str, Any]]:
            per_node = self.evaluations.setdefault(server_round, {})
            for _, res in results:
                per_node[int(res.metrics["partition-id"])] = {k: float(v) for k, v in res.metrics.items()}
            if self.rounds and self.rounds[-1].server_round == server_round:
                self.rounds[-1].seconds = time.perf_counter() - self._started
            losses = [res.loss for _, res in results]
            return (float(np.mean(losses)) if losses else None), {}

    SecAggStrategy.__name__ = SecAggStrategy.__qualname__ = f"SecAgg{base.__name__}"
    return SecAggStrategy


def _server_main(fixed: FleetConfig | None, grid: Grid, context: Context) -> None:
    cfg = fixed if fixed is not None else FleetConfig.from_run_config(context.run_config)
    folder = Path(cfg.out_dir) / "artifacts" if cfg.out_dir else Path(tempfile.mkdtemp(prefix="taste-cl-fleet-"))
    try:
        _run_workflow(cfg, grid, context, folder)
    finally:
        if not cfg.out_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _run_workflow(cfg: FleetConfig, grid: Grid, context: Context, folder: Path) -> None:
    """The SecAgg+ rounds; with ``device="artifacts"`` first export the fleet under ``folder`` (as the plain app does)."""
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    start = time.perf_counter()
    settings = None
    if cfg.device == "artifacts":  # exported once; each device reads it (a real fleet would ship it)
        from taste_cl.adapters.flower.app import cached_fleet
        from taste_cl.adapters.flower.device_server import export_fleet

        initial = export_fleet(cfg, cached_fleet(cfg.devices, cfg.rounds, cfg.seed), folder)
        settings = {**cfg.to_run_config(), "artifacts": str(folder)}
    else:
        initial = _initial(cfg)
    counting = _CountingGrid(grid)
    strategy = _strategy_class(cfg.server)(cfg, counting, initial, settings)
    outer: Any = strategy
    if cfg.privacy == "client":  # devices clip (fixedclipping_mod); the server noises the secure sum
        outer = DifferentialPrivacyClientSideFixedClipping(strategy, cfg.noise, cfg.clip, cfg.devices)
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=cfg.rounds), strategy=outer)
    workflow = DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(
            num_shares=SHARES, reconstruction_threshold=RECONSTRUCTION_THRESHOLD, max_weight=MAX_WEIGHT, clipping_range=CLIPPING_RANGE
        )
    )
    workflow(cast("Grid", counting), legacy)
    if cfg.out_dir:
        final = parameters_to_ndarrays(compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True))
        write_outputs(cfg, named_arrays(initial, final), time.perf_counter() - start, strategy.rounds, strategy.dropped, strategy.evaluations)


def _privacy_mod(fixed: FleetConfig | None) -> Callable[..., Message]:
    """The legacy (FitRes-speaking) Flower DP mod the config asks for, inside ``secaggplus_mod``."""

    def mod(msg: Message, context: Context, call_next: Callable[..., Message]) -> Message:
        cfg = fixed if fixed is not None else FleetConfig.from_run_config(context.run_config)
        return privacy_mod(cfg.privacy, cfg.clip, cfg.epsilon, cfg.delta, legacy=True)(msg, context, call_next)

    return mod


def make_secagg_apps(config: FleetConfig | None = None) -> tuple[ServerApp, ClientApp]:
    """A ``(ServerApp, ClientApp)`` pair running the fleet under SecAgg+; ``None`` reads the run config.

    With ``config.device == "artifacts"`` the ClientApp is the torch-free device runtime's
    (:func:`~taste_cl.adapters.flower.device_client.make_device_secagg_client_app`).
    """
    require_flwr()
    from flwr.client import ClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.server import ServerApp

    if config is not None and not (isinstance(config, FleetConfig) and config.secagg):
        raise TypeError(f"config must be a FleetConfig with secagg=True, or None; got {config!r}")
    sapp = ServerApp()

    @sapp.main()
    def main(grid: Grid, context: Context) -> None:
        _server_main(config, grid, context)

    if config is not None and config.device == "artifacts":
        from taste_cl.adapters.flower.device_client import make_device_secagg_client_app

        return sapp, make_device_secagg_client_app()
    device = _client_class()

    def client_fn(context: Context) -> Any:
        cfg = config if config is not None else FleetConfig.from_run_config(context.run_config)
        return device(cfg, context).to_client()

    return sapp, ClientApp(client_fn=client_fn, mods=[secaggplus_mod, _privacy_mod(config)])


server_app, client_app = make_secagg_apps()
