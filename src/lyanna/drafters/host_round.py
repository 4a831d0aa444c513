"""A Lyanna round's drafting on the host head in one compiled call, on a GGUF's blocks: the draft
forward passes and the round's tree.

Why: a round's drafting is a handful of one- or two-row steps through a one-layer head (the
catch-up's fusion FC and layer, one layer a chain level, the draft logits), each a few tens of
microseconds of arithmetic, then a tree or two over the draft vocabulary; called one by one from
Python, the calls between them (argument checks, rotation tables, masks, span layouts, small
numpy operations, the trees' selection and fusion) cost about as much again as the arithmetic,
on every drafting round, and the more so as the target's pass leaves the interpreter's own data
cold. ``_chain_logits`` runs the same compiled kernels in the same order (the embedding's
dequantizer, the integer linear kernel, ``fused._layers``, the RMSNorm kernel), so every row gets
exactly the bits the step-by-step path gives it, and ``_round`` adds the same tree builder
(``token_info.round_tree``), so the round's tree is the step-by-step path's (``test_lyanna.py``).

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
from ..engines.kernels import SameTypes, _launch, _rms_norm_kernel
from ..engines.quant import QuantMatrix
from ..engines.transformer import Rotations, Weight
from .head import STEP_CATCH_UP, PairContext
from .token_info import TokenInfo, round_tree
from .tree import DraftTree


class ChainWeights(Protocol):
    """What ``CompiledChain`` reads of its head (``lyanna.ChainHead``): stated here so that this
    module need not import ``lyanna``, which imports it."""

    config: ModelConfig
    rotations: Rotations
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
def _catch_up_mask(start, n):  # pragma: no cover - compiled
    """The catch-up block's flattened additive mask (``transformer.attention_bias`` of a causal
    block at ``start``): empty for one pair, which needs none."""
    if n == 1:
        return np.zeros(0, np.float32)
    bias = np.zeros((n, start + n), np.float32)
    for i in range(n):
        bias[i, start + i + 1 :] = -np.inf
    return bias.reshape(-1)


@njit(nogil=True, cache=True)
def _chain_logits(features, tokens, embed, fc, fc_b, fl, cache, start, rot, depth, norm, lm, eps, shape,
                  path):  # pragma: no cover - compiled
    """The raw draft logits ``l_1..l_depth``: the catch-up's ``n`` pairs (``features``, ``tokens``)
    through the fusion FC and the layers as one causal block at cache slot ``start`` (``f_1`` is
    the block's last row), then ``f_k = layers(f_{k-1})`` a row at a time, then the norm and the
    draft LM head. ``rot``: the rotation of the block's positions, then the chain rows'."""
    n, hidden = features.shape
    bias = _catch_up_mask(start, n)
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
    # "masked" as a run-time bool (always false), not the literal False: numba compiles a callee
    # again for each literal it is given, and ``_one_span`` with the layers in it takes long
    unmasked = none.size > 0
    for level in range(1, depth):
        row = np.empty((1, hidden), np.float32)
        row[0] = chain[level - 1]
        chain[level] = _one_span(row, rot[n + level - 1 : n + level].copy(), fl, cache, start + n + level - 1, none,
                                 unmasked, eps, shape, path)[0]
    h = np.empty((depth, hidden), np.float32)
    _rms_norm_kernel(chain, norm, eps, h)
    raw = np.empty((depth, lm[0].size // (hidden // 32)), np.float32)  # a scale per output row and block
    _linear(h, lm[0], lm[1], lm[2], raw, path)
    return raw


@njit(cache=True)  # not nogil: the tree writes new cold rows into the token-info table every fork shares
def _round(features, tokens, embed, fc, fc_b, fl, cache, start, rot, depth, norm, lm, eps, shape, path, leftover, table,
           row_of, filled, a, b, lowrank, d2t, topk, width, max_nodes):  # pragma: no cover - compiled
    """A round's drafting: ``_chain_logits``' raw rows and ``token_info.round_tree`` of them (with
    the ``leftover`` rows of the last chain), rooted at the catch-up's last token."""
    raw = _chain_logits(features, tokens, embed, fc, fc_b, fl, cache, start, rot, depth, norm, lm, eps, shape, path)
    return raw, round_tree(raw, leftover, tokens[-1], table, row_of, filled, a, b, lowrank, d2t, topk, width, max_nodes)


def _blocks(w: object, unpadded: bool = True) -> bool:
    """Whether ``w`` is on the integer kernel (and, for a matrix whose outputs are read, unpadded)."""
    return isinstance(w, QuantMatrix) and w.kernel == "int8" and (not unpadded or w.padded_rows == w.shape[0])


class CompiledChain:
    """A host head's round drafted by ``_round``, or its raw rows alone by ``_chain_logits`` (see
    the module); ``of`` gives None for a head it cannot serve."""

    def __init__(self, head: ChainWeights, fused: FusedLayers):
        c = head.config
        self.rotations = head.rotations
        self.fl = (fused.attn_norms, fused.mlp_norms, fused.d, fused.m, fused.q)
        self.embed = (head.embed.d, head.embed.m, head.embed.q)
        self.fc = (head.fc_w.d, head.fc_w.m, head.fc_w.q)
        self.fc_b = np.ascontiguousarray(head.fc_b, np.float32)
        self.lm = (head.draft_lm_head.d, head.draft_lm_head.m, head.draft_lm_head.q)
        self.norm = np.ascontiguousarray(head.norm, np.float32)
        self.eps = np.float32(c.rms_norm_eps)
        self.shape = (c.num_heads, c.num_kv_heads, c.head_dim)
        self._no_rows = np.zeros((0, head.draft_lm_head.shape[0]), np.float32)  # a round without leftover rows
        # the arguments' types never change for a head (``_pending`` makes them so)
        self._chain, self._round = SameTypes(_chain_logits), SameTypes(_round)

    @classmethod
    def of(cls, head: ChainWeights) -> "CompiledChain | None":
        fused = head._fused
        if fused is None or not _blocks(head.embed, unpadded=False) or not _blocks(head.fc_w) or not _blocks(head.draft_lm_head):
            return None
        return cls(head, fused)

    def _pending(self, pc: PairContext, ctx: np.ndarray, depth: int) -> tuple | None:
        """The chain's arguments after the context's catch-up pairs (reserved in its cache), or
        None where the catch-up is longer than one step."""
        pending = pc.reserve(ctx, depth)
        if len(pending) > STEP_CATCH_UP or depth < 1:
            return None
        cache = pc.cache
        rot = self.rotations(np.concatenate([pending, len(ctx) + np.arange(depth - 1)]))
        return (pc.features[pending - 1], np.ascontiguousarray(ctx[pending], np.int64), self.embed, self.fc, self.fc_b,
                self.fl, (cache.k, cache.v), int(cache.length), rot, int(depth), self.norm, self.lm, self.eps, self.shape,
                intdot.path_index())

    @staticmethod
    def _drafted(pc: PairContext, ctx: np.ndarray, depth: int) -> None:
        """The context after a draft: its catch-up pairs (every pair of ``ctx``) committed to the
        cache, the chain's rows not."""
        pc.cache.length = pc.base = len(ctx) - 1
        pc.passes += depth

    def draft(self, pc: PairContext, ctx: np.ndarray, depth: int) -> np.ndarray | None:
        """``ChainHead.draft`` in one call, or None where the catch-up is longer than one step."""
        args = self._pending(pc, ctx, depth)
        if args is None:
            return None
        with _launch:
            raw = self._chain(*args)
        self._drafted(pc, ctx, depth)
        return raw

    def draft_trees(self, pc: PairContext, ctx: np.ndarray, depth: int, leftover: np.ndarray | None, ti: TokenInfo,
                    d2t: np.ndarray, topk: int, width: int,
                    max_nodes: int) -> tuple[np.ndarray, DraftTree] | None:
        """``ChainHead.draft_trees`` in one call (the chain's raw rows and the round's tree), or None
        where the catch-up is longer than one step."""
        args = self._pending(pc, ctx, depth)
        if args is None:
            return None
        rows = self._no_rows if leftover is None else np.ascontiguousarray(leftover, np.float32)
        with _launch:
            raw, tree = self._round(*args, rows, *ti.kernel_args(), d2t, int(topk), int(width), int(max_nodes))
        self._drafted(pc, ctx, depth)
        return raw, ti.tree(*tree)
