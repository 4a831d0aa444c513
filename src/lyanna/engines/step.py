"""A one-token pass of one sequence through every layer on threads held for the whole pass.

Why: the fused pass (``fused._layers``) starts a parallel region for each matrix and for each
layer's attention, about 150 a pass, and between them the other threads wait while one runs the
layer's small steps. At one row each matrix is a short stream of weights, so every start, and
every thread left idle at the end of a region, is paid in full: streaming the layers' matrices
one parallel call each took markedly longer than streaming the same bytes in one call
(``scripts/measure-block-parts.py``'s ``layer_stream_ms``). Here one region covers the pass: each
phase of a layer (a matrix's tiles, the attention's heads, the small steps between) is a set of
tasks that the threads claim one at a time from a shared counter, and a thread that has no task
left waits, spinning, until the phase's tasks are all done before it claims from the next.

Every task calls the code the fused pass calls for the same piece (``intdot.tile_rows``,
``attention.attention_task``, ``kernels``' norm, RoPE and SiLU, ``intdot``'s quantization), so a
row gets the same bits on either path (tested in ``test_step.py``). Claiming, not a fixed share
per thread, keeps the pass from ever waiting on a thread that never runs: a region given fewer
threads than it asked for (one, at worst) finds every task still unclaimed and does them itself.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm, ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import intdot
from .attention import attention_scratch, attention_task, attention_tasks
from .halves import write_kv
from .intdot_ir import PREFETCH_BYTES, PREFETCH_LOCALITY
from .kernels import _rms_norm_kernel, _rope_kernel, silu_mul_row


def _counter(context, builder, signature, args):
    """A pointer to ``counters[i]`` (the two arguments of ``_fetch_add`` and ``_load``)."""
    arr = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], arr, [args[1]])


def _int64s(counters) -> bool:
    return isinstance(counters, types.Array) and counters.dtype == types.int64


@intrinsic
def _fetch_add(typingctx, counters, i):
    """``counters[i] += 1`` atomically (sequentially consistent); the value before."""
    if not _int64s(counters):
        return None

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _counter(context, builder, signature, args), ir.IntType(64)(1), "seq_cst")

    return types.int64(counters, i), codegen


@intrinsic
def _load(typingctx, counters, i):
    """``counters[i]``, read atomically (acquire: what the tasks that counted wrote is seen)."""
    if not _int64s(counters):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_counter(context, builder, signature, args), "acquire", 8)

    return types.int64(counters, i), codegen


@intrinsic
def _prefetch(typingctx, a, at):
    """Ask for the cache line holding byte ``at`` of ``a``'s data, into L2 (a prefetch never faults)."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        data = builder.bitcast(context.make_array(signature.args[0])(context, builder, args[0]).data, i8p)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.gep(data, [args[1]]), i32(0), i32(PREFETCH_LOCALITY), i32(1)])
        return context.get_dummy_value()

    return types.void(a, at), codegen


