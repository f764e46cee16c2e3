"""Frozen means frozen: normalisation statistics stay fixed in the parts of a model nobody trains.

``requires_grad=False`` stops a parameter, not a buffer: in train mode a BatchNorm of a
frozen backbone still normalises with batch statistics and moves its running statistics
towards the user's data, so the base task drifts although no weight changed (last-layer
personalization forgot more than full fine-tuning in a held-out review). As Keras does for
``trainable=False``, the learner runs such modules in eval mode while it trains. The rule:

- a *normalisation module* is one that tracks running statistics
  (``track_running_stats=True``: ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, their lazy
  forms, ``InstanceNorm*d(track_running_stats=True)``, any module following that convention);
- a parameter is *frozen* when it does not require gradients or no optimizer group holds it;
- a normalisation module is in a *frozen part* when it has parameters (its affine
  ``weight``/``bias``) and all are frozen; without parameters, when the nearest module above
  it that holds any parameter holds only frozen ones (a non-affine BatchNorm in a frozen
  backbone). A parameterless one with no such module above stays in train mode.

:func:`frozen_norms` applies the rule once, when the learner is built (before plugins
attach), so ElasticTrainer's temporary ``requires_grad=False`` on units it left out of a
step never changes a module's mode; :func:`train_mode` puts a model in train mode with
those modules in eval mode.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2), nn.BatchNorm1d(2, affine=False))
>>> _ = model[:2].requires_grad_(False)  # the backbone: a Linear and its BatchNorm
>>> frozen = frozen_norms(model, [p for p in model.parameters() if p.requires_grad])
>>> list(frozen)
['1']
>>> train_mode(model, frozen.values())
>>> [m.training for m in model]
[True, False, True, True]
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from torch import nn

__all__ = ["FROZEN_NORM_MODES", "check_frozen_norm", "frozen_norms", "norm_modules", "train_mode"]

FROZEN_NORM_MODES = ("eval", "train")
"""``"eval"``: normalisation modules in frozen parts run in eval mode while the learner trains; ``"train"``: they follow the model."""


def check_frozen_norm(value: object, name: str = "frozen_norm") -> str:
    """``value`` if it is one of :data:`FROZEN_NORM_MODES`, else ``ValueError`` naming the argument ``name``, rule and value."""
    if not isinstance(value, str) or value not in FROZEN_NORM_MODES:
        raise ValueError(
            f"`{name} == {value!r}`, must be one of {FROZEN_NORM_MODES}: 'eval' keeps the running statistics "
            "of frozen parts fixed, 'train' lets them follow the data"
        )
    return value


def _is_norm(module: nn.Module) -> bool:
    """Whether ``module`` tracks running statistics (its train mode moves them)."""
    return getattr(module, "track_running_stats", False) is True


def frozen_norms(model: nn.Module, trained: Iterable[nn.Parameter]) -> dict[str, nn.Module]:
    """The normalisation modules of ``model`` in frozen parts by name, ``trained`` being the parameters that train (see the module)."""
    trained_ids = {id(p) for p in trained}
    parents: dict[int, nn.Module] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not _is_norm(module):
            continue
        owner: nn.Module | None = module
        while owner is not None and next(owner.parameters(), None) is None:
            owner = parents.get(id(owner))
        if owner is not None and not any(id(p) in trained_ids for p in owner.parameters()):
            found[name] = module
    return found


def norm_modules(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules of ``model`` named ``names`` (:func:`frozen_norms` of it, or of a copy of it)."""
    modules = dict(model.named_modules())
    return [modules[name] for name in names]


def train_mode(model: nn.Module, frozen: Collection[nn.Module], *, keep_frozen: bool = True) -> None:
    """Put ``model`` in train mode with the ``frozen`` normalisation modules in eval mode (in train
    mode too when not ``keep_frozen``); nothing to do when it already is so (``train()`` walks every module)."""
    if model.training and all(m.training != keep_frozen for m in frozen):
        return
    model.train()
    if keep_frozen:
        for module in frozen:
            module.eval()
