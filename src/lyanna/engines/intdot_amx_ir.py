"""The LLVM IR of the AMX kernel's loop (``intdot_amx.amx_by_tiles``): every pair of output vectors
of a tile through every block, for one group of up to ``TILE_ROWS`` input rows.

Why IR: written as numba loops, the work around the tile product (the weights' unpacking, the
scales, the rule's fp32 step) was not vectorized and took several times the whole VNNI kernel; here
it is 64-byte vectors: a B tile is built from 16 loads of 32 bytes, and each row's step for the
pair's 16 outputs is a few 16-lane operations.

Per chunk of ``CHUNK`` blocks of a pair, in three passes: each block's B tile (``[quad][16
outputs][4 inputs]``, the two vectors' quads side by side; nibbles widened) is written to its own
slot of ``weights``; then each block's product ``sums = A @ B`` (exact int32) goes to its slot of
``sums``, by the tile instructions where this build targets AMX and by the same sums in plain
vector IR where it does not (every host tests the layout and the addressing that way); then per
row, block by block, ``out += (d * dx) * isum (+ m * xs)``, operation for operation the rule of
``intdot``. Why passes: a tile load waits until the stores before it have left the core, and a
vector load of stored sums waits for the tile store; block by block (unpack, load, product,
store, step) each block paid those waits in full, which made the tiles slower than VNNI (an AMX
Xeon's two cores, docs/engine.md); a chunk pays them about once.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .intdot_ir import NIBBLE_BYTES, OUT, PREFETCH_BYTES, PREFETCH_LOCALITY, QK
from .kernels import _FEATURES, ir_splat

TILE_ROWS = 16  # input rows of an A tile (and of the C tile of sums)
PAIR = 2 * OUT  # outputs of one product: a B tile's 16 columns, two output vectors of ``pack``
QUADS = QK // 4  # rows of a B tile: one per four inputs of the block
B_BYTES = QUADS * PAIR * 4  # a B tile: 8 rows of 64 bytes
C_STRIDE = PAIR * 4  # bytes per row of the stored sums
TILE_SETS = ((0, 1, 2), (3, 4, 5))  # tile registers (C the sums, A the inputs, B the weights), blocks taking turns
CHUNK = 8  # most blocks whose products are issued before their fp32 steps (their sums: 8 KB at most)
HAS_AMX = "+amx-int8" in _FEATURES and "+amx-tile" in _FEATURES  # tile code compiled in (else emulated)


def _i8p():
    return ir.IntType(8).as_pointer()


def _declare(builder, name: str, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), list(args)), name)


class _PairsEmitter:
    """The IR of ``_pairs`` (see the module); ``amx``: tile instructions, else their sums emulated."""

    def __init__(self, context, builder, signature, args, amx: bool):
        self.b, self.amx = builder, amx
        data = lambda i: context.make_array(signature.args[i])(context, builder, args[i]).data  # noqa: E731
        self.q, self.xq, self.dx, self.xs, self.d, self.m, self.out, self.weights, self.sums = (
            data(i) for i in (0, 5, 8, 9, 11, 12, 14, 19, 20))
        (self.qoff, self.nb, self.g, self.size, self.xoff, self.k, self.soff, self.dmoff, self.ooff, self.ostride,
         self.rows, self.offsets, self.pairs) = (args[i] for i in (1, 2, 3, 4, 6, 7, 10, 13, 15, 16, 17, 18, 21))
        self.half = signature.args[11].dtype == types.uint16  # scales as fp16 bits (``intdot.pack``)
        self.intp = self.qoff.type
        i8, i32 = ir.IntType(8), ir.IntType(32)
        self.i8, self.i32 = i8, i32
        self.v64i8 = ir.VectorType(i8, 64)
        self.v16i32, self.v16f32 = ir.VectorType(i32, PAIR), ir.VectorType(ir.FloatType(), PAIR)
        acc = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), TILE_ROWS * PAIR))  # the pair's sums
        self.acc = builder.bitcast(acc, ir.FloatType().as_pointer())
        self.dchunk, self.mchunk = (
            builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), CHUNK * PAIR)),
                            ir.FloatType().as_pointer()) for _ in range(2))  # a chunk's scales as fp32

    def _at(self, base, offset, kind):
        return self.b.bitcast(self.b.gep(base, [offset]), kind.as_pointer())

    def _load(self, base, offset, kind):
        return self.b.load(self._at(base, offset, kind), align=1)

    def _store(self, value, base, offset):
        self.b.store(value, self._at(base, offset, value.type), align=1)

    def emit(self) -> None:
        b, intp = self.b, self.intp
        chunks = b.sdiv(b.add(self.nb, intp(CHUNK - 1)), intp(CHUNK))  # as even as they go: 18 blocks as 6 + 6 + 6
        self.chunk = b.sdiv(b.add(self.nb, b.sub(chunks, intp(1))), chunks)
        with cgutils.for_range(b, self.pairs) as pair_loop:
            first = b.mul(pair_loop.index, intp(2))  # the pair's first vector in the tile
            j, w = b.sdiv(first, self.g), b.srem(first, self.g)
            col = b.add(self.ooff, b.mul(first, intp(OUT)))
            with cgutils.for_range(b, self.rows) as row_loop:
                self._store(ir.Constant(self.v16f32, [0.0] * PAIR), self.acc, b.mul(row_loop.index, intp(PAIR)))
            with cgutils.for_range_slice(b, intp(0), self.nb, self.chunk) as (start, _):
                n = b.sub(self.nb, start)
                n = b.select(b.icmp_signed("<", n, self.chunk), n, self.chunk)
                # the chunk's B tiles, then its products, then its fp32 steps (see the module)
                with cgutils.for_range(b, n) as block_loop:
                    self._block_unpack(start, block_loop.index, j, w)
                with cgutils.for_range(b, n) as block_loop:
                    self._block_product(start, block_loop.index, j, w)
                with b.if_else(b.icmp_signed("!=", self.offsets, intp(0))) as (with_offsets, without):
                    with with_offsets:
                        self._add_chunk(start, n, j, w, True)
                    with without:
                        self._add_chunk(start, n, j, w, False)
            with cgutils.for_range(b, self.rows) as row_loop:  # the pair's outputs, from the sums of every block
                r = row_loop.index
                self._store(self._load(self.acc, b.mul(r, intp(PAIR)), self.v16f32), self.out,
                            b.add(col, b.mul(r, self.ostride)))

    def _block_unpack(self, start, i, j, w) -> None:
        """Block ``start + i``'s B tile (pair: first vector ``w`` of group ``j``) into ``weights[i]``."""
        b, intp = self.b, self.intp
        blk = b.add(start, i)
        unit = b.add(b.mul(b.add(b.mul(j, self.nb), blk), self.g), w)  # the vector's block (``pack``)
        qat = b.add(self.qoff, b.mul(unit, self.size))
        self._prefetch(qat)
        weights = b.gep(self.weights, [b.mul(i, intp(B_BYTES))])
        with b.if_else(b.icmp_signed("==", self.size, intp(NIBBLE_BYTES))) as (packed, plain):
            with packed:
                self._unpack(qat, weights, True)
            with plain:
                self._unpack(qat, weights, False)

    def _block_product(self, start, i, j, w) -> None:
        """Block ``start + i``'s sums into ``sums[i]`` from its B tile in ``weights[i]``; blocks
        take turns between the two tile sets."""
        b, intp = self.b, self.intp
        weights = b.gep(self.weights, [b.mul(i, intp(B_BYTES))])
        sums = b.bitcast(b.gep(self.sums, [b.mul(i, intp(TILE_ROWS * PAIR))]), self.sums.type)
        xat = b.add(self.xoff, b.mul(b.add(start, i), intp(QK)))
        if not self.amx:
            self._emulated_product(xat, weights, sums)
            return
        with b.if_else(b.icmp_signed("==", b.and_(i, intp(1)), intp(0))) as (even, odd):
            with even:
                self._product(xat, weights, sums, 0)
            with odd:
                self._product(xat, weights, sums, 1)

    def _prefetch(self, qat) -> None:
        """The pair's weights ``PREFETCH_BYTES`` ahead into L2, as the VNNI kernel asks for them."""
        b, intp = self.b, self.intp
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [_i8p(), self.i32, self.i32,
                                                                                      self.i32]), "llvm.prefetch.p0i8")
        with cgutils.for_range_slice(b, intp(0), b.mul(self.size, intp(2)), intp(64)) as (line, _):
            ptr = b.gep(self.q, [b.add(qat, b.add(line, intp(PREFETCH_BYTES)))])  # a prefetch never faults
            b.call(fn, [b.bitcast(ptr, _i8p()), self.i32(0), self.i32(PREFETCH_LOCALITY), self.i32(1)])

    def _unpack(self, qat, weights, nibbles: bool) -> None:
        """The B tile into ``weights``: row ``p``, the first vector's quad ``p`` then the second's
        (32 bytes each); packed nibbles hold quad ``p`` low and ``p + 4`` high."""
        b, intp = self.b, self.intp
        v32i8 = ir.VectorType(self.i8, 32)
        join = ir.Constant(ir.VectorType(self.i32, 64), list(range(64)))
        for p in range(4 if nibbles else QUADS):
            halves = [self._load(self.q, b.add(qat, b.add(b.mul(self.size, intp(v)), intp(32 * p))), v32i8)
                      for v in range(2)]
            row = b.shuffle_vector(halves[0], halves[1], join)
            if not nibbles:
                self._store(row, weights, intp(64 * p))
                continue
            self._store(b.and_(row, ir.Constant(self.v64i8, [15] * 64)), weights, intp(64 * p))
            self._store(b.lshr(row, ir.Constant(self.v64i8, [4] * 64)), weights, intp(64 * (p + 4)))

    def _product(self, xat, weights, sums, turn: int) -> None:
        """``sums = A @ B`` on the tiles of set ``turn`` (``TILE_SETS``): A the rows' 32 inputs of
        the block (row stride ``k``), B the tile in ``weights``."""
        b, i8, i64 = self.b, self.i8, ir.IntType(64)
        c, a, w = (i8(t) for t in TILE_SETS[turn])
        load = _declare(b, "llvm.x86.tileloadd64", i8, _i8p(), i64)
        b.call(_declare(b, "llvm.x86.tilezero", i8), [c])
        b.call(load, [a, b.bitcast(b.gep(self.xq, [xat]), _i8p()), b.sext(self.k, i64)])
        b.call(load, [w, b.bitcast(weights, _i8p()), i64(PAIR * 4)])
        b.call(_declare(b, "llvm.x86.tdpbssd", i8, i8, i8), [c, a, w])
        b.call(_declare(b, "llvm.x86.tilestored64", i8, _i8p(), i64), [c, b.bitcast(sums, _i8p()), i64(C_STRIDE)])

    def _emulated_product(self, xat, weights, sums) -> None:
        """``_product``'s sums in plain vector IR: per row and quad, four input bytes against the B
        tile's row, each output's four products added (``TDPBSSD``'s rule: signed bytes, exact)."""
        b, intp, i32 = self.b, self.intp, self.i32
        v64i32 = ir.VectorType(i32, 64)
        v4i8 = ir.VectorType(self.i8, 4)
        spread = ir.Constant(v64i32, [t % 4 for t in range(64)])
        with cgutils.for_range(b, self.rows) as row_loop:
            at = b.add(xat, b.mul(row_loop.index, self.k))
            acc = ir.Constant(self.v16i32, [0] * PAIR)
            for p in range(QUADS):
                four = b.sext(self._load(self.xq, b.add(at, intp(4 * p)), v4i8), ir.VectorType(i32, 4))
                inputs = b.shuffle_vector(four, four, spread)
                row = b.sext(self._load(weights, intp(64 * p), self.v64i8), v64i32)
                acc = b.add(acc, self._fours(b.mul(inputs, row)))
            self._store(acc, sums, b.mul(row_loop.index, intp(PAIR)))

    def _fours(self, v):
        """Lanes ``4n .. 4n + 3`` of ``v`` added, for each ``n``."""
        for _ in range(2):
            n = v.type.count
            pick = lambda start: ir.Constant(ir.VectorType(self.i32, n // 2), list(range(start, n, 2)))  # noqa: E731
            v = self.b.add(self.b.shuffle_vector(v, v, pick(0)), self.b.shuffle_vector(v, v, pick(1)))
        return v

    def _scales(self, array, sat):
        """The pair's 16 scales of this block as fp32 (widened exactly from fp16 bits where kept so)."""
        if not self.half:
            return self._load(array, sat, self.v16f32)
        bits = self._load(array, sat, ir.VectorType(ir.IntType(16), PAIR))
        return self.b.fpext(self.b.bitcast(bits, ir.VectorType(ir.HalfType(), PAIR)), self.v16f32)

    def _add_chunk(self, start, n, j, w, offsets: bool) -> None:
        """Each row's steps for the chunk's blocks, in the rule's operations and order: ``term =
        (d * dx) * isum``, ``+ m * xs`` where ``m`` was kept, then ``out + term``, ``out`` the
        pair's sums so far (``acc``, contiguous: rows of a wide ``out`` lie a multiple of 4 KB
        apart, in one cache set). Rows outside, blocks inside: a row's sums stay in a register
        through the chunk; the chunk's scales are widened to fp32 once, before."""
        b, intp = self.b, self.intp
        with cgutils.for_range(b, n) as block_loop:
            i = block_loop.index
            unit = b.add(b.mul(b.add(b.mul(j, self.nb), b.add(start, i)), self.g), w)
            sat = b.add(self.dmoff, b.mul(unit, intp(OUT)))
            self._store(self._scales(self.d, sat), self.dchunk, b.mul(i, intp(PAIR)))
            if offsets:
                self._store(self._scales(self.m, sat), self.mchunk, b.mul(i, intp(PAIR)))
        with cgutils.for_range(b, self.rows) as row_loop:
            r = row_loop.index
            row = b.add(b.add(self.soff, b.mul(r, self.nb)), start)
            at = b.mul(r, intp(PAIR))
            with cgutils.for_range(b, n) as block_loop:
                i = block_loop.index
                isum = b.sitofp(self._load(self.sums, b.add(b.mul(i, intp(TILE_ROWS * PAIR)), at), self.v16i32),
                                self.v16f32)
                dv = self._load(self.dchunk, b.mul(i, intp(PAIR)), self.v16f32)
                term = b.fmul(b.fmul(dv, ir_splat(b, b.load(b.gep(self.dx, [b.add(row, i)])), self.v16f32)), isum)
                if offsets:
                    mv = self._load(self.mchunk, b.mul(i, intp(PAIR)), self.v16f32)
                    term = b.fadd(term, b.fmul(mv, ir_splat(b, b.load(b.gep(self.xs, [b.add(row, i)])), self.v16f32)))
                self._store(b.fadd(self._load(self.acc, at, self.v16f32), term), self.acc, at)


@intrinsic
def _pairs(typingctx, q, qoff, nb, g, size, xq, xoff, k, dx, xs, soff, d, m, dmoff, out, ooff, ostride, rows, offsets,
           weights, sums, pairs):
    """Every pair of output vectors of one tile through every block for ``rows`` (<= TILE_ROWS)
    input rows, into ``out``. Flat arrays with offsets: ``q`` the tile's
    weights from ``qoff`` (``nb`` blocks, groups of ``g`` vectors of ``size`` bytes), ``xq`` the
    rows from ``xoff`` (``k`` a row), ``dx``/``xs`` theirs from ``soff`` (``nb`` a row), ``d``/``m``
    the tile's scales from ``dmoff``, ``out`` the rows' outputs of the tile from ``ooff``
    (``ostride`` a row); ``offsets``: 1 where ``m`` was kept; ``weights``/``sums``: room for
    ``CHUNK`` B tiles and ``CHUNK`` C tiles (``B_BYTES``, ``TILE_ROWS * PAIR`` each); ``pairs``: the tile's vectors / 2. Tiles configured by the caller."""
    sig = types.void(q, qoff, nb, g, size, xq, xoff, k, dx, xs, soff, d, m, dmoff, out, ooff, ostride, rows, offsets,
                     weights, sums, pairs)

    def codegen(context, builder, signature, args):
        _PairsEmitter(context, builder, signature, args, HAS_AMX).emit()
        return context.get_dummy_value()

    return sig, codegen
