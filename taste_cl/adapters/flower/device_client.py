"""The fleet's ClientApp as a device runs it: the exported artifacts train, torch is never imported.

A real device has no PyTorch: it trains the on-device artifacts the server exported once
(:func:`taste_cl.adapters.flower.device_server.export_fleet`, parity-gated) with the
torch-free :class:`~taste_cl.adapters.onnxruntime.runtime.OrtOnlineLearner`. This module
imports numpy, psutil, flwr and (on first use) ``onnxruntime`` only, so a ``flwr-clientapp``
process running it stays small. Per message the node:

1. opens its learner: the server's folder in the first round, afterwards its own saved
   folder, kept in the node's ``context.state`` (personal tensors, replay buffer, optimizer
   state and counters never leave the device);
2. checks the shared arrays it received against its own shared part and loads them by name;
3. ``train``: observes its stream slice for the round (test-then-train with replay) and
   replies with its shared tensors only; ``evaluate``: scores its held-out sets after
   ``finetune-steps`` SGD steps of the head on a throwaway copy
   (:attr:`~taste_cl.adapters.flower.app.FleetConfig.finetunes_head`), and a class new to
   it after a second re-fit that adds 5 examples of it (:func:`score_on_device`).

Everything the node needs comes in the message's config record (the server sends its
:class:`~taste_cl.adapters.flower.app.FleetConfig` plus the ``artifacts`` folder), and its
data from ``<artifacts>/data/partition-<id>.npz`` (on loopback the server writes every
device's partition there; on a real fleet the data is the device's own).

``secagg_client_app`` is the same device under SecAgg+ (``FleetConfig(secagg=True)``):
Flower's ``secaggplus_mod`` around a legacy ``NumPyClient`` (in flwr 1.42 SecAgg+ speaks
only the legacy records), whose shared arrays arrive and leave as an ordered list named
after the device's own shared tensors. Before masking, the device checks its update
(:func:`~taste_cl.adapters.flower.updates.check_secagg_upload`) and caps its weight at
``MAX_WEIGHT``; the server never sees a single update.
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import psutil

from taste_cl.adapters.device.artifacts import check_plain_name
from taste_cl.adapters.device.loader import load_learner
from taste_cl.adapters.flower.device_data import DATA_FOLDER, FINETUNE_FOLDER, TRAIN_FOLDER, DeviceData
from taste_cl.adapters.flower.updates import (
    MAX_WEIGHT,
    array_spec,
    check_secagg_upload,
    check_update,
    named_arrays,
    personal_predicate,
    privacy_mod,
    require_flwr,
)

if TYPE_CHECKING:
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

__all__ = [
    "client_app",
    "evaluate_on_device",
    "fit_on_device",
    "make_device_client_app",
    "make_device_secagg_client_app",
    "refit_head_on_device",
    "score_on_device",
    "secagg_client_app",
]

STATE_KEY = "taste_cl-device"


# ------------------------------------------------------------------------ the node
def _settings(msg: Message) -> Mapping[str, Any]:
    """The device's settings: the run's FleetConfig keys, ``artifacts`` and ``server-round``."""
    return cast(Mapping[str, Any], msg.content.config_records["config"])


def _partition(context: Context, settings: Mapping[str, Any]) -> int:
    partition = int(cast(int, context.node_config["partition-id"]))
    devices = int(settings["devices"])
    if not 0 <= partition < devices:
        raise ValueError(f"node config `partition-id == {partition}`, must be in [0, devices={devices})")
    return partition


def _open(context: Context, settings: Mapping[str, Any], work: Path) -> Any:
    """The node's learner: its saved folder from ``context.state``, else the server's artifacts."""
    saved = context.state.config_records.get(STATE_KEY)
    if saved is None:
        return load_learner(Path(str(settings["artifacts"])) / TRAIN_FOLDER)
    folder = work / "state"
    folder.mkdir()
    for name, data in saved.items():
        (folder / check_plain_name(name)).write_bytes(cast(bytes, data))
    return load_learner(folder)  # every file is hash-checked against the manifest before use


def _persist(context: Context, learner: Any, work: Path) -> None:
    from flwr.app import ConfigRecord

    folder = learner.save(work / "saved", web=False)  # no browser files: they need onnx (and, installed, torch)
    context.state[STATE_KEY] = ConfigRecord({path.name: path.read_bytes() for path in sorted(folder.iterdir())})


def _is_personal(settings: Mapping[str, Any]) -> Callable[[str], bool]:
    return personal_predicate([p for p in str(settings["personal"]).split(",") if p])


Arrays = Mapping[str, np.ndarray] | Sequence[np.ndarray]
"""Shared arrays by name (Message API), or as a list in the order of the device's shared tensors (SecAgg+)."""


