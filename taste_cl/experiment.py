"""Run an OnlineLearner over a class-incremental task sequence and score it.

Shared by ``taste-cl demo``, the benchmarks and the tests, so all report the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from taste_cl.datasets import Task, stream
from taste_cl.learner import OnlineLearner
from taste_cl.monitor.evaluation import accuracy, average_forgetting, backward_transfer

__all__ = ["StreamResult", "run_class_incremental"]


@dataclass
class StreamResult:
    """Accuracy matrix, final accuracy over all classes, forgetting and speed of one run."""

    accuracy_matrix: list[list[float]]
    final_accuracy: float
    forgetting: float
    backward_transfer: float
    samples: int
    train_seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (samples seen, accuracy on all test data)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds else float("nan")


def run_class_incremental(
    learner: OnlineLearner,
    tasks: Sequence[Task],
    *,
    batch_size: int = 10,
    seed: int = 0,
    curve_every: int = 0,
    progress: bool = False,
) -> StreamResult:
    """One pass over ``tasks`` in order, stream batches of ``batch_size``; evaluate after each task.

    ``train_seconds`` counts only ``observe`` calls, not evaluation.
    """
    x_all = torch.cat([task.x_test for task in tasks])
    y_all = torch.cat([task.y_test for task in tasks])
    total = sum(task.x_train.shape[0] for task in tasks)
    matrix: list[list[float]] = []
    curve: list[tuple[int, float]] = []
    train_seconds, seen, current = 0.0, 0, 0
    with tqdm(total=total, unit="sample", disable=not progress, desc="stream") as bar:
        for task_index, x, y in stream(tasks, batch_size, seed=seed):
            if task_index != current:
                matrix.append([accuracy(learner.predict, t.x_test, t.y_test) for t in tasks])
                current = task_index
            start = time.perf_counter()
            learner.observe((x, y))
            train_seconds += time.perf_counter() - start
            seen += x.shape[0]
            bar.update(x.shape[0])
            if curve_every and (seen // batch_size) % curve_every == 0:
                curve.append((seen, accuracy(learner.predict, x_all, y_all)))
    matrix.append([accuracy(learner.predict, t.x_test, t.y_test) for t in tasks])
    return StreamResult(
        accuracy_matrix=matrix,
        final_accuracy=accuracy(learner.predict, x_all, y_all),
        forgetting=average_forgetting(matrix),
        backward_transfer=backward_transfer(matrix),
        samples=seen,
        train_seconds=train_seconds,
        curve=curve,
    )
