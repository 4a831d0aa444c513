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
``vnni`` instead reads each weight as the unsigned byte ``q + 128`` and takes ``128 * sum(xq)`` of
the row's block off). Output rows go 8 to a vector (8 int32 lanes of a 256-bit register); each
vector's 32 weights of a block are ``[quad p][output][4 inputs]`` so a broadcast of four input
bytes meets four consecutive weights of every output. The packed layout holds quad ``p`` in the
low nibbles and quad ``p + 4`` in the high ones. A tile's vectors go in groups of
``VECTOR_GROUP``, each group's blocks one after another with the group's vectors side by side in
each (weights and scales alike): the kernel takes a group's vectors through every block with
their outputs in registers, so it reads the bytes in the order they lie.

Paths (``PATH``: the first of ``PATHS`` the CPU has, or ``LYANNA_INTDOT_PATH``, chosen at import): ``vnni``
(``vpdpbusd``, AVX-512 VNNI or AVX-VNNI: four byte products added into each 32-bit lane in one
instruction, so no 16-bit partial sums and no widening step; with AVX-512 VNNI two output vectors
share a 512-bit register, and four share each broadcast input below ``intdot_ir.PAIR_ROWS`` rows), ``avx2``
(``vpmaddubsw`` + ``vpmaddwd``; AVX-512 CPUs run it too) and ``portable`` (the same integers in plain LLVM vector IR, for any CPU). Every path
computes the same integers, so they agree bit for bit; each is tested against ``reference``. On
CPUs with AMX-INT8, ``amx`` (asked for by name) takes blocks of rows on tiles (``intdot_amx``).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import intdot_amx
from .halves import widen_half
from .intdot_ir import (ALL_PATHS as _IR_PATHS, BYTE_BYTES, GROUP, HAS_AVX2, HAS_F16C, HAS_VNNI,  # noqa: F401
                        MANY_TILES, MAX_TILE, NIBBLE_BYTES, OUT, PATHS as _IR_RUNS, PREFETCH_BYTES, QK, _block_avx2,
                        _block_portable, _block_vnni)
from .kernels import even_group, ir_splat

# ``amx`` (``intdot_amx``): tile products for blocks of ``AMX_ROWS`` rows and more, the first path
# of ``PATHS`` for fewer (on fewer rows the tiles' fixed costs lost to it). It runs only where it is
# asked for (``LYANNA_INTDOT_PATH=amx``): measured on an AMX host it takes about the first path's
# time, since a block's rows cost mostly the rule's fp32 step, the same on every path
# (docs/engine.md); every other path is in ``intdot_ir``. Tests set ``PATH = AMX`` on any CPU:
# without AMX its tile products are emulated (the same bits, slowly).
AMX = "amx"
ALL_PATHS = _IR_PATHS + (AMX,)  # a path's index is what the kernels take
PATHS = _IR_RUNS + ((AMX,) if intdot_amx.AVAILABLE else ())  # the ones this CPU runs
AMX_ROWS = 8
_FIRST = _IR_PATHS.index(_IR_RUNS[0])


def _chosen_path() -> str:
    """The fastest path this CPU runs, or the one ``LYANNA_INTDOT_PATH`` names (to compare paths,
    or to rule one out): every path gives the same bits, so this changes speed only."""
    name = os.environ.get("LYANNA_INTDOT_PATH", "").strip() or _IR_RUNS[0]
    if name not in PATHS:
        raise ValueError(f"LYANNA_INTDOT_PATH={name!r}: this CPU runs {', '.join(PATHS)}")
    return name


PATH = _chosen_path()  # the path every matrix takes, read at each call (a test may set it)


def path_index() -> int:
    """``PATH`` as the ``path`` argument of ``int_linear_kernel``."""
    return ALL_PATHS.index(PATH)



