"""How sure the target is of its own next token: the ceiling a draft head's agreement is read against.

A head is fitted to predict the target's next token on the target's own (greedy) replies. Where the
target itself hesitates (a top-1 probability near the second's), a head that learned the target's
distribution perfectly still picks the second token about as often as it is nearly as likely, and
a small head far more often. This measures, over greedy replies to training prompts (benchmark
questions excluded), the target's top-1 probability and its top-1 minus top-2 margin at every
reply position, their means and how often the margin is small; and, for a Lyanna head's draft
vocabulary (``--head``, default the shipped head), the share of reply tokens inside it and the
target's probability mass inside it (a token outside is never drafted).

    python scripts/target-ceiling.py --prompts PROMPTS.jsonl --limit 200 --max-new-tokens 128 \
        --out docs/bench/target-ceiling.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

MARGINS = (0.05, 0.1, 0.2, 0.5)


def position_stats(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 probability and top-1 minus top-2 probability of each row of ``logits``."""
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    top2 = np.sort(np.partition(p, -2, axis=-1)[:, -2:], axis=-1)
    return top2[:, 1], top2[:, 1] - top2[:, 0]


def main() -> int:
    from tqdm import tqdm

    from lyanna.cli import decoder_from_options
    from lyanna.decoding.decoder import GenerationRequest
    from lyanna.training.data import benchmark_prompts, read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL, one object with 'prompt' a line")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="which prompts (a seeded random order)")
    ap.add_argument("--head", type=Path, default=Path(__file__).resolve().parents[1] / "src/lyanna/drafts"
                    / "smollm2-135m-instruct/lyanna/model.safetensors",
                    help="a Lyanna head's model.safetensors, whose d2t is its draft vocabulary")
    ap.add_argument("--out", type=Path, required=True)
    own, engine_args = ap.parse_known_args()
    decoder = decoder_from_options(engine_args)
    engine = decoder.engine
    rows = read_prompts(own.prompts, own.limit, own.seed, benchmark_prompts())
    from safetensors.numpy import load_file

    d2t = load_file(str(own.head))["d2t"] if own.head.is_file() else None
    top1, margin, inside, mass = [], [], [], []
    for row in tqdm(rows, desc="replies", unit="prompt"):
        ids = decoder.encode(row["prompt"])
        reply = decoder.generate(ids, GenerationRequest(max_new_tokens=own.max_new_tokens), method="ar").tokens
        if not reply:
            continue
        tokens = np.asarray([*ids, *reply[:-1]], np.int64)  # the logits before each reply token
        cache = engine.new_cache(len(tokens))
        out = engine.forward(tokens, np.arange(len(tokens)), cache, logit_rows=slice(len(ids) - 1, len(tokens)))
        logits = np.asarray(out.logits, np.float64)
        p1, m = position_stats(logits)
        top1.append(p1)
        margin.append(m)
        if d2t is not None:
            inside.append(np.isin(np.asarray(reply), d2t))
            z = np.exp(logits - logits.max(-1, keepdims=True))
            mass.append(z[:, d2t].sum(-1) / z.sum(-1))
    p1, m = np.concatenate(top1), np.concatenate(margin)
    report = {
        "command": "python scripts/target-ceiling.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engine": engine.name, "prompts": len(top1),
        "positions": int(p1.size), "mean_top1_probability": round(float(p1.mean()), 4),
        "median_top1_probability": round(float(np.median(p1)), 4),
        "mean_top1_top2_margin": round(float(m.mean()), 4),
        "share_with_margin_below": {str(t): round(float((m < t).mean()), 4) for t in MARGINS},
        "share_top1_at_least_0.9": round(float((p1 >= 0.9).mean()), 4),
    }
    if d2t is not None:
        report["draft_vocabulary"] = {"head": "/".join(own.head.resolve().parts[-4:]), "size": int(d2t.size),
                                      "share_of_reply_tokens_inside": round(float(np.concatenate(inside).mean()), 4),
                                      "mean_probability_mass_inside": round(float(np.concatenate(mass).mean()), 4)}
    own.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
