"""How much of the target's own replies a draft vocabulary of each size holds, ranked on other replies.

A Lyanna head drafts only tokens of its draft vocabulary: a reply token outside it is never drafted
right. This ranks tokens by their count in the target's greedy replies to ``--rank-prompts``
training prompts, then measures, on replies to ``--limit`` held-out prompts (another seed's,
disjoint from the ranking prompts), the share of reply tokens inside the top ``V`` for several
sizes, beside the shipped head's own vocabulary (``--head``).

    python scripts/vocab-coverage.py --prompts PROMPTS.jsonl --rank-prompts 400 --limit 96 \
        --out docs/bench/vocab-coverage.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

SIZES = (2048, 4096, 8192, 12288, 16384, 24576, 32768)


def main() -> int:
    from safetensors.numpy import load_file
    from tqdm import tqdm

    from lyanna.cli import decoder_from_options
    from lyanna.decoding.decoder import GenerationRequest
    from lyanna.training.data import benchmark_prompts, read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL, one object with 'prompt' a line")
    ap.add_argument("--rank-prompts", type=int, default=400, help="prompts whose replies rank the tokens (seed 0)")
    ap.add_argument("--limit", type=int, default=96, help="held-out prompts (seed 1, as target-ceiling.py's)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--head", type=Path, default=Path(__file__).resolve().parents[1] / "src/lyanna/drafts"
                    / "smollm2-135m-instruct/lyanna/model.safetensors")
    ap.add_argument("--out", type=Path, required=True)
    own, engine_args = ap.parse_known_args()
    decoder = decoder_from_options(engine_args)
    vocab = decoder.engine.config.vocab_size
    exclude = benchmark_prompts()
    held = read_prompts(own.prompts, own.limit, 1, exclude)
    held_ids = {r["id"] for r in held}
    ranking = [r for r in read_prompts(own.prompts, own.rank_prompts + own.limit, 0, exclude)
               if r["id"] not in held_ids][: own.rank_prompts]
    req = GenerationRequest(max_new_tokens=own.max_new_tokens)

    def counts_of(rows: list[dict[str, str]], desc: str) -> np.ndarray:
        counts = np.zeros(vocab, np.int64)
        for row in tqdm(rows, desc=desc, unit="prompt"):
            reply = decoder.generate(decoder.encode(row["prompt"]), req, method="ar").tokens
            np.add.at(counts, np.asarray(reply, np.int64), 1)
        return counts

    ranked, target = counts_of(ranking, "ranking replies"), counts_of(held, "held-out replies")
    order = np.argsort(-ranked, kind="stable")
    total = max(int(target.sum()), 1)
    report = {
        "command": "python scripts/vocab-coverage.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engine": decoder.engine.name,
        "ranking_replies": len(ranking), "ranking_tokens": int(ranked.sum()), "held_out_replies": len(held),
        "held_out_tokens": int(target.sum()), "distinct_tokens_ranked": int((ranked > 0).sum()),
        "coverage_by_size": {str(v): round(float(target[order[:v]].sum() / total), 4) for v in SIZES},
    }
    if own.head.is_file():
        d2t = load_file(str(own.head))["d2t"]
        report["shipped_head"] = {"size": int(d2t.size), "coverage": round(float(target[d2t].sum() / total), 4)}
    own.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
