"""Every error and warning taste_cl raises, in one hierarchy.

``except TasteCLError`` catches every taste_cl error, and ``warnings.simplefilter(..., TasteCLWarning)``
every taste_cl warning. Each class also subclasses the built-in callers expect: an error caused by
bad user input is a :class:`ValueError`, a missing extra an :class:`ImportError`, a failed run a
:class:`RuntimeError`. Messages name what was wrong, the rule and the value received.

This module imports nothing heavy (no torch, numpy or optional extra): the torch-free device
runtimes raise from it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from taste_cl.adapters.device.parity import ParityReport

__all__ = [
    "AdaptationWarning",
    "ArtifactError",
    "BatchNormModeWarning",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DeploymentError",
    "ElasticWarning",
    "ExportError",
    "GeneratedRowsWarning",
    "InsecureDeploymentWarning",
    "InvalidBatchError",
    "InvalidUpdateError",
    "MissingDependencyError",
    "NonFiniteOutputError",
    "ParityError",
    "ProfileCacheWarning",
    "TasteCLError",
    "TasteCLWarning",
    "TrainingDivergesError",
    "TrialFailure",
    "TunerCacheWarning",
    "TuningError",
    "TuningWarning",
    "UnstableTrainingError",
    "UnsupportedModelError",
    "UnsupportedOperatorError",
    "UntranslatableOperatorError",
    "WebCompatibilityError",
]


class TasteCLError(Exception):
    """Base class of all taste_cl errors."""


class TasteCLWarning(UserWarning):
    """Base class of all taste_cl warnings."""


# ----------------------------------------------------------------- the learner
class InvalidBatchError(TasteCLError, ValueError):
    """A batch given to ``observe``/``predict`` or a replay strategy is malformed.

    Raised before any state is touched: the model, optimizer, buffer and monitor
    are exactly as they were before the call.
    """


class NonFiniteOutputError(TasteCLError, ArithmeticError):
    """A device learner's model computed NaN or infinite outputs; ``predict`` refuses to return them."""


class CheckpointError(TasteCLError, ValueError):
    """A checkpoint is missing, truncated, tampered with, or does not fit the learner."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint file where one was asked for (also a ``FileNotFoundError``)."""


class MissingDependencyError(TasteCLError, ImportError):
    """An optional extra (or, on a device installed with ``--no-deps``, a package) is needed; the message
    says which ``pip install`` fixes it: the extra's, or ``command`` where a plain package is the fix."""

    def __init__(self, package: str, extra: str | None = None, *, command: str | None = None) -> None:
        if command is None and extra is None:
            raise TypeError("MissingDependencyError needs the extra or the install command")
        how = f"install it with: {command}" if command else f"install the extra from the taste_cl checkout with: pip install '.[{extra}]'"
        super().__init__(f"{package!r} is required for this feature but is not installed; {how}")
        self.package = package
        self.extra = extra


# ----------------------------------------------------------------- tuning and elastic caches
class TuningError(TasteCLError, RuntimeError):
    """No batch size could be tuned (every probe failed, or no samples to probe with)."""


class TuningWarning(TasteCLWarning):
    """A (re)tune failed; the learner kept its previous plan and the tuner will retry."""


class TunerCacheWarning(TasteCLWarning):
    """A tuner cache file was unusable (corrupt, implausible, unreadable or unwritable); the tuner measured afresh."""


class ElasticWarning(TasteCLWarning, RuntimeWarning):
    """ElasticTrainer could not select as asked (no selection fits the budget, or the profile is too noisy to rank units); it trains on."""


class ProfileCacheWarning(TasteCLWarning, RuntimeWarning):
    """An elastic profile cache file or entry was unusable, or could not be written; the profile was measured afresh."""


# ----------------------------------------------------------------- device export and artifacts
class ExportError(TasteCLError, ValueError):
    """A model could not be exported for on-device training (the message says why)."""


class ArtifactError(CheckpointError):
    """An artifact folder is missing, incomplete, tampered with, or lists a file it must not."""


class AdaptationWarning(TasteCLWarning):
    """Test-time adaptation falls back (a batch too small for batch statistics) or cannot work as asked."""


class BatchNormModeWarning(TasteCLWarning):
    """An export trains BatchNorm on the device in another mode than the learner does (the message says why)."""


class GeneratedRowsWarning(TasteCLWarning):
    """An export's parity gate trained on generated rows, not the user's: pass ``example=`` with real rows."""


