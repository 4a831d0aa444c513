"""All decoder layers of a pass in one compiled call, on a GGUF's blocks: one sequence's block or
the blocks of a whole batch, each sequence with its own cache.

Why: a one-token step on the blocks engine makes about 450 kernel calls, and going through
Python between them (numba's argument checks, small numpy operations) was a large share of the
step's time. ``python scripts/measure-blocks.py`` (whole passes after 256 cached tokens, 2-core
Xeon, 2026-11-23) measured a one-token pass on the blocks at 13.1 ms before this path and 10.2 ms
with it (``docs/bench/blocks.json``; the earlier run is that file's previous version in the
repository's history). This function calls the same compiled
kernels (``kernels``' RMSNorm, RoPE, attention and SiLU, ``quant``'s linear) from compiled code,
so every row gets exactly the bits the layer-by-layer path gives it (tested in
``test_quant.py``), only without the trips through Python in between.

It serves every pass whose matrices are all on blocks, without a qkv bias and without a prompt
long enough for the GEMM path (which the blocks never take); anything else goes layer by layer
(``transformer.ragged_layer_forward``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.typed import List

from .attention import _attention_kernel, span_layout
from . import step
from .halves import write_kv
from .config import ModelConfig
from .kernels import SameTypes, _rms_norm_kernel, _rope_kernel, _silu_mul_kernel
from . import intdot
from .quant import QuantMatrix, _quant_linear_kernel


def _linear(x, d, m, q, out, path):  # pragma: no cover - replaced in compiled code by the overload below
    """``out = x @ W.T`` by the matrix's kernel (``QuantMatrix.kernel``), told apart by its layout;
    ``path``: intdot's instruction-set path (an argument, not a global, so a compiled and cached
    ``_layers`` serves whichever path the process chose)."""


@overload(_linear)
def _linear_by_layout(x, d, m, q, out, path):
    if q.dtype == types.uint8:  # intdot's layout (``intdot.pack``); the float kernel's weights are int8
        return lambda x, d, m, q, out, path: intdot.int_linear_kernel(x, d, m, q, out, path)
    return lambda x, d, m, q, out, path: _quant_linear_kernel(x, d, m, q, out)


@njit(nogil=True, cache=True)
def _layers(x, rot, attn_norms, mlp_norms, d, m, q, k_caches, v_caches, span_of, lo, starts, bias, bias_at, tap_slot,
            taps, eps, heads, kv_heads, head_dim, path, clock):  # pragma: no cover - compiled
    """``x`` through every layer; layer ``l``'s matrices are ``(d, m, q)[4 * l + j]`` for qkv, o,
    gate_up and down. Row ``i`` belongs to sequence ``s = span_of[i]`` (rows ``lo[s]`` on): its key
    and value go to slot ``starts[s] + i - lo[s]`` of ``k_caches[s]``/``v_caches[s]``, and it
    attends to that sequence's slots up to its own block's end (with the sequence's mask in
    ``bias`` from ``bias_at[s]``, or none where that is -1). The input of layer ``l`` is copied
    to ``taps[tap_slot[l]]`` where ``tap_slot[l] >= 0``. ``path``: see ``_linear``. ``clock``: cycles
    per phase (``PHASES``) added to it, or ``NO_CLOCK``."""
    n, hidden = x.shape
    # The residual stream, added to in place (``x = x + a`` allocated and filled a new array twice
    # a layer); the caller's array is left as it was.
    x = x.copy()
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    scale = np.float32(1.0 / np.sqrt(head_dim))
    ends = starts.copy()
    for i in range(n):
        ends[span_of[i]] += 1
    h = np.empty((n, hidden), np.float32)
    qkv = np.empty((n, q_dim + 2 * kv_dim), np.float32)
    qh = np.empty((n, heads, head_dim), np.float32)
    kh = np.empty((n, kv_heads, head_dim), np.float32)
    o = np.empty((n, q_dim), np.float32)
    a = np.empty((n, hidden), np.float32)
    # every layer has the same shapes; d holds a scale per output row and block of 32 inputs
    gate_up = np.empty((n, d[2].size // (hidden // 32)), np.float32)
    act = np.empty((n, gate_up.shape[1] // 2), np.float32)
    for layer in range(len(attn_norms)):
        if tap_slot[layer] >= 0:
            taps[tap_slot[layer]] = x
        w = 4 * layer
        t = _lap(clock, -1, 0)
        _rms_norm_kernel(x, attn_norms[layer], eps, h)
        t = _lap(clock, 0, t)
        _linear(h, d[w], m[w], q[w], qkv, path)
        t = _lap(clock, 1, t)
        _rope_kernel(qkv, rot, heads, kv_heads, head_dim, scale, qh, kh)
        write_kv(qkv, kh, k_caches, v_caches, layer, span_of, lo, starts, q_dim + kv_dim)
        t = _lap(clock, 2, t)
        _attention_kernel(qh, k_caches, v_caches, layer, span_of, lo, ends, bias, bias_at, o)
        t = _lap(clock, 3, t)
        _linear(o, d[w + 1], m[w + 1], q[w + 1], a, path)
        t = _lap(clock, 4, t)
        x += a
        _rms_norm_kernel(x, mlp_norms[layer], eps, h)
        t = _lap(clock, 5, t)
        _linear(h, d[w + 2], m[w + 2], q[w + 2], gate_up, path)
        t = _lap(clock, 6, t)
        _silu_mul_kernel(gate_up, act)
        t = _lap(clock, 7, t)
        _linear(act, d[w + 3], m[w + 3], q[w + 3], a, path)
        t = _lap(clock, 8, t)
        x += a
        _lap(clock, 9, t)
    return x


# What ``_layers`` times per layer when it is given a clock (``PHASES`` cycle counts, summed over
# the layers): where a pass's time goes, measured inside the pass (``scripts/measure-block-parts.py``),
# so that each part meets the caches as the pass leaves them (a part timed alone, over and over,
# finds its weights in cache far more often).
PHASES = ("attention norm", "qkv", "rope and cache", "attention", "o", "residual and mlp norm", "gate and up",
          "silu and mul", "down", "residual")
NO_CLOCK = np.zeros(0, np.int64)  # a pass not timed


@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter (``rdtsc`` on x86)."""
    def codegen(context, builder, signature, args):
        counter = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                                 "llvm.readcyclecounter")
        return builder.call(counter, [])

    return types.int64(), codegen


