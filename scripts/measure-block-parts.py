"""Where a verify block's time goes on the default engine: ms per block of 1 / 2 / 8 / 16 / 64
tokens after 256 cached tokens for the whole pass, and for its parts measured alone on the same
weights and cache (the layers' 120 matrix products in layer order, the LM head, the 30 layers'
attention over the cache with the block's causal mask). What the pass does besides (norms, RoPE,
SiLU, the calls between) is about the pass less the parts, within this host's noise (the parts,
measured apart, need not add up to the pass). And the same passes timed inside, phase by phase
(``ms_inside_pass``: the layers' phases by the CPU's cycle counter, ``fused.PHASES``, and what the
pass spends outside the layers, the LM head mostly; a clocked pass takes ``fused._layers`` even
where one sequence's small blocks otherwise take the held threads of ``step.py``): there each part meets the caches as the pass
leaves them, where a part timed alone, over and over, finds much of its weights in cache (the LM
head's 30 MB of blocks nearly fit a 32 MB L3). Also the integer kernel's multiply-adds per
second on one matrix that stays in cache at 8 / 16 / 64 rows (its arithmetic bound, no memory
stream; each also as a share of the CPU's 8-bit peak below): what each extra row of a block costs
at the least; and this CPU's own peaks, both cores busy with independent operations on
registers: 8-bit multiply-adds (``vpdpbusd`` on the ``vnni`` path, ``vpmaddubsw`` + ``vpmaddwd`` on ``avx2``) and fp32 fused
multiply-adds, on 512-bit registers too where the CPU has them (the faster width counts), from
which the fastest a block could be on this machine follows (each extra row's matrix products at
the integer peak and its attention at the fp32 peak, next to the measured one-token pass). And
the layers' bytes streamed with no arithmetic, one parallel call per matrix as a one-row pass
makes them and all in one call, and the LM head's in one (``layer_stream_ms``): the one-token
products' memory floor. And the attention inside one-token passes after 16, 256 and 1024 cached
tokens (``attention_by_context``): its cost before any key is read and its rate over the keys.

Why: a draft tree pays only if verifying it costs little more than one token, and the block's
cost in one-token steps (``scripts/measure-blocks.py``) says how far it is from that, not why.
Each part is the fastest of ``ROUNDS`` interleaved medians.

``--against DIR``: the parts of another checkout of this repository (``git worktree add /tmp/before
<commit>``) beside ours, each measured in child processes that take turns, each child one round
(``ms_beside``, keyed ``ours@<commit>`` and the checkout's commit; ``ms`` is then ours from the
children): what a change did to each part, on the same host at the same time.
Writes docs/bench/block-parts.json (``--out`` elsewhere).
Usage: .venv/bin/python scripts/measure-block-parts.py [--against DIR] [--rounds N] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.typed import List

from lyanna.engines import intdot
from lyanna.engines.attention import _attention_kernel, span_layout
from lyanna.engines.kernels import linear
from lyanna.engines.loading import DEFAULT_MODEL, load_target
from lyanna.engines.transformer import KVCache, Transformer, attention_bias
from lyanna.measure.bench import machine_info

SIZES = (1, 2, 8, 16, 64)
CONTEXT = 256
REPEATS = 7
ROUNDS = 3
CHAINS = 12  # independent accumulators in the peak loops: more than latency x issue rate on any x86 core
PEAK_ITERATIONS = 20_000_000


def _peak_loop(kind: str, lanes: int = 8):
    """A compiled loop of ``CHAINS`` independent operations per iteration on registers of ``lanes``
    32-bit lanes (8: 256 bits, 16: 512): ``vnni`` one ``vpdpbusd`` (4 8-bit multiply-adds a lane),
    ``avx2`` one ``vpmaddubsw`` added in 16 bits (32 8-bit products; 256 bits only), ``fma`` one fp32 fused
    multiply-add (1 a lane); returns a value that depends on every chain, so that nothing is
    optimized away."""
    @intrinsic
    def loop(typingctx, n, seed):
        def codegen(context, b, signature, args):
            n, seed = args
            i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
            v32i8, v16i16, v8i32, v8f = (ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, lanes),
                                         ir.VectorType(f32, lanes))
            fn = lambda name, ret, *a: cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, list(a)), name)  # noqa: E731
            s = b.trunc(seed, i32)
            if kind == "fma":
                kind_t, op = v8f, fn(f"llvm.fma.v{lanes}f32", v8f, v8f, v8f, v8f)
                x = b.insert_element(ir.Constant(v8f, [0.999] * lanes), b.sitofp(s, f32), i32(0))
                inits = [ir.Constant(v8f, [float(k)] * lanes) for k in range(CHAINS)]
                step = lambda acc: b.call(op, [acc, x, x])  # noqa: E731
            else:
                kind_t = v8i32
                x = b.insert_element(ir.Constant(v8i32, [0x01020304] * lanes), s, i32(0))
                inits = [ir.Constant(v8i32, [k] * lanes) for k in range(CHAINS)]
                if kind == "vnni":
                    op = fn(f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", v8i32, v8i32, v8i32, v8i32)
                    step = lambda acc: b.call(op, [acc, x, x])  # noqa: E731
                else:
                    maddubs = fn("llvm.x86.avx2.pmadd.ub.sw", v16i16, v32i8, v32i8)

                    def step(acc, k, varied):
                        # The nibble kernel's inner step: a vpmaddubsw added in 16 bits (its vpmaddwd
                        # widening comes once for eight of them). One input varies with the iteration
                        # (``varied``, shared by the chains), the other with the chain: every product
                        # is new (nothing to hoist or share) and none waits on a chain's last sum.
                        # Inputs taken from the accumulator (an xor) put each product behind the last
                        # one's latency: that loop ran slower than the kernel itself on an AVX2-only Zen.
                        other = ir.Constant(v32i8, [(7 * k + j) % 61 + 1 for j in range(32)])
                        pairs = b.call(maddubs, [b.bitcast(varied, v32i8), other])
                        return b.bitcast(b.add(b.bitcast(acc, v16i16), pairs), v8i32)
            entry = b.block
            body, done = b.append_basic_block("body"), b.append_basic_block("done")
            b.branch(body)
            b.position_at_end(body)
            i = b.phi(n.type)
            i.add_incoming(n.type(0), entry)
            accs = []
            for init in inits:
                acc = b.phi(kind_t)
                acc.add_incoming(init, entry)
                accs.append(acc)
            if kind == "avx2":
                varied = b.add(x, b.insert_element(ir.Constant(v8i32, [0] * lanes), b.trunc(i, i32), i32(0)))
                new = [step(acc, k, varied) for k, acc in enumerate(accs)]
            else:
                new = [step(acc) for acc in accs]
            nxt = b.add(i, n.type(1))
            i.add_incoming(nxt, body)
            for acc, value in zip(accs, new):
                acc.add_incoming(value, body)
            b.cbranch(b.icmp_signed("<", nxt, n), body, done)
            b.position_at_end(done)
            total = new[0]
            for value in new[1:]:
                total = b.fadd(total, value) if kind == "fma" else b.add(total, value)
            first = b.extract_element(total, i32(0))
            return b.fptosi(first, ir.IntType(64)) if kind == "fma" else b.sext(first, ir.IntType(64))

        return types.int64(n, seed), codegen

    @njit(parallel=True)
    def on_every_core(n, cores):  # pragma: no cover - compiled
        out = np.zeros(cores, np.int64)
        for c in prange(cores):
            out[c] = loop(n, c + 1)
        return out

    return on_every_core


def peak_per_s(kind: str, widths: tuple[int, ...] = (8,)) -> float:
    """Multiply-adds a second of ``_peak_loop(kind, lanes)`` with every core busy (the best of
    ROUNDS), at the fastest of ``widths`` (lanes). Why both widths: on Intel's AVX-512 cores a
    512-bit ``vpdpbusd`` or ``vfmadd`` does nearly twice a 256-bit one's work in the same time,
    where Zen 4 splits it in two, so a 256-bit peak nearly doubled every share of Intel's peak."""
    best_rate = 0.0
    for lanes in widths:
        run, cores = _peak_loop(kind, lanes), os.cpu_count() or 1
        run(10, cores)  # compile
        best = float("inf")
        for _ in range(ROUNDS):
            start = time.perf_counter()
            run(PEAK_ITERATIONS, cores)
            best = min(best, time.perf_counter() - start)
        per_op = lanes if kind == "fma" else 4 * lanes
        best_rate = max(best_rate, PEAK_ITERATIONS * CHAINS * per_op * cores / best)
    return best_rate


