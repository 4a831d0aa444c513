"""A Lyanna round's drafting against a one-token step, on the default model and its shipped head:
the ms a round spends drafting on the host head (``ChainHead.draft_trees``: the catch-up, the
chain's levels, the draft logits and the trees) by chain depth, the target's one-row pass, and
their ratio, all timed inside real generations (Spec-Bench prompts, greedy, ``ar`` and ``lyanna``
in turn per prompt; lyanna with a fixed tree budget and no fallback, so that any two checkouts
whose drafts have the same bits draft the same rounds).

Each measurement runs in a child process importing a checkout's ``src``; ``--against DIR`` also
measures another checkout of this repository (e.g. ``git worktree add /tmp/before <commit>``),
alternating with ours, ``--rounds`` times, each depth's fastest median kept (a shared host's
speed moves between runs). Writes docs/bench/draft-round.json (``--out`` elsewhere).
Usage: .venv/bin/python scripts/measure-draft-round.py [--against DIR] [--rounds N] [--limit N]
       [--budget N] [--max-new-tokens N] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

from lyanna.engines.loading import DEFAULT_MODEL
from lyanna.measure.bench import checkout_commit, json_beside, machine_info, script_command

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "bench" / "draft-round.json"

_CHILD = """
import collections, json, time
import numpy as np
from lyanna.cli import decoder_from_options
from lyanna.decoding.decoder import GenerationRequest
from lyanna.drafters.lyanna import ChainHead
from lyanna.measure.bench import load_questions

decoder = decoder_from_options([])
drafts, steps, on = collections.defaultdict(list), [], [False]
draft_trees, forward_batch = ChainHead.draft_trees, type(decoder.engine).forward_batch

def timed_draft(self, pc, ctx, depth, *args, **kwargs):
    t = time.perf_counter()
    out = draft_trees(self, pc, ctx, depth, *args, **kwargs)
    if on[0]:
        drafts[depth].append(time.perf_counter() - t)
    return out

def timed_pass(self, blocks, *args, **kwargs):
    t = time.perf_counter()
    out = forward_batch(self, blocks, *args, **kwargs)
    if on[0] and len(blocks) == 1 and len(blocks[0].tokens) == 1:
        steps.append(time.perf_counter() - t)
    return out

ChainHead.draft_trees, type(decoder.engine).forward_batch = timed_draft, timed_pass
prompts = [decoder.encode(q.prompt) for q in load_questions(limit={limit})]
for ids in prompts[:2]:  # compiled kernels loaded, caches sized
    decoder.generate(ids, GenerationRequest(max_new_tokens=16), method="lyanna", budget={budget}, fallback=False)
on[0] = True
for ids in prompts:
    decoder.generate(ids, GenerationRequest(max_new_tokens={max_new}), method="ar")
    decoder.generate(ids, GenerationRequest(max_new_tokens={max_new}), method="lyanna", budget={budget}, fallback=False)
print(json.dumps({{"step_ms": float(np.median(steps)) * 1e3,
                  "draft_ms": {{d: float(np.median(v)) * 1e3 for d, v in sorted(drafts.items())}},
                  "rounds": {{d: len(v) for d, v in sorted(drafts.items())}}}}))
"""


def measure(checkout: Path, limit: int, budget: int, max_new: int) -> dict:
    """One child's medians: the one-row pass, and drafting by depth with each depth's rounds."""
    code = _CHILD.format(limit=limit, budget=budget, max_new=max_new)
    return json_beside(checkout, ["-c", code])


def keep_fastest(kept: dict | None, new: dict) -> dict:
    """The faster medians of two runs of one checkout (the rounds are the same: the same drafts)."""
    if kept is None:
        return new
    return {"step_ms": min(kept["step_ms"], new["step_ms"]),
            "draft_ms": {d: min(ms, new["draft_ms"].get(d, ms)) for d, ms in kept["draft_ms"].items()},
            "rounds": kept["rounds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout of this repository to measure beside ours")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every checkout, alternating (default 2)")
    parser.add_argument("--limit", type=int, default=12, help="Spec-Bench prompts (default 12)")
    parser.add_argument("--budget", type=int, default=4, help="the fixed tree budget in nodes (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens a reply (default 128)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes (default: %(default)s)")
    args = parser.parse_args()
    if min(args.rounds, args.limit, args.budget, args.max_new_tokens) < 1:
        parser.error("--rounds, --limit, --budget and --max-new-tokens must be at least 1")
    checkouts = [REPO] + ([] if args.against is None else [args.against.resolve()])
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for checkout in checkouts:
            name = f"ours@{checkout_commit(checkout)}" if checkout == REPO else f"against@{checkout_commit(checkout)}"
            rows[name] = keep_fastest(rows.get(name), measure(checkout, args.limit, args.budget, args.max_new_tokens))
    for row in rows.values():
        row["draft_over_step"] = {d: round(ms / row["step_ms"], 3) for d, ms in row["draft_ms"].items()}
        row["step_ms"] = round(row["step_ms"], 3)
        row["draft_ms"] = {d: round(ms, 3) for d, ms in row["draft_ms"].items()}
    report = {
        "command": script_command("measure-draft-round.py", parser, args, ("rounds", "limit", "budget", "max_new_tokens"), REPO, DEFAULT_OUT),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": DEFAULT_MODEL,
        "settings": {"limit": args.limit, "budget": args.budget, "max_new_tokens": args.max_new_tokens,
                     "rounds": args.rounds, "fallback": False},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
