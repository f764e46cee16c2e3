"""Figures, with matplotlib as an optional extra (``pip install '.[plot]'``).

The demo and the benchmarks draw with :func:`pyplot` and write with :func:`save_figure`;
without matplotlib, :func:`pyplot` raises :class:`~taste_cl.exceptions.MissingDependencyError`
naming the extra, and :func:`plotting_available` lets a command skip its plot and say so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from taste_cl.exceptions import MissingDependencyError

__all__ = ["PLOT_HINT", "plotting_available", "pyplot", "save_figure"]

PLOT_HINT = "install matplotlib for the plot: pip install '.[plot]' from the taste_cl checkout"


def plotting_available() -> bool:
    """Whether matplotlib can be imported (a command checks this before its work, and plots after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or :class:`MissingDependencyError` naming the ``plot`` extra."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError("matplotlib", "plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100, **options: Any) -> Path:
    """Lay out a matplotlib ``fig``, write it to ``path`` (its folder created) and close it; ``options`` go to ``savefig``."""
    target = Path(path)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=dpi, **options)
    pyplot().close(fig)
    return target
