"""What moves on an unlabelled batch: BN-adapt, TENT and EATA, and the tensors they touch.

All three adapt only a model's normalisation layers, which is what makes test-time
adaptation cheap and its undo small:

- **BN-adapt** (Schneider et al., 2020): BatchNorm normalises with the test batch's own
  statistics, and the running statistics follow them (what ``predict`` uses afterwards).
  No gradient.
- **TENT** (Wang et al., ICLR 2021): BN-adapt, plus one gradient step on the affine
  weights and biases of the normalisation layers (BatchNorm, LayerNorm, GroupNorm) that
  lowers the mean prediction entropy.
- **EATA** (Niu et al., ICML 2022): TENT on the reliable samples only (entropy below
  ``e_margin`` times ``log(classes)``), skipping samples whose prediction is redundant with
  recent ones (cosine similarity to their moving average above ``1 - d_margin``),
  weighting each by ``exp(e_margin - entropy)``, and anchored to the source affine values
  by ``anchor_weight * sum(F * (w - w0)**2)``, ``F`` a Fisher estimate from labelled rows
  when some were given (:meth:`Eata.set_fisher`; the learner passes its replay buffer's),
  else 1 (an L2 anchor).

A method works on a :class:`~taste_cl.adaptation.anchor.NormState`: the normalisation
layers' affine parameters and running statistics, found by :func:`norm_layers`.

Checkpoints: :meth:`AdaptationMethod.state_dict` gives the method's name and settings (and
EATA's anchor, Fisher weights and moving mean of probabilities);
:meth:`AdaptationMethod.parse_state` checks one against the parameters it adapts, changing
nothing, and returns what applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from taste_cl._checks import check_finite_positive, check_positive
from taste_cl.state.restore import Apply, check_keys, check_number, check_tensor, refusing, short

__all__ = ["METHODS", "AdaptationMethod", "BNAdapt", "Eata", "Tent", "affine_parameters", "batch_norms", "entropy", "norm_layers", "resolve_method"]

_AFFINE_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def norm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's normalisation layers by name: BatchNorm/InstanceNorm (any ``_NormBase``),
    LayerNorm and GroupNorm, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _AFFINE_NORMS)]


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The layers that track running statistics (BatchNorm and its kin)."""
    return [m for m in model.modules() if getattr(m, "track_running_stats", False) is True and getattr(m, "running_mean", None) is not None]


def affine_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Affine weights and biases of the normalisation layers, by full parameter name."""
    found: dict[str, nn.Parameter] = {}
    for name, module in norm_layers(model):
        for pname, param in module.named_parameters(recurse=False):
            found[f"{name}.{pname}" if name else pname] = param
    return found


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` per row."""
    log_p = logits.log_softmax(dim=1)
    return -(log_p.exp() * log_p).sum(dim=1)


class AdaptationMethod:
    """One test-time adaptation method: whether it steps the affine parameters, and its loss.

    ``loss(logits)`` returns the loss to minimise on a batch (None: no step on this batch)
    and how many rows it used. Subclasses set :attr:`name` and :attr:`steps`.
    """

    name = "none"
    steps = False  # whether it takes gradient steps on the affine parameters

    def __init__(self, *, lr: float = 1e-3) -> None:
        self.lr = check_finite_positive("lr", lr)

    def loss(self, logits: torch.Tensor, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor | None, int]:
        return None, 0

    def reset(self) -> None:
        """Forget what was learned about the stream (after a reset to the anchor)."""

    # ------------------------------------------------------------------ checkpoints
    def config(self) -> dict[str, Any]:
        """The method's settings, by attribute name (what :meth:`parse_config` checks)."""
        return {"lr": self.lr}

    def state_dict(self) -> dict[str, Any]:
        """The method's name and settings, and what it keeps of the stream (copies), for checkpoints."""
        return {"name": self.name, "config": self.config()}

    def parse_config(self, config: Any, where: str) -> dict[str, Any]:
        """Checked values of a :meth:`config` (``where``: its place in the state, for messages); ``ValueError`` naming the field."""
        if not isinstance(config, dict):
            raise ValueError(f"`{where}` must be a dict; got {type(config).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
        check_keys(where, config, set(self.config()), f" from {type(self).__name__}'s settings")
        return {"lr": check_number(f"{where}.lr", config["lr"], positive=True)}

    def parse_state(self, state: Any, params: Mapping[str, torch.Tensor], *, where: str = "adaptation.method") -> Apply:
        """Check a :meth:`state_dict` of this kind of method against ``params`` (the affine parameters it
        adapts, by name); change nothing, return what applies it. Raises
        :class:`~taste_cl.exceptions.CheckpointError` naming the field."""
        with refusing():
            if not isinstance(state, dict):
                raise ValueError(f"`{where}` must be a dict; got {type(state).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
            check_keys(where, state, set(self.state_dict()), f" from what {self.name!r} keeps")
            if state["name"] != self.name:
                raise ValueError(f"`{where}.name == {short(state['name'])}`; this adapter's method is {self.name!r}")
            values = self.parse_config(state["config"], f"{where}.config")

        def apply() -> None:
            for name, value in values.items():
                setattr(self, name, value)

        return apply

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr})"


