"""The ``taste-cl`` command and its sub-commands, apart from the library.

- :mod:`.main`: the dispatcher (``taste-cl COMMAND`` and ``taste-cl bench NAME``);
- :mod:`.demo`, :mod:`.export`, :mod:`.fleet`, :mod:`.serve_demo`: one module per command;
- :mod:`.console`: progress bars and third-party log levels for everything a person runs.
"""

from taste_cl.cli.main import BENCHMARKS, COMMANDS, build_parser, main

__all__ = ["BENCHMARKS", "COMMANDS", "build_parser", "main"]
