"""Recorded time series: the small UEA/UCR archive datasets bundled inside aeon's wheel.

People recorded these (speakers, gestures, activities, leaves, appliances); they arrive
with the quirks real data has: variable length, class imbalance, classes with a handful
of samples, labels as strings. Nothing is downloaded: the ``.ts`` files ship inside
``aeon`` (the optional extra ``real``: ``pip install '.[real]'``) under
``aeon/datasets/data/``, and are read with aeon's own ``load_from_ts_file``, which only
opens the local file. ``aeon`` is imported on first use, never when this module is.

:func:`load_recorded` returns both splits as float32 arrays ``(n, channels, length)``.
**Variable-length series are padded** with zeros after their end to the longest series of
either split, and a boolean ``mask`` ``(n, length)`` (True on recorded steps) and the
``lengths`` ``(n,)`` say what is real; equal-length datasets have an all-True mask. Labels
arrive as strings; they become integers ``0..C-1`` in the file header's class order, and
``class_names`` maps them back. :meth:`RecordedSplit.with_mask_channel` appends the mask as
one more input channel (1.0 recorded, 0.0 padding), so one tensor carries both into any
model, replay buffer, Avalanche dataset or device export; :func:`class_incremental_tasks`
splits a dataset into seeded class-incremental :class:`~taste_cl.datasets.Task` s of such
tensors.

>>> from taste_cl.recorded import load_recorded
>>> vowels = load_recorded("JapaneseVowels")  # doctest: +SKIP
>>> vowels.train.x.shape, vowels.n_classes, vowels.variable_length  # doctest: +SKIP
((270, 12, 29), 9, True)
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from taste_cl.datasets import Task
from taste_cl.exceptions import MissingDependencyError

__all__ = [
    "RecordedDataset",
    "RecordedSplit",
    "bundled_datasets",
    "class_incremental_tasks",
    "class_order",
    "data_folder",
    "load_recorded",
]

EXTRA = "real"


def _aeon_loader() -> Any:
    try:
        from aeon.datasets import load_from_ts_file
    except ImportError as error:
        raise MissingDependencyError("aeon", EXTRA) from error
    return load_from_ts_file


def data_folder() -> Path:
    """The folder of datasets inside the installed aeon wheel (``aeon/datasets/data``)."""
    _aeon_loader()
    import aeon.datasets

    return Path(aeon.datasets.__file__).resolve().parent / "data"


def _header(path: Path) -> dict[str, str]:
    """The ``@key value`` lines of a ``.ts`` file before ``@data`` (keys lower-cased)."""
    header: dict[str, str] = {}
    with path.open(encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if not line.startswith("@"):
                continue
            key, _, value = line[1:].partition(" ")
            if key.lower() == "data":
                break
            header[key.lower()] = value.strip()
    return header


@functools.lru_cache(maxsize=1)
def _bundled() -> dict[str, tuple[Path, Path]]:
    found: dict[str, tuple[Path, Path]] = {}
    for train in sorted(data_folder().glob("*/*_TRAIN.ts")):
        name = train.name.removesuffix("_TRAIN.ts")
        test = train.with_name(f"{name}_TEST.ts")
        if test.is_file() and _header(train).get("classlabel", "").lower().startswith("true"):
            found[name] = (train, test)
    return found


def bundled_datasets() -> tuple[str, ...]:
    """Names of the classification datasets with a train and a test split in aeon's wheel."""
    return tuple(sorted(_bundled(), key=str.lower))


@dataclass(frozen=True)
class RecordedSplit:
    """One split: ``x`` float32 ``(n, channels, length)`` zero-padded after each series' end,
    ``mask`` bool ``(n, length)`` (True on recorded steps), ``lengths`` int64 ``(n,)``,
    ``y`` int64 ``(n,)`` (indices into the dataset's ``class_names``)."""

    x: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def with_mask_channel(self) -> np.ndarray:
        """``x`` with the mask appended as a last channel: float32 ``(n, channels + 1, length)``."""
        return np.concatenate([self.x, self.mask[:, None, :].astype(np.float32)], axis=1)

    def class_counts(self, n_classes: int) -> np.ndarray:
        """Samples per class, ``(n_classes,)``."""
        return np.bincount(self.y, minlength=n_classes)


@dataclass(frozen=True)
class RecordedDataset:
    """A bundled dataset: both splits, the class names and where it was read from."""

    name: str
    train: RecordedSplit
    test: RecordedSplit
    class_names: tuple[str, ...]
    files: tuple[str, str]

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    @property
    def n_channels(self) -> int:
        return int(self.train.x.shape[1])

    @property
    def length(self) -> int:
        """The padded length (the longest series of either split)."""
        return int(self.train.x.shape[2])

    @property
    def variable_length(self) -> bool:
        return bool(np.unique(np.concatenate([self.train.lengths, self.test.lengths])).size > 1)

    def class_counts(self) -> dict[str, dict[str, int]]:
        """Samples per class name in each split (the imbalance at a glance)."""
        return {
            split: dict(zip(self.class_names, (int(c) for c in part.class_counts(self.n_classes))))
            for split, part in (("train", self.train), ("test", self.test))
        }


def _series(x: Any) -> list[np.ndarray]:
    """aeon returns an array ``(n, channels, length)`` for equal lengths, else a list of ``(channels, length_i)``."""
    return [np.asarray(item, dtype=np.float64) for item in x]


