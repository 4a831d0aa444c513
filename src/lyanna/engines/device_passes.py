"""The target's decoding passes on the device at fixed shapes: a block of rows (``_StaticPass``) and
a block whose draft tree is on the device (``_TreeBlockPass``: the tree's rows formed in the pass,
and, when it verifies, the verdict and the cache's compaction too), the outcome of a pass the host
has not read yet (``PendingPass``), and what crosses back to the host (``_Logits``, ``_fetch``).
``engines.device.DeviceEngine`` makes and runs them.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from .base import ForwardOutput
from .config import ModelConfig
from .device_slabs import (HANDOFF_BONUS, HANDOFF_START, HANDOFF_TOKENS, DeviceTree, FixedShapeCall, Slab, StaticCache,
                           _elapsed)
from .device_verify import follow


class PassEngine(Protocol):
    """What a pass uses of its engine (``device.DeviceEngine``): stated here so that this module
    need not import the engine, which imports it."""

    device: torch.device
    config: ModelConfig
    _graph_pool: Any  # a CUDA graph memory pool handle, or None: calls run eagerly

    def _layers_pass(self, slab: Slab, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     mask: torch.Tensor | None, keys: int, taps: tuple[int, ...],
                     rows: torch.Tensor | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]: ...


class _StaticPass(FixedShapeCall):
    """A decoding block at one fixed shape (``rows`` padded rows, ``keys`` slots of attention) on
    one cache slab, with the taps asked for: input buffers the host fills, outputs it reads."""

    def __init__(self, engine: PassEngine, slab: Slab, rows: int, keys: int, taps: tuple[int, ...]):
        super().__init__(engine.device, engine._graph_pool)
        self.engine, self.slab, self.keys, self.taps = engine, slab, keys, taps
        self.rows = rows
        for name in ("tokens", "positions", "slots"):
            self._input(name, (rows,), torch.int64)
        self._input("mask", (rows, keys), torch.bool)
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None  # every row's, for greedy verification
        self.hidden: dict[int, torch.Tensor] = {}

    def _forward(self) -> None:
        self.logits, self.hidden = self.engine._layers_pass(
            self.slab, self.tokens, self.positions, self.slots, self.mask, self.keys, self.taps, None)
        self.argmax = self.logits.argmax(-1)

    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, mask: np.ndarray) -> None:
        """Fill the inputs (the mask is built on the host) and run."""
        for name, value in (("tokens", tokens), ("positions", positions), ("slots", slots), ("mask", mask)):
            self.host(name)[:] = value
        self.run_fixed()


class _TreeBlockPass(FixedShapeCall):
    """A verification block whose tree is on the device (``DeviceTree``), at one fixed shape: the
    root and ``rows - 1`` tree rows (a tree of fewer nodes is padded), attention over ``keys``
    slots, ancestors up to ``depth``. Its tokens, positions, slots and mask are formed here from
    the tree (``load``) and the block's start and root (host inputs): the same block the host
    builds for a tree. ``rule`` ``"greedy"`` or ``"sampling"``: the pass also verifies the tree
    (``device_verify.follow``; sampling's settings and random numbers are inputs) and compacts
    the cache to root + accepted path, leaving what the next round needs in ``Slab.handoffs[writes]``;
    None: it leaves both to the host. ``chained``: the block's start and root are the last
    verified pass's (the other of ``Slab.handoffs``), not host inputs."""

    def __init__(self, engine: PassEngine, slab: Slab, rows: int, keys: int, taps: tuple[int, ...], depth: int,
                 rule: str | None, chained: bool = False, writes: int = 0):
        super().__init__(engine.device, engine._graph_pool)
        self.engine, self.slab, self.rows, self.keys, self.taps = engine, slab, rows, keys, taps
        self.nodes, self.depth, self.rule, self.chained, self.writes = rows - 1, depth, rule, chained, writes
        if not chained:
            self._input("start", (1,), torch.int64)
            self._input("root", (1,), torch.int64)
        if rule == "sampling":
            for name in ("temperature", "top_p"):
                self._input(name, (1,), torch.float64)
            self._input("top_k", (1,), torch.int64)
            self._input("uniforms", (rows,), torch.float64)  # one a node, then the bonus token's
        # ``DeviceTree.packed``'s layout at ``nodes`` columns (padding past a tree's own columns
        # keeps earlier values: nodes past the count, never read but as rows dropped after).
        self.tree = torch.zeros(5 * self.nodes + 1, dtype=torch.float64, device=engine.device)
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None
        self.hidden: dict[int, torch.Tensor] = {}
        # What crosses to the host, in one copy (float64): ``tree``, the block's start, the path's
        # length, the bonus token, the rows kept (padded); and the tapped rows of those rows, which stay.
        self.result: torch.Tensor | None = None
        self.kept_hidden: dict[int, torch.Tensor] = {}
        self._slots = torch.arange(keys, device=engine.device)  # every slot's index, made once for every run
        # A greedy plain step (no tree: ``ar`` launched ahead) takes a short path (``_plain``),
        # its constant made here too: a captured graph allocates nothing.
        self._plain_step = rows == 1 and rule == "greedy" and engine.config.sliding_window is None
        if self._plain_step:
            self._first = torch.zeros(1, dtype=torch.int64, device=engine.device)

    def _forward(self) -> None:
        m, rows, keys, dev = self.nodes, self.rows, self.keys, self.device
        if self.chained:
            last = self.slab.handoffs[1 - self.writes]
            start, root = last[HANDOFF_START : HANDOFF_START + 1], last[HANDOFF_BONUS : HANDOFF_BONUS + 1]
        else:
            start, root = self.start, self.root
        if self._plain_step:
            self._plain(start, root)
            return
        count = self.tree[-1:].long()
        tree = self.tree[:-1].view(5, m)
        at = torch.arange(m, device=dev)
        valid = at < count
        parents = tree[1].long()
        depths = torch.cat([torch.zeros_like(start), torch.where(valid, tree[4].long(), 1)])  # the root's is 0
        pad = rows - m - 1
        tokens = torch.cat([root, torch.where(valid, tree[0].long(), 0), torch.zeros(pad, dtype=torch.int64, device=dev)])
        positions = torch.cat([start + depths, torch.zeros(pad, dtype=torch.int64, device=dev)])
        slots = torch.cat([start + torch.arange(m + 1, device=dev), self.slab.capacity + torch.arange(pad, device=dev)])
        # Ancestors, a level more each time round: seen[i, j], node j is node i or above it.
        own = at[:, None] == at[None, :]
        above, has = parents.clamp(min=0), (parents >= 0)[:, None]
        seen = own
        for _ in range(self.depth - 1):
            seen = own | (has & seen[above])
        within = torch.cat([torch.ones((m + 1, 1), dtype=torch.bool, device=dev),
                            torch.cat([torch.zeros((1, m), dtype=torch.bool, device=dev), seen])], 1)  # [m+1, m+1]
        key = self._slots
        inside = key - start  # a slot's row in the block
        in_block = (inside >= 0) & (inside <= m)
        mask = (key < start)[None, :] | (within[:, inside.clamp(0, m)] & in_block[None, :])
        window = self.engine.config.sliding_window
        if window is not None:
            key_positions = torch.where(in_block, start + depths[inside.clamp(0, m)], key)
            mask = mask & (positions[: m + 1, None] - key_positions[None, :] < window)
        mask = torch.cat([mask, (key == 0)[None, :].expand(pad, keys)])  # padding rows read slot 0 and are dropped
        self.logits, self.hidden = self.engine._layers_pass(self.slab, tokens, positions, slots, mask, keys, self.taps,
                                                            None)
        # Every row's argmax: the host's (no rule) or greedy verification's; sampling reads none.
        self.argmax = None if self.rule == "sampling" else self.logits.argmax(-1)
        if self.rule is not None:
            self._follow(start, tokens[1 : m + 1], parents, depths[1:], valid)

    def _plain(self, start: torch.Tensor, root: torch.Tensor) -> None:
        """The pass of a tree of no nodes under greedy verification, as the general path computes
        it with a fraction of its kernels: the root alone at ``start``, seeing every slot up to its
        own; the next token its row's argmax; the cache kept as it is (the root's row is the whole
        path); the handoff and the result laid out as ``_follow`` lays them."""
        self.logits, self.hidden = self.engine._layers_pass(self.slab, root, start, start,
                                                            (self._slots <= start)[None, :], self.keys, self.taps, None)
        self.argmax = self.logits.argmax(-1)
        bonus, none = self.argmax[:1], self._first  # no node accepted: the bonus token follows the root's row
        self.result = torch.cat([self.tree, start.double(), none.double(), bonus.double(), none.double()])
        self.kept_hidden = {tap: h[none] for tap, h in self.hidden.items()}
        self.slab.handoffs[self.writes][: HANDOFF_TOKENS + 1] = torch.cat([start + 1, none, bonus, bonus])

    @property
    def levels(self) -> int:
        """The deepest a path can be."""
        return min(self.depth, self.nodes)

    def _follow(self, start: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                valid: torch.Tensor) -> None:
        """Verify (``device_verify.follow``), then move rows ``start + keep`` to ``start + 0..``
        (``keep`` padded with self-copies past the path, so the shape stays fixed), and leave the
        next round's start, root and new tokens in ``Slab.handoffs[writes]``."""
        levels, dev = self.levels, self.device
        sampling = None if self.rule == "greedy" else (self.temperature, self.top_p, self.top_k, self.uniforms)
        path = follow(tokens, parents, depths, valid, self.logits[: self.nodes + 1], self.argmax, levels, sampling)
        kv = self.slab.kv
        kv.index_copy_(3, start + torch.arange(levels + 1, device=dev), kv.index_select(3, start + path.keep))
        self.result = torch.cat([self.tree, start.double(), path.count.double(), path.bonus.double(), path.keep.double()])
        self.kept_hidden = {tap: h[path.keep] for tap, h in self.hidden.items()}
        at = torch.arange(levels + 1, device=dev)
        after = torch.cat([tokens[(path.keep[1:] - 1).clamp(min=0)], path.bonus])  # the path's tokens, padded
        hand = self.slab.handoffs[self.writes]
        hand[: HANDOFF_TOKENS + levels + 1] = torch.cat([start + path.count + 1, path.count, path.bonus,
                                                         torch.where(at == path.count, path.bonus, after)])

    def load(self, tree: DeviceTree) -> None:
        """Copy ``tree`` in (on the device, in stream order: before its drafter's next call)."""
        self.tree[:-1].view(5, self.nodes)[:, : tree.nodes].copy_(tree.packed[:-1].view(5, tree.nodes))
        self.tree[-1:].copy_(tree.packed[-1:])


class PendingPass:
    """A tree pass verified on the device whose outcome the host has not read yet (``Block.ahead``):
    its one small result is on its way to host memory (pinned, not waited for), and the next round
    may already follow it there (``Block.follows``, reading ``handoff``, the one of
    ``Slab.handoffs`` it wrote); ``collect`` waits for the copy and gives the ``ForwardOutput``.
    ``kept_hidden``: the kept rows' taps (``levels + 1`` rows, the path's first), on the device
    until the next pass on the cache."""

    def __init__(self, p: _TreeBlockPass, cache: StaticCache, taps: tuple[int, ...]):
        self.cache, self.levels, self.writes = cache, p.levels, p.writes
        self.handoff = cache.slab.handoffs[p.writes]
        self.kept_hidden, self.timing = p.kept_hidden, p.timing
        self._taps, self._logits, self._width = taps, p.logits, p.tree.shape[0]
        cuda = p.result.device.type == "cuda"
        self._result = torch.empty(p.result.shape, dtype=torch.float64, pin_memory=cuda)
        self._result.copy_(p.result, non_blocking=cuda)
        self._copied = None
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._out: ForwardOutput | None = None

    def device_seconds(self) -> float:
        """The pass's time on the device once collected (0.0 where it ran synchronously)."""
        return _elapsed(self.timing)

    def collect(self) -> ForwardOutput:
        """Wait for the result; the cache's length is then the pass's."""
        if self._out is None:
            if self._copied is not None:
                self._copied.synchronize()
            result = self._result.numpy()
            packed, start, path = result[: self._width], int(result[self._width]), result[self._width + 1 :].astype(np.int64)
            kept, bonus = path[2 : 3 + int(path[0])], int(path[1])
            self.cache.length = start + kept.size
            self._out = ForwardOutput(logits=_Logits(self._logits[: 1 + int(packed[-1])]),
                                      hidden={tap: self.kept_hidden[tap][: kept.size] for tap in self._taps},
                                      tree=packed, kept=kept, bonus=bonus)
        return self._out


class _Logits:
    """A block's logits on the device (``base.DeviceLogits``), with every row's argmax on the
    host when the pass computed it."""

    def __init__(self, t: torch.Tensor, argmax: np.ndarray | None = None):
        self._t, self.shape, self._argmax = t, tuple(t.shape), argmax

    def __getitem__(self, row: int) -> np.ndarray:
        return _fetch([self._t[row]])[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """All rows on the host (``np.asarray``): for tests and tools, not the decoding loop."""
        a = _fetch([self._t])[0]
        return a if dtype is None else a.astype(dtype)

    def argmax(self) -> np.ndarray:
        """Every row's argmax (the first of equal maxima, as numpy's), in one small copy."""
        return self._t.argmax(-1).cpu().numpy() if self._argmax is None else self._argmax


def _fetch(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors as host arrays (floats as fp32), copied out of buffers a later run
    overwrites; from CUDA asynchronously into pinned memory and one wait for them all."""
    wanted = [torch.float32 if t.is_floating_point() else t.dtype for t in tensors]
    if tensors and tensors[0].device.type == "cuda":
        out = [torch.empty(t.shape, dtype=d, pin_memory=True) for t, d in zip(tensors, wanted)]
        for o, t in zip(out, tensors):
            o.copy_(t, non_blocking=True)
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return [o.numpy() for o in out]
    return [t.to(d).numpy().copy() for t, d in zip(tensors, wanted)]