@intrinsic
def _quantize_block(typingctx, x, xoff, xq, dx, xs, xc, soff):
    """One block of 32 inputs at ``x[xoff:]`` by the module's rule, in vectors of 8: ``xq`` at the
    same offset, ``dx[soff]``, ``xs[soff]`` and ``xc[soff] = 128 * sum(xq)`` (exact in int32: what
    ``vnni`` takes off a block's sums, ``intdot_ir``). The sum goes in float64 in the order the rule
    states (lane j of eight: ``((x[j] + x[j+8]) + x[j+16]) + x[j+24]``, then the lanes pairwise),
    which the vector unit runs as it stands: summed one input after another in fp32 it was a chain
    of 31 dependent additions a block, and quantizing took a tenth of a 64-row pass. Why float64:
    the model is sensitive to this sum's rounding (it multiplies Q4_1's offsets, which nearly
    cancel the scaled integer sums); in fp32 the perplexity of ``scripts/measure-int8-quality.py``
    moved by 0.5% between two summation orders; the float64 sum is exact unless a block's values
    span more than about 24 binary orders of magnitude, and is then rounded once."""
    def codegen(context, builder, signature, args):
        b = builder
        xp, xqp, dxp, xsp, xcp = (context.make_array(signature.args[i])(context, builder, args[i]).data
                                  for i in (0, 2, 3, 4, 5))
        xoff, soff = args[1], args[6]
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
        ints = []
        for g, v in enumerate(parts):
            r = b.call(vmin, [vmax([b.call(rint, [b.fmul(v, scale)]), lo]), hi])
            ints.append(b.fptosi(r, v8i))
            b.store(b.trunc(ints[-1], v8b), at(xqp, b.add(xoff, xoff.type(8 * g)), v8b), align=1)
        isum = b.add(b.add(ints[0], ints[1]), b.add(ints[2], ints[3]))  # integers: any order is exact
        isum = b.add(pick(isum, [0, 1, 2, 3]), pick(isum, [4, 5, 6, 7]))
        isum = b.add(pick(isum, [0, 1]), pick(isum, [2, 3]))
        isum = b.add(b.extract_element(isum, i32(0)), b.extract_element(isum, i32(1)))
        b.store(b.mul(isum, i32(128)), b.gep(xcp, [soff]))
        return context.get_dummy_value()

    return types.void(x, xoff, xq, dx, xs, xc, soff), codegen


@njit(cache=True, nogil=True)
def quantize_rows(x):  # pragma: no cover - compiled
    """``(xq, dx, xs, xc)`` of each row of ``x`` [rows, k] per block of 32 (see the module's rule
    and ``_quantize_block``)."""
    quantized = _quantized(x)
    _quantize_span(x, 0, x.shape[0], quantized)
    return quantized


@njit(cache=True, nogil=True)
def _quantized(x):  # pragma: no cover - compiled
    """Room for ``quantize_rows``' four arrays."""
    rows, k = x.shape
    nb = k // QK
    return (np.empty((rows, k), np.int8), np.empty((rows, nb), np.float32), np.empty((rows, nb), np.float32),
            np.empty((rows, nb), np.int32))


@njit(cache=True, nogil=True)
def _quantize_span(x, lo, hi, quantized):  # pragma: no cover - compiled
    """Rows ``lo`` to ``hi`` of ``x`` into ``quantized`` (``_quantized``)."""
    k = x.shape[1]
    nb = k // QK
    flat = x.reshape(-1)
    xq, dx, xs, xc = quantized
    qflat, dflat, sflat, cflat = xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), xc.reshape(-1)
    for i in range(lo, hi):
        for b in range(nb):
            _quantize_block(flat, i * k + b * QK, qflat, dflat, sflat, cflat, i * nb + b)


