"""A task's scores with its queries in a vector's lanes (``_dot_keys_lanes``): ``attention_ir``'s
``_dot_keys`` bit for bit, for tasks of 8 queries and more (a kv head's query heads over a run of
rows)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attention_ir import ir_carried_loop
from .halves import ir_load_floats
from .kernels import LANES, ir_muladd, ir_splat


# Keys scored together when queries fill the lanes: each query vector loaded once feeds this many
# multiply-adds (their keys' numbers come broadcast from memory), within AVX-512's 32 registers
# beside the 8 query vectors of a pass; on AVX2's 16, two.
_LANE_KEYS = 4 if LANES == 16 else 2
_WRITTEN_OUT = 64  # a head's dimensions for which ``_Lanes`` writes its loops out (SmolLM2's, Llama's)


class _Lanes:
    """The IR of ``_dot_keys_lanes`` (see there)."""

    def __init__(self, context, builder, signature, args):
        self.b = b = builder
        self.kp, self.sp, scratch = (context.make_array(signature.args[i])(context, b, args[i]).data for i in (0, 4, 6))
        self.nq, self.koff, self.hd, self.nkeys, self.sstride = args[1], args[2], args[3], args[5], args[7]
        self.intp, self.i32, self.f32 = self.koff.type, ir.IntType(32), ir.FloatType()
        self.vec = ir.VectorType(self.f32, LANES)
        self.qt = scratch  # [hd, LANES]: dimension d of query i at d * LANES + i (filled by the caller)
        self.kf = b.gep(scratch, [b.mul(self.hd, self.intp(LANES))])  # [LANES keys, hd] in float32
        self.tt = b.gep(self.kf, [b.mul(self.hd, self.intp(LANES))])  # [LANES keys, LANES queries]
        self.full = b.mul(b.sdiv(self.hd, self.intp(8)), self.intp(8))

    def _vat(self, base, offset):
        return self.b.bitcast(self.b.gep(base, [offset]), self.vec.as_pointer())

    def widen(self, j, count) -> None:
        """Keys j .. j + count - 1 into ``kf`` as float32 (a half cache's halves widened exactly)."""
        b, intp, hd = self.b, self.intp, self.hd
        n, start = b.mul(count, hd), b.add(self.koff, b.mul(j, hd))
        whole = b.mul(b.sdiv(n, intp(LANES)), intp(LANES))
        with cgutils.for_range_slice(b, intp(0), whole, intp(LANES)) as (i, _):
            b.store(ir_load_floats(b, self.kp, b.add(start, i), self.vec), self._vat(self.kf, i), align=4)
        with cgutils.for_range_slice(b, whole, n, intp(1)) as (i, _):
            b.store(ir_load_floats(b, self.kp, b.add(start, i), self.f32), b.gep(self.kf, [i]))

    def lane_chains(self, lanes: tuple[int, ...], rows, steps: int | None) -> list[list]:
        """For each lane l of ``lanes`` and key row of ``kf`` in ``rows``: the sum over dimensions
        l, l + 8, ... (below ``full``), in that order, of the queries' times the key's, by fused
        multiply-adds from +0: lane l of ``_dot_keys``' vectors, for every query at once. Four
        lanes at a time: with ``_LANE_KEYS`` keys, 16 chains of multiply-adds in flight. ``steps``:
        ``full / 8`` when the caller knows it (written out), else None (a loop)."""
        b, intp, vec = self.b, self.intp, self.vec
        muladd, zero = ir_muladd(b, vec), ir.Constant(vec, [0.0] * LANES)

        def step(d, acc):
            out = []
            for lane, chain in zip(lanes, acc):
                at = b.add(d, intp(lane))
                qv = b.load(self._vat(self.qt, b.mul(at, intp(LANES))), align=4)
                out.append([muladd(qv, ir_splat(b, b.load(b.gep(self.kf, [b.add(row, at)])), vec), a)
                            for row, a in zip(rows, chain)])
            return out

        if steps is not None:
            acc = [[zero for _ in rows] for _ in lanes]
            for m in range(steps):
                acc = step(intp(8 * m), acc)
            return acc
        per = len(rows)
        flat = ir_carried_loop(b, self.full, 8, [zero] * (len(lanes) * per),
                               lambda d, acc: sum(step(d, [acc[i * per : (i + 1) * per] for i in range(len(lanes))]), []))
        return [flat[i * per : (i + 1) * per] for i in range(len(lanes))]

    def totals(self, first, count: int) -> None:
        """Scores of keys ``first`` .. ``first + count - 1`` of ``kf`` into rows of ``tt``: lanes
        added ``((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))``, then the dimensions past ``full`` in order.
        Written out for heads of 64 dimensions (the loop over 8 steps cost a fifth more)."""
        with self.b.if_else(self.b.icmp_signed("==", self.full, self.intp(_WRITTEN_OUT))) as (fixed, general):
            with fixed:
                self._totals(first, count, _WRITTEN_OUT // 8)
            with general:
                self._totals(first, count, None)

    def _totals(self, first, count: int, steps: int | None) -> None:
        b, intp, hd = self.b, self.intp, self.hd
        rows = [b.mul(b.add(first, intp(c)), hd) for c in range(count)]
        lanes = [sums for four in (0, 4) for sums in self.lane_chains(tuple(range(four, four + 4)), rows, steps)]
        pair = lambda x, y: [b.fadd(p, q) for p, q in zip(x, y)]  # noqa: E731
        low = pair(pair(lanes[0], lanes[1]), pair(lanes[2], lanes[3]))
        totals = pair(low, pair(pair(lanes[4], lanes[5]), pair(lanes[6], lanes[7])))
        muladd = ir_muladd(b, self.vec)
        for c, (row, total) in enumerate(zip(rows, totals)):
            slot = cgutils.alloca_once_value(b, total)
            with cgutils.for_range_slice(b, self.full, hd, intp(1)) as (d, _):
                qv = b.load(self._vat(self.qt, b.mul(d, intp(LANES))), align=4)
                b.store(muladd(qv, ir_splat(b, b.load(b.gep(self.kf, [b.add(row, d)])), self.vec), b.load(slot)), slot)
            b.store(b.load(slot), self._vat(self.tt, b.mul(b.add(first, intp(c)), intp(LANES))), align=4)

    def transposed_store(self, j) -> None:
        """``tt`` (a key a row) transposed into rows of ``s`` (a query a row), keys j .. j + LANES - 1."""
        b, intp = self.b, self.intp
        t = [b.load(self._vat(self.tt, intp(i * LANES)), align=4) for i in range(LANES)]
        step = 1
        while step < LANES:
            low = [L if not L & step else LANES + L - step for L in range(LANES)]
            high = [L + step if not L & step else LANES + L for L in range(LANES)]
            for i in (i for i in range(LANES) if not i & step):
                x, y = t[i], t[i | step]
                t[i] = b.shuffle_vector(x, y, ir.Constant(ir.VectorType(self.i32, LANES), low))
                t[i | step] = b.shuffle_vector(x, y, ir.Constant(ir.VectorType(self.i32, LANES), high))
            step *= 2
        for i in range(LANES):
            with b.if_then(b.icmp_signed("<", intp(i), self.nq)):
                b.store(t[i], self._vat(self.sp, b.add(b.mul(intp(i), self.sstride), j)), align=4)

    def emit(self) -> None:
        b, intp = self.b, self.intp
        groups = b.mul(b.sdiv(self.nkeys, intp(LANES)), intp(LANES))
        with cgutils.for_range_slice(b, intp(0), groups, intp(LANES)) as (j, _):
            self.widen(j, intp(LANES))
            with cgutils.for_range_slice(b, intp(0), intp(LANES), intp(_LANE_KEYS)) as (first, _):
                self.totals(first, _LANE_KEYS)
            self.transposed_store(j)
        with cgutils.for_range_slice(b, groups, self.nkeys, intp(1)) as (j, _):
            self.widen(j, intp(1))
            self.totals(intp(0), 1)
            with cgutils.for_range(b, self.nq) as loop:
                score = b.load(b.gep(self.tt, [loop.index]))
                b.store(score, b.gep(self.sp, [b.add(b.mul(loop.index, self.sstride), j)]))


@intrinsic
def _dot_keys_lanes(typingctx, k, nq, koff, hd, s, nkeys, scratch, sstride):
    """``_dot_keys``' scores, bit for bit, with the queries in a vector's lanes instead of the
    keys: ``s[i * sstride + j]`` for queries i < nq (at most ``LANES``, already transposed into
    ``scratch``, a vector per dimension, lanes past ``nq`` zero) and keys j < nkeys at ``k[koff +
    j * hd]``. Lane l of 8 of ``_dot_keys`` becomes a chain over dimensions l, l + 8, ... for all
    queries at once, each key's number broadcast: a score costs its multiply-adds over
    ``LANES`` queries, where ``_dot_keys`` pays for a reduction across lanes and uses half-width
    vectors. Keys go ``LANES`` at a time, widened once, and their scores are transposed in
    registers into the rows of ``s``. Why: ``_dot_keys`` spends about as much on its reductions and
    narrow vectors as on its multiply-adds, and scores were most of a many-row block's attention."""
    def codegen(context, builder, signature, args):
        _Lanes(context, builder, signature, args).emit()
        return context.get_dummy_value()

    return types.void(k, nq, koff, hd, s, nkeys, scratch, sstride), codegen
