"""The digits fleet as one Flower App: the same ServerApp/ClientApp for simulation and deployment.

Every device rebuilds its own partition of the non-IID digits stream
(:func:`taste_cl.benchmarks.federated.make_fleet`) from the run config and its node
config (``partition-id``), so nothing but the shared part of the model travels.
Options, all from the run config (:class:`FleetConfig`):

- FedPer: the personal part (``personal``, default the head) trains on the device with
  everything else and never leaves it; the rest, the shared part, is averaged. (FedBABU,
  the head frozen during the rounds, was withdrawn: it ended below local-only learning on
  both of the benchmark's measures, see docs/federated.md.)
- ``server``: how the server moves the shared part, with Flower's own strategies:
  ``fedavg``, ``fedavgm`` (server momentum, the default) or ``fedadam``.
- ``privacy``: ``off``; ``central`` (Flower's ``DifferentialPrivacyServerSideFixedClipping``:
  the server clips each update and adds Gaussian noise to the aggregate); ``client``
  (``DifferentialPrivacyClientSideFixedClipping`` + ``fixedclipping_mod``: devices clip,
  the server adds the noise); ``local`` (``LocalDpMod``: each device clips and noises
  its own update, so even the server sees only noised updates).
- ``secagg``: the same devices under Flower's SecAgg+ secure aggregation, served by
  the legacy-API twin of this app in :mod:`taste_cl.adapters.flower.secagg`.
- ``device``: ``torch`` (each device trains an eager PyTorch :class:`OnlineLearner`) or
  ``artifacts`` (what real devices run: the server exports the model once, parity-gated,
  and each device trains the ONNX Runtime artifacts with the torch-free device learner,
  :mod:`taste_cl.adapters.flower.device_client`; only the shared tensors travel).

The module-level ``server_app`` and ``client_app`` read their :class:`FleetConfig`
from the run config (``flwr run``); :func:`make_fleet_apps` builds a pair with a fixed
config (for ``run_simulation``, which has no run config). When ``out-dir`` is set, the
server writes ``result.json`` and ``server.npz`` (the final shared arrays) there and
each device writes ``device-<partition>.npz`` (its whole model after loading the
final aggregate), so a caller outside the processes can check them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import psutil
import torch
from torch import nn

from taste_cl._checks import check_int
from taste_cl.adapters.flower.fleet import (
    AggregationPolicy,
    DroppedUpdate,
    RoundStats,
    load_shared,
    persist_to_context,
    record_to_numpy,
    reply_to,
    require_flwr,
    restore_from_context,
    shared_state,
    validating_strategy_class,
)
from taste_cl.adapters.flower.updates import personal_predicate, privacy_mod

if TYPE_CHECKING:
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from taste_cl.adapters.flower.digits_fleet import Fleet
    from taste_cl.learner import OnlineLearner

__all__ = [
    "FleetConfig",
    "client_app",
    "evaluate_device",
    "fit_device",
    "make_fleet_apps",
    "read_outputs",
    "refit_head",
    "server_app",
    "write_outputs",
]

PRIVACY = ("off", "central", "client", "local")
SERVERS = ("fedavg", "fedavgm", "fedadam")
DEVICES = ("torch", "artifacts")


@dataclass(frozen=True)
class FleetConfig:
    """One fleet run. Field names map to run-config keys with ``_`` -> ``-``.

    ``personal`` holds comma-separated ``state_dict`` name prefixes kept on the device
    (default: the head). ``clip`` is the L2 clipping norm of a model update,
    ``noise`` the noise multiplier (central/client DP), ``epsilon``/``delta`` the
    per-round budget of local DP. ``server`` is the server's optimizer
    (FedAvgM by default: plain FedAvg only matched local-only learning at 10 devices x 10
    rounds), ``server_momentum`` and ``server_lr`` FedAvgM's momentum and learning rate, and
    ``server_eta`` FedAdam's step size. A server learning rate of 2 moves the shared part twice
    the mean update: averaging non-IID updates cancels part of each device's progress (chosen
    on seeds 5-9, torch runtime: own-class accuracy 0.952 against 0.940 at 1 and 0.933 local
    only at 10 devices x 10 rounds; 0.965 against 0.960 and 0.962 at 3 x 2). With
    ``evaluate_every_round=False`` devices are evaluated after the last round only (fewer
    messages, hence fewer ClientApp process starts in a deployment). Before each evaluation
    every device re-fits its head on a throwaway copy: ``finetune_steps`` of SGD at
    ``finetune_lr`` on everything it has observed, against the shared part it just received
    (:attr:`finetunes_head`; 0 turns it off). ``secagg`` runs the same devices under
    Flower's SecAgg+ protocol (:mod:`taste_cl.adapters.flower.secagg`): the server sees
    only the sum of the updates; it needs at least 3 devices and cannot be combined
    with ``privacy="central"`` (the server would have to clip single updates).
    ``device="artifacts"`` trains the exported ONNX Runtime artifacts on every device
    without torch (with ``secagg`` too: the SecAgg+ app then serves the device runtime's
    legacy-API twin).
    """

    devices: int = 3
    rounds: int = 2
    personal: str = "4."
    privacy: str = "off"
    clip: float = 1.0
    noise: float = 0.1
    epsilon: float = 10.0
    delta: float = 1e-5
    server: str = "fedavgm"
    server_momentum: float = 0.5
    server_lr: float = 2.0
    server_eta: float = 0.03
    finetune_steps: int = 300
    finetune_lr: float = 0.1
    evaluate_every_round: bool = True
    secagg: bool = False
    device: str = "torch"
    seed: int = 0
    out_dir: str = ""

    def __post_init__(self) -> None:
        for name in ("devices", "rounds"):
            value = getattr(self, name)
            check_int(name, value, 1)
        if self.privacy not in PRIVACY:
            raise ValueError(f"`privacy == {self.privacy!r}`, must be one of {PRIVACY}")
        if self.device not in DEVICES:
            raise ValueError(f"`device == {self.device!r}`, must be one of {DEVICES}")
        if self.server not in SERVERS:
            raise ValueError(f"`server == {self.server!r}`, must be one of {SERVERS}")
        if not 0.0 <= float(self.server_momentum) < 1.0:
            raise ValueError(f"`server_momentum == {self.server_momentum!r}`, must be in [0, 1)")
        for name in ("clip", "epsilon", "delta", "finetune_lr", "server_eta", "server_lr"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"`{name} == {getattr(self, name)!r}`, must be > 0")
        if not float(self.noise) >= 0 or self.finetune_steps < 0:
            raise ValueError(f"`noise` and `finetune_steps` must be >= 0; got {self.noise!r}, {self.finetune_steps!r}")
        if not self.prefixes:
            raise ValueError(f"`personal == {self.personal!r}`, must name at least one state_dict prefix")
        if self.secagg and self.devices < 3:
            raise ValueError(f"`devices == {self.devices}` with `secagg=True`, must be >= 3 (with 2 the average reveals the other update)")
        if self.secagg and self.privacy == "central":
            raise ValueError("`privacy == 'central'` with `secagg=True`: the server cannot clip updates it cannot see; use 'client' or 'local'")

    @property
    def finetunes_head(self) -> bool:
        """Whether each device re-fits its head on its own data before it is evaluated.

        FedPer's head was trained against the device's own body, not the aggregate it then
        receives, and on a class-incremental stream it favours the latest classes; the re-fit on all it has
        seen took FedPer from 0.819 to 0.949 and FedPer + central DP from 0.677 to 0.962 (3 x 2,
        seeds 0-4, device runtime). Local-only learning gains as much from the same re-fit
        (0.792 to 0.961), so benchmarks give it the same (``run_local(refit=config)`` in
        :mod:`taste_cl.benchmarks.federated`). The re-fit also scores ``accuracy-new``: a second
        re-fit adds 5 examples of a class new to the device
        (:meth:`~taste_cl.benchmarks.federated.Fleet.scores`).
        """
        return self.finetune_steps > 0

    @property
    def aggregate_noise_std(self) -> float:
        """The standard deviation of the Gaussian noise central or client DP adds to each
        coordinate of the aggregate every round (Flower's ``noise * clip / devices``); 0 without it.

        That noise is a regularizer too: local-only learning with the same noise added to its
        shared tensors each round gains own-class accuracy (10 devices x 10 rounds, seeds 0-4,
        torch runtime: 0.936 without, 0.951 at 0.01 (noise 0.1), 0.972 at 0.03 (noise 0.3)).
        """
        return self.noise * self.clip / self.devices if self.privacy in ("central", "client") else 0.0

    @property
    def prefixes(self) -> list[str]:
        """The personal ``state_dict`` name prefixes."""
        return [p for p in self.personal.split(",") if p]

    def to_run_config(self) -> dict[str, Any]:
        """The run-config keys and values (TOML scalars) of this config."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FleetConfig:
        """Read a config from Flower's run config; missing keys keep their defaults."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            key = f.name.replace("_", "-")
            if key in run_config:
                value, default = run_config[key], cast(Any, f.default)
                kwargs[f.name] = value if isinstance(default, bool) else type(default)(value)
        return cls(**kwargs)


@functools.lru_cache(maxsize=4)
def cached_fleet(devices: int, rounds: int, seed: int) -> Fleet:
    """The digits fleet of ``devices`` devices, built once per process (the ServerApp and every ClientApp share it)."""
    from taste_cl.adapters.flower.digits_fleet import make_fleet

    return make_fleet(devices, num_rounds=rounds, seed=seed)


def _config(fixed: FleetConfig | None, context: Context) -> FleetConfig:
    return fixed if fixed is not None else FleetConfig.from_run_config(context.run_config)


def _train_only_personal(model: nn.Module, is_personal: Callable[[str], bool]) -> None:
    """Let only the personal parameters receive gradients."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_personal(name))


def refit_head(model: nn.Module, cfg: FleetConfig, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """A copy of ``model`` whose personal part (the head) took ``finetune_steps`` SGD steps on ``(x, y)``."""
    tuned = copy.deepcopy(model)
    _train_only_personal(tuned, personal_predicate(cfg.prefixes))
    params = [p for p in tuned.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=cfg.finetune_lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    tuned.train()
    for _ in range(cfg.finetune_steps):
        idx = torch.randint(x.shape[0], (min(32, x.shape[0]),), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(tuned(x[idx]), y[idx]).backward()
        optimizer.step()
    tuned.eval()
    return tuned


def _device(cfg: FleetConfig, context: Context, shared: Mapping[str, np.ndarray]) -> tuple[int, OnlineLearner]:
    """This device's learner with the fleet's ``shared`` part loaded."""
    torch.set_num_threads(1)  # devices on one host share its cores
    partition = int(context.node_config["partition-id"])
    if not 0 <= partition < cfg.devices:
        raise ValueError(f"node config `partition-id == {partition}`, must be in [0, devices={cfg.devices})")
    fleet = cached_fleet(cfg.devices, cfg.rounds, cfg.seed)
    learner = restore_from_context(context, fleet.build_learner(partition))
    load_shared(learner.model, shared, personal=cfg.prefixes)
    return partition, learner


def _server_round(msg: Message) -> int:
    return int(cast(int, msg.content.config_records["config"]["server-round"]))


def fit_device(
    cfg: FleetConfig, context: Context, shared: Mapping[str, np.ndarray], server_round: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One device's round: load ``shared``, observe its stream slice, keep its state in ``context``.

    Returns the device's new shared part and its metrics (``num-examples`` first).
    Both apps (Message API and SecAgg+) train through this function.
    """
    partition, learner = _device(cfg, context, shared)
    fleet = cached_fleet(cfg.devices, cfg.rounds, cfg.seed)
    start, samples = time.perf_counter(), 0
    for batch in fleet.train_batches(partition, server_round):
        samples += learner.observe(batch).samples
    persist_to_context(context, learner)
    metrics = {
        "num-examples": max(samples, 1),
        "train-seconds": time.perf_counter() - start,
        "rss-mb": psutil.Process().memory_info().rss / 2**20,
    }
    return shared_state(learner.model, personal=cfg.prefixes), metrics


def _train(fixed: FleetConfig | None, msg: Message, context: Context) -> Message:
    from flwr.app import Array, ArrayRecord, MetricRecord

    cfg = _config(fixed, context)
    shared, metrics = fit_device(cfg, context, record_to_numpy(msg.content.array_records["arrays"]), _server_round(msg))
    return reply_to(msg, {"arrays": ArrayRecord({k: Array(v) for k, v in shared.items()}), "metrics": MetricRecord(metrics)})


def evaluate_device(cfg: FleetConfig, context: Context, shared: Mapping[str, np.ndarray], server_round: int) -> dict[str, Any]:
    """Score one device (the fleet's ``shared`` part + its personal part) on its held-out sets
    (:meth:`~taste_cl.benchmarks.federated.Fleet.scores`, after the head re-fit when the config asks for it).

    With ``out_dir`` set, the last round also saves the device's whole model there.
    """
    partition, learner = _device(cfg, context, shared)
    if cfg.out_dir and server_round == cfg.rounds:
        state = {k: v.detach().cpu().numpy() for k, v in learner.model.state_dict().items()}
        np.savez(Path(cfg.out_dir) / f"device-{partition}.npz", **state)
    fleet = cached_fleet(cfg.devices, cfg.rounds, cfg.seed)
    scores = fleet.scores(learner.model, partition, server_round, cfg if cfg.finetunes_head else None)
    return {"partition-id": partition, **scores, "num-examples": int(fleet.eval_sets(partition)["own"][1].shape[0])}


def _evaluate(fixed: FleetConfig | None, msg: Message, context: Context) -> Message:
    from flwr.app import MetricRecord

    cfg = _config(fixed, context)
    metrics = evaluate_device(cfg, context, record_to_numpy(msg.content.array_records["arrays"]), _server_round(msg))
    return reply_to(msg, {"metrics": MetricRecord(metrics)})


def _privacy_mod(fixed: FleetConfig | None) -> Callable[..., Message]:
    """A client mod applying the configured Flower privacy mod to train messages."""

    def mod(msg: Message, context: Context, call_next: Callable[..., Message]) -> Message:
        from flwr.app import MessageType

        cfg = _config(fixed, context)
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        return privacy_mod(cfg.privacy, cfg.clip, cfg.epsilon, cfg.delta)(msg, context, call_next)

    return mod


def _strategy(cfg: FleetConfig) -> Any:
    """Flower's FedAvg, FedAvgM or FedAdam over every device, inside the configured DP wrapper, inside :class:`ValidatingStrategy`."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
        FedAdam,
        FedAvg,
        FedAvgM,
    )

    n = cfg.devices
    nodes: dict[str, Any] = {"min_train_nodes": n, "min_evaluate_nodes": n, "min_available_nodes": n}
    inner: Any = FedAvg(**nodes)
    if cfg.server == "fedavgm":
        inner = FedAvgM(**nodes, server_momentum=cfg.server_momentum, server_learning_rate=cfg.server_lr)
    elif cfg.server == "fedadam":
        inner = FedAdam(**nodes, eta=cfg.server_eta)
    if cfg.privacy == "central":
        inner = DifferentialPrivacyServerSideFixedClipping(inner, cfg.noise, cfg.clip, n)
    elif cfg.privacy == "client":
        inner = DifferentialPrivacyClientSideFixedClipping(inner, cfg.noise, cfg.clip, n)
    guard = validating_strategy_class()(inner, AggregationPolicy())
    if not cfg.evaluate_every_round:
        configure_evaluate = guard.configure_evaluate

        def last_round_only(server_round: int, *args: Any) -> Any:
            return configure_evaluate(server_round, *args) if server_round == cfg.rounds else []

        guard.configure_evaluate = last_round_only
    return guard


def _server_main(fixed: FleetConfig | None, grid: Grid, context: Context) -> None:
    from flwr.app import Array, ArrayRecord, ConfigRecord

    cfg = _config(fixed, context)
    fleet = cached_fleet(cfg.devices, cfg.rounds, cfg.seed)
    guard = _strategy(cfg)
    start = time.perf_counter()
    settings: dict[str, Any] = {}
    folder = Path(cfg.out_dir) / "artifacts" if cfg.out_dir else Path(tempfile.mkdtemp(prefix="taste-cl-fleet-"))
    try:
        if cfg.device == "artifacts":  # exported once; each device reads it (a real fleet would ship it)
            from taste_cl.adapters.flower.device_server import export_fleet

            initial = export_fleet(cfg, fleet, folder)
            settings = {**cfg.to_run_config(), "artifacts": str(folder)}  # the device's settings
        else:
            initial = shared_state(fleet.build_learner(0).model, personal=cfg.prefixes)
        record = ArrayRecord({k: Array(v) for k, v in initial.items()})
        result = guard.start(
            grid=grid, initial_arrays=record, num_rounds=cfg.rounds, train_config=ConfigRecord(settings), evaluate_config=ConfigRecord(settings)
        )
    finally:
        if not cfg.out_dir:
            shutil.rmtree(folder, ignore_errors=True)
    if cfg.out_dir:
        final = record_to_numpy(result.arrays)
        write_outputs(cfg, final, time.perf_counter() - start, guard.rounds, guard.dropped, guard.evaluations)


def write_outputs(
    cfg: FleetConfig,
    server: Mapping[str, np.ndarray],
    seconds: float,
    rounds: list[RoundStats],
    dropped: list[DroppedUpdate],
    evaluations: Mapping[int, Mapping[int, Mapping[str, Any]]],
) -> None:
    """Write ``server.npz`` (the final shared arrays) and ``result.json`` to ``cfg.out_dir``."""
    out = Path(cfg.out_dir)
    np.savez(out / "server.npz", **server)  # type: ignore[arg-type]
    summary = {
        "config": cfg.to_run_config(),
        "seconds": seconds,
        "rounds": [asdict(r) for r in rounds],
        "dropped": [asdict(d) for d in dropped],
        "evaluations": {str(r): {str(p): dict(m) for p, m in nodes.items()} for r, nodes in evaluations.items()},
    }
    (out / "result.json").write_text(json.dumps(summary, indent=1, default=float))


def make_fleet_apps(config: FleetConfig | None = None) -> tuple[ServerApp, ClientApp]:
    """A ``(ServerApp, ClientApp)`` pair; with ``config=None`` both read the run config.

    The ClientApp is the PyTorch one, or with ``config.device == "artifacts"`` the
    device-runtime one (:mod:`.device_client`, which takes its settings from each message).
    """
    require_flwr()
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    if config is not None and not (isinstance(config, FleetConfig) and not config.secagg):
        raise TypeError(f"config must be a FleetConfig with secagg=False (see flower_secagg), or None; got {config!r}")
    sapp = ServerApp()

    @sapp.main()
    def main(grid: Grid, context: Context) -> None:
        _server_main(config, grid, context)

    if config is not None and config.device == "artifacts":
        from taste_cl.adapters.flower.device_client import make_device_client_app

        return sapp, make_device_client_app()
    capp = ClientApp(mods=[_privacy_mod(config)])

    @capp.train()
    def train(msg: Message, context: Context) -> Message:
        return _train(config, msg, context)

    @capp.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return _evaluate(config, msg, context)

    return sapp, capp


def read_outputs(out_dir: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[int, dict[str, np.ndarray]]]:
    """``(result.json, server arrays, {partition: device state})`` written by a run with ``out-dir``."""
    out = Path(out_dir)
    result = json.loads((out / "result.json").read_text())
    with np.load(out / "server.npz", allow_pickle=False) as data:
        server = {k: data[k] for k in data.files}
    devices = {}
    for path in sorted(out.glob("device-*.npz")):
        with np.load(path, allow_pickle=False) as data:
            devices[int(path.stem.split("-")[1])] = {k: data[k] for k in data.files}
    return result, server, devices


server_app, client_app = make_fleet_apps()