def _own_shared(learner: Any, is_personal: Callable[[str], bool]) -> dict[str, np.ndarray]:
    return {name: value for name, value in learner.parameters().items() if not is_personal(name)}


def _load_shared(learner: Any, arrays: Arrays, is_personal: Callable[[str], bool]) -> None:
    """Check the received arrays against this device's shared part, then load them (a bad update changes nothing).

    A list is named after the device's shared tensors in order and cast to their dtypes
    (SecAgg+ dequantizes to float64).
    """
    own = _own_shared(learner, is_personal)
    shared = dict(arrays) if isinstance(arrays, Mapping) else named_arrays(own, arrays)
    check_update(shared, array_spec(own))
    learner.load_parameters(shared)


def _data(settings: Mapping[str, Any], partition: int) -> DeviceData:
    return DeviceData.load(Path(str(settings["artifacts"])) / DATA_FOLDER / f"partition-{partition}.npz")


def fit_on_device(settings: Mapping[str, Any], context: Context, arrays: Arrays) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One device's round: load the shared ``arrays``, observe the round's stream slice, keep the state in ``context``.

    Returns the device's new shared tensors and its metrics (``num-examples`` first).
    """
    partition, is_personal = _partition(context, settings), _is_personal(settings)
    with tempfile.TemporaryDirectory(prefix="taste-cl-device-") as tmp:
        learner = _open(context, settings, Path(tmp))
        _load_shared(learner, arrays, is_personal)
        start, samples = time.perf_counter(), 0
        for batch in _data(settings, partition).batches(int(settings["server-round"])):
            samples += learner.observe(batch).samples
        seconds = time.perf_counter() - start
        _persist(context, learner, Path(tmp))
        shared = _own_shared(learner, is_personal)
    return shared, {"num-examples": max(samples, 1), "train-seconds": seconds, "rss-mb": psutil.Process().memory_info().rss / 2**20}


def refit_head_on_device(learner: Any, head: Path, x: np.ndarray, y: np.ndarray, *, steps: int, lr: float, seed: int) -> Any:
    """The device learner's model in the ``head`` artifacts (only the head trains there) after
    ``steps`` SGD steps at ``lr`` on batches of 32 drawn from ``(x, y)``: the device-runtime twin
    of :func:`~taste_cl.adapters.flower.app.refit_head`."""
    tuner = load_learner(head)
    tuner.load_parameters(learner.parameters())
    tuner.lr = lr
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, y.shape[0], size=min(32, y.shape[0]))
        tuner.train_step(x[idx], y[idx])
    return tuner


def score_on_device(
    learner: Any, data: DeviceData, head: Path | None, *, steps: int, lr: float, seed: int, partition: int, server_round: int
) -> dict[str, Any]:
    """The device's accuracies on its held-out sets (``accuracy-all``, ``accuracy-own``), after re-fitting a copy
    of its head in the ``head`` artifacts on everything it has seen (no re-fit when ``head`` is None), and
    ``accuracy-new``: its own classes and one class new to it, after a re-fit that adds 5 examples of that class
    (:func:`~taste_cl.adapters.flower.device_data.new_class_sets`; only with a re-fit)."""
    refit = functools.partial(refit_head_on_device, learner, head, steps=steps, lr=lr, seed=seed) if head is not None else None
    model = learner if refit is None else refit(*data.seen(server_round))
    metrics: dict[str, Any] = {}
    for name, (x, y) in data.eval_sets().items():
        metrics[f"accuracy-{name}"] = _accuracy(model, x, y)
        metrics["num-examples"] = int(y.shape[0])
    if refit is not None:
        refit_set, (x, y) = data.new_class_sets(server_round, seed=seed, partition=partition)
        metrics["accuracy-new"] = _accuracy(refit(*refit_set), x, y)
    return metrics


def _accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float((model.predict(x).argmax(axis=1) == y).mean()) if y.shape[0] else float("nan")


def evaluate_on_device(settings: Mapping[str, Any], context: Context, arrays: Arrays) -> dict[str, Any]:
    """Score the device (shared ``arrays`` + its personal part) with :func:`score_on_device` and the run's settings.

    With ``out-dir`` set, the last round also saves the device's whole model there.
    """
    partition, server_round = _partition(context, settings), int(settings["server-round"])
    steps = int(settings["finetune-steps"])
    head = Path(str(settings["artifacts"])) / FINETUNE_FOLDER if steps > 0 else None
    with tempfile.TemporaryDirectory(prefix="taste-cl-device-") as tmp:
        learner = _open(context, settings, Path(tmp))
        _load_shared(learner, arrays, _is_personal(settings))
        if settings["out-dir"] and server_round == int(settings["rounds"]):
            np.savez(Path(str(settings["out-dir"])) / f"device-{partition}.npz", **learner.parameters())
        scores = score_on_device(
            learner, _data(settings, partition), head, steps=steps, lr=float(settings["finetune-lr"]),
            seed=int(settings["seed"]), partition=partition, server_round=server_round,
        )  # fmt: skip
    return {"partition-id": partition, **scores}


def _received(msg: Message) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in msg.content.array_records["arrays"].items()}


def _train(msg: Message, context: Context) -> Message:
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    shared, metrics = fit_on_device(_settings(msg), context, _received(msg))
    content: dict[str, Any] = {"arrays": ArrayRecord({k: Array(v) for k, v in shared.items()}), "metrics": MetricRecord(metrics)}
    return Message(content=RecordDict(content), reply_to=msg)


def _evaluate(msg: Message, context: Context) -> Message:
    from flwr.app import Message, MetricRecord, RecordDict

    metrics = evaluate_on_device(_settings(msg), context, _received(msg))
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _privacy(msg: Message, context: Context, call_next: Callable[..., Message]) -> Message:
    """The client-side privacy the server asked for in the train config (see :func:`privacy_mod`)."""
    from flwr.app import MessageType

    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    settings = _settings(msg)
    mod = privacy_mod(str(settings["privacy"]), float(settings["clip"]), float(settings["epsilon"]), float(settings["delta"]))
    return mod(msg, context, call_next)


def make_device_client_app() -> ClientApp:
    """The device-runtime ClientApp (its settings arrive with each message, so one app serves every run)."""
    require_flwr()
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[_privacy])
    app.train()(_train)
    app.evaluate()(_evaluate)
    return app


def _secagg_privacy(msg: Message, context: Context, call_next: Callable[..., Message]) -> Message:
    """The legacy-record twin of :func:`_privacy`, inside ``secaggplus_mod`` (its settings are the fit config)."""
    from flwr.app import MessageType

    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    settings = cast(Mapping[str, Any], msg.content.config_records["fitins.config"])
    mod = privacy_mod(str(settings["privacy"]), float(settings["clip"]), float(settings["epsilon"]), float(settings["delta"]), legacy=True)
    return mod(msg, context, call_next)


def _secagg_client_class() -> type:
    from flwr.client import NumPyClient

    class SecAggDevice(NumPyClient):
        """The device runtime as the legacy ``NumPyClient`` that ``secaggplus_mod`` wraps; ``config`` holds its settings."""

        def __init__(self, context: Context) -> None:
            self.ctx = context

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            shared, metrics = fit_on_device(config, self.ctx, parameters)
            weight = min(int(metrics.pop("num-examples")), int(MAX_WEIGHT))
            check_secagg_upload(shared, array_spec(shared), weight)
            return list(shared.values()), weight, metrics

        def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
            metrics = evaluate_on_device(config, self.ctx, parameters)
            return 1.0 - float(metrics["accuracy-all"]), int(metrics["num-examples"]), metrics

    return SecAggDevice


def make_device_secagg_client_app() -> ClientApp:
    """The device-runtime ClientApp under SecAgg+: ``secaggplus_mod`` around the legacy client, the DP mod inside."""
    require_flwr()
    from flwr.client import ClientApp
    from flwr.client.mod import secaggplus_mod

    device = _secagg_client_class()
    return ClientApp(client_fn=lambda context: device(context).to_client(), mods=[secaggplus_mod, _secagg_privacy])


client_app = make_device_client_app()
secagg_client_app = make_device_secagg_client_app()
