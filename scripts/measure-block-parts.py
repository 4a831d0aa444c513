"""Where a verify block's time goes on the default engine: ms per block of 1 / 2 / 8 / 16 / 64
tokens after 256 cached tokens for the whole pass, and for its parts measured alone on the same
weights and cache (the layers' 120 matrix products in layer order, the LM head, the 30 layers'
attention over the cache with the block's causal mask). What the pass does besides (norms, RoPE,
SiLU, the calls between) is about the pass less the parts, within this host's noise (the parts,
measured apart, need not add up to the pass). Also the integer kernel's
multiply-adds per second on one matrix that stays in cache (its arithmetic bound, no memory
stream): what each extra row of a block costs at the least.

Why: a draft tree pays only if verifying it costs little more than one token, and the block's
cost in one-token steps (``scripts/measure-blocks.py``) says how far it is from that, not why.
Each part is the fastest of ``ROUNDS`` interleaved medians. Writes docs/bench/block-parts.json.
Usage: .venv/bin/python scripts/measure-block-parts.py
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from lyanna.engines import intdot
from lyanna.engines.attention import _attention_kernel, span_layout
from lyanna.engines.kernels import linear
from lyanna.engines.loading import DEFAULT_MODEL, load_target
from lyanna.engines.transformer import Transformer, attention_bias
from lyanna.measure.bench import machine_info

SIZES = (1, 2, 8, 16, 64)
CONTEXT = 256
REPEATS = 7
ROUNDS = 3


def median_ms(run, repeats: int = REPEATS) -> float:
    run()  # warm-up (first-call compiles, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    target = load_target(DEFAULT_MODEL)
    engine = Transformer(target.config, target.weights)
    c = engine.config
    rng = np.random.default_rng(0)
    cache = engine.new_cache(CONTEXT + max(SIZES))
    engine.forward(rng.integers(c.vocab_size, size=CONTEXT), np.arange(CONTEXT), cache, logit_rows=[-1])
    widths = {"wqkv": c.hidden_size, "wo": c.num_heads * c.head_dim, "w_gate_up": c.hidden_size,
              "w_down": c.intermediate_size}

    def parts_for(n: int) -> dict:
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

    runs = {n: parts_for(n) for n in SIZES}
    ms: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for n, parts in runs.items():
            for name, run in parts.items():
                row = ms.setdefault(name, [float("inf")] * len(SIZES))
                row[SIZES.index(n)] = min(row[SIZES.index(n)], median_ms(run))

    # The kernel's arithmetic bound: one matrix (layer 0's gate and up projections, 1.1 MB of
    # blocks) over and over at 16 rows, so its weights come from cache, not memory.
    w = engine.layers[0].w_gate_up
    hot_x = rng.standard_normal((16, w.shape[1])).astype(np.float32)
    seconds = min(median_ms(lambda: [linear(hot_x, w) for _ in range(20)]) for _ in range(ROUNDS)) / 1e3 / 20
    macs_per_row = sum(getattr(layer, name).shape[0] * getattr(layer, name).shape[1]
                       for layer in engine.layers for name in widths) + engine.lm_head.shape[0] * engine.lm_head.shape[1]
    peak = 16 * w.shape[0] * w.shape[1] / seconds
    report = {
        "command": "python scripts/measure-block-parts.py",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": DEFAULT_MODEL,
        "kernel": engine.kernel,
        "intdot_path": intdot.PATH,
        "context": CONTEXT,
        "sizes": list(SIZES),
        "ms": {k: [round(v, 2) for v in row] for k, row in ms.items()},
        "hot_kernel_gmac_per_s": round(peak / 1e9, 1),
        "macs_per_row": macs_per_row,
        # Each row beyond the first costs at least its multiply-adds at the kernel's bound.
        "least_ms_per_extra_row": round(macs_per_row / peak * 1e3, 3),
    }
    path = Path(__file__).resolve().parent.parent / "docs" / "bench" / "block-parts.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ms", "hot_kernel_gmac_per_s", "least_ms_per_extra_row")}, indent=1))


if __name__ == "__main__":
    main()
