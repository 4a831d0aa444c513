"""A bench JSON's rates without the prompts on which some method's run met a first-time cost.

On an engine whose new shapes compile or capture (the device path on a GPU), a bench run before
`bench` warmed each prompt up timed the compile inside whichever method met a new shape first:
seconds on one prompt where a reply takes a fifth of one, enough to turn the whole table. This
drops every question on which any method took more than ``--over`` times its own median seconds
per new token, and gives each method's tokens/s and decode tokens/s over the rest, against
``ar``'s over the same questions.

    python scripts/bench-steady.py docs/bench/gpu/h200-cache-in-graph-bench-bfloat16.json [--out F]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def steady(report: dict, over: float) -> dict:
    rows = {r["method"]: r for r in report["results"]}
    slow: set[int] = set()
    for r in rows.values():
        per_token = {q["question_id"]: q["seconds"] / max(q["new_tokens"], 1) for q in r["per_question"]}
        median = statistics.median(per_token.values())
        slow |= {qid for qid, s in per_token.items() if s > over * median}
    rates: dict[str, dict[str, float]] = {}
    for m, r in rows.items():
        kept = [q for q in r["per_question"] if q["question_id"] not in slow]
        tokens = sum(q["new_tokens"] for q in kept)
        seconds = sum(q["seconds"] for q in kept)
        decode = sum(q["seconds"] - q["prefill_seconds"] for q in kept)
        rates[m] = {"tokens_per_s": round(tokens / seconds, 1), "decode_tokens_per_s": round(tokens / decode, 1)}
    if "ar" in rates:
        for v in rates.values():
            v["speedup"] = round(v["tokens_per_s"] / rates["ar"]["tokens_per_s"], 3)
            v["decode_speedup"] = round(v["decode_tokens_per_s"] / rates["ar"]["decode_tokens_per_s"], 3)
    return {"over": over, "dropped_questions": sorted(slow),
            "questions": len(next(iter(rows.values()))["per_question"]) - len(slow), "methods": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--over", type=float, default=2.5, help="drop a question where a method's seconds per token "
                    "exceed this many times its median (default 2.5)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = {"command": f"python scripts/bench-steady.py {args.bench_json} --over {args.over}",
           "source": args.bench_json.name, **steady(json.loads(args.bench_json.read_text()), args.over)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
