"""Guards that keep a learner from harming its model, side by side.

- :mod:`.update`: :class:`UpdateGuard`, per optimizer step: no step that can poison the model;
- :mod:`.probe`: :class:`ProbeGuard`, per update window: roll back a window that made the model worse for its user.
"""

from taste_cl._lazy import lazy_getattr

__all__ = [
    "GUARD_MODES",
    "ProbeGuard",
    "UpdateGuard",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "GUARD_MODES": "taste_cl.guards.update",
        "UpdateGuard": "taste_cl.guards.update",
        "ProbeGuard": "taste_cl.guards.probe",
    },
)
