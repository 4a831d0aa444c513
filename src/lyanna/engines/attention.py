"""Attention over a KV cache for blocks of tree rows (compiled), and a prompt's prefill attention."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import _FAST, LANES, _aligned, _launch, exp_nonpositive, ir_muladd, ir_splat


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``attention`` for a prompt's prefill (``n`` rows from an empty cache, additive mask
    [n, n]) by PyTorch's batched GEMMs, one per key/value head with its query heads stacked, where
    our kernel takes one query at a time. It computes what PyTorch's
    ``scaled_dot_product_attention`` computes with that mask (its CPU path for a float mask is
    these products and a softmax: identical bits with torch 2.13 here, tested to 1e-6) without
    repeating each key/value head per query head, and was the faster of the two at every prompt
    length tried on the 2-core Xeon (2026-11-23). Like ``linear_rows``, only prefill goes this
    way, so a prompt's numbers are the same for every method and in a batch."""
    import torch


    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    groups = heads // kv
    # [kv, groups * n, hd]: the query heads that share key/value head g, one after the other
    qt = torch.from_numpy(_aligned(q)).view(n, kv, groups, hd).permute(1, 2, 0, 3).reshape(kv, groups * n, hd)
    kt = torch.from_numpy(_aligned(k_cache[:, :n]))
    vt = torch.from_numpy(_aligned(v_cache[:, :n]))
    mask = torch.from_numpy(bias).repeat(groups, 1).expand(kv, groups * n, n)
    with _launch:
        probs = torch.softmax(torch.baddbmm(mask, qt, kt.transpose(1, 2)), dim=-1)
        out = torch.bmm(probs, vt)
    return out.view(kv, groups, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd).numpy()


_PV_VECTORS = 4  # accumulators per pass over the keys: 64 dimensions of a head on AVX-512


