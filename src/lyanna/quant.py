"""A GGUF file's quantized weight matrices, computed on their blocks (``--weights gguf``).

Why: the default model's GGUF stores its layers as Q4_1 blocks (20 bytes per 32 weights) and its
token embedding, also the tied LM head, as Q8_0 (34 bytes per 32). Dequantized to fp32 the engine
streams 513 MiB per token; on the blocks 160 MiB (one byte per weight, see below), and it
converts bytes to floats once per weight for a pair of input rows instead of multiplying fp32.

The weights are the same: a weight is ``d * q + m`` with fp16 scales widened to fp32, which is
how GGUF's dequantizer, and so our converted fp32 checkpoint, computes it (``load_target``
checks every matrix bit for bit). The kernel sums per block, ``d * sum(q * x) + m * sum(x)``, so
its outputs differ from the fp32 kernel's in the last bits: another engine, and "lossless" compares
each engine with its own ``ar``.

Layout: Q4_0 / Q4_1 / Q8_0 all become one signed byte per weight (Q4_1's nibbles 0..15, Q4_0's
nibble - 8, Q8_0's value) with one fp32 scale ``d`` and offset ``m`` per 32 weights (``m = 0``
for the symmetric types): one layout, one kernel, and matrices of different types can be stacked
(q, k and v become one fused matrix). One byte per weight because LLVM vectorizes the byte-to-float
widening, not nibble unpacking (packed nibbles ran at 0.27-0.42x the fp32 kernel,
scripts/measure-quantized-linear.py). The rows are stored in tiles of ``tw`` output rows,
input-major ([tiles, k, tw]): the kernel vectorizes across the tile's output rows, so each
output is a plain sequential sum over the input and needs no reassociation at all.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kernels import _launch

QK = 32  # weights per block in every type supported here
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 scale (+ fp16 min for Q4_1) + values
SUPPORTED = tuple(_BLOCK_BYTES)
# Output rows per tile: a tile's accumulators for a few input rows stay in L1 (512 floats = 2 KB
# a row), and its inner loop is long enough to amortize the loop overhead (64-row tiles ran 1.3x
# slower at one input row).
MAX_TILE = 512
LANES = 16  # fp32 lanes of an AVX-512 register: tiles a multiple of it vectorize without remainder


# No fastmath in these kernels: without reassociation or contraction every loop shape computes an
# element with the same IEEE operations in the same order, so a row's output is the same whether
# it is computed alone, in a pair or with a leftover row (greedy equality and batching rely on it),
# whatever the compiler or CPU. Allowing fused multiply-adds was only 3-7% faster here.
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


@intrinsic
def _prefetch(typingctx, array, index):  # pragma: no cover - compiled
    """Ask the CPU to start loading the cache line holding ``array.flat[index]`` (a hint: it never
    faults, and changes no result)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr.type, i32, i32, i32]), "llvm.prefetch.p0i8")
        builder.call(fn, [byte_ptr, i32(0), i32(3), i32(1)])  # read, keep in all cache levels, data
        return context.get_dummy_value()

    return types.void(array, types.intp), codegen


# How many input positions ahead of the one being multiplied the kernel prefetches its weight
# bytes. The sums cost about as much as streaming the bytes, and without the hint the two do not
# overlap: 30 layers at one row took 9.6-10.4 ms with none, 7.3-7.7 with 8 or 16, 7.4 with 24.
PREFETCH_AHEAD = 16


@njit(parallel=True, cache=True, nogil=True)
def _quant_linear_kernel(x, d, m, q, out):  # pragma: no cover - compiled
    """``out = x @ (d * q + m).T`` as ``sum over blocks of d * sum(q * x) + m * sum(x)``, one tile
    of output rows per task. Input rows go in pairs (one byte-to-float conversion for both), an odd
    last row alone; per block the partial sums live in ``blk`` (L1), then scale into ``acc``."""
    rows, k = x.shape
    tiles, nb, tw = d.shape
    xs = _block_sums(x)
    flat = q.reshape(-1)
    for c in prange(tiles):
        acc = np.zeros((rows, tw), np.float32)
        blk = np.empty((rows, tw), np.float32)
        for b in range(nb):
            blk[:] = 0
            for t in range(b * QK, b * QK + QK):
                if t + PREFETCH_AHEAD < k:
                    ahead = (c * k + t + PREFETCH_AHEAD) * tw
                    for line in range(0, tw, 64):  # 64-byte cache lines
                        _prefetch(flat, ahead + line)
                i = 0
                while i + 2 <= rows:
                    x0 = x[i, t]
                    x1 = x[i + 1, t]
                    for u in range(tw):
                        f = np.float32(q[c, t, u])
                        blk[i, u] += f * x0
                        blk[i + 1, u] += f * x1
                    i += 2
                if i < rows:
                    x0 = x[i, t]
                    for u in range(tw):
                        blk[i, u] += np.float32(q[c, t, u]) * x0
            for i in range(rows):
                s = xs[i, b]
                for u in range(tw):
                    acc[i, u] += d[c, b, u] * blk[i, u] + m[c, b, u] * s
        out[:, c * tw : (c + 1) * tw] = acc


