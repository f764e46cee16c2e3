"""Built-in data for demos, benchmarks and tests: nothing is downloaded.

``split_digits`` turns scikit-learn's bundled handwritten digits (1797 8x8 images) into
a class-incremental sequence of tasks, the standard "split" continual-learning setup.
The small models here (``make_mlp``, ``make_cnn``, ``TextClassifier``) are the ones the
benchmarks and the test zoo train.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["Task", "TextClassifier", "make_cnn", "make_mlp", "make_pattern_images", "split_digits", "stream"]


@dataclass(frozen=True)
class Task:
    """One task of a class-incremental stream: its classes and train/test tensors."""

    classes: tuple[int, ...]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def split_digits(n_tasks: int = 5, *, test_fraction: float = 0.25, seed: int = 0) -> list[Task]:
    """Split sklearn digits into ``n_tasks`` tasks of disjoint classes (features scaled to [0, 1])."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 1 <= n_tasks <= 10 or 10 % n_tasks:
        raise ValueError(f"`n_tasks == {n_tasks}`, must divide the 10 digit classes")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    order = np.random.default_rng(seed).permutation(10) if seed else np.arange(10)
    per_task = 10 // n_tasks
    tasks = []
    for t in range(n_tasks):
        classes = tuple(int(c) for c in sorted(order[t * per_task : (t + 1) * per_task]))
        train, test = np.isin(y_train, classes), np.isin(y_test, classes)
        tasks.append(
            Task(
                classes,
                torch.from_numpy(x_train[train]),
                torch.from_numpy(y_train[train]),
                torch.from_numpy(x_test[test]),
                torch.from_numpy(y_test[test]),
            )
        )
    return tasks


def stream(tasks: Sequence[Task], batch_size: int, *, seed: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(task_index, x, y)`` batches: tasks in order, samples shuffled within a task, one pass."""
    generator = torch.Generator().manual_seed(seed)
    for index, task in enumerate(tasks):
        order = torch.randperm(task.x_train.shape[0], generator=generator)
        for start in range(0, order.numel(), batch_size):
            picks = order[start : start + batch_size]
            yield index, task.x_train[picks], task.y_train[picks]


def make_mlp(in_features: int = 64, hidden: int = 128, n_classes: int = 10, *, seed: int = 0) -> nn.Module:
    """A small two-hidden-layer MLP with seeded initialisation."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )
    finally:
        torch.set_rng_state(generator_state)


def make_cnn(n_classes: int = 10, *, channels: int = 3, seed: int = 0) -> nn.Module:
    """The 3-conv CNN used for throughput benchmarks (3x32x32 inputs by default)."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, n_classes),
        )
    finally:
        torch.set_rng_state(generator_state)


def make_pattern_images(n: int, *, n_classes: int = 10, size: int = 32, noise: float = 0.6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated 3-channel images: each class is a fixed random low-frequency pattern plus noise."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(n_classes, 3, 4, 4, generator=generator)
    patterns = nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.randint(0, n_classes, (n,), generator=generator)
    x = patterns[y] + noise * torch.randn(n, 3, size, size, generator=generator)
    return x, y


class TextClassifier(nn.Module):
    """Embedding + 2-layer TransformerEncoder over integer tokens with a padding mask.

    Takes a dict ``{"input_ids": (n, t) int, "attention_mask": (n, t) 0/1}`` (called as
    ``model(**x)``) and averages the unmasked positions before the linear head.
    """

    def __init__(self, vocab: int = 50, dim: int = 32, classes: int = 4, *, feedforward: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=feedforward, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0))
