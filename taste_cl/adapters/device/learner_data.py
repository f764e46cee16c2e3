"""What the device exporters read from an :class:`~taste_cl.OnlineLearner`: buffered rows and task targets, and what they refuse.

Both exporters (ONNX Runtime, ExecuTorch) ship the learner's replay buffer and check parity
on buffered rows, and both must give the device targets shaped like the learner's (a
regression target ``(n,)`` for an ``(n, 1)`` output becomes ``(n, 1)``, as the learner's
:class:`~taste_cl.tasks.Task` makes it). The rows are read from the buffer's
``state_dict()`` (``x`` one tensor, or a list of leaves plus ``x_spec`` for structured
inputs), so the buffer's random stream is not advanced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._batch import Spec, batch_len, unflatten
from taste_cl.adapters.device.artifacts import ExportError
from taste_cl.guards.probe import ProbeGuard
from taste_cl.replay import ReplayStrategy
from taste_cl.strategies import ExperienceReplay
from taste_cl.tasks import Task

if TYPE_CHECKING:
    from taste_cl.learner import OnlineLearner

__all__ = ["BufferedRows", "buffered_rows", "check_device_trains_alike", "synthetic_example", "task_targets"]


@dataclass(frozen=True)
class BufferedRows:
    """The samples a buffer holds (``x`` in the learner's input structure), its capacity and counters."""

    x: Any
    y: torch.Tensor
    capacity: int
    seen: int
    seed: int = 0

    def __len__(self) -> int:
        return int(self.y.shape[0])


def buffered_rows(replay: ReplayStrategy | None) -> BufferedRows | None:
    """The rows of ``replay`` (None for no buffer or an empty one); :class:`ExportError` if its state has no storage."""
    if replay is None:
        return None
    state = replay.state_dict()
    storage = state.get("storage") if isinstance(state, dict) else None
    if not isinstance(storage, dict) or "size" not in storage:
        raise ExportError(
            f"cannot export a {type(replay).__name__} buffer: its state_dict() has no 'storage' (a BufferStorage state); pass include_replay=False"
        )
    size = int(storage["size"])
    if not size:
        return None
    x = storage["x"] if "x_spec" not in storage else unflatten(Spec.from_json(storage["x_spec"]), list(storage["x"]))
    seen = state.get("seen")  # a reservoir counts one stream; a class-balanced buffer one per class
    total = sum(seen) if isinstance(seen, list) else seen if isinstance(seen, int) else size
    return BufferedRows(x, storage["y"], int(replay.capacity), max(int(total), size), int(state.get("seed", 0)))


def task_targets(task: Task | None, x: Any, y: Any, output_shape: tuple[int, ...]) -> torch.Tensor:
    """``y`` validated and shaped by ``task`` for outputs ``(n, *output_shape)`` (as the learner does), on the CPU.

    Float targets become float32; with no task (a loss taste_cl does not know) ``y`` is kept as given.
    """
    if task is None:
        return torch.as_tensor(y).detach().cpu()
    return task.to_targets(y, n=batch_len(x), output_shape=output_shape, dtype=torch.float32, device=torch.device("cpu"))


def synthetic_example(learner: OnlineLearner, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rows`` seeded rows in [0, 1) of the learner's ``input_shape`` with labels below its
    ``num_classes``: the shape-fixing, parity-checking batch of a learner whose buffer holds too
    few rows (one exported before it observed anything). Only for one float input tensor and
    class labels; None otherwise (token ids, structured inputs, regression: the caller asks
    for ``example``)."""
    spec, task = learner.input_spec, learner.task
    if spec is None or not spec.is_tensor or spec.leaf != "float" or learner.num_classes is None:
        return None
    if task is not None and task.name != "classification":
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.rand((rows, *spec.shape), generator=generator)
    return x, torch.randint(0, learner.num_classes, (rows,), generator=generator)


def check_device_trains_alike(learner: OnlineLearner) -> None:
    """``ExportError`` for a learner whose steps the device runtimes would not take alike.

    Gradient clipping (``max_grad_norm``) is not in the exported training graphs: the device
    would train unclipped, unlike the learner it was exported from. The ONNX Runtime training and
    ExecuTorch learners train plain replay only: a learner with ER-ACE, DER++, LwF or a strategy of
    its own would continue as plain replay there, and one with a ``ProbeGuard`` would keep the windows
    it rolls back, so both are refused, naming the backend that carries them.
    """
    if type(learner.strategy) is not ExperienceReplay:
        raise ExportError(
            f"this learner's strategy is {type(learner.strategy).__name__} ({learner.strategy.name!r}) and the ONNX Runtime "
            "training and ExecuTorch device learners train plain replay only: the device would drop it; export with "
            "backend='onnx_engine', whose loop trains ER-ACE, DER++ and LwF, or build the learner with strategy='er' to "
            "accept plain replay on the device"
        )
    if learner.max_grad_norm is not None:
        raise ExportError(
            f"this learner clips its gradients (max_grad_norm={learner.max_grad_norm:g}) and the device runtimes do not: "
            "they would train unclipped; export with backend='onnx_engine', which clips, or set learner.max_grad_norm = None "
            "before export to accept that"
        )
    guards = [type(plugin).__name__ for plugin in learner.plugins if isinstance(plugin, ProbeGuard)]
    if guards:
        raise ExportError(
            f"this learner rolls back harmful windows ({guards[0]}) and the ONNX Runtime training and ExecuTorch device learners "
            "do not: the device would keep them; export with backend='onnx_engine', whose loop carries the probe guard, or "
            "remove the plugin before export to accept that"
        )
