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
    as ``x * (1 / dx)``, 0 where the block is 0), ``xs = sum(x)`` in order in fp32;
  * per block, ``isum = sum(q * xq)`` exactly in integers;
  * ``out = out + ((d * dx) * float(isum) + m * xs)`` over blocks in order, from 0, in fp32 without
    fused multiply-adds.
Each row's output depends on that row alone, so it is bit-identical alone, in a verify block of
any size, or beside other sequences in a batch (greedy equality with ``ar`` relies on it).

Layouts: matrices whose values are all 0..15 (Q4_1) keep two weights per byte; others (Q8_0, and
Q4_0's -8..7) one signed byte, multiplied by the sign trick (``|q|`` times ``x`` with ``q``'s sign). Output rows go 8 to a vector (8 int32 lanes of a 256-bit
register); each vector's 32 weights of a block are ``[quad p][output][4 inputs]`` so a broadcast of
four input bytes meets four consecutive weights of every output. The packed layout holds quad
``p`` in the low nibbles and quad ``p + 4`` in the high ones.

Paths (``PATH``, chosen at import): ``avx2`` (x86 intrinsics; AVX-512 CPUs run it too) and
``portable`` (the same integers in plain LLVM vector IR, for any CPU). Both are tested against
``reference``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import _FEATURES, ir_splat

QK = 32  # inputs per block
OUT = 8  # outputs per vector: 8 int32 lanes of a 256-bit register
GROUP = 8  # input rows sharing one load (and unpacking) of a weight vector
MAX_TILE = 512  # output rows per parallel task (see ``quant.MAX_TILE``)
NIBBLE_BYTES = OUT * QK // 2  # bytes of one output vector's block, packed: 4 vectors of 32
BYTE_BYTES = OUT * QK  # the same, one byte per weight: 8 vectors of 32
PREFETCH_BYTES = 4096  # see quant.PREFETCH_BYTES
HAS_AVX2 = "+avx2" in _FEATURES
PATH = "avx2" if HAS_AVX2 else "portable"
PATHS = ("avx2", "portable") if HAS_AVX2 else ("portable",)
# Registers (16 on AVX2): accumulators rows x cols, the weight vectors (two per packed vector once
# unpacked), the broadcast inputs and two constants must fit without spilling.
_COLS = {1: 4, 2: 2, 3: 2}


