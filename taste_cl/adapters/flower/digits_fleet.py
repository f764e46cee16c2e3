"""The digits fleet: each device's non-IID, class-incremental partition of sklearn's digits.

:func:`make_fleet` gives each simulated device 2-4 digit classes in a random order and a
disjoint share of their samples, and keeps the held-out digits of every class; a
:class:`Fleet` hands each device its stream slice per round, its held-out sets and the class
it meets after the rounds. The Flower App (:mod:`.app`), the device-runtime SuperNodes
(:mod:`.device_server`), ``taste-cl fleet`` and ``taste-cl bench federated`` all run on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from taste_cl.adapters.flower.device_data import DeviceData, round_batches, round_bounds
from taste_cl.datasets import split_digits
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import accuracy
from taste_cl.reference import build_digits_learner

if TYPE_CHECKING:
    from taste_cl.adapters.flower.app import FleetConfig

__all__ = ["Fleet", "make_fleet"]


@dataclass(frozen=True)
class Fleet:
    """Per-device class sequences and private streams, plus the held-out test set.

    Picklable (plain tensors), so Flower's simulation workers can rebuild each stream.
    """

    classes: list[list[int]]
    x_train: list[torch.Tensor]
    y_train: list[torch.Tensor]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_rounds: int
    batch_size: int
    replay_capacity: int
    seed: int

    def build_learner(self, partition: int) -> OnlineLearner:
        """Every device starts from the same reference learner (FedAvg needs one initialisation)."""
        return build_digits_learner(replay_capacity=self.replay_capacity, seed=self.seed)

    def train_batches(self, partition: int, server_round: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The device's stream slice for ``server_round`` (1-based), in class order."""
        return round_batches(self.x_train[partition], self.y_train[partition], self.num_rounds, self.batch_size, server_round)

    def seen(self, partition: int, server_round: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything the device observed in rounds ``1..server_round`` (it stays on the device)."""
        hi = round_bounds(self.x_train[partition].shape[0], self.num_rounds, server_round)[1]
        return self.x_train[partition][:hi], self.y_train[partition][:hi]

    def device_data(self, partition: int) -> DeviceData:
        """The device's stream and held-out sets as numpy arrays, as a device runtime reads them."""
        return DeviceData(
            self.x_train[partition].numpy(), self.y_train[partition].numpy(), self.x_test.numpy(), self.y_test.numpy(),
            np.asarray(self.classes[partition]), self.num_rounds, self.batch_size, self.new_class(partition),
        )  # fmt: skip

    def new_class(self, partition: int) -> int:
        """The class the device meets after the rounds (``accuracy-new``): one it never saw but another device of
        the fleet holds, when there is one (what a shared model can know and the device cannot)."""
        own = self.classes[partition]
        held = sorted({c for d, classes in enumerate(self.classes) if d != partition for c in classes} - set(own))
        return int(np.random.default_rng([self.seed, partition, 2]).choice(held or [c for c in range(10) if c not in own]))

    def new_class_sets(self, partition: int, server_round: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``(refit set, evaluation set)`` for :meth:`new_class` after ``server_round``
        (:func:`~taste_cl.adapters.flower.device_data.new_class_sets`, as a device runtime computes them)."""
        refit, scored = self.device_data(partition).new_class_sets(server_round, seed=self.seed, partition=partition)
        return (torch.from_numpy(refit[0]), torch.from_numpy(refit[1])), (torch.from_numpy(scored[0]), torch.from_numpy(scored[1]))

    def scores(self, model: torch.nn.Module, partition: int, server_round: int, refit: FleetConfig | None) -> dict[str, float]:
        """The device's accuracies with ``model`` (``accuracy-all``, ``accuracy-own``), each after re-fitting
        a copy of the head on everything seen when ``refit`` is given, plus ``accuracy-new``: its own classes
        and a class new to it, after a re-fit that adds 5 examples of that class (only with ``refit``)."""
        from taste_cl.adapters.flower.app import refit_head

        tuned = model if refit is None else refit_head(model, refit, *self.seen(partition, server_round))
        tuned.eval()
        with torch.no_grad():
            scores = {f"accuracy-{k}": accuracy(tuned, x, y) for k, (x, y) in self.eval_sets(partition).items()}
        if refit is not None:
            refit_set, (x, y) = self.new_class_sets(partition, server_round)
            tuned = refit_head(model, refit, *refit_set)
            tuned.eval()
            with torch.no_grad():
                scores["accuracy-new"] = accuracy(tuned, x, y)
        return scores

    def eval_sets(self, partition: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        own = torch.isin(self.y_test, torch.tensor(self.classes[partition]))
        return {"all": (self.x_test, self.y_test), "own": (self.x_test[own], self.y_test[own])}


def make_fleet(num_devices: int, *, num_rounds: int, batch_size: int = 10, replay_capacity: int = 200, seed: int = 0) -> Fleet:
    """Give each device 2-4 digit classes in a random order and a disjoint share of their samples."""
    rng = np.random.default_rng(seed)
    tasks = split_digits(10, seed=seed)  # in a seeded class order: looked up by class below
    by_class = {task.classes[0]: task for task in tasks}
    classes = [[int(c) for c in rng.choice(10, size=int(rng.integers(2, 5)), replace=False)] for _ in range(num_devices)]
    holders = {c: [d for d in range(num_devices) if c in classes[d]] for c in range(10)}
    shares: dict[tuple[int, int], np.ndarray] = {}
    for c, task in sorted(by_class.items()):
        for d, part in zip(holders[c], np.array_split(rng.permutation(task.x_train.shape[0]), max(len(holders[c]), 1))):
            shares[(d, c)] = part
    x_train, y_train = [], []
    for d in range(num_devices):
        x_train.append(torch.cat([by_class[c].x_train[shares[(d, c)]] for c in classes[d]]))
        y_train.append(torch.cat([by_class[c].y_train[shares[(d, c)]] for c in classes[d]]))
    return Fleet(
        classes=classes,
        x_train=x_train,
        y_train=y_train,
        x_test=torch.cat([t.x_test for t in tasks]),
        y_test=torch.cat([t.y_test for t in tasks]),
        num_rounds=num_rounds,
        batch_size=batch_size,
        replay_capacity=replay_capacity,
        seed=seed,
    )
