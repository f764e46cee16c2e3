"""Test-time adaptation on unlabelled batches: one method, its anchor and its guard.

:class:`TestTimeAdapter` is what ``OnlineLearner.adapt(x)`` runs. On each unlabelled batch
it runs the model with its BatchNorm layers on the batch's statistics (their running
statistics follow, so ``predict`` afterwards sees the adaptation too), takes the method's
step on the normalisation layers' affine parameters (TENT, EATA), and returns the
predictions. With a :class:`~taste_cl.adaptation.guard.CollapseGuard` (the default) it
resets to the anchor when the guard says the adaptation collapses; the predictions returned
for that batch are then the source model's (the anchor's values swapped in for one forward:
no copy of the model is kept). They are the source's too while the guard's label-free accuracy
estimate (AETTA, :mod:`~taste_cl.adaptation.estimate`) rates the source above the adapted model
(a fallback, without reset); each batch's dropout summary is in :attr:`AdaptStats.summary`.

This is the one place where normalisation statistics move on purpose: the learner's
``frozen_norm="eval"`` keeps a frozen backbone's statistics fixed while it *trains* on
labels, but adapting a model to unlabelled data is done through exactly those statistics.

Small batches: batch statistics need at least ``min_batch`` rows (and BatchNorm1d on
``(batch, features)`` needs 2). Below that no method adapts: BatchNorm keeps its running
statistics and TENT and EATA take no step (an entropy step through one row's prediction made
the continual benchmark worse than never adapting: 0.904 error against the source's 0.791 at
batch size 1), so the batch gets the current model's predictions. The first such batch warns
(:class:`~taste_cl.exceptions.AdaptationWarning`).

Checkpoints: :meth:`TestTimeAdapter.state_dict` holds the method's state, the adapter's settings
and counters, the anchor's tensors, the step moments and the guard's state (each part gives its
own); :meth:`TestTimeAdapter.parse_state` checks one against a model, changing nothing, and
returns what applies it, so a resumed learner adapts on exactly as the uninterrupted one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from taste_cl._batch import Inputs, batch_len, call_model
from taste_cl._checks import check_int
from taste_cl.adaptation.anchor import NormAnchor, model_bytes
from taste_cl.adaptation.estimate import DropoutProbe
from taste_cl.adaptation.guard import CollapseGuard, GuardVerdict
from taste_cl.adaptation.methods import METHODS, AdaptationMethod, Eata, affine_parameters, batch_norms, resolve_method
from taste_cl.exceptions import AdaptationWarning
from taste_cl.state.restore import Apply, check_keys, check_number, check_tensor, refusing, short
from taste_cl.state.restore import check_int as check_int_in

__all__ = ["AdaptStats", "TestTimeAdapter"]

_SETTINGS = ("optimizer", "momentum", "min_batch", "backoff")
_FLAGS = ("bound", "stale_anchor", "warned_small")
_KEYS = {"method", "settings", "lr_scale", "batches", "resets", *_FLAGS, "anchor", "steps", "guard"}


@dataclass(frozen=True)
class AdaptStats:
    """What one ``adapt`` did: the predictions it returns, and the guard's reading."""

    outputs: torch.Tensor
    """The batch's predictions: the adapted model's, or the source's on a batch that reset."""
    rows_used: int
    """Rows the method's loss used (all for TENT, the reliable ones for EATA, 0 for BN-adapt)."""
    batch_statistics: bool
    """Whether BatchNorm normalised with this batch's statistics (False below ``min_batch``)."""
    reset: bool
    reason: str | None
    verdict: GuardVerdict | None
    summary: torch.Tensor | None = None
    """Per row of :attr:`outputs`, the dropout inference AETTA reads (:mod:`~taste_cl.adaptation.estimate`): the agreement of 10 dropout
    predictions with the prediction, then their mean probabilities; None when the model's output is not its last
    linear layer's. :func:`~taste_cl.engine.adapt.aetta_accuracy` over any rows' summaries estimates their accuracy."""