@njit(parallel=True, cache=True, nogil=True)
def _dequantize_kernel(d, m, q, rows, out):  # pragma: no cover - compiled
    """``out[r] = d * q + m`` of weight row ``rows[r]`` (two roundings, as GGUF's dequantizer)."""
    tw = d.shape[2]
    k = q.shape[1]
    for r in prange(rows.shape[0]):
        c, u = divmod(rows[r], tw)
        for t in range(k):
            out[r, t] = d[c, t >> 5, u] * np.float32(q[c, t, u]) + m[c, t >> 5, u]


def _tile_width(n: int) -> int:
    """The widest tile (at most MAX_TILE rows, a multiple of LANES, dividing ``n``) that gives an
    even number of tiles (work for both cores of the project's CPU), else the widest at all."""
    widths = [w for w in range(LANES, min(n, MAX_TILE) + 1, LANES) if n % w == 0]
    even = [w for w in widths if (n // w) % 2 == 0]
    return max(even or widths)


class QuantMatrix:
    """A weight matrix [n, k] kept as blocks: one byte per weight and, per 32 weights, an fp32
    scale ``d`` and offset ``m`` (given in row layout: q int8 [n, k], d and m [n, k / 32]).

    Indexing reads rows as fp32 (an embedding lookup, a draft vocabulary's LM-head rows), like an
    array; ``take`` / ``concat`` reorder and stack rows without leaving the blocks (load-time work:
    they untile and retile)."""

    def __init__(self, d: np.ndarray, m: np.ndarray, q: np.ndarray):
        n, k = q.shape
        if q.dtype != np.int8 or k % QK or d.shape != (n, k // QK) or m.shape != d.shape:
            raise ValueError(f"QuantMatrix needs q int8 [n, k] (k a multiple of {QK}) and d, m [n, k / {QK}]")
        self.shape = (n, k)
        padded = -(-n // LANES) * LANES  # zero rows up to a multiple of LANES, dropped from outputs
        pad = ((0, padded - n), (0, 0))
        d, m, q = (np.pad(a, pad) for a in (np.asarray(d, np.float32), np.asarray(m, np.float32), q))
        tw = _tile_width(padded)
        self.q = np.ascontiguousarray(q.reshape(padded // tw, tw, k).transpose(0, 2, 1))
        self.d = np.ascontiguousarray(d.reshape(padded // tw, tw, k // QK).transpose(0, 2, 1))
        self.m = np.ascontiguousarray(m.reshape(padded // tw, tw, k // QK).transpose(0, 2, 1))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes

    def row_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(d, m, q)`` as given to the constructor (what the cache file stores)."""
        n = self.shape[0]
        return tuple(np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1])[:n])
                     for a in (self.d, self.m, self.q))

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
                _dequantize_kernel(self.d, self.m, self.q, flat, out)
        return out.reshape(*np.shape(rows), self.shape[1])

    def dense(self) -> np.ndarray:
        """Every weight as fp32 (a prompt's prefill runs a GEMM over them)."""
        return self[:]

    def take(self, indices: np.ndarray, axis: int = 0) -> "QuantMatrix":
        """Rows ``indices`` as a new matrix (``ndarray.take`` along rows, for code written for both)."""
        if axis != 0:
            raise ValueError("a QuantMatrix is reordered by rows only")
        return QuantMatrix(*(a[indices] for a in self.row_layout()))

    @staticmethod
    def concat(parts: Sequence["QuantMatrix"]) -> "QuantMatrix":
        layouts = [p.row_layout() for p in parts]
        return QuantMatrix(*(np.concatenate([lay[f] for lay in layouts]) for f in range(3)))

    def linear(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T`` for ``x`` [rows, k] fp32 contiguous."""
        rows = x.shape[0]
        out = np.empty((rows, self.q.shape[0] * self.q.shape[2]), np.float32)
        if rows:
            with _launch:
                _quant_linear_kernel(x, self.d, self.m, self.q, out)
        return out if out.shape[1] == self.shape[0] else np.ascontiguousarray(out[:, : self.shape[0]])


def from_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantMatrix:
    """A matrix [n, k] from GGUF's raw blocks (``raw`` uint8 [n, bytes per row]) of type ``kind``."""
    n, k = shape
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"tensor type {kind} is not supported (supported: {', '.join(SUPPORTED)})")
    blocks = np.ascontiguousarray(raw).reshape(n, k // QK, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return QuantMatrix(d, np.zeros_like(d), blocks[..., 2:].copy().view(np.int8).reshape(n, k))
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # 16 bytes: weight t low, t + 16 high
    nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int8)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return QuantMatrix(d, m, nibbles.reshape(n, k))
    return QuantMatrix(d, np.zeros_like(d), (nibbles - 8).reshape(n, k))


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
