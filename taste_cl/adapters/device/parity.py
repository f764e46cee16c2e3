"""The parity gate: train a few steps in eager PyTorch and in a device backend from identical weights, compare.

An exported training graph can load and run yet compute something else (a dropped
optimizer state, a wrong loss reduction, a transform that is not equivalent). Before
artifacts are published, :func:`check_parity` runs the same batches through a
:class:`TorchTrainer` (the eager reference) and a backend's :class:`Trainer`, and compares
the outputs before and after training, every step's loss and every trainable parameter.
Differences are scaled by magnitude (``|a - b| / max(1, |a|)``, maximum over elements; a
loss by the larger of its own and the outputs' magnitude, since a loss computed from
outputs of magnitude M carries their rounding, about M times the dtype's epsilon: a
cross-entropy of 4 from logits near 150 differs by 5e-4 between float32 and float64) and
compared with tolerances that default from the dtype. The module itself imports no torch
(only :class:`TorchTrainer` does, when built).

A runtime that trains like torch also diverges like torch: a learning rate too high for the
model, or BatchNorm frozen to running statistics that do not fit the weights, sends both to
``inf``/``nan`` within a few steps, and comparing non-finite numbers would blame the runtime.
So both keep training on the batches (cycled) for at least ``watch_steps`` steps, and the
reference's own numbers decide first: non-finite outputs, a non-finite loss, or a loss
:data:`LOSS_GROWTH` times its first (at least 1) is :class:`TrainingDivergesError`, which says
whether the runtime diverged the same way and what to try (each of the exporter's
``alternatives``, a setting such as ``batchnorm='batch'`` or a lower ``lr``, trained in torch
on the same batches: which of them stay finite); only a healthy reference is compared, and a
runtime that diverges alone fails parity.

Some trainings amplify rounding: float32 noise of 1e-7 grows a hundredfold per step
(BatchNorm with batch statistics over a handful of values per channel, as in a CNN whose
last stage sees 1x1 maps of a batch of 8), so after three steps torch's own float32 run is
as far from the same run in float64 as any runtime is, and no tolerance tells a faithful
runtime from a wrong one. Given a float64 reference (``precise``), a failed comparison is
checked against it: when torch's float32 departs from it beyond the tolerance and the
runtime departs no more than :data:`ROUNDING_FACTOR` times as far,
:class:`UnstableTrainingError` says so and which ``alternatives`` (trained in float32 and in
float64) keep torch within the tolerance of exact arithmetic. A runtime within the tolerance
of the float64 run passes whatever torch's float32 did: two faithful float32 runs, each
within the tolerance of exact arithmetic, may differ from each other by up to twice it (a
ResNet-18's outputs by 1.1e-4 between ONNX Runtime and torch on one CI machine).

>>> import numpy as np
>>> class Const:
...     def train_step(self, x, y): return 0.5
...     def parameters(self): return {"w": np.ones(2, np.float32)}
...     def predict(self, x): return np.zeros((len(x), 2), np.float32)
>>> report = check_parity(Const(), Const(), [(np.zeros((3, 1)), np.zeros(3))], backend="same")
>>> report.passed, report.max_loss_diff
(True, 0.0)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from taste_cl.adapters.device.artifacts import GENERATED_ROWS_NOTE, PARITY_ROWS
from taste_cl.exceptions import ParityError, TrainingDivergesError, UnstableTrainingError

__all__ = [
    "LOSS_GROWTH",
    "ROUNDING_FACTOR",
    "WATCH_STEPS",
    "ParityError",
    "ParityReport",
    "TorchTrainer",
    "Trainer",
    "TrainingDivergesError",
    "UnstableTrainingError",
    "check_parity",
    "default_tolerance",
    "training_diverges",
]

_TOLERANCES = {"float64": 1e-8, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
WATCH_STEPS = 10  # steps both trainers take (at least) while watched for divergence
LOSS_GROWTH = 1e3  # a loss this many times the first one (at least 1) is divergence
ROUNDING_FACTOR = 10.0  # a runtime within this many times torch's own float32 departure from float64 rounds like torch
_CAUSES = "Likely causes: a learning rate too high for this model, or BatchNorm frozen to running statistics that do not fit the weights"


class Trainer(Protocol):
    """One training step on numpy inputs, as a device would do it."""

    def train_step(self, x: Any, y: np.ndarray) -> float:
        """Train one step on ``x`` (an array or a dict of arrays) and targets ``y``; return the loss."""
        ...

    def parameters(self) -> dict[str, np.ndarray]:
        """Trainable parameters by their PyTorch ``named_parameters()`` names."""
        ...

    def predict(self, x: Any) -> np.ndarray:
        """Outputs for ``x`` in eval mode, changing no state."""
        ...


def _to_torch(value: Any) -> Any:
    import torch

    if isinstance(value, Mapping):
        return {key: _to_torch(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_torch(item) for item in value)
    return torch.as_tensor(np.asarray(value))


def _call(model: Any, x: Any) -> Any:
    """``model`` on ``x`` as :func:`~taste_cl._batch.call_model` calls it (call mode ``"auto"``); torch imported when called."""
    from taste_cl._batch import call_model

    return call_model(model, x)


def _numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of ``tensor`` (bfloat16, which numpy lacks, as float32)."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy().copy()


class TorchTrainer:
    """The eager reference: deep copies of ``model`` and ``optimizer`` (state included) and ``loss_fn``.

    ``forward(model, x)`` calls the model (default: by the structure of ``x``); numpy inputs
    become tensors with their dtype; ``loss_fn(outputs, targets)`` gives the loss. ``dtype``
    (a torch dtype name, e.g. ``"float64"``) trains in that precision instead: the model's
    floating tensors, the optimizer's state and every floating input and target are cast.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        forward: Callable[[Any, Any], Any] | None = None,
        dtype: str | None = None,
    ) -> None:
        import torch

        # one deepcopy call keeps the optimizer's state keyed by the copied parameters
        self.model, self.optimizer = copy.deepcopy((model, optimizer))
        self.loss_fn = loss_fn
        self.forward = forward or _call
        self._names = {id(p): name for name, p in self.model.named_parameters()}
        self._dtype = None if dtype is None else getattr(torch, dtype)
        if self._dtype is not None:
            self.model.to(self._dtype)  # in place: the optimizer keeps holding the same parameters
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        state[key] = value.to(self._dtype)

    def _tensors(self, value: Any) -> Any:
        """``value`` as tensors, floating ones in the trainer's dtype."""
        import torch.utils._pytree as pytree

        tensors = _to_torch(value)
        if self._dtype is None:
            return tensors
        return pytree.tree_map(lambda t: t.to(self._dtype) if t.is_floating_point() else t, tensors)

    def train_step(self, x: Any, y: np.ndarray) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.forward(self.model, self._tensors(x)), self._tensors(y))
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def parameters(self) -> dict[str, np.ndarray]:
        return {name: _numpy(p) for name, p in self.model.named_parameters() if p.requires_grad}

    def predict(self, x: Any) -> np.ndarray:
        import torch

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.forward(self.model, self._tensors(x))
        finally:
            self.model.train(was_training)
        return _numpy(out)


