"""Console behaviour of the commands: progress bars only on terminals, quiet third-party logs, plain help."""

from __future__ import annotations

import argparse
import io
import logging

import pytest

from taste_cl.cli.console import NOISY_LOGGERS, HelpFormatter, plain_text, progress_bar, progress_enabled, set_third_party_logging


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_only_when_stdout_and_stderr_are_terminals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert not progress_enabled()
    assert progress_bar(range(3)).disable
    monkeypatch.setattr("sys.stdout", _Terminal())
    assert progress_enabled()
    assert not progress_enabled(False)
    bar = progress_bar(range(3), desc="x")
    assert not bar.disable
    assert list(bar) == [0, 1, 2]


def test_third_party_loggers_are_quiet_unless_verbose() -> None:
    levels = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    try:
        set_third_party_logging(verbose=False)
        assert all(not logging.getLogger(name).isEnabledFor(logging.INFO) for name in NOISY_LOGGERS)
        assert all(logging.getLogger(name).isEnabledFor(logging.WARNING) for name in NOISY_LOGGERS)
        set_third_party_logging(verbose=True)
        assert all(logging.getLogger(name).isEnabledFor(logging.INFO) for name in NOISY_LOGGERS)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_plain_text_drops_rest_markup_and_joins_the_first_paragraph() -> None:
    doc = "``taste-cl demo``: a stream of\n:class:`Task` objects, `x`.\n\nSecond paragraph."
    assert plain_text(doc) == "taste-cl demo: a stream of Task objects, x."


def test_help_shows_defaults_except_for_flags_and_none() -> None:
    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument("--out", default="bench_results", help="folder")
    parser.add_argument("--flag", action="store_true", help="a flag")
    parser.add_argument("--lr", type=float, help="rate")
    text = " ".join(parser.format_help().split())
    assert "seed (default: 0)" in text and "folder (default: bench_results)" in text
    assert "a flag (default" not in text and "rate (default" not in text