@njit(nogil=True, cache=True)
def cycles():  # pragma: no cover - compiled
    """``_cycles`` from Python: what a caller converts ``_layers``' clock to seconds with."""
    return _cycles()


@njit(nogil=True, cache=True)
def _lap(clock, phase, since):  # pragma: no cover - compiled
    """The cycle counter now, having added the cycles since ``since`` to ``clock[phase]``
    (``phase`` -1: only read it); 0 and nothing done for an empty clock (a pass not timed)."""
    if clock.size == 0:
        return 0
    now = _cycles()
    if phase >= 0:
        clock[phase] += now - since
    return now


def _matrices(layers: Sequence) -> list:
    """Each layer's four matrices in the order ``_layers`` indexes them."""
    return [w for layer in layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]


class FusedLayers:
    """The layers' weights gathered for ``_layers``; ``None`` from ``of`` when some layer does not
    fit it (fp32 matrices, a qkv bias, padded matrices, matrices on different kernels)."""

    def __init__(self, layers: Sequence, config: ModelConfig):
        mats = _matrices(layers)
        self.d, self.m, self.q = (List([getattr(w, f) for w in mats]) for f in ("d", "m", "q"))
        self.attn_norms = List([np.ascontiguousarray(layer.attn_norm, np.float32) for layer in layers])
        self.mlp_norms = List([np.ascontiguousarray(layer.mlp_norm, np.float32) for layer in layers])
        self.config = config
        # one sequence's caches as a tuple, a batch's as typed lists: two signatures, each called
        # straight at its machine code (the typed lists of weights cost the dispatcher every call)
        self._alone, self._batch = SameTypes(_layers), SameTypes(_layers)
        # One-row passes of one sequence on threads held for the pass (``step``), on intdot's layout.
        self._steps = SameTypes(step.step_layers) if mats and mats[0].q.dtype == np.uint8 else None

    @classmethod
    def of(cls, layers: Sequence, config: ModelConfig) -> "FusedLayers | None":
        mats = _matrices(layers)
        unpadded = all(isinstance(w, QuantMatrix) and w.padded_rows == w.shape[0] for w in mats)
        # One typed list per field: one kernel, and scales of one type (fp16 bits or fp32, ``intdot.pack``).
        one_kernel = unpadded and len({(w.kernel, w.d.dtype) for w in mats}) == 1
        if not layers or not unpadded or not one_kernel or any(layer.bqkv is not None for layer in layers):
            return None
        return cls(layers, config)

    def __call__(self, x: np.ndarray, rot: np.ndarray, blocks: Sequence[tuple[int, int, np.ndarray, np.ndarray, int,
                                                                          np.ndarray | None]],
                 taps: list[int], clock: np.ndarray = NO_CLOCK) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """``x`` [n, hidden] after every layer, and the inputs of the layers in ``taps``. ``blocks``:
        per sequence, its rows [lo, hi) of ``x``, its key and value caches, the slot its block
        starts at and its additive mask (None: a single row). ``clock``: see ``_layers``."""
        c = self.config
        n = x.shape[0]
        tap_slot = np.full(c.num_layers, -1, np.int64)
        for slot, layer in enumerate(taps):
            tap_slot[layer] = slot
        out = np.empty((len(taps), n, c.hidden_size), np.float32)
        span_of, lo, bias, bias_at = span_layout(n, [(lo, hi, bias) for lo, hi, _, _, _, bias in blocks])
        if self._steps is not None and len(blocks) == 1 and clock.size == 0 and n <= step.MOST_ROWS:
            return self._step(x, rot, blocks[0], (span_of, lo, bias, bias_at), tap_slot, out, taps)
        # A batch's caches as typed lists: one compiled ``_layers`` whatever the number of sequences.
        # One sequence's as a 1-tuple: a second compilation, specialized to one cache, whose steps ran faster.
        if len(blocks) == 1:
            k_caches, v_caches, layers = (blocks[0][2],), (blocks[0][3],), self._alone
        else:
            k_caches, v_caches, layers = List([b[2] for b in blocks]), List([b[3] for b in blocks]), self._batch
        x = layers(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(rot, np.complex64), self.attn_norms, self.mlp_norms, self.d, self.m, self.q,
                    k_caches, v_caches, span_of, lo, np.array([b[4] for b in blocks], np.int64), bias, bias_at,
                    tap_slot, out, np.float32(c.rms_norm_eps), c.num_heads, c.num_kv_heads, c.head_dim,
                    intdot.path_index(), clock)
        return x, {layer: out[slot] for slot, layer in enumerate(taps)}

    def _step(self, x: np.ndarray, rot: np.ndarray, block: tuple, spans: tuple, tap_slot: np.ndarray, out: np.ndarray,
              taps: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """``__call__`` for a small block of one sequence, by ``step.step_layers`` (``spans``:
        ``attention.span_layout``'s for it)."""
        c = self.config
        x = self._steps(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(rot, np.complex64), self.attn_norms,
                        self.mlp_norms, self.d, self.m, self.q, block[2], block[3], block[4], *spans, out, tap_slot,
                        np.float32(c.rms_norm_eps), c.num_heads, c.num_kv_heads, c.head_dim, intdot.path_index(),
                        get_num_threads())
        return x, {layer: out[slot] for slot, layer in enumerate(taps)}