@njit(nogil=True, cache=True)
def _heads_of_tiles(d, m, q):  # pragma: no cover - compiled
    """The first ``PREFETCH_BYTES`` of each tile of a matrix (and the first line of its scales)
    asked for: what the kernel's own prefetches, that run that far ahead, never ask for."""
    tiles = q.shape[0]
    per_tile = q.size // tiles
    for c in range(tiles):
        for at in range(0, min(PREFETCH_BYTES, per_tile), 64):
            _prefetch(q, c * per_tile + at)
        _prefetch(d, c * (d.size // tiles) * 2)
        if m.size:
            _prefetch(m, c * (m.size // tiles) * 2)


@njit(nogil=True, cache=True)
def _heads_of_cache(k_cache, v_cache, layer, keys):  # pragma: no cover - compiled
    """Each key/value head's first ``keys`` keys and values at ``layer`` asked for."""
    per_head = k_cache[layer, 0].size * k_cache.itemsize
    used = keys * k_cache.shape[3] * k_cache.itemsize
    for g in range(k_cache.shape[1]):
        at = (layer * k_cache.shape[1] + g) * per_head
        for line in range(0, used, 64):
            _prefetch(k_cache, at + line)
            _prefetch(v_cache, at + line)


@intrinsic
def _pause(typingctx):
    """x86's ``pause`` (a spinning thread's hint: it leaves the core's resources to a sibling
    thread, and leaves the loop without a pipeline flush); nothing on other CPUs."""
    def codegen(context, builder, signature, args):
        if "x86" in llvm.get_process_triple():
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(nogil=True, cache=True)
def _wait(sync, phase, tasks):  # pragma: no cover - compiled
    """Until the ``tasks`` tasks of ``phase`` are done."""
    while _load(sync, _LINE * phase + _DONE) < tasks:
        _pause()


# Each phase's counters (int64s of ``sync``, a cache line a phase): tasks claimed, claimed from the
# front, claimed from the back, threads arrived, tasks done.
_LINE, _FRONT, _BACK, _ARRIVED, _DONE = 8, 1, 2, 3, 4


@njit(nogil=True, cache=True)
def _claim(sync, phase, tasks, back):  # pragma: no cover - compiled
    """The next task of ``phase`` for this thread, or -1 when all are claimed: the second thread to
    arrive takes them from the last one down, the others from the first one up, so that each
    thread's tasks lie side by side (a matrix's neighbouring tiles, the heads that share keys)."""
    if _fetch_add(sync, _LINE * phase) >= tasks:
        return -1
    if back:
        return tasks - 1 - _fetch_add(sync, _LINE * phase + _BACK)
    return _fetch_add(sync, _LINE * phase + _FRONT)


@njit(nogil=True, cache=True)
def _first(sync, phase):  # pragma: no cover - compiled
    """Whether this thread claimed ``phase``'s one task (a serial step between the parallel ones)."""
    return _fetch_add(sync, _LINE * phase) == 0


@njit(nogil=True, cache=True)
def _tiles(sync, phase, quantized, d, m, q, out, path):  # pragma: no cover - compiled
    """A matrix's tiles, claimed one at a time, for the quantized row; then the phase's end."""
    xq, dx, xs, xc = quantized
    back = _fetch_add(sync, _LINE * phase + _ARRIVED) == 1
    while True:
        c = _claim(sync, phase, d.shape[0], back)
        if c < 0:
            break
        intdot.tile_rows(c, xq, dx, xs, xc, d, m, q, out, path)
        _fetch_add(sync, _LINE * phase + _DONE)
    _wait(sync, phase, d.shape[0])


@njit(nogil=True, cache=True)
def _heads(sync, phase, qh, k_cache, v_cache, layer, spans, o, scratch):  # pragma: no cover - compiled
    """The attention's tasks (a head of a run of rows, ``attention.attention_task``), claimed one at
    a time; then the phase's end."""
    span_of, lo, bias, bias_at, tasks, _, ends = spans
    back = _fetch_add(sync, _LINE * phase + _ARRIVED) == 1
    while True:
        t = _claim(sync, phase, tasks.shape[0], back)
        if t < 0:
            break
        attention_task(t, tasks, qh, (k_cache,), (v_cache,), layer, span_of, lo, ends, bias, bias_at, o, *scratch)
        _fetch_add(sync, _LINE * phase + _DONE)
    _wait(sync, phase, tasks.shape[0])


@njit(nogil=True, cache=True)
def _silu(sync, phase, gate_up, act, quantized, d, m, q):  # pragma: no cover - compiled
    """``silu(gate) * up`` and its quantization (``intdot``'s blocks), a row a task; the thread
    that arrives second then asks for the down matrix's first bytes (``_heads_of_tiles``); then
    the phase's end. A whole row a task, as the fused pass computes it: split into runs of
    columns, some of a row's values came out a last bit apart."""
    n = act.shape[0]
    back = _fetch_add(sync, _LINE * phase + _ARRIVED) == 1
    while True:
        r = _claim(sync, phase, n, back)
        if r < 0:
            break
        silu_mul_row(gate_up, act, r)
        intdot._quantize_span(act, r, r + 1, quantized)
        _fetch_add(sync, _LINE * phase + _DONE)
    if back:
        _heads_of_tiles(d, m, q)
    _wait(sync, phase, n)


@njit(nogil=True, cache=True)
def _serial(sync, phase):  # pragma: no cover - compiled
    """The end of a one-task phase: its task counted done by the thread that ran it."""
    _fetch_add(sync, _LINE * phase + _DONE)


PHASES_A_LAYER = 10


@njit(nogil=True, cache=True)
def _attention_phases(layer, x, rot, norm, d, m, q, k_cache, v_cache, taps, tap_slot, eps, kv_heads, path, sync,
                      bufs, spans):  # pragma: no cover - compiled
    """Phases 0-3 of a layer (see ``step_layers``): the last layer's residual and this one's
    input norm, qkv, RoPE and the cache write, attention."""
    h, qkv, qh, kh, o, a = bufs[:6]
    hq, scratch = bufs[8:12], bufs[20:24]
    n, heads, head_dim = qh.shape
    ph = PHASES_A_LAYER * layer
    if _first(sync, ph):
        if layer:
            _add(x, a)
        if tap_slot[layer] >= 0:
            taps[tap_slot[layer]] = x
        _rms_norm_kernel(x, norm, eps, h)
        intdot._quantize_span(h, 0, n, hq)
        _serial(sync, ph)
    else:  # while the other thread works alone, the next matrix's first bytes on their way
        _heads_of_tiles(d, m, q)
    _wait(sync, ph, 1)
    _tiles(sync, ph + 1, hq, d, m, q, qkv, path)
    if _first(sync, ph + 2):
        _rope_kernel(qkv, rot, heads, kv_heads, head_dim, np.float32(1.0 / np.sqrt(head_dim)), qh, kh)
        write_kv(qkv, kh, (k_cache,), (v_cache,), layer, spans[0], spans[1], spans[5], (heads + kv_heads) * head_dim)
        _serial(sync, ph + 2)
    else:
        _heads_of_cache(k_cache, v_cache, layer, spans[6][0])
    _wait(sync, ph + 2, 1)
    _heads(sync, ph + 3, qh, k_cache, v_cache, layer, spans, o, scratch)


@njit(nogil=True, cache=True)
def _mlp_phases(layer, x, norm, d, m, q, eps, path, sync, bufs):  # pragma: no cover - compiled
    """Phases 4-9 of a layer: its attention's output quantized and through its matrix, the
    residual, the MLP's norm, gate and up, SiLU, down (whose residual the next layer's phase 0 adds)."""
    h, o, a, gate_up, act = bufs[0], bufs[4], bufs[5], bufs[6], bufs[7]
    hq, oq, actq = bufs[8:12], bufs[12:16], bufs[16:20]
    n, ph = x.shape[0], PHASES_A_LAYER * layer
    if _first(sync, ph + 4):
        intdot._quantize_span(o, 0, n, oq)
        _serial(sync, ph + 4)
    else:
        _heads_of_tiles(d[0], m[0], q[0])
    _wait(sync, ph + 4, 1)
    _tiles(sync, ph + 5, oq, d[0], m[0], q[0], a, path)
    if _first(sync, ph + 6):
        _add(x, a)
        _rms_norm_kernel(x, norm, eps, h)
        intdot._quantize_span(h, 0, n, hq)
        _serial(sync, ph + 6)
    else:
        _heads_of_tiles(d[1], m[1], q[1])
    _wait(sync, ph + 6, 1)
    _tiles(sync, ph + 7, hq, d[1], m[1], q[1], gate_up, path)
    _silu(sync, ph + 8, gate_up, act, actq, d[2], m[2], q[2])
    _tiles(sync, ph + 9, actq, d[2], m[2], q[2], a, path)


@njit(nogil=True, cache=True)
def _thread(x, rot, attn_norms, mlp_norms, d, m, q, k_cache, v_cache, taps, tap_slot, eps, kv_heads, path, sync,
            bufs, spans):  # pragma: no cover - compiled
    """One thread's part of the pass (see ``step_layers``): every phase in order."""
    for layer in range(len(attn_norms)):
        w = 4 * layer
        _attention_phases(layer, x, rot, attn_norms[layer], d[w], m[w], q[w], k_cache, v_cache, taps, tap_slot, eps,
                          kv_heads, path, sync, bufs, spans)
        _mlp_phases(layer, x, mlp_norms[layer], (d[w + 1], d[w + 2], d[w + 3]), (m[w + 1], m[w + 2], m[w + 3]),
                    (q[w + 1], q[w + 2], q[w + 3]), eps, path, sync, bufs)
    last = PHASES_A_LAYER * len(attn_norms)
    if _first(sync, last):
        _add(x, bufs[5])
        _serial(sync, last)
    _wait(sync, last, 1)


@njit(nogil=True, cache=True)
def _add(x, a):  # pragma: no cover - compiled
    """``x += a`` (a residual), in a call: written in a parallel loop's body, numba would take it
    for a reduction over the loop."""
    x += a


# The most rows a block may have to take the held threads: one (every plain decoding step and a
# draft head's chain steps). The pass is written for any block whose matrices ``int_linear_kernel``
# shares by tiles (fewer than ``intdot.ROW_SHARES_MIN`` rows), but blocks of 2 to 5 rows ran no
# faster on held threads than in the fused pass.
MOST_ROWS = 1


@njit(parallel=True, nogil=True, cache=True)
def step_layers(x, rot, attn_norms, mlp_norms, d, m, q, k_cache, v_cache, start, span_of, lo, bias, bias_at, taps,
                tap_slot, eps, heads, kv_heads, head_dim, path, threads):  # pragma: no cover - compiled
    """``fused._layers`` for a block of at most ``MOST_ROWS`` rows of one sequence (its keys and
    values go to slots ``start`` on; ``span_of``... as ``attention.span_layout`` gives them for
    it), on ``threads`` threads held for the whole pass. ``path``: intdot's path index, not
    ``amx`` for more than one row (``amx`` takes the first path of ``PATHS`` for one row, as
    ``int_linear_kernel`` does)."""
    x = x.copy()
    if path == len(intdot._IR_PATHS):
        path = intdot._FIRST
    n, hidden = x.shape
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    h, o, a = np.empty((n, hidden), np.float32), np.empty((n, q_dim), np.float32), np.empty((n, hidden), np.float32)
    gate_up = np.empty((n, d[2].size // (hidden // 32)), np.float32)
    act = np.empty((n, gate_up.shape[1] // 2), np.float32)
    tasks = attention_tasks(span_of, heads, heads // kv_heads)
    # flat tuples: numba's parallel loop takes no tuple of arrays inside another
    bufs = (h, np.empty((n, q_dim + 2 * kv_dim), np.float32), np.empty((n, heads, head_dim), np.float32),
            np.empty((n, kv_heads, head_dim), np.float32), o, a, gate_up, act,
            *intdot._quantized(h), *intdot._quantized(o), *intdot._quantized(act),
            *attention_scratch(tasks, start + n, head_dim))
    spans = (span_of, lo, bias, bias_at, tasks, np.full(1, start, np.int64), np.full(1, start + n, np.int64))
    sync = np.zeros(_LINE * (PHASES_A_LAYER * len(attn_norms) + 1), np.int64)
    for _ in prange(threads):
        _thread(x, rot, attn_norms, mlp_norms, d, m, q, k_cache, v_cache, taps, tap_slot, eps, kv_heads, path, sync,
                bufs, spans)
    return x
