"""The draft heads on the target's torch device (the GPU path).

On a ``DeviceEngine`` a draft head runs where the target does: the catch-up over committed pairs,
the head's steps, and for ``lyanna`` the chain, the raw logits over the draft vocabulary and the
trees built from them stay on the device, and so does the choice of the round's nodes among the
candidates (``device_tree``): only the chosen tree (a few dozen token ids, parents and scores)
crosses to the host to become a ``DraftTree``. ``DeviceDraftHead`` gives ``PairContext``
its cache and ``fill`` and ``EagleDrafter`` the whole tree (``eagle_tree``); ``DeviceChainHead``
gives ``LyannaDrafter`` what ``lyanna.ChainHead`` does (``draft``, ``tree``, and ``draft_trees``, a
round's drafting in one call); the same numbers as the host heads up to floating-point rounding.

Token information is computed on the fly, ``TI(parent) = A[parent] @ B`` for the whole frontier
in one product: the hot-row table is a CPU optimization (a row read instead of a rank-r product),
while on a GPU the product is one small matmul. A ``TokenInfo`` with ``fallback == "none"`` still
gives cold parents no token information, as on the host.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..engines.device import (HANDOFF_BONUS, HANDOFF_COUNT, HANDOFF_TOKENS, KEY_BUCKET_MIN, DeviceTree, FixedShapeCall,
                              PendingPass, Slab, SlabPool, StaticCache, pow2_at_least)
from ..engines.torch_layers import DecoderLayer, PackedLayer, cached_layer, rms_norm, rotation
from ..errors import LyannaError
from .checkpoint import head_layer_count, layer_prefixes
from .device_tree import PaddedTrees, best, packed, union
from .head import PairContext
from .tree import DraftTree


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

    def __init__(self, head: "DeviceDraftHead", slab: Slab, rows: int, keys: int, pool: Any,
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

    def __init__(self, head: "DeviceChainHead", slab: Slab, rows: int, depth: int, keys: int, pool: Any,
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

    def __init__(self, head: "DeviceChainHead", slab: Slab, rows: int, depth: int, keys: int, resample: bool,
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
        if self.leftover is not None:
            self.levels[1:].copy_((self.last_depth - count - 1).clamp(0, self.depth).view(1, 1))
        return count, bonus, key

    def _forward(self) -> None:
        if self.handoff is not None:
            self._follow()
        super()._forward()
        h, depth = self.head, self.depth
        raw = self.raw[None] if self.leftover is None else torch.stack([self.raw, self.leftover])
        ids, parents, scores, depths = _grow(h, raw, self.root_info, self.topk, self.width, self.layout)
        origin = torch.arange(raw.shape[0], device=h.device)[:, None].expand_as(ids)  # the re-sampled tree: 1
        valid = depths <= self.levels
        if self.leftover is None:  # the best ``nodes`` of the best ``max_nodes`` (``nodes`` <= ``max_nodes``)
            self.tree = _packed_draft(h, ids, parents, scores, depths, origin, valid, self.nodes, depth, leveled=True)
            return
        kept = best(ids, parents, scores, depths, origin, valid, self.max_nodes, depth, joint=True, leveled=True)
        fused, valid = union(PaddedTrees(*(t[:1] for t in kept)), PaddedTrees(*(t[1:] for t in kept)), depth)
        self.tree = _packed_draft(h, *fused[:5], valid, self.nodes, depth, leveled=False)


class _EagleTreePass(_CatchUpCall):
    """EAGLE-2's tree growth at one fixed shape (``depth`` levels, ``topk`` children a node,
    ``width`` frontier nodes a level), after the catch-up: the root's top-k children, then per
    level the ``width`` best candidates by joint log-probability (a stable sort: ties to the
    earlier) through the head at once, each seeing the prefix, its ancestors' slots and its own,
    each expanded to its top-k. ``tree``: the best ``max_nodes`` of the candidates (in the host
    drafter's order), ``device_tree.packed``."""

    def __init__(self, head: "DeviceDraftHead", slab: Slab, rows: int, depth: int, topk: int, width: int,
                 max_nodes: int, keys: int, pool: Any, handoff: torch.Tensor | None = None):
        super().__init__(head, slab, rows, keys, pool, handoff)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        spec = max(depth - 1, 0) * width  # slots of speculative pairs: ``width`` a level after the first
        self._input("spec_slots", (spec,), torch.int64)
        self._input("spec_positions", (max(depth - 1, 1),), torch.int64)
        self._input("prefix", (keys,), torch.bool)  # the committed slots
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
                                torch.ones_like(tokens, dtype=torch.bool), self.max_nodes, self.depth, joint=True,
                                leveled=True))


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


