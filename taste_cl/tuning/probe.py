"""Probes of the batch-size tuner: real training steps on a private copy of the user's setup.

A :class:`ProbeRunner` deep-copies the model, the loss and the optimizer together (so the
copy's optimizer holds the copy's parameters, with the user's class, param-group
hyperparameters and state, whatever its constructor accepts) and trains the copy on real
samples tiled to the probed batch size, keeping their dtypes and structure (a tensor, or a
dict/tuple/list of tensors). Nothing the caller owns is touched: not the model, the
optimizer, the RNG state nor the thread count.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from taste_cl._batch import batch_len, call_model, index_batch
from taste_cl.learner.frozen import frozen_norms, train_mode
from taste_cl.tasks import infer_task
from taste_cl.tuning.searcher import thread_options, timed_rate

__all__ = ["ProbeRunner", "Samples", "max_batch_for_memory", "measure_throughput", "num_threads", "preserved_rng", "thread_options", "timed_rate"]

Samples = tuple[Any, Any]  # (inputs, targets): tensors or dicts/tuples/lists of tensors, batch first
LossFn = Callable[[Any, Any], torch.Tensor]


def _trained_targets(model: nn.Module, loss_fn: LossFn, samples: Samples, output: Callable[[Any], Any] | None, call: str = "auto") -> Any:
    """The targets as :class:`~taste_cl.OnlineLearner` trains on them, for a loss whose task
    taste_cl knows (:func:`~taste_cl.tasks.infer_task`): ``(n,)`` regression targets of an
    ``(n, 1)`` output become ``(n, 1)``, and targets the task refuses raise
    :class:`~taste_cl.exceptions.InvalidBatchError` instead of being timed on a broadcast
    loss. ``model`` is the probes' private copy, ``output`` the learner's output selection;
    other losses keep their targets."""
    x, y = samples
    try:
        model.eval()
        with torch.no_grad():
            out = call_model(model, index_batch(x, slice(0, 1)), output=output, call=call)
    except Exception:  # noqa: BLE001 - the probes find out what trains
        return y
    task = infer_task(loss_fn, tuple(out.shape[1:])) if isinstance(out, torch.Tensor) else None
    if task is None:
        return y
    first = next(model.parameters(), out)
    return task.to_targets(y, n=batch_len(x), output_shape=tuple(out.shape[1:]), dtype=first.dtype, device=first.device)


def tile(samples: Samples, size: int) -> Samples:
    """``size`` samples made by cycling through the real ones."""
    return index_batch(samples, torch.arange(size) % batch_len(samples[0]))


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads (None: unchanged), then restore the count."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def preserved_rng(*owners: object) -> Iterator[None]:
    """Restore torch's, numpy's and Python's global RNGs, and every ``torch.Generator`` and
    ``numpy.random.Generator`` attribute of ``owners`` (a replay buffer's), when the block ends."""
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    generators = [g for owner in owners for g in vars(owner).values() if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in generators]
    numpy_generators = [g for owner in owners for g in vars(owner).values() if isinstance(g, np.random.Generator)]
    numpy_states = [g.bit_generator.state for g in numpy_generators]
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        for generator, state in zip(generators, states):
            generator.set_state(state)
        for numpy_generator, numpy_state in zip(numpy_generators, numpy_states):
            numpy_generator.bit_generator.state = numpy_state


class ProbeRunner:
    """Time training steps of a private copy of ``(model, loss_fn, optimizer)`` on real samples.

    The copy is made once; its parameters are reset before every probe, so probes do not
    drift the weights they time. ``clock`` times each step (seconds; a test or simulator
    passes its own so that the measurements do not depend on the machine's load).
    ``output`` picks the trained tensor from the model's output, as the learner's
    ``output`` does (:mod:`taste_cl.outputs`; None: the model returns one tensor).
    The copy trains as a learner built on ``(model, optimizer)`` with the default
    ``frozen_norm="eval"`` does: the normalisation modules of its frozen parts in eval mode
    (:mod:`taste_cl.learner.frozen`), so a batch of one trains where only those hold BatchNorm.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        samples: Samples,
        *,
        clock: Callable[[], float] = time.perf_counter,
        output: Callable[[Any], Any] | None = None,
        call: str = "auto",
    ) -> None:
        batch_len(samples[0])
        self.clock = clock
        self.output, self.call = output, call
        self.model, self.loss_fn, self.optimizer = copy.deepcopy((model, loss_fn, optimizer))
        self.samples = (samples[0], _trained_targets(self.model, self.loss_fn, samples, output, call))
        self._params = [p for group in self.optimizer.param_groups for p in group["params"]]
        train_mode(self.model, frozen_norms(self.model, [p for p in self._params if p.requires_grad]).values())
        with torch.no_grad():
            self._initial = [p.detach().clone() for p in self._params]
        first = self._params[0] if self._params else next(self.model.parameters(), None)
        self._sync = torch.cuda.synchronize if first is not None and first.device.type == "cuda" else None

    def _reset(self) -> None:
        with torch.no_grad():
            for param, initial in zip(self._params, self._initial):
                param.copy_(initial)
                param.grad = None

    def _step(self, x: Any, y: Any) -> float:
        start = self.clock()
        loss = self.loss_fn(call_model(self.model, x, output=self.output, call=self.call), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._sync is not None:
            self._sync()
        return self.clock() - start

    def work(self, batch_size: int, steps: int, *, threads: int | None = None, max_seconds: float = math.inf) -> tuple[int, float]:
        """``(steps done, wall seconds)`` of up to ``steps`` training steps at ``batch_size``, after
        one untimed step that starts the thread pool: a fixed amount of work, so a slow spell
        counts in full (cut once ``max_seconds`` have passed, after at least one step)."""
        x, y = tile(self.samples, batch_size)
        self._reset()
        done, seconds = 0, 0.0
        with num_threads(threads):
            self._step(x, y)
            while done < steps and (done == 0 or seconds < max_seconds):
                seconds += self._step(x, y)
                done += 1
        return done, seconds

    def trains_at(self, batch_size: int) -> str | None:
        """None if one training step at ``batch_size`` works, else why not."""
        x, y = tile(self.samples, batch_size)
        self._reset()
        try:
            self._step(x, y)
        except Exception as error:  # noqa: BLE001 - any failure of the user's model makes the size infeasible
            return f"{type(error).__name__}: {error}"
        return None

    def smallest_trainable(self, limit: int) -> tuple[int, list[tuple[int, str]]]:
        """The smallest batch of 1, 2, 4, ... up to ``limit`` one training step works at, and the
        ``(batch, reason)`` failures before it; ``(0, failures)`` if none works."""
        failures: list[tuple[int, str]] = []
        batch = 1
        while batch <= limit:
            reason = self.trains_at(batch)
            if reason is None:
                return batch, failures
            failures.append((batch, reason))
            batch *= 2
        return 0, failures

    def measure(
        self, batch_size: int, *, threads: int | None = None, min_time: float = 0.15, min_steps: int = 3, stop_below: float | None = None
    ) -> float:
        """Training samples/s at ``batch_size``: ``batch_size`` over the lower-quartile step
        time of at least ``min_steps`` steps and ``min_time`` seconds, after one warm-up step.

        With ``stop_below``, a size clearly slower than that rate stops early, once its
        steps have taken a third of ``min_time`` (so a preempted sub-millisecond step on a
        busy machine cannot end a probe): after the warm-up if it ran at under half of
        ``stop_below``, else as soon as the median step is under it. Raises whatever the
        model raises (the caller marks the size infeasible).
        """
        x, y = tile(self.samples, batch_size)
        self._reset()
        switched = threads is not None and threads != torch.get_num_threads()
        with num_threads(threads):
            if switched:  # a new thread count's first step starts its pool: on a busy machine that can take a
                self._step(x, y)  # whole scheduler period, which must not end the probe as if every step did
            return timed_rate(lambda: self._step(x, y), batch_size, min_time=min_time, min_steps=min_steps, stop_below=stop_below)


def measure_throughput(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    samples: Samples,
    batch_size: int,
    *,
    threads: int | None = None,
    min_time: float = 0.15,
) -> float:
    """Training samples/s of full steps (forward, backward, optimizer) at ``batch_size`` on
    ``samples`` (tiled), on copies: the caller's model and optimizer are untouched."""
    with preserved_rng():
        return ProbeRunner(model, optimizer, loss_fn, samples).measure(batch_size, threads=threads, min_time=min_time)


def max_batch_for_memory(model: nn.Module, x: Any, *, budget_bytes: float, call: str = "auto") -> int:
    """Largest batch whose estimated training memory fits ``budget_bytes``.

    Estimate: parameters x4 (weights, gradients, two optimizer moments) plus, per sample,
    three times the bytes of every leaf module's outputs for one sample of ``x``.
    """
    activation_bytes = 0

    def count(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal activation_bytes
        activation_bytes += sum(t.numel() * t.element_size() for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()  # one sample: BatchNorm cannot run it in training mode
        with torch.no_grad(), preserved_rng():
            call_model(model, index_batch(x, torch.arange(1)), call=call)
    finally:
        for module, mode in modes:
            module.training = mode
        for handle in handles:
            handle.remove()
    fixed = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    return max(1, int((budget_bytes - fixed) // (3 * max(activation_bytes, 1))))
