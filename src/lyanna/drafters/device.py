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

from ..engines.base import shapes_compile
from ..engines.device_passes import PendingPass
from ..engines.device_slabs import (HANDOFF_COUNT, KEY_BUCKET_MIN, DeviceTree, Slab, SlabPool, StaticCache,
                                    pow2_at_least)
from ..engines.torch_layers import DecoderLayer, PackedLayer, cached_layer, rms_norm, rotation
from ..errors import LyannaError
from .checkpoint import head_layer_count, layer_prefixes
from .device_calls import CATCH_UP_ROWS, HEAD_POOL_MIN, _DraftPass, _DraftTreesPass, _EagleTreePass, _TreePass
from .device_rows import HeadRows
from .head import PairContext
from .tree import DraftTree


def _cut(max_nodes: int, nodes: int | None) -> int:
    """A call's node count: the drafter's ``max_nodes``, or a budget's fewer ``nodes``."""
    return max_nodes if nodes is None else min(nodes, max_nodes)


def _chosen(p: Any, depth: int, ahead: bool) -> DraftTree | DeviceTree:
    """Call ``p``'s chosen tree (``p.tree``: ``device_tree.packed``, no deeper than ``depth``) on
    the host, or (``ahead``) left on the device for the verification pass, with the call's timing."""
    if ahead:
        return DeviceTree(p.tree, (p.tree.shape[0] - 1) // 5, depth, p.timing)
    return DraftTree.from_packed(p.tree.cpu().numpy())


def _deferred(p: Any, depth: int, keep: tuple[tuple[str, torch.Tensor], ...] = ()) -> DeviceTree:
    """Call ``p``'s tree (as ``_chosen`` leaves it on the device) with ``p`` not run again yet:
    the verification pass runs it joined with its own (``DeviceTree.deferred``), then copies
    what the drafter ``keep``s of its outputs. ``p`` has run before: its tree's shape is known."""
    return DeviceTree(p.tree, (p.tree.shape[0] - 1) // 5, depth, None, p, keep)


class DevicePairContext(PairContext):
    """``PairContext`` whose committed features stay on the device, in its head cache's slab
    (``Slab.features``, row ``i`` the feature after token ``i``, the row pair ``i + 1`` reads):
    a round verified in the target's pass hands over its kept rows' taps there, and the head's
    next catch-up reads them without a copy to the host and back."""

    @property
    def features(self) -> torch.Tensor:
        return self.cache.slab.features[: self._count]

    def start(self, hidden: dict[int, Any]) -> None:
        """A new generation, on a free row of the head's ``rows`` where it has one (a context
        takes a row when it starts, not when made: a drafter that never generates holds none)."""
        rows = self.head.rows
        if rows is not None and self.cache.slab.row is None:
            row = rows.cache(1)  # a prompt longer than a row moves the context to a cache of its own
            if row is not None:
                self.cache = row
        super().start(hidden)

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

    _fed = True  # whether the call after the last ``hand_over`` fed the head up to its rows

    def hand_over(self, hidden: dict[int, Any], rows: int, need: int, fed: bool = True) -> None:
        """``commit`` of a round whose outcome the host has not read: its first ``rows`` kept rows
        (root and every level a path may reach; the rows past the path are overwritten later)
        written after the committed features, uncounted until ``settle``; ``need``: positions to
        make room for first; ``fed``: a draft call after the round feeds the head up to them
        (False: a plain step follows, and the next draft catches the head up)."""
        self._room(need)
        self.cache.slab.features[self._count : self._count + rows] = self._features(hidden, rows)
        self._fed = fed

    def settle(self, n: int) -> None:
        """Count ``n`` rows ``hand_over`` wrote (and where the call after it fed the head, the
        head's cache up to them)."""
        self._count += n
        if self._fed:
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
        self._halves = engine.halves  # the target's layers compiled or not: the head's too
        self._graph_pool = engine._graph_pool  # None: no graphs (CPU, or --no-cuda-graphs)
        # Each layer's keys and values a cache and the committed features, ``CATCH_UP_ROWS`` scratch
        # slots for a catch-up's padding.
        self._pool = SlabPool(len(self.layers), c, CATCH_UP_ROWS, HEAD_POOL_MIN, self.dtype, self.device,
                              features=c.hidden_size)
        self._eagles: dict[tuple[int, ...], _EagleTreePass] = {}
        self.rows: HeadRows | None = None  # head caches as rows of one tensor, where a head drafts on several at once
        self._engine = engine
        # The deepest a drafter of this head drafts (each drafter on it raises it): where each new
        # shape compiles and captures, every round's call is built that deep (``_call_depth``).
        self.full_depth: int | None = None

    def drafts_to(self, depth: int) -> None:
        """A drafter on this head drafts ``depth`` levels deep: calls are built at least that deep
        where shapes compile (``full_depth``)."""
        self.full_depth = max(self.full_depth or 0, depth)

    def _call_depth(self, depth: int) -> int:
        """The depth a round's call is built at for a tree of ``depth`` levels: the head's
        ``full_depth`` on an engine where each new shape compiles and captures
        (``engines.base.shapes_compile``), the tree held to ``depth`` levels by the call's
        ``levels`` input (the depth the room left in a reply allows moved in its last rounds, a
        new shape each time); elsewhere ``depth`` itself (deeper levels cost a step each)."""
        if self.full_depth is None or not shapes_compile(self._engine):
            return depth
        return max(depth, self.full_depth)

    @staticmethod
    def _weight(weights: dict[str, np.ndarray], name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(np.ascontiguousarray(weights[name], np.float32))
        except KeyError:
            raise LyannaError(f"draft head weight {name!r} is missing") from None

    def new_cache(self, capacity: int) -> StaticCache:
        """A head cache for ``capacity`` positions (``[1, kv heads, slots, head dim]``, the layout
        ``PairContext`` grows by copying slices), from the pool of caches no context holds (a
        context takes a row of ``rows`` when it starts: ``DevicePairContext.start``)."""
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
            x = cached_layer(layer, x, cos, sin, slab.kv[:, i], slots, mask, keys, self._halves)
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
                x = cached_layer(layer, x, cos, sin, cache.slab.kv[:, i], slots, mask, end, self._halves)
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
        cut, levels, depth = _cut(max_nodes, nodes), depth, self._call_depth(depth)
        spec = max(depth - 1, 0) * width  # speculative pairs' slots: ``width`` a level after the first

        def make(slab: Slab, rows: int, keys: int, base: int) -> _EagleTreePass:
            key = (id(slab), rows, depth, k, width, cut, keys)
            p = self._eagles.get(key)
            if p is None:
                p = self._eagles[key] = _EagleTreePass(self, slab, rows, depth, k, width, cut, keys, self._graph_pool)
            p.host("levels")[0] = levels
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
        host has not read, from what it left there, the call deferred to the round's own pass
        (see ``DeviceChainHead.draft_trees_after``); None where the host must read the pass first."""
        tree_levels, depth = depth, self._call_depth(depth)
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
        p.host("length")[0], p.host("levels")[0] = length, tree_levels
        pc.passes += depth
        if p.tree is None:  # a first run goes alone: its tree's shape is known once it has run
            p.run_fixed(timed=True)
            return _chosen(p, depth, ahead=True)
        return _deferred(p, depth)

    def follow_plain(self, pc: "DevicePairContext", pending: PendingPass, length: int) -> None:
        """Before a plain step after ``pending`` (a pass the host has not read; the context
        ``length`` long before it): its kept rows' features handed over, the head not fed."""
        rows = pending.levels + 1
        pc.hand_over(pending.kept_hidden, rows, length + rows, fed=False)

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
        if engine.row_slabs is not None:  # a batch on the target's row caches drafts in one call
            self.rows = HeadRows(self, engine.row_slabs.rows, engine.row_slabs.capacity)
        self._draft_trees: dict[tuple, _DraftTreesPass] = {}
        self._trees: dict[tuple[int, int, int, int], _TreePass] = {}

    def drafts_together(self, pc: PairContext, length: int, depth: int) -> HeadRows | None:
        """What drafts a batch's rounds in one call: the head's row caches, for a context on one
        with room for the chain (None: it drafts alone)."""
        return self.rows if self.rows is not None and self.rows.holds(pc, length, depth) else None

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
        cut, levels, depth = _cut(max_nodes, nodes), depth, self._call_depth(depth)

        def make(slab: Slab, rows: int, keys: int) -> _DraftTreesPass:
            key = (id(slab), rows, depth, keys, resample, k, width, max_nodes, cut)
            p = self._draft_trees.get(key)
            if p is None:
                p = self._draft_trees[key] = _DraftTreesPass(self, slab, rows, depth, keys, resample, k, width,
                                                              max_nodes, cut, self._graph_pool)
            p.host("root_info")[:] = self._token_info(ti, int(ctx[-1]))
            p.host("levels")[:] = [[levels]] + ([[min(leftover.shape[0], levels)]] if resample else [])
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
        at a shape fixed by what the pass may have kept (a path through every level), deferred:
        the round's own pass runs it joined with itself (``_deferred``), one launch a round, and
        fills the returned chain. ``length``: the context's length before that pass. None where
        no such call fits (``_follow_room``): the host reads the pass first."""
        tree_levels, depth = depth, self._call_depth(depth)
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
        p.host("levels")[:] = [[tree_levels]] + ([[0]] if resample else [])  # the second: from the pass, on the device
        if resample:  # the chain's rows past the pass's kept tokens (clamped: those past the chain are not read)
            past = torch.arange(1, depth + 1, device=self.device) + hand[HANDOFF_COUNT]
            p.leftover.copy_(chain.index_select(0, past.clamp(max=chain.shape[0] - 1)))
        pc.passes += depth
        if p.tree is None:  # a first run goes alone: its tree's shape is known once it has run
            p.run_fixed(timed=True)
            return p.raw.clone(), _chosen(p, depth, ahead=True)
        chain = torch.empty_like(p.raw)  # the call's raw rows, copied once it has run
        return chain, _deferred(p, depth, keep=(("raw", chain),))

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