def _grow(head: "DeviceChainHead", raw: torch.Tensor, root_info: torch.Tensor, topk: int, width: int,
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

    def __init__(self, head: "DeviceChainHead", depth: int, topk: int, width: int, max_nodes: int, pool: Any):
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
                                  torch.ones_like(ids, dtype=torch.bool), self.max_nodes, self.depth, leveled=True)


def _packed_draft(head: "DeviceChainHead", ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                  depths: torch.Tensor, origin: torch.Tensor, valid: torch.Tensor, nodes: int,
                  depth: int, leveled: bool) -> torch.Tensor:
    """The best ``nodes`` of token-info candidates (draft ids, joint probabilities), their ids
    mapped to the target's, as ``device_tree.packed`` (``leveled``: ``device_tree.best``'s)."""
    kept = best(ids, parents, scores, depths, origin, valid, nodes, depth, joint=True, leveled=leveled)
    return packed(kept._replace(tokens=head._d2t[kept.tokens]))


def _cut(max_nodes: int, nodes: int | None) -> int:
    """A call's node count: the drafter's ``max_nodes``, or a budget's fewer ``nodes``."""
    return max_nodes if nodes is None else min(nodes, max_nodes)


def _chosen(p: Any, depth: int, ahead: bool) -> DraftTree | DeviceTree:
    """Call ``p``'s chosen tree (``p.tree``: ``device_tree.packed``, no deeper than ``depth``) on
    the host, or (``ahead``) left on the device for the verification pass, with the call's timing."""
    if ahead:
        return DeviceTree(p.tree, (p.tree.shape[0] - 1) // 5, depth, p.timing)
    return DraftTree.from_packed(p.tree.cpu().numpy())


class DevicePairContext(PairContext):
    """``PairContext`` whose committed features stay on the device, in its head cache's slab
    (``Slab.features``, row ``i`` the feature after token ``i``, the row pair ``i + 1`` reads):
    a round verified in the target's pass hands over its kept rows' taps there, and the head's
    next catch-up reads them without a copy to the host and back."""

    @property
    def features(self) -> torch.Tensor:
        return self.cache.slab.features[: self._count]

    def commit(self, hidden: dict[int, Any]) -> None:
        """``hidden``: each tap's rows, on the host or on the device."""
        rows = self._features(hidden)
        need = self._count + rows.shape[0]
        self._room(need)
        self.cache.slab.features[self._count : need] = rows
        self._count = need

    def _features(self, hidden: dict[int, Any], rows: int | None = None) -> torch.Tensor:
        """The first ``rows`` (None: all) of each tap's rows as features on the device (fp32,
        several taps projected by ``taps_fc``)."""
        head = self.head
        taps = [torch.as_tensor(hidden[t])[:rows].to(head.device, torch.float32) for t in self.taps]
        return taps[0] if len(taps) == 1 else torch.cat(taps, dim=-1) @ head.taps_fc.T

    def _room(self, need: int) -> None:
        old = self.cache
        super()._room(need)
        if self.cache is not old:
            self.cache.slab.features[: self._count] = old.slab.features[: self._count]

    def hand_over(self, hidden: dict[int, Any], rows: int, need: int) -> None:
        """``commit`` of a round whose outcome the host has not read: its first ``rows`` kept rows
        (root and every level a path may reach; the rows past the path are overwritten later)
        written after the committed features, uncounted until ``settle``; ``need``: positions to
        make room for first."""
        self._room(need)
        self.cache.slab.features[self._count : self._count + rows] = self._features(hidden, rows)

    def settle(self, n: int) -> None:
        """Count ``n`` rows ``hand_over`` wrote, the head fed up to them (its draft followed the
        round on the device)."""
        self._count += n
        self.cache.length = self.base = self._count


class DeviceDraftHead:
    """The fusion layer and the head's decoder layers in torch, on the engine's device and in its
    dtype; the embedding and LM head are the engine's own tensors."""

    def __init__(self, engine, weights: dict[str, np.ndarray]):
        """``engine``: a ``DeviceEngine``; ``weights``: the checkpoint's tensors (host arrays)."""
        c = self.config = engine.config
        self.device, self.dtype = engine.device, engine.dtype
        fc_w = self._weight(weights, "fc.weight")
        if tuple(fc_w.shape) != (c.hidden_size, 2 * c.hidden_size):
            raise LyannaError(f"draft head fc.weight has shape {tuple(fc_w.shape)}, expected {(c.hidden_size, 2 * c.hidden_size)}")
        self.fc = torch.nn.Linear(2 * c.hidden_size, c.hidden_size)
        self.fc.load_state_dict({"weight": fc_w, "bias": self._weight(weights, "fc.bias")})
        self.fc.to(self.device, self.dtype).eval().requires_grad_(False)
        self.layers = []
        for prefix in layer_prefixes(head_layer_count(weights)):
            layer = DecoderLayer(c)
            layer.load_state_dict({k: self._weight(weights, prefix + k) for k in layer.state_dict()})
            layer.to(self.device, self.dtype).eval().requires_grad_(False)
            with torch.no_grad():
                self.layers.append(PackedLayer(layer, c))
        # Several taps' rows are projected to one feature as they are committed (fp32, as the host's).
        self.taps_fc = self._weight(weights, "taps_fc.weight").to(self.device) if "taps_fc.weight" in weights else None
        self._embed = engine._embed
        self._lm_head = engine._lm_head
        self._inv_freq = engine._inv_freq
        self._graph_pool = engine._graph_pool  # None: no graphs (CPU, or --no-cuda-graphs)
        # Each layer's keys and values a cache and the committed features, ``CATCH_UP_ROWS`` scratch
        # slots for a catch-up's padding.
        self._pool = SlabPool(len(self.layers), c, CATCH_UP_ROWS, HEAD_POOL_MIN, self.dtype, self.device,
                              features=c.hidden_size)
        self._eagles: dict[tuple[int, ...], _EagleTreePass] = {}

    @staticmethod
    def _weight(weights: dict[str, np.ndarray], name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(np.ascontiguousarray(weights[name], np.float32))
        except KeyError:
            raise LyannaError(f"draft head weight {name!r} is missing") from None

    def new_cache(self, capacity: int) -> StaticCache:
        """A head cache for ``capacity`` positions (``[1, kv heads, slots, head dim]``, the layout
        ``PairContext`` grows by copying slices), from the pool of caches no context holds."""
        return self._pool.cache(capacity)

    def context(self, taps: Sequence[int]) -> "DevicePairContext":
        """A new generation's view of the committed context, its features on the device."""
        return DevicePairContext(self, taps)

    def _rows(self, a: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Feature rows on the device in the head's dtype."""
        t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a, np.float32))
        return t.to(self.device, self.dtype)

    def rotation(self, positions: torch.Tensor | Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin for ``positions`` in the head's dtype."""
        if not isinstance(positions, torch.Tensor):
            positions = torch.as_tensor(np.asarray(positions, np.int64), device=self.device)
        return rotation(positions, self._inv_freq, self.dtype)

    def _fuse(self, features: np.ndarray | torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
        emb = self._embed[torch.as_tensor(np.asarray(tokens, np.int64), device=self.device)]
        return self.fc(torch.cat([self._rows(features), emb], dim=-1))

    def layer_at(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor | None, slab: Slab, keys: int) -> torch.Tensor:
        """The head's layers over rows ``x``: keys and values written at ``slots``, attention over
        the first ``keys`` slots under ``mask`` (None: all of them)."""
        for i, layer in enumerate(self.layers):
            x = cached_layer(layer, x, cos, sin, slab.k[i], slab.v[i], slots, mask, keys)
        return x

    @torch.inference_mode()
    def fill(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: StaticCache) -> None:
        """Append pairs as a full step would, the last layer's keys and values only (nobody reads
        their outputs): the layers below it run whole, each pair seeing those before it."""
        n = len(tokens)
        if not n:
            return
        x, (cos, sin) = self._fuse(features, tokens), self.rotation(positions)
        end = cache.length + n
        if len(self.layers) > 1:
            slots = torch.arange(cache.length, end, device=self.device)
            mask = torch.arange(end, device=self.device)[None, :] <= slots[:, None]
            for i, layer in enumerate(self.layers[:-1]):
                x = cached_layer(layer, x, cos, sin, cache.k[i], cache.v[i], slots, mask, end)
        last = self.layers[-1]
        _, k, v = last.qkv_rows(rms_norm(x, last.input_norm, last.eps), cos, sin)
        cache.k[-1, :, cache.length : end] = k
        cache.v[-1, :, cache.length : end] = v
        cache.length = end

    def _pending(self, pc: PairContext, ctx: np.ndarray, extra: int) -> np.ndarray:
        """The pairs a fixed-shape catch-up takes (at most ``CATCH_UP_ROWS``, the root last) after
        room is made for them and ``extra`` speculative rows; a new prompt's older pairs are
        filled first, step by step."""
        pending = pc.reserve(ctx, extra)
        if len(pending) > CATCH_UP_ROWS:
            old = pending[:-1]
            self.fill(pc.features[torch.as_tensor(old - 1, device=self.device)], ctx[old], old, pc.cache)
            pending = pending[-1:]
        return pending

    @torch.inference_mode()
    def eagle_tree(self, pc: PairContext, ctx: np.ndarray, depth: int, topk: int, width: int,
                   max_nodes: int, nodes: int | None = None, ahead: bool = False) -> DraftTree | DeviceTree:
        """``EagleDrafter.propose`` in one fixed-shape call (a CUDA graph on a GPU) per shape:
        the catch-up, then the tree's growth and its best ``max_nodes`` nodes (``nodes``, fewer:
        a fixed budget's) (``_EagleTreePass``), which cross to the host in one copy (``ahead``: are
        left on the device, ``DeviceTree``, for the verification pass). The context is left at
        its committed pairs."""
        k = min(topk, self.config.vocab_size)
        cut = _cut(max_nodes, nodes)
        spec = max(depth - 1, 0) * width  # speculative pairs' slots: ``width`` a level after the first

        def make(slab: Slab, rows: int, keys: int, base: int) -> _EagleTreePass:
            key = (id(slab), rows, depth, k, width, cut, keys)
            p = self._eagles.get(key)
            if p is None:
                p = self._eagles[key] = _EagleTreePass(self, slab, rows, depth, k, width, cut, keys, self._graph_pool)
            p.host("spec_slots")[:] = base + np.arange(spec)
            positions = p.host("spec_positions")
            positions[:], positions[: depth - 1] = 0, len(ctx) - 1 + np.arange(1, depth)
            p.host("prefix")[:] = np.arange(keys) < base
            return p

        p = self._catch_up_call(pc, ctx, width * depth + 1, spec, depth, make, timed=ahead)
        return _chosen(p, depth, ahead)

    @torch.inference_mode()
    def eagle_tree_after(self, pc: "DevicePairContext", pending: PendingPass, length: int, depth: int, topk: int,
                         width: int, max_nodes: int, nodes: int | None = None) -> DeviceTree | None:
        """``eagle_tree`` (left on the device) for the round after ``pending``, a target pass the
        host has not read, from what it left there (see ``DeviceChainHead.draft_trees_after``);
        None where the host must read the pass first."""
        slab = self._follow_room(pc, pending, length, width * depth + 1)
        if slab is None:
            return None
        k, cut, levels = min(topk, self.config.vocab_size), _cut(max_nodes, nodes), pending.levels
        keys = min(pow2_at_least(length + levels + max(depth - 1, 0) * width, KEY_BUCKET_MIN), slab.capacity)
        key = (id(slab), pow2_at_least(levels + 1), depth, k, width, cut, keys, id(pending.handoff))
        p = self._eagles.get(key)
        if p is None:
            p = self._eagles[key] = _EagleTreePass(self, slab, key[1], depth, k, width, cut, keys, self._graph_pool,
                                                   handoff=pending.handoff)
        p.host("length")[0] = length
        p.run_fixed(timed=True)
        pc.passes += depth
        return _chosen(p, depth, ahead=True)

    def _follow_room(self, pc: "DevicePairContext", pending: PendingPass, length: int, extra: int) -> Slab | None:
        """For a call after ``pending`` (the context ``length`` long before it): room for every
        pair the pass may have kept and ``extra`` rows after them, and its kept rows' features
        handed over (``DevicePairContext.hand_over``). None where no such call fits: more levels
        than a catch-up takes, or the head not fed up to that pass's root by the last draft."""
        levels = pending.levels
        if levels + 1 > CATCH_UP_ROWS or pc.cache.length != length - 1:
            return None
        pc.hand_over(pending.kept_hidden, levels + 1, length + levels + 1 + extra)
        return pc.cache.slab

    def _catch_up_call(self, pc: PairContext, ctx: np.ndarray, extra: int, span: int, depth: int, make,
                       timed: bool = False) -> Any:
        """Run the call ``make(slab, rows, keys, base)`` gives (one per shape, a CUDA graph on a GPU;
        it fills its own buffers past the catch-up) for this context: room for the pending pairs
        and ``extra`` speculative rows, the last ``CATCH_UP_ROWS`` pending pairs in the call (older
        ones filled first), attention over the committed pairs and ``span`` slots after them. The
        context is left at its committed pairs, ``depth`` head passes counted (``timed``: see
        ``FixedShapeCall.run_fixed``)."""
        pending = self._pending(pc, ctx, extra)
        cache = pc.cache
        slab, base = cache.slab, int(pending[-1])  # the root pair sits in slot base - 1
        rows, keys = pow2_at_least(len(pending)), min(pow2_at_least(base + span, KEY_BUCKET_MIN), slab.capacity)
        p = make(slab, rows, keys, base)
        p.load(ctx, pending)
        p.run_fixed(timed)
        cache.length = pc.base = base
        pc.passes += depth
        return p


class DeviceChainHead(DeviceDraftHead):
    """``DeviceDraftHead`` plus the chain's norm, the raw logits over the draft vocabulary (the
    engine's LM-head rows of ``d2t``) and token-info trees."""

    def __init__(self, engine, weights: dict[str, np.ndarray]):
        super().__init__(engine, weights)
        c = self.config
        self._norm = self._weight(weights, "norm.weight").to(self.device, self.dtype)
        d2t = np.asarray(weights["d2t"], np.int64)
        if d2t.ndim != 1 or d2t.size == 0 or np.unique(d2t).size != d2t.size or d2t.min() < 0 or d2t.max() >= c.vocab_size:
            raise LyannaError("draft vocabulary map d2t must list distinct target token ids")
        self.d2t = d2t
        self._d2t = torch.from_numpy(d2t).to(self.device)
        self._draft_lm_head = self._lm_head[self._d2t]
        # Token information in fp32 whatever the head's dtype: it shifts logits of order 1.
        self._ti_a = self._weight(weights, "ti.a").numpy()  # host rows: the roots' travel with a call's inputs
        self._ti_b = self._weight(weights, "ti.b").to(self.device)
        # ``A``'s rows of the draft vocabulary, zero where a parent gets no token information (a
        # cold parent under fallback "none"): what a tree's frontier reads. One tensor, refilled
        # in place for another ``TokenInfo``, so that captured trees read the current one.
        self.ti_rows = torch.zeros((d2t.size, self._ti_a.shape[1]), dtype=torch.float32, device=self.device)
        # The same over the whole vocabulary: a round drafted after a pass the host has not read
        # finds its root's row there (the root is that pass's bonus token).
        self.ti_full = torch.zeros(self._ti_a.shape, dtype=torch.float32, device=self.device)
        self._ti_of: Any = None
        self._informed: np.ndarray | None = None
        self._drafts: dict[tuple[int, int, int, int], _DraftPass] = {}
        self._draft_trees: dict[tuple, _DraftTreesPass] = {}
        self._trees: dict[tuple[int, int, int, int], _TreePass] = {}

    def _token_info(self, ti, root: int) -> np.ndarray:
        """``ti`` made current (``ti_rows``) and ``root``'s own ``A`` row ([rank], on the host:
        zero where it gets no token information)."""
        if self._ti_of is not ti:
            full = self._ti_a
            self._informed = None if ti.fallback == "lowrank" else ti.row_of >= 0  # None: every parent gets TI
            if self._informed is not None:
                full = full * self._informed[:, None]
            self.ti_full.copy_(torch.from_numpy(full))
            self.ti_rows.copy_(self.ti_full[self._d2t])
            self._ti_of = ti
        row = self._ti_a[root]
        return row if self._informed is None or self._informed[root] else np.zeros_like(row)

    def _drafted(self, pc: PairContext, ctx: np.ndarray, depth: int, make, timed: bool = False) -> _DraftPass:
        """Run the draft call ``make(slab, rows, keys)`` gives for this context's shape: the
        catch-up, the chain, the raw logits (``_catch_up_call``)."""
        def chained(slab: Slab, rows: int, keys: int, base: int) -> _DraftPass:
            p = make(slab, rows, keys)
            chain_slots = base + np.arange(depth - 1)
            p.host("chain_positions")[:] = chain_slots + 1
            p.host("chain_slots")[:] = chain_slots
            p.host("chain_mask")[:] = np.arange(keys)[None, :] <= chain_slots[:, None]
            return p

        return self._catch_up_call(pc, ctx, depth, depth, depth, chained, timed)

    @torch.inference_mode()
    def draft(self, pc: PairContext, ctx: np.ndarray, depth: int) -> torch.Tensor:
        """``ChainHead.draft`` at fixed shapes: the catch-up, the chain, the raw logits, in one
        call. The same numbers as the step-by-step path up to rounding."""
        def make(slab: Slab, rows: int, keys: int) -> _DraftPass:
            key = (id(slab), rows, depth, keys)
            if key not in self._drafts:
                self._drafts[key] = _DraftPass(self, slab, rows, depth, keys, self._graph_pool)
            return self._drafts[key]

        return self._drafted(pc, ctx, depth, make).raw.clone()

    @torch.inference_mode()
    def draft_trees(self, pc: PairContext, ctx: np.ndarray, depth: int, leftover: torch.Tensor | None, ti,
                    topk: int, width: int, max_nodes: int, nodes: int | None = None,
                    ahead: bool = False) -> tuple[torch.Tensor, DraftTree | DeviceTree]:
        """``ChainHead.draft_trees`` in one fixed-shape call (``_DraftTreesPass``): one launch and
        one copy to the host (the round's tree) a round, instead of three calls and two.
        ``nodes``: the round's tree is cut to its best ``nodes`` (a fixed budget's size, the same
        tree as cutting it on the host; None: ``max_nodes``). ``ahead``: the tree is left on the
        device (``DeviceTree``) for the verification pass, not copied."""
        if topk < 1 or width < 1:
            return self.draft(pc, ctx, depth), DraftTree.empty()
        k, resample = min(topk, self.d2t.size), leftover is not None
        cut = _cut(max_nodes, nodes)

        def make(slab: Slab, rows: int, keys: int) -> _DraftTreesPass:
            key = (id(slab), rows, depth, keys, resample, k, width, max_nodes, cut)
            p = self._draft_trees.get(key)
            if p is None:
                p = self._draft_trees[key] = _DraftTreesPass(self, slab, rows, depth, keys, resample, k, width,
                                                              max_nodes, cut, self._graph_pool)
            p.host("root_info")[:] = self._token_info(ti, int(ctx[-1]))
            p.host("levels")[:] = [[depth]] + ([[leftover.shape[0]]] if resample else [])
            if resample:
                p.leftover[: leftover.shape[0]].copy_(leftover)
            return p

        p = self._drafted(pc, ctx, depth, make, timed=ahead)
        return p.raw.clone(), _chosen(p, depth, ahead)

    @torch.inference_mode()
    def draft_trees_after(self, pc: "DevicePairContext", pending: PendingPass, length: int, chain: torch.Tensor,
                          depth: int, resample: bool, ti, topk: int, width: int, max_nodes: int,
                          nodes: int | None) -> tuple[torch.Tensor, DeviceTree] | None:
        """``draft_trees`` (left on the device) for the round after ``pending``, a target pass the
        host has not read, from what it left on the device: its kept rows' features handed over
        (``DevicePairContext.hand_over``), its accepted tokens and bonus token the pending pairs
        and root, the last draft's ``chain`` rows past them the leftover (``resample``). One call
        at a shape fixed by what the pass may have kept (a path through every level).
        ``length``: the context's length before that pass. None where no such call fits
        (``_follow_room``): the host reads the pass first."""
        slab = None if topk < 1 or width < 1 else self._follow_room(pc, pending, length, depth)
        if slab is None:
            return None
        k, cut, levels = min(topk, self.d2t.size), _cut(max_nodes, nodes), pending.levels
        rows, hand = pow2_at_least(levels + 1), pending.handoff
        keys = min(pow2_at_least(length + levels + depth, KEY_BUCKET_MIN), slab.capacity)
        key = (id(slab), rows, depth, keys, resample, k, width, max_nodes, cut, id(hand))
        p = self._draft_trees.get(key)
        if p is None:
            p = self._draft_trees[key] = _DraftTreesPass(self, slab, rows, depth, keys, resample, k, width, max_nodes,
                                                          cut, self._graph_pool, handoff=hand)
        self._token_info(ti, 0)  # the table current (the root's row is read on the device)
        p.host("length")[0], p.host("last_depth")[0] = length, chain.shape[0]
        p.host("levels")[:] = [[depth]] + ([[0]] if resample else [])  # the second: from the pass, on the device
        if resample:  # the chain's rows past the pass's kept tokens (clamped: those past the chain are not read)
            past = torch.arange(1, depth + 1, device=self.device) + hand[HANDOFF_COUNT]
            p.leftover.copy_(chain.index_select(0, past.clamp(max=chain.shape[0] - 1)))
        p.run_fixed(timed=True)
        pc.passes += depth
        return p.raw.clone(), _chosen(p, depth, ahead=True)

    @torch.inference_mode()
    def tree(self, raw: torch.Tensor, root: int, ti, topk: int, width: int, max_nodes: int, origin: int = 0) -> DraftTree:
        """``lyanna.token_info_tree`` on the device (``_TreePass``), at a fixed shape per (depth,
        top-k, width, nodes); its best ``max_nodes`` nodes cross to the host in one copy."""
        depth, v = raw.shape
        if depth == 0 or width < 1 or topk < 1:
            return DraftTree.empty()
        key = (depth, min(topk, v), width, max_nodes)
        p = self._trees.get(key)
        if p is None:
            p = self._trees[key] = _TreePass(self, *key, self._graph_pool)
        p.host("root_info")[:] = self._token_info(ti, int(root))
        p.host("origin")[:] = origin
        p.raw[0].copy_(raw)
        p.run_fixed()
        return _chosen(p, depth, ahead=False)
