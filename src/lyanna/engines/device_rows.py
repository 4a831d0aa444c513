"""The caches of a continuous batch as rows of one tensor, so that the sequences' decoding blocks
run as one pass: a step of 8 or 32 sequences launches one pass's kernels instead of 8 or 32
passes', which is what a small model's step costs on a GPU.

``RowSlabs`` holds ``[2, layers, rows, kv heads, capacity + scratch, head dim]``; each row is a
``Slab`` (a view) that a ``StaticCache`` holds like any other, so everything one sequence does on
its cache (prefill, trees left on the device, compaction) works unchanged on a row. Blocks of
rows under a mask (a plain step, or a root and a host tree) on several rows run together
(``run``): each block padded to the pass's row bucket, each row attending to its own row of the
cache under its own mask, rows of no block masked and writing only scratch slots. A row's numbers
are its own (attention reads only its row, the matrices multiply rows independently), so the
outputs are the blocks' alone up to the summation order of a batched product.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import LyannaError
from .base import Block, ForwardOutput
from .device_batch import batch_layers, first_half
from .device_passes import _fetch, _Logits
from .device_slabs import KEY_BUCKET_MIN, FixedShapeCall, Slab, StaticCache, pow2_at_least
from .torch_layers import attention_bias, rms_norm

# The most rows one block may bring to a batched pass (larger blocks run on their own), and so the
# scratch slots past each row's capacity that padding rows write.
MAX_BLOCK_ROWS = 64


class RowSlabs:
    """``rows`` caches of ``capacity`` positions as rows of one tensor, for ``engine`` (a
    ``device.DeviceEngine``: its layers, dtype, device, compiled halves and CUDA graph pool)."""

    def __init__(self, engine, rows: int, capacity: int):
        if rows < 2:
            raise LyannaError(f"batch rows must be 0 (none) or >= 2, got {rows}")
        if capacity < 1:
            raise LyannaError(f"row capacity must be >= 1, got {capacity}")
        c = engine.config
        self.engine, self.rows, self.capacity = engine, rows, capacity
        slots = capacity + MAX_BLOCK_ROWS
        self.kv = torch.zeros((2, c.num_layers, rows, c.num_kv_heads, slots, c.head_dim), dtype=engine.dtype,
                              device=engine.device)
        self.slabs = []
        for r in range(rows):
            slab = Slab((c.num_layers, c.num_kv_heads, slots, c.head_dim), capacity, engine.dtype, engine.device,
                        kv=self.kv[:, :, r])
            slab.row = r
            self.slabs.append(slab)
        self._free = list(range(rows - 1, -1, -1))
        self._every = torch.arange(rows, device=engine.device)
        self._first = first_half(engine.halves.compiled)
        self._passes: dict[tuple[int, int, tuple[int, ...]], _RowsPass] = {}
        self.passes_run = 0  # batched passes run so far (how often a batch shared one)

    def cache(self, capacity: int) -> StaticCache | None:
        """A free row for ``capacity`` positions, or None (none is free, or it holds fewer)."""
        if capacity > self.capacity or not self._free:
            return None
        return StaticCache(self.slabs[self._free.pop()], capacity, self._release)

    def _release(self, slab: Slab) -> None:
        self._free.append(slab.row)

    @staticmethod
    def takes(b: Block, n: int) -> bool:
        """Whether block ``b`` of ``n`` rows, run on the host-verified path, may share a pass."""
        return (getattr(b.cache, "slab", None) is not None and b.cache.slab.row is not None and not b.prefill
                and b.logit_rows is None and 1 <= n <= MAX_BLOCK_ROWS)

    def run(self, blocks: Sequence[Block], inputs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]
            ) -> list[ForwardOutput]:
        """``blocks`` (each ``takes``, on distinct rows) in one pass, with their checked
        ``(tokens, positions, within)``: each block's logits (left on the device) and taps, its
        cache grown by its rows, as ``DeviceEngine._run_static`` gives them alone."""
        t = pow2_at_least(max(len(tokens) for tokens, _, _ in inputs))
        end = max(b.cache.length + len(tokens) for b, (tokens, _, _) in zip(blocks, inputs))
        keys = min(pow2_at_least(end, KEY_BUCKET_MIN), self.capacity)
        taps = tuple(sorted(set().union(*(b.taps for b in blocks))))
        p = self._passes.get((t, keys, taps))
        if p is None:
            p = self._passes[(t, keys, taps)] = _RowsPass(self, t, keys, taps)
        tok, pos, slots, mask = (p.host(name) for name in ("tokens", "positions", "slots", "mask"))
        tok[:], pos[:], slots[:], mask[:] = 0, 0, self.capacity + np.arange(t), False
        mask[:, :, 0] = True  # rows of no block, and padding rows, read slot 0 (never NaN) and are dropped
        for b, (tokens, positions, within) in zip(blocks, inputs):
            r, n, start = b.cache.slab.row, len(tokens), b.cache.length
            tok[r, :n], pos[r, :n], slots[r, :n] = tokens, positions, start + np.arange(n)
            mask[r] = self.engine._visible(start, positions, within, t, keys)
            mask[r, n:, 0] = True
        p.run_fixed()
        self.passes_run += 1
        argmax, *hidden = _fetch([p.argmax] + [p.hidden[tap] for tap in taps])
        outs = []
        for b, (tokens, _, _) in zip(blocks, inputs):
            r, n = b.cache.slab.row, len(tokens)
            outs.append(ForwardOutput(logits=_Logits(p.logits[r, :n].clone(), argmax[r, :n]),
                                      hidden={tap: h[r, :n] for tap, h in zip(taps, hidden) if tap in b.taps}))
            b.cache.length += n
        return outs


class _RowsPass(FixedShapeCall):
    """One pass over every row of a ``RowSlabs`` at ``t`` rows a block and ``keys`` slots."""

    def __init__(self, owner: RowSlabs, t: int, keys: int, taps: tuple[int, ...]):
        super().__init__(owner.engine.device, owner.engine._graph_pool)
        self.owner, self.keys, self.taps = owner, keys, taps
        for name in ("tokens", "positions", "slots"):
            self._input(name, (owner.rows, t), torch.int64)
        self._input("mask", (owner.rows, t, keys), torch.bool)
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None
        self.hidden: dict[int, torch.Tensor] = {}

    def _forward(self) -> None:
        o, e = self.owner, self.owner.engine
        bias = attention_bias(self.mask, e.dtype)[:, None]
        x, self.hidden = batch_layers(e, o._first, lambda li: o.kv[:, li], self.tokens, self.positions, self.slots,
                                      o._every, bias, self.keys, self.taps)
        top = e.config.num_layers  # the final norm, once: a tap of it is already normalized
        normed = self.hidden[top] if top in self.hidden else rms_norm(x, e._norm, e.config.rms_norm_eps)
        self.logits = normed @ e._lm_head.T
        self.argmax = self.logits.argmax(-1)
