"""A GGUF file's quantized weight matrices, computed on their blocks (``--weights gguf`` and
``gguf-float``), and this module's kernel for fp32 inputs (``gguf-float``).

Why: the default model's GGUF stores its layers as Q4_1 blocks (20 bytes per 32 weights) and its
token embedding, also the tied LM head, as Q8_0 (34 bytes per 32). Dequantized to fp32 the engine
streams 513 MiB per token; on the blocks far less. ``QuantMatrix`` holds a matrix for one of two
kernels: ``intdot``'s (8-bit inputs, integer dot products, 4-bit weights packed: the default) or
the one below (fp32 inputs, one byte per weight, 160 MiB a token).

The weights are the same: a weight is ``d * q + m`` with fp16 scales widened to fp32, which is
how GGUF's dequantizer, and so our converted fp32 checkpoint, computes it (``load_target``
checks every matrix bit for bit). This kernel sums per block, ``d * sum(q * x) + m * sum(x)``, so
its outputs differ from the fp32 kernel's in the last bits: another engine, and "lossless" compares
each engine with its own ``ar``.

Layout (this kernel): Q4_0 / Q4_1 / Q8_0 all become one signed byte per weight (Q4_1's nibbles 0..15, Q4_0's
nibble - 8, Q8_0's value) with one fp32 scale ``d`` and offset ``m`` per 32 weights (``m = 0``
for the symmetric types): one layout, one kernel, and matrices of different types can be stacked
(q, k and v become one fused matrix). One byte per weight because the byte-to-float
widening is one instruction, not nibble unpacking (packed nibbles ran at 0.27-0.42x the fp32
kernel, scripts/measure-quantized-linear.py). The rows are stored in tiles of ``tw`` output rows,
input-major: the kernel vectorizes across output rows, so each output is a plain sequential sum
over the input and needs no reassociation at all.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import intdot
from .kernels import LANES, _launch, ir_muladd, ir_splat

QK = 32  # weights per block in every type supported here
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 scale (+ fp16 min for Q4_1) + values
SUPPORTED = tuple(_BLOCK_BYTES)
# Output rows per tile (one task of the parallel loop): wide enough that both cores get equal
# work, narrow enough that a tile's outputs for a block of rows stay in L1/L2 while they accumulate.
MAX_TILE = 512

# How many vector accumulators the kernel keeps in registers (AVX-512 has 32 registers, AVX2 16:
# the accumulators, the converted weights and one broadcast input must fit without spilling).
_ACCUMULATORS = LANES
GROUP = 8  # input rows sharing one conversion of a weight vector (the kernel's register block)
_UNROLL = 4  # input positions per turn of the kernel's inner loop (32 fully unrolled ran 1.2-1.4x slower)
# Bytes ahead of the weights being multiplied that the kernel asks the CPU to fetch. Without it the
# sums and the stream from memory do not overlap, and a one-row pass is slower.
PREFETCH_BYTES = 4096


@njit(cache=True, nogil=True)
def _block_sums(x):  # pragma: no cover - compiled
    """``sum(x)`` over each block of 32 inputs of each row, in order."""
    rows, k = x.shape
    out = np.zeros((rows, k // QK), np.float32)
    for i in range(rows):
        for b in range(k // QK):
            s = np.float32(0.0)
            for t in range(b * QK, b * QK + QK):
                s += x[i, t]
            out[i, b] = s
    return out


class _GroupKernel:
    """Emits the LLVM IR of one block (32 inputs) of a tile for up to ``GROUP`` input rows.

    Why IR: numba's loops keep accumulators in memory, and LLVM does not turn a loop over a few
    rows into register blocking. Here every accumulator is an explicit vector value: for a chunk
    of ``C`` vectors of output rows and ``R`` input rows, each weight vector is loaded and
    converted once and multiplied into ``R * C`` accumulators. Per element the operations are
    always ``blk = fma(q[t], x[t], blk)`` for t = 0..31 in order, then
    ``out += d * blk + m * sum(x)``: the same whatever ``R``, ``C`` or the neighbours, so a row's
    output never depends on its block (greedy equality and batching rely on it)."""

    def __init__(self, context, builder, signature, args):
        self.b = builder
        self.q, self.x, self.xs, self.d, self.m, self.out = (
            context.make_array(signature.args[i])(context, builder, args[i]).data for i in (0, 3, 6, 9, 10, 12))
        (self.qoff, self.nvec, self.xoff, self.k, self.xsoff, self.nb, self.dmoff, self.ooff, self.ostride,
         self.rows, self.prefetch) = (args[i] for i in (1, 2, 4, 5, 7, 8, 11, 13, 14, 15, 16))
        self.intp = self.qoff.type
        f32, i8, i32 = ir.FloatType(), ir.IntType(8), ir.IntType(32)
        self.vf, self.vb, self.i32 = ir.VectorType(f32, LANES), ir.VectorType(i8, LANES), i32
        module = builder.module
        self.muladd = ir_muladd(builder, self.vf)
        self.prefetch_fn = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")

    def emit(self) -> None:
        """A switch on the number of rows (1..GROUP), each case a loop over the tile's vectors."""
        b, intp = self.b, self.intp
        merge = b.append_basic_block("group.end")
        switch = b.switch(self.rows, merge)
        for rows in range(1, GROUP + 1):
            case = b.append_basic_block(f"group.rows{rows}")
            switch.add_case(self.rows.type(rows), case)
            b.position_at_end(case)
            cols = max(1, min(4, _ACCUMULATORS // rows))  # 4 independent sums hide the FMA latency at one row
            full = b.sdiv(self.nvec, intp(cols))
            with cgutils.for_range(b, full) as loop:
                self._chunk(rows, cols, b.mul(loop.index, intp(cols)))
            if cols > 1:  # leftover vectors one at a time (the same operations per element)
                with cgutils.for_range_slice(b, b.mul(full, intp(cols)), self.nvec, intp(1)) as (j, _):
                    self._chunk(rows, 1, j)
            b.branch(merge)
        b.position_at_end(merge)

    def _vector(self, base, offset, kind):
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), kind.as_pointer()), align=1)

    def _chunk(self, rows: int, cols: int, j) -> None:
        """Output vectors ``j .. j + cols - 1`` of this tile for ``rows`` input rows."""
        b, intp = self.b, self.intp
        chunk_bytes = QK * LANES
        qbase = [b.add(self.qoff, b.mul(b.add(j, intp(c)), intp(chunk_bytes))) for c in range(cols)]
        with b.if_then(b.icmp_signed("!=", self.prefetch, intp(0))):
            for c in range(cols):
                for line in range(0, chunk_bytes, 64):  # 64-byte cache lines; a prefetch never faults
                    ptr = b.gep(self.q, [b.add(qbase[c], intp(PREFETCH_BYTES + line))])
                    b.call(self.prefetch_fn, [ptr, self.i32(0), self.i32(3), self.i32(1)])  # read, keep, data
        xrow = [b.add(self.xoff, b.mul(intp(r), self.k)) for r in range(rows)]
        entry = b.block
        body, done = b.append_basic_block("t.body"), b.append_basic_block("t.done")
        b.branch(body)
        b.position_at_end(body)
        t0 = b.phi(intp)
        t0.add_incoming(intp(0), entry)
        zero = ir.Constant(self.vf, [0.0] * LANES)
        phis = [[b.phi(self.vf) for _ in range(cols)] for _ in range(rows)]
        for phi in (p for row in phis for p in row):
            phi.add_incoming(zero, entry)
        acc = [list(row) for row in phis]
        for u in range(_UNROLL):
            t = b.add(t0, intp(u))
            w = [b.sitofp(self._vector(self.q, b.add(qbase[c], b.mul(t, intp(LANES))), self.vb), self.vf)
                 for c in range(cols)]
            for r in range(rows):
                xv = ir_splat(b, b.load(b.gep(self.x, [b.add(xrow[r], t)])), self.vf)
                for c in range(cols):
                    acc[r][c] = self.muladd(w[c], xv, acc[r][c])
        t_next = b.add(t0, intp(_UNROLL))
        t0.add_incoming(t_next, b.block)
        for r in range(rows):
            for c in range(cols):
                phis[r][c].add_incoming(acc[r][c], b.block)
        b.cbranch(b.icmp_signed("<", t_next, intp(QK)), body, done)
        b.position_at_end(done)
        for c in range(cols):
            col = b.mul(b.add(j, intp(c)), intp(LANES))
            dv = self._vector(self.d, b.add(self.dmoff, col), self.vf)
            mv = self._vector(self.m, b.add(self.dmoff, col), self.vf)
            for r in range(rows):
                s = ir_splat(b, b.load(b.gep(self.xs, [b.add(self.xsoff, b.mul(intp(r), self.nb))])), self.vf)
                ptr = b.bitcast(b.gep(self.out, [b.add(b.add(self.ooff, b.mul(intp(r), self.ostride)), col)]),
                                self.vf.as_pointer())
                total = b.fadd(b.load(ptr, align=1), b.fadd(b.fmul(dv, acc[r][c]), b.fmul(mv, s)))
                b.store(total, ptr, align=1)


