"""The draft heads' calls on the device at fixed shapes (each one CUDA graph where graphs are on):
a catch-up over committed pairs (``_CatchUpCall``), a chain of head steps (``_DraftPass``), a
round's drafting in one call, chain and token-info trees (``_DraftTreesPass``), EAGLE's tree
(``_EagleTreePass``) and a token-info tree alone (``_TreePass``). The heads that make and run them
are in ``drafters.device``.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..engines.config import ModelConfig
from ..engines.device_slabs import HANDOFF_BONUS, HANDOFF_COUNT, HANDOFF_TOKENS, FixedShapeCall, Slab
from ..engines.torch_layers import LayerHalves, rms_norm
from .device_tree import PaddedTrees, best, packed, packed_rows, union


class CallHead(Protocol):
    """What a call reads of its head (``drafters.device.DeviceDraftHead``): stated here so that
    this module need not import the heads, which import it."""

    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    fc: torch.nn.Linear
    _embed: torch.Tensor
    _lm_head: torch.Tensor

    def rotation(self, positions: torch.Tensor | Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...

    def layer_at(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor | None, slab: Slab, keys: int) -> torch.Tensor: ...


class ChainCallHead(CallHead, Protocol):
    """What a Lyanna call reads besides (``drafters.device.DeviceChainHead``): the draft
    vocabulary and its LM head, the final norm and the token-info tables."""

    d2t: np.ndarray
    _d2t: torch.Tensor
    _draft_lm_head: torch.Tensor
    _norm: torch.Tensor
    _ti_b: torch.Tensor
    ti_full: torch.Tensor
    ti_rows: torch.Tensor
    _halves: LayerHalves  # the layers compiled or not: the tree's code follows


# Committed pairs one fixed-shape catch-up takes (the root and the tokens accepted since the last
# draft: at most the deepest tree's depth plus one); more (a new prompt's) are filled first.
CATCH_UP_ROWS = 8
# Head caches are pooled by capacity rounded up to a power of two from this (``PairContext``
# starts at 1,024 positions and doubles).
HEAD_POOL_MIN = 1024


class _CatchUpCall(FixedShapeCall):
    """A head's call that starts with a fixed-shape catch-up on one head-cache slab: ``rows``
    pending pairs (the root last, padding after it) through the head's layer, attention over
    ``keys`` slots under host-built masks, each pair's feature read from the slab's committed
    features (``DevicePairContext``); ``_root`` gives the head's prediction after the root.
    ``handoff``: the call follows a target pass the host has not read (``engines.device.
    PendingPass``) and forms its inputs from what that pass left there (``_follow``)."""

    def __init__(self, head: CallHead, slab: Slab, rows: int, keys: int, pool: Any,
                 handoff: torch.Tensor | None = None):
        super().__init__(head.device, pool)
        self.head, self.slab, self.keys, self.rows = head, slab, keys, rows
        for name in ("features", "tokens", "positions", "slots"):  # ``features``: rows of ``slab.features``
            self._input(name, (rows,), torch.int64)
        self._input("mask", (rows, keys), torch.bool)
        self._input("root", (1,), torch.int64)
        self.handoff = handoff
        if handoff is not None:
            self._input("length", (1,), torch.int64)  # the context's length before the pass followed

    def _follow(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``load``'s inputs as the host would give them once the pass followed is read: its
        ``count`` accepted tokens and bonus token are the pending pairs after the context's
        ``length`` (their features handed over already, ``DevicePairContext.hand_over``), the
        bonus token the root. Returns ``count``, the bonus token and the key slots' indices."""
        rows, dev = self.rows, self.device
        hand, cap = self.handoff, self.slab.capacity
        count, bonus = hand[HANDOFF_COUNT : HANDOFF_COUNT + 1], hand[HANDOFF_BONUS : HANDOFF_BONUS + 1]
        i = torch.arange(rows, device=dev)
        live = i <= count  # the path's tokens and the bonus token; padding after
        pair = self.length + i
        key = torch.arange(self.keys, device=dev)
        self.features.copy_(torch.where(live, pair - 1, cap))
        self.tokens.copy_(torch.where(live, hand[HANDOFF_TOKENS : HANDOFF_TOKENS + rows], 0))
        self.positions.copy_(torch.where(live, pair, 0))
        self.slots.copy_(torch.where(live, pair - 1, cap + i - count - 1))
        self.mask.copy_(torch.where(live[:, None], key[None, :] < pair[:, None], (key == 0)[None, :]))
        self.root.copy_(count)
        return count, bonus, key

    def load(self, ctx: np.ndarray, pending: np.ndarray) -> None:
        """The pending pairs' inputs (pair ``p``: the feature after token ``p - 1`` and token
        ``p``, at position ``p``, in slot ``p - 1``, seeing its own slot and those before)."""
        n = len(pending)
        mask = self.host("mask")
        mask[:n] = np.arange(self.keys)[None, :] <= (pending - 1)[:, None]
        mask[n:] = False
        mask[n:, 0] = True  # padding rows read slot 0 and are dropped
        feats, tokens, positions, slots = (self.host(name) for name in ("features", "tokens", "positions", "slots"))
        feats[:n], feats[n:] = pending - 1, self.slab.capacity  # a scratch row (zeros) for padding
        tokens[:n], tokens[n:] = ctx[pending], 0
        positions[:n], positions[n:] = pending, 0
        slots[:n], slots[n:] = pending - 1, self.slab.capacity + np.arange(self.rows - n)
        self.host("root")[0] = n - 1

    def _root(self, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``rot``: RoPE's (cos, sin) whose first rows are the pending pairs' (None: made here)."""
        h, n = self.head, self.rows
        cos, sin = h.rotation(self.positions) if rot is None else (rot[0][:n], rot[1][:n])
        x = h.fc(torch.cat([self.slab.features[self.features].to(h.dtype), h._embed[self.tokens]], dim=-1))
        return h.layer_at(x, cos, sin, self.slots, self.mask, self.slab, self.keys).index_select(0, self.root)


class _DraftPass(_CatchUpCall):
    """Lyanna's draft at one fixed shape: the catch-up, ``depth - 1`` chain steps, the raw logits.
    Captured as one CUDA graph where the engine captures its own."""

    def __init__(self, head: ChainCallHead, slab: Slab, rows: int, depth: int, keys: int, pool: Any,
                 handoff: torch.Tensor | None = None):
        super().__init__(head, slab, rows, keys, pool, handoff)
        self.depth = depth
        self._input("chain_positions", (depth - 1,), torch.int64)
        self._input("chain_slots", (depth - 1,), torch.int64)
        self._input("chain_mask", (depth - 1, keys), torch.bool)
        self.raw: torch.Tensor | None = None

    def _forward(self) -> None:
        h, n = self.head, self.rows
        cos, sin = h.rotation(torch.cat([self.positions, self.chain_positions]))  # one RoPE for every row
        f = self._root((cos, sin))
        features = [f]
        for j in range(self.depth - 1):
            f = h.layer_at(f, cos[n + j : n + j + 1], sin[n + j : n + j + 1], self.chain_slots[j : j + 1],
                           self.chain_mask[j : j + 1], self.slab, self.keys)
            features.append(f)
        self.raw = (rms_norm(torch.cat(features), h._norm, h.config.rms_norm_eps) @ h._draft_lm_head.T).float()


class _DraftTreesPass(_DraftPass):
    """A round of lyanna's drafting in one call: ``_DraftPass``, then the tree of its raw logits
    and, with ``resample`` (the last chain's rows still valid, in ``leftover``'s first rows, their
    count in ``levels``), the tree re-sampled from them, both under the same root, grown together
    (``_grow``) and fused (``device_tree.union``), each tree cut to ``max_nodes`` before: ``tree``,
    the round's best ``nodes`` (``device_tree.packed``). Following a pass (``handoff``), the
    chain, its root's token information and the re-sampled tree's levels come from it too."""

    def __init__(self, head: ChainCallHead, slab: Slab, rows: int, depth: int, keys: int, resample: bool,
                 topk: int, width: int, max_nodes: int, nodes: int, pool: Any, handoff: torch.Tensor | None = None):
        super().__init__(head, slab, rows, depth, keys, pool, handoff)
        self.topk, self.width, self.max_nodes, self.nodes = topk, width, max_nodes, nodes
        self.layout = _grow_layout(depth, topk, width, head.device)
        trees = 2 if resample else 1
        self.leftover = torch.zeros((depth, head.d2t.size), dtype=torch.float32, device=head.device) if resample else None
        self._input("root_info", (trees, 1, head._ti_b.shape[0]), torch.float32)
        self._input("levels", (trees, 1), torch.int64)  # each tree's levels of valid rows
        if handoff is not None:
            self._input("last_depth", (1,), torch.int64)  # the chain rows the last draft left
        self.tree: torch.Tensor | None = None

    def _follow(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up's inputs, then the chain's after its root, the root's token information,
        and the leftover rows' levels: those of the last chain past the pass's kept tokens."""
        count, bonus, key = super()._follow()
        h, dev = self.head, self.device
        chain = self.length + count + torch.arange(self.depth - 1, device=dev)  # after the root pair's slot
        self.chain_slots.copy_(chain)
        self.chain_positions.copy_(chain + 1)
        self.chain_mask.copy_(key[None, :] <= chain[:, None])
        self.root_info.copy_(h.ti_full[bonus].expand_as(self.root_info))
        if self.leftover is not None:  # no deeper than the chain's own tree (``levels[0]``)
            left = (self.last_depth - count - 1).clamp(0, self.depth).view(1, 1)
            self.levels[1:].copy_(torch.minimum(left, self.levels[:1]))
        return count, bonus, key

    def _forward(self) -> None:
        if self.handoff is not None:
            self._follow()
        super()._forward()
        raw = self.raw[None] if self.leftover is None else torch.stack([self.raw, self.leftover])
        self.tree = _tree_tail(self.head)(self.head, raw[None], self.root_info[None], self.levels[None], self.topk,
                                          self.width, self.layout, self.max_nodes, self.nodes, self.depth)[0]


class _EagleTreePass(_CatchUpCall):
    """EAGLE-2's tree growth at one fixed shape (``depth`` levels, ``topk`` children a node,
    ``width`` frontier nodes a level), after the catch-up: the root's top-k children, then per
    level the ``width`` best candidates by joint log-probability (a stable sort: ties to the
    earlier) through the head at once, each seeing the prefix, its ancestors' slots and its own,
    each expanded to its top-k. ``tree``: the best ``max_nodes`` of the candidates (in the host
    drafter's order), ``device_tree.packed``."""

    def __init__(self, head: CallHead, slab: Slab, rows: int, depth: int, topk: int, width: int,
                 max_nodes: int, keys: int, pool: Any, handoff: torch.Tensor | None = None):
        super().__init__(head, slab, rows, keys, pool, handoff)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        spec = max(depth - 1, 0) * width  # slots of speculative pairs: ``width`` a level after the first
        self._input("spec_slots", (spec,), torch.int64)
        self._input("spec_positions", (max(depth - 1, 1),), torch.int64)
        self._input("prefix", (keys,), torch.bool)  # the committed slots
        self._input("levels", (1,), torch.int64)  # no node deeper is chosen: a call as deep as the room allows
        self.tree: torch.Tensor | None = None

    def _follow(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up's inputs, then the speculative pairs' slots and positions after the root
        pair and the committed slots before them."""
        count, bonus, key = super()._follow()
        dev, base = self.device, self.length + count  # the root pair's position
        self.spec_slots.copy_(base + torch.arange(self.spec_slots.shape[0], device=dev))
        at = torch.arange(self.spec_positions.shape[0], device=dev)
        self.spec_positions.copy_(torch.where(at < self.depth - 1, base + 1 + at, 0))
        self.prefix.copy_(key < base)
        return count, bonus, key

    def _forward(self) -> None:
        if self.handoff is not None:
            self._follow()
        h, k, w, dev = self.head, self.topk, self.width, self.device
        spec = self.spec_slots.shape[0]
        rows = self.rows
        cos, sin = h.rotation(torch.cat([self.positions, self.spec_positions]))  # one RoPE for every row
        pred = self._root((cos, sin))  # [1, H]: the feature predicted after the root
        top_v, top_i = torch.topk(torch.log_softmax((pred @ h._lm_head.T).float(), dim=-1), k, dim=-1)
        c_tok, c_score = top_i.reshape(-1), top_v.double().reshape(-1)
        c_src = torch.zeros(k, dtype=torch.int64, device=dev)  # row of ``pred`` / ``anc`` of each candidate's parent
        c_global = torch.arange(k, device=dev)
        anc = torch.zeros((1, spec), dtype=torch.bool, device=dev)  # speculative slots each row's pair sees
        tokens, parents, scores = [c_tok], [torch.full((k,), -1, dtype=torch.int64, device=dev)], [c_score]
        depths = [torch.ones_like(c_tok)]
        n = k
        for d in range(2, self.depth + 1):
            fw = min(w, c_tok.shape[0])
            order = torch.sort(c_score, descending=True, stable=True).indices[:fw]
            own = (d - 2) * w + torch.arange(fw, device=dev)
            # Each row also sees its own slot. No ``t[i, j] = True``: a Python scalar becomes a
            # host tensor copied to the device, which a CUDA graph cannot capture.
            rows_anc = anc[c_src[order]] | (torch.arange(spec, device=dev)[None, :] == own[:, None])
            mask = self.prefix[None, :].expand(fw, -1).clone()
            mask[:, self.spec_slots] = rows_anc
            x = h.fc(torch.cat([pred[c_src[order]], h._embed[c_tok[order]]], dim=-1))
            at = rows + d - 2  # this level's position
            pred = h.layer_at(x, cos[at : at + 1].expand(fw, -1), sin[at : at + 1].expand(fw, -1), self.spec_slots[own],
                              mask, self.slab, self.keys)
            top_v, top_i = torch.topk(torch.log_softmax((pred @ h._lm_head.T).float(), dim=-1), k, dim=-1)
            c_tok, c_score = top_i.reshape(-1), (c_score[order][:, None] + top_v.double()).reshape(-1)
            tokens.append(c_tok)
            parents.append(c_global[order].repeat_interleave(k))
            scores.append(c_score)
            depths.append(torch.full_like(c_tok, d))
            c_src, anc = torch.arange(fw, device=dev).repeat_interleave(k), rows_anc
            c_global = n + torch.arange(fw * k, device=dev)
            n += fw * k
        tokens, parents, depths = (torch.cat(t)[None] for t in (tokens, parents, depths))
        self.tree = packed(best(tokens, parents, torch.cat(scores)[None].exp(), depths, torch.zeros_like(tokens),
                                depths <= self.levels, self.max_nodes, self.depth, joint=True, leveled=True))


def _round_tree(h: ChainCallHead, raw: torch.Tensor, root_info: torch.Tensor, levels: torch.Tensor, topk: int,
                width: int, layout: tuple[torch.Tensor, ...], max_nodes: int, nodes: int, depth: int) -> torch.Tensor:
    """Each sequence's round tree from its raw logits (``raw`` [seqs, trees, depth, draft vocab]:
    the chain's, and the re-sampled rows' as a second tree; ``levels`` [seqs, trees, 1]: each
    tree's valid levels; ``root_info`` [seqs, trees, 1, rank]): grown (``_grow``), each cut to its
    best ``max_nodes``, fused (``device_tree.union``), the best ``nodes`` packed, a row a sequence."""
    seqs, trees = raw.shape[:2]
    ids, parents, scores, depths = _grow(h, raw.flatten(0, 1), root_info.flatten(0, 1), topk, width, layout)
    origin = torch.arange(trees, device=raw.device).repeat(seqs)[:, None].expand_as(ids)  # a re-sampled tree: 1
    valid = depths <= levels.flatten(0, 1)
    if trees == 1:  # the best ``nodes`` of the best ``max_nodes`` (``nodes`` <= ``max_nodes``)
        return _packed_draft(h, ids, parents, scores, depths, origin, valid, nodes, depth, leveled=True)
    kept = best(ids, parents, scores, depths, origin, valid, max_nodes, depth, joint=True, leveled=True)
    fused, valid = union(PaddedTrees(*(t[0::2] for t in kept)), PaddedTrees(*(t[1::2] for t in kept)), depth)
    return _packed_draft(h, *fused[:5], valid, nodes, depth, leveled=False)


_COMPILED_ROUND_TREE: list[Any] = []  # torch.compile of _round_tree, made on first use


def _tree_tail(h: ChainCallHead) -> Any:
    """``_round_tree`` as the head runs its layers: through ``torch.compile`` where those are
    (on a GPU the tree's growth, choice and union are a hundred small kernels eagerly; fused,
    fewer; the same rules, so the same tokens), else as it is."""
    if not h._halves.compiled:
        return _round_tree
    if not _COMPILED_ROUND_TREE:
        _COMPILED_ROUND_TREE.append(torch.compile(_round_tree, fullgraph=True))
    return _COMPILED_ROUND_TREE[0]


def _grow_layout(depth: int, topk: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What the places of ``_grow``'s candidates fix before any score is known, made once per
    call shape (a captured graph allocates nothing): the root's parent (-1, ``[1, 1]``), the first
    candidate index of each frontier entry's level (0 for the root; ``[1, 1 + frontier entries]``)
    and every candidate's depth (``[1, n]``)."""
    at, depths, start, frontier = [0], [], 0, 1
    for d in range(depth):
        n = frontier * topk  # the level's candidates: each frontier entry's top-k children
        depths += [d + 1] * n
        if d + 1 < depth:
            frontier = min(width, n)
            at += [start] * frontier
        start += n
    return (torch.full((1, 1), -1, dtype=torch.int64, device=device), torch.tensor([at], device=device),
            torch.tensor([depths], device=device))


def _grow(head: ChainCallHead, raw: torch.Tensor, root_info: torch.Tensor, topk: int, width: int,
          layout: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-info trees' candidates, several trees at once (one kernel per step for all of them):
    ``raw`` [trees, depth, draft vocab], ``root_info`` [trees, 1, rank] (each root's ``A`` row,
    zero where it gets no token information), ``layout`` from ``_grow_layout``. Per depth, each
    frontier branch's top-k children under ``log_softmax(raw[d] + TI(parent))``; the ``width``
    best by joint log-probability (a stable sort: ties to the earlier child) form the next
    frontier, whose ``TI`` is read from ``head.ti_rows`` (the draft vocabulary's ``A`` rows).
    ``[trees, n]`` per tree, every level's candidates in order (the host builder's): draft ids,
    parents (indices among the candidates, -1 under the root), joint probabilities (float64) and
    depths. Parents and depths are formed once after the levels: fewer kernels a call."""
    trees, depth, _ = raw.shape
    root, level_start, depths = layout
    a, f_score = root_info, None
    ids, scores, frontiers = [], [], [root.expand(trees, 1)]  # frontiers: each level's, by place in its level
    for d in range(depth):
        x = raw[:, d, None, :] + a @ head._ti_b  # [trees, frontier, vocab]
        top_v, top_i = torch.topk(x, topk, dim=-1)
        step = top_v - torch.logsumexp(x, dim=-1, keepdim=True)
        s = (step.double() if f_score is None else f_score[:, :, None] + step).reshape(trees, -1)  # float64
        ids.append(top_i.reshape(trees, -1))
        scores.append(s)
        if d + 1 < depth:
            f_score, order = torch.sort(s, dim=-1, descending=True, stable=True)
            f_score, order = f_score[:, :width], order[:, :width]
            a = head.ti_rows[ids[-1].gather(1, order)]
            frontiers.append(order)
    parents = (torch.cat(frontiers, 1) + level_start).repeat_interleave(topk, dim=1)
    return torch.cat(ids, 1), parents, torch.cat(scores, 1).exp(), depths.expand(trees, -1)


class _TreePass(FixedShapeCall):
    """A token-info tree at one fixed shape (``depth`` rows of raw logits, ``topk`` children a
    branch, ``width`` branches a depth; ``_grow``): ``tree``, its best ``max_nodes`` candidates
    (``device_tree.packed``), of origin ``origin``."""

    def __init__(self, head: ChainCallHead, depth: int, topk: int, width: int, max_nodes: int, pool: Any):
        super().__init__(head.device, pool)
        self.head, self.depth, self.topk, self.width, self.max_nodes = head, depth, topk, width, max_nodes
        self.layout = _grow_layout(depth, topk, width, head.device)
        self.raw = torch.zeros((1, depth, head.d2t.size), dtype=torch.float32, device=head.device)
        self._input("root_info", (1, 1, head._ti_b.shape[0]), torch.float32)
        self._input("origin", (1, 1), torch.int64)
        self.tree: torch.Tensor | None = None

    def _forward(self) -> None:
        ids, parents, scores, depths = _grow(self.head, self.raw, self.root_info, self.topk, self.width, self.layout)
        self.tree = _packed_draft(self.head, ids, parents, scores, depths, self.origin.expand_as(ids),
                                  torch.ones_like(ids, dtype=torch.bool), self.max_nodes, self.depth, leveled=True)[0]


def _packed_draft(head: ChainCallHead, ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                  depths: torch.Tensor, origin: torch.Tensor, valid: torch.Tensor, nodes: int,
                  depth: int, leveled: bool) -> torch.Tensor:
    """Each tree's best ``nodes`` of token-info candidates (draft ids, joint probabilities), their
    ids mapped to the target's, as ``device_tree.packed_rows`` (``leveled``: ``device_tree.best``'s)."""
    kept = best(ids, parents, scores, depths, origin, valid, nodes, depth, joint=True, leveled=leveled)
    return packed_rows(kept._replace(tokens=head._d2t[kept.tokens]))
