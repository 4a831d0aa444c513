"""Turning target logits into the distribution we sample from (temperature, top-k, top-p).

Speculative methods must sample from exactly this distribution, so it lives in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import LyannaError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise LyannaError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise LyannaError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise LyannaError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution (float64, rows sum to 1) for logits of shape [..., vocab]."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    z = np.asarray(logits, dtype=np.float64)
    # Shifted before dividing: the largest logit becomes 0 at any temperature, so a tiny one (down
    # to subnormals) gives its limit, the greedy distribution, instead of inf - inf = NaN.
    z = (z - z.max(axis=-1, keepdims=True)) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a 1-D distribution by inverse CDF."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.shape[-1] - 1))


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy argmax or a sample from the filtered distribution, for one row of logits."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(target_probs(logits, params), rng)
