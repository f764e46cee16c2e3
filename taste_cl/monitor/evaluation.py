"""Continual-learning metrics over task sequences: accuracy matrix, forgetting, BWT.

``matrix[i][j]`` is the accuracy on task ``j``'s test data after training through task
``i`` (Lopez-Paz & Ranzato, 2017). Average forgetting follows Chaudhry et al. (2018).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["accuracy", "average_forgetting", "backward_transfer"]

Matrix = Sequence[Sequence[float]]


def accuracy(predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``predict`` (features -> logits) on ``(x, y)``."""
    if x.shape[0] == 0:
        raise ValueError("accuracy of an empty set is undefined")
    correct = 0
    for start in range(0, x.shape[0], batch_size):
        logits = predict(x[start : start + batch_size])
        correct += int((logits.argmax(dim=1).cpu() == y[start : start + batch_size].cpu()).sum())
    return correct / x.shape[0]


def average_forgetting(matrix: Matrix) -> float:
    """Mean over all but the last task of (best earlier accuracy - final accuracy)."""
    final = len(matrix) - 1
    if final < 1:
        return 0.0
    drops = [max(matrix[i][j] for i in range(j, final)) - matrix[final][j] for j in range(final)]
    return sum(drops) / len(drops)


def backward_transfer(matrix: Matrix) -> float:
    """Mean over all but the last task of (final accuracy - accuracy right after learning it)."""
    final = len(matrix) - 1
    if final < 1:
        return 0.0
    return sum(matrix[final][j] - matrix[j][j] for j in range(final)) / final
