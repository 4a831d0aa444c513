"""The draft head's forward pass in numpy: a fusion FC over [feature ; token embedding] and one
decoder layer with its own KV cache. Embedding and LM head are the target's own (frozen, shared).

The layer uses the target's layer shape and the engine's ``layer_forward``, so the head's numbers
follow the same code path as the target's.
"""
from __future__ import annotations

import numpy as np

from ..engine import KVCache, LayerWeights, Transformer, layer_forward, rotation
from ..errors import LyannaError


class DraftHead:
    def __init__(self, target: Transformer, weights: dict[str, np.ndarray]):
        c = target.config

        def get(name: str) -> np.ndarray:
            try:
                return np.ascontiguousarray(weights[name], dtype=np.float32)
            except KeyError:
                raise LyannaError(f"draft head weight {name!r} is missing") from None

        self.config = c
        self.fc_w = get("fc.weight")
        self.fc_b = get("fc.bias")
        if self.fc_w.shape != (c.hidden_size, 2 * c.hidden_size):
            raise LyannaError(f"draft head fc.weight has shape {self.fc_w.shape}, expected {(c.hidden_size, 2 * c.hidden_size)}")
        self.layer = LayerWeights.from_hf(get, "layer.", c)
        self.embed = target.embed
        self.lm_head = target.lm_head
        self.inv_freq = target.inv_freq

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity)

    def step(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: KVCache,
             bias: np.ndarray | None) -> np.ndarray:
        """Predict the next features for n (feature, token) pairs appended to ``cache``."""
        x = np.concatenate([features, self.embed[tokens]], axis=-1) @ self.fc_w.T + self.fc_b
        out = layer_forward(self.layer, self.config, x, rotation(self.inv_freq, positions),
                            cache.k[0], cache.v[0], cache.length, bias)
        cache.length += len(tokens)
        return out

    def log_probs(self, features: np.ndarray) -> np.ndarray:
        logits = features @ self.lm_head.T
        logits = logits - logits.max(axis=-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