def _labels(raw: np.ndarray, declared: list[str], path: Path) -> tuple[np.ndarray, tuple[str, ...]]:
    """String labels -> int64 indices in the header's order (aeon may lower-case the values)."""
    names = [str(v) for v in declared] or sorted({str(v) for v in raw})
    index = {name: i for i, name in enumerate(names)} | {name.lower(): i for i, name in enumerate(names)}
    unknown = sorted({str(v) for v in raw} - set(index))
    if unknown:
        raise ValueError(f"{path.name}: labels {unknown} are not among the classes its header declares {names}")
    return np.array([index[str(v)] for v in raw], dtype=np.int64), tuple(names)


def load_recorded(name: str, *, standardize: bool = False) -> RecordedDataset:
    """Load bundled dataset ``name`` (see :func:`bundled_datasets`); nothing is downloaded.

    Series of different lengths are zero-padded at the end to the longest of both splits,
    with ``mask`` and ``lengths`` saying which steps were recorded. ``standardize=True``
    scales each channel to zero mean and unit variance with the training split's recorded
    steps (both splits alike; padding stays 0). Raises ``ValueError`` for a name that is
    not bundled (the message lists those that are) or a series with missing values, and
    :class:`~taste_cl.exceptions.MissingDependencyError` without aeon.
    """
    load = _aeon_loader()
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {type(name).__name__}")
    bundled = _bundled()
    if name not in bundled:
        close = difflib.get_close_matches(name, list(bundled), n=1) or [n for n in bundled if n.lower() == name.lower()]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"`name == {name!r}` is not a dataset bundled with aeon{hint}; bundled: {', '.join(bundled_datasets())}")
    splits: list[tuple[list[np.ndarray], np.ndarray]] = []
    class_names: tuple[str, ...] = ()
    for path in bundled[name]:
        x, raw, meta = load(str(path), return_meta_data=True)
        series = _series(x)
        for i, s in enumerate(series):
            if not np.isfinite(s).all():
                raise ValueError(f"{path.name}: series {i} has missing or non-finite values; these loaders refuse them")
        y, names = _labels(np.asarray(raw), list(meta.get("class_values") or []), path)
        if class_names and names != class_names:
            raise ValueError(f"{name}: the train and test headers declare different classes: {class_names} vs {names}")
        class_names = names
        splits.append((series, y))
    channels = {s.shape[0] for series, _ in splits for s in series}
    if len(channels) != 1:
        raise ValueError(f"{name}: series have different numbers of channels {sorted(channels)}")
    length = max(s.shape[1] for series, _ in splits for s in series)
    parts = [_pad(series, y, length) for series, y in splits]
    if standardize:
        parts = _standardize(parts)
    train_file, test_file = (str(p) for p in bundled[name])
    return RecordedDataset(name, parts[0], parts[1], class_names, (train_file, test_file))


def _pad(series: list[np.ndarray], y: np.ndarray, length: int) -> RecordedSplit:
    n, channels = len(series), series[0].shape[0]
    x = np.zeros((n, channels, length), dtype=np.float32)
    lengths = np.array([s.shape[1] for s in series], dtype=np.int64)
    for i, s in enumerate(series):
        x[i, :, : s.shape[1]] = s
    mask = np.arange(length)[None, :] < lengths[:, None]
    return RecordedSplit(x, mask, lengths, y)


def _standardize(parts: list[RecordedSplit]) -> list[RecordedSplit]:
    train = parts[0]
    weights = train.mask[:, None, :]
    count = weights.sum(axis=(0, 2))
    mean = (train.x * weights).sum(axis=(0, 2)) / count
    var = (((train.x - mean[None, :, None]) * weights) ** 2).sum(axis=(0, 2)) / count
    std = np.where(var > 0, np.sqrt(var), 1.0)
    out = []
    for part in parts:
        x = ((part.x - mean[None, :, None]) / std[None, :, None]) * part.mask[:, None, :]
        out.append(RecordedSplit(x.astype(np.float32), part.mask, part.lengths, part.y))
    return out


def class_order(n_classes: int, seed: int) -> list[int]:
    """The seeded order in which the classes arrive (seed 0 included: every seed permutes)."""
    return [int(c) for c in np.random.default_rng(seed).permutation(n_classes)]


def class_incremental_tasks(dataset: RecordedDataset, classes_per_task: int, *, seed: int = 0) -> list[Task]:
    """Tasks of ``classes_per_task`` new classes each (the last takes the remainder), in a seeded
    class order; inputs carry the mask as their last channel (:meth:`RecordedSplit.with_mask_channel`)
    and labels keep the dataset's class indices."""
    if isinstance(classes_per_task, bool) or not isinstance(classes_per_task, int) or not 1 <= classes_per_task <= dataset.n_classes:
        raise ValueError(f"`classes_per_task == {classes_per_task!r}`, must be an int in [1, {dataset.n_classes}]")
    order = class_order(dataset.n_classes, seed)
    x_train, x_test = (torch.from_numpy(part.with_mask_channel()) for part in (dataset.train, dataset.test))
    y_train, y_test = torch.from_numpy(dataset.train.y), torch.from_numpy(dataset.test.y)
    tasks = []
    for start in range(0, dataset.n_classes, classes_per_task):
        classes = tuple(sorted(order[start : start + classes_per_task]))
        train, test = np.isin(dataset.train.y, classes), np.isin(dataset.test.y, classes)
        tasks.append(Task(classes, x_train[train], y_train[train], x_test[test], y_test[test]))
    return tasks
