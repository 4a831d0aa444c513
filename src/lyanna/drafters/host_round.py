"""A Lyanna round's draft forward passes on the host head in one compiled call, on a GGUF's blocks.

Why: a round's drafting is a handful of one- or two-row steps through a one-layer head (the
catch-up's fusion FC and layer, one layer a chain level, the draft logits), each a few tens of
microseconds of arithmetic; called one by one from Python, the calls between them (argument
checks, rotation tables, span layouts, small numpy operations) cost about as much again as the
arithmetic, on every drafting round. ``_chain_logits`` runs the same compiled kernels in the same
order (the embedding's dequantizer, the integer linear kernel, ``fused._layers``, the RMSNorm
kernel), so every row gets exactly the bits the step-by-step path gives it (``test_lyanna.py``).

It serves a round whose catch-up is one step of the head (``head.STEP_CATCH_UP`` pairs or fewer)
on a head whose layers run fused (``FusedLayers``) and whose fusion FC, embedding and draft LM
head are unpadded blocks on the integer kernel; anything else drafts step by step.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
from numba import njit

from ..engines import intdot
from ..engines.config import ModelConfig
from ..engines.fused import FusedLayers, _layers, _linear
from ..engines.kernels import _launch, _rms_norm_kernel
from ..engines.quant import QuantMatrix
from ..engines.transformer import Weight, attention_bias, rotation
from .head import STEP_CATCH_UP, PairContext


class ChainWeights(Protocol):
    """What ``CompiledChain`` reads of its head (``lyanna.ChainHead``): stated here so that this
    module need not import ``lyanna``, which imports it."""

    config: ModelConfig
    inv_freq: np.ndarray
    embed: Weight
    fc_w: Weight
    fc_b: Weight
    norm: np.ndarray
    draft_lm_head: Weight
    _fused: FusedLayers | None


@njit(nogil=True, cache=True)
def _one_span(x, rot, fl, cache, start, bias, masked, eps, shape, path):  # pragma: no cover - compiled
    """``x`` through the head's layers as one sequence's block at cache slot ``start``, with its
    flattened additive mask (``masked``) or none."""
    attn_norms, mlp_norms, d, m, q = fl
    k, v = cache
    heads, kv_heads, head_dim = shape
    zero = np.zeros(1, np.int64)
    return _layers(x, rot, attn_norms, mlp_norms, d, m, q, (k,), (v,), np.zeros(x.shape[0], np.int64), zero,
                   np.full(1, start, np.int64), bias, np.full(1, 0 if masked else -1, np.int64),
                   np.full(len(attn_norms), -1, np.int64), np.empty((0, x.shape[0], x.shape[1]), np.float32), eps,
                   heads, kv_heads, head_dim, path, np.zeros(0, np.int64))


@njit(nogil=True, cache=True)
def _chain_logits(features, tokens, embed, fc, fc_b, fl, cache, start, bias, rot, depth, norm, lm, eps, shape,
                  path):  # pragma: no cover - compiled
    """The raw draft logits ``l_1..l_depth``: the catch-up's ``n`` pairs (``features``, ``tokens``)
    through the fusion FC and the layers as one block at cache slot ``start`` under its flattened
    causal mask ``bias`` (empty for one pair; ``f_1`` is the block's last row), then ``f_k =
    layers(f_{k-1})`` a row at a time, then the norm and the draft LM head. ``rot``: the rotation
    of the block's positions, then the chain rows'."""
    n, hidden = features.shape
    pairs = np.empty((n, 2 * hidden), np.float32)
    pairs[:, :hidden] = features
    emb = np.empty((n, hidden), np.float32)
    intdot.dequantize_rows(embed[0], embed[1], embed[2], tokens, emb)
    pairs[:, hidden:] = emb
    x = np.empty((n, hidden), np.float32)
    _linear(pairs, fc[0], fc[1], fc[2], x, path)
    x = x + fc_b
    out = _one_span(x, rot[:n].copy(), fl, cache, start, bias, bias.size > 0, eps, shape, path)
    chain = np.empty((depth, hidden), np.float32)
    chain[0] = out[n - 1]
    none = np.zeros(0, np.float32)
    for level in range(1, depth):
        row = np.empty((1, hidden), np.float32)
        row[0] = chain[level - 1]
        chain[level] = _one_span(row, rot[n + level - 1 : n + level].copy(), fl, cache, start + n + level - 1, none,
                                 False, eps, shape, path)[0]
    h = np.empty((depth, hidden), np.float32)
    _rms_norm_kernel(chain, norm, eps, h)
    raw = np.empty((depth, lm[0].size // (hidden // 32)), np.float32)  # a scale per output row and block
    _linear(h, lm[0], lm[1], lm[2], raw, path)
    return raw


def _blocks(w: object, unpadded: bool = True) -> bool:
    """Whether ``w`` is on the integer kernel (and, for a matrix whose outputs are read, unpadded)."""
    return isinstance(w, QuantMatrix) and w.kernel == "int8" and (not unpadded or w.padded_rows == w.shape[0])


class CompiledChain:
    """A host head's round drafted by ``_chain_logits`` (see the module); ``of`` gives None for a
    head it cannot serve."""

    def __init__(self, head: ChainWeights, fused: FusedLayers):
        c = head.config
        self.inv_freq = head.inv_freq
        self.fl = (fused.attn_norms, fused.mlp_norms, fused.d, fused.m, fused.q)
        self.embed = (head.embed.d, head.embed.m, head.embed.q)
        self.fc = (head.fc_w.d, head.fc_w.m, head.fc_w.q)
        self.fc_b = np.ascontiguousarray(head.fc_b, np.float32)
        self.lm = (head.draft_lm_head.d, head.draft_lm_head.m, head.draft_lm_head.q)
        self.norm = np.ascontiguousarray(head.norm, np.float32)
        self.eps = np.float32(c.rms_norm_eps)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)

    @classmethod
    def of(cls, head: ChainWeights) -> "CompiledChain | None":
        fused = head._fused
        if fused is None or not _blocks(head.embed, unpadded=False) or not _blocks(head.fc_w) or not _blocks(head.draft_lm_head):
            return None
        return cls(head, fused)

    def draft(self, pc: PairContext, ctx: np.ndarray, depth: int) -> np.ndarray | None:
        """``ChainHead.draft`` in one call, or None where the catch-up is longer than one step."""
        pending = pc.reserve(ctx, depth)
        n = len(pending)
        if n > STEP_CATCH_UP or depth < 1:
            return None
        cache, start = pc.cache, pc.cache.length
        rot = rotation(self.inv_freq, np.concatenate([pending, len(ctx) + np.arange(depth - 1)]))
        # the catch-up's mask as the step-by-step path makes it (none for a lone root)
        bias = np.zeros(0, np.float32) if n == 1 else attention_bias(start, np.tril(np.ones((n, n), bool))).reshape(-1)
        with _launch:
            raw = _chain_logits(pc.features[pending - 1], ctx[pending], self.embed, self.fc, self.fc_b, self.fl,
                                (cache.k, cache.v), start, bias, rot, depth, self.norm, self.lm, self.eps, self.shape,
                                intdot.path_index())
        cache.length = pc.base = start + n
        pc.passes += depth
        return raw
