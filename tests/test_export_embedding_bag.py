"""An ``nn.EmbeddingBag`` recommender with dict inputs, from the PyTorch learner to both device runtimes.

The model predicts the category a user is shopping for from the items viewed in the
session (a bag of item ids padded with 0) and the user id. ``nn.EmbeddingBag`` reaches the devices through
the exact gather/mask/reduce rewrite of :mod:`taste_cl.adapters.device.embeddings`; the
device learners keep dict replay buffers and refuse ids outside the embedding tables before
their runtime sees them (ONNX Runtime's ``Gather`` would wrap a negative id silently).
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import rehash
from torch import nn

from taste_cl import OnlineLearner, ReservoirReplay
from taste_cl.adapters.device.artifacts import ArtifactError, ExportError
from taste_cl.adapters.device.embeddings import GatherEmbeddingBag, index_bounds, rewrite_embedding_bags
from taste_cl.exceptions import InvalidBatchError

ITEMS, USERS, CATEGORIES, LENGTH = 60, 12, 5, 8

pytestmark = pytest.mark.usefixtures("one_thread")


class Recommender(nn.Module):
    """Category scores from a padded bag of viewed items (``padding_idx=0``) and the user id."""

    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(ITEMS, 16, mode=mode, padding_idx=0)
        self.user = nn.Embedding(USERS, 16)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CATEGORIES))

    def forward(self, items: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.history(items), self.user(user)], dim=1))


def stream(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sessions of 1 to 8 viewed items (the rest padding), 70% of them from the session's intent
    category (item id mod 5), the rest random; the target is the intent."""
    g = torch.Generator().manual_seed(seed)
    intent = torch.randint(0, CATEGORIES, (n, 1), generator=g)
    on_intent = torch.randint(1, ITEMS // CATEGORIES, (n, LENGTH), generator=g) * CATEGORIES + intent
    items = torch.where(torch.rand(n, LENGTH, generator=g) < 0.7, on_intent, torch.randint(1, ITEMS, (n, LENGTH), generator=g))
    items[torch.arange(LENGTH) >= torch.randint(1, LENGTH + 1, (n, 1), generator=g)] = 0
    return {"items": items, "user": torch.randint(0, USERS, (n,), generator=g)}, intent.squeeze(1)


def learner(mode: str = "mean", *, replay_batch_size: int = 0) -> OnlineLearner:
    torch.manual_seed(0)
    model = Recommender(mode)
    return OnlineLearner(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), replay=ReservoirReplay(48), replay_batch_size=replay_batch_size
    )