@njit(cache=True, nogil=True)
def quantize_rows(x):  # pragma: no cover - compiled
    """``(xq, dx, xs)`` of each row of ``x`` [rows, k] per block of 32 (see the module's rule)."""
    rows, k = x.shape
    nb = k // QK
    xq = np.empty((rows, k), np.int8)
    dx = np.empty((rows, nb), np.float32)
    xs = np.empty((rows, nb), np.float32)
    for i in range(rows):
        for b in range(nb):
            amax = np.float32(0.0)
            s = np.float32(0.0)
            for t in range(b * QK, b * QK + QK):
                s += x[i, t]
                amax = max(amax, abs(x[i, t]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            for t in range(b * QK, b * QK + QK):
                xq[i, t] = np.int8(min(127.0, max(-127.0, np.rint(x[i, t] * inv))))
            dx[i, b] = d
            xs[i, b] = s
    return xq, dx, xs


class _Emitter:
    """The LLVM IR of one block (32 inputs) of one tile for up to ``GROUP`` input rows, every
    output vector of the tile; ``portable`` emits plain vector IR instead of AVX2 intrinsics.
    The integer sums are exact either way: no pair sum reaches the 16-bit saturation (4-bit
    weights: 8 pairs of at most 2 * 15 * 127 = 3810; bytes: one pair of at most 2 * 128 * 127)."""

    def __init__(self, context, builder, signature, args, portable: bool):
        self.b, self.portable = builder, portable
        arrays = {i: context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 4, 7, 8, 11, 12, 14)}
        self.q, self.xq, self.dx, self.xs, self.d, self.m, self.out = (arrays[i] for i in (0, 4, 7, 8, 11, 12, 14))
        (self.qoff, self.nvec, self.nibbles, self.xoff, self.k, self.soff, self.nb, self.dmoff, self.ooff,
         self.ostride, self.rows, self.prefetch) = (args[i] for i in (1, 2, 3, 5, 6, 9, 10, 13, 15, 16, 17, 18))
        self.intp = self.qoff.type
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        self.i32 = i32
        self.v32i8, self.v16i16, self.v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
        self.v8f32 = ir.VectorType(ir.FloatType(), 8)
        module = builder.module
        fn = lambda name, ret, *args: cgutils.get_or_insert_function(module, ir.FunctionType(ret, list(args)), name)  # noqa: E731
        if not portable:
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
            cols = _COLS.get(rows, 1)
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
        for c in range(cols):
            col = b.mul(b.add(j, intp(c)), intp(OUT))
            dv = self._load(self.d, b.add(self.dmoff, col), self.v8f32)
            mv = self._load(self.m, b.add(self.dmoff, col), self.v8f32)
            for r in range(rows):
                at = b.add(self.soff, b.mul(intp(r), self.nb))
                dx = ir_splat(b, b.load(b.gep(self.dx, [at])), self.v8f32)
                xs = ir_splat(b, b.load(b.gep(self.xs, [at])), self.v8f32)
                ptr = b.bitcast(b.gep(self.out, [b.add(b.add(self.ooff, b.mul(intp(r), self.ostride)), col)]),
                                self.v8f32.as_pointer())
                isum = b.sitofp(sums[r][c], self.v8f32)
                term = b.fadd(b.fmul(b.fmul(dv, dx), isum), b.fmul(mv, xs))
                b.store(b.fadd(b.load(ptr, align=1), term), ptr, align=1)

    def _packed_sums(self, qbase, xrow):
        """Per row and vector, the block's 32-bit sums from 4-bit weights (16-bit partial sums)."""
        b, intp = self.b, self.intp
        low = ir.Constant(self.v32i8, [15] * 32)
        four = ir.Constant(self.v32i8, [4] * 32)
        acc = [[ir.Constant(self.v16i16, [0] * 16) for _ in qbase] for _ in xrow]
        for p in range(4):
            packed = [self._load(self.q, b.add(base, intp(32 * p)), self.v32i8) for base in qbase]
            lo = [b.and_(v, low) for v in packed]
            hi = [b.lshr(v, four) for v in packed]
            for r, row in enumerate(xrow):
                xlo = self._broadcast(b.add(row, intp(4 * p)))
                xhi = self._broadcast(b.add(row, intp(4 * p + 16)))
                for c in range(len(qbase)):
                    acc[r][c] = b.add(acc[r][c], self.maddubs(lo[c], xlo))
                    acc[r][c] = b.add(acc[r][c], self.maddubs(hi[c], xhi))
        return [[self.widen(a) for a in row] for row in acc]

    def _byte_sums(self, qbase, xrow):
        """Per row and vector, the block's 32-bit sums from signed byte weights (the sign trick)."""
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


def _block_intrinsic(portable: bool):
    def block(typingctx, q, qoff, nvec, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
              rows, prefetch):
        def codegen(context, builder, signature, args):
            _Emitter(context, builder, signature, args, portable).emit()
            return context.get_dummy_value()

        sig = types.void(q, qoff, nvec, nibbles, xq, xoff, k, dx, xs, soff, nb, d, m, dmoff, out, ooff, ostride,
                         rows, prefetch)
        return sig, codegen

    block.__name__ = block.__qualname__ = "int_block_portable" if portable else "int_block_fast"
    return intrinsic(block)


_block_fast = _block_intrinsic(portable=not HAS_AVX2)  # never emits AVX2 where the CPU lacks it
_block_portable = _block_intrinsic(portable=True)


@njit(parallel=True, cache=True, nogil=True)
def int_linear_kernel(x, d, m, q, out, portable):  # pragma: no cover - compiled
    """``out = x @ W.T`` by the module's rule; ``q`` [tiles, blocks, vectors, bytes] (32 * 4 bytes
    per vector when packed, 32 * 8 when not), ``d``/``m`` [tiles, blocks, tile width]."""
    rows, k = x.shape
    tiles, nb, tw = d.shape
    nvec = tw // OUT
    nibbles = 1 if q.shape[3] == NIBBLE_BYTES else 0
    xq, dx, xs = quantize_rows(x)
    flat, xflat, dflat, sflat = q.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1)
    width = out.shape[1]
    for c in prange(tiles):
        out[:, c * tw : (c + 1) * tw] = 0
        for b in range(nb):
            qoff = (c * nb + b) * nvec * q.shape[3]
            i = 0
            while i < rows:
                group = min(GROUP, rows - i)
                args = (flat, qoff, nvec, nibbles, xflat, i * k + b * QK, k, dflat, sflat, i * nb + b, nb, d, m,
                        (c * nb + b) * tw, out, i * width + c * tw, width, group, 1 if i == 0 else 0)
                if portable:
                    _block_portable(*args)
                else:
                    _block_fast(*args)
                i += group


def tile_width(n: int, step: int = OUT) -> int:
    """The widest tile (at most MAX_TILE rows, a multiple of ``step``, dividing ``n``) giving an
    even number of tiles (work for both cores of the project's CPU), else the widest at all."""
    widths = [w for w in range(step, min(n, MAX_TILE) + 1, step) if n % w == 0]
    even = [w for w in widths if (n // w) % 2 == 0]
    return max(even or widths)


def pack(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's ``(d, m, q)`` from a matrix in row layout (q int8 [n, k], d and m [n, k / 32],
    n a multiple of OUT): packed nibbles when every value is 0..15, else one signed byte each."""
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
    scales = [np.ascontiguousarray(a.reshape(tiles, tw, nb).transpose(0, 2, 1)) for a in (d, m)]
    return scales[0], scales[1], np.ascontiguousarray(data)


def unpack(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack``'s inverse: ``(d, m, q)`` in row layout."""
    tiles, nb, nvec, size = q.shape
    if size == NIBBLE_BYTES:
        packed = q.reshape(tiles, nb, nvec, 4, OUT, 4)
        quads = np.concatenate([packed & 15, packed >> 4], axis=3)
    else:
        quads = q.reshape(tiles, nb, nvec, 8, OUT, 4)
    values = quads.view(np.int8).transpose(0, 2, 4, 1, 3, 5).reshape(tiles * nvec * OUT, nb * QK)
    d2, m2 = (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, nb)) for a in (d, m))
    return d2, m2, np.ascontiguousarray(values)


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(d, m, q, rows, out):  # pragma: no cover - compiled
    """``out[r] = d * q + m`` of weight row ``rows[r]`` (two roundings, as GGUF's dequantizer)."""
    tw = d.shape[2]
    packed = q.shape[3] == NIBBLE_BYTES
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
            out[r, t] = d[c, b, u] * value + m[c, b, u]


def reference(x: np.ndarray, d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The rule in numpy (row layout: q [n, k], d and m [n, k / 32]): what every path must equal bit for bit."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    nb = k // QK
    xb = x.reshape(rows, nb, QK)
    xs = np.zeros((rows, nb), np.float32)
    for t in range(QK):  # in order, as the kernel sums
        xs += xb[:, :, t]
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
