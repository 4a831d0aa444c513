"""``intdot``'s rule on AMX tiles, for CPUs that have AMX-INT8 (Intel Xeon from Sapphire Rapids on).

Why: on a block of rows the VNNI kernel spends most of its time on the integer products, which
``TDPBSSD`` does about eight times faster: one instruction multiplies a tile of up to 16 input rows
by 32 inputs (one block) against a tile of 16 outputs, into 16 x 16 exact int32 sums. What is left
per block is the rule's fp32 step (``(d * dx) * isum + m * xs`` added to ``out``), the same
operations in the same order as on every other path, so every row has the same bits as there.

The weights stay in ``intdot.pack``'s layout (no second copy): per output vector and block, its
bytes are ``[quad of inputs][output][4 inputs]`` (packed nibbles: quads 0-3 low, 4-7 high), and a
B tile wants ``[quad][16 outputs][4 inputs]``: two neighbouring vectors of a group side by side.
``_unpack`` writes that tile (widening nibbles) into a small buffer just before it is loaded, so
the 4-bit weights stream from memory as 4 bits. The activations are ``intdot.quantize_rows``' int8
rows, loaded as an A tile straight from the row array (row stride: the row's length).

Tile registers: 0 holds the sums (C, rows x 16 int32), 1 the inputs (A, rows x 32 bytes), 2 the
weights (B, 8 x 64 bytes). ``ldtilecfg`` sets their shapes per thread, per group of rows.

Where the CPU has no AMX the tile operations are emulated in plain compiled code (``_emulated_*``:
the same sums, slowly), so the kernel's layout and addressing are tested on every host; the tile
instructions are compiled only where LLVM's host features list ``amx-int8`` and ``amx-tile``, and
used only once Linux granted this process the tile state (``_granted``).
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .intdot_ir import NIBBLE_BYTES, OUT, QK, _scale_at
from .kernels import _FEATURES, even_group

TILE_ROWS = 16  # input rows of an A tile (and of the C tile of sums)
PAIR = 2 * OUT  # outputs of one product: a B tile's 16 columns, two output vectors of ``pack``
QUADS = QK // 4  # rows of a B tile: one per four inputs of the block
B_BYTES = QUADS * PAIR * 4  # a B tile: 8 rows of 64 bytes
C_STRIDE = PAIR * 4  # bytes per row of the stored sums
_A, _B, _C = 1, 2, 0  # tile registers


def _compiled_for_amx() -> bool:
    return "+amx-int8" in _FEATURES and "+amx-tile" in _FEATURES


def _granted() -> bool:
    """Ask Linux for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``):
    without it the first tile instruction kills the process."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


HAS_AMX = _compiled_for_amx()  # the tile instructions are compiled in (else the emulation is)
AVAILABLE = HAS_AMX and _granted()  # and this process may run them


def _i8p():
    return ir.IntType(8).as_pointer()


def _declare(builder, name: str, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), list(args)), name)


def _data(context, builder, kind, value):
    return context.make_array(kind)(context, builder, value).data


@intrinsic
def _amx_configure(typingctx, config):
    """``ldtilecfg`` from ``config`` (``_configure``'s 64 bytes)."""
    def codegen(context, builder, signature, args):
        ptr = builder.bitcast(_data(context, builder, signature.args[0], args[0]), _i8p())
        builder.call(_declare(builder, "llvm.x86.ldtilecfg", _i8p()), [ptr])
        return context.get_dummy_value()

    return types.void(config), codegen


