"""taste_cl.recorded: the UEA/UCR datasets bundled in aeon's wheel load without the network,
and each quirk of recorded data is handled or refused clearly (variable length, class
imbalance, a class with fewer samples than the buffer's share, labels as strings)."""

from __future__ import annotations

import socket
import sys
from typing import Any

import numpy as np
import pytest
import torch

from taste_cl import ClassBalancedReplay
from taste_cl.exceptions import MissingDependencyError
from taste_cl.recorded import bundled_datasets, class_incremental_tasks, class_order, data_folder, load_recorded

pytest.importorskip("aeon")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every attempt to open a connection fails (and is recorded)."""
    attempts: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        attempts.append(args)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def test_bundled_datasets_load_with_the_network_blocked(no_network: list[Any]) -> None:
    names = bundled_datasets()
    assert {"JapaneseVowels", "BasicMotions", "PickupGestureWiimoteZ", "OSULeaf", "GunPoint", "ArrowHead"} <= set(names)
    for name in ("JapaneseVowels", "BasicMotions", "PickupGestureWiimoteZ"):
        dataset = load_recorded(name)
        assert len(dataset.train) and len(dataset.test)
        assert all(str(data_folder()) in path for path in dataset.files)
    assert no_network == []  # nothing even tried to connect


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("JapaneseVowel", ValueError, r"not a dataset bundled with aeon \(did you mean 'JapaneseVowels'\?\); bundled: .*BasicMotions"),
        ("basicmotions", ValueError, r"did you mean 'BasicMotions'"),
        ("PLAID", ValueError, r"`name == 'PLAID'` is not a dataset bundled with aeon; bundled: ACSF1, ArrowHead"),
        (3, TypeError, r"`name` must be a str, got int"),
    ],
)
def test_unknown_names_are_refused_with_the_bundled_list(name: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_recorded(name)


def test_variable_length_is_padded_with_a_mask() -> None:
    vowels = load_recorded("JapaneseVowels")
    assert vowels.variable_length and vowels.length == 29 and vowels.n_channels == 12
    for split in (vowels.train, vowels.test):
        assert split.x.dtype == np.float32 and split.mask.dtype == np.bool_ and split.lengths.dtype == np.int64
        assert split.x.shape == (len(split), 12, 29) and split.mask.shape == (len(split), 29)
        np.testing.assert_array_equal(split.mask.sum(1), split.lengths)
        assert (split.x * ~split.mask[:, None, :] == 0).all()  # zeros after each series' end
        packed = split.with_mask_channel()
        assert packed.shape == (len(split), 13, 29) and np.array_equal(packed[:, -1], split.mask.astype(np.float32))
    assert vowels.train.lengths.min() == 7 and vowels.train.lengths.max() <= 29
    gestures = load_recorded("PickupGestureWiimoteZ")
    assert gestures.variable_length and gestures.length == max(gestures.train.lengths.max(), gestures.test.lengths.max())
    assert not load_recorded("BasicMotions").variable_length and load_recorded("BasicMotions").train.mask.all()


def test_standardize_uses_training_statistics_and_keeps_padding_zero() -> None:
    vowels = load_recorded("JapaneseVowels", standardize=True)
    valid = vowels.train.x.transpose(1, 0, 2)[:, vowels.train.mask]  # (channels, recorded steps)
    np.testing.assert_allclose(valid.mean(1), 0, atol=1e-4)
    np.testing.assert_allclose(valid.std(1), 1, atol=1e-3)
    assert (vowels.test.x * ~vowels.test.mask[:, None, :] == 0).all()


def test_string_labels_become_integers_with_class_names() -> None:
    from aeon.datasets import load_from_ts_file

    motions = load_recorded("BasicMotions")
    assert motions.class_names == ("standing", "running", "walking", "badminton")  # the header's order (aeon lower-cases)
    _, raw = load_from_ts_file(motions.files[0])
    assert [motions.class_names[i] for i in motions.train.y] == [str(v) for v in raw]
    assert motions.train.y.dtype == np.int64 and set(motions.train.y.tolist()) == {0, 1, 2, 3}


def test_class_imbalance_is_kept_and_reported() -> None:
    counts = load_recorded("JapaneseVowels").class_counts()
    assert set(counts["train"].values()) == {30}
    test = counts["test"]
    assert sum(test.values()) == 370 and min(test.values()) == 24 and max(test.values()) == 88


def test_a_class_with_fewer_samples_than_the_buffer_share_keeps_all_of_them() -> None:
    gestures = load_recorded("PickupGestureWiimoteZ")
    assert set(gestures.class_counts()["train"].values()) == {5}  # 5 recordings per subject
    replay = ClassBalancedReplay(100, seed=0)  # a share of 10 per class over 10 classes: more than any class has
    x, y = torch.from_numpy(gestures.train.with_mask_channel()), torch.from_numpy(gestures.train.y)
    for rows in torch.arange(len(y)).split(10):
        replay.add(x[rows], y[rows])
    assert replay.class_counts() == dict.fromkeys(range(10), 5) and len(replay) == 50  # every recording kept, none twice
    sample_x, sample_y = replay.sample(20)
    assert sample_x.shape == (20, 2, gestures.length) and sample_y.shape == (20,)


def test_digit_strings_are_class_names_not_numbers() -> None:
    vowels = load_recorded("JapaneseVowels")  # speakers labelled "1" .. "9"
    assert vowels.class_names == tuple(str(i) for i in range(1, 10))
    assert vowels.train.y.min() == 0 and vowels.train.y.max() == 8  # indices into class_names, not int("9")
    assert vowels.class_names[int(vowels.train.y[0])] == "1"


def test_an_imbalanced_training_split_is_kept_and_the_buffer_balances_what_it_holds() -> None:
    leaves = load_recorded("OSULeaf")  # 15 to 53 training outlines per species
    counts = leaves.class_counts()["train"]
    assert min(counts.values()) == 15 and max(counts.values()) == 53 and sum(counts.values()) == len(leaves.train) == 200
    tasks = class_incremental_tasks(leaves, 2, seed=0)
    assert {c: int((t.y_train == c).sum()) for t in tasks for c in t.classes} == {leaves.class_names.index(k): v for k, v in counts.items()}
    replay = ClassBalancedReplay(60, seed=0)  # a share of 10 per class over 6 classes
    x, y = torch.from_numpy(leaves.train.with_mask_channel()), torch.from_numpy(leaves.train.y)
    for rows in torch.arange(len(y)).split(10):
        replay.add(x[rows], y[rows])
    assert replay.class_counts() == dict.fromkeys(range(6), 10)  # the rarest class keeps its share


def _tiny_dataset(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, train_rows: str) -> None:
    """A two-class ``.ts`` dataset "Tiny" standing in for the bundled ones."""
    import taste_cl.recorded as recorded

    header = "@problemName Tiny\n@timeStamps false\n@missing true\n@univariate true\n@equalLength false\n@classLabel true up down\n@data\n"
    (tmp_path / "Tiny_TRAIN.ts").write_text(header + train_rows)
    (tmp_path / "Tiny_TEST.ts").write_text(header + "1.0,2.0:up\n")
    monkeypatch.setattr(recorded, "_bundled", lambda: {"Tiny": (tmp_path / "Tiny_TRAIN.ts", tmp_path / "Tiny_TEST.ts")})


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ("1.0,2.0,3.0:up\n1.0,?,3.0:down\n", r"Tiny_TRAIN\.ts: series 1 has missing or non-finite values; these loaders refuse them"),
        (
            "1.0,2.0,3.0:up\n1.0,2.0:sideways\n",
            r"Tiny_TRAIN\.ts: labels \['sideways'\] are not among the classes its header declares \['up', 'down'\]",
        ),
    ],
)
def test_missing_values_and_undeclared_labels_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, rows: str, match: str) -> None:
    _tiny_dataset(monkeypatch, tmp_path, rows)
    with pytest.raises(ValueError, match=match):
        load_recorded("Tiny")


def test_a_small_variable_length_file_loads_padded_with_string_labels(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    _tiny_dataset(monkeypatch, tmp_path, "1.0,2.0,3.0:down\n4.0:up\n")
    tiny = load_recorded("Tiny")
    assert tiny.class_names == ("up", "down") and tiny.train.y.tolist() == [1, 0] and tiny.length == 3
    np.testing.assert_array_equal(tiny.train.x[:, 0], [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    np.testing.assert_array_equal(tiny.train.mask, [[True, True, True], [True, False, False]])
    assert tiny.train.lengths.tolist() == [3, 1] and tiny.test.x.shape == (1, 1, 3)


def test_class_incremental_tasks_follow_a_seeded_order() -> None:
    vowels = load_recorded("JapaneseVowels")
    tasks = class_incremental_tasks(vowels, 3, seed=1)
    assert [c for t in tasks for c in t.classes] != list(range(9)) or class_order(9, 1) == list(range(9))
    assert sorted(c for t in tasks for c in t.classes) == list(range(9)) and len(tasks) == 3
    assert sum(t.y_train.numel() for t in tasks) == 270 and sum(t.y_test.numel() for t in tasks) == 370
    for task in tasks:
        assert set(task.y_train.tolist()) == set(task.classes) and task.x_train.shape[1:] == (13, 29)
    again = class_incremental_tasks(vowels, 3, seed=1)
    assert [t.classes for t in again] == [t.classes for t in tasks]
    assert [len(t.classes) for t in class_incremental_tasks(vowels, 4, seed=0)] == [4, 4, 1]  # the last takes the remainder
    with pytest.raises(ValueError, match=r"`classes_per_task == 0`, must be an int in \[1, 9\]"):
        class_incremental_tasks(vowels, 0)


def test_without_aeon_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aeon.datasets", None)
    with pytest.raises(MissingDependencyError, match=r"'aeon' is required .*pip install '\.\[real\]'"):
        load_recorded("BasicMotions")


def test_importing_the_module_does_not_import_aeon() -> None:
    import subprocess

    code = "import sys, taste_cl.recorded; assert not any(m == 'aeon' or m.startswith('aeon.') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
