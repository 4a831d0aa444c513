"""The load test's 8 clients without the host's noise: each method serves the same requests in a
closed loop of ``--max-batch`` sequences (``Decoder.generate_batch``: a request joins as one
leaves, as the server's batch does), and every pass is also priced at the latency curve for its
rows, so a request's latency has a simulated twin that does not move with the host's speed.
With ``--clients`` above the batch, the others wait in the queue as the server's do: a closed loop
of that many clients, each sending its next request when its last one ends (request ``j`` arrives
with the ``j - clients``-th request to end), its latency counted from its arrival.

On a shared 2-core host the same `ar` row of `scripts/loadtest-batching.sh` ranges over a third;
this runs in seconds and repeats to the row: the tool for comparing budget rules under load. What
it leaves out: drafting time (a head's draft is not priced, only counted) and the server's HTTP
and streaming.

    python scripts/simulate-load.py --out docs/bench/simulated-load.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--methods", default="ar,suffix,lyanna,lyanna+suffix")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--clients", type=int, default=None,
                    help="concurrent clients (default: --max-batch); more queue, latency from arrival")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="as `lyanna serve --prefill-chunk` (default: its default)")
    ap.add_argument("--shared-margin", type=float, default=None,
                    help="replace budget.SHARED_MARGIN for this run (to compare margins)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    clients = args.max_batch if args.clients is None else args.clients
    if clients < args.max_batch:
        ap.error("--clients below --max-batch would leave the batch part empty: lower --max-batch instead")

    from lyanna.cli import DEFAULT_PREFILL_CHUNK
    from lyanna.decoding import batching, budget
    from lyanna.decoding.decoder import Decoder, GenerationRequest
    from lyanna.engines.loading import load_target
    from lyanna.measure.bench import load_questions, script_record

    if args.shared_margin is not None:
        budget.SHARED_MARGIN = args.shared_margin
    chunk = DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk
    decoder = Decoder(load_target(args.model), prefill_chunk=chunk)
    curve = decoder.latency_curve()
    prompts = [decoder.encode(q.prompt) for q in load_questions()][: args.requests]
    clock = {"wall": 0.0, "sim": 0.0, "passes": 0, "rows": 0}
    ended: dict = {}
    step = batching.BatchScheduler.step

    def timed_step(self):
        # The server's queue, not generate_batch's (which holds every prompt from the start): the
        # requests that have arrived (a client's next one when its last ends) and are not in the batch.
        self.waiting = max(0, min(len(prompts) - len(ended), clients) - len(self.active))
        t0 = time.perf_counter()
        done = step(self)
        clock["wall"] += time.perf_counter() - t0
        rows = self.pass_rows
        clock["sim"] += float(curve(rows))
        clock["passes"] += 1
        clock["rows"] += rows
        for key, _ in done:
            ended[key] = (clock["wall"], clock["sim"])
        return done

    batching.BatchScheduler.step = timed_step
    methods = args.methods.split(",")
    for method in methods:  # warm-up: heads loaded, kernels compiled
        decoder.generate_batch(prompts[:2], GenerationRequest(max_new_tokens=16), method=method, max_batch=2)
    rows = []
    for method in methods:
        clock.update(wall=0.0, sim=0.0, passes=0, rows=0)
        ended.clear()
        results = decoder.generate_batch(prompts, GenerationRequest(max_new_tokens=args.max_new_tokens),
                                         method=method, max_batch=args.max_batch)
        tokens = sum(r.new_tokens for r in results)
        # Request j arrives with the (j - clients)-th request to end (that client's next), the first ones at 0.
        wall, sim = [], []
        for i, out in enumerate((wall, sim)):
            ends = sorted(e[i] for e in ended.values())
            out += [ended[j][i] - (ends[j - clients] if j >= clients else 0.0) for j in sorted(ended)]
        rows.append({"method": method, "tokens": tokens, "passes": clock["passes"],
                     "rows_per_pass": round(clock["rows"] / clock["passes"], 2),
                     "simulated_tokens_per_s": round(tokens / clock["sim"], 1),
                     "simulated_latency_p50_s": round(statistics.median(sim), 3),
                     "simulated_latency_p95_s": round(float(np.percentile(sim, 95)), 3),
                     "wall_tokens_per_s": round(tokens / clock["wall"], 1),
                     "wall_latency_p50_s": round(statistics.median(wall), 3),
                     # What the simulation does not price: the drafters' passes and their wall seconds.
                     "draft_passes": sum(r.extra.get("draft_passes", 0) for r in results),
                     "draft_seconds": round(sum(r.extra.get("draft_seconds", 0.0) for r in results), 3)})
        r = rows[-1]
        print(f"{method}: simulated {r['simulated_tokens_per_s']} tokens/s, latency p50 {r['simulated_latency_p50_s']} s, "
              f"p95 {r['simulated_latency_p95_s']} s ({r['passes']} passes of {r['rows_per_pass']} rows); "
              f"wall {r['wall_tokens_per_s']} tokens/s, p50 {r['wall_latency_p50_s']} s; "
              f"{r['draft_passes']} draft passes, {r['draft_seconds']} s drafting")
    report = {"model": args.model, **script_record("simulate-load.py", vars(args)),
              "shared_margin": budget.SHARED_MARGIN, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