@intrinsic
def _amx_product(typingctx, xq, at, stride, weights, sums):
    """The block's sums of the configured rows: ``sums[r, n] = sum_t xq[at + r * stride + t] *
    B[t // 4, n, t % 4]`` for ``B`` the tile in ``weights`` (``_unpack``), stored at ``C_STRIDE``."""
    def codegen(context, builder, signature, args):
        i8, i64 = ir.IntType(8), ir.IntType(64)
        a = builder.gep(_data(context, builder, signature.args[0], args[0]), [args[1]])
        b = builder.bitcast(_data(context, builder, signature.args[3], args[3]), _i8p())
        c = builder.bitcast(_data(context, builder, signature.args[4], args[4]), _i8p())
        load = _declare(builder, "llvm.x86.tileloadd64", i8, _i8p(), i64)
        builder.call(_declare(builder, "llvm.x86.tilezero", i8), [i8(_C)])
        builder.call(load, [i8(_A), builder.bitcast(a, _i8p()), builder.sext(args[2], i64)])
        builder.call(load, [i8(_B), b, i64(PAIR * 4)])
        builder.call(_declare(builder, "llvm.x86.tdpbssd", i8, i8, i8), [i8(_C), i8(_A), i8(_B)])
        builder.call(_declare(builder, "llvm.x86.tilestored64", i8, _i8p(), i64), [i8(_C), c, i64(C_STRIDE)])
        return context.get_dummy_value()

    return types.void(xq, at, stride, weights, sums), codegen


