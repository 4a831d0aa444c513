"""A Lyanna head's caches as rows of one tensor, so that a batch's rounds draft in one call: on a
GPU a round's drafting is a few hundred small kernels whatever its rows, so 32 sequences drafting
one after another pay 32 times what one call for all of them does.

``HeadRows`` gives each generation's ``DevicePairContext`` a row (``[2, layers, rows, kv heads,
capacity + scratch, head dim]`` and ``[rows, capacity + scratch, hidden]`` features, each row a
``Slab`` view, so everything one sequence does on its head cache works unchanged on a row). In a
batch on the target's row caches each round asks its drafting of the scheduler
(``base.DraftRequest``), which runs every sequence's in one call (``HeadRows.draft``,
``_DraftRowsPass``): each row's catch-up over its committed pairs, the chain, the raw logits, the
trees (the fresh one, and the one re-sampled from the last chain's leftover rows, fused) for every
row at once; the trees cross to the host in one copy, where each sequence's budget cuts its own.
Rows that draft nothing this round are computed as padding and written only to scratch slots.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..engines.device_batch import batch_layer, first_half
from ..engines.device_passes import _fetch
from ..engines.device_slabs import KEY_BUCKET_MIN, FixedShapeCall, Slab, StaticCache, pow2_at_least
from ..engines.torch_layers import PackedLayer, attention_bias, rms_norm
from .base import DraftRequest
from .device_calls import CATCH_UP_ROWS, ChainCallHead, _grow_layout, _tree_tail
from .head import PairContext
from .lyanna_batch import ChainRequest, TokenTable, chain_requests
from .tree import DraftTree


class RowsHead(ChainCallHead, Protocol):
    """What ``HeadRows`` uses of its head (``device.DeviceChainHead``), which makes it: stated
    here so that this module need not import the head's."""

    layers: list[PackedLayer]
    _graph_pool: Any

    def _pending(self, pc: PairContext, ctx: np.ndarray, extra: int) -> np.ndarray: ...

    def _token_info(self, ti: TokenTable, root: int) -> np.ndarray: ...