class BNAdapt(AdaptationMethod):
    """Test-batch statistics, no gradient (see the module)."""

    name = "bn"


class Tent(AdaptationMethod):
    """Entropy minimisation on the normalisation layers' affine parameters (see the module)."""

    name = "tent"
    steps = True

    def loss(self, logits: torch.Tensor, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor | None, int]:
        return entropy(logits).mean(), logits.shape[0]


class Eata(AdaptationMethod):
    """Reliable, non-redundant samples only, weighted, with a Fisher anchor (see the module)."""

    name = "eata"
    steps = True

    def __init__(self, *, lr: float = 1e-3, e_margin: float = 0.4, d_margin: float = 0.05, anchor_weight: float = 1.0) -> None:
        super().__init__(lr=lr)
        self.e_margin = check_positive("e_margin", e_margin, upper=1.0)
        self.d_margin = check_positive("d_margin", d_margin, upper=2.0)
        if (
            isinstance(anchor_weight, bool)
            or not isinstance(anchor_weight, (int, float))
            or not (math.isfinite(anchor_weight) and anchor_weight >= 0)
        ):
            raise ValueError(f"`anchor_weight == {anchor_weight!r}`, must be a finite number >= 0")
        self.anchor_weight = float(anchor_weight)
        self._mean_probs: torch.Tensor | None = None
        self._source: dict[str, torch.Tensor] = {}
        self._fisher: dict[str, torch.Tensor] = {}

    def set_anchor(self, params: dict[str, nn.Parameter], fisher: dict[str, torch.Tensor] | None = None) -> None:
        """Anchor to the current values of ``params``, weighted by ``fisher`` (1 where missing)."""
        self._source = {name: p.detach().clone() for name, p in params.items()}
        self._fisher = {name: (fisher or {}).get(name, torch.ones_like(p)).detach().clone() for name, p in params.items()}

    def reset(self) -> None:
        self._mean_probs = None

    def config(self) -> dict[str, Any]:
        return {"lr": self.lr, "e_margin": self.e_margin, "d_margin": self.d_margin, "anchor_weight": self.anchor_weight}

    def state_dict(self) -> dict[str, Any]:
        """Name and settings, the anchor (source values and Fisher weights, by parameter name) and the moving mean of probabilities."""
        return {
            **super().state_dict(),
            "source": {name: t.clone() for name, t in self._source.items()},
            "fisher": {name: t.clone() for name, t in self._fisher.items()},
            "mean_probs": None if self._mean_probs is None else self._mean_probs.clone(),
        }

    def parse_config(self, config: Any, where: str) -> dict[str, Any]:
        values = super().parse_config(config, where)
        values["e_margin"] = check_positive(f"{where}.e_margin", config["e_margin"], upper=1.0)
        values["d_margin"] = check_positive(f"{where}.d_margin", config["d_margin"], upper=2.0)
        values["anchor_weight"] = check_number(f"{where}.anchor_weight", config["anchor_weight"], low=0.0)
        return values

    def parse_state(self, state: Any, params: Mapping[str, torch.Tensor], *, where: str = "adaptation.method") -> Apply:
        """As :meth:`AdaptationMethod.parse_state`, and the anchor: source values and Fisher weights of some of
        ``params`` (the same names; their shapes and dtypes; finite; Fisher weights >= 0), and the moving mean of
        probabilities (None, or one finite probability per class)."""
        apply_config = super().parse_state(state, params, where=where)
        with refusing():
            source = _parse_tensors(f"{where}.source", state["source"], params)
            fisher = _parse_tensors(f"{where}.fisher", state["fisher"], params)
            if set(fisher) != set(source):
                raise ValueError(f"`{where}.fisher` must weight exactly the parameters of `{where}.source`: {sorted(set(fisher) ^ set(source))[:4]}")
            for name, weight in fisher.items():
                if bool((weight < 0).any()):
                    raise ValueError(f"`{where}.fisher.{name}` holds negative weights")
            mean = state["mean_probs"]
            if mean is not None:
                mean = check_tensor(f"{where}.mean_probs", mean)
                if mean.dim() != 1 or mean.numel() < 1 or not mean.is_floating_point() or bool(((mean < 0) | (mean > 1)).any()):
                    raise ValueError(
                        f"`{where}.mean_probs` must be None or a floating vector of probabilities in [0, 1]; got {mean.dtype} {tuple(mean.shape)}"
                    )
        device = next(iter(params.values())).device if params else None
        placed_mean = None if mean is None else mean.detach().to(device=device).clone()

        def apply() -> None:
            apply_config()
            self._source, self._fisher, self._mean_probs = _placed(source, params), _placed(fisher, params), placed_mean

        return apply

    def loss(self, logits: torch.Tensor, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor | None, int]:
        ent = entropy(logits)
        margin = self.e_margin * math.log(logits.shape[1])
        keep = ent < margin
        probs = logits.detach().softmax(dim=1)
        if self._mean_probs is not None:
            similarity = torch.nn.functional.cosine_similarity(self._mean_probs.unsqueeze(0), probs, dim=1)
            keep &= similarity.abs() < 1 - self.d_margin
        chosen = probs[keep]
        if chosen.shape[0]:
            mean = chosen.mean(dim=0)
            self._mean_probs = mean if self._mean_probs is None else 0.9 * self._mean_probs + 0.1 * mean
        if not bool(keep.any()):
            return None, 0
        weights = torch.exp(margin - ent[keep].detach())
        loss = (ent[keep] * weights).mean()
        if self.anchor_weight and self._source:
            loss = loss + self.anchor_weight * sum(
                (self._fisher[name] * (p - self._source[name]) ** 2).sum() for name, p in params.items() if name in self._source
            )
        return loss, int(keep.sum())

    def __repr__(self) -> str:
        return f"Eata(lr={self.lr}, e_margin={self.e_margin}, d_margin={self.d_margin}, anchor_weight={self.anchor_weight})"


