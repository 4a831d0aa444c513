"""What a verified tree's pass costs while decoding, against the calibration: the target's pass over
a block of 1, 2, ... rows timed inside real generations (Spec-Bench prompts, greedy, ``lyanna`` with
fixed tree budgets of 0 to ``--most`` nodes and no fallback, the budgets in turn per prompt; budget
0 drafts nothing, so its one-row passes are plain decoding's), each row count's median over the
plain pass's, beside the same ratio from the latency curve ``lyanna calibrate`` cached (what the auto
budget starts from before decoding corrects it, ``decoding/costs.py``).

Each run is a child process, one after another (``--runs``), and each is reported on its own: on a
shared host the price of the extra rows can move between runs while the plain pass stays put, and
such a move is what this measures, so runs are not merged. Writes docs/bench/pass-shape.json
(``--out`` elsewhere).
Usage: .venv/bin/python scripts/measure-pass-shape.py [--runs N] [--limit N] [--most N]
       [--max-new-tokens N] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from lyanna.engines.loading import DEFAULT_MODEL
from lyanna.measure.bench import json_beside, script_record

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "bench" / "pass-shape.json"

_CHILD = """
import collections, json, time
import numpy as np
from lyanna.cli import decoder_from_options
from lyanna.decoding.decoder import GenerationRequest
from lyanna.measure.bench import load_questions

decoder = decoder_from_options([])
engine_type = type(decoder.engine)
forward_batch = engine_type.forward_batch
passes, budget = collections.defaultdict(list), [None]

def timed_pass(self, blocks, *args, **kwargs):
    t = time.perf_counter()
    out = forward_batch(self, blocks, *args, **kwargs)
    rows = len(blocks[0].tokens)
    if budget[0] is not None and len(blocks) == 1 and rows == budget[0] + 1:  # the budget's own trees
        passes[rows].append(time.perf_counter() - t)
    return out

engine_type.forward_batch = timed_pass
curve = decoder.latency_curve()
prompts = [decoder.encode(q.prompt) for q in load_questions(limit={limit})]
budgets = list(range({most} + 1))
for b in budgets:  # compiled kernels loaded, caches sized
    decoder.generate(prompts[0], GenerationRequest(max_new_tokens=16), method="lyanna", budget=b, fallback=False)
for i, ids in enumerate(prompts):
    for b in budgets[i % len(budgets):] + budgets[:i % len(budgets)]:
        budget[0] = b
        decoder.generate(ids, GenerationRequest(max_new_tokens={max_new}), method="lyanna", budget=b, fallback=False)
        budget[0] = None
one = float(np.median(passes[1]))
print(json.dumps({{"pass_ms": {{r: round(float(np.median(v)) * 1e3, 3) for r, v in sorted(passes.items())}},
                  "x_one_row": {{r: round(float(np.median(v)) / one, 3) for r, v in sorted(passes.items())}},
                  "passes": {{r: len(v) for r, v in sorted(passes.items())}},
                  "curve_x_one_row": {{r: round(float(curve(r) / curve(1)), 3) for r in sorted(passes)}},
                  "curve_date": curve.date}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="child processes, one after another (default 3)")
    parser.add_argument("--limit", type=int, default=26, help="Spec-Bench prompts (default 26)")
    parser.add_argument("--most", type=int, default=5, help="the largest fixed tree budget, in nodes (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens a reply (default 128)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes (default: %(default)s)")
    args = parser.parse_args()
    if min(args.runs, args.limit, args.most, args.max_new_tokens) < 1:
        parser.error("--runs, --limit, --most and --max-new-tokens must be at least 1")
    code = _CHILD.format(limit=args.limit, most=args.most, max_new=args.max_new_tokens)
    runs = []
    for i in range(args.runs):
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        runs.append({"started": started, **json_beside(REPO, ["-c", code])})
        print(f"run {i + 1}: {json.dumps(runs[-1]['x_one_row'])}", flush=True)
    report = {
        **script_record("measure-pass-shape.py", vars(args)),
        "model": DEFAULT_MODEL,
        "settings": {"limit": args.limit, "most": args.most, "max_new_tokens": args.max_new_tokens, "runs": args.runs,
                     "fallback": False},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