class HeadRows:
    """``rows`` head caches of ``capacity`` positions as rows of one tensor, for ``head`` (a
    ``device.DeviceChainHead``), and the calls that draft on several rows at once."""

    def __init__(self, head: RowsHead, rows: int, capacity: int):
        c = head.config
        self.head, self.rows, self.capacity = head, rows, capacity
        slots = capacity + CATCH_UP_ROWS
        shape = (len(head.layers), c.num_kv_heads, slots, c.head_dim)
        self.kv = torch.zeros((2, shape[0], rows, *shape[1:]), dtype=head.dtype, device=head.device)
        self.features = torch.zeros((rows, slots, c.hidden_size), dtype=torch.float32, device=head.device)
        self.slabs = []
        for r in range(rows):
            slab = Slab(shape, capacity, head.dtype, head.device, features=self.features[r], kv=self.kv[:, :, r])
            slab.row = r
            self.slabs.append(slab)
        self._free = list(range(rows - 1, -1, -1))
        self.every = torch.arange(rows, device=head.device)
        self.first = first_half(head._halves.compiled)
        self._passes: dict[tuple, _DraftRowsPass] = {}
        self.calls, self.most = 0, 0  # calls run, and the most sequences one drafted for

    def cache(self, capacity: int) -> StaticCache | None:
        """A free row (holding its whole capacity) for at least ``capacity`` positions, or None."""
        if capacity > self.capacity or not self._free:
            return None
        return StaticCache(self.slabs[self._free.pop()], self.capacity, self._release)

    def _release(self, slab: Slab) -> None:
        self._free.append(slab.row)

    @property
    def idle(self) -> int:
        """Rows no context holds."""
        return len(self._free)

    def holds(self, pc: PairContext, length: int, depth: int) -> bool:
        """Whether a context on ``pc`` of ``length`` tokens drafts here: on a row, with room for
        its chain of ``depth`` rows (a context that outgrows its row drafts on its own)."""
        slab = pc.cache.slab
        return slab.row is not None and slab is self.slabs[slab.row] and length + depth <= self.capacity

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """Each ``ChainRequest``'s tree, in order: one call per token-info table and tree shape
        among them (forks of one drafter share both)."""
        reqs = chain_requests(requests)
        trees: dict[int, DraftTree] = {}
        groups: dict[tuple[int, tuple[int, int, int]], list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault((id(r.ti), r.shape), []).append(i)
        for members in groups.values():
            trees.update(zip(members, self._draft([reqs[i] for i in members])))
        return [trees[i] for i in range(len(reqs))]

    @torch.inference_mode()
    def _draft(self, requests: Sequence[ChainRequest]) -> list[DraftTree]:
        """One call for ``requests``, every chain as deep as the deepest (a row whose context has
        no room for that many drafts alone, at its own depth)."""
        head, depth = self.head, max(r.chain for r in requests)
        if any(len(r.context) + depth > self.capacity for r in requests):
            short = [i for i, r in enumerate(requests) if len(r.context) + depth > self.capacity]
            rest = [i for i in range(len(requests)) if i not in short]
            trees = dict(zip(rest, self._draft([requests[i] for i in rest]) if rest else []))
            trees.update((i, self._draft([requests[i]])[0]) for i in short)
            return [trees[i] for i in range(len(requests))]
        pendings = [head._pending(r.pc, r.context, depth) for r in requests]  # older pairs filled first
        rows = pow2_at_least(max(len(p) for p in pendings))
        keys = min(pow2_at_least(max(int(p[-1]) + depth for p in pendings), KEY_BUCKET_MIN), self.capacity)
        resample = any(r.leftover is not None for r in requests)
        topk, width, max_nodes = requests[0].shape
        k = min(topk, head.d2t.size)
        key = (rows, depth, keys, resample, k, width, max_nodes)
        p = self._passes.get(key)
        if p is None:
            p = self._passes[key] = _DraftRowsPass(self, rows, depth, keys, resample, k, width, max_nodes)
        p.load(requests, pendings)
        p.run_fixed()
        self.calls, self.most = self.calls + 1, max(self.most, len(requests))
        raw = p.raw.clone()  # the chains outlive the call's buffer
        packed = _fetch([p.tree])[0].astype(np.float64)
        out = []
        for r, pending in zip(requests, pendings):
            row, base = r.pc.cache.slab.row, int(pending[-1])
            r.pc.cache.length = r.pc.base = base
            r.pc.passes += r.chain
            out.append(r.drafter.drafted(r, raw[row, : r.chain], DraftTree.from_packed(packed[row])))
        return out


class _DraftRowsPass(FixedShapeCall):
    """Lyanna's drafting on every row of a ``HeadRows`` at one fixed shape: a catch-up of ``rows``
    pairs a row (the root last, padding after), ``depth - 1`` chain steps, the raw logits, and
    each row's round tree (``device_calls._round_tree``; with ``resample``, fused with the tree of
    the row's leftover rows)."""

    def __init__(self, owner: HeadRows, rows: int, depth: int, keys: int, resample: bool, topk: int, width: int,
                 max_nodes: int):
        head = owner.head
        super().__init__(head.device, head._graph_pool)
        self.owner, self.head, self.rows, self.depth, self.keys = owner, head, rows, depth, keys
        self.topk, self.width, self.max_nodes = topk, width, max_nodes
        self.layout = _grow_layout(depth, topk, width, head.device)
        seqs, trees, chain = owner.rows, 2 if resample else 1, depth - 1
        for name in ("features", "tokens", "positions", "slots"):  # ``features``: rows of each row's features
            self._input(name, (seqs, rows), torch.int64)
        self._input("mask", (seqs, rows, keys), torch.bool)
        self._input("root", (seqs,), torch.int64)
        for name in ("chain_positions", "chain_slots"):
            self._input(name, (seqs, chain), torch.int64)
        self._input("chain_mask", (seqs, chain, keys), torch.bool)
        self._input("root_info", (seqs, trees, 1, head._ti_b.shape[0]), torch.float32)
        self._input("levels", (seqs, trees, 1), torch.int64)
        self.leftover = (torch.zeros((seqs, depth, head.d2t.size), dtype=torch.float32, device=head.device)
                         if resample else None)
        self.raw: torch.Tensor | None = None
        self.tree: torch.Tensor | None = None

    def load(self, requests: Sequence[ChainRequest], pendings: Sequence[np.ndarray]) -> None:
        """Every row's inputs: the requests' rows as ``_CatchUpCall.load`` and ``DeviceChainHead.
        _drafted`` lay out one sequence's, the other rows as padding (scratch slots, slot 0 seen)."""
        cap, rows, keys, chain = self.owner.capacity, self.rows, self.keys, self.depth - 1
        names = ("features", "tokens", "positions", "slots", "mask", "root")
        feats, tokens, positions, slots, mask, root = (self.host(name) for name in names)
        c_pos, c_slots, c_mask = (self.host(n) for n in ("chain_positions", "chain_slots", "chain_mask"))
        info, levels = self.host("root_info"), self.host("levels")
        feats[:], tokens[:], positions[:], slots[:], root[:] = cap, 0, 0, cap + np.arange(rows), 0
        mask[:], c_pos[:], c_slots[:], c_mask[:], levels[:] = False, 0, cap, False, 0
        mask[:, :, 0] = c_mask[:, :, 0] = True  # padding reads slot 0 and is dropped
        at = np.arange(keys)
        for r, pending in zip(requests, pendings):
            i, n, base = r.pc.cache.slab.row, len(pending), int(pending[-1])
            feats[i, :n], tokens[i, :n] = pending - 1, r.context[pending]
            positions[i, :n], slots[i, :n] = pending, pending - 1
            mask[i, :n] = at[None, :] <= (pending - 1)[:, None]
            root[i] = n - 1
            chain_slots = base + np.arange(chain)
            c_pos[i], c_slots[i], c_mask[i] = chain_slots + 1, chain_slots, at[None, :] <= chain_slots[:, None]
            info[i] = self.head._token_info(r.ti, int(r.context[-1]))
            levels[i, 0] = r.chain
            if r.leftover is not None:
                levels[i, 1] = r.leftover.shape[0]
                self.leftover[i, : r.leftover.shape[0]].copy_(r.leftover)

    def _forward(self) -> None:
        o, h, n = self.owner, self.head, self.rows
        seqs, d = o.rows, h.config.head_dim
        every = torch.cat([self.positions, self.chain_positions], 1).view(-1)  # one RoPE for every row
        cos, sin = (t.view(seqs, -1, d) for t in h.rotation(every))
        x = h.fc(torch.cat([o.features[o.every[:, None], self.features].to(h.dtype), h._embed[self.tokens]], dim=-1))
        x = self._layers(x, cos[:, :n], sin[:, :n], self.slots, self.mask)
        f = x[o.every, self.root][:, None]  # [seqs, 1, hidden]: each row's prediction after its root
        features = [f]
        for j in range(self.depth - 1):
            at = slice(n + j, n + j + 1)
            f = self._layers(f, cos[:, at], sin[:, at], self.chain_slots[:, j : j + 1], self.chain_mask[:, j : j + 1])
            features.append(f)
        self.raw = (rms_norm(torch.cat(features, 1), h._norm, h.config.rms_norm_eps) @ h._draft_lm_head.T).float()
        raw = self.raw[:, None] if self.leftover is None else torch.stack([self.raw, self.leftover], 1)
        self.tree = _tree_tail(h)(h, raw, self.root_info, self.levels, self.topk, self.width, self.layout,
                                  self.max_nodes, self.max_nodes, self.depth)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The head's layers over ``x`` [seqs, t, hidden], each row on its own cache row."""
        o, h = self.owner, self.head
        bias = attention_bias(mask, h.dtype)[:, None]
        cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        for li, layer in enumerate(h.layers):
            x = batch_layer(layer, h._halves, o.first, x, cos, sin, o.kv[:, li], o.every, slots, bias, self.keys)
        return x