@intrinsic
def _weighted_rows(typingctx, p, v, voff, n, hd, out, ooff, scale):
    """``out[ooff + e] = scale * sum(p[j] * v[voff + j * hd + e] for j < n if p[j] != 0)`` for
    e < hd, keys in order, as one ``fma`` per term (``v``, ``out``: C-contiguous float32).


    Why IR: the same sum written as a numba loop keeps the head's accumulator in memory, a load
    and a store per key and vector, and was two thirds of the attention kernel's time. Here the
    accumulators of up to ``_PV_VECTORS`` vectors stay in registers across the keys, which was
    faster for tree blocks and long prompts alike on the 2-core AMD EPYC (2026-11-23). The terms
    are those of that loop in the same order (keys
    of weight 0 are skipped, not added), so a row gets the same bits alone, in a batch or in a tree
    block whose other keys it cannot see."""
    if not (isinstance(v, types.Array) and isinstance(out, types.Array) and v.layout == "C" and out.layout == "C"):
        return None


    def codegen(context, builder, signature, args):
        b = builder
        pp, vp, op = (context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 1, 5))
        voff, n, hd, ooff, scale = (args[i] for i in (2, 3, 4, 6, 7))
        intp, f32 = voff.type, ir.FloatType()


        def pass_over_keys(e, kind, width: int) -> None:
            """Dimensions [e, e + width * lanes of ``kind``) of the weighted sum."""
            lanes = kind.count if isinstance(kind, ir.VectorType) else 1
            muladd = ir_muladd(b, kind)


            def at(base, offset):
                return b.bitcast(b.gep(base, [offset]), kind.as_pointer())


            zero = ir.Constant(kind, [0.0] * lanes if lanes > 1 else 0.0)
            entry = b.block
            body, done = b.append_basic_block("keys.body"), b.append_basic_block("keys.done")
            b.cbranch(b.icmp_signed(">", n, intp(0)), body, done)
            b.position_at_end(body)
            j = b.phi(intp)
            j.add_incoming(intp(0), entry)
            acc = [b.phi(kind) for _ in range(width)]
            for a in acc:
                a.add_incoming(zero, entry)
            pj = b.load(b.gep(pp, [j]))
            weighs = b.fcmp_ordered("!=", pj, ir.Constant(f32, 0.0))
            pv = ir_splat(b, pj, kind)
            row = b.add(b.add(voff, b.mul(j, hd)), e)
            new = [b.select(weighs, muladd(pv, b.load(at(vp, b.add(row, intp(r * lanes))), align=4), acc[r]), acc[r])
                   for r in range(width)]
            j_next = b.add(j, intp(1))
            j.add_incoming(j_next, b.block)
            for a, x in zip(acc, new):
                a.add_incoming(x, b.block)
            b.cbranch(b.icmp_signed("<", j_next, n), body, done)
            b.position_at_end(done)
            sums = [b.phi(kind) for _ in range(width)]
            for total, x in zip(sums, new):
                total.add_incoming(zero, entry)
                total.add_incoming(x, body)
            for r, total in enumerate(sums):
                b.store(b.fmul(total, ir_splat(b, scale, kind)), at(op, b.add(b.add(ooff, e), intp(r * lanes))), align=4)


        vector = ir.VectorType(f32, LANES)
        wide, one = intp(_PV_VECTORS * LANES), intp(LANES)
        wide_end = b.mul(b.sdiv(hd, wide), wide)
        vector_end = b.add(wide_end, b.mul(b.sdiv(b.sub(hd, wide_end), one), one))
        with cgutils.for_range_slice(b, intp(0), wide_end, wide) as (e, _):
            pass_over_keys(e, vector, _PV_VECTORS)
        with cgutils.for_range_slice(b, wide_end, vector_end, one) as (e, _):
            pass_over_keys(e, vector, 1)
        with cgutils.for_range_slice(b, vector_end, hd, intp(1)) as (e, _):  # a head_dim not a multiple of LANES
            pass_over_keys(e, f32, 1)
        return context.get_dummy_value()


    return types.void(p, v, voff, n, hd, out, ooff, scale), codegen


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _attention_kernel(q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray, ends: np.ndarray,
                      bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row ``i`` of ``q`` belongs to span ``span_of[i]`` (-1: skipped) and attends to keys
    [0, ends[s]) of layer ``layer`` of that span's caches ``ks[s]``/``vs[s]`` ([layers, kv_heads,
    capacity, head_dim]; tuples or typed lists: one launch for every sequence of a batch), plus its
    row of the span's additive mask when ``bias_at[s] >= 0``."""
    n, heads, hd = q.shape
    groups = heads // ks[0].shape[1]
    for t in prange(n * heads):
        i = t // heads
        s = span_of[i]
        if s < 0:
            continue
        h = t % heads
        g = h // groups
        k = ks[s][layer]
        v = vs[s][layer]
        end = ends[s]
        masked = bias_at[s] >= 0
        row_bias = bias_at[s] + (i - lo[s]) * end
        if masked:  # keys after the row's last visible one weigh exactly 0: skip them (half of a causal block)
            while end > 1 and bias[row_bias + end - 1] == -np.inf:
                end -= 1
        scores = np.empty(end, np.float32)
        top = -np.inf
        for j in range(end):
            sc = np.float32(0.0)
            for d in range(hd):
                sc += q[i, h, d] * k[g, j, d]
            if masked:
                sc += bias[row_bias + j]
            scores[j] = sc
            top = max(top, sc)
        for j in range(end):
            scores[j] = exp_nonpositive(scores[j] - top)  # masked keys (-inf) get exactly 0
        # The vectorized sum visits keys in an order that depends on how many there are; in
        # float64 that order no longer shows once rounded to float32, so a query gets the same
        # denominator alone, in a tree block whose later keys it cannot see, or in a batch.
        total64 = 0.0
        for j in range(end):
            total64 += np.float64(scores[j])
        inv = np.float32(1.0) / np.float32(total64)
        _weighted_rows(scores, v, g * v.shape[1] * hd, end, hd, out, i * out.shape[1] + h * hd, inv)


class AttentionSpan(NamedTuple):
    """Rows [lo, hi) of a block's queries, attending to keys [0, end) of these caches (one
    layer's [kv_heads, capacity, head_dim]) with an additive [hi - lo, end] mask or none."""


    lo: int
    hi: int
    k_cache: np.ndarray
    v_cache: np.ndarray
    end: int
    bias: np.ndarray | None