@dataclass(frozen=True)
class ParityReport:
    """The largest scaled differences found by :func:`check_parity`, and the tolerances they were held to."""

    backend: str
    steps: int
    max_output_diff: float
    max_loss_diff: float
    max_param_diff: float
    output_tol: float
    loss_tol: float
    param_tol: float
    watched_steps: int = 0  # steps both trained while watched for divergence (the compared ones included)
    diverged: str = ""  # how the backend diverged while torch did not; empty when it did not
    exact_departure: float | None = None  # the backend's departure from a float64 run, when one was compared
    torch_departure: float | None = None  # torch's float32 departure from that run
    rows: str = "given"  # where the compared batches came from (PARITY_ROWS): "generated" rows are not the user's

    @property
    def passed(self) -> bool:
        """Every difference is finite and within its tolerance, or the backend is within the output
        tolerance of the float64 run, and the backend did not diverge alone."""
        within = self.max_output_diff <= self.output_tol and self.max_loss_diff <= self.loss_tol and self.max_param_diff <= self.param_tol
        exact = self.exact_departure is not None and self.exact_departure <= self.output_tol
        return (within or exact) and not self.diverged

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"{self.backend} parity {verdict} over {self.steps} steps: "
            f"outputs {self.max_output_diff:.3g} (tol {self.output_tol:.3g}), "
            f"losses {self.max_loss_diff:.3g} (tol {self.loss_tol:.3g}), "
            f"parameters {self.max_param_diff:.3g} (tol {self.param_tol:.3g})"
            + (f"; {self.exact_departure:.3g} from float64" if self.exact_departure is not None else "")
            + (f" (torch's float32 {self.torch_departure:.3g})" if self.torch_departure is not None else "")
            + (f"; {self.diverged}" if self.diverged else "")
            + (f"; {GENERATED_ROWS_NOTE}" if self.rows == "generated" else "")
        )


