"""``intdot``'s rule on AMX tiles, for CPUs that have AMX-INT8 (Intel Xeon from Sapphire Rapids on).

Why: on a block of rows the VNNI kernel spends most of its time on the integer products, which
``TDPBSSD`` does about eight times faster: one instruction multiplies a tile of up to 16 input rows
by 32 inputs (one block) against a tile of 16 outputs, into 16 x 16 exact int32 sums. What is left
per block is the rule's fp32 step (``(d * dx) * isum + m * xs`` added to ``out``), the same
operations in the same order as on every other path, so every row has the same bits as there.

The weights stay in ``intdot.pack``'s layout (no second copy): per output vector and block, its
bytes are ``[quad of inputs][output][4 inputs]`` (packed nibbles: quads 0-3 low, 4-7 high), and a
B tile wants ``[quad][16 outputs][4 inputs]``: two neighbouring vectors of a group side by side.
The kernel writes that tile (widening nibbles) into a small buffer just before it is loaded, so
the 4-bit weights stream from memory as 4 bits. The activations are ``intdot.quantize_rows``' int8
rows, loaded as an A tile straight from the row array (row stride: the row's length).

Tile registers: 0 and 3 hold sums (C, rows x 16 int32), 1 and 4 inputs (A, rows x 32 bytes), 2 and 5
weights (B, 8 x 64 bytes), a set for even blocks and one for odd ones. ``ldtilecfg`` sets their
shapes per thread, per group of rows. The loop over pairs and blocks is LLVM IR (``intdot_amx_ir``).

Where the CPU has no AMX the tile product is emulated in plain vector IR (the same sums, slowly),
so the kernel's layout and addressing are tested on every host; the tile instructions are compiled
only where LLVM's host features list ``amx-int8`` and ``amx-tile``, and used only once Linux
granted this process the tile state (``_granted``).
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .intdot_amx_ir import B_BYTES, C_STRIDE, CHUNK, HAS_AMX, PAIR, QUADS, TILE_ROWS, TILE_SETS, _declare, _i8p, _pairs
from .intdot_ir import NIBBLE_BYTES, OUT, QK
from .kernels import even_group


def _granted() -> bool:
    """Ask Linux for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``):
    without it the first tile instruction kills the process."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


AVAILABLE = HAS_AMX and _granted()  # and this process may run them


@intrinsic
def _amx_configure(typingctx, config):
    """``ldtilecfg`` from ``config`` (``_configure``'s 64 bytes)."""
    def codegen(context, builder, signature, args):
        ptr = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, _i8p())
        builder.call(_declare(builder, "llvm.x86.ldtilecfg", _i8p()), [ptr])
        return context.get_dummy_value()

    return types.void(config), codegen


def _tile_configure(config):  # pragma: no cover - replaced in compiled code by the overload below
    """Load ``config`` into the tile registers (nothing where the tiles are emulated)."""


@overload(_tile_configure)
def _tile_configure_impl(config):
    if HAS_AMX:
        return lambda config: _amx_configure(config)
    return lambda config: None


@njit(cache=True, nogil=True)
def _configure(config, rows):  # pragma: no cover - compiled
    """``ldtilecfg``'s 64 bytes for ``rows`` input rows: palette 1, then per register its bytes a
    row (16-bit, from byte 16) and its rows (from byte 48)."""
    config[:] = 0
    config[0] = 1
    for c, a, w in TILE_SETS:
        for tile, width, height in ((c, C_STRIDE, rows), (a, QK, rows), (w, PAIR * 4, QUADS)):
            config[16 + 2 * tile] = width & 255
            config[17 + 2 * tile] = width >> 8
            config[48 + tile] = height


@njit(parallel=True, cache=True, nogil=True)
def amx_by_tiles(xq, dx, xs, d, m, q, out):  # pragma: no cover - compiled
    """``out = x @ W.T`` by ``intdot``'s rule from ``x``'s quantized rows (``xq``, ``dx``, ``xs``:
    ``intdot.quantize_rows``) and ``pack``'s ``(d, m, q)``, whose groups hold an even number of
    vectors: a task per tile of ``pack``, in row groups of up to ``TILE_ROWS`` rows
    (``intdot_amx_ir``: every pair of output vectors through every block)."""
    rows, k = xq.shape
    tiles, groups, nb, g, size = q.shape
    width, tw = out.shape[1], groups * g * OUT
    most = even_group(rows, TILE_ROWS)
    flat, xflat, dflat, sflat = q.reshape(-1), xq.reshape(-1), dx.reshape(-1), xs.reshape(-1)
    dm, mm = d.reshape(-1), m.reshape(-1)
    for c in prange(tiles):
        weights, sums = np.empty(CHUNK * B_BYTES, np.int8), np.empty(CHUNK * TILE_ROWS * PAIR, np.int32)
        config = np.empty(64, np.uint8)
        i = 0
        while i < rows:
            group = min(most, rows - i)
            _configure(config, group)
            _tile_configure(config)
            _pairs(flat, c * groups * nb * g * size, nb, g, size, xflat, i * k, k, dflat, sflat, i * nb, dm, mm,
                   c * groups * nb * g * OUT, out, i * width + c * tw, width, group, 1 if m.size else 0, weights, sums,
                   groups * g // 2)
            i += group


def tile_model(d: np.ndarray, m: np.ndarray, q: np.ndarray, tile: int, pair: int, block: int) -> np.ndarray:
    """The B tile the kernel builds for pair ``pair`` of ``pack``'s tile ``tile`` and block
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