# Blocks of ROW_SHARES_MIN rows and more on matrices of fewer than MANY_TILES tiles (a layer's
# qkv, o and down projections) are shared among the threads by rows, up to ROW_SHARE rows a task
# in an even number of tasks (``_shares``: 12 rows on two threads are 6 + 6, not 4 + 4 + 4,
# where one thread ran a third share alone), over every tile, instead of by tiles: split by tiles,
# each of two threads held one tile of such a matrix and the pair ran well below twice one
# thread's speed, while by rows each streams the whole matrix (a few hundred KB, the second time
# from its cache) for its rows. Five rows stay split by tiles, one group of 5 a tile: with the
# kernel's chunks of four vectors (before ``intdot_ir.PAIR_ROWS``) that took 0.95x the time of two
# shares of 3 + 2 rows. Blocks
# of ROW_SHARES_WIDE rows and more go by rows on matrices of fewer than WIDE_TILES tiles too (a
# layer's gate and up projections, about 1 MB): two threads scaled better by rows than by tiles
# there. The LM head (tens of tiles) stays split by tiles: by rows both threads would stream all
# of its 30 MB.
# Measured on the 2-core Zen 4: docs/engine.md (latency against block size).
ROW_SHARE = 8
ROW_SHARES_MIN = 6
ROW_SHARES_WIDE, WIDE_TILES = 8, 8
# Output vectors whose blocks lie side by side (``_grouped``): the widest chunk of the kernel.
VECTOR_GROUP = 4
# Output vectors of a tile that every row group of a block takes in turn where a block has more
# than one group: the first group's loads bring the span's weights into L1 for the others, so the
# tile streams from memory while all the groups compute, not while the first one alone does.
SPAN = VECTOR_GROUP


@njit(cache=True, nogil=True)
def int_linear_kernel(x, d, m, q, out, path):  # pragma: no cover - compiled
    """``out = x @ W.T`` by the module's rule on path ``ALL_PATHS[path]``; ``q`` [tiles, groups,
    blocks, vectors of a group, bytes] (32 * 4 bytes per vector when packed, 32 * 8 when not),
    ``d``/``m`` [tiles, groups, blocks, vectors of a group, 8] (``pack``). Shared among
    the threads by tiles, or by rows (``ROW_SHARE``): every row's outputs have the same bits
    either way."""
    rows, tiles = x.shape[0], d.shape[0]
    if path == len(_IR_PATHS):  # amx: tiles for blocks, the first path of ``PATHS`` for single rows
        if rows >= AMX_ROWS and _amx_linear(x, d, m, q, out):
            return
        path = _FIRST
    if (rows >= ROW_SHARES_MIN and tiles < MANY_TILES) or (rows >= ROW_SHARES_WIDE and tiles < WIDE_TILES):
        _by_rows(x, _quantized(x), d, m, q, out, path)  # each share quantizes its own rows
    else:
        xq, dx, xs, xc = quantize_rows(x)
        _by_blocks(xq, dx, xs, xc, d, m, q, out, path)


@njit(cache=True, nogil=True)
def _amx_linear(x, d, m, q, out):  # pragma: no cover - compiled
    """``int_linear_kernel`` on AMX tiles (``intdot_amx``: emulated where this build targets no AMX,
    which only tests ask for, setting ``PATH`` themselves); False, nothing done, where the matrix's
    groups hold an odd number of vectors."""
    if q.shape[3] % 2:
        return False
    xq, dx, xs, _ = quantize_rows(x)
    intdot_amx.amx_by_tiles(xq, dx, xs, d, m, q, out)
    return True


@njit(cache=True, nogil=True)
def _shapes(xq, d, m, q):  # pragma: no cover - compiled
    """What the kernels read of the operands' shapes: rows, inputs, tiles, blocks, tile width,
    output vectors a tile, vectors a group (``_grouped``), bytes of a vector's block, whether the
    weights are packed nibbles, whether ``m`` was kept (``pack`` leaves out an all-zero m)."""
    tiles, groups, nb, g, size = q.shape
    return (xq.shape[0], xq.shape[1], tiles, nb, groups * g * OUT, groups * g, g, size, 1 if size == NIBBLE_BYTES else 0,
            1 if m.size else 0)


