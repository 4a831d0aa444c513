"""The LLVM IR of the integer kernel's inner loop (``intdot.int_linear_kernel``): output vectors
``j0 .. jn - 1`` of one tile over all its blocks of 32 inputs, for up to ``GROUP`` input rows, on
one instruction-set path (``vnni``, ``avx2``, ``portable``), with the layout constants it reads.
Why IR: numba's own loops keep the partial sums in memory; here the integer sums stay in
registers through a block and the outputs through all of a tile's blocks. ``intdot`` states the
rule every path computes and holds the kernels that call these.
"""
from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import _FEATURES, ir_splat

QK = 32  # inputs per block
OUT = 8  # outputs per vector: 8 int32 lanes of a 256-bit register
GROUP = 8  # input rows sharing one load (and unpacking) of a weight vector
MANY_TILES = 4  # tiles from which a matrix stays split by tiles among the threads at 6+ rows (``intdot``)
MAX_TILE = 512  # output rows per parallel task (see ``quant.MAX_TILE``)
NIBBLE_BYTES = OUT * QK // 2  # bytes of one output vector's block, packed: 4 vectors of 32
BYTE_BYTES = OUT * QK  # the same, one byte per weight: 8 vectors of 32
# Bytes ahead of the weights being multiplied that the kernel asks the CPU to fetch, into its L2
# (``prefetcht1``), not L1: a core holds few L1 misses in flight, too few to keep memory streaming
# while it computes, so with L1 prefetches a pass took about the time of its stream plus its sums.
# Measured on the 2-core Zen 4 (the layers' 120 products as in a pass, and whole passes after 256
# cached tokens, each against the L1 prefetch 4 KB ahead in alternating processes): docs/engine.md.
PREFETCH_BYTES = 8192
PREFETCH_LOCALITY = 2  # llvm.prefetch's locality: 2 is prefetcht1 (L2 and beyond) on x86
HAS_AVX2 = "+avx2" in _FEATURES
HAS_F16C = "+f16c" in _FEATURES  # fp16 -> fp32 in one instruction (``pack`` keeps fp16 scales only then)
HAS_512 = HAS_AVX2 and "+avx512vl" in _FEATURES  # 32 vector registers, EVEX-encoded 256-bit ops
HAS_VNNI = HAS_AVX2 and ((HAS_512 and "+avx512vnni" in _FEATURES) or "+avxvnni" in _FEATURES)
HAS_VNNI_512 = HAS_512 and "+avx512vnni" in _FEATURES  # ``vpdpbusd`` on 512-bit registers too
ALL_PATHS = ("vnni", "avx2", "portable")  # fastest first; a path's index is what the kernel takes
PATHS = tuple(p for p, ok in zip(ALL_PATHS, (HAS_VNNI, HAS_AVX2, True)) if ok)  # the ones this CPU runs

# Values per chunk, by input rows: accumulators (rows x cols), the weight vectors (two per packed
# vector once unpacked), the broadcast inputs and two constants must fit the registers without
# spilling: 16 on AVX2 (a value: one output vector).
_COLS = {1: 4, 2: 2, 3: 2}
# On ``vnni`` with AVX-512 VNNI a value holds two output vectors (16 lanes of a 512-bit register), so a
# chunk of two values takes four vectors at every row count in half the registers 256-bit values
# needed: 4 rows x 4 vectors of float and integer sums had been all 32 registers, and from 5 rows
# a chunk had to drop to 2 vectors, unpacking each weight twice as often. The same integers and
# the same fp32 operations lane by lane, so the same bits; whole passes: docs/engine.md.
# From PAIR_ROWS rows a chunk takes one value (two vectors) instead: its 512-bit sums of up to 8
# rows fit the registers with room to spare, each weight's unpacking still serves every row, and
# the kernel on a matrix in cache ran about 1.06x faster at 16 and 64 rows (1.1x on the LM head).
PAIRS_512 = 2
PAIR_ROWS = 5