def median_ms(run, repeats: int = REPEATS) -> float:
    run()  # warm-up (first-call compiles, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "bench" / "block-parts.json"


HOT_ROWS = (8, 16, 64)
HOT_WARM_S = 1.0


@njit(nogil=True)
def _calls(x, d, m, q, out, path, n):  # pragma: no cover - compiled
    for _ in range(n):
        intdot.int_linear_kernel(x, d, m, q, out, path)


def hot_kernel_per_s(w, rng: np.random.Generator, rows: int, calls: int = 20) -> float:
    """Multiply-adds a second of the kernel on one matrix (layer 0's gate and up projections, 1.1
    MB of blocks) over and over at ``rows`` rows, so its weights come from cache, not memory: its
    arithmetic bound. The integer kernel is called from compiled code, as a pass calls it
    (``fused``), so the interpreter's call is not counted; other weights go through ``linear``."""
    x = rng.standard_normal((rows, w.shape[1])).astype(np.float32)
    if getattr(w, "kernel", None) == "int8":
        out = np.empty((rows, w.padded_rows), np.float32)
        run = lambda: _calls(x, w.d, w.m, w.q, out, intdot.path_index(), calls)  # noqa: E731
    else:
        run = lambda: [linear(x, w) for _ in range(calls)]  # noqa: E731
    until = time.perf_counter() + HOT_WARM_S  # the threads and caches up to speed: a process's first
    while time.perf_counter() < until:        # parallel calls ran at half speed for a while
        run()
    seconds = min(median_ms(run) for _ in range(ROUNDS)) / 1e3 / calls
    return rows * w.shape[0] * w.shape[1] / seconds


