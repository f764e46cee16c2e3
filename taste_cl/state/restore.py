"""Validate every section of a decoded state, then apply all of them, or nothing.

The parts that own state (the learner, its replay buffer, strategy, monitor, guards and
plugins) each check their own section and return a closure that applies it and cannot
fail. :func:`restore_sections` runs every parser first; only when all have passed are the
plugin states loaded (each put back if a later one fails) and the closures run. On any error
nothing is changed and :class:`~taste_cl.exceptions.CheckpointError` names the section.
This module knows no part: it orchestrates, and offers the value checks every parser uses
(each raises ``ValueError`` naming the field, the rule and the value got).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from taste_cl._batch import count_nonfinite
from taste_cl._checks import INT_LIMIT
from taste_cl.exceptions import CheckpointError

__all__ = [
    "CHECKPOINT_FORMAT",
    "Apply",
    "check_format",
    "check_generator_state",
    "check_int",
    "check_keys",
    "check_number",
    "check_tensor",
    "parse_sections",
    "refusing",
    "restore_sections",
    "same",
    "short",
    "validate_sections",
]

CHECKPOINT_FORMAT = 2

Apply = Callable[[], None]
"""Applies one validated section; cannot fail."""

Parser = Callable[[], Apply]
"""Checks one section, changing nothing, and returns what applies it."""

_ERRORS = (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError)


class StatefulPlugin(Protocol):
    """What the orchestrator needs of a plugin: a name and its state in and out."""

    name: str

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------ value checks
def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def same(value: Any, expected: int | str) -> bool:
    """``value == expected`` for a value of exactly the expected type (a tensor never compares)."""
    return type(value) is type(expected) and value == expected


def check_int(where: str, value: Any, low: int = 0, high: int = INT_LIMIT) -> int:
    """An int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"`{where} == {short(value)}`, must be an int in [{low}, {high}]")
    return value


def check_number(where: str, value: Any, *, low: float = -math.inf, positive: bool = False) -> float:
    """A finite real number (a one-element real tensor too) ``>= low``, or ``> 0`` when ``positive``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{where} == {short(value)}`, must be a number")  # noqa: TRY004 (a bad state is a ValueError)
    number = float(value)
    if not math.isfinite(number) or number < low or (positive and number <= 0):
        rule = "> 0" if positive else f">= {low:g}"
        raise ValueError(f"`{where} == {number}`, must be finite and {rule}")
    return number


def check_tensor(where: str, value: Any, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` (when given) holding no NaN or infinity."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"`{where}` must be a tensor; got {type(value).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"`{where}` must have shape {shape}; got {tuple(value.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"`{where}` must have dtype {dtype}; got {value.dtype}")
    if (value.is_floating_point() or value.is_complex()) and count_nonfinite(value):
        raise ValueError(f"`{where}` holds {count_nonfinite(value)} non-finite values")
    return value


def check_keys(where: str, value: dict[str, Any], expected: set[str], whose: str = "") -> None:
    """``value`` must have exactly the keys ``expected`` (``whose``: what they are expected from, for the message)."""
    if set(value) != expected:
        missing, extra = sorted(expected - set(value)), sorted(map(str, set(value) - expected))
        raise ValueError(f"`{where}` keys differ{whose}: missing {missing[:5]}, unexpected {extra[:5]}")


def check_generator_state(where: str, value: Any) -> torch.Tensor:
    """A ``torch.Generator`` state (a uint8 tensor the generator accepts)."""
    value = check_tensor(where, value, dtype=torch.uint8)
    try:
        torch.Generator().set_state(value.cpu())
    except RuntimeError as error:
        raise ValueError(f"`{where}` is not a valid generator state: {error}") from error
    return value


@contextmanager
def refusing() -> Iterator[None]:
    """A part's ``parse_state``: what its checks raise (``ValueError`` and kin, naming the field) raised as
    :class:`~taste_cl.exceptions.CheckpointError` with the same message."""
    try:
        yield
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as error:
        raise CheckpointError(str(error)) from error


# -------------------------------------------------------------------- orchestration
def check_format(state: Any, sections: Iterable[str], extra: Iterable[str] = ()) -> dict[str, Any]:
    """``state`` must be a dict of this format holding no section but ``sections`` and the ``extra`` entries."""
    if not isinstance(state, dict):
        raise CheckpointError(f"a learner state is a dict; got {type(state).__name__}")
    if not same(state.get("format"), CHECKPOINT_FORMAT):
        raise CheckpointError(f"checkpoint format {short(state.get('format'))} is not supported (want {CHECKPOINT_FORMAT})")
    unknown = sorted(map(str, set(state) - {"format", *sections, *extra}))
    if unknown:
        raise CheckpointError(f"checkpoint has unknown sections {unknown[:5]}")
    return state


def parse_sections(parsers: Sequence[tuple[str, Parser]]) -> list[Apply]:
    """Run each section's parser in order (a later one may read what an earlier one settled); the applies, or
    :class:`CheckpointError` naming the first section that does not fit."""
    applies = []
    for name, parse in parsers:
        try:
            applies.append(parse())
        except _ERRORS as error:
            raise CheckpointError(f"checkpoint does not fit this learner: section `{name}`: {error}") from error
    return applies


def restore_sections(parse: Callable[[], list[Apply]], plugins: Sequence[StatefulPlugin], state: Any, undo: Apply | None = None) -> None:
    """Parse every section of ``state``, load the plugins' states (its ``plugins`` section, read once every section
    has parsed), then apply every section; all or nothing. ``undo`` (a preparation made before parsing, such as a
    grown classifier) runs on any error."""
    try:
        applies = parse()
        load_plugins(plugins, state["plugins"])
    except BaseException:
        if undo is not None:
            undo()
        raise
    for apply in applies:
        apply()


def validate_sections(parse: Callable[[], list[Apply]], plugins: Sequence[StatefulPlugin], state: Any, undo: Apply | None = None) -> None:
    """Raise :class:`CheckpointError` unless every section and plugin state fits; changes nothing (each plugin's
    state is tried and put back: some plugins check theirs only when loading it; ``undo`` always runs)."""
    try:
        parse()
        load_plugins(plugins, state["plugins"], keep=False)
    finally:
        if undo is not None:
            undo()


def load_plugins(plugins: Sequence[StatefulPlugin], states: dict[str, Any], *, keep: bool = True) -> None:
    """Load each plugin's state; if one fails, put the ones already loaded back and raise.
    ``keep=False`` (a trial) puts them all back once every one has loaded."""
    done: list[tuple[StatefulPlugin, dict[str, Any]]] = []
    for plugin in plugins:
        if plugin.name not in states:
            continue
        done.append((plugin, plugin.state_dict()))
        try:
            plugin.load_state_dict(states[plugin.name])
        except Exception as error:
            _put_back(done)
            raise CheckpointError(f"checkpoint does not fit this learner: plugin {plugin.name!r}: {error}") from error
    if not keep:
        _put_back(done)


def _put_back(loaded: list[tuple[StatefulPlugin, dict[str, Any]]]) -> None:
    """Load each ``(plugin, earlier state)`` back, the last loaded first."""
    for plugin, previous in reversed(loaded):
        plugin.load_state_dict(previous)