class UnsupportedOperatorError(ExportError):
    """The model uses an operator ONNX Runtime cannot differentiate; ``.op`` and ``.module`` name it."""

    def __init__(self, op: str, module: str, detail: str = "") -> None:
        super().__init__(
            f"ONNX Runtime cannot train operator {op!r} (used by module {module!r}){': ' + detail if detail else ''}; "
            "replace that layer or keep it out of the trainable part"
        )
        self.op, self.module = op, module


class UntranslatableOperatorError(ExportError):
    """The ONNX engine's export cannot write an operator of the forward or backward graph in standard ONNX; ``.op`` names it."""

    def __init__(self, op: str, detail: str = "") -> None:
        super().__init__(
            f"the ONNX engine cannot translate operator {op!r} to standard ONNX{': ' + detail if detail else ''}; "
            "replace that layer, keep it out of the trainable part, or use another backend"
        )
        self.op = op


class UnsupportedModelError(ExportError):
    """ExecuTorch cannot capture, differentiate or lower the model (the message names the step and cause)."""


class TrialFailure(ExportError):
    """The staged artifacts crashed or failed in the child; ``.step``, ``.signal`` (a name or None), ``.detail``."""

    def __init__(self, step: str, signal_name: str | None, detail: str) -> None:
        how = f"killed the process with {signal_name}" if signal_name else "failed"
        super().__init__(f"ONNX Runtime {how} at {step} of the built artifacts (tried in a child process): {detail}")
        self.step, self.signal, self.detail = step, signal_name, detail


class WebCompatibilityError(TasteCLError, ValueError):
    """The artifacts train in Python but cannot in ONNX Runtime Web (the reason is in the message)."""


class ParityError(ExportError):
    """The backend does not train like PyTorch; ``.report`` holds the numbers."""

    def __init__(self, report: ParityReport) -> None:
        hint = ""
        if report.torch_departure is not None and report.torch_departure <= report.output_tol:
            hint = (
                f". Torch's own float32 training stays within the tolerance of float64 and {report.backend}'s does not, "
                "so the runtime computes differently on these batches: a wrong operator or transform, or a ReLU "
                "input within the runtime's rounding of 0 on one of the gate's samples (its gradient is 0 in one "
                "run and 1 in the other, and the outputs grow apart while the parameters stay close; seen in "
                "ResNet-18 selections with settled BatchNorm statistics). A flip depends on the batch: export again "
                "after the learner has seen other batches (the gate trains on its buffer's rows); a wrong "
                "operator fails on every batch"
            )
        super().__init__(f"refusing to publish: {report}{hint}")
        self.report = report


class TrainingDivergesError(ExportError):
    """Torch's own training diverges on the gate's batches: the setting is the hazard, not the runtime.

    ``.step`` is the step at which the reference diverged (0: its outputs were not finite
    before training); ``.reference_losses`` and ``.candidate_losses`` hold each step's loss;
    ``.alternatives`` maps each setting tried in torch to where it diverged (None: it did not).
    The parity gate (:mod:`taste_cl.adapters.device.parity`) writes the message.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        reference_losses: list[float],
        candidate_losses: list[float],
        alternatives: Mapping[str, tuple[int, str] | None],
    ) -> None:
        super().__init__(message)
        self.step, self.reference_losses, self.candidate_losses = step, reference_losses, candidate_losses
        self.alternatives = dict(alternatives)


class UnstableTrainingError(ExportError):
    """Torch's own float32 training departs from float64 beyond the tolerance, and the runtime no further:
    the training amplifies rounding, so parity cannot be checked.

    ``.torch_departure`` and ``.runtime_departure`` are the largest scaled differences from the
    float64 run (outputs, losses, parameters); ``.alternatives`` maps each setting tried to
    torch's float32 departure from float64 with it; ``.report`` is the failed comparison.
    The parity gate (:mod:`taste_cl.adapters.device.parity`) writes the message.
    """

    def __init__(
        self,
        message: str,
        *,
        report: ParityReport,
        torch_departure: float,
        runtime_departure: float,
        alternatives: Mapping[str, float],
    ) -> None:
        super().__init__(message)
        self.report, self.torch_departure, self.runtime_departure = report, torch_departure, runtime_departure
        self.alternatives = dict(alternatives)


# ----------------------------------------------------------------- the fleet
class InvalidUpdateError(TasteCLError, ValueError):
    """A model update has the wrong names, shapes or dtypes, or non-finite values."""


class DeploymentError(TasteCLError, RuntimeError):
    """The loopback deployment could not start, or its run failed or timed out."""


class InsecureDeploymentWarning(TasteCLWarning):
    """A deployment was started without TLS or SuperNode authentication (``insecure=True``)."""
