"""Attention over a KV cache for blocks of tree rows (compiled), and a prompt's prefill attention."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .halves import as_floats, ir_load_floats
from .kernels import _FAST, LANES, _aligned, _ir_exp, _launch, even_group, ir_muladd, ir_splat


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
    kt = torch.from_numpy(_aligned(as_floats(k_cache[:, :n])))
    vt = torch.from_numpy(_aligned(as_floats(v_cache[:, :n])))
    mask = torch.from_numpy(bias).repeat(groups, 1).expand(kv, groups * n, n)
    with _launch:
        probs = torch.softmax(torch.baddbmm(mask, qt, kt.transpose(1, 2)), dim=-1)
        out = torch.bmm(probs, vt)
    return out.view(kv, groups, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd).numpy()


_PV_VECTORS = 4  # accumulators per query and pass over the keys: 64 dimensions of a head on AVX-512
# Query rows of one head per task: they share each key's and value's loads, and each task reads
# its head's keys and values, so a block cut into more tasks reads them more often. With AVX-512's
# 32 registers, 6 rows' accumulators (``_PV_VECTORS`` each) and the loaded values still fit: a
# block of 5 or 6 rows is one task a head instead of two.
QUERIES = 6 if LANES == 16 else 4
# Queries scored together against each eight keys: they share every key vector's load (one load
# fed one multiply-add per query before). Two queries' 16 lane sums fit AVX-512's 32 registers
# (three at a time ran slower); on AVX2's 16 registers, one.
_SCORE_QUERIES = 2 if LANES == 16 else 1
_KEYS = 8  # keys scored together: 8 lanes of a 256-bit vector, one key's dot product per lane


def _reduce_pairs(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """Neighbouring lanes of ``x`` and ``y`` added per 128-bit half (``vhaddps``'s rule):
    ``[x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7]``."""
    i32 = ir.IntType(32)
    pick = lambda idx: b.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 8), idx))  # noqa: E731
    return b.fadd(pick([0, 2, 8, 10, 4, 6, 12, 14]), pick([1, 3, 9, 11, 5, 7, 13, 15]))


class _Scores:
    """The IR of ``_dot_keys`` (see there)."""

    def __init__(self, context, builder, signature, args):
        self.b = b = builder
        self.qp, self.kp, self.sp = (context.make_array(signature.args[i])(context, b, args[i]).data for i in (0, 4, 8))
        self.qoff, self.qstride, self.nq, self.koff, self.hd, self.nkeys, self.sstride = (args[i] for i in (1, 2, 3, 5, 6, 7, 9))
        self.intp, self.i32 = self.qoff.type, ir.IntType(32)
        self.v8 = ir.VectorType(ir.FloatType(), 8)
        self.full = b.mul(b.sdiv(self.hd, self.intp(8)), self.intp(8))  # dimensions in whole vectors of 8

    def _at(self, base, offset):
        return self.b.bitcast(self.b.gep(base, [offset]), self.v8.as_pointer())

    def _pick(self, x, y, idx):
        return self.b.shuffle_vector(x, y, ir.Constant(ir.VectorType(self.i32, len(idx)), idx))

    def lane_sums(self, queries, keys):
        """The 8 lane sums of each of ``keys`` with each of ``queries`` over dimensions [0, full):
        every key vector loaded once for all the queries."""
        b, intp, v8 = self.b, self.intp, self.v8
        muladd = ir_muladd(b, v8)
        entry = b.block
        body, done = b.append_basic_block("dims.body"), b.append_basic_block("dims.done")
        zero = ir.Constant(v8, [0.0] * 8)
        b.cbranch(b.icmp_signed(">", self.full, intp(0)), body, done)
        b.position_at_end(body)
        d = b.phi(intp)
        d.add_incoming(intp(0), entry)
        acc = [[b.phi(v8) for _ in keys] for _ in queries]
        for a in (a for row in acc for a in row):
            a.add_incoming(zero, entry)
        qv = [b.load(self._at(self.qp, b.add(query, d)), align=4) for query in queries]
        kv = [ir_load_floats(b, self.kp, b.add(b.add(self.koff, b.mul(key, self.hd)), d), v8) for key in keys]
        new = [[muladd(q, k, a) for k, a in zip(kv, row)] for q, row in zip(qv, acc)]
        d_next = b.add(d, intp(8))
        d.add_incoming(d_next, b.block)
        for row, xs in zip(acc, new):
            for a, x in zip(row, xs):
                a.add_incoming(x, b.block)
        b.cbranch(b.icmp_signed("<", d_next, self.full), body, done)
        b.position_at_end(done)
        sums = [[b.phi(v8) for _ in keys] for _ in queries]
        for row, xs in zip(sums, new):
            for total, x in zip(row, xs):
                total.add_incoming(zero, entry)
                total.add_incoming(x, body)
        return sums

    def store(self, query, out, key, total) -> None:
        """``total`` plus the dimensions past ``full`` in order, at ``s[out + key]``."""
        b, intp = self.b, self.intp
        row = b.add(self.koff, b.mul(key, self.hd))
        slot = cgutils.alloca_once_value(b, total)
        with cgutils.for_range_slice(b, self.full, self.hd, intp(1)) as (d, _):
            qd, kd = b.load(b.gep(self.qp, [b.add(query, d)])), ir_load_floats(b, self.kp, b.add(row, d), ir.FloatType())
            b.store(ir_muladd(b, ir.FloatType())(qd, kd, b.load(slot)), slot)
        b.store(b.load(slot), b.gep(self.sp, [b.add(out, key)]))

    def eight_keys(self, j) -> None:
        """Keys j .. j + 7 for every query: eight lane sums reduced together, ``_SCORE_QUERIES``
        queries at a time (the rest one by one). Each query's sums are the same operations in
        the same order whichever queries it goes with, so a score has the same bits."""
        b, intp = self.b, self.intp
        keys = [b.add(j, intp(i)) for i in range(_KEYS)]
        most = b.mul(b.sdiv(self.nq, intp(_SCORE_QUERIES)), intp(_SCORE_QUERIES))
        with cgutils.for_range_slice(b, intp(0), most, intp(_SCORE_QUERIES)) as (first, _):
            self.queries_eight_keys([b.add(first, intp(i)) for i in range(_SCORE_QUERIES)], j, keys)
        with cgutils.for_range_slice(b, most, self.nq, intp(1)) as (index, _):
            self.queries_eight_keys([index], j, keys)

    def queries_eight_keys(self, indices, j, keys) -> None:
        """Keys j .. j + 7 for the queries numbered ``indices``."""
        b = self.b
        queries = [b.add(self.qoff, b.mul(i, self.qstride)) for i in indices]
        for index, query, a in zip(indices, queries, self.lane_sums(queries, keys)):
            out = b.mul(index, self.sstride)
            h = [_reduce_pairs(b, a[2 * i], a[2 * i + 1]) for i in range(4)]
            h = [_reduce_pairs(b, h[0], h[1]), _reduce_pairs(b, h[2], h[3])]
            scores = b.fadd(self._pick(h[0], h[1], [0, 1, 2, 3, 8, 9, 10, 11]), self._pick(h[0], h[1], [4, 5, 6, 7, 12, 13, 14, 15]))
            with b.if_else(b.icmp_signed("==", self.full, self.hd)) as (exact, longer):
                with exact:  # no dimensions past the last full 8: the scores as they are
                    b.store(scores, self._at(self.sp, b.add(out, j)), align=4)
                with longer:
                    for i, key in enumerate(keys):
                        self.store(query, out, key, b.extract_element(scores, self.i32(i)))

    def one_key(self, key) -> None:
        """Key ``key`` for every query, by the same rule."""
        b = self.b
        with cgutils.for_range(b, self.nq) as loop:
            query, out = b.add(self.qoff, b.mul(loop.index, self.qstride)), b.mul(loop.index, self.sstride)
            ((v,),) = self.lane_sums([query], [key])
            quad = b.fadd(self._pick(v, v, [0, 2, 4, 6]), self._pick(v, v, [1, 3, 5, 7]))
            pair = b.fadd(self._pick(quad, quad, [0, 2]), self._pick(quad, quad, [1, 3]))
            self.store(query, out, key, b.fadd(b.extract_element(pair, self.i32(0)), b.extract_element(pair, self.i32(1))))

    def emit(self) -> None:
        b, intp = self.b, self.intp
        groups = b.mul(b.sdiv(self.nkeys, intp(_KEYS)), intp(_KEYS))
        with cgutils.for_range_slice(b, intp(0), groups, intp(_KEYS)) as (j, _):
            self.eight_keys(j)
        with cgutils.for_range_slice(b, groups, self.nkeys, intp(1)) as (key, _):
            self.one_key(key)


@intrinsic
def _dot_keys(typingctx, q, qoff, qstride, nq, k, koff, hd, nkeys, s, sstride):
    """For each query r < nq: ``s[r * sstride + j] = q[qoff + r * qstride : ... + hd] .
    k[koff + j * hd : ... + hd]`` for j < nkeys, each in one fixed order whatever ``nkeys`` and
    ``nq`` are: lane l of 8 adds dimensions l, l + 8, ... by fused multiply-adds, the lanes are
    added pairwise ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``, then any dimensions past the last
    full 8 in order. Eight keys at a time share one transposing reduction (``_reduce_pairs``), so
    a score costs its multiply-adds and about one more vector operation (a dot product per key
    reduced its lanes alone); every query meets the eight keys while they are in L1. Keys past
    the last full eight go one by one by the same rule."""
    def codegen(context, builder, signature, args):
        _Scores(context, builder, signature, args).emit()
        return context.get_dummy_value()

    return types.void(q, qoff, qstride, nq, k, koff, hd, nkeys, s, sstride), codegen


@intrinsic
def _softmax_weights(typingctx, p, off, n):
    """``p[off + j] = exp(p[off + j] - max(p[off : off + n]))`` for j < n by ``_ir_exp``, in
    vectors of ``LANES`` then one by one (the same bits either way). Why IR: numba's loop did
    not vectorize the maximum or the exponential, and together they were a third of a 64-row
    block's attention."""
    def codegen(context, builder, signature, args):
        b = builder
        pp = context.make_array(signature.args[0])(context, builder, args[0]).data
        off, n = args[1], args[2]
        intp, f32, i32 = off.type, ir.FloatType(), ir.IntType(32)
        vec = ir.VectorType(f32, LANES)
        at = lambda j, kind: b.bitcast(b.gep(pp, [b.add(off, j)]), kind.as_pointer())  # noqa: E731
        vmax = cgutils.get_or_insert_function(b.module, ir.FunctionType(vec, [vec, vec]), f"llvm.maxnum.v{LANES}f32")
        smax = cgutils.get_or_insert_function(b.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
        full = b.mul(b.sdiv(n, intp(LANES)), intp(LANES))
        top_v = cgutils.alloca_once_value(b, ir_splat(b, f32(float("-inf")), vec))
        with cgutils.for_range_slice(b, intp(0), full, intp(LANES)) as (j, _):
            b.store(b.call(vmax, [b.load(top_v), b.load(at(j, vec), align=4)]), top_v)
        top = cgutils.alloca_once_value(b, f32(float("-inf")))
        for lane in range(LANES):  # a maximum is exact in any order
            b.store(b.call(smax, [b.load(top), b.extract_element(b.load(top_v), i32(lane))]), top)
        with cgutils.for_range_slice(b, full, n, intp(1)) as (j, _):
            b.store(b.call(smax, [b.load(top), b.load(at(j, f32))]), top)
        shift = b.load(top)
        with cgutils.for_range_slice(b, intp(0), full, intp(LANES)) as (j, _):
            x = b.fsub(b.load(at(j, vec), align=4), ir_splat(b, shift, vec))
            b.store(_ir_exp(b, x), at(j, vec), align=4)
        with cgutils.for_range_slice(b, full, n, intp(1)) as (j, _):
            b.store(_ir_exp(b, b.fsub(b.load(at(j, f32)), shift)), at(j, f32))
        return context.get_dummy_value()

    return types.void(p, off, n), codegen


class _Weighted:
    """The IR of ``_weighted_rows`` (see there)."""

    def __init__(self, context, builder, signature, args):
        self.b = b = builder
        self.pp, self.vp, self.op, self.scp = (context.make_array(signature.args[i])(context, b, args[i]).data
                                               for i in (0, 3, 7, 10))
        self.pstride, self.nq, self.voff, self.n, self.hd, self.ooff, self.ostride = (args[i] for i in (1, 2, 4, 5, 6, 8, 9))
        self.intp = self.voff.type

    def pass_over_keys(self, e, kind, width: int, queries: int) -> None:
        """Dimensions [e, e + width * lanes of ``kind``) of the weighted sums of ``queries``."""
        b, intp, n = self.b, self.intp, self.n
        lanes = kind.count if isinstance(kind, ir.VectorType) else 1
        muladd = ir_muladd(b, kind)
        at = lambda base, offset: b.bitcast(b.gep(base, [offset]), kind.as_pointer())  # noqa: E731
        zero = ir.Constant(kind, [0.0] * lanes if lanes > 1 else 0.0)
        entry = b.block
        body, done = b.append_basic_block("keys.body"), b.append_basic_block("keys.done")
        b.cbranch(b.icmp_signed(">", n, intp(0)), body, done)
        b.position_at_end(body)
        j = b.phi(intp)
        j.add_incoming(intp(0), entry)
        acc = [[b.phi(kind) for _ in range(width)] for _ in range(queries)]
        for a in (x for row in acc for x in row):
            a.add_incoming(zero, entry)
        row = b.add(b.add(self.voff, b.mul(j, self.hd)), e)
        vals = [ir_load_floats(b, self.vp, b.add(row, intp(w * lanes)), kind) for w in range(width)]
        new = []
        for r in range(queries):
            pv = ir_splat(b, b.load(b.gep(self.pp, [b.add(b.mul(intp(r), self.pstride), j)])), kind)
            new.append([muladd(pv, vals[w], acc[r][w]) for w in range(width)])
        j_next = b.add(j, intp(1))
        j.add_incoming(j_next, b.block)
        for r in range(queries):
            for a, x in zip(acc[r], new[r]):
                a.add_incoming(x, b.block)
        b.cbranch(b.icmp_signed("<", j_next, n), body, done)
        b.position_at_end(done)
        totals = [[b.phi(kind) for _ in range(width)] for _ in range(queries)]  # phis first in a block
        for r in range(queries):
            for total, x in zip(totals[r], new[r]):
                total.add_incoming(zero, entry)
                total.add_incoming(x, body)
        for r in range(queries):
            scale = ir_splat(b, b.load(b.gep(self.scp, [intp(r)])), kind)
            for w, total in enumerate(totals[r]):
                dst = b.add(b.add(b.add(self.ooff, b.mul(intp(r), self.ostride)), e), intp(w * lanes))
                b.store(b.fmul(total, scale), at(self.op, dst), align=4)

    def emit(self) -> None:
        """A switch on the number of queries, each case over the head's dimensions."""
        b, intp, hd = self.b, self.intp, self.hd
        vector = ir.VectorType(ir.FloatType(), LANES)
        wide, one = intp(_PV_VECTORS * LANES), intp(LANES)
        wide_end = b.mul(b.sdiv(hd, wide), wide)
        vector_end = b.add(wide_end, b.mul(b.sdiv(b.sub(hd, wide_end), one), one))
        merge = b.append_basic_block("queries.end")
        switch = b.switch(self.nq, merge)
        for queries in range(1, QUERIES + 1):
            case = b.append_basic_block(f"queries{queries}")
            switch.add_case(self.nq.type(queries), case)
            b.position_at_end(case)
            with cgutils.for_range_slice(b, intp(0), wide_end, wide) as (e, _):
                self.pass_over_keys(e, vector, _PV_VECTORS, queries)
            with cgutils.for_range_slice(b, wide_end, vector_end, one) as (e, _):
                self.pass_over_keys(e, vector, 1, queries)
            with cgutils.for_range_slice(b, vector_end, hd, intp(1)) as (e, _):  # a head_dim not a multiple of LANES
                self.pass_over_keys(e, ir.FloatType(), 1, queries)
            b.branch(merge)
        b.position_at_end(merge)


@intrinsic
def _weighted_rows(typingctx, p, pstride, nq, v, voff, n, hd, out, ooff, ostride, scales):
    """For each query r < nq (1..``QUERIES``): ``out[ooff + r * ostride + e] = scales[r] *
    sum(p[r * pstride + j] * v[voff + j * hd + e] for j < n)`` for e < hd, keys in order, one
    ``fma`` per term, starting from +0 (``out``: C-contiguous float32; ``v``: C-contiguous float32,
    or a half cache's 16 bits, read as float32).

    Why IR: numba's loop keeps the accumulators in memory; here the accumulators of every query
    stay in registers across the keys and each value vector is loaded once for all of them. A
    key of weight 0 (masked, or past a query's last visible key) adds ``0 * v``: the sum is the
    same bits as without that key (an exact 0 added to a nonzero sum leaves it; added to +0, the
    only zero a sum from +0 can reach, it gives +0), so a row gets the same numbers alone, in a
    batch or in a tree block whose other keys it cannot see."""
    if not (isinstance(v, types.Array) and isinstance(out, types.Array) and v.layout == "C" and out.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        _Weighted(context, builder, signature, args).emit()
        return context.get_dummy_value()

    return types.void(p, pstride, nq, v, voff, n, hd, out, ooff, ostride, scales), codegen


@njit(cache=True, nogil=True)
def _row_chunks(span_of: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """[first, end) of each run of up to ``QUERIES`` consecutive rows of one span (rows of span -1
    skipped), a span's runs as even as they can be (7 rows as 4 + 3, not 6 + 1: a run's time is
    mostly its reads of the keys and values, whatever its rows)."""
    n = span_of.shape[0]
    bounds = np.empty((n, 2), np.int64)
    count, i = 0, 0
    while i < n:
        if span_of[i] < 0:
            i += 1
            continue
        end = i + 1
        while end < n and span_of[end] == span_of[i]:
            end += 1
        size = even_group(end - i, QUERIES)
        while i < end:
            j = min(i + size, end)
            bounds[count, 0], bounds[count, 1] = i, j
            count += 1
            i = j
    return bounds[:count]


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _attention_kernel(q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray, ends: np.ndarray,
                      bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row ``i`` of ``q`` belongs to span ``span_of[i]`` (-1: skipped) and attends to keys
    [0, ends[s]) of layer ``layer`` of that span's caches ``ks[s]``/``vs[s]`` ([layers, kv_heads,
    capacity, head_dim]; tuples or typed lists: one launch for every sequence of a batch), plus its
    row of the span's additive mask when ``bias_at[s] >= 0``. One task per head and run of up to
    ``QUERIES`` rows of a span: the run's rows share each key's and value's loads."""
    heads = q.shape[1]
    chunks = _row_chunks(span_of)
    last_all, inv_all, p_all = attention_scratch(chunks.shape[0] * heads, ends.max())
    for t in prange(chunks.shape[0] * heads):
        attention_task(t, chunks, q, ks, vs, layer, span_of, lo, ends, bias, bias_at, out, last_all, inv_all, p_all)


# Softmax weights (at most 1) as integers in units of 2**-50, for ``_scales``' exact sums: a sum of
# up to 8192 such weights stays below 2**63.
_FIXED = np.float32(2.0 ** 50)


@njit(cache=True, nogil=True)
def _scales(p: np.ndarray, inv: np.ndarray) -> None:  # pragma: no cover - compiled
    """``inv[r] = 1 / sum(p[r])`` for each row of softmax weights ``p`` [rows, width] (each in
    [0, 1], the row's largest exactly 1), the sum taken exactly in integers: each weight in
    units of 2**-50, truncated (the same for a weight wherever it is), added in int64, then
    rounded once to float32. An integer sum has no order, so a row's denominator is the same bits
    whatever the block, the key count, the vector width or the code around the loop, and a weight
    of 0 (a key the row cannot see) changes nothing: alone, in a tree block or in a batch, a row
    gets the same (a float64 sum left to the vectorizer now and then came out a last bit apart
    between two callers). The dropped bits move the sum (at least 1) by under ``width * 2**-50``."""
    rows, width = p.shape
    for r in range(rows):
        total = np.int64(0)
        for j in range(width):
            total += np.int64(p[r, j] * _FIXED)
        inv[r] = np.float32(1.0) / np.float32(np.float64(total) / np.float64(_FIXED))


@njit(cache=True, nogil=True)
def attention_scratch(tasks: int, most_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Every task's scratch in one allocation each: its rows' last visible key, weights and scales."""
    return (np.empty((tasks, QUERIES), np.int64), np.empty((tasks, QUERIES), np.float32),
            np.empty((tasks, QUERIES * most_keys), np.float32))


@njit(fastmath=_FAST, cache=True, nogil=True)
def attention_task(t: int, chunks: np.ndarray, q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray,
                   ends: np.ndarray, bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray, last_all: np.ndarray,
                   inv_all: np.ndarray, p_all: np.ndarray) -> None:  # pragma: no cover - compiled
    """Task ``t`` of ``_attention_kernel`` (head ``t % heads`` of run ``t // heads`` of ``chunks``),
    also one task of the one-row pass on held threads (``step``)."""
    n, heads, hd = q.shape
    groups = heads // ks[0].shape[1]
    r0, r1 = chunks[t // heads, 0], chunks[t // heads, 1]
    h = t % heads
    s = span_of[r0]
    k = ks[s][layer]
    v = vs[s][layer]
    g = h // groups
    masked = bias_at[s] >= 0
    last, inv = last_all[t], inv_all[t]
    for r in range(r1 - r0):
        end = ends[s]
        if masked:  # keys after the row's last visible one weigh exactly 0: skip them (half of a causal block)
            row_bias = bias_at[s] + (r0 + r - lo[s]) * ends[s]
            while end > 1 and bias[row_bias + end - 1] == -np.inf:
                end -= 1
        last[r] = end
    width = last[: r1 - r0].max()
    p = p_all[t, : (r1 - r0) * width].reshape(r1 - r0, width)
    _dot_keys(q, (r0 * heads + h) * hd, heads * hd, r1 - r0, k, g * k.shape[1] * hd, hd, width, p, width)
    for r in range(r1 - r0):
        i, end = r0 + r, last[r]
        prow = p[r, :end]
        p[r, end:] = 0.0
        if masked:
            row_bias = bias_at[s] + (i - lo[s]) * ends[s]
            brow = bias[row_bias : row_bias + end]  # from 0: indexed as bias[row_bias + j], the loop ran scalar
            for j in range(end):
                prow[j] += brow[j]
        _softmax_weights(p, r * width, end)  # masked keys (-inf) get exactly 0
    _scales(p, inv)
    _weighted_rows(p, width, r1 - r0, v, g * v.shape[1] * hd, width, hd, out, r0 * out.shape[1] + h * hd,
                   out.shape[1], inv)


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