@njit(cache=True, nogil=True)
def _shares(rows):  # pragma: no cover - compiled
    """How many shares ``_by_rows`` cuts ``rows`` rows into: an even number (the project's CPUs
    have two cores; the thread count is not read here, which would keep numba from caching the
    kernels), each of at most ``ROW_SHARE`` rows."""
    return 2 * ((rows + 2 * ROW_SHARE - 1) // (2 * ROW_SHARE))


@njit(cache=True, nogil=True)
def _share_span(rows, shares, share):  # pragma: no cover - compiled
    """Where share ``share`` of ``shares`` starts and how many rows it takes, as even as they go:
    49 rows in 8 shares are seven of 6 and one of 7."""
    start = share * rows // shares
    return start, (share + 1) * rows // shares - start


@njit(parallel=True, cache=True, nogil=True)
def _by_rows(x, quantized, d, m, q, out, path):  # pragma: no cover - compiled
    """``int_linear_kernel`` by shares of up to ``ROW_SHARE`` rows: each share quantizes its rows of
    ``x`` (into ``quantized``) and takes every tile for them."""
    xq, dx, xs, xc = quantized
    rows, k, tiles, nb, tw, nvec, g, size, nibbles, offsets = _shapes(xq, d, m, q)
    flat, xflat, dflat, sflat, cflat = q.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), xc.reshape(-1)
    width = out.shape[1]
    shares = _shares(rows)
    # as int64s, not literals: ``_tile``'s argument types as ``tile_rows`` gives them, so both callers
    # share one compiled copy of it (numba compiles a callee again for each literal it is given)
    streams, first_vector = np.int64(1), np.int64(0)
    for share in prange(shares):
        i, group = _share_span(rows, shares, share)
        _quantize_span(x, i, i + group, quantized)
        out[i : i + group] = 0
        for c in range(tiles):
            _tile(path, (flat, c * nb * nvec * size, nvec, nibbles, xflat, i * k, k, dflat, sflat, i * nb, nb, d, m,
                         c * nb * tw, out, i * width + c * tw, width, group, streams, offsets, cflat, first_vector, g))


@njit(parallel=True, cache=True, nogil=True)
def _by_blocks(xq, dx, xs, xc, d, m, q, out, path):  # pragma: no cover - compiled
    """``int_linear_kernel`` tile by tile (``tile_rows``), the tiles shared among the threads."""
    for c in prange(d.shape[0]):  # the index as an int64, as ``step`` gives it: one compiled ``tile_rows``
        tile_rows(np.int64(c), xq, dx, xs, xc, d, m, q, out, path)


@njit(cache=True, nogil=True)
def tile_rows(c, xq, dx, xs, xc, d, m, q, out, path):  # pragma: no cover - compiled
    """Tile ``c``'s outputs of every row, up to GROUP rows a call (a call: every block of a span
    of the tile's output vectors); what one task of ``_by_blocks`` does, and of the one-row pass
    on held threads (``step``)."""
    rows, k, tiles, nb, tw, nvec, g, size, nibbles, offsets = _shapes(xq, d, m, q)
    # as even as they go: 9 rows in groups of 8 were 8 + 1, the second group paying nearly a whole
    # group's unpacking and scaling for one row (docs/engine.md); each row's sums are the same bits
    most = even_group(rows, GROUP)
    flat, xflat, dflat, sflat, cflat = q.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1), xc.reshape(-1)
    width = out.shape[1]
    span = nvec if rows <= most else SPAN
    out[:, c * tw : (c + 1) * tw] = 0
    for j in range(0, nvec, span):
        i = 0
        while i < rows:  # the first group streams the span's weights, the others find them in L1
            group = min(most, rows - i)
            _tile(path, (flat, c * nb * nvec * size, min(j + span, nvec), nibbles, xflat, i * k, k, dflat,
                         sflat, i * nb, nb, d, m, c * nb * tw, out, i * width + c * tw, width, group,
                         1 if i == 0 else 0, offsets, cflat, j, g))
            i += group


