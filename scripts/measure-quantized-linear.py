"""Prototypes of computing on GGUF blocks (before ``quant.py``): a numba linear layer that reads Q4_1 blocks directly
against today's fp32 kernel (``kernels.linear``) over the same weights dequantized, for blocks of
1 / 2 / 8 / 16 / 64 rows on the default model's weight shapes.

The prototype converts each 8-row x 32-column weight tile to fp32 once per block of input rows
(``d * q + m`` with two roundings, as the GGUF dequantizer computes it: the tile equals today's
fp32 weights bit for bit) and then runs the fp32 kernel's two-row code over it, so a row's result
does not depend on how many rows share its block. Prints ms per call and writes JSON. Each matrix
exists in 30 copies (one per layer) so the weights stream from memory as in a real forward.

First result (docs/bench/quantized-linear.json, 2-core Intel Xeon, 2026-11-23, nothing else
running): one layer's four matmuls take 0.55 / 0.53 / 0.94 / 1.39 / 4.08 ms in fp32 for 1 / 2 / 8 /
16 / 64 rows and 1.76 / 1.99 / 2.69 / 4.00 / 9.75 ms in this prototype (0.27x-0.42x); every row
equals its own single-row call, and the result is within 7e-6 of fp32 over the dequantized weights
(the sums are chunked differently). Here the fp32 kernel streams ~26 GB/s and is not purely
bound by memory, so the scalar nibble unpacking costs more than the bytes it saves: the route
needs a vectorized unpack (or one byte per weight) before it can pay.

Second prototype (route 1b, ``_u8_kernel``): the 4-bit values widened to one byte at load time
and one loop over each output row's whole input, which LLVM vectorizes. Same command, 2026-11-23
09:08 (docs/bench/quantized-linear.json): 0.30 / 0.37 / 0.95 / 2.20 / 9.94 ms for 1 / 2 / 8 / 16 /
64 rows against 0.52 / 0.54 / 1.02 / 1.44 / 4.47 in fp32 (a run a minute earlier: 0.24 / 0.24 /
0.83 / 2.14 / 7.79 against 0.45 / 0.55 / 0.78 / 1.27 / 4.00); every row identical alone and in a
block, within 2e-6 of fp32. It pays for plain decoding and short trees, not for long blocks.

Usage: .venv/bin/python scripts/measure-quantized-linear.py [--out docs/bench/quantized-linear.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from numba import njit, prange

from lyanna.engines.kernels import _FAST, linear

QK = 32  # weights per Q4_1 block
LAYERS = 30  # SmolLM2-135M's decoder layers


@njit(cache=True)
def _dequant_tile(d, m, qs, j, b, tile):  # pragma: no cover - compiled
    """Rows j..j+7 of block b as fp32; no fastmath here, so no fused multiply-add: d * q, then + m."""
    for r in range(8):
        dd = d[j + r, b]
        mm = m[j + r, b]
        for t in range(16):
            byte = qs[j + r, b, t]
            tile[r, t] = dd * np.float32(byte & 15) + mm
            tile[r, t + 16] = dd * np.float32(byte >> 4) + mm


@njit(parallel=True, fastmath=_FAST, cache=True)
def _q41_kernel(x, d, m, qs, out):  # pragma: no cover - compiled
    rows, _ = x.shape
    n, nb = d.shape
    for jb in prange(n // 8):
        j = jb * 8
        tile = np.empty((8, QK), np.float32)
        acc = np.zeros((rows, 8), np.float32)
        for b in range(nb):
            _dequant_tile(d, m, qs, j, b, tile)
            k0 = b * QK
            for i in range(0, rows, 2):  # the same two-row code for every row, as kernels.linear
                i1 = min(i + 1, rows - 1)
                a0, a1, a2, a3, a4, a5, a6, a7 = acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3], acc[i, 4], acc[i, 5], acc[i, 6], acc[i, 7]
                c0, c1, c2, c3, c4, c5, c6, c7 = acc[i1, 0], acc[i1, 1], acc[i1, 2], acc[i1, 3], acc[i1, 4], acc[i1, 5], acc[i1, 6], acc[i1, 7]
                for k in range(QK):
                    x0 = x[i, k0 + k]
                    x1 = x[i1, k0 + k]
                    w0, w1, w2, w3 = tile[0, k], tile[1, k], tile[2, k], tile[3, k]
                    w4, w5, w6, w7 = tile[4, k], tile[5, k], tile[6, k], tile[7, k]
                    a0 += x0 * w0
                    a1 += x0 * w1
                    a2 += x0 * w2
                    a3 += x0 * w3
                    a4 += x0 * w4
                    a5 += x0 * w5
                    a6 += x0 * w6
                    a7 += x0 * w7
                    c0 += x1 * w0
                    c1 += x1 * w1
                    c2 += x1 * w2
                    c3 += x1 * w3
                    c4 += x1 * w4
                    c5 += x1 * w5
                    c6 += x1 * w6
                    c7 += x1 * w7
                acc[i, 0], acc[i, 1], acc[i, 2], acc[i, 3], acc[i, 4], acc[i, 5], acc[i, 6], acc[i, 7] = a0, a1, a2, a3, a4, a5, a6, a7
                acc[i1, 0], acc[i1, 1], acc[i1, 2], acc[i1, 3], acc[i1, 4], acc[i1, 5], acc[i1, 6], acc[i1, 7] = c0, c1, c2, c3, c4, c5, c6, c7
        for i in range(rows):
            for r in range(8):
                out[i, j + r] = acc[i, r]


@njit(parallel=True, fastmath=_FAST, cache=True)
def _u8_kernel(x, d, m, q, out):  # pragma: no cover - compiled
    """Route 1b: the 4-bit values widened to one byte each at load time (q [n, k] uint8), each output
    row's whole input in one loop (the scale looked up per weight as ``d[j, t >> 5]``), two input
    rows at a time as in ``kernels.linear``. LLVM vectorizes this loop over t (byte -> fp32, then
    ``d * q + m`` and the two products), where the tiled kernel above runs the conversion scalar.
    ``d * q`` is exact in fp32 (an 11-bit by 4-bit product), so with or without a fused multiply-add
    each weight is today's dequantized fp32 weight; only the order of the sums differs."""
    rows, k = x.shape
    n = q.shape[0]
    for j in prange(n):
        for i in range(0, rows, 2):
            i1 = min(i + 1, rows - 1)
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for t in range(k):
                w = d[j, t >> 5] * np.float32(q[j, t]) + m[j, t >> 5]
                s0 += w * x[i, t]
                s1 += w * x[i1, t]
            out[i, j] = s0
            out[i1, j] = s1