class TestTimeAdapter:
    """Adapt a model to unlabelled batches with ``method``, guarded against collapse.

    Parameters
    ----------
    method:
        ``"tent"`` (default; the device runs it too), ``"eata"`` (the guarded default of
        ``taste-cl bench adapt``: never worse than the source on its collapsing stream), ``"bn"``,
        or an :class:`~taste_cl.adaptation.methods.AdaptationMethod`.
    guard:
        A :class:`~taste_cl.adaptation.guard.CollapseGuard` (default: one with its default
        settings), or None for the unguarded method.
    optimizer:
        ``"adam"`` (default, as TENT's CIFAR setting) or ``"sgd"`` for the affine-parameter steps.
    momentum:
        Adam's first-moment decay, or SGD's momentum.
    min_batch:
        Fewest rows for batch statistics (see the module).
    backoff:
        Factor on the learning rate after each reset by the guard: a stream that collapsed the
        adaptation once is adapted more gently from then on (0: BN-adapt only after a reset).
    """

    __test__ = False  # not a pytest class

    def __init__(
        self,
        method: AdaptationMethod | str = "tent",
        *,
        guard: CollapseGuard | str | None = "default",
        optimizer: str = "adam",
        momentum: float = 0.9,
        min_batch: int = 2,
        backoff: float = 0.5,
    ) -> None:
        self.method = resolve_method(method)
        if isinstance(guard, str):
            if guard != "default":
                raise ValueError(f"`guard == {guard!r}`, must be a CollapseGuard, None or 'default'")
            guard = CollapseGuard()
        self.guard = guard
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"`momentum == {momentum!r}`, must be a number in [0, 1)")
        self.momentum = float(momentum)
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"`optimizer == {optimizer!r}`, must be 'adam' or 'sgd'")
        self.optimizer = optimizer
        self._second: dict[str, torch.Tensor] = {}
        self._updates = 0
        self.min_batch = check_int("min_batch", min_batch, 2)
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff <= 1:
            raise ValueError(f"`backoff == {backoff!r}`, must be a number in [0, 1]")
        self.backoff = float(backoff)
        self.lr_scale = 1.0
        self.batches = 0
        self.resets = 0
        self._model: nn.Module | None = None
        self._anchor: NormAnchor | None = None
        self._probe: DropoutProbe | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._velocity: dict[str, torch.Tensor] = {}
        self._warned_small = False
        self._stale_anchor = False

    # ------------------------------------------------------------------ wiring
    def bind(self, model: nn.Module, *, fisher: dict[str, torch.Tensor] | None = None) -> None:
        """Adapt ``model`` from now on, anchored at its current normalisation tensors."""
        self._model = model
        self._params = affine_parameters(model)
        if self.method.steps and not self._params:
            raise ValueError(f"{self.method.name!r} adapts normalisation layers' affine parameters, and the model has none; use method='bn' or none")
        if not self.method.steps and not batch_norms(model):
            raise ValueError("'bn' adapts BatchNorm statistics, and the model has no BatchNorm that tracks them")
        self._anchor = NormAnchor(model)
        self._probe = DropoutProbe(model)
        self._anchor_method(fisher)
        self._clear_steps()

    def _anchor_method(self, fisher: dict[str, torch.Tensor] | None = None) -> None:
        if isinstance(self.method, Eata):
            self.method.set_anchor(self._params, fisher)

    @property
    def bound(self) -> bool:
        return self._model is not None

    def labelled_update(self) -> None:
        """The model trained on labels: the anchor moves to it before the next unlabelled batch."""
        self._stale_anchor = True

    @property
    def anchor_bytes(self) -> int:
        """Memory of the anchor (the normalisation tensors), against :attr:`model_copy_bytes` for a frozen model copy."""
        return 0 if self._anchor is None else self._anchor.nbytes

    @property
    def model_copy_bytes(self) -> int:
        return 0 if self._model is None else model_bytes(self._model)

    def reset(self) -> None:
        """Back to the anchor: normalisation tensors, step momentum and the method's memory."""
        if self._anchor is not None:
            self._anchor.restore()
        self._clear_steps()
        self.method.reset()
        if self.guard is not None:
            self.guard.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed adapter needs (copies): the method's state, the settings, the counters and flags,
        the anchor's tensors (None while unbound), the step moments and the guard's state (None unguarded)."""
        return {
            "method": self.method.state_dict(),
            "settings": {"optimizer": self.optimizer, "momentum": self.momentum, "min_batch": self.min_batch, "backoff": self.backoff},
            "lr_scale": self.lr_scale,
            "batches": self.batches,
            "resets": self.resets,
            "bound": self.bound,
            "stale_anchor": self._stale_anchor,
            "warned_small": self._warned_small,
            "anchor": None if self._anchor is None else self._anchor.values(),
            "steps": {
                "velocity": {name: t.clone() for name, t in self._velocity.items()},
                "second": {name: t.clone() for name, t in self._second.items()},
                "updates": self._updates,
            },
            "guard": None if self.guard is None else self.guard.state_dict(),
        }

    @classmethod
    def from_state(cls, state: Any, model: nn.Module, *, where: str = "adaptation") -> tuple[TestTimeAdapter, Apply]:
        """A new adapter of the built-in method ``state`` names, and what applies ``state`` to it (see
        :meth:`parse_state`); :class:`~taste_cl.exceptions.CheckpointError` naming the field, nothing built, otherwise."""
        with refusing():
            if not isinstance(state, dict):
                raise ValueError(f"`{where}` must be a dict or None; got {type(state).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
            method = state.get("method")
            name = method.get("name") if isinstance(method, dict) else None
            if not isinstance(name, str) or name not in METHODS:
                raise ValueError(
                    f"`{where}.method.name == {short(name)}` is not a built-in method {sorted(METHODS)}:"
                    " build the learner with adaptation=TestTimeAdapter(your method) and load_state_dict"
                )
            adapter = cls(METHODS[name](), guard=None)
        return adapter, adapter.parse_state(state, model, where=where)

    def parse_state(self, state: Any, model: nn.Module, *, where: str = "adaptation") -> Apply:
        """Check a :meth:`state_dict` against this adapter (the same method) and ``model`` (bound to it when the state
        is), changing nothing, and return what applies it. Raises :class:`~taste_cl.exceptions.CheckpointError`
        naming the field: settings a constructor refuses, ``lr_scale`` outside (0, 1] (0 only once a backoff
        below 1 has reset it), negative counters, an anchor that is not this model's normalisation tensors,
        moments of other names, shapes or dtypes than its affine parameters, NaN anywhere, or a guard state
        its :meth:`~taste_cl.adaptation.guard.CollapseGuard.parse_state` refuses."""
        with refusing():
            if not isinstance(state, dict):
                raise ValueError(f"`{where}` must be a dict or None; got {type(state).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
            check_keys(where, state, _KEYS, " from what a TestTimeAdapter keeps")
            params = affine_parameters(model)
            apply_method = self.method.parse_state(state["method"], params, where=f"{where}.method")
            settings = _parse_settings(state["settings"], f"{where}.settings")
            batches = check_int_in(f"{where}.batches", state["batches"])
            resets = check_int_in(f"{where}.resets", state["resets"], 0, batches)
            lr_scale = check_number(f"{where}.lr_scale", state["lr_scale"], low=0.0)
            if lr_scale > 1 or (lr_scale == 0 and not (resets and settings["backoff"] < 1)):
                raise ValueError(f"`{where}.lr_scale == {lr_scale}`, must be in (0, 1] (0 only once a backoff below 1 has reset it)")
            flags = {}
            for flag in _FLAGS:
                if not isinstance(state[flag], bool):
                    raise ValueError(f"`{where}.{flag} == {short(state[flag])}`, must be a bool")  # noqa: TRY004 (a bad state is a ValueError)
                flags[flag] = state[flag]
            anchor = self._parse_anchor(state["anchor"], model, params, flags["bound"], where)
            velocity, second, updates = _parse_steps(state["steps"], params if flags["bound"] else {}, settings["optimizer"], f"{where}.steps")
            guard, apply_guard = self._parse_guard(state["guard"], model, where)

        def apply() -> None:
            apply_method()
            self.optimizer, self.momentum, self.min_batch, self.backoff = (settings[key] for key in _SETTINGS)
            self.lr_scale, self.batches, self.resets = lr_scale, batches, resets
            self._stale_anchor, self._warned_small = flags["stale_anchor"], flags["warned_small"]
            self._model, self._params, self._anchor = (model, params, anchor) if anchor is not None else (None, {}, None)
            self._probe = DropoutProbe(model) if anchor is not None else None
            self._velocity, self._second, self._updates = velocity, second, updates
            self.guard = guard
            apply_guard()

        return apply

    def _parse_anchor(self, value: Any, model: nn.Module, params: dict[str, nn.Parameter], bound: bool, where: str) -> NormAnchor | None:
        """The anchor a bound state holds, loaded into a new :class:`NormAnchor` of ``model`` (None when unbound)."""
        if not bound:
            if value is not None:
                raise ValueError(f"`{where}.anchor` must be None while `{where}.bound` is False")
            return None
        if self.method.steps and not params:
            raise ValueError(f"`{where}.bound`: {self.method.name!r} adapts normalisation layers' affine parameters, and this model has none")
        if not self.method.steps and not batch_norms(model):
            raise ValueError(f"`{where}.bound`: 'bn' adapts BatchNorm statistics, and this model has no BatchNorm that tracks them")
        if not isinstance(value, dict):
            raise ValueError(f"`{where}.anchor` must be a dict of tensors while `{where}.bound` is True")  # noqa: TRY004 (a bad state is a ValueError)
        anchor = NormAnchor(model)  # a copy of the model's tensors: nothing of the model changes
        live = anchor.values()
        placed = {name: t.to(device=live[name].device) if isinstance(t, torch.Tensor) and name in live else t for name, t in value.items()}
        try:
            anchor.load_values(placed)
        except ValueError as error:
            raise ValueError(f"`{where}.anchor`: {error}") from error
        return anchor

    def _parse_guard(self, value: Any, model: nn.Module, where: str) -> tuple[CollapseGuard | None, Apply]:
        """The guard the state has (this adapter's, else a new one its settings apply to) and what applies its state."""
        if value is None:
            return None, lambda: None
        guard = self.guard if self.guard is not None else CollapseGuard()
        device = next((p.device for p in model.parameters()), None)
        return guard, guard.parse_state(value, where=f"{where}.guard", device=device)

    # ------------------------------------------------------------------ one batch
    def adapt(self, x: Inputs, *, call: str = "auto", output: Callable[[Any], Any] | None = None) -> AdaptStats:
        """Adapt on the validated batch ``x`` and return its predictions (see the class)."""
        model, anchor, probe = self._model, self._anchor, self._probe
        if model is None or anchor is None or probe is None:
            raise RuntimeError("TestTimeAdapter is not bound to a model: OnlineLearner.adapt binds it")
        if self._stale_anchor:
            anchor.capture()
            self._anchor_method()
            self._clear_steps()
            self.method.reset()
            if self.guard is not None:
                self.guard.clear()
            self._stale_anchor = False
        rows = batch_len(x)
        batch_stats = rows >= self.min_batch
        if not batch_stats and not self._warned_small:
            self._warned_small = True
            warnings.warn(
                f"adapt: a batch of {rows} row(s) is below min_batch={self.min_batch}: BatchNorm keeps its running statistics"
                + f" and {self.method.name} takes no step on it: its predictions are the current model's",
                AdaptationWarning,
                stacklevel=3,
            )
        was_training = model.training
        with probe.capture():
            adapted, used = self._forward_and_step(model, x, batch_stats, call, output)
        summary = probe.summary(adapted, self.batches)
        verdict, outputs, reason = None, adapted, None
        source, source_summary = self._source(x, call, output) if self.guard is not None and self.guard.needs_source() else (None, None)
        if not self._finite():
            reason = "non-finite normalisation parameters after the step"
        elif self.guard is not None:
            verdict = self.guard.update(adapted, source, summary, source_summary)
            reason = verdict.reason
        if reason is not None and source is None:
            source, source_summary = self._source(x, call, output)
        if source is not None and (reason is not None or (verdict is not None and verdict.fallback)):
            outputs, summary = source, source_summary
        if reason is not None:
            self.reset()
            self.resets += 1
            self.lr_scale *= self.backoff
        model.train(was_training)
        self.batches += 1
        return AdaptStats(outputs.detach(), used, batch_stats, reason is not None, reason, verdict, summary)

    def _forward_and_step(
        self, model: nn.Module, x: Inputs, batch_stats: bool, call: str, output: Callable[[Any], Any] | None
    ) -> tuple[torch.Tensor, int]:
        """The adapted forward (BatchNorm on batch statistics when ``batch_stats``) and the method's step."""
        model.eval()
        if batch_stats:
            for bn in batch_norms(model):
                bn.train()
        params = list(self._params.values())
        if not self.method.steps or not batch_stats:
            with torch.no_grad():
                return call_model(model, x, output=output, call=call).detach(), 0
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        try:
            with torch.enable_grad():
                logits = call_model(model, x, output=output, call=call)
                loss, used = self.method.loss(logits, self._params)
                if loss is not None and math.isfinite(float(loss.detach())):
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    self._step(grads)
                else:
                    used = 0
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
        return logits.detach(), used

    def _clear_steps(self) -> None:
        self._velocity, self._second, self._updates = {}, {}, 0

    def _source(self, x: Inputs, call: str, output: Callable[[Any], Any] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The source model's predictions (the anchor swapped in, eval mode, no gradient) and their dropout summary."""
        model, anchor, probe = self._model, self._anchor, self._probe
        assert model is not None and anchor is not None and probe is not None  # bound: adapt checked
        with anchor.swapped(), torch.no_grad(), probe.capture():
            model.eval()
            logits = call_model(model, x, output=output, call=call).detach()
        return logits, probe.summary(logits, self.batches)

    def _step(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Adam (beta1 = ``momentum``, beta2 0.999) or SGD with momentum on the affine parameters, on
        buffers of its own (the learner's optimizer and any gradient it is accumulating are left alone)."""
        self._updates += 1
        with torch.no_grad():
            for (name, p), g in zip(self._params.items(), grads):
                if g is None:
                    continue
                v = self._velocity.get(name)
                if self.optimizer == "sgd":
                    v = g.clone() if v is None else v.mul_(self.momentum).add_(g)
                    self._velocity[name] = v
                    p.sub_(self.method.lr * self.lr_scale * v)
                    continue
                v = (1 - self.momentum) * g if v is None else v.mul_(self.momentum).add_((1 - self.momentum) * g)
                s = self._second.get(name)
                s = 0.001 * g * g if s is None else s.mul_(0.999).addcmul_(g, g, value=0.001)
                self._velocity[name], self._second[name] = v, s
                v_hat = v / (1 - self.momentum**self._updates)
                s_hat = s / (1 - 0.999**self._updates)
                p.sub_(self.method.lr * self.lr_scale * v_hat / (s_hat.sqrt() + 1e-8))

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Apply a :meth:`state_dict` checked against ``model`` (see :meth:`parse_state`); all or nothing."""
        self.parse_state(state, model)()

    def _finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self._params.values())

    def report(self) -> dict[str, Any]:
        """Plain values for logs and benchmarks."""
        return {
            "method": self.method.name,
            "guarded": self.guard is not None,
            "batches": self.batches,
            "resets": self.resets,
            "lr_scale": self.lr_scale,
            "anchor_bytes": self.anchor_bytes,
            "model_copy_bytes": self.model_copy_bytes,
        }


def _parse_settings(value: Any, where: str) -> dict[str, Any]:
    """The adapter's settings, each as its constructor takes it."""
    if not isinstance(value, dict):
        raise ValueError(f"`{where}` must be a dict; got {type(value).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
    check_keys(where, value, set(_SETTINGS))
    if value["optimizer"] not in ("adam", "sgd"):
        raise ValueError(f"`{where}.optimizer == {short(value['optimizer'])}`, must be 'adam' or 'sgd'")
    momentum = check_number(f"{where}.momentum", value["momentum"], low=0.0)
    if momentum >= 1:
        raise ValueError(f"`{where}.momentum == {momentum}`, must be in [0, 1)")
    backoff = check_number(f"{where}.backoff", value["backoff"], low=0.0)
    if backoff > 1:
        raise ValueError(f"`{where}.backoff == {backoff}`, must be in [0, 1]")
    return {
        "optimizer": value["optimizer"],
        "momentum": momentum,
        "min_batch": check_int_in(f"{where}.min_batch", value["min_batch"], 2),
        "backoff": backoff,
    }


def _parse_steps(
    value: Any, params: Mapping[str, torch.Tensor], optimizer: str, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The step moments, copied onto their parameters' devices: per affine parameter (``params``, empty while
    unbound) a first moment and, for Adam, a second one (>= 0) of its shape and dtype; the step count."""
    if not isinstance(value, dict):
        raise ValueError(f"`{where}` must be a dict; got {type(value).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
    check_keys(where, value, {"velocity", "second", "updates"})
    updates = check_int_in(f"{where}.updates", value["updates"])
    moments = {}
    for key in ("velocity", "second"):
        tensors = value[key]
        if not isinstance(tensors, dict):
            raise ValueError(f"`{where}.{key}` must be a dict of tensors by parameter name")  # noqa: TRY004 (a bad state is a ValueError)
        unknown = sorted(map(str, set(tensors) - set(params)))
        if unknown:
            raise ValueError(f"`{where}.{key}` names {unknown[:4]}, which are not the bound model's normalisation parameters")
        moments[key] = {
            name: check_tensor(f"{where}.{key}.{name}", t, shape=tuple(params[name].shape), dtype=params[name].dtype) for name, t in tensors.items()
        }
    velocity, second = moments["velocity"], moments["second"]
    if optimizer == "sgd" and second:
        raise ValueError(f"`{where}.second` must be empty: SGD keeps no second moment")
    if optimizer == "adam" and set(second) != set(velocity):
        raise ValueError(f"`{where}.second` must name the parameters `{where}.velocity` names: Adam keeps both moments")
    for name, t in second.items():
        if bool((t < 0).any()):
            raise ValueError(f"`{where}.second.{name}` holds negative values (a moving mean of squares)")
    if velocity and updates == 0:
        raise ValueError(f"`{where}.updates == 0` with moments held: a moment follows at least one step")

    def placed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.detach().to(device=params[name].device).clone() for name, t in tensors.items()}

    return placed(velocity), placed(second), updates
