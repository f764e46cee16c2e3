"""How taste_cl.elastic is put together: imports go one way, shared checks, state restores exactly."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from taste_cl import ElasticTrainer, OnlineLearner
from taste_cl._checks import check_positive
from taste_cl.exceptions import CheckpointError
from taste_cl.plugins import LearnerPlugin

ELASTIC = Path(__file__).resolve().parents[1] / "taste_cl" / "elastic"


def _imports(path: Path) -> set[str]:
    """The taste_cl.elastic modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name.rsplit(".", 1)[-1] for name in found if name.startswith("taste_cl.elastic.")}


def test_no_elastic_module_imports_one_that_imports_it_back():
    modules = {p.stem for p in ELASTIC.glob("*.py") if p.stem != "__init__"}
    edges = {m: _imports(ELASTIC / f"{m}.py") & modules for m in modules}

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert sorted(m for m in modules if m in reachable(m)) == []
    assert edges["tensor_profile"] == set()  # the data types everyone shares import nothing of elastic


def test_old_homes_of_the_profile_type_still_resolve_to_it():
    from taste_cl.elastic import TensorProfile, profiling, tensor_profile

    assert profiling.TensorProfile is tensor_profile.TensorProfile is TensorProfile
    assert profiling.Granularity is tensor_profile.Granularity and profiling.Clock is tensor_profile.Clock


@pytest.mark.parametrize(
    "value, upper, rule",
    [
        (0, None, "a number > 0"),
        (-1.5, None, "a number > 0"),
        (math.nan, None, "a number > 0"),
        (True, None, "a number > 0"),
        ("1", None, "a number > 0"),
        (1.01, 1.0, "a number > 0 and <= 1.0"),
    ],
)
def test_check_positive_names_the_argument_rule_and_value(value, upper, rule):
    with pytest.raises(ValueError, match=f"^`rho == {value!r}`, must be {rule}$".replace("(", r"\(").replace(")", r"\)")):
        check_positive("rho", value, upper=upper)


def test_check_positive_returns_good_values():
    assert check_positive("rho", 1.0, upper=1.0) == 1.0
    assert check_positive("tolerance", math.inf) == math.inf
    assert check_positive("budget_s", 3) == 3


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def test_elastic_state_restores_exactly_from_a_learner_checkpoint(tmp_path):
    torch.manual_seed(0)
    options = {"rho": 0.6, "reselect_every": 3, "drift_steps": 4, "cache_dir": None, "warmup": 0, "repeats": 2, "tolerance": 1e9}
    model = _mlp()
    elastic = ElasticTrainer(**options)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[elastic])
    for step in range(8):
        x = torch.randn(16, 6)
        learner.observe((x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()))
        if step == 5:
            elastic.reselect()  # a pending probe is part of the state
    learner.monitor.emit("drift_detected", loss=9.0)  # a drift window in progress is part of the state too
    learner.monitor.dispatch()
    assert elastic.current_rho > elastic.rho
    learner.save(tmp_path / "ckpt")
    restored, fresh = ElasticTrainer(**options), _mlp()
    loaded = OnlineLearner.load(tmp_path / "ckpt", model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1), plugins=[restored])
    before, after = elastic.state_dict(), restored.state_dict()
    assert torch.equal(before.pop("example"), after.pop("example"))
    assert after == before
    assert restored.current_rho == elastic.current_rho
    trainable = {name: p.requires_grad for name, p in loaded.model.named_parameters()}
    assert trainable == {name: p.requires_grad for name, p in learner.model.named_parameters()}
    assert restored.memory_estimate() == elastic.memory_estimate()


_RESET = {"rho": 0.6, "reselect_every": 1000, "cache_dir": None, "warmup": 0, "repeats": 2, "tolerance": 1e9, "optimizer_state": "reset"}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for _ in range(n):
        x = torch.randn(16, 6)
        batches.append((x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()))
    return batches


def test_a_resumed_learner_with_reset_optimizer_state_continues_identically(tmp_path):
    """optimizer_state="reset": the units left out have no optimizer state, in the checkpoint as
    in the run, and the restored learner takes the same steps as the one that went on."""
    torch.manual_seed(0)
    options = _RESET
    batches = _batches(8)
    model = _mlp()
    elastic = ElasticTrainer(**options)
    learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), plugins=[elastic])
    for batch in batches[:5]:
        learner.observe(batch)
    left_out = [p for p in model.parameters() if not p.requires_grad]
    assert left_out and all(p not in learner.optimizer.state for p in left_out)
    learner.save(tmp_path / "ckpt")
    fresh = _mlp()
    loaded = OnlineLearner.load(
        tmp_path / "ckpt", model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), plugins=[ElasticTrainer(**options)]
    )
    for batch in batches[5:]:
        learner.observe(batch)
        loaded.observe(batch)
    for (name, expected), got in zip(learner.model.named_parameters(), loaded.model.parameters()):
        assert torch.equal(expected, got), name
        assert (expected in learner.optimizer.state) == (got in loaded.optimizer.state), name


class _Refuses(LearnerPlugin):
    """A plugin whose checkpoint state never loads (loaded after the elastic trainer)."""

    name = "refuses"

    def state_dict(self) -> dict:
        return {"ok": True}

    def load_state_dict(self, state: dict) -> None:
        if state != {"ok": True}:
            raise ValueError("refused")


def test_a_refused_checkpoint_leaves_a_reset_learners_optimizer_state_as_it_was():
    """Loading the elastic state switches units off before the optimizer section applies; with
    "reset" that must not drop their momentum, or a load refused afterwards would lose it."""
    torch.manual_seed(0)
    saved_model = _mlp()
    saved = OnlineLearner(saved_model, optimizer=torch.optim.SGD(saved_model.parameters(), lr=0.1, momentum=0.9), plugins=[ElasticTrainer(**_RESET)])
    for batch in _batches(4):
        saved.observe(batch)
    assert not all(p.requires_grad for p in saved_model.parameters())  # the checkpoint leaves units out
    model = _mlp()
    elastic = ElasticTrainer(**_RESET)
    live = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), plugins=[elastic, _Refuses()])
    live.observe(_batches(1)[0])
    elastic.apply_selection(elastic.profile_.units)
    live.observe(_batches(1)[0])
    buffers = {name: live.optimizer.state[p]["momentum_buffer"].clone() for name, p in model.named_parameters()}
    state = saved.state_dict()
    with pytest.raises(CheckpointError, match="plugin 'refuses': refused"):
        live.load_state_dict({**state, "plugins": {**state["plugins"], "refuses": {"ok": False}}})
    assert all(p.requires_grad for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(live.optimizer.state[p]["momentum_buffer"], buffers[name]), name