def _diverges_message(backend: str, step: int, reason: str, losses: tuple[list[float], list[float]],
                      alternatives: Mapping[str, tuple[int, str] | None], steps: int) -> str:  # fmt: skip
    """The :class:`TrainingDivergesError` message: what diverged, whether the runtime did too, and what to try."""
    reference, candidate = losses
    also = _divergence(None, candidate)
    if also is not None:
        same = f"{backend} diverged too ({also[1]}): the runtime is faithful"
    else:
        same = f"{backend} did not, over the same {len(candidate)} steps"
    shown = ", ".join(f"{loss:.3g}" for loss in reference[: max(step, 1)])
    return (
        f"refusing to publish: the training itself diverges, not the runtime: torch's {reason} (losses {shown}); "
        f"{same}. {_CAUSES}. {_advice(alternatives, steps)}"
    )


def _advice(alternatives: Mapping[str, tuple[int, str] | None], steps: int) -> str:
    """What to try, from the alternatives torch trained on the same batches."""
    if not alternatives:
        return "Try a lower learning rate."
    finite = [setting for setting, found in alternatives.items() if found is None]
    failing = {setting: found[1] for setting, found in alternatives.items() if found is not None}
    if not finite:
        tried = " and with ".join(f"{setting} ({why})" for setting, why in failing.items())
        return f"In torch on the same batches it diverges with {tried} too: lower the learning rate further."
    verb = "train" if len(finite) > 1 else "trains"
    told = f"In torch on the same batches over {steps} steps, {' and '.join(finite)} {verb} without diverging: export with {finite[0]}"
    return told + "".join(f"; with {setting} it diverges too ({why})" for setting, why in failing.items()) + "."


def _unstable_message(report: ParityReport, departures: tuple[float, float], alternatives: Mapping[str, float], tolerance: float) -> str:
    """The :class:`UnstableTrainingError` message: how far each precision departs, the likely causes, what to try."""
    torch_departure, runtime_departure = departures
    stable = [setting for setting, departure in alternatives.items() if departure <= tolerance]
    if stable:
        advice = (f"In torch on the same batches, {' and '.join(stable)} {'keep' if len(stable) > 1 else 'keeps'} "
                  f"float32 within the tolerance of float64: export with {stable[0]}.")  # fmt: skip
    elif alternatives:
        tried = ", ".join(f"{setting} ({departure:.3g})" for setting, departure in alternatives.items())
        advice = f"With {tried} torch's float32 departs from float64 too: lower the learning rate further or use larger batches."
    else:
        advice = "Lower the learning rate or use larger batches."
    return (
        f"refusing to publish: the training amplifies rounding, so parity cannot be checked: torch's own float32 training "
        f"departs from the same training in float64 by {torch_departure:.3g} over {report.steps} steps "
        f"(tolerance {tolerance:.3g}) and {report.backend} by {runtime_departure:.3g}, as rounding does ({report}). "
        "Likely causes: BatchNorm with batch statistics over few values per channel (small feature maps or batches), "
        "a learning rate that makes the training chaotic, or a ReLU whose input is within rounding of 0 on one of the "
        "gate's samples (its gradient is 0 in one precision and 1 in the other: one step moves a weight by about lr "
        f"more; the more steps compared, the likelier). {advice}"
    )


@dataclass
class _Run:
    """What a trainer did over the compared steps: outputs before, losses, outputs after, parameters."""

    first: Any
    losses: list[float]
    outputs: list[Any]
    parameters: dict[str, np.ndarray]


def _run(trainer: Trainer, batches: Sequence[tuple[Any, np.ndarray]]) -> _Run:
    """Predict the first batch, train one step per batch, predict every batch, read the parameters."""
    first = trainer.predict(batches[0][0])
    losses = [trainer.train_step(x, y) for x, y in batches]
    return _Run(first, losses, [trainer.predict(x) for x, _ in batches], trainer.parameters())


