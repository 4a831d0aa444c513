"""``x @ W.T`` on a GGUF's blocks with 8-bit activations and integer dot products (``--weights gguf``).

Why: a verify block of 8 rows on the float kernel (``quant._quant_linear_kernel``) widened every
weight byte to fp32 and multiplied in fp32, 2.3-2.5x the time of one row, so verifying a draft tree
cost far more than the step it saves. CPU engines that are fast on batches quantize each input row
to 8 bits per block of 32 and take integer dot products against the 4/8-bit weights: on AVX2,
``vpmaddubsw`` multiplies 32 byte pairs and adds neighbours into 16-bit sums in one instruction,
four times the multiply-adds of an fp32 FMA, and a 4-bit weight stays 4 bits (packed nibbles,
unpacked by a shift and a mask) until it is multiplied, so a one-row pass reads half the bytes.

The rule, the same on every path (``reference`` is it in numpy):
  * each input row, per block of 32: ``dx = max|x| / 127``, ``xq = rint(x / dx)`` as int8 (computed
    as ``x * (1 / dx)``, 0 where the block is 0), ``xs = sum(x)`` in float64 in a fixed order
    (eight lanes ``((x[j] + x[j+8]) + x[j+16]) + x[j+24]``, then lanes j + 4, then j + 2, then
    the two), rounded once to fp32;
  * per block, ``isum = sum(q * xq)`` exactly in integers;
  * ``out = out + ((d * dx) * float(isum) + m * xs)`` over blocks in order, from 0, in fp32 without
    fused multiply-adds.
Each row's output depends on that row alone, so it is bit-identical alone, in a verify block of
any size, or beside other sequences in a batch (greedy equality with ``ar`` relies on it).

Layouts: matrices whose values are all 0..15 (Q4_1) keep two weights per byte; others (Q8_0, and
Q4_0's -8..7) one signed byte, multiplied by the sign trick (``|q|`` times ``x`` with ``q``'s sign;
``vnni`` instead offsets the inputs to unsigned bytes and takes the offset's products off). Output rows go 8 to a vector (8 int32 lanes of a 256-bit
register); each vector's 32 weights of a block are ``[quad p][output][4 inputs]`` so a broadcast of
four input bytes meets four consecutive weights of every output. The packed layout holds quad
``p`` in the low nibbles and quad ``p + 4`` in the high ones.

Paths (``PATH``: the first of ``PATHS`` the CPU has, or ``LYANNA_INTDOT_PATH``, chosen at import): ``vnni``
(``vpdpbusd``, AVX-512 VNNI or AVX-VNNI: four byte products added into each 32-bit lane in one
instruction, so no 16-bit partial sums and no widening step, and with AVX-512's 32 registers more
output vectors share each broadcast input), ``avx2`` (``vpmaddubsw`` + ``vpmaddwd``; AVX-512 CPUs
run it too) and ``portable`` (the same integers in plain LLVM vector IR, for any CPU). Every path
computes the same integers, so they agree bit for bit; each is tested against ``reference``.
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .kernels import _FEATURES, ir_splat

QK = 32  # inputs per block
OUT = 8  # outputs per vector: 8 int32 lanes of a 256-bit register
GROUP = 8  # input rows sharing one load (and unpacking) of a weight vector
# The row group on ``vnni`` with AVX-512's registers for matrices cut into at least ``MANY_TILES``
# tiles (a layer's gate and up projections, the LM head): 4 rows, each chunk 4 output vectors
# wide (``_COLS_32``). On the 2-core Zen 4 (2026-11-26, each kind of matrix over all 30 layers,
# weights streamed as in a pass) groups of 4 ran gate_up 0.93x / 0.79x / 0.75x the time of groups
# of 8 for 8 / 16 / 64 rows and the LM head 0.73x at 64 rows, while the two-tile matrices ran
# 1.00-1.09x; whole passes after 256 cached tokens took 67.5-68.7 ms instead of 71.9 for 64 rows,
# the same within noise for 1 to 16. Only the speed changes: every row's sums are the same.
MANY_TILES, MANY_TILES_GROUP = 4, 4
MAX_TILE = 512  # output rows per parallel task (see ``quant.MAX_TILE``)
NIBBLE_BYTES = OUT * QK // 2  # bytes of one output vector's block, packed: 4 vectors of 32
BYTE_BYTES = OUT * QK  # the same, one byte per weight: 8 vectors of 32
PREFETCH_BYTES = 4096  # see quant.PREFETCH_BYTES
HAS_AVX2 = "+avx2" in _FEATURES
HAS_F16C = "+f16c" in _FEATURES  # fp16 -> fp32 in one instruction (``pack`` keeps fp16 scales only then)
HAS_512 = HAS_AVX2 and "+avx512vl" in _FEATURES  # 32 vector registers, EVEX-encoded 256-bit ops
HAS_VNNI = HAS_AVX2 and ((HAS_512 and "+avx512vnni" in _FEATURES) or "+avxvnni" in _FEATURES)
ALL_PATHS = ("vnni", "avx2", "portable")  # fastest first; a path's index is what the kernel takes
PATHS = tuple(p for p, ok in zip(ALL_PATHS, (HAS_VNNI, HAS_AVX2, True)) if ok)  # the ones this CPU runs


def _chosen_path() -> str:
    """The fastest path this CPU runs, or the one ``LYANNA_INTDOT_PATH`` names (to compare paths,
    or to rule one out): every path gives the same bits, so this changes speed only."""
    name = os.environ.get("LYANNA_INTDOT_PATH", "").strip() or PATHS[0]
    if name not in PATHS:
        raise ValueError(f"LYANNA_INTDOT_PATH={name!r}: this CPU runs {', '.join(PATHS)}")
    return name


PATH = _chosen_path()  # the path every matrix takes, read at each call (a test may set it)


def path_index() -> int:
    """``PATH`` as the ``path`` argument of ``int_linear_kernel``."""
    return ALL_PATHS.index(PATH)

# Output vectors per chunk, by input rows: accumulators (rows x cols), the weight vectors (two per
# packed vector once unpacked), the broadcast inputs and two constants must fit the registers
# without spilling: 16 on AVX2, 32 with AVX-512's EVEX encoding.
_COLS = {1: 4, 2: 2, 3: 2}
_COLS_32 = {1: 4, 2: 4, 3: 4, 4: 4, 5: 2, 6: 2, 7: 2, 8: 2}


@intrinsic
def _quantize_block(typingctx, x, xoff, xq, dx, xs, soff):
    """One block of 32 inputs at ``x[xoff:]`` by the module's rule, in vectors of 8: ``xq`` at the
    same offset, ``dx[soff]`` and ``xs[soff]``. The sum goes in float64 in the order the rule
    states (lane j of eight: ``((x[j] + x[j+8]) + x[j+16]) + x[j+24]``, then the lanes pairwise),
    which the vector unit runs as it stands: summed one input after another in fp32 it was a chain
    of 31 dependent additions a block, and quantizing took a tenth of a 64-row pass. Why float64:
    the model is sensitive to this sum's rounding (it multiplies Q4_1's offsets, which nearly
    cancel the scaled integer sums); in fp32 the perplexity of ``scripts/measure-int8-quality.py``
    moved by 0.5% between two summation orders; the float64 sum is exact unless a block's values
    span more than about 24 binary orders of magnitude, and is then rounded once."""
    def codegen(context, builder, signature, args):
        b = builder
        xp, xqp, dxp, xsp = (context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 2, 3, 4))
        xoff, soff = args[1], args[5]
        f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
        v8f, v8i, v8b = ir.VectorType(f32, 8), ir.VectorType(i32, 8), ir.VectorType(i8, 8)
        module = b.module
        fn = lambda name, ret, *a: cgutils.get_or_insert_function(module, ir.FunctionType(ret, list(a)), name)  # noqa: E731
        fabs, rint = fn("llvm.fabs.v8f32", v8f, v8f), fn("llvm.rint.v8f32", v8f, v8f)
        vmin = fn("llvm.minnum.v8f32", v8f, v8f, v8f)

        def vmax(pair):
            kind = pair[0].type
            name = f"llvm.maxnum.v{kind.count}f32" if isinstance(kind, ir.VectorType) else "llvm.maxnum.f32"
            return b.call(fn(name, kind, kind, kind), pair)

        at = lambda ptr, i, kind: b.bitcast(b.gep(ptr, [i]), kind.as_pointer())  # noqa: E731
        parts = [b.load(at(xp, b.add(xoff, xoff.type(8 * g)), v8f), align=4) for g in range(4)]
        pick = lambda v, idx: b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, len(idx)), idx))  # noqa: E731
        wide = [b.fpext(v, ir.VectorType(ir.DoubleType(), 8)) for v in parts]
        lanes = b.fadd(b.fadd(b.fadd(wide[0], wide[1]), wide[2]), wide[3])
        half = b.fadd(pick(lanes, [0, 1, 2, 3]), pick(lanes, [4, 5, 6, 7]))
        quarter = b.fadd(pick(half, [0, 1]), pick(half, [2, 3]))
        total = b.fadd(b.extract_element(quarter, i32(0)), b.extract_element(quarter, i32(1)))
        b.store(b.fptrunc(total, f32), b.gep(xsp, [soff]))
        mags = [b.call(fabs, [v]) for v in parts]
        top = vmax([vmax([mags[0], mags[1]]), vmax([mags[2], mags[3]])])  # a maximum is exact in any order
        top = vmax([pick(top, [0, 1, 2, 3]), pick(top, [4, 5, 6, 7])])
        top = vmax([pick(top, [0, 1]), pick(top, [2, 3])])
        amax = vmax([b.extract_element(top, i32(0)), b.extract_element(top, i32(1))])
        step = b.fdiv(amax, f32(127.0))
        b.store(step, b.gep(dxp, [soff]))
        inv = b.select(b.fcmp_ordered(">", step, f32(0.0)), b.fdiv(f32(1.0), step), f32(0.0))
        scale, lo, hi = ir_splat(b, inv, v8f), ir_splat(b, f32(-127.0), v8f), ir_splat(b, f32(127.0), v8f)
        for g, v in enumerate(parts):
            r = b.call(vmin, [vmax([b.call(rint, [b.fmul(v, scale)]), lo]), hi])
            b.store(b.trunc(b.fptosi(r, v8i), v8b), at(xqp, b.add(xoff, xoff.type(8 * g)), v8b), align=1)
        return context.get_dummy_value()

    return types.void(x, xoff, xq, dx, xs, soff), codegen


@njit(cache=True, nogil=True)
def quantize_rows(x):  # pragma: no cover - compiled
    """``(xq, dx, xs)`` of each row of ``x`` [rows, k] per block of 32 (see the module's rule)."""
    rows, k = x.shape
    nb = k // QK
    xq = np.empty((rows, k), np.int8)
    dx = np.empty((rows, nb), np.float32)
    xs = np.empty((rows, nb), np.float32)
    flat, qflat, dflat, sflat = x.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1)
    for i in range(rows):
        for b in range(nb):
            _quantize_block(flat, i * k + b * QK, qflat, dflat, sflat, i * nb + b)
    return xq, dx, xs


