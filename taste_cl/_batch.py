"""Validation and coercion of user batches at the library boundary, and pytree helpers.

Inputs ``x`` are a tensor (or numpy array) or a dict / tuple / list of them, nested at
will (a *pytree*). The model is called as the structure says (:func:`call_model`):
``model(x)`` for a tensor, ``model(**x)`` for a dict, ``model(*x)`` for a tuple or list,
or ``model(x)`` for a whole structure when its ``forward`` takes it as one argument
(the call mode, :data:`CALL_MODES`).

Everything that comes from the app passes through here before any state is touched,
so a bad batch raises :class:`~taste_cl.exceptions.InvalidBatchError` and leaves the
learner exactly as it was. Per leaf: floating leaves become the model's dtype and device
and must be finite; integer and bool leaves keep their dtype (moved to the device); the
first batch fixes the structure and each leaf's feature shape (:class:`Spec`, a small
JSON-able description, so checkpoints hold no code).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from taste_cl.exceptions import InvalidBatchError

ArrayLike = torch.Tensor | np.ndarray
BatchLike = tuple[Any, Any] | Sequence[Any] | Mapping[str, Any]
Inputs = Any  # a tensor, or a dict / tuple / list of Inputs

__all__ = [
    "CALL_MODES",
    "ArrayLike",
    "BatchLike",
    "Inputs",
    "Spec",
    "as_tensor",
    "batch_len",
    "call_model",
    "call_style",
    "cat_batches",
    "check_call",
    "count_nonfinite",
    "describe",
    "index_batch",
    "label_range",
    "leaves",
    "map_leaves",
    "split_batch",
    "to_features",
    "to_inputs",
    "to_labels",
    "to_like",
    "unflatten",
]

_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
# torch's wide unsigned dtypes have few kernels: they become the next signed dtype that holds them.
_WIDE_UNSIGNED = {torch.uint16: torch.int32, torch.uint32: torch.int64, torch.uint64: torch.int64}
_NUMPY_REFUSED = {
    "c": "complex",
    "M": "datetime64",
    "m": "timedelta64",
    "V": "structured (void)",
    "U": "string",
    "S": "bytes",
    "O": "object",
}


# ------------------------------------------------------------------ model calls
CALL_MODES = ("auto", "keywords", "positional")
"""How a dict / tuple / list input reaches the model: ``"keywords"`` spreads it (``model(**x)``,
``model(*x)``), ``"positional"`` passes it whole (``model(x)``), ``"auto"`` picks one (:func:`call_style`)."""


def check_call(call: Any, name: str = "call") -> str:
    """``call`` if it is one of :data:`CALL_MODES`, else ``ValueError`` naming ``name`` and the value."""
    if not isinstance(call, str) or call not in CALL_MODES:
        raise ValueError(f"`{name} == {call!r}`, must be one of {', '.join(map(repr, CALL_MODES))}")
    return call


def call_style(model: Callable[..., Any], x: Inputs, call: str = "auto") -> str:
    """``"keywords"`` or ``"positional"``: how :func:`call_model` passes ``x`` to ``model`` under ``call``.

    ``"auto"`` reads the signature of ``model.forward``: when it takes exactly one required
    argument (no ``*args`` or ``**kwargs``) and spreading ``x`` cannot fit it (a dict whose keys
    are not all parameter names, a tuple or list longer than its positional parameters), ``x``
    is passed whole; otherwise, and when the signature says nothing (``forward(*args, **kwargs)``,
    a signature that cannot be read), it is spread.
    """
    if call != "auto" or not isinstance(x, (Mapping, tuple, list)):  # a tensor is passed as it is whatever the mode
        return "keywords" if call == "auto" else call
    fits = tuple(x) if isinstance(x, Mapping) else len(x)
    forward = getattr(model, "forward", model)
    function = getattr(forward, "__func__", None)
    whole = _method_takes_whole(function, fits) if function is not None else _takes_whole(_parameters(forward), fits)
    return "positional" if whole else "keywords"


@functools.lru_cache(maxsize=256)
def _method_takes_whole(function: Callable[..., Any], fits: tuple[str, ...] | int) -> bool:
    """:func:`_takes_whole` for a method's function (its first parameter bound), cached: the learner calls it every step."""
    params = _parameters(function)
    return _takes_whole(None if params is None else params[1:], fits)


