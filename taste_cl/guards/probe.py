"""Guarded personalization: never keep an update window that made the model worse for its user.

:class:`ProbeGuard` is a learner plugin. It splits the stream into *update windows* of
``window`` ``observe`` calls and keeps the last good snapshot: the model's parameters and
buffers, the optimizer state and (``restore_replay``) the replay buffer. At the end of
each window it scores the model on a *probe* — samples from windows it accepted before,
or a fixed probe the user gives (e.g. examples the user confirmed) — and compares each
probe sample with its score at the last accepted window. If the probe score dropped by
more than ``max_drop`` or the negative flip rate (right before, wrong now) exceeds
``max_flip_rate``, it rolls the model, the optimizer and the buffer back to the snapshot
bit-identically, drops the window's samples, emits ``update_rolled_back`` on the
learner's monitor and, with ``lr_factor < 1``, lowers the learning rates. Otherwise the
window is accepted: a new snapshot is taken and the window's samples join the probe.

The snapshot's model is a frozen copy, :attr:`ProbeGuard.accepted_model`; serve
predictions with :meth:`ProbeGuard.predict` and users only ever see models that passed
the probe (``learner.predict`` shows the model being trained, mid-window).

Cost: memory for one copy of the model (the accepted model) and of the optimizer state (plus the replay buffer with
``restore_replay``), the probe and one window of samples; time for one forward over the
probe and one snapshot copy per window (``taste-cl bench strategies`` measures it).

Tasks: classification and multi-label (score: right or wrong per sample, flips counted),
regression (score: minus the per-sample squared error; ``max_drop`` is then in squared
error units and ``max_flip_rate`` does not apply). Token tagging is refused.

>>> import torch
>>> from torch import nn
>>> from taste_cl import OnlineLearner
>>> from taste_cl.guards.probe import ProbeGuard
>>> _ = torch.manual_seed(0)
>>> model = nn.Linear(4, 3)
>>> guard = ProbeGuard(window=2)
>>> learner = OnlineLearner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plugins=[guard])
>>> for _ in range(4):
...     _ = learner.observe((torch.randn(8, 4), torch.randint(0, 3, (8,))))
>>> guard.windows, len(guard.probe) > 0
(2, True)
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import torch

from taste_cl._batch import (
    Inputs,
    batch_len,
    call_model,
    cat_batches,
    map_leaves,
    to_inputs,
)
from taste_cl.guards.probe_rule import check_probe_settings, lowered_lr, regressed, window_verdict
from taste_cl.monitor.monitor import sample_correct
from taste_cl.plugins import LearnerPlugin
from taste_cl.replay import ClassBalancedReplay, ReservoirReplay
from taste_cl.tasks import Classification, MultiLabel, Regression, Task

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner

__all__ = ["ProbeGuard"]


def _check_task(task: Task | None) -> Task:
    if not isinstance(task, (Classification, MultiLabel, Regression)):
        raise ValueError(  # noqa: TRY004 - a task the guard cannot score is a bad value, like every refusal here
            f"ProbeGuard scores each probe sample as right/wrong (classification, multi-label) or by its squared "
            f"error (regression); the {getattr(task, 'name', None)} task has neither"
        )
    return task


class ProbeGuard(LearnerPlugin):
    """Roll back an update window that lowers the probe score (see the module doc).

    Parameters
    ----------
    window:
        ``observe`` calls per update window.
    max_drop:
        Largest accepted drop of the probe score (accuracy points as a fraction) on the
        probe samples scored at the last accepted window.
    max_flip_rate:
        Largest accepted negative flip rate; None to ignore flips.
    probe:
        A fixed probe ``(x, y)``; default: up to ``probe_capacity`` samples from accepted
        windows (class-balanced for classification).
    lr_factor, min_lr:
        On a rollback, multiply every learning rate by ``lr_factor`` (1: keep), not below ``min_lr``.
    restore_replay:
        Also roll the replay buffer back (else the window's samples stay in it).
    warmup:
        Windows accepted without judgement at the start (their samples fill the probe):
        a model still learning fast changes its probe score by more than ``max_drop``
        from window to window, so judging it would reject good updates.
    """

    name = "guard"

    def __init__(
        self,
        *,
        window: int = 10,
        max_drop: float = 0.05,
        max_flip_rate: float | None = 0.1,
        probe: tuple[Any, Any] | None = None,
        probe_capacity: int = 200,
        lr_factor: float = 1.0,
        min_lr: float = 0.0,
        restore_replay: bool = True,
        warmup: int = 0,
        seed: int = 0,
    ) -> None:
        checked = check_probe_settings(window=window, max_drop=max_drop, max_flip_rate=max_flip_rate, probe_capacity=probe_capacity,
                                       lr_factor=lr_factor, min_lr=min_lr, warmup=warmup, seed=seed)  # fmt: skip
        if probe is not None and (not isinstance(probe, (tuple, list)) or len(probe) != 2):
            raise ValueError("probe must be a pair (x, y) of held-out samples or None")
        self.window, self.warmup = window, warmup
        self.max_drop, self.max_flip_rate = checked["max_drop"], checked["max_flip_rate"]
        self.probe_capacity = probe_capacity
        self.lr_factor, self.min_lr = checked["lr_factor"], checked["min_lr"]
        self.restore_replay = bool(restore_replay)
        self.seed = seed
        self._fixed = probe
        self.probe: ClassBalancedReplay | ReservoirReplay = ReservoirReplay(probe_capacity, seed=seed)
        self.windows = 0
        self.rollbacks = 0
        self._calls = 0
        self._pending: list[tuple[Inputs, torch.Tensor]] = []
        self._baseline: dict[int, float] = {}  # probe sample id -> score at the last accepted window
        self._baseline_correct: dict[int, bool] = {}
        self._snapshot: dict[str, Any] | None = None  # optimizer and replay state of the accepted model
        self.accepted_model: torch.nn.Module | None = None
        self._learner: OnlineLearner | None = None
        self._next_id = 0

    # ---------------------------------------------------------------- hooks
    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        if learner.task is not None:
            _check_task(learner.task)
        self._learner = learner
        self.accepted_model = copy.deepcopy(learner.model).eval()
        for p in self.accepted_model.parameters():
            p.requires_grad_(False)
        self._snapshot = self._take(learner)

    def on_first_batch(self, learner: OnlineLearner, x: Any, **kwargs: Any) -> None:
        task = _check_task(learner.task)
        if task.balances_classes and len(self.probe) == 0:
            self.probe = ClassBalancedReplay(self.probe_capacity, seed=self.seed)

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        batch = kwargs.get("batch")
        if batch is not None and self._fixed is None:
            x, y = batch
            self._pending.append((map_leaves(lambda t: t.detach().clone(), x), y.detach().clone()))
        self._calls += 1
        if self._calls % self.window == 0:
            self.end_window(learner)

    # ------------------------------------------------------------- decision
    def end_window(self, learner: OnlineLearner) -> bool:
        """Judge the update window that just ended; return True if it was kept, False if rolled back."""
        self.windows += 1
        scored = self._score(learner)
        drop, flips, common = window_verdict(self._baseline, self._baseline_correct, *scored)
        if regressed(windows=self.windows, warmup=self.warmup, drop=drop, flips=flips, max_drop=self.max_drop, max_flip_rate=self.max_flip_rate):
            self._rollback(learner, drop=drop, negative_flip_rate=flips, probe_samples=common)
            return False
        self._snapshot = self._take(learner)
        self._baseline, self._baseline_correct = scored
        if self._pending:  # one add for the whole window
            x = cat_batches([x for x, _ in self._pending])
            y = torch.cat([y for _, y in self._pending])
            self.probe.add_validated(x, y, sid=torch.arange(self._next_id, self._next_id + y.shape[0]))
            self._next_id += y.shape[0]
        self._pending = []
        return True

    def _score(self, learner: OnlineLearner) -> tuple[dict[int, float], dict[int, bool]]:
        """Per probe sample id: its score and (class tasks) whether it is right."""
        if self._fixed is not None:
            x, y = self._fixed
            ids = torch.arange(batch_len(x))
        elif len(self.probe):
            x, y, fields = self.probe.sample(len(self.probe), with_fields=True)
            ids = fields["sid"]
        else:
            return {}, {}
        outputs = learner.predict(x)
        task: Task = learner.task  # type: ignore[assignment]
        y = torch.as_tensor(y).to(outputs.device)
        correct = sample_correct(task, outputs, y)
        if correct is None:  # regression: minus the per-sample squared error
            score = -((outputs - y.reshape(outputs.shape).to(outputs)) ** 2).flatten(1).mean(1)
            return dict(zip(ids.tolist(), score.tolist())), {}
        keys = ids.tolist()
        return dict(zip(keys, correct.float().tolist())), dict(zip(keys, correct.tolist()))

    # ------------------------------------------------------------- rollback
    def predict(self, x: Any) -> torch.Tensor:
        """Outputs of the last accepted model for ``x`` (validated like ``learner.predict``)."""
        if self._learner is None or self.accepted_model is None:
            raise RuntimeError("ProbeGuard.predict() needs the guard attached to a learner (plugins=[guard])")
        device, dtype = self._learner.device, self._learner.dtype
        inputs, _ = to_inputs(x, spec=self._learner.input_spec, dtype=dtype, device=device)
        with torch.no_grad():
            return call_model(self.accepted_model, inputs, output=self._learner.output, call=self._learner.call)

    def _take(self, learner: OnlineLearner) -> dict[str, Any]:
        """Copy what a rollback restores into the accepted model and a snapshot (tensors
        copied: later in-place updates cannot reach them)."""
        assert self.accepted_model is not None
        self.accepted_model.load_state_dict(learner.model.state_dict())
        replay = learner.replay if self.restore_replay else None
        return {
            "optimizer": copy.deepcopy(learner.optimizer.state_dict()),
            "replay": None if replay is None else copy.deepcopy(replay.state_dict()),
        }

    def _rollback(self, learner: OnlineLearner, **details: float) -> None:
        assert self._snapshot is not None
        snapshot = self._snapshot
        # deep copies: the optimizer would alias the snapshot's tensors and update them in place
        assert self.accepted_model is not None
        lrs = [lowered_lr(group["lr"], self.lr_factor, self.min_lr) for group in learner.optimizer.param_groups]
        learner.model.load_state_dict(self.accepted_model.state_dict())
        learner.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        if snapshot["replay"] is not None and learner.replay is not None:
            learner.replay.load_state_dict(copy.deepcopy(snapshot["replay"]))
        learner.discard_window()  # the window's pending gradients are dropped too
        for group, new_lr, saved in zip(learner.optimizer.param_groups, lrs, snapshot["optimizer"]["param_groups"]):
            group["lr"] = saved["lr"] = new_lr  # later rollbacks keep the lowered rate
        self._pending = []
        self.rollbacks += 1
        learner.monitor.emit("update_rolled_back", window=self.windows, lr=lrs, **details)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": self.windows,
            "rollbacks": self.rollbacks,
            "calls": self._calls,
            "next_id": self._next_id,
            "probe_type": type(self.probe).__name__,
            "probe": self.probe.state_dict(),
            "baseline": [list(self._baseline), list(self._baseline.values())],
            "baseline_correct": [list(self._baseline_correct), list(self._baseline_correct.values())],
            "pending": [[x, y] for x, y in self._pending],
            "snapshot": self._snapshot,
            "accepted_model": None if self.accepted_model is None else self.accepted_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        probe_type = ClassBalancedReplay if state["probe_type"] == "ClassBalancedReplay" else ReservoirReplay
        probe = probe_type(self.probe_capacity, seed=self.seed)
        probe.load_state_dict(state["probe"])
        ids, scores = state["baseline"]
        correct_ids, correct = state["baseline_correct"]
        self.probe = probe
        self.windows, self.rollbacks = int(state["windows"]), int(state["rollbacks"])
        self._calls, self._next_id = int(state["calls"]), int(state["next_id"])
        self._baseline = {int(i): float(s) for i, s in zip(ids, scores)}
        self._baseline_correct = {int(i): bool(c) for i, c in zip(correct_ids, correct)}
        self._pending = [(x, y) for x, y in state["pending"]]
        self._snapshot = state["snapshot"]
        if self.accepted_model is not None:
            self.accepted_model.load_state_dict(state["accepted_model"])

    @property
    def fixed_probe(self) -> tuple[Any, Any] | None:
        """The fixed probe ``(x, y)`` given at construction (None: the guard's probe fills from accepted windows)."""
        return self._fixed

    @property
    def lost_updates(self) -> float:
        """Share of windows rolled back (NaN before the first window)."""
        return self.rollbacks / self.windows if self.windows else math.nan