@njit(cache=True, nogil=True)
def _tile(path, args):  # pragma: no cover - compiled
    """One call of the tile kernel (``intdot_ir``: every block of a tile for up to GROUP rows) on
    path ``ALL_PATHS[path]``."""
    if path == 0:
        _block_vnni(*args)
    elif path == 1:
        _block_avx2(*args)
    else:
        _block_portable(*args)


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
        data = _grouped(packed.transpose(0, 1, 3, 4, 2, 5).reshape(tiles, tw // OUT, nb, NIBBLE_BYTES))
    else:
        data = _grouped(blocks.transpose(0, 1, 3, 4, 2, 5).reshape(tiles, tw // OUT, nb, BYTE_BYTES).view(np.uint8))
    half = HAS_F16C and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (d, m))
    scales = [_grouped(a.reshape(tiles, tw // OUT, OUT, nb).transpose(0, 1, 3, 2)) for a in (d, m)]
    if half:
        scales = [a.astype(np.float16).view(np.uint16) for a in scales]
    if not m.any() and not np.signbit(m).any():
        scales[1] = np.zeros(scales[0].shape[:-1] + (0,), scales[0].dtype)  # one type for d and m, as the kernel reads them
    return scales[0], scales[1], np.ascontiguousarray(data)


def _grouped(a: np.ndarray) -> np.ndarray:
    """[tiles, vectors, blocks, x] as [tiles, groups, blocks, vectors of the group, x]: a group's
    block is its vectors' blocks side by side, so a chunk of the kernel (``intdot_ir``), which
    takes a group's vectors block after block, reads its bytes in the order they lie."""
    tiles, nvec, nb, width = a.shape
    g = next(g for g in (VECTOR_GROUP, 2, 1) if nvec % g == 0)
    return np.ascontiguousarray(a.reshape(tiles, nvec // g, g, nb, width).transpose(0, 1, 3, 2, 4))


def _ungrouped(a: np.ndarray) -> np.ndarray:
    """``_grouped``'s inverse."""
    tiles, groups, nb, g, width = a.shape
    return a.transpose(0, 1, 3, 2, 4).reshape(tiles, groups * g, nb, width)


def _float_scales(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def unpack(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack``'s inverse: ``(d, m, q)`` in row layout (fp32 scales, m zeros where it was left out)."""
    d, m, q = _ungrouped(d), _ungrouped(m), _ungrouped(q)
    tiles, nvec, nb, size = q.shape
    if size == NIBBLE_BYTES:
        packed = q.reshape(tiles, nvec, nb, 4, OUT, 4)
        quads = np.concatenate([packed & 15, packed >> 4], axis=3)
    else:
        quads = q.reshape(tiles, nvec, nb, 8, OUT, 4)
    values = quads.view(np.int8).transpose(0, 1, 4, 2, 3, 5).reshape(tiles * nvec * OUT, nb * QK)
    d = _float_scales(d)
    m = _float_scales(m) if m.size else np.zeros_like(d)
    d2, m2 = (np.ascontiguousarray(a.transpose(0, 1, 3, 2).reshape(-1, nb)) for a in (d, m))
    return d2, m2, np.ascontiguousarray(values)


def _scale_at(a, c, v, b, w, lane):  # pragma: no cover - replaced in compiled code by the overload below
    """Scale ``a[c, v, b, w, lane]`` as fp32, whether ``pack`` kept it as fp32 or as fp16 bits."""


@overload(_scale_at)
def _scale_at_by_type(a, c, v, b, w, lane):
    if a.dtype == types.uint16:
        return lambda a, c, v, b, w, lane: widen_half(a[c, v, b, w, lane])
    return lambda a, c, v, b, w, lane: a[c, v, b, w, lane]


@njit(parallel=True, cache=True, nogil=True)
def dequantize_rows(d, m, q, rows, out):  # pragma: no cover - compiled
    """``out[r] = d * q + m`` of weight row ``rows[r]`` (two roundings, as GGUF's dequantizer)."""
    g = q.shape[3]  # vectors a group (``_grouped``)
    tw = d.shape[1] * g * OUT
    packed = q.shape[4] == NIBBLE_BYTES
    offsets = m.size > 0
    for r in prange(rows.shape[0]):
        c, u = divmod(rows[r], tw)
        vector, lane = divmod(u, OUT)
        v, w = divmod(vector, g)
        for t in range(out.shape[1]):
            b, within = divmod(t, QK)
            quad, j = divmod(within, 4)
            if packed:
                byte = q[c, v, b, w, (quad & 3) * 32 + lane * 4 + j]
                value = np.float32(byte & 15 if quad < 4 else byte >> 4)
            else:
                value = np.float32(np.int8(q[c, v, b, w, quad * 32 + lane * 4 + j]))
            # + 0.0 where m was left out: the same bits as adding the +0 it held
            offset = _scale_at(m, c, v, b, w, lane) if offsets else np.float32(0.0)
            out[r, t] = _scale_at(d, c, v, b, w, lane) * value + offset


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