def _parameters(function: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """The parameters of ``function``; None when its signature cannot be read (a builtin, an odd callable)."""
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes_whole(params: list[inspect.Parameter] | None, fits: tuple[str, ...] | int) -> bool:
    """Whether a ``forward`` with ``params`` takes an input of dict keys / sequence length ``fits`` whole (see :func:`call_style`)."""
    if params is None or any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params):
        return False  # the signature says nothing: spread, as always
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(required) != 1 or required[0].kind is inspect.Parameter.KEYWORD_ONLY:
        return False
    if isinstance(fits, int):
        return fits > sum(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in params)
    return not set(fits) <= {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def call_model(model: Callable[..., Any], x: Inputs, *, output: Callable[[Any], Any] | None = None, call: str = "auto") -> Any:
    """Call ``model`` on ``x``: ``model(x)`` for a tensor, ``model(**x)`` for a dict,
    ``model(*x)`` for a tuple or list, or ``model(x)`` when ``call`` (:data:`CALL_MODES`,
    resolved by :func:`call_style`) passes the structure whole.

    ``output`` (a :class:`~taste_cl.outputs.OutputSelector`) picks the tensor to train on
    from what the model returns (a dict, tuple or dataclass); None returns it as it is.
    """
    if isinstance(x, torch.Tensor) or call_style(model, x, call) == "positional":
        out = model(x)
    elif isinstance(x, Mapping):
        out = model(**x)
    else:
        out = model(*x)
    return out if output is None else output(out)


# ------------------------------------------------------------------ pytrees


def to_like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` in ``ref``'s dtype and device; ``t`` itself, without a dispatch, when it is there already (hot paths)."""
    return t if t.dtype == ref.dtype and t.device == ref.device else t.to(ref)


def map_leaves(fn: Callable[[torch.Tensor], torch.Tensor], x: Inputs) -> Inputs:
    """``x`` with ``fn`` applied to every tensor leaf; the structure is kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return {key: map_leaves(fn, value) for key, value in x.items()}
    if isinstance(x, tuple):
        return tuple(map_leaves(fn, value) for value in x)
    if isinstance(x, list):
        return [map_leaves(fn, value) for value in x]
    raise TypeError(f"expected a tensor or a dict/tuple/list of tensors; got {type(x).__name__}")


def leaves(x: Inputs) -> list[torch.Tensor]:
    """The tensor leaves of ``x`` in structure order (dict insertion order)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [leaf for value in x.values() for leaf in leaves(value)]
    if isinstance(x, (tuple, list)):
        return [leaf for value in x for leaf in leaves(value)]
    raise TypeError(f"expected a tensor or a dict/tuple/list of tensors; got {type(x).__name__}")


def batch_len(x: Inputs) -> int:
    """Number of samples in ``x`` (the first dimension of its leaves)."""
    while not isinstance(x, torch.Tensor):
        x = next(iter(x.values())) if isinstance(x, Mapping) else x[0]
    return int(x.shape[0])


def index_batch(x: Inputs, index: Any) -> Inputs:
    """Samples ``index`` (a slice or a 1-D index tensor) of every leaf."""
    if isinstance(index, torch.Tensor):  # index_select is cheaper than advanced indexing
        return map_leaves(lambda leaf: leaf.index_select(0, index.to(leaf.device)), x)
    if isinstance(x, torch.Tensor):
        return x[index]
    return map_leaves(lambda leaf: leaf[index], x)


def cat_batches(batches: Sequence[Inputs]) -> Inputs:
    """Concatenate batches of one structure along the sample dimension."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches))
    if isinstance(first, Mapping):
        return {key: cat_batches([b[key] for b in batches]) for key in first}
    parts = [cat_batches([b[i] for b in batches]) for i in range(len(first))]
    return tuple(parts) if isinstance(first, tuple) else parts


# --------------------------------------------------------------------- spec
@dataclass(frozen=True)
class Spec:
    """Structure of an input and, per leaf, its kind and feature shape (not the batch length).

    ``kind`` is ``"tensor"``, ``"dict"``, ``"tuple"`` or ``"list"``. A tensor leaf has
    ``leaf`` (``"float"``, ``"int"`` or ``"bool"``), ``dtype`` (for int and bool leaves;
    floating leaves follow the model) and ``shape``; containers have ``keys`` (dict) and
    ``children``. :meth:`to_json` / :meth:`from_json` give a plain form for checkpoints.
    """

    kind: str
    leaf: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    keys: tuple[str, ...] = ()
    children: tuple[Spec, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    def to_json(self) -> dict[str, Any]:
        if self.is_tensor:
            return {"kind": "tensor", "leaf": self.leaf, "dtype": self.dtype, "shape": list(self.shape)}
        out: dict[str, Any] = {"kind": self.kind, "children": [child.to_json() for child in self.children]}
        if self.kind == "dict":
            out["keys"] = list(self.keys)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Spec:
        """Parse :meth:`to_json` output; ``ValueError`` names what is malformed."""
        if not isinstance(data, Mapping) or data.get("kind") not in ("tensor", "dict", "tuple", "list"):
            raise ValueError(f"input spec must be a mapping with kind tensor/dict/tuple/list; got {data!r:.200}")
        if data["kind"] == "tensor":
            shape = data.get("shape")
            if (
                data.get("leaf") not in ("float", "int", "bool")
                or not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            ):
                raise ValueError(f"input spec leaf is malformed: {data!r:.200}")
            dtype = data.get("dtype", "")
            if data["leaf"] != "float" and _dtype_named(dtype) is None:
                raise ValueError(f"input spec leaf has unknown dtype {dtype!r}")
            return cls("tensor", data["leaf"], str(dtype) if data["leaf"] != "float" else "", tuple(shape))
        children = data.get("children")
        keys = data.get("keys", []) if data["kind"] == "dict" else []
        if not isinstance(children, list) or not children or not isinstance(keys, list):
            raise ValueError(f"input spec container is malformed: {data!r:.200}")
        if data["kind"] == "dict" and (len(keys) != len(children) or not all(isinstance(k, str) for k in keys)):
            raise ValueError(f"input spec dict needs one string key per child; got keys {keys!r:.200}")
        return cls(data["kind"], keys=tuple(keys), children=tuple(cls.from_json(c) for c in children))

    @property
    def leaf_count(self) -> int:
        return 1 if self.is_tensor else sum(child.leaf_count for child in self.children)

    @property
    def entries(self) -> int:
        """Number of values one sample holds, over all leaves (for memory bounds)."""
        return math.prod(self.shape) if self.is_tensor else sum(child.entries for child in self.children)

    @property
    def int_dtype(self) -> torch.dtype:
        dtype = _dtype_named(self.dtype)
        assert dtype is not None
        return dtype


def _dtype_named(name: Any) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if dtype in _INTEGER_DTYPES or dtype == torch.bool else None


def _leaf_kind(t: torch.Tensor) -> str:
    return "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int"


def describe(x: Inputs) -> Spec:
    """The :class:`Spec` of a pytree of tensors."""
    if isinstance(x, torch.Tensor):
        kind = _leaf_kind(x)
        return Spec("tensor", kind, "" if kind == "float" else str(x.dtype).removeprefix("torch."), tuple(x.shape[1:]))
    if isinstance(x, Mapping):
        return Spec("dict", keys=tuple(x), children=tuple(describe(v) for v in x.values()))
    return Spec("tuple" if isinstance(x, tuple) else "list", children=tuple(describe(v) for v in x))


def unflatten(spec: Spec, flat: Sequence[torch.Tensor]) -> Inputs:
    """Rebuild the structure ``spec`` describes from its leaves in order (``ValueError`` if
    their number does not match)."""
    if len(flat) != spec.leaf_count:
        raise ValueError(f"input spec describes {spec.leaf_count} leaves; got {len(flat)}")
    it = iter(flat)

    def build(node: Spec) -> Inputs:
        if node.is_tensor:
            return next(it)
        children = [build(child) for child in node.children]
        if node.kind == "dict":
            return dict(zip(node.keys, children))
        return tuple(children) if node.kind == "tuple" else children

    return build(spec)


def spec_mismatch(expected: Spec, got: Spec, name: str = "x") -> str | None:
    """Why ``got`` does not fit ``expected`` (structure, leaf kind, feature shape), or None."""
    if expected.kind != got.kind:
        return f"{name} is a {got.kind} but the first batch had a {expected.kind} there"
    if expected.is_tensor:
        if expected.leaf != got.leaf:
            return f"{name} is a {got.leaf} leaf but the first batch had a {expected.leaf} leaf there"
        if expected.shape != got.shape:
            return f"{name} has feature shape {got.shape}, expected {expected.shape}"
        return None
    if expected.keys != got.keys or len(expected.children) != len(got.children):
        if expected.kind == "dict":
            return f"{name} has keys {sorted(got.keys)}, expected {sorted(expected.keys)}"
        return f"{name} has {len(got.children)} items, expected {len(expected.children)}"
    labels = expected.keys if expected.kind == "dict" else range(len(expected.children))
    for label, want, have in zip(labels, expected.children, got.children):
        problem = spec_mismatch(want, have, f"{name}[{label!r}]")
        if problem:
            return problem
    return None


# --------------------------------------------------------------- leaf checks
def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN or infinite entries of a floating tensor (0 for integer ones)."""
    if not x.is_floating_point():
        return 0
    # One reduction and one read on the hot path: a NaN or inf entry makes the sum
    # non-finite. So can an overflow of finite entries, hence the exact count then.
    if math.isfinite(x.sum().item()):
        return 0
    return int((~torch.isfinite(x)).sum())


def label_range(y: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest entry of a non-empty integer tensor."""
    low, high = torch.aminmax(y)
    return int(low), int(high)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Return ``(x, y)`` from an ``(x, y)`` pair or a ``{"x": ..., "y": ...}`` mapping."""
    if isinstance(batch, Mapping):
        missing = [key for key in ("x", "y") if key not in batch]
        if missing:
            raise InvalidBatchError(f"batch mapping must have keys 'x' and 'y'; missing {missing}, got keys {sorted(map(str, batch))}")
        return batch["x"], batch["y"]
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise InvalidBatchError(f"batch must be a pair (x, y); got a {type(batch).__name__} of length {len(batch)}")
        return batch[0], batch[1]
    raise InvalidBatchError(f"batch must be an (x, y) pair or a mapping with keys 'x' and 'y'; got {type(batch).__name__}")


def _from_numpy(value: np.ndarray, name: str) -> torch.Tensor:
    kind = value.dtype.kind
    if kind in _NUMPY_REFUSED:
        raise InvalidBatchError(f"{name} must have a numeric dtype (float, integer or bool); got {_NUMPY_REFUSED[kind]} numpy dtype {value.dtype}")
    if kind == "f" and value.dtype.itemsize > 8:
        raise InvalidBatchError(f"{name} has numpy dtype {value.dtype} (longdouble), which torch cannot hold; convert with .astype(np.float64)")
    if not value.dtype.isnative:  # big-endian data on a little-endian machine (or the reverse)
        value = value.astype(value.dtype.newbyteorder("="))
    if kind == "u" and value.dtype.itemsize > 1:
        value = _widen_unsigned(value, name)
    return torch.from_numpy(np.ascontiguousarray(value))


def _widen_unsigned(value: np.ndarray, name: str) -> np.ndarray:
    if value.dtype.itemsize == 2:
        return value.astype(np.int32)
    if value.dtype.itemsize == 8 and value.size and int(value.max()) > np.iinfo(np.int64).max:
        raise InvalidBatchError(f"{name} has uint64 value {int(value.max())} above the int64 maximum")
    return value.astype(np.int64)


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """``value`` as a dense, real, detached tensor; odd inputs raise :class:`InvalidBatchError`."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise InvalidBatchError(f"{name} is on the meta device (it holds no data)")
        if value.layout != torch.strided or value.is_nested:
            raise InvalidBatchError(f"{name} must be a dense tensor; got layout {value.layout} (call .to_dense())")
        if value.is_quantized:
            raise InvalidBatchError(f"{name} is a quantized tensor; pass .dequantize()")
        if value.dtype in _WIDE_UNSIGNED:
            wide = value.to(_WIDE_UNSIGNED[value.dtype])
            if value.dtype == torch.uint64 and bool((wide < 0).any()):  # wrapped around: above the int64 maximum
                raise InvalidBatchError(f"{name} has uint64 values above the int64 maximum")
            value = wide
        if value.is_complex() or not (value.is_floating_point() or value.dtype in _INTEGER_DTYPES or value.dtype == torch.bool):
            raise InvalidBatchError(f"{name} must be a real floating, integer or bool tensor; got dtype {value.dtype}")
        return value.detach() if value.requires_grad else value
    if isinstance(value, np.ndarray):
        return _from_numpy(value, name)
    if value is None:
        raise InvalidBatchError(f"{name} is None; every input leaf must be a torch.Tensor or numpy.ndarray")
    raise InvalidBatchError(f"{name} must be a torch.Tensor or numpy.ndarray; got {type(value).__name__}")


def _to_leaf(value: Any, expected: Spec | None, name: str, *, min_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, Spec]:
    """Validate one leaf and return a fresh tensor (never the caller's memory) and its spec."""
    x = as_tensor(value, name)
    if x.dim() < min_dim:
        raise InvalidBatchError(
            f"{name} must have shape (batch, *features) with at least {min_dim} dimension{'s' if min_dim > 1 else ''}; got shape {tuple(x.shape)}"
        )
    if x.shape[0] == 0:
        raise InvalidBatchError(f"{name} is an empty batch (shape {tuple(x.shape)}); give at least one sample")
    kind = _leaf_kind(x)
    if expected is not None:
        if not expected.is_tensor:
            raise InvalidBatchError(f"{name} is a tensor but the first batch had a {expected.kind} there")
        if tuple(x.shape[1:]) != expected.shape:
            raise InvalidBatchError(f"{name} has feature shape {tuple(x.shape[1:])}, expected {expected.shape} (full shape got {tuple(x.shape)})")
        if kind != expected.leaf and (kind, expected.leaf) != ("int", "float"):  # integers for a float leaf are converted
            raise InvalidBatchError(f"{name} has dtype {x.dtype}; the first batch had {expected.dtype or 'floating point'} there")
        kind = expected.leaf
    if kind == "float":
        x = x.to(device=device, dtype=dtype, copy=True).contiguous()
        bad = count_nonfinite(x)
        if bad:
            raise InvalidBatchError(f"{name} contains {bad} non-finite value(s) (NaN or inf)")
        return x, expected or Spec("tensor", "float", "", tuple(x.shape[1:]))
    if expected is not None and x.dtype != expected.int_dtype:
        target = expected.int_dtype
        if x.numel() and target != torch.bool:
            low, high = label_range(x.long() if x.dtype == torch.bool else x)
            info = torch.iinfo(target)
            if low < info.min or high > info.max:
                raise InvalidBatchError(f"{name} has values in [{low}, {high}], outside the first batch's dtype {target}")
        x = x.to(target)
    x = x.to(device=device, copy=True).contiguous()
    return x, expected or describe(x)


def _copy_if_plain(value: Any, spec: Spec, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The hot path of :func:`to_inputs` after the first batch: a contiguous copy of a plain,
    finite float tensor that already has the model's dtype and device and ``spec``'s
    feature shape. None when anything differs: the full validation then converts or explains.

    Only inputs the full validation accepts unchanged pass, and they get the same copy.
    """
    if not spec.is_tensor or spec.leaf != "float" or type(value) is not torch.Tensor:
        return None
    if value.dtype != dtype or value.device != device or value.requires_grad or value.layout != torch.strided or value.is_nested:
        return None
    if value.shape[1:] != spec.shape or not value.shape[0]:
        return None
    x = value.clone(memory_format=torch.contiguous_format)
    return None if count_nonfinite(x) else x  # non-finite: the full path raises with the count


def to_inputs(value: Any, *, spec: Spec | None, dtype: torch.dtype, device: torch.device, name: str = "x") -> tuple[Inputs, Spec]:
    """Validate an input batch (a tensor/array or a dict/tuple/list of them) against ``spec``
    (None on the first batch) and return fresh tensors in the model's placement and its spec.

    A lone tensor needs at least 2 dimensions ``(batch, *features)``; a leaf inside a
    structure at least 1. Every leaf must have the same batch length.
    """
    if spec is not None:
        plain = _copy_if_plain(value, spec, dtype=dtype, device=device)
        if plain is not None:
            return plain, spec
    if isinstance(value, (torch.Tensor, np.ndarray)) or value is None:
        return _to_leaf(value, spec, name, min_dim=2, dtype=dtype, device=device)
    if spec is not None and spec.is_tensor:
        raise InvalidBatchError(f"{name} must be a torch.Tensor or numpy.ndarray like the first batch; got {type(value).__name__}")
    out, got = _to_tree(value, spec, name, dtype=dtype, device=device)
    lengths = {path: int(leaf.shape[0]) for path, leaf in _named_leaves(out, name)}
    if len(set(lengths.values())) > 1:
        raise InvalidBatchError(f"{name} leaves differ in batch length: {lengths}")
    return out, got


def _named_leaves(x: Inputs, name: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(x, torch.Tensor):
        return [(name, x)]
    items = x.items() if isinstance(x, Mapping) else enumerate(x)
    return [pair for key, value in items for pair in _named_leaves(value, f"{name}[{key!r}]")]


def _to_tree(value: Any, spec: Spec | None, name: str, *, dtype: torch.dtype, device: torch.device) -> tuple[Inputs, Spec]:
    if isinstance(value, (torch.Tensor, np.ndarray)) or value is None:
        return _to_leaf(value, spec, name, min_dim=1, dtype=dtype, device=device)
    if isinstance(value, Mapping):
        if not value:
            raise InvalidBatchError(f"{name} is an empty dict; give at least one input tensor")
        odd = [key for key in value if not isinstance(key, str)]
        if odd:
            raise InvalidBatchError(f"{name} has non-string key(s) {odd[:5]!r}; dict keys name the model's inputs and must be strings")
        if spec is not None and (spec.kind != "dict" or set(spec.keys) != set(value)):
            want = sorted(spec.keys) if spec.kind == "dict" else f"a {spec.kind}"
            raise InvalidBatchError(f"{name} has keys {sorted(value)}, expected {want} like the first batch")
        keys = spec.keys if spec is not None else tuple(value)
        children = [
            _to_tree(value[key], None if spec is None else spec.children[i], f"{name}[{key!r}]", dtype=dtype, device=device)
            for i, key in enumerate(keys)
        ]
        return {key: c for key, (c, _) in zip(keys, children)}, Spec("dict", keys=keys, children=tuple(s for _, s in children))
    if isinstance(value, (tuple, list)):
        if not value:
            raise InvalidBatchError(f"{name} is an empty {type(value).__name__}; give at least one input tensor")
        if spec is not None and (spec.kind not in ("tuple", "list") or len(spec.children) != len(value)):
            want = f"{len(spec.children)} items" if spec.kind in ("tuple", "list") else f"a {spec.kind}"
            raise InvalidBatchError(f"{name} has {len(value)} items, expected {want} like the first batch")
        children = [
            _to_tree(item, None if spec is None else spec.children[i], f"{name}[{i}]", dtype=dtype, device=device) for i, item in enumerate(value)
        ]
        kind = spec.kind if spec is not None else ("tuple" if isinstance(value, tuple) else "list")
        items = [c for c, _ in children]
        return (tuple(items) if kind == "tuple" else items), Spec(kind, children=tuple(s for _, s in children))
    if spec is None or not spec.is_tensor:
        raise InvalidBatchError(f"{name} must be a torch.Tensor or numpy.ndarray, or a dict/tuple/list of them; got {type(value).__name__}")
    return _to_leaf(value, spec, name, min_dim=1, dtype=dtype, device=device)


# ------------------------------------------- single-tensor helpers (adapters)
def to_features(
    value: Any,
    *,
    feature_shape: tuple[int, ...] | None,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "x",
) -> torch.Tensor:
    """Validate a float feature batch ``(n, *feature_shape)`` (integer data is converted to
    ``dtype``; bool refused) and return a fresh tensor. Used where the model takes one float
    tensor (the ONNX device learner)."""
    x = as_tensor(value, name)
    if x.dtype == torch.bool:
        raise InvalidBatchError(f"{name} must be a real floating or integer tensor; got dtype {x.dtype}")
    expected = None if feature_shape is None else Spec("tensor", "float", "", tuple(feature_shape))
    return _to_leaf(x, expected, name, min_dim=2, dtype=dtype, device=device)[0]


def to_labels(value: Any, *, n: int, num_classes: int | None, device: torch.device, name: str = "y") -> torch.Tensor:
    """Validate a label batch: integer dtype, shape ``(n,)``, values in ``[0, num_classes)``."""
    y = as_tensor(value, name)
    if y.is_floating_point() or y.dtype == torch.bool:
        raise InvalidBatchError(f"{name} must hold integer class labels; got dtype {y.dtype}")
    if y.dim() != 1:
        raise InvalidBatchError(f"{name} must be 1-D of shape ({n},); got shape {tuple(y.shape)}")
    if y.shape[0] != n:
        raise InvalidBatchError(f"x and {name} lengths differ: x has {n} samples, {name} has {y.shape[0]}")
    if y.numel() and num_classes is not None:
        low, high = label_range(y)
        if low < 0 or high >= num_classes:
            offending = low if low < 0 else high
            raise InvalidBatchError(f"{name} has label {offending} out of range; labels must be in [0, {num_classes - 1}]")
    return y.to(device=device, dtype=torch.long, copy=True)