LANES = 64  # floats a row of the stream floor's arrays: whole cache lines, vectorized sums


@njit(nogil=True, fastmath=True)
def _add_share(a, share, shares, acc):  # pragma: no cover - compiled
    """Every float of run ``share`` of ``shares`` of ``a``'s rows [rows, LANES] added into ``acc``."""
    n = a.shape[0] // shares
    for i in range(share * n, (share + 1) * n):
        for j in range(LANES):
            acc[j] += a[i, j]


@njit(parallel=True, nogil=True, fastmath=True)
def _read(a, shares):  # pragma: no cover - compiled
    """Every float of ``a`` added up, its rows in ``shares`` runs taken in parallel."""
    sums = np.zeros(shares, np.float32)
    for share in prange(shares):
        acc = np.zeros(LANES, np.float32)
        _add_share(a, share, shares, acc)
        sums[share] = acc.sum()
    return sums.sum()


@njit(nogil=True)
def _read_each(arrays, shares):  # pragma: no cover - compiled
    """``_read`` of each array in turn: one parallel call each, as a one-row pass calls its matrices."""
    total = np.float32(0.0)
    for a in arrays:
        total += _read(a, shares)
    return total


@njit(parallel=True, nogil=True, fastmath=True)
def _read_once(arrays, shares):  # pragma: no cover - compiled
    """The same floats in one parallel call: each thread reads its run of every array in turn."""
    sums = np.zeros(shares, np.float32)
    for share in prange(shares):
        acc = np.zeros(LANES, np.float32)
        for a in arrays:
            _add_share(a, share, shares, acc)
        sums[share] = acc.sum()
    return sums.sum()


