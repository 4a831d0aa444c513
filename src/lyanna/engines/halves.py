"""A key/value cache of half-precision floats (``transformer.kv_cache_kind``): each key and value
rounded to the nearest half once, when it is written, and widened exactly whenever it is read.

The compiled kernels take no float16 arrays, so such a cache is an array of ``uint16`` holding the
halves' bits: compiled writes go through ``cache_value``, numpy's through ``as_stored`` (the same
rounding: to nearest, ties to even), compiled reads through ``ir_load_floats`` and numpy's through
``as_floats``. Widening a half to float32 is exact, so attention over a half cache computes what it
computes over a float32 cache holding the same rounded values, bit for bit.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


def ir_load_floats(b: ir.IRBuilder, base: ir.Value, offset: ir.Value, kind: ir.Type) -> ir.Value:
    """``kind`` (float32 or a vector of them) from element ``offset`` of ``base``: float32
    elements as they are, 16-bit ones (a half cache's bits, ``KVCache``) widened to float32, which
    is exact, so a key read from a half cache has the bits of the same key stored as float32."""
    lanes = kind.count if isinstance(kind, ir.VectorType) else 1
    at = b.gep(base, [offset])
    if base.type.pointee == ir.IntType(16):
        half = ir.VectorType(ir.HalfType(), lanes) if lanes > 1 else ir.HalfType()
        return b.fpext(b.load(b.bitcast(at, half.as_pointer()), align=2), kind)
    return b.load(b.bitcast(at, kind.as_pointer()), align=4)


@intrinsic
def widen_half(typingctx, bits):
    """float32 from a half's 16 bits, exactly: ``as_floats`` for one value in compiled code
    (``intdot.pack``'s fp16 scales, where ``intdot.dequantize_rows`` reads them)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _half_bits(typingctx, x):
    """float32 ``x`` rounded to the nearest half-precision float (ties to even, as numpy's
    ``astype(np.float16)`` rounds) as its 16 bits."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


def cache_value(cache, x):  # pragma: no cover - replaced in compiled code by the overload below
    """``x`` (float32) as ``cache`` holds it: as it is in a float32 cache, as a half's bits in a
    16-bit one (``KVCache``)."""


@overload(cache_value)
def _cache_value(cache, x):
    if cache.dtype == types.uint16:
        return lambda cache, x: _half_bits(np.float32(x))
    return lambda cache, x: x


def as_stored(cache: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``cache_value`` for numpy: ``values`` as a cache of ``cache``'s dtype holds them."""
    return values.astype(np.float16).view(np.uint16) if cache.dtype == np.uint16 else values


def as_floats(cache: np.ndarray) -> np.ndarray:
    """A cache's (or a slice's) values as float32: a 16-bit cache's halves widened."""
    return cache.view(np.float16).astype(np.float32) if cache.dtype == np.uint16 else cache


@njit(nogil=True, cache=True)
def write_kv(qkv, kh, k_caches, v_caches, layer, span_of, lo, starts, v_at):  # pragma: no cover - compiled
    """Each row's rotated keys ``kh`` and its values (``qkv`` from column ``v_at``) into its
    sequence's caches at layer ``layer`` (slots as ``fused._layers`` says)."""
    kv_heads, head_dim = kh.shape[1], kh.shape[2]
    for i in range(kh.shape[0]):
        s = span_of[i]
        k_cache, v_cache, slot = k_caches[s], v_caches[s], starts[s] + i - lo[s]
        for g in range(kv_heads):
            for e in range(head_dim):
                k_cache[layer, g, slot, e] = cache_value(k_cache, kh[i, g, e])
                v_cache[layer, g, slot, e] = cache_value(v_cache, qkv[i, v_at + g * head_dim + e])
