"""Plugin hooks: how the batch-size tuner, elastic training and user code extend a learner.

Every hook does nothing by default and takes ``**kwargs``, so a plugin written today keeps
working when later releases pass more arguments (the skorch callback convention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taste_cl.learner import ObserveStats, OnlineLearner

__all__ = ["LearnerPlugin"]


class LearnerPlugin:
    """Base class of learner plugins. Override only the hooks you need.

    ``name`` keys the plugin's state in learner checkpoints; keep it stable.
    """

    name: str = "plugin"

    def on_attach(self, learner: OnlineLearner, **kwargs: Any) -> None:
        """Called once when the learner is built (or loaded) with this plugin."""

    def on_first_batch(self, learner: OnlineLearner, x: Any, **kwargs: Any) -> None:
        """Called once, before the first training step, with a validated sample batch."""

    def before_step(self, learner: OnlineLearner, **kwargs: Any) -> None:
        """Called before every optimizer step (forward/backward not yet run)."""

    def after_observe(self, learner: OnlineLearner, stats: ObserveStats, **kwargs: Any) -> None:
        """Called at the end of every successful ``observe``."""

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors to keep in learner checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
