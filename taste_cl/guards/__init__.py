"""Guards that keep a learner from harming its model, side by side.

- :mod:`.update`: :class:`UpdateGuard`, per optimizer step: no step that can poison the model;
- :mod:`.probe`: :class:`ProbeGuard`, per update window: roll back a window that made the model worse for its user.
"""

from taste_cl.guards.probe import ProbeGuard
from taste_cl.guards.update import GUARD_MODES, UpdateGuard

__all__ = [
    "GUARD_MODES",
    "ProbeGuard",
    "UpdateGuard",
]
