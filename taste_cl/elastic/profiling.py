"""Robust timing profile of one training step, split per trainable unit.

Timing on a shared CPU or a phone is noisy: a busy neighbour, a throttled core or a
background app can make one measurement several times too long. So every quantity is
measured in *rounds*: each round times every measurement once, in a shuffled order, so a
burst of load hits all of them alike instead of one; outliers are rejected (median +- 3
scaled MADs) and each estimate carries a 95% confidence interval. When the intervals are
too wide to tell the units apart, more rounds are measured (bounded by ``max_rounds``),
and a profile still too noisy says so (:attr:`TensorProfile.noisy`) instead of passing
noise off as a measurement.

Times are read from a *clock*: ``"wall"`` (``time.perf_counter``, what a step takes on
an otherwise idle device) or ``"cpu"`` (``time.process_time``, the CPU time of this
process: on a device shared with other processes it does not count the time they hold
the cores, so it stays steady while wall time swings with the neighbours' load).

A *unit* is a parameter tensor (``granularity="tensor"``: a layer's weight and bias are
separate units, as in ElasticTrainer) or a module with parameters of its own
(``granularity="module"``), in the order the forward pass first calls them. Only
*trainable* parameters make units (by default those with ``requires_grad``; the elastic
trainer passes the ones the user left trainable and the optimizer holds): a frozen
module is not a unit, but its forward time is in the step, and its activation-gradient
time counts wherever the backward pass has to cross it (between the loss and a trained
unit). A module called inside another captured module (a frozen ``nn.Linear`` inside a
LoRA wrapper) is timed as part of it, not twice.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from taste_cl._batch import call_model
from taste_cl._checks import check_int, check_positive
from taste_cl.elastic.tensor_profile import CLOCKS, Clock, Granularity, TensorProfile, check_clock, check_granularity
from taste_cl.learner.frozen import norm_modules, train_mode

__all__ = ["Clock", "Granularity", "TensorProfile", "profile_tensors", "trainable_ids", "unit_names", "unit_parameters"]

_Z95 = 1.96


def check_profile_options(granularity: str, clock: str, warmup: int, repeats: int, max_rounds: int, tolerance: float) -> None:
    """Check :func:`profile_tensors`' options (``ValueError`` naming the first bad one): shared
    with :class:`~taste_cl.elastic.trainer.ElasticTrainer`, which checks them when built."""
    check_granularity(granularity)
    check_clock(clock)
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 2)
    check_int("max_rounds", max_rounds, repeats)
    check_positive("tolerance", tolerance)


# ------------------------------------------------------------------ structured inputs
def first_rows(x: Any, n: int) -> Any:
    """A detached copy of the first ``n`` samples of every tensor leaf of ``x``."""
    return pytree.tree_map(lambda t: t[:n].detach().clone() if torch.is_tensor(t) else t, x)


def repeat_rows(x: Any, size: int) -> Any:
    """``x`` (one sample per leaf) repeated to ``size`` samples, contiguous."""
    return pytree.tree_map(lambda t: t.expand(size, *t.shape[1:]).contiguous() if torch.is_tensor(t) else t, x)


def describe_input(x: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the first tensor leaf (the cache key), plus all leaf shapes hashed in."""
    leaves = [t for t in pytree.tree_leaves(x) if torch.is_tensor(t)]
    if not leaves:
        raise ValueError("the example input holds no tensor")
    shape = tuple(int(d) for t in leaves for d in (*t.shape, -1))  # every leaf's shape, separated
    return shape, leaves[0].dtype


def _device(x: Any) -> torch.device:
    return next(t for t in pytree.tree_leaves(x) if torch.is_tensor(t)).device


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point()]


# ------------------------------------------------------------------ units
def trainable_ids(model: nn.Module, trainable: Iterable[nn.Parameter] | None) -> set[int]:
    """Ids of the parameters that may be units: ``trainable``, or by default those with ``requires_grad``."""
    if trainable is None:
        return {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in trainable}


def _direct_params(module: nn.Module, trainable: set[int]) -> list[tuple[str, nn.Parameter]]:
    """The module's own trainable parameters (ones the user froze are never units)."""
    return [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) in trainable]


def _detached_copy(value: Any) -> Any:
    """A tensor's detached copy (other values as they are): a recorded call must not change later."""
    return value.detach().clone() if torch.is_tensor(value) else value