def _differences(expected: _Run, got: _Run) -> tuple[float, float, float]:
    """The largest scaled output, loss and parameter differences of ``got`` from ``expected`` (losses
    scaled at least by the largest finite output of ``expected``: they inherit the outputs' rounding)."""
    outputs = max(_scaled_diff(a, b) for a, b in zip([expected.first, *expected.outputs], [got.first, *got.outputs]))
    magnitude = max((_magnitude(value) for value in [expected.first, *expected.outputs]), default=1.0)
    losses = max(_scaled_diff(a, b, floor=magnitude) for a, b in zip(expected.losses, got.losses))
    parameters = max((_scaled_diff(value, got.parameters[name]) for name, value in expected.parameters.items()), default=0.0)
    return outputs, losses, parameters


def _departure(differences: tuple[float, float, float], tolerances: tuple[float, float, float]) -> float:
    """How far beyond its tolerance the worst difference is, as a scaled difference at the output tolerance."""
    return max(difference * tolerances[0] / tolerance for difference, tolerance in zip(differences, tolerances))


def default_tolerance(dtype: Any) -> float:
    """The scaled tolerance for a dtype name or numpy dtype (float32: 1e-4); unknown dtypes get float32's."""
    return _TOLERANCES.get(str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype, _TOLERANCES["float32"])


def _magnitude(value: Any) -> float:
    """``max |value|`` over its finite elements, at least 1."""
    a = np.abs(np.asarray(value, dtype=np.float64))
    return max(1.0, float(a[np.isfinite(a)].max(initial=0.0)))