class _Emitter:
    """The LLVM IR of one block (32 inputs) of one tile for up to ``GROUP`` input rows, every
    output vector of the tile, on ``path`` (see the module). The integer sums are exact on every
    path: no pair sum reaches the 16-bit saturation of ``avx2``/``portable`` (4-bit weights: 8
    pairs of at most 2 * 15 * 127 = 3810; bytes: one pair of at most 2 * 128 * 127), and ``vnni``
    adds whole products into 32 bits."""

    def __init__(self, context, builder, signature, args, path: str):
        self.b, self.portable, self.vnni = builder, path == "portable", path == "vnni"
        self.cols = _COLS_32 if self.vnni and HAS_512 else _COLS
        arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 4, 7, 8, 11, 12, 14)}
        self.q, self.xq, self.dx, self.xs, self.d, self.m, self.out = (arrays[i] for i in (0, 4, 7, 8, 11, 12, 14))
        (self.qoff, self.nvec, self.nibbles, self.xoff, self.k, self.soff, self.nb, self.dmoff, self.ooff,
         self.ostride, self.rows, self.prefetch, self.offsets) = (args[i] for i in (1, 2, 3, 5, 6, 9, 10, 13, 15, 16,
                                                                                   17, 18, 19))
        self.half = signature.args[11].dtype == types.uint16  # scales stored as fp16 bits (``pack``)
        self.intp = self.qoff.type
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        self.i32 = i32
        self.v32i8, self.v16i16, self.v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
        self.v8f32 = ir.VectorType(ir.FloatType(), 8)
        module = builder.module
        fn = lambda name, ret, *args: cgutils.get_or_insert_function(module, ir.FunctionType(ret, list(args)), name)  # noqa: E731
        if self.vnni:  # i32 operands: the form every LLVM since 9 accepts (newer ones upgrade it)
            self.dpbusd_fn = fn("llvm.x86.avx512.vpdpbusd.256", self.v8i32, self.v8i32, self.v8i32, self.v8i32)
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
        bytes ``s`` (``vpdpbusd``; exact: a lane's sum stays far inside 32 bits)."""
        v8i32 = self.v8i32
        return self.b.call(self.dpbusd_fn, [acc, self.b.bitcast(u, v8i32), self.b.bitcast(s, v8i32)])

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
        b, intp = self.b, self.intp
        merge = b.append_basic_block("rows.end")
        switch = b.switch(self.rows, merge)
        for rows in range(1, GROUP + 1):
            case = b.append_basic_block(f"rows{rows}")
            switch.add_case(self.rows.type(rows), case)
            b.position_at_end(case)
            cols = self.cols.get(rows, 1)
            full = b.sdiv(self.nvec, intp(cols))
            with cgutils.for_range(b, full) as loop:
                self._chunk(nibbles, rows, cols, b.mul(loop.index, intp(cols)))
            if cols > 1:
                with cgutils.for_range_slice(b, b.mul(full, intp(cols)), self.nvec, intp(1)) as (j, _):
                    self._chunk(nibbles, rows, 1, j)
            b.branch(merge)
        b.position_at_end(merge)

    def _load(self, base, offset, kind):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), kind.as_pointer()), align=1)

    def _broadcast(self, offset):
        """Four input bytes at ``offset`` in every 32-bit lane."""
        return self.b.bitcast(ir_splat(self.b, self._load(self.xq, offset, self.i32), self.v8i32), self.v32i8)

    def _chunk(self, nibbles: bool, rows: int, cols: int, j) -> None:
        """Output vectors ``j .. j + cols - 1`` for ``rows`` input rows: integer sums, then the scales."""
        b, intp = self.b, self.intp
        size = NIBBLE_BYTES if nibbles else BYTE_BYTES
        qbase = [b.add(self.qoff, b.mul(b.add(j, intp(c)), intp(size))) for c in range(cols)]
        with b.if_then(b.icmp_signed("!=", self.prefetch, intp(0))):
            for c in range(cols):
                for line in range(0, size, 64):  # 64-byte cache lines; a prefetch never faults
                    ptr = b.gep(self.q, [b.add(qbase[c], intp(PREFETCH_BYTES + line))])
                    b.call(self.prefetch_fn, [ptr, self.i32(0), self.i32(3), self.i32(1)])
        xrow = [b.add(self.xoff, b.mul(intp(r), self.k)) for r in range(rows)]
        sums = self._packed_sums(qbase, xrow) if nibbles else self._byte_sums(qbase, xrow)
        with b.if_else(b.icmp_signed("!=", self.offsets, intp(0))) as (with_offsets, without):
            with with_offsets:
                self._scale(sums, rows, cols, j, True)
            with without:
                self._scale(sums, rows, cols, j, False)

    def _load_scales(self, array, offset):
        """Eight fp32 scales at ``offset``, widened exactly from fp16 bits where ``pack`` kept those."""
        if not self.half:
            return self._load(array, offset, self.v8f32)
        halves = self.b.bitcast(self._load(array, offset, ir.VectorType(ir.IntType(16), 8)), ir.VectorType(ir.HalfType(), 8))
        return self.b.fpext(halves, self.v8f32)

    def _scale(self, sums, rows: int, cols: int, j, offsets: bool) -> None:
        """``out += (d * dx) * isum + m * xs`` for the chunk; without the ``m * xs`` term where
        ``pack`` found every ``m`` zero: adding +-0 leaves ``out`` as it was (``out`` starts at +0
        and a sum of nonzero values rounds to +0, never -0), so the result is the same bits."""
        b, intp = self.b, self.intp
        for c in range(cols):
            col = b.mul(b.add(j, intp(c)), intp(OUT))
            dv = self._load_scales(self.d, b.add(self.dmoff, col))
            mv = self._load_scales(self.m, b.add(self.dmoff, col)) if offsets else None
            for r in range(rows):
                at = b.add(self.soff, b.mul(intp(r), self.nb))
                dx = ir_splat(b, b.load(b.gep(self.dx, [at])), self.v8f32)
                ptr = b.bitcast(b.gep(self.out, [b.add(b.add(self.ooff, b.mul(intp(r), self.ostride)), col)]),
                                self.v8f32.as_pointer())
                term = b.fmul(b.fmul(dv, dx), b.sitofp(sums[r][c], self.v8f32))
                if offsets:
                    xs = ir_splat(b, b.load(b.gep(self.xs, [at])), self.v8f32)
                    term = b.fadd(term, b.fmul(mv, xs))
                b.store(b.fadd(b.load(ptr, align=1), term), ptr, align=1)

    def _packed_sums(self, qbase, xrow):
        """Per row and vector, the block's 32-bit sums from 4-bit weights (16-bit partial sums)."""
        b, intp = self.b, self.intp
        low = ir.Constant(self.v32i8, [15] * 32)
        four = ir.Constant(self.v32i8, [4] * 32)
        zero = self.v8i32 if self.vnni else self.v16i16
        acc = [[ir.Constant(zero, [0] * zero.count) for _ in qbase] for _ in xrow]
        for p in range(4):
            packed = [self._load(self.q, b.add(base, intp(32 * p)), self.v32i8) for base in qbase]
            lo = [b.and_(v, low) for v in packed]
            hi = [b.lshr(v, four) for v in packed]
            for r, row in enumerate(xrow):
                xlo = self._broadcast(b.add(row, intp(4 * p)))
                xhi = self._broadcast(b.add(row, intp(4 * p + 16)))
                for c in range(len(qbase)):
                    if self.vnni:
                        acc[r][c] = self.dot4(self.dot4(acc[r][c], lo[c], xlo), hi[c], xhi)
                    else:
                        acc[r][c] = b.add(acc[r][c], self.maddubs(lo[c], xlo))
                        acc[r][c] = b.add(acc[r][c], self.maddubs(hi[c], xhi))
        return acc if self.vnni else [[self.widen(a) for a in row] for row in acc]

    def _byte_sums(self, qbase, xrow):
        """Per row and vector, the block's 32-bit sums from signed byte weights (the sign trick)."""
        if self.vnni:
            return self._byte_sums_offset(qbase, xrow)
        b, intp = self.b, self.intp
        acc = [[ir.Constant(self.v8i32, [0] * 8) for _ in qbase] for _ in xrow]
        for g in range(8):
            w = [self._load(self.q, b.add(base, intp(32 * g)), self.v32i8) for base in qbase]
            aw = [b.call(self.abs_fn, [v, ir.IntType(1)(0)]) for v in w]
            for r, row in enumerate(xrow):
                xb = self._broadcast(b.add(row, intp(4 * g)))
                for c in range(len(qbase)):
                    acc[r][c] = b.add(acc[r][c], self.widen(self.maddubs(aw[c], self.sign(xb, w[c]))))
        return acc

    def _byte_sums_offset(self, qbase, xrow):
        """The same sums on ``vnni`` without the sign trick: the inputs shifted to unsigned bytes,
        ``xq + 128`` (1..255), multiply the signed weights, and ``128 * sum(q)`` (formed once per
        vector, for every row) comes off: one operation per input row and group instead of one
        per row and output vector."""
        b, intp = self.b, self.intp
        bias = ir.Constant(self.v32i8, [-128] * 32)  # 0x80: adding 128 flips the top bit
        acc = [[ir.Constant(self.v8i32, [0] * 8) for _ in qbase] for _ in xrow]
        offset = [ir.Constant(self.v8i32, [0] * 8) for _ in qbase]
        for g in range(8):
            w = [self._load(self.q, b.add(base, intp(32 * g)), self.v32i8) for base in qbase]
            offset = [self.dot4(o, bias, v) for o, v in zip(offset, w)]
            for r, row in enumerate(xrow):
                xu = b.xor(self._broadcast(b.add(row, intp(4 * g))), bias)
                for c in range(len(qbase)):
                    acc[r][c] = self.dot4(acc[r][c], xu, w[c])
        return [[b.sub(a, o) for a, o in zip(row, offset)] for row in acc]


