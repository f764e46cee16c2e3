"""Exceptions raised by taste_cl.

Every error caused by bad user input is a :class:`ValueError` subclass, so callers
that already catch ``ValueError`` keep working; the message names what was wrong,
the rule and the value received.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "InvalidBatchError",
    "MissingDependencyError",
    "TasteCLError",
]


class TasteCLError(Exception):
    """Base class of all taste_cl errors."""


class InvalidBatchError(TasteCLError, ValueError):
    """A batch given to ``observe``/``predict`` or a replay strategy is malformed.

    Raised before any state is touched: the model, optimizer, buffer and monitor
    are exactly as they were before the call.
    """


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