@dataclass
class _Call:
    """One captured module call: its first inputs, and whether it ran inside another captured call."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    nested: bool


def _capture(model: nn.Module, example: Any, trainable: set[int], call: str) -> list[_Call]:
    """Run ``model`` once (``example`` passed as ``call`` says, :func:`~taste_cl._batch.call_model`); return the first
    call of every module with trainable parameters of its own and of every other leaf module (frozen or parameter-free), in call order.

    A leaf called while another captured module runs is left out (replaying the outer
    module times it already); a unit module called so is kept, marked ``nested``.
    """
    calls: list[_Call] = []
    seen: set[str] = set()
    running: list[str] = []
    handles = []

    def enter(name: str, unit: bool) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in seen and (unit or not running):
                seen.add(name)
                copies = pytree.tree_map(_detached_copy, (args, kwargs))
                calls.append(_Call(name, module, copies[0], copies[1], nested=bool(running)))
            running.append(name)

        return record

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        running.pop()

    for name, module in model.named_modules():
        unit = bool(_direct_params(module, trainable))
        if unit or (not list(module.children()) and name):
            handles.append(module.register_forward_pre_hook(enter(name, unit), with_kwargs=True))
            handles.append(module.register_forward_hook(leave))
    try:
        with torch.no_grad():
            call_model(model, example, call=call)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _units_of(name: str, module: nn.Module, granularity: str, trainable: set[int]) -> list[tuple[str, list[nn.Parameter]]]:
    params = _direct_params(module, trainable)
    if not params:
        return []
    if granularity == "module":
        return [(name, [p for _, p in params])]
    return [(f"{name}.{pname}" if name else pname, [p]) for pname, p in params]


def unit_names(
    model: nn.Module, example: Any, *, granularity: Granularity = "tensor", trainable: Iterable[nn.Parameter] | None = None, call: str = "auto"
) -> list[str]:
    """The units of ``model`` for ``example``, in execution order (one no-grad forward pass).

    ``trainable``: the parameters that may be units (default: those with ``requires_grad``);
    ``call``: how a dict or tuple ``example`` is passed to the model (the learner's ``call``).
    """
    check_granularity(granularity)
    ids = trainable_ids(model, trainable)
    modes = _modes(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            calls = _capture(model, example, ids, call)
    finally:
        _restore(model, buffers, modes)
    return [unit for call in calls for unit, _ in _units_of(call.name, call.module, granularity, ids)]


def unit_parameters(model: nn.Module, units: Sequence[str], granularity: str, trainable: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The trainable parameters of each named unit.

    ``KeyError`` naming a unit that is not in the model, or that is frozen: a tensor unit
    not in ``trainable``, a module unit without a parameter of its own in it.
    """
    ids = trainable_ids(model, trainable)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    modules = dict(model.named_modules())
    out = []
    for unit in units:
        if granularity == "module":
            if unit not in modules:
                raise KeyError(f"no module named {unit!r} in the model")
            chosen = [p for p in modules[unit].parameters(recurse=False) if id(p) in ids]
        else:
            if unit not in params:
                raise KeyError(f"no parameter named {unit!r} in the model")
            chosen = [params[unit]] if id(params[unit]) in ids else []
        if not chosen:
            raise KeyError(f"unit {unit!r} is frozen in this model (requires_grad=False, or not in the optimizer)")
        out.append(chosen)
    return out


def _modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every module's train/eval mode (the learner keeps frozen parts' normalisation modules in eval mode)."""
    return [(module, module.training) for module in model.modules()]


def _restore(model: nn.Module, buffers: dict[str, torch.Tensor], modes: list[tuple[nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


class SavedBytes:
    """Context manager counting the bytes autograd saves for backward inside it.

    A storage is counted once, with the largest extent any saved view of it covers (so a
    batch sliced from a big dataset counts as the batch); ``exclude`` holds storage
    pointers not to count (the parameters, which exist anyway).
    """

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self._sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self._sizes[ptr] = max(self._sizes.get(ptr, 0), t.numel() * t.element_size())
        return t

    @property
    def total(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> SavedBytes:  # noqa: PYI034
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


# ------------------------------------------------------------------ robust timing
@dataclass
class _Measure:
    """One quantity to time: ``prepare()`` builds (untimed) the callable to time."""

    prepare: Callable[[], Callable[[], Any]]
    samples: list[float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_rounds(measures: Sequence[_Measure], rounds: int, *, device: torch.device, rng: random.Random, clock: str) -> None:
    """Time every measure once per round, in a fresh shuffled order each round."""
    now = CLOCKS[clock]
    order = list(range(len(measures)))
    for _ in range(rounds):
        rng.shuffle(order)
        for index in order:
            timed = measures[index].prepare()
            _sync(device)
            start = now()
            timed()
            _sync(device)
            measures[index].samples.append(now() - start)


def robust_estimate(samples: Sequence[float]) -> tuple[float, float]:
    """(estimate, 95% CI half-width) of a timing: the median of the samples left after
    dropping those more than 3 scaled MADs from the median; the CI is that of a median
    (1.2533 x the standard error of the mean of the kept samples)."""
    if not samples:
        raise ValueError("no samples")
    median = statistics.median(samples)
    mad = 1.4826 * statistics.median(abs(s - median) for s in samples)
    kept = [s for s in samples if abs(s - median) <= 3 * mad] if mad > 0 else list(samples)
    estimate = statistics.median(kept)
    if len(kept) < 2:
        return estimate, estimate
    return estimate, _Z95 * 1.2533 * statistics.stdev(kept) / math.sqrt(len(kept))


def _grad_measure(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[nn.Parameter] | None, param_ptrs: set[int]
) -> tuple[_Measure, int]:
    """Measure of the backward through ``module`` w.r.t. ``targets`` (None: its float inputs),
    and the bytes autograd keeps for it (parameter storage excluded)."""
    own = list(module.parameters())
    wanted = targets or []

    def prepare(count: list[int] | None = None) -> Callable[[], Any]:
        flags = [p.requires_grad for p in own]
        for p in own:
            p.requires_grad_(any(p is q for q in wanted))
        try:
            leaves = pytree.tree_map(
                lambda a: a.clone().requires_grad_(targets is None) if torch.is_tensor(a) and a.is_floating_point() else a,
                (args, kwargs),
            )
            inputs = [a for a in pytree.tree_leaves(leaves) if torch.is_tensor(a) and a.requires_grad]
            # clones of the leaves, so in-place modules (ReLU(inplace=True)) may run
            call_args, call_kwargs = pytree.tree_map(lambda a: a.clone() if torch.is_tensor(a) and a.requires_grad else a, leaves)
            if count is None:
                out = module(*call_args, **call_kwargs)
            else:
                with SavedBytes(param_ptrs) as saved:
                    out = module(*call_args, **call_kwargs)
                count[0] = saved.total
        finally:
            for p, flag in zip(own, flags):
                p.requires_grad_(flag)
        outs = [o for o in _float_leaves(out) if o.requires_grad]
        wrt = inputs if targets is None else list(wanted)
        if not outs or not wrt:
            return lambda: None
        grads = [torch.ones_like(o) for o in outs]
        return lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True)

    count = [0]
    prepare(count)
    return _Measure(prepare, []), count[0]


def profile_tensors(
    model: nn.Module,
    example: Any,
    *,
    granularity: Granularity = "tensor",
    warmup: int = 2,
    repeats: int = 7,
    max_rounds: int = 28,
    tolerance: float = 0.2,
    seed: int = 0,
    clock: Clock = "wall",
    trainable: Iterable[nn.Parameter] | None = None,
    output: Callable[[Any], Any] | None = None,
    call: str = "auto",
    frozen_norms: Sequence[str] = (),
) -> TensorProfile:
    """Measure forward, per-unit weight-gradient and activation-gradient times on ``example``.

    ``example`` is one training batch (a tensor, or a dict/tuple of tensors passed as
    keyword/positional arguments). Each unit's module is replayed alone on its captured
    input; a unit-free leaf module's (ReLU, pooling, a frozen layer) activation-gradient
    time is added to the next unit's, since both are spent under the same condition, and
    after the last unit it is the profile's ``tail_grad_s``, spent whenever anything trains.
    ``trainable``: the parameters that train, and so may be units (default: those with
    ``requires_grad``); the model is measured with exactly these requiring gradients.
    ``warmup`` untimed rounds, then ``repeats`` timed rounds; while
    :meth:`TensorProfile.relative_noise` exceeds ``tolerance``, the number of rounds is
    doubled, up to ``max_rounds``. The model's parameters, their gradients and
    ``requires_grad`` flags, buffers (BatchNorm statistics) and the torch RNG are left as
    they were. ``clock``: ``"wall"`` or ``"cpu"`` (see the module doc). ``output`` picks the
    trained tensor from the model's output (the learner's ``output``; :mod:`taste_cl.outputs`):
    the full backward starts from it, as the training step's does. ``call`` says how a dict or
    tuple ``example`` is passed to the model (the learner's ``call``, :data:`~taste_cl._batch.CALL_MODES`).
    The model trains in train mode with the normalisation modules named ``frozen_norms`` in eval
    mode, as the learner's step runs it (its :attr:`~taste_cl.OnlineLearner.frozen_norms`).
    """
    check_profile_options(granularity, clock, warmup, repeats, max_rounds, tolerance)
    ids = trainable_ids(model, trainable)
    device = _device(example)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    kept = [(p, p.requires_grad, p.grad) for p in model.parameters()]
    modes = _modes(model)
    train_mode(model, norm_modules(model, frozen_norms))
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        for p, _, _ in kept:
            p.requires_grad_(id(p) in ids)
            p.grad = None  # the full backward accumulates here: the user's gradients are set aside
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            parts = _measures(_capture(model, example, ids, call), granularity, ids, param_ptrs)
            forward = _Measure(lambda: lambda: call_model(model, example, output=output, call=call), [])

            def full_backward() -> Callable[[], Any]:
                outs = [o for o in _float_leaves(call_model(model, example, output=output, call=call)) if o.requires_grad]
                return lambda: torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            backward = _Measure(full_backward, [])
            measures = [*parts.weight, *(m for group in parts.act for m in group), *parts.tail, forward, backward]
            rng = random.Random(seed)
            _run_rounds(measures, warmup, device=device, rng=rng, clock=clock)
            for m in measures:
                m.samples.clear()
            rounds = 0
            target = repeats
            while True:
                _run_rounds(measures, target - rounds, device=device, rng=rng, clock=clock)
                rounds = target
                profile = _summarise(parts, forward, backward, granularity, rounds, clock)
                if profile.relative_noise() <= tolerance or rounds >= max_rounds:
                    break
                target = min(2 * rounds, max_rounds)
    finally:
        for p, flag, grad in kept:
            p.requires_grad_(flag)
            p.grad = grad
        _restore(model, buffers, modes)
    if profile.relative_noise() > tolerance:
        return TensorProfile(**{**profile.to_dict(), "noisy": True})
    return profile


@dataclass
class _Parts:
    """What :func:`profile_tensors` times per unit, and the backward after the last unit."""

    units: list[str]
    weight: list[_Measure]
    act: list[list[_Measure]]
    param_bytes: list[int]
    input_bytes: list[int]
    act_bytes: list[int]
    tail: list[_Measure]
    tail_bytes: int


def _measures(calls: list[_Call], granularity: str, trainable: set[int], param_ptrs: set[int]) -> _Parts:
    """The measures of every captured call: a unit's weight gradient; the activation gradient
    of each segment (the modules up to a unit, charged to that unit); the tail after the last."""
    parts = _Parts([], [], [], [], [], [], [], 0)
    pending: list[_Measure] = []
    pending_bytes = 0
    for call in calls:
        if not call.nested:  # a nested module's backward is inside the outer module's
            measure, kept = _grad_measure(call.module, call.args, call.kwargs, None, param_ptrs)
            pending.append(measure)
            pending_bytes += kept
        for index, (unit, params) in enumerate(_units_of(call.name, call.module, granularity, trainable)):
            w_measure, w_kept = _grad_measure(call.module, call.args, call.kwargs, params, param_ptrs)
            first = index == 0 and not call.nested
            parts.units.append(unit)
            parts.weight.append(w_measure)
            parts.act.append(pending if first else [])
            parts.act_bytes.append(pending_bytes if first else 0)
            parts.input_bytes.append(w_kept)
            parts.param_bytes.append(sum(p.numel() * p.element_size() for p in params))
            if first:
                pending, pending_bytes = [], 0
    if parts.units:  # before any unit, nothing is ever passed back
        parts.tail, parts.tail_bytes = pending, pending_bytes
    return parts


def _sum_estimates(group: list[_Measure]) -> tuple[float, float]:
    """(sum of the estimates, root-sum-square of their CIs) of a group timed as one segment."""
    parts = [robust_estimate(m.samples) for m in group]
    return sum(e for e, _ in parts), math.sqrt(sum(c * c for _, c in parts))


def _summarise(parts: _Parts, forward: _Measure, backward: _Measure, granularity: str, rounds: int, clock: str) -> TensorProfile:
    w_est = [robust_estimate(m.samples) for m in parts.weight]
    a_est = [_sum_estimates(group) for group in parts.act]
    tail, tail_ci = _sum_estimates(parts.tail)
    f_est, f_ci = robust_estimate(forward.samples)
    return TensorProfile(
        units=list(parts.units),
        weight_grad_s=[e for e, _ in w_est],
        act_grad_s=[e for e, _ in a_est],
        forward_s=f_est,
        backward_s=robust_estimate(backward.samples)[0],
        weight_grad_ci=[c for _, c in w_est],
        act_grad_ci=[c for _, c in a_est],
        forward_ci=f_ci,
        param_bytes=list(parts.param_bytes),
        input_bytes=list(parts.input_bytes),
        act_bytes=list(parts.act_bytes),
        granularity=granularity,
        rounds=rounds,
        clock=clock,
        tail_grad_s=tail,
        tail_grad_ci=tail_ci,
        tail_bytes=parts.tail_bytes,
    )