def _block_intrinsic(path: str):
    # A path this CPU lacks is emitted as ``portable``: the kernel below names every path's block,
    # and none may hold an instruction the CPU cannot run.
    emitted = path if path in PATHS else "portable"

    def block(typingctx, q, qoff, nvec, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
              rows, prefetch, offsets):
        def codegen(context, builder, signature, args):
            _Emitter(context, builder, signature, args, emitted).emit()
            return context.get_dummy_value()

        sig = types.void(q, qoff, nvec, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
                         rows, prefetch, offsets)
        return sig, codegen

    block.__name__ = block.__qualname__ = f"int_block_{path}"
    return intrinsic(block)


_block_vnni, _block_avx2, _block_portable = (_block_intrinsic(p) for p in ALL_PATHS)


@njit(parallel=True, cache=True, nogil=True)
def int_linear_kernel(x, d, m, q, out, path):  # pragma: no cover - compiled
    """``out = x @ W.T`` by the module's rule on path ``ALL_PATHS[path]``; ``q`` [tiles, blocks,
    vectors, bytes] (32 * 4 bytes per vector when packed, 32 * 8 when not), ``d``/``m`` [tiles,
    blocks, tile width]."""
    rows, k = x.shape
    tiles, nb, tw = d.shape
    nvec = tw // OUT
    nibbles = 1 if q.shape[3] == NIBBLE_BYTES else 0
    offsets = 1 if m.size else 0  # ``pack`` leaves out an all-zero m
    most = MANY_TILES_GROUP if tiles >= MANY_TILES and path == 0 and HAS_512 else GROUP  # measured there only
    xq, dx, xs = quantize_rows(x)
    flat, xflat, dflat, sflat = q.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1)
    width = out.shape[1]
    for c in prange(tiles):
        out[:, c * tw : (c + 1) * tw] = 0
        for b in range(nb):
            qoff = (c * nb + b) * nvec * q.shape[3]
            i = 0
            while i < rows:
                group = min(most, rows - i)
                args = (flat, qoff, nvec, nibbles, xflat, i * k + b * QK, k, dflat, sflat, i * nb + b, nb, d, m,
                        (c * nb + b) * tw, out, i * width + c * tw, width, group, 1 if i == 0 else 0, offsets)
                if path == 0:
                    _block_vnni(*args)
                elif path == 1:
                    _block_avx2(*args)
                else:
                    _block_portable(*args)
                i += group


