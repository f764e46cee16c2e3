"""Which parameters a device trains: those the optimizer holds and that require gradients, or a selection of them.

A frozen backbone (``requires_grad=False``, or left out of the optimizer) stays frozen on the
device: both exporters mark every other parameter non-trainable in the model copy they
export (ONNX Runtime: frozen parameters of the artifacts, no gradient and no optimizer state;
ExecuTorch: no gradient, so the device SGD never sees it), and the parity gate's torch
reference then trains exactly what the device trains.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
>>> optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
>>> trained_parameters(model, optimizer)
['1.weight', '1.bias']

A learner's export takes ``trainable=``: a list of parameter names, or an attached
:class:`~taste_cl.elastic.ElasticTrainer` (its current selection, e.g. at ``rho=0.5``).
Only those tensors train on the device (a smaller gradient graph and optimizer state, a
faster step); :func:`selected_parameters` resolves and checks it.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

from torch import nn, optim

__all__ = ["freeze_untrained", "selected_parameters", "selection_record", "trained_parameters"]


def trained_parameters(model: nn.Module, optimizer: optim.Optimizer) -> list[str]:
    """Names of ``model``'s parameters that ``optimizer`` holds and that require gradients, in model order."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) in held]


def freeze_untrained(model: nn.Module, trained: Collection[str]) -> None:
    """Make exactly the ``trained`` parameters of ``model`` require gradients (by name)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trained)


def _learner_trainable(learner: Any) -> list[str]:
    """The parameters ``learner`` trains, by name: held by its optimizer and left trainable by the user
    (a unit an attached ElasticTrainer switched off for now counts as trainable)."""
    from taste_cl.elastic import ElasticTrainer

    ids = {id(p) for plugin in learner.plugins if isinstance(plugin, ElasticTrainer) and plugin.profile_ is not None for p in plugin.candidates()}
    trained = set(trained_parameters(learner.model, learner.optimizer))
    return [name for name, p in learner.model.named_parameters() if name in trained or id(p) in ids]


def selected_parameters(learner: Any, trainable: Any = None) -> list[str]:
    """The names of ``learner.model``'s parameters a device export trains, in model order.

    ``trainable`` is None (everything the learner trains, including units an ElasticTrainer
    has switched off for now), a list of parameter names, or an :class:`~taste_cl.elastic.ElasticTrainer`
    attached to ``learner`` (its current selection). A name that is not a parameter, or that
    the learner does not train (``requires_grad=False``, or left out of the optimizer), is a
    ``ValueError`` naming it; nothing is changed either way.
    """
    from taste_cl.elastic import ElasticTrainer
    from taste_cl.elastic.profiling import unit_parameters

    allowed = _learner_trainable(learner)
    if trainable is None:
        return allowed
    if isinstance(trainable, ElasticTrainer):
        if trainable not in learner.plugins:
            raise ValueError("trainable= is an ElasticTrainer that is not attached to this learner (pass it in OnlineLearner(plugins=[...]))")
        if trainable.profile_ is None or not trainable.selected:
            raise ValueError("the ElasticTrainer has selected nothing yet: observe batches until its first probe has run, then export")
        groups = unit_parameters(learner.model, trainable.selected, trainable.granularity, trainable.candidates())
        chosen_ids = {id(p) for group in groups for p in group}
        names = [name for name, p in learner.model.named_parameters() if id(p) in chosen_ids]
    elif isinstance(trainable, str) or not isinstance(trainable, Collection):
        raise TypeError(f"trainable must be None, a list of parameter names or an ElasticTrainer; got {trainable!r}")
    else:
        names = list(trainable)
        every = dict(learner.model.named_parameters())
        for name in names:
            if not isinstance(name, str) or name not in every:
                close = difflib.get_close_matches(str(name), list(every), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"trainable names {name!r}, which is not a parameter of the model{hint}")
            if name not in allowed:
                raise ValueError(
                    f"trainable names {name!r}, which the learner does not train (requires_grad=False or not in the optimizer): "
                    "a device cannot train what the learner froze"
                )
        names = [name for name in allowed if name in set(names)]
    if not names:
        raise ValueError("trainable selects no parameter: name at least one the learner trains")
    return names


def selection_record(learner: Any, trainable: Any, chosen: list[str]) -> dict[str, Any] | None:
    """What the manifest says about an explicit selection (None without one): its source, the
    names trained, and the share of the learner's trainable parameters (by element count) they hold."""
    if trainable is None:
        return None
    from taste_cl.elastic import ElasticTrainer

    every = dict(learner.model.named_parameters())
    total = sum(every[name].numel() for name in _learner_trainable(learner))
    record: dict[str, Any] = {"source": "names", "trainable": chosen, "parameter_share": sum(every[name].numel() for name in chosen) / total}
    if isinstance(trainable, ElasticTrainer):
        record.update(source="elastic", rho=trainable.current_rho, predicted_speedup=trainable.predicted_speedup())
    return record
