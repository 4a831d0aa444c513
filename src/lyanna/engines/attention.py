"""Attention over a KV cache for blocks of tree rows (compiled), and a prompt's prefill attention."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from numba import njit, prange

from .attention_ir import QUERIES, _dot_keys, _softmax_weights, _weighted_rows
from .halves import as_floats
from .kernels import _FAST, _aligned, _launch, even_group


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``attention`` for a prompt's prefill (``n`` rows from an empty cache, additive mask
    [n, n]) by PyTorch's batched GEMMs, one per key/value head with its query heads stacked, where
    our kernel takes one query at a time. It computes what PyTorch's
    ``scaled_dot_product_attention`` computes with that mask (its CPU path for a float mask is
    these products and a softmax: identical bits with torch 2.13 here, tested to 1e-6) without
    repeating each key/value head per query head, and was the faster of the two at every prompt
    length tried on the 2-core Xeon (2026-11-23). Like ``linear_rows``, only prefill goes this
    way, so a prompt's numbers are the same for every method and in a batch."""
    import torch


    n, heads, hd = q.shape
    kv = k_cache.shape[0]
    groups = heads // kv
    # [kv, groups * n, hd]: the query heads that share key/value head g, one after the other
    qt = torch.from_numpy(_aligned(q)).view(n, kv, groups, hd).permute(1, 2, 0, 3).reshape(kv, groups * n, hd)
    kt = torch.from_numpy(_aligned(as_floats(k_cache[:, :n])))
    vt = torch.from_numpy(_aligned(as_floats(v_cache[:, :n])))
    mask = torch.from_numpy(bias).repeat(groups, 1).expand(kv, groups * n, n)
    with _launch:
        probs = torch.softmax(torch.baddbmm(mask, qt, kt.transpose(1, 2)), dim=-1)
        out = torch.bmm(probs, vt)
    return out.view(kv, groups, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd).numpy()


@njit(cache=True, nogil=True)
def _row_chunks(span_of: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """[first, end) of each run of up to ``QUERIES`` consecutive rows of one span (rows of span -1
    skipped), a span's runs as even as they can be (7 rows as 4 + 3, not 6 + 1: a run's time is
    mostly its reads of the keys and values, whatever its rows)."""
    n = span_of.shape[0]
    bounds = np.empty((n, 2), np.int64)
    count, i = 0, 0
    while i < n:
        if span_of[i] < 0:
            i += 1
            continue
        end = i + 1
        while end < n and span_of[end] == span_of[i]:
            end += 1
        size = even_group(end - i, QUERIES)
        while i < end:
            j = min(i + size, end)
            bounds[count, 0], bounds[count, 1] = i, j
            count += 1
            i = j
    return bounds[:count]


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _attention_kernel(q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray, ends: np.ndarray,
                      bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row ``i`` of ``q`` belongs to span ``span_of[i]`` (-1: skipped) and attends to keys
    [0, ends[s]) of layer ``layer`` of that span's caches ``ks[s]``/``vs[s]`` ([layers, kv_heads,
    capacity, head_dim]; tuples or typed lists: one launch for every sequence of a batch), plus its
    row of the span's additive mask when ``bias_at[s] >= 0``. One task per head and run of up to
    ``QUERIES`` rows of a span: the run's rows share each key's and value's loads."""
    heads = q.shape[1]
    chunks = _row_chunks(span_of)
    last_all, inv_all, p_all = attention_scratch(chunks.shape[0] * heads, ends.max())
    for t in prange(chunks.shape[0] * heads):
        attention_task(t, chunks, q, ks, vs, layer, span_of, lo, ends, bias, bias_at, out, last_all, inv_all, p_all)


# Softmax weights (at most 1) as integers in units of 2**-50, for ``_scales``' exact sums: a sum of
# up to 8192 such weights stays below 2**63.
_FIXED = np.float32(2.0 ** 50)