@intrinsic
def _group(typingctx, q, qoff, nvec, x, xoff, k, xs, xsoff, nb, d, m, dmoff, out, ooff, ostride, rows, prefetch):
    """One block of one tile for ``rows`` (1..GROUP) input rows, added into ``out`` (offsets are
    flat element offsets into each array; see ``_GroupKernel``)."""
    def codegen(context, builder, signature, args):
        _GroupKernel(context, builder, signature, args).emit()
        return context.get_dummy_value()

    return types.void(q, qoff, nvec, x, xoff, k, xs, xsoff, nb, d, m, dmoff, out, ooff, ostride, rows, prefetch), codegen


@njit(parallel=True, cache=True, nogil=True)
def _quant_linear_kernel(x, d, m, q, out):  # pragma: no cover - compiled
    """``out = x @ (d * q + m).T`` as ``sum over blocks of d * sum(q * x) + m * sum(x)``, one tile
    of output rows per task, input rows in groups of up to ``GROUP`` (``_GroupKernel``)."""
    rows, k = x.shape
    tiles, nb, tw = d.shape
    nvec = tw // LANES
    xs = _block_sums(x)
    flat = q.reshape(-1)
    width = out.shape[1]
    for c in prange(tiles):
        out[:, c * tw : (c + 1) * tw] = 0
        for b in range(nb):
            qoff = (c * nb + b) * tw * QK
            i = 0
            while i < rows:
                group = min(GROUP, rows - i)
                _group(flat, qoff, nvec, x, i * k + b * QK, k, xs, i * nb + b, nb, d, m, (c * nb + b) * tw,
                       out, i * width + c * tw, width, group, 1 if i == 0 else 0)  # prefetch once per block
                i += group


