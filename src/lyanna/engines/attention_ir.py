"""The LLVM IR of attention's inner loops: a run of queries' scores against a span of keys with
the keys in a vector's lanes, the softmax weights, and the weighted sum of the values.
``attention`` runs them as a block's tasks (``attention_lanes``: the scores with the queries in
the lanes)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .halves import ir_load_floats
from .kernels import LANES, _ir_exp, ir_muladd, ir_splat

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


def ir_carried_loop(b: ir.IRBuilder, end: ir.Value, step: int, inits: list, body) -> list:
    """``body(i, values) -> values`` for i = 0, step, 2 * step, ... below ``end``, the values
    carried from ``inits`` in registers (phis) and the last ones returned (``inits`` when the loop
    does not run): the accumulators of the kernels' loops over dimensions or keys."""
    intp = end.type
    entry = b.block
    loop, done = b.append_basic_block("carried.body"), b.append_basic_block("carried.done")
    b.cbranch(b.icmp_signed(">", end, intp(0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(intp)
    i.add_incoming(intp(0), entry)
    acc = [b.phi(x.type) for x in inits]
    for a, x in zip(acc, inits):
        a.add_incoming(x, entry)
    new = body(i, acc)
    i_next = b.add(i, intp(step))
    i.add_incoming(i_next, b.block)
    for a, x in zip(acc, new):
        a.add_incoming(x, b.block)
    last = b.block
    b.cbranch(b.icmp_signed("<", i_next, end), loop, done)
    b.position_at_end(done)
    out = [b.phi(x.type) for x in inits]
    for o, x, n in zip(out, inits, new):
        o.add_incoming(x, entry)
        o.add_incoming(n, last)
    return out


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
        b, v8 = self.b, self.v8
        muladd = ir_muladd(b, v8)
        zero = ir.Constant(v8, [0.0] * 8)

        def step(d, acc):
            qv = [b.load(self._at(self.qp, b.add(query, d)), align=4) for query in queries]
            kv = [ir_load_floats(b, self.kp, b.add(b.add(self.koff, b.mul(key, self.hd)), d), v8) for key in keys]
            return [muladd(q, k, acc[i * len(keys) + j]) for i, q in enumerate(qv) for j, k in enumerate(kv)]

        flat = ir_carried_loop(b, self.full, 8, [zero] * (len(queries) * len(keys)), step)
        return [flat[i * len(keys) : (i + 1) * len(keys)] for i in range(len(queries))]

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


_MAX_CHAINS = 4  # running maxima over a row's vectors: a chain of one waited on each maximum's latency


def _ir_larger(b: ir.IRBuilder, x: ir.Value, m: ir.Value) -> ir.Value:
    """``x > m ? x : m``: one ``vmaxps``. (``llvm.maxnum`` also orders NaNs: three dependent
    instructions a vector, in a chain through the whole row.)"""
    return b.select(b.fcmp_ordered(">", x, m), x, m)


def _ir_row_max(b: ir.IRBuilder, at, n: ir.Value) -> ir.Value:
    """The largest of elements [0, n) (``at(j, kind)`` points at element j): ``_MAX_CHAINS``
    vectors of running maxima, then across them and across their lanes by halves, then the
    elements past the last whole vector; -inf when n is 0. A maximum is exact in any order."""
    intp, f32, i32 = n.type, ir.FloatType(), ir.IntType(32)
    vec = ir.VectorType(f32, LANES)
    big = intp(LANES * _MAX_CHAINS)
    most, full = b.mul(b.sdiv(n, big), big), b.mul(b.sdiv(n, intp(LANES)), intp(LANES))
    tops = [cgutils.alloca_once_value(b, ir_splat(b, f32(float("-inf")), vec)) for _ in range(_MAX_CHAINS)]
    with cgutils.for_range_slice(b, intp(0), most, big) as (j, _):
        for c, top in enumerate(tops):
            b.store(_ir_larger(b, b.load(at(b.add(j, intp(c * LANES)), vec), align=4), b.load(top)), top)
    with cgutils.for_range_slice(b, most, full, intp(LANES)) as (j, _):
        b.store(_ir_larger(b, b.load(at(j, vec), align=4), b.load(tops[0])), tops[0])
    values = [b.load(top) for top in tops]
    while len(values) > 1:
        values = [_ir_larger(b, x, y) for x, y in zip(values[::2], values[1::2])]
    t, width = values[0], LANES
    while width > 1:
        width //= 2
        upper = ir.Constant(ir.VectorType(i32, LANES), [(lane + width) % LANES for lane in range(LANES)])
        t = _ir_larger(b, b.shuffle_vector(t, t, upper), t)
    top = cgutils.alloca_once_value(b, b.extract_element(t, i32(0)))
    with cgutils.for_range_slice(b, full, n, intp(1)) as (j, _):
        b.store(_ir_larger(b, b.load(at(j, f32)), b.load(top)), top)
    return b.load(top)



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
        intp, f32 = off.type, ir.FloatType()
        vec = ir.VectorType(f32, LANES)
        at = lambda j, kind: b.bitcast(b.gep(pp, [b.add(off, j)]), kind.as_pointer())  # noqa: E731
        full = b.mul(b.sdiv(n, intp(LANES)), intp(LANES))
        shift = _ir_row_max(b, at, n)
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

        def step(j, acc):
            row = b.add(b.add(self.voff, b.mul(j, self.hd)), e)
            vals = [ir_load_floats(b, self.vp, b.add(row, intp(w * lanes)), kind) for w in range(width)]
            new = []
            for r in range(queries):
                pv = ir_splat(b, b.load(b.gep(self.pp, [b.add(b.mul(intp(r), self.pstride), j)])), kind)
                new += [muladd(pv, vals[w], acc[r * width + w]) for w in range(width)]
            return new

        flat = ir_carried_loop(b, n, 1, [zero] * (queries * width), step)
        totals = [flat[r * width : (r + 1) * width] for r in range(queries)]
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