@njit(cache=True, nogil=True)
def _scales(p: np.ndarray, inv: np.ndarray) -> None:  # pragma: no cover - compiled
    """``inv[r] = 1 / sum(p[r])`` for each row of softmax weights ``p`` [rows, width] (each in
    [0, 1], the row's largest exactly 1), the sum taken exactly in integers: each weight in
    units of 2**-50, truncated (the same for a weight wherever it is), added in int64, then
    rounded once to float32. An integer sum has no order, so a row's denominator is the same bits
    whatever the block, the key count, the vector width or the code around the loop, and a weight
    of 0 (a key the row cannot see) changes nothing: alone, in a tree block or in a batch, a row
    gets the same (a float64 sum left to the vectorizer now and then came out a last bit apart
    between two callers). The dropped bits move the sum (at least 1) by under ``width * 2**-50``."""
    rows, width = p.shape
    for r in range(rows):
        total = np.int64(0)
        for j in range(width):
            total += np.int64(p[r, j] * _FIXED)
        inv[r] = np.float32(1.0) / np.float32(np.float64(total) / np.float64(_FIXED))


@njit(cache=True, nogil=True)
def attention_scratch(tasks: int, most_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Every task's scratch in one allocation each: its rows' last visible key, weights and scales."""
    return (np.empty((tasks, QUERIES), np.int64), np.empty((tasks, QUERIES), np.float32),
            np.empty((tasks, QUERIES * most_keys), np.float32))


@njit(fastmath=_FAST, cache=True, nogil=True)
def attention_task(t: int, chunks: np.ndarray, q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray,
                   ends: np.ndarray, bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray, last_all: np.ndarray,
                   inv_all: np.ndarray, p_all: np.ndarray) -> None:  # pragma: no cover - compiled
    """Task ``t`` of ``_attention_kernel`` (head ``t % heads`` of run ``t // heads`` of ``chunks``),
    also one task of the one-row pass on held threads (``step``)."""
    n, heads, hd = q.shape
    groups = heads // ks[0].shape[1]
    r0, r1 = chunks[t // heads, 0], chunks[t // heads, 1]
    h = t % heads
    s = span_of[r0]
    k = ks[s][layer]
    v = vs[s][layer]
    g = h // groups
    masked = bias_at[s] >= 0
    last, inv = last_all[t], inv_all[t]
    for r in range(r1 - r0):
        end = ends[s]
        if masked:  # keys after the row's last visible one weigh exactly 0: skip them (half of a causal block)
            row_bias = bias_at[s] + (r0 + r - lo[s]) * ends[s]
            while end > 1 and bias[row_bias + end - 1] == -np.inf:
                end -= 1
        last[r] = end
    width = last[: r1 - r0].max()
    p = p_all[t, : (r1 - r0) * width].reshape(r1 - r0, width)
    _dot_keys(q, (r0 * heads + h) * hd, heads * hd, r1 - r0, k, g * k.shape[1] * hd, hd, width, p, width)
    for r in range(r1 - r0):
        i, end = r0 + r, last[r]
        prow = p[r, :end]
        p[r, end:] = 0.0
        if masked:
            row_bias = bias_at[s] + (i - lo[s]) * ends[s]
            brow = bias[row_bias : row_bias + end]  # from 0: indexed as bias[row_bias + j], the loop ran scalar
            for j in range(end):
                prow[j] += brow[j]
        _softmax_weights(p, r * width, end)  # masked keys (-inf) get exactly 0
    _scales(p, inv)
    _weighted_rows(p, width, r1 - r0, v, g * v.shape[1] * hd, width, hd, out, r0 * out.shape[1] + h * hd,
                   out.shape[1], inv)


class AttentionSpan(NamedTuple):
    """Rows [lo, hi) of a block's queries, attending to keys [0, end) of these caches (one
    layer's [kv_heads, capacity, head_dim]) with an additive [hi - lo, end] mask or none."""


    lo: int
    hi: int
    k_cache: np.ndarray
    v_cache: np.ndarray
    end: int
    bias: np.ndarray | None


def ragged_attention(q: np.ndarray, spans: Sequence[AttentionSpan], out: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query softmax attention of several sequences' query rows, each over its own cache,
    in one kernel launch (a batch of 8 decoding sequences: 30 launches per pass instead of 240;
    measured in-process on the 2-core CPU, 2026-11-23: such a pass 61-64 -> 56-58 ms). ``q`` is
    [n, heads, head_dim], already scaled; returns [n, heads * head_dim]
    (rows outside every span are left as they are in ``out``). A row's numbers do not depend on
    the other spans: the same kernel serves a sequence alone (``attention``) and in a batch.


    One compiled kernel instead of BLAS batched matmuls: those start OpenBLAS's thread pool
    beside numba's, and on two cores the pools fight (blocks of 12 tokens and more took 0.4 to
    0.6 s instead of 0.03)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n, heads, hd = q.shape
    for sp in spans:
        kv = sp.k_cache.shape
        if kv[0] == 0 or heads % kv[0] or kv[2] != hd or sp.end > kv[1] or sp.end < 1 or not 0 <= sp.lo <= sp.hi <= n:
            raise ValueError(f"attention shapes do not fit: q {q.shape}, rows [{sp.lo}, {sp.hi}), cache {kv}, end {sp.end}")
        if kv[0] != spans[0].k_cache.shape[0] or sp.v_cache.shape != kv:
            raise ValueError("every span's caches must have the same shape per slot")
        if sp.bias is not None and np.shape(sp.bias) != (sp.hi - sp.lo, sp.end):
            raise ValueError(f"attention bias must be [{sp.hi - sp.lo}, {sp.end}], got {np.shape(sp.bias)}")
    span_of, lo, bias, bias_at = span_layout(n, [(sp.lo, sp.hi, sp.bias) for sp in spans])
    # tuples are compiled per length: pad to a power of two (the last cache again, never read)
    # so that batch sizes 1..N cost log2(N) compilations, not N
    # (and one array type: a non-contiguous cache view is read through a contiguous copy)
    width = 1 << max(len(spans) - 1, 0).bit_length()
    ks = tuple(np.ascontiguousarray(sp.k_cache)[None] for sp in spans)  # one layer's caches as layer 0
    vs = tuple(np.ascontiguousarray(sp.v_cache)[None] for sp in spans)
    ks, vs = ks + ks[-1:] * (width - len(spans)), vs + vs[-1:] * (width - len(spans))
    if out is None:
        out = np.empty((n, heads * hd), np.float32)
    with _launch:
        _attention_kernel(q, ks, vs, 0, span_of, lo, np.array([sp.end for sp in spans], np.int64), bias, bias_at, out)
    return out


def span_layout(n: int, spans: Sequence[tuple[int, int, np.ndarray | None]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What ``_attention_kernel`` reads of spans given as (lo, hi, additive mask or None): each of
    the ``n`` rows' span (-1: none), each span's first row, the masks flattened into one array,
    and where each span's mask starts in it (-1: no mask)."""
    span_of = np.full(n, -1, np.int64)
    bias_at, biases, at = [], [], 0
    for s, (lo, hi, bias) in enumerate(spans):
        span_of[lo:hi] = s
        bias_at.append(-1 if bias is None else at)
        if bias is not None:
            biases.append(np.ascontiguousarray(bias, np.float32).reshape(-1))
            at += biases[-1].size
    flat = np.concatenate(biases) if biases else np.zeros(0, np.float32)
    return span_of, np.array([lo for lo, _, _ in spans], np.int64), flat, np.array(bias_at, np.int64)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, end: int,
              bias: np.ndarray | None) -> np.ndarray:
    """Grouped-query softmax attention of n query rows over cache slots [0, end): ``q`` is
    [n, heads, head_dim], already scaled; ``k_cache``/``v_cache`` are one layer's
    [kv_heads, capacity, head_dim]; ``bias`` is an additive [n, end] mask or None (no mask).
    Returns [n, heads * head_dim]: ``ragged_attention`` of one span."""
    return ragged_attention(q, [AttentionSpan(0, len(q), k_cache, v_cache, end, bias)])
