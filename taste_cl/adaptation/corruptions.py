"""Corruptions at five severities, built offline, for test-time adaptation streams.

After Hendrycks & Dietterich's ImageNet-C / CIFAR-10-C (ICLR 2019), written for tensors:
images ``(batch, channels, height, width)`` and sequences ``(batch, channels, time)``. The
severity scales are relative to the data's own spread (its standard deviation and range),
so the same names work on generated images, digits and recorded sensor data. Every
function is deterministic given its ``generator``.

Images: ``gaussian_noise``, ``shot_noise``, ``blur``, ``contrast``, ``brightness``,
``pixelate``, ``jpeg`` (8x8 block DCT quantisation). Sequences: ``sensor_noise``,
``drift`` (a slow additive ramp), ``time_warp`` (a smooth monotone resampling).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.nn import functional

__all__ = ["IMAGE_CORRUPTIONS", "SEQUENCE_CORRUPTIONS", "SEVERITIES", "corrupt"]

SEVERITIES = (1, 2, 3, 4, 5)
Corruption = Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.std().clamp_min(1e-6)


def gaussian_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    sigma = (0.3, 0.5, 0.7, 0.9, 1.2)[severity - 1]
    return x + sigma * _scale(x) * torch.randn(x.shape, generator=generator)


def shot_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    rate = (60.0, 25.0, 12.0, 5.0, 3.0)[severity - 1]
    low, high = x.amin(), x.amax()
    unit = (x - low) / (high - low).clamp_min(1e-6)
    return torch.poisson(unit * rate, generator=generator) / rate * (high - low) + low


def blur(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    sigma = (0.6, 1.0, 1.5, 2.0, 3.0)[severity - 1]
    radius = max(1, math.ceil(2 * sigma))
    taps = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel = torch.exp(-(taps**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    c = x.shape[1]
    out = functional.conv2d(functional.pad(x, (radius, radius, 0, 0), mode="reflect"), kernel.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    return functional.conv2d(functional.pad(out, (0, 0, radius, radius), mode="reflect"), kernel.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)


def contrast(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    factor = (0.6, 0.45, 0.3, 0.2, 0.1)[severity - 1]
    mean = x.mean(dim=tuple(range(1, x.dim())), keepdim=True)
    return (x - mean) * factor + mean


def brightness(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    shift = (0.3, 0.6, 0.9, 1.2, 1.6)[severity - 1]
    return x + shift * _scale(x)


def pixelate(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    factor = (0.8, 0.6, 0.45, 0.3, 0.2)[severity - 1]
    h, w = x.shape[-2:]
    small = functional.interpolate(x, size=(max(1, round(h * factor)), max(1, round(w * factor))), mode="area")
    return functional.interpolate(small, size=(h, w), mode="nearest")


def _dct_matrix(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)
    m = torch.cos(math.pi / n * (k[None, :] + 0.5) * k[:, None]) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m.float()


def jpeg(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """8x8 block DCT, coefficients quantised with steps growing with frequency, then inverted."""
    step = (0.1, 0.2, 0.35, 0.6, 1.0)[severity - 1] * float(_scale(x)) * 8
    b, c, h, w = x.shape
    ph, pw = (-h) % 8, (-w) % 8
    padded = functional.pad(x, (0, pw, 0, ph), mode="replicate")
    blocks = padded.unfold(2, 8, 8).unfold(3, 8, 8)  # b, c, h/8, w/8, 8, 8
    d = _dct_matrix(8)
    coeffs = d @ blocks @ d.T
    freq = torch.arange(8, dtype=x.dtype)
    quant = step * (1 + freq[:, None] + freq[None, :]) / 4
    restored = d.T @ (torch.round(coeffs / quant) * quant) @ d
    out = restored.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h + ph, w + pw)
    return out[..., :h, :w].contiguous()


def sensor_noise(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    return gaussian_noise(x, severity, generator)


def drift(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """A per-sample, per-channel linear ramp over time, up to ``severity``-scaled spreads."""
    height = (0.3, 0.6, 1.0, 1.5, 2.0)[severity - 1] * _scale(x)
    slopes = torch.randn(x.shape[0], x.shape[1], 1, generator=generator)
    ramp = torch.linspace(0, 1, x.shape[-1], dtype=x.dtype)
    return x + height * slopes * ramp


def time_warp(x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
    """Resample each sequence along a smooth monotone warp of its time axis."""
    strength = (0.1, 0.2, 0.3, 0.4, 0.5)[severity - 1]
    t = x.shape[-1]
    base = torch.linspace(0, 1, t, dtype=x.dtype)
    phase = torch.rand(x.shape[0], 1, generator=generator) * 2 * math.pi
    warped = base + strength / (2 * math.pi) * torch.sin(2 * math.pi * base + phase) * (1 - base) * base * 4
    warped = torch.cummax(warped.clamp(0, 1), dim=1).values * (t - 1)
    left = warped.floor().long().clamp(0, t - 1)
    right = (left + 1).clamp(max=t - 1)
    frac = (warped - left).unsqueeze(1)
    gather = lambda idx: x.gather(2, idx.unsqueeze(1).expand(-1, x.shape[1], -1))  # noqa: E731
    return gather(left) * (1 - frac) + gather(right) * frac


IMAGE_CORRUPTIONS: dict[str, Corruption] = {
    "gaussian_noise": gaussian_noise,
    "shot_noise": shot_noise,
    "blur": blur,
    "contrast": contrast,
    "brightness": brightness,
    "pixelate": pixelate,
    "jpeg": jpeg,
}
SEQUENCE_CORRUPTIONS: dict[str, Corruption] = {"sensor_noise": sensor_noise, "drift": drift, "time_warp": time_warp}


def corrupt(x: torch.Tensor, name: str, severity: int, *, seed: int = 0) -> torch.Tensor:
    """``x`` under corruption ``name`` at ``severity`` (1-5); images 4-D, sequences 3-D."""
    table = IMAGE_CORRUPTIONS if x.dim() == 4 else SEQUENCE_CORRUPTIONS if x.dim() == 3 else None
    if table is None:
        raise ValueError(f"`x` must be images (batch, channels, height, width) or sequences (batch, channels, time); got shape {tuple(x.shape)}")
    if name not in table:
        raise ValueError(f"`name == {name!r}`, must be one of {sorted(table)} for {'images' if x.dim() == 4 else 'sequences'}")
    if isinstance(severity, bool) or severity not in SEVERITIES:
        raise ValueError(f"`severity == {severity!r}`, must be one of {SEVERITIES}")
    with torch.no_grad():
        return table[name](x.float(), severity, torch.Generator().manual_seed(seed))