def tile_width(n: int, step: int = OUT) -> int:
    """The widest tile (at most MAX_TILE rows, a multiple of ``step``, dividing ``n``) giving an
    even number of tiles (work for both cores of the project's CPU), else the widest at all."""
    widths = [w for w in range(step, min(n, MAX_TILE) + 1, step) if n % w == 0]
    even = [w for w in widths if (n // w) % 2 == 0]
    return max(even or widths)


def pack(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's ``(d, m, q)`` from a matrix in row layout (q int8 [n, k], d and m [n, k / 32],
    n a multiple of OUT): packed nibbles when every value is 0..15, else one signed byte each.
    Scales that fp16 holds exactly (a GGUF's always) are kept as fp16 bits, and an m that is all
    +0 (Q8_0, Q4_0) is left out (last dimension 0): a one-row pass streams the weights from
    memory, and fp32 scales were a third of a Q4_1 matrix's bytes."""
    n, k = q.shape
    nb = k // QK
    d, m = np.asarray(d, np.float32), np.asarray(m, np.float32)
    tw = tile_width(n)
    tiles = n // tw
    # [tile, vector, output, block, quad, 4 inputs]
    blocks = q.reshape(tiles, tw // OUT, OUT, nb, 8, 4)
    if q.size == 0 or (q.min() >= 0 and q.max() <= 15):
        u = blocks.astype(np.uint8)
        packed = u[..., :4, :] | (u[..., 4:, :] << 4)  # quad p low, quad p + 4 high
        data = packed.transpose(0, 3, 1, 4, 2, 5).reshape(tiles, nb, tw // OUT, NIBBLE_BYTES)
    else:
        data = blocks.transpose(0, 3, 1, 4, 2, 5).reshape(tiles, nb, tw // OUT, BYTE_BYTES).view(np.uint8)
    half = HAS_F16C and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (d, m))
    scales = [np.ascontiguousarray(a.reshape(tiles, tw, nb).transpose(0, 2, 1)) for a in (d, m)]
    if half:
        scales = [a.astype(np.float16).view(np.uint16) for a in scales]
    if not m.any() and not np.signbit(m).any():
        scales[1] = np.zeros((tiles, nb, 0), scales[0].dtype)  # one type for d and m, as the kernel reads them
    return scales[0], scales[1], np.ascontiguousarray(data)


def _float_scales(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def unpack(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack``'s inverse: ``(d, m, q)`` in row layout (fp32 scales, m zeros where it was left out)."""
    tiles, nb, nvec, size = q.shape
    if size == NIBBLE_BYTES:
        packed = q.reshape(tiles, nb, nvec, 4, OUT, 4)
        quads = np.concatenate([packed & 15, packed >> 4], axis=3)
    else:
        quads = q.reshape(tiles, nb, nvec, 8, OUT, 4)
    values = quads.view(np.int8).transpose(0, 2, 4, 1, 3, 5).reshape(tiles * nvec * OUT, nb * QK)
    d = _float_scales(d)
    m = _float_scales(m) if m.size else np.zeros_like(d)
    d2, m2 = (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, nb)) for a in (d, m))
    return d2, m2, np.ascontiguousarray(values)


@intrinsic
def _widen_half(typingctx, bits):
    """fp32 from fp16 bits (exact)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def _scale_at(a, c, b, u):  # pragma: no cover - replaced in compiled code by the overload below
    """Scale ``a[c, b, u]`` as fp32, whether ``pack`` kept it as fp32 or as fp16 bits."""


@overload(_scale_at)
def _scale_at_by_type(a, c, b, u):
    if a.dtype == types.uint16:
        return lambda a, c, b, u: _widen_half(a[c, b, u])
    return lambda a, c, b, u: a[c, b, u]


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(d, m, q, rows, out):  # pragma: no cover - compiled
    """``out[r] = d * q + m`` of weight row ``rows[r]`` (two roundings, as GGUF's dequantizer)."""
    tw = d.shape[2]
    packed = q.shape[3] == NIBBLE_BYTES
    offsets = m.size > 0
    for r in prange(rows.shape[0]):
        c, u = divmod(rows[r], tw)
        v, lane = divmod(u, OUT)
        for t in range(out.shape[1]):
            b, within = divmod(t, QK)
            quad, j = divmod(within, 4)
            if packed:
                byte = q[c, b, v, (quad & 3) * 32 + lane * 4 + j]
                value = np.float32(byte & 15 if quad < 4 else byte >> 4)
            else:
                value = np.float32(np.int8(q[c, b, v, quad * 32 + lane * 4 + j]))
            # + 0.0 where m was left out: the same bits as adding the +0 it held
            offset = _scale_at(m, c, b, u) if offsets else np.float32(0.0)
            out[r, t] = _scale_at(d, c, b, u) * value + offset


def reference(x: np.ndarray, d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The rule in numpy (row layout: q [n, k], d and m [n, k / 32]): what every path must equal bit for bit."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    nb = k // QK
    xb = x.reshape(rows, nb, QK)
    wide = xb.astype(np.float64)
    lanes = ((wide[:, :, 0:8] + wide[:, :, 8:16]) + wide[:, :, 16:24]) + wide[:, :, 24:32]  # the rule's order
    half = lanes[:, :, :4] + lanes[:, :, 4:]
    quarter = half[:, :, :2] + half[:, :, 2:]
    xs = (quarter[:, :, 0] + quarter[:, :, 1]).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    dx = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(dx > 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xb * inv[:, :, None]), -127, 127).astype(np.int64)
    isum = np.einsum("rbt,nbt->rnb", xq, q.reshape(-1, nb, QK).astype(np.int64))
    out = np.zeros((rows, q.shape[0]), np.float32)
    for b in range(nb):
        scale = (d[None, :, b] * dx[:, b, None]).astype(np.float32)
        out = out + (scale * isum[:, :, b].astype(np.float32) + m[None, :, b] * xs[:, b, None])
    return out
