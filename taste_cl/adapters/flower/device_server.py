"""The server's side of a fleet of device runtimes: export the starting model once, parity-gated.

With ``FleetConfig(device="artifacts")`` the ServerApp calls :func:`export_fleet` before
the first round. It writes, under one folder that every device can read:

- ``train/``: ONNX Runtime training artifacts of the fleet's reference learner (model,
  loss, SGD, an empty replay buffer of the learner's capacity), published only if the
  device trains like PyTorch (the parity gate of :func:`taste_cl.adapters.device.export`);
- ``finetune/`` (when :attr:`FleetConfig.finetunes_head`): the same model with only the
  head trainable, plain SGD at ``finetune_lr``, which each device uses on a throwaway copy
  before it is evaluated;
- ``data/partition-<id>.npz``: each device's partition (loopback only: on a real fleet
  the data is the device's own).

Only ONNX Runtime artifacts are written: its runtime imports no torch, which is the point
(the ExecuTorch runtime's Python bindings import torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from taste_cl.adapters.device import export
from taste_cl.adapters.flower.device_data import DATA_FOLDER, FINETUNE_FOLDER, TRAIN_FOLDER
from taste_cl.adapters.flower.updates import personal_predicate
from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

if TYPE_CHECKING:
    import torch

    from taste_cl.adapters.flower.app import FleetConfig
    from taste_cl.adapters.flower.digits_fleet import Fleet
    from taste_cl.learner import OnlineLearner

__all__ = ["export_fleet", "export_head"]

_EXAMPLE_ROWS = 8


def export_head(learner: OnlineLearner, folder: Path, cfg: FleetConfig, example: tuple[torch.Tensor, torch.Tensor]) -> Path:
    """Artifacts of ``learner`` in which only the head (``cfg.personal``) trains, with plain SGD at
    ``cfg.finetune_lr`` and no replay: what a device re-fits its head with before evaluation."""
    is_personal = personal_predicate(cfg.prefixes)
    personal = [name for name, _ in learner.model.named_parameters() if is_personal(name)]
    if not personal:
        raise ValueError(f"`personal == {cfg.personal!r}` names no parameter: the device re-fits a head (`finetune_steps > 0`)")
    return export(
        learner, folder, backend="onnxruntime", example=example, trainable=personal, optimizer="sgd", lr=cfg.finetune_lr, include_replay=False
    )


def export_fleet(cfg: FleetConfig, fleet: Fleet, folder: Path) -> dict[str, np.ndarray]:
    """Write the fleet's artifacts and data under ``folder``; return the initial shared arrays by name."""
    learner = fleet.build_learner(0)
    is_personal = personal_predicate(cfg.prefixes)
    example = (fleet.x_train[0][:_EXAMPLE_ROWS], fleet.y_train[0][:_EXAMPLE_ROWS])
    export(learner, folder / TRAIN_FOLDER, backend="onnxruntime", example=example)
    if cfg.finetunes_head:
        export_head(learner, folder / FINETUNE_FOLDER, cfg, example)
    (folder / DATA_FOLDER).mkdir()
    for partition in range(cfg.devices):
        fleet.device_data(partition).save(folder / DATA_FOLDER / f"partition-{partition}.npz")
    device = OrtOnlineLearner.from_artifacts(folder / TRAIN_FOLDER)
    return {name: value for name, value in device.parameters().items() if not is_personal(name)}