@njit(parallel=True, cache=True, nogil=True)
def _dequantize_kernel(d, m, q, rows, out):  # pragma: no cover - compiled
    """``out[r] = d * q + m`` of weight row ``rows[r]`` (two roundings, as GGUF's dequantizer)."""
    tw = d.shape[2]
    k = out.shape[1]
    for r in prange(rows.shape[0]):
        c, u = divmod(rows[r], tw)
        v, lane = divmod(u, LANES)
        for t in range(k):
            b = t >> 5
            out[r, t] = d[c, b, u] * np.float32(q[c, b, v, t & 31, lane]) + m[c, b, u]


KERNELS = ("int8", "float")  # intdot's integer dot products on 8-bit inputs; this module's fp32 inputs


class QuantMatrix:
    """A weight matrix [n, k] kept as blocks: per 32 weights a scale ``d`` and offset ``m`` (given
    in row layout: q int8 [n, k], d and m fp32 [n, k / 32]), computed by one of two kernels:
    ``"int8"`` (``intdot``: inputs quantized to 8 bits per block of 32, integer dot products, 4-bit
    weights kept packed) or ``"float"`` (this module's: one byte per weight widened to fp32, fp32
    inputs). Both read the same weights; their outputs differ in the last bits of a block's sum
    (int8: the input's rounding to 8 bits).

    Indexing reads rows as fp32 (an embedding lookup, a draft vocabulary's LM-head rows), like an
    array; ``take`` / ``concat`` reorder and stack rows without leaving the blocks (load-time work:
    they untile and retile)."""

    def __init__(self, d: np.ndarray, m: np.ndarray, q: np.ndarray, kernel: str = "int8"):
        n, k = q.shape
        if q.dtype != np.int8 or k % QK or d.shape != (n, k // QK) or m.shape != d.shape:
            raise ValueError(f"QuantMatrix needs q int8 [n, k] (k a multiple of {QK}) and d, m [n, k / {QK}]")
        if kernel not in KERNELS:
            raise ValueError(f"kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
        self.shape, self.kernel = (n, k), kernel
        step = intdot.OUT if kernel == "int8" else LANES
        padded = -(-n // step) * step  # zero rows up to a whole vector of outputs, dropped from outputs
        pad = ((0, padded - n), (0, 0))
        d, m, q = (np.pad(a, pad) for a in (np.asarray(d, np.float32), np.asarray(m, np.float32), q))
        if kernel == "int8":
            self.d, self.m, self.q = intdot.pack(d, m, q)
            return
        tw = intdot.tile_width(padded, LANES)
        tiles, nb = padded // tw, k // QK
        # q as [tile, block, vector, 32 inputs, LANES outputs]: the bytes one kernel step reads
        # (32 inputs of one vector of outputs) are 512 contiguous bytes, and the whole matrix is
        # read front to back, once per block of input rows.
        self.q = np.ascontiguousarray(q.reshape(tiles, tw // LANES, LANES, nb, QK).transpose(0, 3, 1, 4, 2))
        self.d = np.ascontiguousarray(d.reshape(tiles, tw, nb).transpose(0, 2, 1))
        self.m = np.ascontiguousarray(m.reshape(tiles, tw, nb).transpose(0, 2, 1))

    @property
    def padded_rows(self) -> int:
        """Output rows the kernels compute (``shape[0]`` rounded up to a whole vector)."""
        return self.d.size * QK // self.shape[1]  # d holds one scale per output row and block, in either layout

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes

    def row_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(d, m, q)`` as given to the constructor (what the cache file stores)."""
        n, k = self.shape
        if self.kernel == "int8":
            return tuple(np.ascontiguousarray(a[:n]) for a in intdot.unpack(self.d, self.m, self.q))
        d, m = (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1])[:n]) for a in (self.d, self.m))
        q = np.ascontiguousarray(self.q.transpose(0, 2, 4, 1, 3).reshape(-1, k)[:n])
        return d, m, q

    def __getitem__(self, key) -> np.ndarray:
        n = self.shape[0]
        # token ids (the embedding lookup of every forward) index directly; slices go through arange
        rows = np.arange(n)[key] if isinstance(key, slice) else np.asarray(key, np.int64)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"row index out of range for a matrix of {n} rows")
        flat = np.atleast_1d(rows % n)
        out = np.empty((flat.size, self.shape[1]), np.float32)
        if flat.size:
            with _launch:
                (intdot.dequantize_rows if self.kernel == "int8" else _dequantize_kernel)(self.d, self.m, self.q, flat, out)
        return out.reshape(*np.shape(rows), self.shape[1])

    def dense(self) -> np.ndarray:
        """Every weight as fp32 (to stack it with fp32 matrices, or to check it)."""
        return self[:]

    def take(self, indices: np.ndarray, axis: int = 0) -> "QuantMatrix":
        """Rows ``indices`` as a new matrix (``ndarray.take`` along rows, for code written for both)."""
        if axis != 0:
            raise ValueError("a QuantMatrix is reordered by rows only")
        return QuantMatrix(*(a[indices] for a in self.row_layout()), kernel=self.kernel)

    @staticmethod
    def concat(parts: Sequence["QuantMatrix"]) -> "QuantMatrix":
        """The rows of ``parts`` stacked, computed by the first part's kernel."""
        layouts = [p.row_layout() for p in parts]
        return QuantMatrix(*(np.concatenate([lay[f] for lay in layouts]) for f in range(3)), kernel=parts[0].kernel)

    def linear(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T`` for ``x`` [rows, k] fp32 contiguous."""
        rows = x.shape[0]
        out = np.empty((rows, self.padded_rows), np.float32)
        if rows:
            with _launch:
                if self.kernel == "int8":
                    intdot.int_linear_kernel(x, self.d, self.m, self.q, out, intdot.path_index())
                else:
                    _quant_linear_kernel(x, self.d, self.m, self.q, out)
        return out if out.shape[1] == self.shape[0] else np.ascontiguousarray(out[:, : self.shape[0]])


def from_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int], kernel: str = "int8") -> QuantMatrix:
    """A matrix [n, k] from GGUF's raw blocks (``raw`` uint8 [n, bytes per row]) of type ``kind``."""
    n, k = shape
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"tensor type {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    blocks = np.ascontiguousarray(raw).reshape(n, k // QK, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return QuantMatrix(d, np.zeros_like(d), blocks[..., 2:].copy().view(np.int8).reshape(n, k), kernel)
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # 16 bytes: weight t low, t + 16 high
    nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int8)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return QuantMatrix(d, m, nibbles.reshape(n, k), kernel)
    return QuantMatrix(d, np.zeros_like(d), (nibbles - 8).reshape(n, k), kernel)


def quantize_blocks(w: np.ndarray, kind: str = "Q8_0", kernel: str = "int8") -> QuantMatrix:
    """An fp32 matrix [n, k] as ``kind`` blocks (``SUPPORTED``), quantized by gguf's reference
    quantizer (for weights that need not equal any file's, like a draft head's: its drafts are
    checked by the target)."""
    from gguf import GGMLQuantizationType, quants

    if kind not in _BLOCK_BYTES:
        raise ValueError(f"tensor type {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"{kind} needs a matrix [n, k] with k a multiple of {QK}, got {w.shape}")
    return from_blocks(kind, quants.quantize(w, getattr(GGMLQuantizationType, kind)), w.shape, kernel)


# Candidate scales per block that ``fit_q4_1`` tries: ``(15 + FIT_STEP * s) / (max - min)`` for
# ``s`` in -FIT_STEPS..FIT_STEPS, each refitted by least squares.
FIT_STEPS, FIT_STEP = 8, 0.2


def fit_q4_1(w: np.ndarray, kernel: str = "int8") -> QuantMatrix:
    """An fp32 matrix [n, k] as Q4_1 blocks fitted to it: per block of 32, the scale and offset
    (fp16, as GGUF stores them) with the least squared error among candidate scales
    (``FIT_STEPS``), where the reference quantizer (``quantize_blocks``) spans each block's range
    in 15 equal steps. Why: a draft head's matrices are quantized by us, for speed only, and a
    fitted block keeps more of what the head learnt (fewer rejected drafts) at the same bytes."""
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"Q4_1 needs a matrix [n, k] with k a multiple of {QK}, got {w.shape}")
    n, k = w.shape
    x = w.reshape(-1, QK)
    d, m = np.empty(x.shape[0], np.float32), np.empty(x.shape[0], np.float32)
    _fit_blocks(x, FIT_STEPS, FIT_STEP, d, m)
    d, m = (a.astype(np.float16).astype(np.float32) for a in (d, m))  # as a file would hold them
    q = np.clip(np.rint((x - m[:, None]) / np.where(d > 0, d, 1)[:, None]), 0, 15)
    q = np.where(d[:, None] > 0, q, 0).astype(np.int8)
    return QuantMatrix(d.reshape(n, k // QK), m.reshape(n, k // QK), q.reshape(n, k), kernel)


@njit(cache=True, parallel=True)
def _fit_blocks(x, steps, step, d, m):  # pragma: no cover - compiled
    """Each row of ``x`` [blocks, 32]: ``d``, ``m`` of the least squared error ``sum((d * q + m -
    x)^2)`` over codes ``q`` in 0..15, among the equal-steps block and a least-squares refit for
    each candidate scale's codes."""
    for b in prange(x.shape[0]):
        lo, hi = np.float64(x[b].min()), np.float64(x[b].max())
        d[b], m[b] = 0.0, lo
        if hi <= lo:  # one value: no scale to fit
            continue
        best_d, best_m = (hi - lo) / 15.0, lo
        best = _block_error(x[b], best_d, best_m)
        sx = np.float64(0.0)
        for i in range(QK):
            sx += x[b, i]
        for s in range(-steps, steps + 1):
            iscale = (15.0 + step * s) / (hi - lo)
            sl = sll = slx = 0.0
            for i in range(QK):
                code = min(max(np.rint((x[b, i] - lo) * iscale), 0.0), 15.0)
                sl += code
                sll += code * code
                slx += code * x[b, i]
            det = QK * sll - sl * sl
            if det <= 0:
                continue
            scale = (QK * slx - sl * sx) / det
            if scale <= 0:
                continue
            offset = (sx - scale * sl) / QK
            e = _block_error(x[b], scale, offset)
            if e < best:
                best, best_d, best_m = e, scale, offset
        d[b], m[b] = best_d, best_m


@njit(cache=True)
def _block_error(x, d, m):  # pragma: no cover - compiled
    """``sum((d * q + m - x)^2)`` with each ``q`` the nearest code in 0..15."""
    e = 0.0
    for i in range(x.shape[0]):
        code = min(max(np.rint((x[i] - m) / d), 0.0), 15.0)
        e += (d * code + m - x[i]) ** 2
    return e


def quantize_q8_0(w: np.ndarray, kernel: str = "int8") -> QuantMatrix:
    """``quantize_blocks`` to Q8_0."""
    return quantize_blocks(w, "Q8_0", kernel)


# GGUF tensor names of the Llama family -> Hugging Face names ({} is the layer index).
_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF weight matrix, None for anything else (norms, ...)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        template = _HF_NAMES.get(".".join(["blk", "{}", *parts[2:]]))
        return None if template is None else template.format(parts[1])
    return _HF_NAMES.get(gguf_name)


def read_gguf_matrices(path: Path) -> tuple[dict[str, QuantMatrix], dict[str, str]]:
    """The weight matrices of a GGUF file in a supported block type, by Hugging Face name, in the
    file's row order; and the matrices left out, with their type (the caller keeps fp32 for those)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    found, skipped = {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        if kind not in _BLOCK_BYTES:
            skipped[name] = f"type {kind} has no block kernel"
            continue
        k, n = (int(s) for s in t.shape)  # GGUF lists dimensions innermost first
        found[name] = from_blocks(kind, t.data, (n, k))
    return found, skipped