class _Emitter:
    """The LLVM IR of output vectors ``j0 .. jn - 1`` of one tile, every block, for up to ``GROUP``
    input rows, on ``path`` (see the module). The integer sums are exact on every
    path: no pair sum reaches the 16-bit saturation of ``avx2``/``portable`` (4-bit weights: 8
    pairs of at most 2 * 15 * 127 = 3810; bytes: one pair of at most 2 * 128 * 127), and ``vnni``
    adds whole products into 32 bits."""

    def __init__(self, context, builder, signature, args, path: str):
        self.b, self.portable, self.vnni = builder, path == "portable", path == "vnni"
        self.per = 2 if self.vnni and HAS_VNNI_512 else 1  # output vectors a value holds
        arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]).data
                  for i in (0, 4, 7, 8, 11, 12, 14, 20)}
        self.q, self.xq, self.dx, self.xs, self.d, self.m, self.out, self.xc = (arrays[i] for i in (0, 4, 7, 8, 11, 12, 14,
                                                                                                  20))
        (self.qoff, self.jn, self.nibbles, self.xoff, self.k, self.soff, self.nb, self.dmoff, self.ooff,
         self.ostride, self.rows, self.prefetch, self.offsets, self.j0, self.g) = (
             args[i] for i in (1, 2, 3, 5, 6, 9, 10, 13, 15, 16, 17, 18, 19, 21, 22))
        self.half = signature.args[11].dtype == types.uint16  # scales stored as fp16 bits (``pack``)
        self.intp = self.qoff.type
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        self.i32 = i32
        self.v32i8, self.v16i16, self.v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
        self.v8f32 = ir.VectorType(ir.FloatType(), 8)
        self.i8 = i8
        module = builder.module
        fn = lambda name, ret, *args: cgutils.get_or_insert_function(module, ir.FunctionType(ret, list(args)), name)  # noqa: E731
        if self.vnni:  # i32 operands: the form every LLVM since 9 accepts (newer ones upgrade it)
            self.dpbusd_fn = {8: fn("llvm.x86.avx512.vpdpbusd.256", *[self.v8i32] * 4)}
            if self.per == 2:
                v16i32 = ir.VectorType(i32, 16)
                self.dpbusd_fn[16] = fn("llvm.x86.avx512.vpdpbusd.512", *[v16i32] * 4)
        if not self.portable:
            self.maddubs_fn = fn("llvm.x86.avx2.pmadd.ub.sw", self.v16i16, self.v32i8, self.v32i8)
            self.madd_fn = fn("llvm.x86.avx2.pmadd.wd", self.v8i32, self.v16i16, self.v16i16)
            self.sign_fn = fn("llvm.x86.avx2.psign.b", self.v32i8, self.v32i8, self.v32i8)
        self.abs_fn = fn("llvm.abs.v32i8", self.v32i8, self.v32i8, ir.IntType(1))
        self.prefetch_fn = fn("llvm.prefetch.p0i8", ir.VoidType(), i8.as_pointer(), i32, i32, i32)

    # -- integer operations, exact where no saturation occurs ------------------------------------
    def _pairs(self, v):
        """Neighbouring lanes added: ``v[0] + v[1], v[2] + v[3], ...``."""
        n = v.type.count
        pick = lambda start: ir.Constant(ir.VectorType(self.i32, n // 2), list(range(start, n, 2)))  # noqa: E731
        return self.b.add(self.b.shuffle_vector(v, v, pick(0)), self.b.shuffle_vector(v, v, pick(1)))

    def maddubs(self, u, s):
        """Unsigned bytes ``u`` times signed bytes ``s``, neighbouring products added (16 bits)."""
        if not self.portable:
            return self.b.call(self.maddubs_fn, [u, s])
        v32i16 = ir.VectorType(ir.IntType(16), 32)
        return self._pairs(self.b.mul(self.b.zext(u, v32i16), self.b.sext(s, v32i16)))

    def dot4(self, acc, u, s):
        """``acc`` plus, in each 32-bit lane, the four products of unsigned bytes ``u`` and signed
        bytes ``s`` (``vpdpbusd``, 8 or 16 lanes; exact: a lane's sum stays far inside 32 bits)."""
        kind = acc.type
        return self.b.call(self.dpbusd_fn[kind.count], [acc, self.b.bitcast(u, kind), self.b.bitcast(s, kind)])

    def kinds(self, per: int):
        """The byte, int32 and fp32 vector types of a value of ``per`` output vectors."""
        return (ir.VectorType(self.i8, 32 * per), ir.VectorType(self.i32, OUT * per),
                ir.VectorType(ir.FloatType(), OUT * per))

    def widen(self, v):
        """16-bit lanes to 32 bits, neighbours added."""
        if not self.portable:
            return self.b.call(self.madd_fn, [v, ir.Constant(self.v16i16, [1] * 16)])
        return self._pairs(self.b.sext(v, ir.VectorType(self.i32, 16)))

    def sign(self, x, w):
        """``x`` where ``w > 0``, ``-x`` where ``w < 0``, 0 where ``w == 0``."""
        if not self.portable:
            return self.b.call(self.sign_fn, [x, w])
        b, zero = self.b, ir.Constant(self.v32i8, [0] * 32)
        negated = b.select(b.icmp_signed("<", w, zero), b.neg(x), x)
        return b.select(b.icmp_signed("==", w, zero), zero, negated)

    # -- the block -------------------------------------------------------------------------------
    def emit(self) -> None:
        """A switch on the number of rows (1..GROUP) inside a branch on the layout."""
        b = self.b
        with b.if_else(b.icmp_signed("!=", self.nibbles, self.nibbles.type(0))) as (packed, plain):
            with packed:
                self._switch(True)
            with plain:
                self._switch(False)

    def _switch(self, nibbles: bool) -> None:
        """A case per number of rows, each over the tile's output vectors in chunks (``_chunk``)."""
        b, intp = self.b, self.intp
        merge = b.append_basic_block("rows.end")
        switch = b.switch(self.rows, merge)
        for rows in range(1, GROUP + 1):
            case = b.append_basic_block(f"rows{rows}")
            switch.add_case(self.rows.type(rows), case)
            b.position_at_end(case)
            cols = (PAIRS_512 if rows < PAIR_ROWS else 1) if self.per == 2 else _COLS.get(rows, 1)  # values a chunk takes
            width = cols * self.per  # output vectors a chunk takes
            full = b.sdiv(b.sub(self.jn, self.j0), intp(width))  # vectors j0 .. jn - 1
            with cgutils.for_range(b, full) as loop:
                self._chunk(nibbles, rows, cols, b.add(self.j0, b.mul(loop.index, intp(width))), self.per)
            if width > 1:  # the rest one vector at a time
                with cgutils.for_range_slice(b, b.add(self.j0, b.mul(full, intp(width))), self.jn, intp(1)) as (j, _):
                    self._chunk(nibbles, rows, 1, j, 1)
            b.branch(merge)
        b.position_at_end(merge)

    def _load(self, base, offset, kind):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), kind.as_pointer()), align=1)

    def _gather(self, base, offsets, kind):
        """A value of ``kind`` loaded at each of ``offsets``, side by side (one output vector's
        bytes or scales each: a value of two vectors is two loads, as the layout places them)."""
        parts = [self._load(base, at, kind) for at in offsets]
        while len(parts) > 1:
            n = parts[0].type.count
            pick = ir.Constant(ir.VectorType(self.i32, 2 * n), list(range(2 * n)))
            parts = [self.b.shuffle_vector(parts[i], parts[i + 1], pick) for i in range(0, len(parts), 2)]
        return parts[0]

    def _broadcast(self, offset, per: int = 1):
        """Four input bytes at ``offset`` in every 32-bit lane of a value of ``per`` vectors."""
        v8, v32, _ = self.kinds(per)
        return self.b.bitcast(ir_splat(self.b, self._load(self.xq, offset, self.i32), v32), v8)

    def _out_ptr(self, r: int, col, kind):
        b, intp = self.b, self.intp
        return b.bitcast(b.gep(self.out, [b.add(b.add(self.ooff, b.mul(intp(r), self.ostride)), col)]), kind.as_pointer())

    def _chunk(self, nibbles: bool, rows: int, cols: int, j, per: int) -> None:
        """Output vectors ``j .. j + cols * per - 1`` (``cols`` values of ``per`` vectors) for ``rows``
        input rows over every block of the tile: the outputs stay in registers from the first block
        to the last (one load and one store of ``out`` a chunk, not a block), added to in the rule's
        order, so the bits are the same."""
        b, intp = self.b, self.intp
        size = NIBBLE_BYTES if nibbles else BYTE_BYTES
        vf32 = self.kinds(per)[2]
        cols_at = [b.mul(b.add(j, intp(c * per)), intp(OUT)) for c in range(cols)]  # in a row of ``out``
        units = [[self._unit(b.add(j, intp(c * per + v))) for v in range(per)] for c in range(cols)]  # block 0s
        group_run = b.mul(b.sdiv(j, self.g), b.mul(self.nb, self.g))  # the chunk's group's block 0
        accs = [[cgutils.alloca_once(b, vf32) for _ in range(cols)] for _ in range(rows)]
        for r in range(rows):
            for c in range(cols):
                b.store(b.load(self._out_ptr(r, cols_at[c], vf32), align=1), accs[r][c])
        with cgutils.for_range(b, self.nb) as loop:
            blk = b.mul(loop.index, self.g)  # a group's block holds its g vectors' blocks
            qbase = [[b.add(self.qoff, b.mul(b.add(u, blk), intp(size))) for u in value] for value in units]
            scale_at = [[b.add(self.dmoff, b.mul(b.add(u, blk), intp(OUT))) for u in value] for value in units]
            self._prefetch(b.add(self.qoff, b.mul(b.add(group_run, blk), intp(size))), size,
                           b.add(self.dmoff, b.mul(b.add(group_run, blk), intp(OUT))))
            xrow = [b.add(b.add(self.xoff, b.mul(loop.index, intp(QK))), b.mul(intp(r), self.k)) for r in range(rows)]
            srow = [b.add(b.add(self.soff, loop.index), b.mul(intp(r), self.nb)) for r in range(rows)]
            sums = self._packed_sums(qbase, xrow, per) if nibbles else self._byte_sums(qbase, xrow, srow, per)
            with b.if_else(b.icmp_signed("!=", self.offsets, intp(0))) as (with_offsets, without):
                with with_offsets:
                    self._scale(sums, accs, srow, scale_at, True)
                with without:
                    self._scale(sums, accs, srow, scale_at, False)
        for r in range(rows):
            for c in range(cols):
                b.store(b.load(accs[r][c]), self._out_ptr(r, cols_at[c], vf32), align=1)

    def _unit(self, v):
        """Where vector ``v``'s block 0 lies, in vector-blocks from the tile's start: its group's
        run of blocks, then its place in the group (the layout: ``intdot.pack``)."""
        b = self.b
        return b.add(b.mul(b.sdiv(v, self.g), b.mul(self.nb, self.g)), b.srem(v, self.g))

    def _prefetch(self, at, size: int, scales) -> None:
        """Where ``prefetch`` is set, into L2: the weights ``PREFETCH_BYTES`` beyond ``at`` (a
        group's block, the chunk's place in the tile as the bytes lie) and the scales as many
        blocks beyond ``scales``."""
        b, intp = self.b, self.intp
        with b.if_then(b.icmp_signed("!=", self.prefetch, intp(0))):
            with cgutils.for_range_slice(b, intp(0), b.mul(self.g, intp(size)), intp(64)) as (line, _):  # cache lines
                ptr = b.gep(self.q, [b.add(at, b.add(line, intp(PREFETCH_BYTES)))])  # a prefetch never faults
                b.call(self.prefetch_fn, [ptr, self.i32(0), self.i32(PREFETCH_LOCALITY), self.i32(1)])
            ahead = b.add(scales, b.mul(self.g, intp(PREFETCH_BYTES // size * OUT)))
            for array in (self.d, self.m):
                ptr = b.bitcast(b.gep(array, [ahead]), ir.IntType(8).as_pointer())
                b.call(self.prefetch_fn, [ptr, self.i32(0), self.i32(PREFETCH_LOCALITY), self.i32(1)])

    def _load_scales(self, array, offsets):
        """The fp32 scales of the output vectors at ``offsets`` (eight each), widened exactly from
        fp16 bits where ``pack`` kept those."""
        if not self.half:
            return self._gather(array, offsets, self.v8f32)
        halves = self._gather(array, offsets, ir.VectorType(ir.IntType(16), OUT))
        return self.b.fpext(self.b.bitcast(halves, ir.VectorType(ir.HalfType(), halves.type.count)),
                            ir.VectorType(ir.FloatType(), halves.type.count))

    def _scale(self, sums, accs, srow, scale_at, offsets: bool) -> None:
        """``acc += (d * dx) * isum + m * xs`` for the chunk's block; without the ``m * xs`` term where
        ``pack`` found every ``m`` zero: adding +-0 leaves ``out`` as it was (``out`` starts at +0
        and a sum of nonzero values rounds to +0, never -0), so the result is the same bits."""
        b = self.b
        for c, at in enumerate(scale_at):
            dv = self._load_scales(self.d, at)
            mv = self._load_scales(self.m, at) if offsets else None
            for r, acc in enumerate(accs):
                term = self._term(dv, mv, srow[r], sums[r][c])
                b.store(b.fadd(b.load(acc[c]), term), acc[c])

    def _term(self, dv, mv, at, isum):
        """The rule's term of one block for a value's outputs of one row: ``(d * dx) * isum + m * xs``
        (no ``m * xs`` where ``mv`` is None), ``dx``/``xs`` at ``at``; lane by lane, whatever the
        value's width."""
        b, kind = self.b, dv.type
        dx = ir_splat(b, b.load(b.gep(self.dx, [at])), kind)
        term = b.fmul(b.fmul(dv, dx), b.sitofp(isum, kind))
        if mv is not None:
            xs = ir_splat(b, b.load(b.gep(self.xs, [at])), kind)
            term = b.fadd(term, b.fmul(mv, xs))
        return term

    def _zero_sums(self, kind, rows: int, cols: int):
        """Zero sums per row and value, as chains: two on ``vnni`` (the low and high nibbles, or
        the even and odd quads of bytes, add into separate registers, joined once a block), one
        on the other paths. One chain of a block's 8 ``vpdpbusd`` per row and value left a core as
        many chains in flight as rows, too few to cover the instruction's latency at its
        throughput, and the kernel on a matrix in cache ran faster with two; integer sums are
        exact in any order, so the bits are the same."""
        zero = ir.Constant(kind, [0] * kind.count)
        return [[[zero] * (2 if self.vnni else 1) for _ in range(cols)] for _ in range(rows)]

    def _joined(self, chains):
        """Each row and value's chains added into one sum."""
        return [[functools.reduce(self.b.add, value) for value in row] for row in chains]

    def _packed_sums(self, qbase, xrow, per: int):
        """Per row and value, the block's 32-bit sums from 4-bit weights (16-bit partial sums but on
        ``vnni``)."""
        b, intp = self.b, self.intp
        v8, v16, v32 = self.kinds(per)[0], self.v16i16, self.kinds(per)[1]
        low, four = ir.Constant(v8, [15] * v8.count), ir.Constant(v8, [4] * v8.count)
        acc = self._zero_sums(v32 if self.vnni else v16, len(xrow), len(qbase))
        for p in range(4):
            packed = [self._gather(self.q, [b.add(at, intp(32 * p)) for at in value], self.v32i8) for value in qbase]
            lo = [b.and_(v, low) for v in packed]
            hi = [b.lshr(v, four) for v in packed]
            for r, row in enumerate(xrow):
                xlo = self._broadcast(b.add(row, intp(4 * p)), per)
                xhi = self._broadcast(b.add(row, intp(4 * p + 16)), per)
                for c in range(len(qbase)):
                    if self.vnni:
                        low_sum, high_sum = acc[r][c]
                        acc[r][c] = [self.dot4(low_sum, lo[c], xlo), self.dot4(high_sum, hi[c], xhi)]
                    else:  # one 16-bit sum
                        (total,) = acc[r][c]
                        acc[r][c] = [b.add(b.add(total, self.maddubs(lo[c], xlo)), self.maddubs(hi[c], xhi))]
        sums = self._joined(acc)
        return sums if self.vnni else [[self.widen(a) for a in row] for row in sums]

    def _byte_sums(self, qbase, xrow, srow, per: int):
        """Per row and value, the block's 32-bit sums from signed byte weights (the sign trick)."""
        if self.vnni:
            return self._byte_sums_offset(qbase, xrow, srow, per)
        b, intp = self.b, self.intp
        acc = [[ir.Constant(self.v8i32, [0] * 8) for _ in qbase] for _ in xrow]
        for g in range(8):
            w = [self._gather(self.q, [b.add(at, intp(32 * g)) for at in value], self.v32i8) for value in qbase]
            aw = [b.call(self.abs_fn, [v, ir.IntType(1)(0)]) for v in w]
            for r, row in enumerate(xrow):
                xb = self._broadcast(b.add(row, intp(4 * g)))
                for c in range(len(qbase)):
                    acc[r][c] = b.add(acc[r][c], self.widen(self.maddubs(aw[c], self.sign(xb, w[c]))))
        return acc

    def _byte_sums_offset(self, qbase, xrow, srow, per: int):
        """The same sums on ``vnni`` without the sign trick: each weight byte's top bit flipped
        makes it ``q + 128`` as an unsigned byte (0..255), which multiplies the signed inputs, and
        ``128 * sum(xq)`` of the row's block (``xc``, formed once when the row is quantized) comes
        off: one cheap operation per weight vector, where taking ``128 * sum(q)`` off instead
        needed a product per output vector, as many as the row's own."""
        b, intp = self.b, self.intp
        v8, v32, _ = self.kinds(per)
        flip = ir.Constant(v8, [-128] * v8.count)  # 0x80
        acc = self._zero_sums(v32, len(xrow), len(qbase))
        for g in range(8):
            w = [b.xor(self._gather(self.q, [b.add(at, intp(32 * g)) for at in value], self.v32i8), flip)
                 for value in qbase]
            for r, row in enumerate(xrow):
                xb = self._broadcast(b.add(row, intp(4 * g)), per)
                for c in range(len(qbase)):
                    acc[r][c][g % 2] = self.dot4(acc[r][c][g % 2], w[c], xb)
        sums = []
        for r, row in enumerate(self._joined(acc)):
            taken = ir_splat(b, b.load(b.gep(self.xc, [srow[r]])), v32)
            sums.append([b.sub(a, taken) for a in row])
        return sums


def _block_intrinsic(path: str):
    # A path this CPU lacks is emitted as ``portable``: the kernel below names every path's block,
    # and none may hold an instruction the CPU cannot run.
    emitted = path if path in PATHS else "portable"

    def block(typingctx, q, qoff, jn, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
              rows, prefetch, offsets, xc, j0, g):
        def codegen(context, builder, signature, args):
            _Emitter(context, builder, signature, args, emitted).emit()
            return context.get_dummy_value()

        sig = types.void(q, qoff, jn, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
                         rows, prefetch, offsets, xc, j0, g)
        return sig, codegen

    block.__name__ = block.__qualname__ = f"int_block_{path}"
    return intrinsic(block)


_block_vnni, _block_avx2, _block_portable = (_block_intrinsic(p) for p in ALL_PATHS)
