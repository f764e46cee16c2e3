"""What the commands show on the console: progress bars and third-party log levels.

Progress bars appear only when someone watches (both stdout and stderr are terminals),
so logs, pipes and CI output stay clean. Flower, Ray and Avalanche log at INFO by
default (hundreds of lines per run); the commands lower them to WARNING unless
``--verbose`` is given.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

__all__ = ["NOISY_LOGGERS", "HelpFormatter", "plain_text", "progress_bar", "progress_enabled", "set_third_party_logging"]

T = TypeVar("T")

# loggers of optional dependencies that print INFO lines on every run
NOISY_LOGGERS = ("flwr", "ray", "avalanche")


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows each option's default, except for flags and ``None``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and not (action.default is None or action.default is False or action.default == argparse.SUPPRESS)
            and "%(default)" not in text
        ):
            text += " (default: %(default)s)"
        return text


def plain_text(docstring: str) -> str:
    """The first paragraph of ``docstring`` on one line, without reST markup (double
    backquotes, ``:class:`` roles), as a ``--help`` description."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    return re.sub(r"(?::[a-z]+:)?`+([^`]+)`+", r"\1", paragraph)


def progress_enabled(requested: bool = True) -> bool:
    """``requested`` and the output is a terminal (no bars in pipes, files or CI logs)."""
    return requested and sys.stdout.isatty() and sys.stderr.isatty()


def progress_bar(iterable: Iterable[T] | None = None, *, enabled: bool = True, **options: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (or a manual one with ``total=``), shown only when
    :func:`progress_enabled`; ``options`` go to tqdm (``desc``, ``total``, ``unit``, ...)."""
    return tqdm(iterable, disable=not progress_enabled(enabled), dynamic_ncols=True, **options)


def set_third_party_logging(verbose: bool = False) -> None:
    """Set the :data:`NOISY_LOGGERS` to INFO when ``verbose``, else to WARNING."""
    level = logging.INFO if verbose else logging.WARNING
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)
