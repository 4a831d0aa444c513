"""Every method's greedy tokens on Spec-Bench, recorded, and two records compared question by question.

A change that must not change behaviour (a refactor of the loop, the drafters, an engine) is
checked by recording before and after and comparing:

    python scripts/same-tokens.py record --out before.json              # at the old commit
    python scripts/same-tokens.py record --out after.json               # at the new one
    python scripts/same-tokens.py compare before.json after.json        # exit 1 on any difference

``scripts/same-tokens.sh OLD NEW`` does all three with a worktree of each commit. Engine options
go before ``record``'s own (``--backend torch`` for the device engine on CPU torch); budgets are
fixed (``lyanna@16``) or ``auto``. Greedy only: sampled tokens depend on the random numbers a
round draws, which a refactor may legitimately draw in another order.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_METHODS = "ar,suffix,eagle,lyanna,lyanna+suffix,lyanna@16,eagle@16"


def record(argv: list[str]) -> int:
    from tqdm import tqdm

    from lyanna.cli import _decoder, build_parser
    from lyanna.decoding.decoder import GenerationRequest
    from lyanna.measure.bench import load_questions, split_budget

    ap = argparse.ArgumentParser(prog="same-tokens.py record")
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--limit", type=int, default=26)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-fallback", action="store_true", help="judge drafting only by the budget")
    own, engine_args = ap.parse_known_args(argv)
    # Not ``decoder_from_options``: this script also runs an older commit's package (same-tokens.sh).
    decoder = _decoder(build_parser().parse_args([*engine_args, "bench"]))
    questions = load_questions(None, own.limit)
    prompts = [decoder.encode(q.prompt) for q in questions]
    req = GenerationRequest(max_new_tokens=own.max_new_tokens)
    tokens: dict[str, dict[str, list[int]]] = {}
    bar = tqdm(total=len(prompts) * len(own.methods.split(",")), desc="record", unit="reply")
    for spec in own.methods.split(","):
        method, budget = split_budget(spec, "auto")
        tokens[spec] = {}
        for q, ids in zip(questions, prompts):
            got = decoder.generate(ids, req, method=method, budget=budget, fallback=not own.no_fallback)
            tokens[spec][str(q.question_id)] = list(map(int, got.tokens))
            bar.update()
    bar.close()
    report = {"command": "python scripts/same-tokens.py record " + " ".join(argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "engine": decoder.engine.name, "max_new_tokens": own.max_new_tokens, "tokens": tokens}
    Path(own.out).write_text(json.dumps(report))
    print(f"wrote {own.out}: {len(tokens)} methods x {len(prompts)} questions")
    return 0


def compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="same-tokens.py compare")
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args(argv)
    a, b = (json.loads(Path(f).read_text()) for f in (args.before, args.after))
    differ = 0
    for method in sorted(set(a["tokens"]) | set(b["tokens"])):
        x, y = a["tokens"].get(method), b["tokens"].get(method)
        if x is None or y is None:
            print(f"{method}: only in {'after' if x is None else 'before'}")
            differ += 1
            continue
        bad = [q for q in x if x[q] != y.get(q)] + [q for q in y if q not in x]
        ar_differs = sum(x[q] != a["tokens"].get("ar", x)[q] for q in x)
        print(f"{method}: {len(x) - len(bad)} of {len(x)} questions the same"
              + (f"; differ: {', '.join(bad)}" if bad else "") + f" (before: {ar_differs} differ from ar)")
        differ += len(bad)
    print("the same tokens" if not differ else f"{differ} differences")
    return 1 if differ else 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("record", "compare"):
        print(__doc__)
        return 2
    return record(sys.argv[2:]) if sys.argv[1] == "record" else compare(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