def _parse_tensors(where: str, value: Any, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dict of finite tensors named and shaped as some of ``params``."""
    if not isinstance(value, dict):
        raise ValueError(f"`{where}` must be a dict of tensors by parameter name; got {type(value).__name__}")  # noqa: TRY004 (a bad state is a ValueError)
    unknown = sorted(map(str, set(value) - set(params)))
    if unknown:
        raise ValueError(f"`{where}` names {unknown[:4]}, which are not this model's normalisation parameters")
    return {
        name: check_tensor(f"{where}.{name}", tensor, shape=tuple(params[name].shape), dtype=params[name].dtype) for name, tensor in value.items()
    }


def _placed(tensors: dict[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of checked tensors on their parameters' devices."""
    return {name: t.detach().to(device=params[name].device).clone() for name, t in tensors.items()}


METHODS: dict[str, Callable[..., AdaptationMethod]] = {"bn": BNAdapt, "tent": Tent, "eata": Eata}


def resolve_method(method: AdaptationMethod | str) -> AdaptationMethod:
    """A method object from itself or its name (:data:`METHODS`)."""
    if isinstance(method, AdaptationMethod):
        return method
    if isinstance(method, str) and method in METHODS:
        return METHODS[method]()
    raise ValueError(f"`method == {method!r}`, must be an AdaptationMethod or one of {sorted(METHODS)}")