def numpy(x: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The batch as the app gives it to a device learner (copies: edits leave ``x`` as it is)."""
    return {key: value.numpy().copy() for key, value in x.items()}


# ----------------------------------------------------------------- the rewrite
def _bag_case(rng: torch.Generator, mode: str, one_d: bool, weighted: bool) -> tuple[nn.EmbeddingBag, tuple[Any, ...], Any]:
    """A random EmbeddingBag and its arguments: padded 2-D bags, or 1-D ids with offsets (empty bags included)."""
    pad = [None, 0, 3][int(torch.randint(0, 3, (), generator=rng))]
    last = one_d and bool(torch.randint(0, 2, (), generator=rng))
    bag = nn.EmbeddingBag(int(torch.randint(5, 40, (), generator=rng)), 6, mode=mode, padding_idx=pad, include_last_offset=last)
    size = bag.num_embeddings
    if one_d:
        n = int(torch.randint(0, 20, (), generator=rng))
        ids = torch.randint(0, size, (n,), generator=rng)
        offsets = torch.sort(torch.randint(0, n + 1, (5,), generator=rng)).values
        offsets[0] = 0
        args: tuple[Any, ...] = (ids, torch.cat([offsets, torch.tensor([n])]) if last else offsets)
    else:
        ids = torch.randint(0, size, (5, int(torch.randint(1, 9, (), generator=rng))), generator=rng)
        args = (ids, None)
    if pad is not None:
        ids[torch.rand(ids.shape, generator=rng) < 0.4] = pad
    weights = torch.rand(ids.shape, generator=rng) if weighted else None
    return bag, args, weights


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("one_d", [False, True], ids=["padded_2d", "offsets_1d"])
def test_the_rewrite_computes_pytorchs_bags_and_gradients(mode: str, one_d: bool) -> None:
    rng = torch.Generator().manual_seed(0)
    for case in range(40):
        weighted = mode == "sum" and case % 2 == 1
        bag, args, weights = _bag_case(rng, mode, one_d, weighted)
        rewritten = copy.deepcopy(bag)
        assert rewrite_embedding_bags(rewritten) == 1 and type(rewritten) is GatherEmbeddingBag
        w1 = None if weights is None else weights.clone().requires_grad_()
        w2 = None if weights is None else weights.clone().requires_grad_()
        expected, got = bag(*args, per_sample_weights=w1), rewritten(*args, per_sample_weights=w2)
        upstream = torch.randn(expected.shape, generator=rng)
        (expected * upstream).sum().backward()
        (got * upstream).sum().backward()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        assert bag.weight.grad is not None and rewritten.weight.grad is not None
        torch.testing.assert_close(rewritten.weight.grad, bag.weight.grad, rtol=0, atol=1e-6)
        if w1 is not None and w2 is not None and w1.numel():
            torch.testing.assert_close(w2.grad, w1.grad, rtol=0, atol=1e-6)


def test_the_rewrite_keeps_names_and_values_and_refuses_what_it_cannot_keep() -> None:
    model = Recommender()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    assert rewrite_embedding_bags(model) == 1 and type(model.history) is GatherEmbeddingBag
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items()) and set(before) == set(model.state_dict())

    refusals = (({"max_norm": 1.0}, r"'tags' is an nn.EmbeddingBag with max_norm=1.0, .* build it with max_norm=None"),
                ({"scale_grad_by_freq": True}, r"'tags' .* scale_grad_by_freq=True, .* with scale_grad_by_freq=False"))  # fmt: skip
    for option, message in refusals:
        model = Recommender()
        model.tags = nn.EmbeddingBag(10, 4, **option)
        with pytest.raises(ExportError, match=message):
            rewrite_embedding_bags(model)
        assert type(model.history) is nn.EmbeddingBag  # checked first: nothing changed


def test_index_bounds_finds_the_inputs_that_index_a_table() -> None:
    model = Recommender()
    x, _ = stream(4, 0)
    assert index_bounds(model, lambda: model(**x), x) == {"items": ITEMS, "user": USERS}
    assert model.training  # mode restored

    class Shifted(Recommender):  # ids made by arithmetic are not the input's: not tracked
        def forward(self, items: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.history(items.flatten().view(items.shape)), self.user((user + 1) % USERS)], dim=1))

    shifted = Shifted()
    assert index_bounds(shifted, lambda: shifted(**x), x) == {"items": ITEMS}


# ------------------------------------------------------------------ PyTorch
def test_the_learner_trains_the_recommender_with_dict_replay() -> None:
    learner_ = learner(replay_batch_size=8)
    held_out = stream(200, 99)

    def accuracy() -> float:
        return float((learner_.predict(held_out[0]).argmax(1) == held_out[1]).float().mean())

    start = accuracy()
    for seed in range(40):
        stats = learner_.observe(stream(16, seed))
    assert stats.replay_samples == 8 and len(learner_.replay) == 48
    assert accuracy() > start + 0.25, (start, accuracy())


# ------------------------------------------------------------------ ONNX Runtime
@pytest.mark.training_build
@pytest.mark.parametrize("mode", ["mean", "max"])  # sum is mean without the division
def test_onnxruntime_trains_the_recommender_like_the_learner(tmp_path: Path, mode: str) -> None:
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    learner_ = learner(mode)  # no replay draws: the device and the learner draw from different random streams
    for seed in range(4):
        learner_.observe(stream(8, seed))
    folder = learner_.export(tmp_path / "art", backend="onnxruntime")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["transforms"] == ["history: EmbeddingBag -> GatherEmbeddingBag"]
    assert [(spec["name"], spec.get("bound")) for spec in manifest["inputs"]] == [("items", ITEMS), ("user", USERS)]
    assert manifest["parity"]["max_param_diff"] < 1e-5

    device = OrtOnlineLearner.from_artifacts(folder)
    held_out, _ = stream(16, 99)
    for seed in range(4, 8):
        x, y = stream(8, seed)
        assert not device.observe((numpy(x), y.numpy())).skipped
        learner_.observe((x, y))
    np.testing.assert_allclose(device.predict(numpy(held_out)), learner_.predict(held_out).numpy(), rtol=0, atol=1e-4)


@pytest.mark.training_build
def test_onnxruntime_replays_dict_rows_and_keeps_them_across_save(tmp_path: Path) -> None:
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    learner_ = learner(replay_batch_size=4)
    for seed in range(3):
        learner_.observe(stream(8, seed))
    device = OrtOnlineLearner.from_artifacts(learner_.export(tmp_path / "art", backend="onnxruntime"))
    x, y = stream(8, 5)
    stats = device.observe((numpy(x), y.numpy()))
    assert stats.replay_samples == 4 and len(device.replay) == 32
    restored = OrtOnlineLearner.from_artifacts(device.save(tmp_path / "saved"))
    assert restored.replay.to_bytes() == device.replay.to_bytes() and restored.replay.info() == device.replay.info()
    next_batch = stream(8, 6)
    a = device.observe((numpy(next_batch[0]), next_batch[1].numpy()))
    b = restored.observe((numpy(next_batch[0]), next_batch[1].numpy()))
    assert a.loss == b.loss  # the same replay draws and weights after the round trip


@pytest.mark.training_build
def test_onnxruntime_refuses_ids_outside_the_tables_before_the_runtime(tmp_path: Path) -> None:
    from taste_cl.adapters.onnxruntime.manifest import REPLAY_FILE
    from taste_cl.adapters.onnxruntime.runtime import OrtOnlineLearner

    learner_ = learner(replay_batch_size=4)
    for seed in range(2):
        learner_.observe(stream(8, seed))
    folder = learner_.export(tmp_path / "art", backend="onnxruntime")
    device = OrtOnlineLearner.from_artifacts(folder)
    x, y = stream(4, 7)
    params, seen, stored = device.parameters(), device.samples_seen, device.replay.to_bytes()
    for key, bad, shown in (("items", ITEMS, rf"\[0, {ITEMS}\]"), ("items", -1, r"\[-1, \d+\]"), ("user", 10**6, r"\[\d+, 1000000\]")):
        wrong = numpy(x)
        wrong[key][0] = bad
        with pytest.raises(InvalidBatchError, match=rf"x\['{key}'\] holds ids in {shown}, must be in \[0, \d+\] \(the embedding table's rows\)"):
            device.observe((wrong, y.numpy()))
        with pytest.raises(InvalidBatchError, match="the embedding table's rows"):
            device.predict(wrong)
    after = device.parameters()
    assert device.samples_seen == seen and device.replay.to_bytes() == stored and all(np.array_equal(after[k], params[k]) for k in params)

    # a replay.npz holding an id outside its table is refused on load, like a manifest bound on a float input
    with np.load(folder / REPLAY_FILE) as archive:
        arrays = {key: archive[key] for key in archive.files}
    arrays["x0"][0, 0] = ITEMS
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    (folder / REPLAY_FILE).write_bytes(buffer.getvalue())
    rehash(folder)
    with pytest.raises(ArtifactError, match=rf"replay.npz: array 'x0' holds ids in \[0, {ITEMS}\]"):
        OrtOnlineLearner.from_artifacts(folder)


@pytest.mark.training_build
def test_onnxruntime_manifest_bounds_are_validated(tmp_path: Path) -> None:
    from taste_cl.adapters.onnxruntime.manifest import parse_manifest

    learner_ = learner()
    learner_.observe(stream(8, 0))
    manifest = json.loads((learner_.export(tmp_path / "art", backend="onnxruntime", verify=False) / "manifest.json").read_text())
    for bound in (0, True, 1.5, "60"):
        manifest["inputs"][0]["bound"] = bound
        with pytest.raises(ArtifactError, match=r"inputs\[0\].bound"):
            parse_manifest(manifest)
    manifest["inputs"][0].update(bound=5, dtype="float32")
    with pytest.raises(ArtifactError, match=r"absent for a non-integer input"):
        parse_manifest(manifest)


# ------------------------------------------------------------------ ExecuTorch
def _et_spec() -> Any:
    from taste_cl.adapters.executorch.runtime import IOSpec

    x, y = stream(2, 0)
    return IOSpec.of(x, y, CATEGORIES, {"items": ITEMS, "user": USERS})


def test_executorch_dict_replay_round_trips_and_is_validated(tmp_path: Path) -> None:
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch.replay import load_replay, save_replay

    replay = ReservoirReplay(20, seed=3)
    for seed in range(4):
        replay.add(*stream(8, seed))
    spec = _et_spec()
    assert save_replay(tmp_path / "replay.npz", replay)["size"] == 20
    loaded = load_replay((tmp_path / "replay.npz").read_bytes(), spec)
    original, restored = replay.state_dict(), loaded.state_dict()
    assert restored["seen"] == original["seen"] == 32 and torch.equal(restored["generator"], original["generator"])
    for a, b in zip(original["storage"]["x"], restored["storage"]["x"]):
        assert torch.equal(a, b)
    assert torch.equal(original["storage"]["y"], restored["storage"]["y"])
    assert loaded.sample(4)[0].keys() == {"items", "user"}

    with np.load(tmp_path / "replay.npz") as archive:
        arrays = {key: archive[key] for key in archive.files}
    for edit, message in ((lambda a: a["x1"].__setitem__(0, USERS), r"x\['user'\] holds ids in \[\d+, 12\], must be in \[0, 11\]"),
                          (lambda a: a.__setitem__("keys", np.array(["items", "users"])), r"input keys \['items', 'users'\] are not the program's"),
                          (lambda a: a.pop("x0"), "x0")):  # fmt: skip
        hostile = {key: value.copy() for key, value in arrays.items()}
        edit(hostile)
        buffer = io.BytesIO()
        np.savez(buffer, **hostile)
        with pytest.raises(ArtifactError, match=message):
            load_replay(buffer.getvalue(), spec)


def test_executorch_spec_checks_id_bounds() -> None:
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch.runtime import IOSpec

    spec = _et_spec()
    assert IOSpec.from_json(spec.to_json()) == spec and spec.inputs[0].bound == ITEMS
    x, _ = stream(4, 1)
    x["items"][1, 0] = -3
    with pytest.raises(InvalidBatchError, match=r"x\['items'\] holds ids in \[-3, \d+\], must be in \[0, 59\]"):
        spec.flat_inputs(x)
    for bound in (0, True, 2.5):
        with pytest.raises(ValueError, match="bound"):
            IOSpec.from_json({**spec.to_json(), "inputs": [{**spec.inputs[0].to_json(), "bound": bound}, spec.inputs[1].to_json()]})


@pytest.mark.slow
def test_executorch_trains_the_recommender_with_dict_replay(tmp_path: Path) -> None:
    pytest.importorskip("executorch")
    from taste_cl.adapters.executorch.learner import EtOnlineLearner

    learner_ = learner(replay_batch_size=4)
    for seed in range(3):
        learner_.observe(stream(8, seed))
    folder = learner_.export(tmp_path / "art", backend="executorch")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["transforms"] == ["rewrite_embedding_bags"] and manifest["replay"]["size"] == 24
    assert [leaf.get("bound") for leaf in manifest["io"]["inputs"]] == [ITEMS, USERS]
    assert manifest["parity"]["max_param_diff"] < 1e-5

    device = EtOnlineLearner.from_artifacts(folder)
    for seed in range(3, 6):
        x, y = stream(8, seed)
        stats = device.observe((numpy(x), y.numpy()))
        assert stats.replay_samples == 4 and not stats.skipped
    restored = EtOnlineLearner.from_artifacts(device.save(tmp_path / "saved"))
    assert len(restored.replay) == len(device.replay) == 48 and restored.samples_seen == device.samples_seen == 48
    for a, b in zip(device.replay.state_dict()["storage"]["x"], restored.replay.state_dict()["storage"]["x"]):
        assert torch.equal(a, b)
    params = device.parameters()
    wrong = numpy(x)
    wrong["items"][0, 0] = ITEMS
    with pytest.raises(InvalidBatchError, match=rf"x\['items'\] holds ids in \[0, {ITEMS}\]"):
        device.observe((wrong, y.numpy()))
    assert device.samples_seen == 48 and all(np.array_equal(device.parameters()[k], params[k]) for k in params)