def _scaled_diff(reference: Any, candidate: Any, *, floor: float = 1.0) -> float:
    """``max |a - b| / max(floor, max |a|)``; ``inf`` on a shape mismatch or a non-finite value."""
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(candidate, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    return float(np.abs(a - b).max() / max(floor, float(np.abs(a).max())))


def _finite(value: Any) -> bool:
    return bool(np.isfinite(np.asarray(value, dtype=np.float64)).all())


def _divergence(first_outputs: Any, losses: list[float]) -> tuple[int, str] | None:
    """``(step, what)`` where a trainer diverged: non-finite outputs before training (step 0), a
    non-finite loss, or a loss :data:`LOSS_GROWTH` times the first (at least 1); None if it did not."""
    if first_outputs is not None and not _finite(first_outputs):
        return 0, "outputs are not finite before any training step"
    base = max(1.0, abs(losses[0])) if losses and math.isfinite(losses[0]) else 1.0
    for step, loss in enumerate(losses, 1):
        if not math.isfinite(loss):
            return step, f"loss is {loss} at step {step}"
        if abs(loss) > LOSS_GROWTH * base:
            return step, f"loss grew from {losses[0]:.3g} to {loss:.3g} by step {step}"
    return None


def training_diverges(trainer: Trainer, batches: Sequence[tuple[Any, np.ndarray]], steps: int) -> tuple[int, str] | None:
    """Train ``trainer`` ``steps`` steps on ``batches`` (cycled); ``(step, what)`` where it diverged, None if it did not."""
    first = trainer.predict(batches[0][0])
    losses: list[float] = []
    for step in range(steps):
        if (found := _divergence(first, losses)) is not None:
            return found
        x, y = batches[step % len(batches)]
        losses.append(trainer.train_step(x, y))
    return _divergence(first, losses)


def check_parity(
    reference: Trainer,
    candidate: Trainer,
    batches: Iterable[tuple[Any, np.ndarray]],
    *,
    backend: str,
    tolerance: float | None = None,
    param_tolerance: float | None = None,
    watch_steps: int = WATCH_STEPS,
    alternatives: Mapping[str, Callable[..., Trainer]] | None = None,
    precise: Callable[[], Trainer] | None = None,
    rows: str = "given",
) -> ParityReport:
    """Train ``reference`` and ``candidate`` on the same ``batches``; raise :class:`ParityError` if they differ.

    Compares the outputs on the first batch before training and on every batch after it,
    every step's loss, and every parameter of the reference (the candidate must report all
    of them under the same names). ``tolerance`` (default: from the reference's output
    dtype, 1e-4 for float32) applies to all three scaled differences; ``param_tolerance``
    (default: ``tolerance``) overrides it for parameters, e.g. for Adam-type optimizers,
    which turn rounding noise in a zero gradient into a full ``lr`` step. Both then keep
    training, the batches cycled, up to ``watch_steps`` steps in all: when the reference
    diverges (see the module), each of ``alternatives`` (a setting as the user writes it ->
    a fresh torch trainer with that setting; called with ``dtype="float64"`` for its float64
    twin) trains as long, and :class:`TrainingDivergesError` says which stay finite; when
    the candidate alone diverges, parity fails. When the comparison fails and ``precise``
    (a fresh float64 twin of the reference) is given, a runtime within the tolerance of the
    float64 run passes (its departure in ``exact_departure``) and a training that amplifies
    rounding is :class:`UnstableTrainingError` (see the module). ``rows`` says where the batches
    came from (:data:`~taste_cl.adapters.device.artifacts.PARITY_ROWS`); on ``"generated"`` rows every
    verdict says so, with how to give real ones. Returns the report.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("`batches` is empty, must hold at least one (x, y) batch")
    for name, value in (("tolerance", tolerance), ("param_tolerance", param_tolerance)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"`{name} == {value!r}`, must be None or a number > 0")
    if isinstance(watch_steps, bool) or not isinstance(watch_steps, int) or watch_steps < 0:
        raise ValueError(f"`watch_steps == {watch_steps!r}`, must be an int >= 0")
    if rows not in PARITY_ROWS:
        raise ValueError(f"`rows == {rows!r}`, must be one of {', '.join(map(repr, PARITY_ROWS))}")
    expected, got = _run(reference, batches), _run(candidate, batches)
    tol = float(tolerance) if tolerance is not None else default_tolerance(np.asarray(expected.first).dtype)
    missing = sorted(set(expected.parameters) - set(got.parameters))
    if missing:
        raise ValueError(f"{backend} reports no values for the trainable parameters {missing}")
    output_diff, loss_diff, param_diff = _differences(expected, got)
    losses = (list(expected.losses), list(got.losses))
    first = expected.first
    for step in range(len(batches), watch_steps):  # compared no more: a healthy run's rounding may grow
        if _divergence(first, losses[0]) is not None and _divergence(None, losses[1]) is not None:
            break
        x, y = batches[step % len(batches)]
        losses[0].append(reference.train_step(x, y))
        losses[1].append(candidate.train_step(x, y))
    diverged = _divergence(first, losses[0])
    if diverged is not None:
        steps = max(len(batches), watch_steps)
        tried = {setting: training_diverges(make(), batches, steps) for setting, make in (alternatives or {}).items()}
        raise TrainingDivergesError(
            _diverges_message(backend, *diverged, losses, tried, steps) + (f" Note: {GENERATED_ROWS_NOTE}." if rows == "generated" else ""),
            step=diverged[0], reference_losses=losses[0], candidate_losses=losses[1], alternatives=tried,
        )  # fmt: skip
    alone = _divergence(None, losses[1])
    param_tol = float(param_tolerance) if param_tolerance is not None else tol
    report = ParityReport(
        backend, len(batches), output_diff, loss_diff, param_diff, tol, tol, param_tol, len(losses[0]),
        "" if alone is None else f"{backend}'s {alone[1]} (of {len(losses[1])} watched) while torch's training stayed finite",
        rows=rows,
    )  # fmt: skip
    if not report.passed and not report.diverged and precise is not None:
        tolerances = (tol, tol, param_tol)
        exact = _run(precise(), batches)
        torch_departure = _departure(_differences(exact, expected), tolerances)
        runtime_departure = _departure(_differences(exact, got), tolerances)
        report = replace(report, exact_departure=runtime_departure, torch_departure=torch_departure)
        if not report.passed and tol < torch_departure and runtime_departure <= ROUNDING_FACTOR * torch_departure:
            tried_stability = {
                setting: _departure(_differences(_run(make(dtype="float64"), batches), _run(make(), batches)), tolerances)
                for setting, make in (alternatives or {}).items()
            }
            raise UnstableTrainingError(
                _unstable_message(report, (torch_departure, runtime_departure), tried_stability, tol),
                report=report, torch_departure=torch_departure, runtime_departure=runtime_departure, alternatives=tried_stability,
            )  # fmt: skip
    if not report.passed:
        raise ParityError(report)
    return report
