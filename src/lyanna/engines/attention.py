"""Attention over a KV cache for blocks of tree rows (compiled), and a prompt's prefill attention."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from numba import njit, prange

from .attention_ir import QUERIES, _dot_keys, _softmax_weights, _weighted_rows
from .attention_lanes import _dot_keys_lanes
from .halves import as_floats
from .kernels import _FAST, LANES, _aligned, _launch, even_group


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


# Queries a task scores with the queries in a vector's lanes (``_dot_keys_lanes``), at least: a
# kv head's query heads over a run of rows. Fewer go a head at a time with the keys in the lanes
# (``_dot_keys``), which costs less when most lanes would be empty. The bits are the same.
LANES_FROM = 8


@njit(cache=True, nogil=True)
def attention_tasks(span_of: np.ndarray, heads: int, groups: int) -> np.ndarray:  # pragma: no cover - compiled
    """The tasks of a block's attention as rows (first row, end row, first head, heads): a run of
    consecutive rows of one span (rows of span -1 skipped) and the query heads of one kv head
    (``groups`` of them) when they fill ``LANES_FROM`` lanes or more (on AVX2's 8 lanes, never for
    3 query heads a kv head: 2 rows would fill 6), else one head. A span's runs
    are as even as they can be (7 rows as 4 + 3, not 6 + 1: a run's time is mostly its reads of
    the keys and values, whatever its rows): up to ``QUERIES`` rows a head, or as many as fill a
    vector's lanes with their heads' queries."""
    n = span_of.shape[0]
    tasks = np.empty((n * heads, 4), np.int64)
    count, i = 0, 0
    per_group = LANES // groups
    while i < n:
        if span_of[i] < 0:
            i += 1
            continue
        end = i + 1
        while end < n and span_of[end] == span_of[i]:
            end += 1
        grouped = per_group * groups >= LANES_FROM and (end - i) * groups >= LANES_FROM
        size = even_group(end - i, per_group if grouped else QUERIES)
        while i < end:
            j = min(i + size, end)
            for h in range(0, heads, groups if grouped else 1):
                tasks[count, 0], tasks[count, 1], tasks[count, 2] = i, j, h
                tasks[count, 3] = groups if grouped else 1
                count += 1
            i = j
    return tasks[:count]


@njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _attention_kernel(q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray, ends: np.ndarray,
                      bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Row ``i`` of ``q`` belongs to span ``span_of[i]`` (-1: skipped) and attends to keys
    [0, ends[s]) of layer ``layer`` of that span's caches ``ks[s]``/``vs[s]`` ([layers, kv_heads,
    capacity, head_dim]; tuples or typed lists: one launch for every sequence of a batch), plus its
    row of the span's additive mask when ``bias_at[s] >= 0``. One task per run of rows of a span
    and head, or kv head's query heads (``attention_tasks``): its queries share each key's and
    value's loads."""
    heads, hd = q.shape[1], q.shape[2]
    tasks = attention_tasks(span_of, heads, heads // ks[0].shape[1])
    scratch = attention_scratch(tasks, ends.max(), hd)
    for t in prange(tasks.shape[0]):
        attention_task(t, tasks, q, ks, vs, layer, span_of, lo, ends, bias, bias_at, out, *scratch)


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
def attention_scratch(tasks: np.ndarray, most_keys: int, hd: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Every task's scratch in one allocation each, sized for the block's largest task: its rows'
    last visible key, its queries' weights and scales, and ``_dot_keys_lanes``' (its queries a
    dimension a vector, ``LANES`` keys widened, ``LANES`` vectors of scores) where a task scores so."""
    queries = 1
    for t in range(tasks.shape[0]):
        queries = max(queries, (tasks[t, 1] - tasks[t, 0]) * tasks[t, 3])
    lanes = 2 * hd * LANES + LANES * LANES if queries >= LANES_FROM else 0
    return (np.empty((tasks.shape[0], queries), np.int64), np.empty((tasks.shape[0], queries), np.float32),
            np.empty((tasks.shape[0], queries * most_keys), np.float32), np.empty((tasks.shape[0], lanes), np.float32))


@njit(cache=True, nogil=True)
def _queries_in_lanes(q: np.ndarray, r0: int, rows: int, h0: int, first: int, count: int,
                      scratch: np.ndarray) -> None:  # pragma: no cover - compiled
    """Queries ``first`` .. ``first + count - 1`` of a task (query i: row ``r0 + i % rows`` of head
    ``h0 + i // rows``) into ``scratch`` a dimension a vector, lanes past ``count`` zero."""
    hd = q.shape[2]
    scratch[: hd * LANES] = 0.0
    for i in range(count):
        row, head = r0 + (first + i) % rows, h0 + (first + i) // rows
        for d in range(hd):
            scratch[d * LANES + i] = q[row, head, d]


@njit(cache=True, nogil=True, fastmath=False)
def _scores(q: np.ndarray, r0: int, rows: int, h0: int, nh: int, k: np.ndarray, kv_at: int, p: np.ndarray,
            lanes: np.ndarray) -> None:  # pragma: no cover - compiled
    """A task's scores ``p`` [queries, keys] (query i: row ``r0 + i % rows`` of head ``h0 + i //
    rows``): with the queries in a vector's lanes when they fill ``LANES_FROM`` or more, else a
    head at a time with the keys in the lanes; the same bits either way. ``fastmath=False`` stated:
    numba compiles a function that leaves it unset with its caller's flags (``attention_task``'s),
    the IR inside included, and under them LLVM regrouped the lanes kernel's sums (scores a last
    bit apart from ``_dot_keys``'), and on a CPU without fused multiply-adds the chains' sums too."""
    heads, hd = q.shape[1], q.shape[2]
    nq, width = p.shape
    if nq >= LANES_FROM:
        for first in range(0, nq, LANES):
            count = min(LANES, nq - first)
            _queries_in_lanes(q, r0, rows, h0, first, count, lanes)
            _dot_keys_lanes(k, count, kv_at, hd, p[first:], width, lanes, width)
    else:
        for i in range(nh):
            _dot_keys(q, (r0 * heads + h0 + i) * hd, heads * hd, rows, k, kv_at, hd, width, p[i * rows:], width)


@njit(fastmath=_FAST, cache=True, nogil=True)
def _visible(bias: np.ndarray, at: int, end: int) -> int:  # pragma: no cover - compiled
    """Keys up to a row's last visible one (the mask row at ``bias[at:]``): those after it weigh
    exactly 0, so a task skips them (half of a causal block)."""
    while end > 1 and bias[at + end - 1] == -np.inf:
        end -= 1
    return end


@njit(fastmath=_FAST, cache=True, nogil=True)
def attention_task(t: int, tasks: np.ndarray, q: np.ndarray, ks, vs, layer: int, span_of: np.ndarray, lo: np.ndarray,
                   ends: np.ndarray, bias: np.ndarray, bias_at: np.ndarray, out: np.ndarray, last_all: np.ndarray,
                   inv_all: np.ndarray, p_all: np.ndarray, lanes_all: np.ndarray) -> None:  # pragma: no cover - compiled
    """Task ``t`` of ``attention_tasks`` (rows ``r0 .. r1 - 1``, heads ``h0 .. h0 + nh - 1``; query
    i is row ``r0 + i % rows`` of head ``h0 + i // rows``) of ``_attention_kernel``, also one task of
    the one-row pass on held threads (``step``)."""
    heads, hd = q.shape[1], q.shape[2]
    r0, r1, h0, nh = tasks[t, 0], tasks[t, 1], tasks[t, 2], tasks[t, 3]
    rows, s = r1 - r0, span_of[tasks[t, 0]]
    k, v = ks[s][layer], vs[s][layer]
    kv_at = (h0 // (heads // ks[0].shape[1])) * k.shape[1] * hd
    masked = bias_at[s] >= 0
    last, inv = last_all[t], inv_all[t]
    for r in range(rows):
        last[r] = _visible(bias, bias_at[s] + (r0 + r - lo[s]) * ends[s], ends[s]) if masked else ends[s]
    width, nq = last[:rows].max(), rows * nh
    p = p_all[t, : nq * width].reshape(nq, width)
    _scores(q, r0, rows, h0, nh, k, kv_at, p, lanes_all[t])
    for i in range(nq):
        r = i % rows
        end = last[r]
        prow = p[i, :end]
        p[i, end:] = 0.0
        if masked:
            row_bias = bias_at[s] + (r0 + r - lo[s]) * ends[s]
            brow = bias[row_bias : row_bias + end]  # from 0: indexed as bias[row_bias + j], the loop ran scalar
            for j in range(end):
                prow[j] += brow[j]
        _softmax_weights(p, i * width, end)  # masked keys (-inf) get exactly 0
    _scales(p, inv[:nq])
    for i in range(nh):
        for first in range(0, rows, QUERIES):
            count = min(QUERIES, rows - first)
            _weighted_rows(p[i * rows + first:], width, count, v, kv_at, width, hd, out,
                           (r0 + first) * out.shape[1] + (h0 + i) * hd, out.shape[1], inv[i * rows + first:])


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
