"""The draft head's forward pass in numpy: a fusion FC over [feature ; token embedding] and one
decoder layer (or a few, ``checkpoint.layer_prefixes``) with its own KV cache. Embedding and LM
head are the target's own (frozen, shared).

The layers use the target's layer shape and the engine's kernels (``layer_forward``, or on a GGUF's
blocks the fused all-layers call), so the head's numbers follow the same code path as the target's.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..engines.base import TargetEngine
from ..engines.fused import FusedLayers
from ..engines.halves import as_stored
from ..engines.kernels import linear, rms_norm, rope_qk
from ..engines.quant import QuantMatrix, fit_q4_1
from ..engines.transformer import KVCache, LayerWeights, Span, Weight, attention_bias, Rotations, ragged_layer_forward
from ..errors import LyannaError
from .checkpoint import head_layer_count, layer_prefixes


class DraftHead:
    def __init__(self, target: TargetEngine, weights: dict[str, np.ndarray]):
        c = target.config
        # On a target computed on a GGUF's blocks the head's matrices become Q4_1 blocks too
        # (``quant.fit_q4_1``): a draft step streams a sixth of the fp32 bytes (the head is one
        # layer, so its step is bound by reading its weights), and a draft needs no exact weights,
        # the target checks it. 4-bit, not 8: the target's pass pushes the head's weights out of
        # the caches, so every round reads them again from memory, and the bytes saved draft
        # faster than the coarser weights cost in accepted drafts.
        blocks = isinstance(target.lm_head, QuantMatrix)

        def get(name: str) -> Weight:
            try:
                w = np.ascontiguousarray(weights[name], dtype=np.float32)
            except KeyError:
                raise LyannaError(f"draft head weight {name!r} is missing") from None
            return fit_q4_1(w, target.lm_head.kernel) if blocks and w.ndim == 2 else w

        self.config = c
        self.fc_w = get("fc.weight")
        self.fc_b = get("fc.bias")
        if self.fc_w.shape != (c.hidden_size, 2 * c.hidden_size):
            raise LyannaError(f"draft head fc.weight has shape {self.fc_w.shape}, expected {(c.hidden_size, 2 * c.hidden_size)}")
        self.layers = [LayerWeights.from_hf(get, prefix, c) for prefix in layer_prefixes(head_layer_count(weights))]
        # On blocks the layers run as one compiled call (as the target's layers do): a draft step
        # is one row, so the ~10 kernel launches a layer of the layer-by-layer path cost more than its math.
        self._fused = FusedLayers.of(self.layers, c)
        self._fused_below = FusedLayers.of(self.layers[:-1], c) if len(self.layers) > 1 else None
        # The key and value rows of the last layer's fused projection: with the layers below it,
        # what a pair whose output nobody reads needs (``fill``).
        q_dim = c.num_heads * c.head_dim
        last = self.layers[-1]
        self._wkv = last.wqkv.take(np.arange(q_dim, last.wqkv.shape[0]), axis=0)
        self._bkv = None if last.bqkv is None else last.bqkv[q_dim:]
        self.embed = target.embed
        self.lm_head = target.lm_head
        self.rotations = Rotations(target.inv_freq)  # a round's positions' RoPE factors, read from a table
        # A head reading several taps projects their rows, side by side, to one feature (``PairContext``).
        self.taps_fc = get("taps_fc.weight") if "taps_fc.weight" in weights else None
        # Keys and values held as the target holds its own (halves on a GGUF's blocks): the head's
        # layers then run the target's compiled passes for the same argument types, not a second
        # compilation of each for a float32 cache, and its attention reads half the bytes.
        self.halves = getattr(target, "kv_cache", "float32") == "float16"

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), c.num_kv_heads, c.head_dim, capacity, self.halves)

    def context(self, taps: Sequence[int]) -> "PairContext":
        """A new generation's view of the committed context (``PairContext``)."""
        return PairContext(self, taps)

    def fuse(self, features: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The fusion FC over each pair's [feature ; token embedding]: the head layers' input rows."""
        return linear(np.concatenate([features, self.embed[tokens]], axis=-1), self.fc_w) + self.fc_b

    def step(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: KVCache,
             bias: np.ndarray | None) -> np.ndarray:
        """Predict the next features for n (feature, token) pairs appended to ``cache``."""
        out = self.layer_step(self.fuse(features, tokens), positions, cache, bias)
        cache.length += len(tokens)
        return out

    def fill(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: KVCache) -> None:
        """Append n (feature, token) pairs to ``cache`` as ``step`` would, without predicting:
        a row's key and value in the last layer depend on that row's input to it alone, so pairs
        whose outputs nobody reads (all of a catch-up's but the root's) need the fusion FC, the
        layers below the last, and the last's key/value projection: for a one-layer head about a
        fifth of its multiply-adds, and no attention. Same kernels, so the cache rows are
        bit-identical to ``step``'s."""
        c, n = self.config, len(tokens)
        if not n:
            return
        x = self.fuse(features, tokens)
        if len(self.layers) > 1:  # each pair sees those before it
            x = self.layer_step(x, positions, cache, attention_bias(cache.length, np.tril(np.ones((n, n), bool))),
                                below=True)
        h = rms_norm(x, self.layers[-1].attn_norm, c.rms_norm_eps)
        kv = linear(h, self._wkv)
        if self._bkv is not None:
            kv += self._bkv
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = np.zeros((n, q_dim + 2 * kv_dim), np.float32)  # rope_qk reads the fused layout
        qkv[:, q_dim:] = kv
        _, k = rope_qk(qkv, self.rotations(positions), c.num_heads, c.num_kv_heads, c.head_dim)
        end = cache.length + n
        cache.k[-1, :, cache.length : end] = as_stored(cache.k, k.transpose(1, 0, 2))
        cache.v[-1, :, cache.length : end] = as_stored(cache.v, kv[:, kv_dim:].reshape(n, c.num_kv_heads,
                                                                                     c.head_dim).transpose(1, 0, 2))
        cache.length = end

    def layer_step(self, x: np.ndarray, positions: np.ndarray | Sequence[int], cache: KVCache,
                   bias: np.ndarray | None, below: bool = False) -> np.ndarray:
        """The head's decoder layers (``below``: all but the last) over rows ``x`` at
        ``positions``, written to the cache after its ``length`` rows (the caller advances ``length``)."""
        return self.layers_over(x, positions, [(0, x.shape[0], cache, bias)], below)

    def layers_over(self, x: np.ndarray, positions: np.ndarray | Sequence[int],
                    spans: Sequence[tuple[int, int, KVCache, np.ndarray | None]], below: bool = False) -> np.ndarray:
        """``layer_step`` for the rows of several sequences at once (``spans``: each one's rows
        ``[lo, hi)`` of ``x``, its cache and its additive mask or None), the weights streamed
        once for all of them; each row's numbers are those it gets alone."""
        rot = self.rotations(positions)
        layers, fused = (self.layers[:-1], self._fused_below) if below else (self.layers, self._fused)
        if fused is not None:
            return fused(x, rot, [(lo, hi, kv.k, kv.v, kv.length, bias) for lo, hi, kv, bias in spans], [])[0]
        for i, layer in enumerate(layers):
            x = ragged_layer_forward(layer, self.config, x, rot,
                                     [Span(lo, hi, kv.k[i], kv.v[i], kv.length, bias) for lo, hi, kv, bias in spans])
        return x

    def log_probs(self, features: np.ndarray) -> np.ndarray:
        logits = linear(features, self.lm_head)
        logits = logits - logits.max(axis=-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))

    def top_children(self, features: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``k`` likeliest next tokens under the target's LM head, likeliest first,
        and their log-probabilities: ``[rows, k]`` each."""
        logp = self.log_probs(features)
        top = np.argpartition(-logp, k, axis=-1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(logp, top, -1), axis=-1), -1)
        return top, np.take_along_axis(logp, top, -1)


# Pairs a catch-up feeds through one step of the head together (the tokens a round accepted and
# its root): for so few rows a whole step costs about what ``fill``'s calls for all but the root
# and a step for the root do, in one call instead of several. A prompt's pairs are filled.
STEP_CATCH_UP = 8


class PairContext:
    """A draft head's view of the committed context.

    It keeps the target features of committed tokens and the head's KV cache over the pairs
    (feature after token i-1, token i); pair i sits at position i and cache slot i - 1. Drafters
    append speculative rows after ``base`` and drop them with ``rewind``.
    """

    def __init__(self, head: DraftHead, taps: Sequence[int]):
        """``taps``: the target hidden states the head reads (``check_taps``); with several,
        the committed tokens' feature is their rows side by side through ``head.taps_fc``,
        computed once when a token is committed, so that everything after it sees one feature
        per token whatever the taps."""
        self.head, self.taps = head, tuple(taps)
        if (len(self.taps) > 1) != (head.taps_fc is not None):
            raise LyannaError(f"a head reading taps {list(self.taps)} needs taps_fc.weight exactly when it reads several")
        self.cache = head.new_cache(1024)
        # Committed features in a buffer that doubles when full: appending a round's rows costs
        # their size, not a copy of the whole context (which every round paid, drafting or not).
        self._rows = np.zeros((0, head.config.hidden_size), np.float32)
        self._count = 0
        self.base = 0
        self.passes = 0  # head forward passes, for statistics

    @property
    def features(self) -> np.ndarray:
        """The target features of the committed tokens, one row each."""
        return self._rows[: self._count]

    def start(self, hidden: dict[int, np.ndarray]) -> None:
        self._count = 0
        self.commit(hidden)
        self.cache.length = self.base = 0

    def commit(self, hidden: dict[int, np.ndarray]) -> None:
        if len(self.taps) == 1:
            rows = hidden[self.taps[0]]
        else:
            rows = linear(np.concatenate([hidden[t] for t in self.taps], axis=-1), self.head.taps_fc)
        need = self._count + len(rows)
        if need > len(self._rows):
            grown = np.empty((max(need, 2 * len(self._rows)), self._rows.shape[1]), np.float32)
            grown[: self._count] = self._rows[: self._count]
            self._rows = grown
        self._rows[self._count : need] = rows
        self._count = need

    def reserve(self, ctx: np.ndarray, extra: int) -> np.ndarray:
        """Make room for the pairs of ``ctx`` not fed yet and ``extra`` speculative rows after
        them; return those pairs' positions (the root's last). A root fed already (a repeated
        proposal for the same context) is fed again."""
        self.cache.length = min(self.cache.length, len(ctx) - 2)
        self._room(len(ctx) + extra)
        return np.arange(self.cache.length + 1, len(ctx))

    def _room(self, need: int) -> None:
        """A cache of at least ``need`` positions (doubling), the fed pairs moved over."""
        if need > self.cache.capacity:
            bigger = self.head.new_cache(max(need, 2 * self.cache.capacity))
            bigger.k[:, :, : self.cache.length] = self.cache.k[:, :, : self.cache.length]
            bigger.v[:, :, : self.cache.length] = self.cache.v[:, :, : self.cache.length]
            bigger.length = self.cache.length
            self.cache = bigger

    def catch_up(self, ctx: np.ndarray, extra: int) -> np.ndarray:
        """Feed every committed pair not fed yet, the root (``ctx[-1]``) last, and return the
        head's prediction after the root (the only output read). A round's few pairs go through
        one step together; a prompt's many are ``fill``ed but the root. ``extra`` slots are
        reserved for speculative rows."""
        pending = self.reserve(ctx, extra)
        n = len(pending)
        if n <= STEP_CATCH_UP:
            bias = None if n == 1 else attention_bias(self.cache.length, np.tril(np.ones((n, n), bool)))
            out = self.head.step(self.features[pending - 1], ctx[pending], pending, self.cache, bias)
            self.passes += 1
            self.base = self.cache.length
            return out[-1]
        old, root = pending[:-1], pending[-1:]
        self.head.fill(self.features[old - 1], ctx[old], old, self.cache)
        out = self.head.step(self.features[root - 1], ctx[root], root, self.cache, None)
        self.passes += 1
        self.base = self.cache.length
        return out[-1]

    def rewind(self) -> None:
        self.cache.length = self.base
