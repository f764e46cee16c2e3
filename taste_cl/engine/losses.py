"""The strategies' losses in numpy: each returns the loss and its gradient with respect to the outputs.

The same definitions as the torch strategies (:mod:`taste_cl.strategies`), written once for
every engine (:mod:`taste_cl.engine.base`): a micro-batch is ``[stream | replay]``, its first
``n_stream`` rows from the stream.

- :func:`experience_replay`: cross-entropy over every row (``nn.CrossEntropyLoss()``'s mean).
- :func:`er_ace`: the stream rows' cross-entropy over the classes present in the stream
  part only, plus the replayed rows' over all classes, each part a mean.
- :func:`der_plus_plus`: the stream rows' cross-entropy, plus ``beta`` times the replayed
  rows', plus ``alpha`` times the mean squared error between the replayed rows' outputs and
  the outputs stored with them.
- :func:`lwf`: cross-entropy over every row plus ``alpha`` times the KL divergence to a
  teacher's outputs at ``temperature``, times ``temperature**2``.
- :func:`mean_entropy`: TENT's label-free loss.
- :func:`clip_by_total_norm`: ``torch.nn.utils.clip_grad_norm_``'s definition.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["clip_by_total_norm", "der_plus_plus", "er_ace", "experience_replay", "lwf", "mean_entropy", "softmax", "total_norm"]

Loss = tuple[float, np.ndarray]


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax; a row of all ``-inf`` is not allowed."""
    shifted = z - z.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _weighted_cross_entropy(outputs: np.ndarray, y: np.ndarray, weights: np.ndarray) -> Loss:
    """``sum_i weights[i] * CE(outputs[i], y[i])`` and its gradient."""
    rows = np.arange(outputs.shape[0])
    log_p = _log_softmax(outputs)
    loss = float(-(weights * log_p[rows, y]).sum())
    grad = np.exp(log_p)
    grad[rows, y] -= 1
    return loss, (grad * weights[:, None]).astype(outputs.dtype, copy=False)


def _part_weights(size: int, n_stream: int, replay_weight: float = 1.0) -> np.ndarray:
    """Per-row weights making the stream part a mean plus ``replay_weight`` times the replay part's mean."""
    weights = np.empty(size)
    weights[:n_stream] = 1.0 / n_stream
    if size > n_stream:
        weights[n_stream:] = replay_weight / (size - n_stream)
    return weights


def experience_replay(outputs: np.ndarray, y: np.ndarray, n_stream: int) -> Loss:
    return _weighted_cross_entropy(outputs, y, np.full(outputs.shape[0], 1.0 / outputs.shape[0]))


def er_ace(outputs: np.ndarray, y: np.ndarray, n_stream: int) -> Loss:
    absent = np.bincount(y[:n_stream], minlength=outputs.shape[1]) == 0
    masked = outputs.copy()
    masked[:n_stream][:, absent] = -np.inf
    loss, grad = _weighted_cross_entropy(masked, y, _part_weights(outputs.shape[0], n_stream))
    grad[:n_stream][:, absent] = 0.0
    return loss, grad


def der_plus_plus(outputs: np.ndarray, y: np.ndarray, n_stream: int, stored: np.ndarray | None, *, alpha: float = 1.0, beta: float = 1.0) -> Loss:
    if n_stream == outputs.shape[0]:
        return experience_replay(outputs, y, n_stream)
    if stored is None:
        raise ValueError("DER++ needs the replayed rows' stored outputs (`stored`)")
    loss, grad = _weighted_cross_entropy(outputs, y, _part_weights(outputs.shape[0], n_stream, beta))
    diff = outputs[n_stream:] - stored
    loss += alpha * float((diff * diff).mean())
    grad[n_stream:] += (2 * alpha / diff.size) * diff
    return loss, grad


def lwf(outputs: np.ndarray, y: np.ndarray, n_stream: int, teacher: np.ndarray | None, *, alpha: float = 1.0, temperature: float = 2.0) -> Loss:
    loss, grad = experience_replay(outputs, y, n_stream)
    if teacher is None or not alpha:
        return loss, grad
    t = temperature
    log_q = _log_softmax(teacher / t)
    log_p = _log_softmax(outputs / t)
    n = outputs.shape[0]
    loss += alpha * float((np.exp(log_q) * (log_q - log_p)).sum(axis=1).mean()) * t * t
    grad += (alpha * t / n) * (np.exp(log_p) - np.exp(log_q))
    return loss, grad


def mean_entropy(outputs: np.ndarray) -> Loss:
    """Mean Shannon entropy of ``softmax(outputs)`` and its gradient (TENT)."""
    log_p = _log_softmax(outputs)
    p = np.exp(log_p)
    entropy = -(p * log_p).sum(axis=1, keepdims=True)
    return float(entropy.mean()), (-p * (log_p + entropy) / outputs.shape[0]).astype(outputs.dtype, copy=False)


def total_norm(gradients: Mapping[str, np.ndarray]) -> float:
    """The 2-norm of all gradients together."""
    return float(np.sqrt(sum(float(np.vdot(g, g)) for g in gradients.values())))


def clip_by_total_norm(gradients: Mapping[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """The gradients scaled by ``max_norm / (norm + 1e-6)`` when their total norm exceeds ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``), and the norm before clipping."""
    norm = total_norm(gradients)
    if not norm > max_norm:  # NaN is not clipped: the guard refuses it
        return dict(gradients), norm
    scale = max_norm / (norm + 1e-6)
    return {name: (g * scale).astype(g.dtype, copy=False) for name, g in gradients.items()}, norm