def stream_floor_ms(engine: Transformer, rounds: int) -> dict[str, float]:
    """How fast the layers' weights can stream from memory here, without arithmetic: as many bytes
    as each layer matrix's blocks (an array of ones of that size each, so that no bit pattern
    slows the sums), read in layer order, one parallel call per matrix (``per_matrix``: a one-row
    pass's call structure, each call starting its streams afresh) and all in one call
    (``one_call``: what a pass that kept its threads across matrices could reach); and as many as
    the LM head's in one call after the layers' (``lm_head``: one call in a pass too). The layers' bytes
    (66 MB for the default model) exceed the L3, so back-to-back reads come from memory: set
    against the one-token pass's layer products (``ms``) they say how far those are from their
    memory floor, and how much of the gap is the call structure rather than the kernel."""
    def ones(w) -> np.ndarray:  # as many bytes as ``w``'s blocks (or floats)
        size = sum(getattr(w, f).nbytes for f in ("q", "d", "m")) if hasattr(w, "q") else w.nbytes
        return np.ones((max(1, size // (4 * LANES)), LANES), np.float32)

    arrays = List([ones(getattr(layer, name)) for layer in engine.layers for name in _widths(engine)])
    head = ones(engine.lm_head)
    shares = get_num_threads()
    def head_after_layers() -> float:  # ms of the LM head's read with the layers' read before it, as in a pass
        _read_once(arrays, shares)
        start = time.perf_counter()
        _read(head, shares)
        return (time.perf_counter() - start) * 1e3

    best = {"per_matrix": float("inf"), "one_call": float("inf"), "lm_head": float("inf")}
    for _ in range(rounds):
        best["per_matrix"] = min(best["per_matrix"], median_ms(lambda: _read_each(arrays, shares)))
        best["one_call"] = min(best["one_call"], median_ms(lambda: _read_once(arrays, shares)))
        head_after_layers()  # warm-up (first-call compiles)
        best["lm_head"] = min(best["lm_head"], float(np.median([head_after_layers() for _ in range(REPEATS)])))
    return {"weights_mb": round(sum(a.nbytes for a in arrays) / 1e6, 1), "lm_head_mb": round(head.nbytes / 1e6, 1),
            **{k: round(v, 3) for k, v in best.items()}}


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _engine() -> tuple[Transformer, np.random.Generator, KVCache]:
    """The default engine, a random generator and a cache holding ``CONTEXT`` tokens."""
    target = load_target(DEFAULT_MODEL)
    engine = Transformer(target.config, target.weights)
    c = engine.config
    rng = np.random.default_rng(0)
    cache = engine.new_cache(CONTEXT + max(SIZES))
    engine.forward(rng.integers(c.vocab_size, size=CONTEXT), np.arange(CONTEXT), cache, logit_rows=[-1])
    return engine, rng, cache


def _widths(engine: Transformer) -> dict[str, int]:
    """Each layer matrix's input width."""
    c = engine.config
    return {"wqkv": c.hidden_size, "wo": c.num_heads * c.head_dim, "w_gate_up": c.hidden_size,
            "w_down": c.intermediate_size}


def _parts_for(engine: Transformer, rng: np.random.Generator, cache: KVCache, n: int) -> dict:
    """The pass and its parts for a block of ``n`` tokens, each a function to time."""
    c, widths = engine.config, _widths(engine)
    x = {k: rng.standard_normal((n, w)).astype(np.float32) for k, w in widths.items()}
    q = rng.standard_normal((n, c.num_heads, c.head_dim)).astype(np.float32)
    out = np.empty((n, c.num_heads * c.head_dim), np.float32)
    bias = attention_bias(CONTEXT, np.tril(np.ones((n, n), bool))) if n > 1 else None
    span_of, lo, flat_bias, bias_at = span_layout(n, [(0, n, bias)])
    ends = np.array([CONTEXT + n], np.int64)
    tokens, positions = rng.integers(c.vocab_size, size=n), np.arange(CONTEXT, CONTEXT + n)
    mask = np.tril(np.ones((n, n), bool))

    def matmuls() -> None:
        for layer in engine.layers:
            for name in widths:
                linear(x[name], getattr(layer, name))

    def attention() -> None:
        for li in range(c.num_layers):
            _attention_kernel(q, (cache.k,), (cache.v,), li, span_of, lo, ends, flat_bias, bias_at, out)

    def whole() -> None:
        cache.length = CONTEXT
        engine.forward(tokens, positions, cache, block_mask=mask)

    return {"pass": whole, "layer matmuls": matmuls, "lm head": lambda: linear(x["wqkv"], engine.lm_head),
            "attention": attention}


def parts_ms(engine: Transformer, rng: np.random.Generator, cache: KVCache, rounds: int) -> dict[str, list[float]]:
    """Each part's ms per block size: the fastest of ``rounds`` interleaved medians."""
    runs = {n: _parts_for(engine, rng, cache, n) for n in SIZES}
    ms: dict[str, list[float]] = {}
    for _ in range(rounds):
        for n, parts in runs.items():
            for name, run in parts.items():
                row = ms.setdefault(name, [float("inf")] * len(SIZES))
                row[SIZES.index(n)] = min(row[SIZES.index(n)], median_ms(run))
    return ms


def _cycles_per_second(cycles) -> float:
    """The cycle counter's rate (``fused.cycles``), against the wall clock over a fifth of a second."""
    c0, t0 = cycles(), time.perf_counter()
    time.sleep(0.2)
    return (cycles() - c0) / (time.perf_counter() - t0)


def _fused_clock(engine: Transformer) -> tuple | None:
    """The engine's fused layers, their phases (``fused.PHASES``) and the cycle counter's rate:
    what timing a pass phase by phase needs. None where the layers take no clock (an earlier
    checkout) or the engine has no fused layers."""
    try:
        from lyanna.engines.fused import PHASES, cycles
    except ImportError:
        return None
    if engine._fused is None:
        return None
    return engine._fused, PHASES, _cycles_per_second(cycles)


def phases_ms(engine: Transformer, rng: np.random.Generator, cache: KVCache, rounds: int) -> dict[str, list[float]] | None:
    """Inside whole passes, per block size: ms a pass in each phase of the layers (``fused.PHASES``,
    summed over the layers), the layers' call, what the pass spends outside it (embedding, final
    norm, LM head, the Python around) and the pass; the round with the fastest pass, each the mean
    of ``REPEATS`` passes. None where the engine's layers take no clock (an earlier checkout)."""
    clocked = _fused_clock(engine)
    if clocked is None:
        return None
    fused, PHASES, per_second = clocked
    c, best = engine.config, {}
    for _ in range(rounds):
        for n in SIZES:
            clock, inside = np.zeros(len(PHASES), np.int64), []

            def timed(x, rot, blocks, taps):
                start = time.perf_counter()
                out = fused(x, rot, blocks, taps, clock=clock)
                inside.append(time.perf_counter() - start)
                return out

            tokens, positions = rng.integers(c.vocab_size, size=n), np.arange(CONTEXT, CONTEXT + n)
            mask, passes = np.tril(np.ones((n, n), bool)), []
            engine._fused = timed
            try:
                for _ in range(REPEATS):
                    cache.length = CONTEXT
                    start = time.perf_counter()
                    engine.forward(tokens, positions, cache, block_mask=mask)
                    passes.append(time.perf_counter() - start)
            finally:
                engine._fused = fused
            row = {name: clock[i] / per_second / REPEATS * 1e3 for i, name in enumerate(PHASES)}
            row.update({"layers": np.mean(inside) * 1e3, "pass": np.mean(passes) * 1e3})
            row["outside the layers"] = row["pass"] - row["layers"]
            if n not in best or row["pass"] < best[n]["pass"]:
                best[n] = row
    return {name: [round(best[n][name], 3) for n in SIZES] for name in best[SIZES[0]]}


ATTENTION_CONTEXTS = (16, 256, 1024)


def attention_by_context(engine: Transformer, rng: np.random.Generator, rounds: int) -> dict | None:
    """Inside one-token passes after 16, 256 and 1024 cached tokens (taking turns): ms a pass in
    the layers' attention (the fastest of ``rounds`` means of ``4 * REPEATS`` passes), what each 1000
    more cached tokens add, and the rate at which that reads their keys and values (GB/s): what
    attention costs before any key is read, and how fast it reads them. None without a clock."""
    clocked = _fused_clock(engine)
    if clocked is None:
        return None
    fused, PHASES, per_second = clocked
    c, at = engine.config, PHASES.index("attention")
    caches = {}
    for ctx in ATTENTION_CONTEXTS:
        caches[ctx] = engine.new_cache(ctx + 1)
        engine.forward(rng.integers(c.vocab_size, size=ctx), np.arange(ctx), caches[ctx], logit_rows=[-1])
    token, best = rng.integers(c.vocab_size, size=1), {}
    clock = np.zeros(len(PHASES), np.int64)
    engine._fused = lambda x, rot, blocks, taps: fused(x, rot, blocks, taps, clock=clock)
    try:
        for _ in range(rounds):
            for ctx, cache in caches.items():
                clock[:] = 0
                for _ in range(4 * REPEATS):
                    cache.length = ctx
                    engine.forward(token, np.arange(ctx, ctx + 1), cache)
                best[ctx] = min(best.get(ctx, np.inf), clock[at] / per_second / (4 * REPEATS) * 1e3)
    finally:
        engine._fused = fused
    lo, hi = ATTENTION_CONTEXTS[1], ATTENTION_CONTEXTS[2]
    per_1k = (best[hi] - best[lo]) / (hi - lo) * 1e3
    kv_bytes_per_token = c.num_layers * c.num_kv_heads * c.head_dim * 2 * 4  # keys and values, float32
    return {"context": list(ATTENTION_CONTEXTS), "ms": [round(best[ctx], 3) for ctx in ATTENTION_CONTEXTS],
            "ms_per_1k_cached_tokens": round(per_1k, 3), "kv_gb_per_s": round(kv_bytes_per_token / per_1k / 1e3, 1)}


def _child_ms(checkout: Path) -> dict[str, list[float]]:
    """One round of ``parts_ms`` in a child that imports ``checkout``'s package (this script's
    code, that checkout's engine)."""
    from lyanna.measure.bench import json_beside  # see ``against_ms``

    return json_beside(checkout, [__file__, "--one-round"])


def against_ms(checkout: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Ours and ``checkout``'s parts, each round in a child, alternating: a change's effect on each
    part measured beside what it changed (keys ``ours@<commit>`` and ``<commit>``)."""
    # imported here: a child runs this script against the other checkout's package, which may lack it
    from lyanna.measure.bench import checkout_commit

    names = {REPO: f"ours@{checkout_commit(REPO)}", checkout: checkout_commit(checkout)}
    rows: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for where in (REPO, checkout) if r % 2 == 0 else (checkout, REPO):
            kept = rows.setdefault(names[where], {})
            for name, row in _child_ms(where).items():
                kept[name] = [min(a, b) for a, b in zip(kept.get(name, row), row)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes (default: docs/bench/block-parts.json)")
    parser.add_argument("--against", type=Path, help="another checkout of this repository: its parts measured beside ours")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS}; with --against, children per checkout)")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)  # a child of --against
    args = parser.parse_args()
    engine, rng, cache = _engine()
    if args.one_round:
        print(json.dumps(parts_ms(engine, rng, cache, 1)))
        return
    if args.against is None:
        ms, beside = parts_ms(engine, rng, cache, args.rounds), None
    else:  # ours measured in children too, alike
        beside = against_ms(args.against.resolve(), args.rounds)
        ms = next(rows for who, rows in beside.items() if who.startswith("ours@"))
    floors = {"layer_stream_ms": stream_floor_ms(engine, args.rounds),
              "attention_by_context": attention_by_context(engine, rng, args.rounds)}
    report(args, engine, rng, ms, beside, phases_ms(engine, rng, cache, args.rounds), floors)


def report(args: argparse.Namespace, engine: Transformer, rng: np.random.Generator, ms: dict[str, list[float]],
           beside: dict[str, dict[str, list[float]]] | None, phases: dict[str, list[float]] | None, floors: dict) -> None:
    """The kernel's bound and the CPU's peaks measured, and the JSON written."""
    widths = _widths(engine)
    c = engine.config
    hot = {rows: hot_kernel_per_s(engine.layers[0].w_gate_up, rng, rows) for rows in HOT_ROWS}
    peak = hot[16]
    macs_per_row = sum(getattr(layer, name).shape[0] * getattr(layer, name).shape[1]
                       for layer in engine.layers for name in widths) + engine.lm_head.shape[0] * engine.lm_head.shape[1]
    machine = machine_info()
    # the portable path has no one instruction to time; amx's blocks are measured against VNNI's peak
    # (single rows run there; the tiles' own peak is not measured here)
    int_kind = {"portable": None, intdot.AMX: "vnni"}.get(intdot.PATH, intdot.PATH)
    wide = (8, 16) if "avx512f" in machine["cpu_features"] else (8,)
    int_peak = peak_per_s(int_kind, wide if int_kind == "vnni" and "avx512_vnni" in machine["cpu_features"] else (8,)) \
        if int_kind else None
    fma_peak = peak_per_s("fma", wide) if "fma" in machine["cpu_features"] else None
    # attention's multiply-adds for one more row: a score and a weighted value row per cached key and head
    attention_macs = c.num_layers * c.num_heads * (CONTEXT + 1) * c.head_dim * 2
    at_peaks = None
    if int_peak and fma_peak:
        per_row = macs_per_row / int_peak + attention_macs / fma_peak
        one = ms["pass"][0] / 1e3
        at_peaks = {str(n): round((one + (n - 1) * per_row) * 1e3, 2) for n in SIZES}
    report = {
        "command": "python scripts/measure-block-parts.py" + (" --against CHECKOUT" if args.against else "")
                   + (f" --rounds {args.rounds}" if args.rounds != ROUNDS else "")
                   + (f" --out {_shown(args.out)}" if args.out != DEFAULT_OUT else ""),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "model": DEFAULT_MODEL,
        "kernel": engine.kernel,
        "intdot_path": intdot.PATH,
        "context": CONTEXT,
        "sizes": list(SIZES),
        "ms": {k: [round(v, 2) for v in row] for k, row in ms.items()},
        # ours inside whole passes (``phases_ms``): each phase where the pass leaves the caches
        "ms_inside_pass": phases,
        # --against: ours and the checkout's parts, each in children taking turns (each the fastest of its rounds)
        "ms_beside": None if beside is None else {who: {k: [round(v, 2) for v in row] for k, row in rows.items()}
                                                  for who, rows in beside.items()},
        "hot_kernel_gmac_per_s": round(peak / 1e9, 1),  # at 16 rows, the figure earlier JSONs hold
        "hot_kernel_gmac_per_s_by_rows": {str(rows): round(v / 1e9, 1) for rows, v in hot.items()},
        "hot_kernel_share_of_int8_peak": None if int_peak is None else {str(rows): round(v / int_peak, 3)
                                                                         for rows, v in hot.items()},
        "macs_per_row": macs_per_row,
        # Each row beyond the first costs at least its multiply-adds at the kernel's bound.
        "least_ms_per_extra_row": round(macs_per_row / peak * 1e3, 3),
        "cpu_int8_peak_gmac_per_s": None if int_peak is None else round(int_peak / 1e9, 1),
        "cpu_int8_peak_instruction": int_kind,
        "cpu_fp32_fma_peak_g_per_s": None if fma_peak is None else round(fma_peak / 1e9, 1),
        "attention_macs_per_row": attention_macs,
        # The measured one-token pass plus each extra row's products at the CPU's peaks: the
        # fastest each block could be here, whatever the kernels (None: a peak not measured).
        "block_ms_at_cpu_peaks": at_peaks,
        # the one-token products' memory floor (``stream_floor_ms``), attention against the context
        **floors,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ms", "ms_inside_pass", "hot_kernel_gmac_per_s_by_rows",
                                             "hot_kernel_share_of_int8_peak", "least_ms_per_extra_row",
                                             "cpu_int8_peak_gmac_per_s", "cpu_fp32_fma_peak_g_per_s",
                                             "block_ms_at_cpu_peaks", *floors)}, indent=1))


if __name__ == "__main__":
    main()
