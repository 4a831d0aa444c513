"""``x @ w.T`` for the few-row blocks that speculative decoding verifies, compiled with numba.

Why not BLAS: a speculative round verifies 2 to 64 tokens, and OpenBLAS's sgemm packs the whole
weight matrix for every call, so on the project's 2-core CPU a 2-token forward of the default
model cost 2.3x a 1-token one (calibration: 16.4 vs 38.3 ms) and verification could never pay.
This kernel streams each weight row once per block: 8 weight rows at a time stay in L1 while
pairs of input rows are multiplied against them, and the 16 accumulators are vectorized over the
hidden dimension. Whole forward passes of SmolLM2-135M on that CPU (``lyanna calibrate --force``,
quiet machine, 2026-11-21), ms for 1 / 2 / 8 / 16 / 64 tokens: OpenBLAS 16.4 / 38.3 / 37.8 /
48.1 / 127.4, these kernels 11.8 / 15.0 / 24.3 / 37.7 / 117.2.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Callable, Protocol, Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.core.codegen import get_host_cpu_features
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic


# what numba compiles for: the package's import set it (``compile_cache.prefer_full_vectors``)
_FEATURES = numba_config.CPU_FEATURES or get_host_cpu_features()
LANES = 16 if "+avx512f" in _FEATURES else 8  # fp32 lanes of one vector register
# A fused multiply-add rounds once, exactly as IEEE 754 defines it, so it is as deterministic as a
# multiply and an add, and it halves the arithmetic of the IR kernels (quant.py: 8 rows took 0.45x
# the old kernel's time with it, 0.56x without). Without the instruction LLVM would call libm's
# fmaf, so such CPUs multiply and add.
_USE_FMA = "+fma" in _FEATURES


class KernelLaunches:
    """What every kernel launch holds. A lock: numba's "workqueue" threading layer aborts when two
    Python threads launch parallel kernels at once. And a warning, once, when a second live thread
    launches kernels: numba's OpenMP layer keeps a team of threads for every launching thread,
    and once the teams hold more threads than there are cores libgomp stops spinning at its
    barriers, so every kernel pays to wake its team (a one-token step of the default model ran
    2.6x slower on a second thread of a 2-core machine, 2026-11-23). An application should run
    every pass on one thread, the one that loaded the model (``lyanna serve`` does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self.warned = False

    def __enter__(self) -> None:
        self._lock.acquire()
        me = threading.current_thread()
        if me not in self._threads:
            self._threads.add(me)
            if not self.warned and sum(t.is_alive() for t in self._threads) > 1:
                self.warned = True
                warnings.warn(f"Lyanna's kernels now run on a second thread ({me.name}) while another that ran them "
                              "is alive: numba's thread teams slow every kernel down (up to 2-3x on a few cores); "
                              "run every forward pass on one thread, the one that loaded the model",
                              RuntimeWarning, stacklevel=2)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


_launch = KernelLaunches()


class SameTypes:
    """A compiled function that a caller calls with arguments of the same numba types every time:
    the first call goes through numba's dispatcher, later ones straight to the machine code it
    compiled for those types. Why: the dispatcher types every argument on every call, and a tuple
    holding typed lists has no fast fingerprint, so typing it costs about as much Python as a
    small kernel's whole call. The caller keeps the types fixed: the same dtype, dimensions and
    contiguity for every array, the same kind for every scalar (the machine code trusts them).
    ``first_calls`` counts, over every such function of the process, the calls that compiled it
    or loaded it from numba's cache (``Transformer.first_runs``)."""

    first_calls = 0

    def __init__(self, kernel: Dispatcher):
        self.kernel = kernel
        self._entry: Callable[..., object] | None = None

    def __call__(self, *args: object) -> object:
        if self._entry is not None:
            return self._entry(*args)
        SameTypes.first_calls += 1
        out = self.kernel(*args)
        self._entry = self.kernel.get_overload(tuple(self.kernel.typeof_pyval(a) for a in args))
        return out


class PackedMatrix(Protocol):
    """A weight matrix [n, k] kept in another format that computes ``x @ W.T`` with its own
    kernel (``quant.QuantMatrix``: a GGUF's quantized blocks); ``linear`` hands such weights to it."""

    shape: tuple[int, int]

    def linear(self, x: np.ndarray) -> np.ndarray: ...

    def dense(self) -> np.ndarray: ...


# Reassociation lets LLVM vectorize the dot products; no "no-infs" flag, because masked
# attention scores are -inf on purpose.
_FAST = {"reassoc", "contract", "arcp", "nsz"}


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _linear_kernel(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    m, k_dim = x.shape
    n = w.shape[0]
    for jb in prange((n + 7) // 8):
        j = jb * 8
        if j + 8 > n:  # tail rows when n is not a multiple of 8
            for jj in range(j, n):
                for i in range(m):
                    acc = np.float32(0.0)
                    for k in range(k_dim):
                        acc += x[i, k] * w[jj, k]
                    out[i, jj] = acc
            continue
        # Every input row goes through the same two-row code (an odd last row is paired with
        # itself), so a row's result never depends on how many rows share its block: greedy
        # speculative decoding and batching rely on that.
        for i in range(0, m, 2):
            i1 = min(i + 1, m - 1)
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
            b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
            for k in range(k_dim):
                x0 = x[i, k]
                x1 = x[i1, k]
                w0 = w[j, k]
                w1 = w[j + 1, k]
                w2 = w[j + 2, k]
                w3 = w[j + 3, k]
                w4 = w[j + 4, k]
                w5 = w[j + 5, k]
                w6 = w[j + 6, k]
                w7 = w[j + 7, k]
                a0 += x0 * w0
                a1 += x0 * w1
                a2 += x0 * w2
                a3 += x0 * w3
                a4 += x0 * w4
                a5 += x0 * w5
                a6 += x0 * w6
                a7 += x0 * w7
                b0 += x1 * w0
                b1 += x1 * w1
                b2 += x1 * w2
                b3 += x1 * w3
                b4 += x1 * w4
                b5 += x1 * w5
                b6 += x1 * w6
                b7 += x1 * w7
            out[i, j], out[i, j + 1], out[i, j + 2], out[i, j + 3] = a0, a1, a2, a3
            out[i, j + 4], out[i, j + 5], out[i, j + 6], out[i, j + 7] = a4, a5, a6, a7
            out[i1, j], out[i1, j + 1], out[i1, j + 2], out[i1, j + 3] = b0, b1, b2, b3
            out[i1, j + 4], out[i1, j + 5], out[i1, j + 6], out[i1, j + 7] = b4, b5, b6, b7


def linear(x: np.ndarray, w: np.ndarray | PackedMatrix) -> np.ndarray:
    """``x @ w.T`` in fp32 for ``x`` [m, k] or [k] and a row-major weight ``w`` [n, k] (fp32, or
    a ``PackedMatrix``, which computes with its own kernel)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    dense = not hasattr(w, "linear")
    if dense:
        w = np.ascontiguousarray(w, dtype=np.float32)
    if x.ndim not in (1, 2) or len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear needs x [m, k] or [k] and w [n, k], got {x.shape} and {w.shape}")
    rows = x.reshape(-1, w.shape[1])
    if not dense:
        out = w.linear(rows)
    else:
        out = np.empty((rows.shape[0], w.shape[0]), np.float32)
        if out.size:
            with _launch:
                _linear_kernel(rows, w, out)
    return out if x.ndim == 2 else out[0]


@intrinsic
def _int_bits_as_float(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bit pattern is the int32 ``bits`` (free: a register reinterpretation)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# exp(x) = 2**n * exp(r) with n = round(x / ln 2) and |r| <= ln(2) / 2; ln 2 split in two so that
# n * _LN2_HI is exact for every n the kernel meets (|n| < 128; _LN2_HI has 9 significant bits).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# Below this exp(x) is under float32's smallest normal number: the softmax weight is 0.
_EXP_FLOOR = np.float32(-87.0)


@njit(cache=True, nogil=True, fastmath=False)
def exp_nonpositive(x: float) -> float:  # pragma: no cover - compiled
    """exp(x) in float32 for x <= 0 (a softmax score minus its row's maximum), within 4e-7
    relative of the true value, and exactly 0 below -87 and for -inf (masked keys).

    Plain arithmetic instead of libm's ``expf``: LLVM vectorizes it (libm's is a scalar call per
    key: 30-40% of attention), and the vector and scalar copies of a loop compute it with the
    same operations, so a key's weight has the same bits whatever number of keys its row has.
    ``fastmath=False`` stated: numba compiles a function that leaves it unset with the flags of
    the first caller that needs it, and every later caller, in this process or from numba's
    cache, gets that copy; compiled first for the draft tree's fastmath softmax, its polynomial
    was fused into multiply-adds and the target's SiLU (``silu_mul_row``) came out a last bit
    apart, so plain decoding's tokens could depend on what a process compiled first."""
    if x < _EXP_FLOOR:
        return np.float32(0.0)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    # Taylor series of exp(r) to r**7 / 7!: the next term is below 6e-9 for |r| <= ln(2) / 2
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _int_bits_as_float((np.int32(n) + np.int32(127)) << np.int32(23))  # times 2**n


def _ir_exp(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``kernels.exp_nonpositive``'s arithmetic on ``x`` (float32 or a vector of them), with
    every multiply-add an explicit ``fma``: a lane of a vector and the same value alone get the
    same bits (no contraction left to the compiler), 0 below -87 and for -inf."""
    kind = x.type
    lanes = kind.count if isinstance(kind, ir.VectorType) else 1
    c = lambda v: ir_splat(b, ir.Constant(ir.FloatType(), float(v)), kind)  # noqa: E731
    fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(kind, [kind] * 3),
                                         f"llvm.fma.v{lanes}f32" if lanes > 1 else "llvm.fma.f32")
    floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(kind, [kind]),
                                           f"llvm.floor.v{lanes}f32" if lanes > 1 else "llvm.floor.f32")
    n = b.call(floor, [b.call(fma, [x, c(_LOG2E), c(0.5)])])
    neg = b.fneg(n)
    r = b.call(fma, [neg, c(_LN2_LO), b.call(fma, [neg, c(_LN2_HI), x])])
    poly = c(1.0 / 5040.0)
    for coef in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        poly = b.call(fma, [poly, r, c(coef)])
    ints = ir.VectorType(ir.IntType(32), lanes) if lanes > 1 else ir.IntType(32)
    bias = ir_splat(b, ir.IntType(32)(127), ints)
    safe = b.select(b.fcmp_ordered(">=", x, c(_EXP_FLOOR)), n, c(0.0))  # -inf and far below: any exponent, unused
    two_n = b.bitcast(b.shl(b.add(b.fptosi(safe, ints), bias), ir_splat(b, ir.IntType(32)(23), ints)), kind)
    return b.select(b.fcmp_ordered(">=", x, c(_EXP_FLOOR)), b.fmul(poly, two_n), c(0.0))


# On one core: a parallel launch cost more than the norm of 1 to 8 rows (on the 2-core Zen 4,
# 2026-11-27: 1.3 / 1.5 us a call against 0.1 / 0.5 us serial; 64 rows 3.4 against 4.2), and a pass
# makes two a layer. No fastmath flags here nor in the sum: see ``_sum_of_squares``.
@njit(cache=True, nogil=True)
def _rms_norm_kernel(x: np.ndarray, weight: np.ndarray, eps: np.float32, out: np.ndarray) -> None:  # pragma: no cover - compiled
    n, d = x.shape
    for r in range(n):
        inv = np.float32(1.0) / np.sqrt(_sum_of_squares(x, r) / np.float32(d) + eps)
        for c in range(d):
            out[r, c] = x[r, c] * inv * weight[c]


@njit(cache=True, nogil=True)
def _sum_of_squares(x: np.ndarray, r: int) -> np.float32:  # pragma: no cover - compiled
    """Row ``r``'s sum of squares in an order the code fixes: eight running sums (column ``c``
    to sum ``c % 8``; the last columns of a row whose length 8 does not divide to the first),
    added pairwise. Why not a plain loop with ``reassoc``: LLVM then picks the order as it
    vectorizes, and it picked differently where the norm was compiled inside another function
    (the one-token pass on held threads, ``step``), so the same row's norm came out a last bit
    apart on two paths. Eight independent sums still vectorize, and without fastmath flags every
    compiled copy computes the written operations."""
    d = x.shape[1]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    body = d - d % 8
    for c in range(0, body, 8):
        s0 += x[r, c] * x[r, c]
        s1 += x[r, c + 1] * x[r, c + 1]
        s2 += x[r, c + 2] * x[r, c + 2]
        s3 += x[r, c + 3] * x[r, c + 3]
        s4 += x[r, c + 4] * x[r, c + 4]
        s5 += x[r, c + 5] * x[r, c + 5]
        s6 += x[r, c + 6] * x[r, c + 6]
        s7 += x[r, c + 7] * x[r, c + 7]
    for c in range(body, d):
        s0 += x[r, c] * x[r, c]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row of ``x`` ([n, d] or [d]) in fp32. Compiled, one pass per row, instead
    of numpy's five passes over the block: a prompt's prefill spent ~1 s of 20 in
    numpy's version for 48 prompts; a row's result does not depend on the rows beside it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    if rows.size:
        with _launch:
            _rms_norm_kernel(rows, np.ascontiguousarray(weight, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


@njit(parallel=True, cache=True, nogil=True)
def _silu_mul_kernel(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    for r in prange(gate_up.shape[0]):
        silu_mul_row(gate_up, out, r)


@njit(cache=True, nogil=True)
def silu_mul_row(gate_up: np.ndarray, out: np.ndarray, r: int) -> None:  # pragma: no cover - compiled
    """Row ``r`` of ``_silu_mul_kernel``'s output. No fastmath flags: with them (contraction,
    reciprocals, reassociation) the compiled loop's vectors and its scalar tail, and copies of
    it compiled inside other functions (``step``), gave some values a last bit apart; without
    them every copy computes the written operations, so a value's bits do not depend on where
    or in which lane it is computed."""
    half = gate_up.shape[1] // 2
    for c in range(half):
        g = gate_up[r, c]
        e = exp_nonpositive(-abs(g))  # never overflows: sigmoid(g) from exp(-|g|)
        sigmoid = (np.float32(1.0) if g >= 0 else e) / (np.float32(1.0) + e)
        out[r, c] = g * sigmoid * gate_up[r, half + c]


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` for rows ``[gate | up]`` ([n, 2 * intermediate]): the MLP's activation
    in one compiled pass (numpy's takes five over a [n, intermediate] block, ~2 s of a 48-prompt
    prefill's 20), with the attention kernel's exp."""
    gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul needs [n, 2 * intermediate], got {gate_up.shape}")
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    if out.size:
        with _launch:
            _silu_mul_kernel(gate_up, out)
    return out


@njit(cache=True, nogil=True)
def _rope_kernel(qkv: np.ndarray, rot: np.ndarray, heads: int, kv_heads: int, head_dim: int, scale: np.float32,
                 q_out: np.ndarray, k_out: np.ndarray) -> None:  # pragma: no cover - compiled
    n = qkv.shape[0]
    for i in range(n):
        for h in range(heads + kv_heads):
            base = h * head_dim
            for p in range(head_dim // 2):
                re = qkv[i, base + 2 * p]
                im = qkv[i, base + 2 * p + 1]
                c = rot[i, p].real
                s = rot[i, p].imag
                a = re * c - im * s
                b = re * s + im * c
                if h < heads:
                    q_out[i, h, 2 * p] = a * scale
                    q_out[i, h, 2 * p + 1] = b * scale
                else:
                    k_out[i, h - heads, 2 * p] = a
                    k_out[i, h - heads, 2 * p + 1] = b


def rope_qk(qkv: np.ndarray, rot: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Queries [n, heads, head_dim] (rotated and scaled by 1 / sqrt(head_dim)) and keys
    [n, kv_heads, head_dim] (rotated) from the fused projection rows ``qkv`` (rotary pairs
    adjacent) and the rotations ``rot`` [n, head_dim / 2] (complex unit factors). One compiled
    pass instead of numpy's nine small operations."""
    n = qkv.shape[0]
    if qkv.ndim != 2 or qkv.shape[1] < (heads + kv_heads) * head_dim or rot.shape != (n, head_dim // 2):
        raise ValueError(f"rope_qk shapes do not fit: qkv {qkv.shape}, rot {rot.shape}")
    q = np.empty((n, heads, head_dim), np.float32)
    k = np.empty((n, kv_heads, head_dim), np.float32)
    _rope_kernel(qkv, rot, heads, kv_heads, head_dim, np.float32(1.0 / np.sqrt(head_dim)), q, k)
    return q, k


# Rows from which a prompt's prefill goes through PyTorch's kernels (``linear_rows``,
# ``prefill_attention``): from here on its sgemm outran ``linear`` on the 2-core Xeon for every
# weight shape of the default model (2026-11-22; at 32 rows it lost on one shape).
BULK_MIN_ROWS = 48


def linear_rows(x: np.ndarray, w: np.ndarray | PackedMatrix, bulk: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """``x @ w.T`` where each row range ``[lo, hi)`` of ``bulk`` (a prompt's prefill) of at least
    ``BULK_MIN_ROWS`` rows goes through one GEMM call of its own and every other row through
    ``linear``. A GEMM's rows can depend on the block they come in, so only prefill goes that way:
    a prompt is prefilled the same way by every method, alone or in a batch (its own call, on an
    aligned copy of its rows), and verified or decoded rows never go through it.

    A packed ``w`` (a GGUF's blocks) keeps all rows on its own kernel: dequantizing it for a GEMM
    lost at every prompt length tried (default model, whole prefill, 2-core AMD EPYC, 2026-11-23),
    and keeping prompts on the kernel makes a row's bits independent of how the prompt is split
    into blocks, which the prefix cache needs."""
    ranges = [(lo, hi) for lo, hi in bulk if hi - lo >= BULK_MIN_ROWS]
    if not ranges or hasattr(w, "linear"):
        return linear(x, w)
    if ranges == [(0, x.shape[0])]:  # a prompt alone: its GEMM's output is the answer
        return _gemm(x, w)
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    rest = np.ones(x.shape[0], bool)
    for lo, hi in ranges:
        out[lo:hi] = _gemm(x[lo:hi], w)
        rest[lo:hi] = False
    if rest.any():
        out[rest] = linear(x[rest], w)
    return out


def _aligned(x: np.ndarray) -> np.ndarray:
    """``x`` contiguous at a 64-byte aligned address (itself when it already is, else a copy):
    BLAS kernels may take another path for another alignment or layout, which would change the
    last bits of a prompt's numbers."""
    if x.dtype == np.float32 and x.flags.c_contiguous and x.ctypes.data % 64 == 0:
        return x
    flat = np.empty(x.size + 16, np.float32)
    skip = (-flat.ctypes.data % 64) // 4
    out = flat[skip : skip + x.size].reshape(x.shape)
    out[...] = x
    return out


def _gemm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` by PyTorch's CPU sgemm."""
    import torch

    with _launch:
        return torch.nn.functional.linear(torch.from_numpy(_aligned(x)), torch.from_numpy(w)).numpy()


@njit(cache=True, nogil=True)
def even_group(count: int, most: int) -> int:  # pragma: no cover - compiled
    """The size of each group when ``count`` items go in groups of at most ``most``, as even as
    they can be (5 in groups of 4: 3 + 2, not 4 + 1): the kernels' row groups and attention's
    runs of query rows, where a group's cost is mostly what it reads, whatever its rows."""
    groups = (count + most - 1) // most
    return (count + groups - 1) // groups


def ir_splat(b: ir.IRBuilder, scalar: ir.Value, kind: ir.Type) -> ir.Value:
    """``scalar`` in every lane of a value of ``kind`` (itself when ``kind`` is a scalar type)."""
    if not isinstance(kind, ir.VectorType):
        return scalar
    i32 = ir.IntType(32)
    undef = ir.Constant(kind, ir.Undefined)
    zeros = ir.Constant(ir.VectorType(i32, kind.count), [0] * kind.count)
    return b.shuffle_vector(b.insert_element(undef, scalar, i32(0)), undef, zeros)


def ir_muladd(b: ir.IRBuilder, kind: ir.Type) -> Callable[[ir.Value, ir.Value, ir.Value], ir.Value]:
    """``(x, y, z) -> x * y + z`` on values of ``kind`` (float32 or a vector of them): one fused
    multiply-add where the CPU has it (``_USE_FMA``), else a multiply then an add."""
    if not _USE_FMA:
        return lambda x, y, z: b.fadd(b.fmul(x, y), z)
    lanes = kind.count if isinstance(kind, ir.VectorType) else 1
    fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(kind, [kind] * 3),
                                         f"llvm.fma.v{lanes}f32" if lanes > 1 else "llvm.fma.f32")
    return lambda x, y, z: b.call(fma, [x, y, z])