def u8_linear(x: np.ndarray, d, m, q) -> np.ndarray:
    out = np.empty((x.shape[0], d.shape[0]), np.float32)
    _u8_kernel(np.ascontiguousarray(x, np.float32), d, m, q, out)
    return out


def widen(qs: np.ndarray) -> np.ndarray:
    """Q4_1's packed nibbles [n, blocks, 16] as one byte per weight [n, k] (weight t of a block is
    the low nibble of byte t, weight t + 16 its high nibble)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(qs.shape[0], -1).astype(np.uint8)


def quantize_q41(w: np.ndarray):
    """Q4_1 blocks of ``w`` [n, k] (per 32 weights: fp16 scale d and minimum m, 4-bit q) and
    the fp32 weights they stand for (what the engine streams today)."""
    n, k = w.shape
    blocks = w.reshape(n, k // QK, QK)
    lo, hi = blocks.min(-1), blocks.max(-1)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((blocks - m[..., None]) / np.where(d == 0, 1, d)[..., None]), 0, 15).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    deq = (d[..., None] * q.astype(np.float32) + m[..., None]).astype(np.float32).reshape(n, k)
    return d, m, qs, deq


def q41_linear(x: np.ndarray, d, m, qs) -> np.ndarray:
    out = np.empty((x.shape[0], d.shape[0]), np.float32)
    _q41_kernel(np.ascontiguousarray(x, np.float32), d, m, qs, out)
    return out


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # SmolLM2-135M's shapes: fused qkv, o, fused gate+up, down (n = output rows, k = input)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    results = []
    for name, (n, k) in shapes.items():
        # one copy per layer: the weights stream from memory as in a real forward, not from cache
        layers = [quantize_q41(rng.normal(0, 0.05, (n, k)).astype(np.float32)) for _ in range(LAYERS)]
        wide = [widen(L[2]) for L in layers]
        d, m, qs, deq = layers[0]
        for rows in (1, 2, 8, 16, 64):
            x = rng.normal(0, 1, (rows, k)).astype(np.float32)
            got, ref = q41_linear(x, d, m, qs), linear(x, deq)
            alone = np.stack([q41_linear(x[i:i + 1], d, m, qs)[0] for i in range(rows)])
            fp32 = best_ms(lambda: [linear(x, L[3]) for L in layers], args.repeat) / LAYERS
            q4 = best_ms(lambda: [q41_linear(x, *L[:3]) for L in layers], args.repeat) / LAYERS
            u8 = best_ms(lambda: [u8_linear(x, L[0], L[1], q) for L, q in zip(layers, wide)], args.repeat) / LAYERS
            got8 = u8_linear(x, d, m, wide[0])
            alone8 = np.stack([u8_linear(x[i:i + 1], d, m, wide[0])[0] for i in range(rows)])
            row = {"shape": name, "n": n, "k": k, "rows": rows, "fp32_ms": round(fp32, 4), "q4_1_ms": round(q4, 4),
                   "speedup": round(fp32 / q4, 3), "max_abs_diff_vs_fp32": float(np.abs(got - ref).max()),
                   "row_identical_alone": bool(np.array_equal(got, alone)),
                   "u8_ms": round(u8, 4), "u8_speedup": round(fp32 / u8, 3),
                   "u8_max_abs_diff_vs_fp32": float(np.abs(got8 - ref).max()),
                   "u8_row_identical_alone": bool(np.array_equal(got8, alone8))}
            results.append(row)
            print(json.dumps(row))
    summary = {}
    for rows in (1, 2, 8, 16, 64):
        sel = [r for r in results if r["rows"] == rows]
        summary[rows] = {key: round(sum(r[key] for r in sel), 4) for key in ("fp32_ms", "q4_1_ms", "u8_ms")}
        summary[rows]["speedup"] = round(summary[rows]["fp32_ms"] / summary[rows]["q4_1_ms"], 3)
        summary[rows]["u8_speedup"] = round(summary[rows]["fp32_ms"] / summary[rows]["u8_ms"], 3)
    print("one layer's four matmuls, ms (fp32 / q4_1 tiles / one byte per weight, speedups):", summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "scripts/measure-quantized-linear.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "machine": platform.processor() or platform.machine(), "results": results,
                       "layer_summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