def ragged_attention(q: np.ndarray, spans: Sequence[AttentionSpan], out: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query softmax attention of several sequences' query rows, each over its own cache,
    in one kernel launch (a batch of 8 decoding sequences: 30 launches per pass instead of 240;
    measured in-process on the 2-core CPU, 2026-11-23: such a pass 61-64 -> 56-58 ms). ``q`` is
    [n, heads, head_dim], already scaled; returns [n, heads * head_dim]
    (rows outside every span are left as they are in ``out``). A row's numbers do not depend on
    the other spans: the same kernel serves a sequence alone (``attention``) and in a batch.


    One compiled kernel instead of BLAS batched matmuls: those start OpenBLAS's thread pool
    beside numba's, and on two cores the pools fight (blocks of 12 tokens and more took 0.4 to
    0.6 s instead of 0.03)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n, heads, hd = q.shape
    for sp in spans:
        kv = sp.k_cache.shape
        if kv[0] == 0 or heads % kv[0] or kv[2] != hd or sp.end > kv[1] or sp.end < 1 or not 0 <= sp.lo <= sp.hi <= n:
            raise ValueError(f"attention shapes do not fit: q {q.shape}, rows [{sp.lo}, {sp.hi}), cache {kv}, end {sp.end}")
        if kv[0] != spans[0].k_cache.shape[0] or sp.v_cache.shape != kv:
            raise ValueError("every span's caches must have the same shape per slot")
        if sp.bias is not None and np.shape(sp.bias) != (sp.hi - sp.lo, sp.end):
            raise ValueError(f"attention bias must be [{sp.hi - sp.lo}, {sp.end}], got {np.shape(sp.bias)}")
    span_of, lo, bias, bias_at = span_layout(n, [(sp.lo, sp.hi, sp.bias) for sp in spans])
    # tuples are compiled per length: pad to a power of two (the last cache again, never read)
    # so that batch sizes 1..N cost log2(N) compilations, not N
    # (and one array type: a non-contiguous cache view is read through a contiguous copy)
    width = 1 << max(len(spans) - 1, 0).bit_length()
    ks = tuple(np.ascontiguousarray(sp.k_cache)[None] for sp in spans)  # one layer's caches as layer 0
    vs = tuple(np.ascontiguousarray(sp.v_cache)[None] for sp in spans)
    ks, vs = ks + ks[-1:] * (width - len(spans)), vs + vs[-1:] * (width - len(spans))
    if out is None:
        out = np.empty((n, heads * hd), np.float32)
    with _launch:
        _attention_kernel(q, ks, vs, 0, span_of, lo, np.array([sp.end for sp in spans], np.int64), bias, bias_at, out)
    return out


def span_layout(n: int, spans: Sequence[tuple[int, int, np.ndarray | None]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What ``_attention_kernel`` reads of spans given as (lo, hi, additive mask or None): each of
    the ``n`` rows' span (-1: none), each span's first row, the masks flattened into one array,
    and where each span's mask starts in it (-1: no mask)."""
    span_of = np.full(n, -1, np.int64)
    bias_at, biases, at = [], [], 0
    for s, (lo, hi, bias) in enumerate(spans):
        span_of[lo:hi] = s
        bias_at.append(-1 if bias is None else at)
        if bias is not None:
            biases.append(np.ascontiguousarray(bias, np.float32).reshape(-1))
            at += biases[-1].size
    flat = np.concatenate(biases) if biases else np.zeros(0, np.float32)
    return span_of, np.array([lo for lo, _, _ in spans], np.int64), flat, np.array(bias_at, np.int64)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, end: int,
              bias: np.ndarray | None) -> np.ndarray:
    """Grouped-query softmax attention of n query rows over cache slots [0, end): ``q`` is
    [n, heads, head_dim], already scaled; ``k_cache``/``v_cache`` are one layer's
    [kv_heads, capacity, head_dim]; ``bias`` is an additive [n, end] mask or None (no mask).
    Returns [n, heads * head_dim]: ``ragged_attention`` of one span."""
    return ragged_attention(q, [AttentionSpan(0, len(q), k_cache, v_cache, end, bias)])