@njit(cache=True, nogil=True)
def _emulated_product(xq, at, stride, weights, sums, rows):  # pragma: no cover - compiled
    """``_amx_product``'s sums in plain code (``TDPBSSD``: signed bytes, four products a lane)."""
    for r in range(rows):
        for n in range(PAIR):
            total = np.int32(0)
            for t in range(QK):
                total += np.int32(xq[at + r * stride + t]) * np.int32(weights[(t // 4) * PAIR * 4 + 4 * n + t % 4])
            sums[r * PAIR + n] = total


def _tile_configure(config):  # pragma: no cover - replaced in compiled code by the overload below
    """Load ``config`` into the tile registers (nothing where the tiles are emulated)."""


@overload(_tile_configure)
def _tile_configure_impl(config):
    if HAS_AMX:
        return lambda config: _amx_configure(config)
    return lambda config: None


def _tile_product(xq, at, stride, weights, sums, rows):  # pragma: no cover - replaced by the overload below
    """One block's sums for ``rows`` input rows (``_amx_product``), on tiles or emulated."""


@overload(_tile_product)
def _tile_product_impl(xq, at, stride, weights, sums, rows):
    if HAS_AMX:
        return lambda xq, at, stride, weights, sums, rows: _amx_product(xq, at, stride, weights, sums)
    return lambda xq, at, stride, weights, sums, rows: _emulated_product(xq, at, stride, weights, sums, rows)


@njit(cache=True, nogil=True)
def _configure(config, rows):  # pragma: no cover - compiled
    """``ldtilecfg``'s 64 bytes for ``rows`` input rows: palette 1, then per register its bytes a
    row (16-bit, from byte 16) and its rows (from byte 48)."""
    config[:] = 0
    config[0] = 1
    for tile, width, height in ((_C, C_STRIDE, rows), (_A, QK, rows), (_B, PAIR * 4, QUADS)):
        config[16 + 2 * tile] = width & 255
        config[17 + 2 * tile] = width >> 8
        config[48 + tile] = height


@njit(cache=True, nogil=True)
def _unpack(q, at, size, weights):  # pragma: no cover - compiled
    """The B tile of the two output vectors whose blocks start at ``q[at]`` and ``q[at + size]``
    (``pack``'s layout, ``size`` bytes each) into ``weights``: row ``p`` holds both vectors' quad
    ``p``, the first vector's 32 bytes then the second's."""
    if size == NIBBLE_BYTES:
        for v in range(2):
            for p in range(4):
                src, dst = at + v * size + 32 * p, p * PAIR * 4 + 32 * v
                for i in range(32):
                    byte = q[src + i]
                    weights[dst + i] = np.int8(byte & 15)
                    weights[dst + 4 * PAIR * 4 + i] = np.int8(byte >> 4)
    else:
        for v in range(2):
            for p in range(QUADS):
                src, dst = at + v * size + 32 * p, p * PAIR * 4 + 32 * v
                for i in range(32):
                    weights[dst + i] = np.int8(q[src + i])


@njit(parallel=True, cache=True, nogil=True)
def amx_by_tiles(xq, dx, xs, d, m, q, out):  # pragma: no cover - compiled
    """``out = x @ W.T`` by ``intdot``'s rule from ``x``'s quantized rows (``xq``, ``dx``, ``xs``:
    ``intdot.quantize_rows``) and ``pack``'s ``(d, m, q)``, whose groups hold an even number of
    vectors; a task per tile of ``pack``, row groups of up to ``TILE_ROWS`` rows, each pair of
    output vectors through every block with its sums added to ``out`` in the rule's order."""
    rows, k = xq.shape
    tiles, groups, nb, g, size = q.shape
    width, tw, offsets = out.shape[1], groups * g * OUT, m.size > 0
    most = even_group(rows, TILE_ROWS)
    flat, xflat = q.reshape(-1), xq.reshape(-1)
    for c in prange(tiles):
        weights, sums = np.empty(B_BYTES, np.int8), np.empty(TILE_ROWS * PAIR, np.int32)
        config, dv, mv = np.empty(64, np.uint8), np.empty(PAIR, np.float32), np.zeros(PAIR, np.float32)
        i = 0
        while i < rows:
            group = min(most, rows - i)
            _configure(config, group)
            _tile_configure(config)
            for pair in range(groups * g // 2):
                j, w = divmod(2 * pair, g)
                col = c * tw + 2 * pair * OUT
                out[i : i + group, col : col + PAIR] = 0
                for b in range(nb):
                    _unpack(flat, (((c * groups + j) * nb + b) * g + w) * size, size, weights)
                    _tile_product(xflat, i * k + b * QK, k, weights, sums, group)
                    for n in range(PAIR):
                        dv[n] = _scale_at(d, c, j, b, w + n // OUT, n % OUT)
                        if offsets:
                            mv[n] = _scale_at(m, c, j, b, w + n // OUT, n % OUT)
                    _add_block(out, i, col, group, dv, mv, dx[:, b], xs[:, b], sums, offsets)
            i += group


@njit(cache=True, nogil=True)
def _add_block(out, i, col, rows, dv, mv, dx, xs, sums, offsets):  # pragma: no cover - compiled
    """The rule's step for one block: ``out += (d * dx) * isum (+ m * xs)`` for rows ``i ..`` and
    the pair's outputs from ``col``, lane by lane in fp32 without fused multiply-adds."""
    for r in range(rows):
        dxr, xsr = dx[i + r], xs[i + r]
        for n in range(PAIR):
            term = (dv[n] * dxr) * np.float32(sums[r * PAIR + n])
            if offsets:
                term = term + mv[n] * xsr
            out[i + r, col + n] = out[i + r, col + n] + term


def tile_model(d: np.ndarray, m: np.ndarray, q: np.ndarray, tile: int, pair: int, block: int) -> np.ndarray:
    """The B tile ``_unpack`` builds for pair ``pair`` of ``pack``'s tile ``tile`` and block
    ``block``, in numpy from ``pack``'s arrays: [8 quads, 16 outputs, 4 inputs] int8 (for tests)."""
    tiles, groups, nb, g, size = q.shape
    j, w = divmod(2 * pair, g)
    vectors = q[tile, j, block, w : w + 2]  # [2, size]
    if size == NIBBLE_BYTES:
        packed = vectors.reshape(2, 4, OUT, 4)
        quads = np.concatenate([packed & 15, packed >> 4], axis=1)  # quad p low, p + 4 high
    else:
        quads = vectors.reshape(2, QUADS, OUT, 4)
    return np.ascontiguousarray(quads.transpose(1, 0, 2, 3).reshape(QUADS, PAIR, 4)).view(np.int8)
