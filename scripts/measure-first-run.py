"""What a first run costs on a machine with nothing compiled yet: the default model loaded and a
first ``lyanna`` reply, each with an empty ``$LYANNA_CACHE`` (so the GGUF is converted and every
kernel compiled inside the clock), and how many compilations numba ran (a count that does not
move with the host's speed, where the seconds do); then an ``ar`` reply, which must give the same
tokens.

Each measurement runs in a child process importing a checkout's ``src``; ``--against DIR`` also
measures another checkout of this repository (e.g. ``git worktree add /tmp/before <commit>``),
the two taking turns ``--rounds`` times, each with a fresh cache. Writes docs/bench/first-run.json
(``--out`` elsewhere).
Usage: .venv/bin/python scripts/measure-first-run.py [--against DIR] [--rounds N] [--max-new-tokens N] [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from lyanna.engines.loading import DEFAULT_MODEL
from lyanna.measure.bench import checkout_commit, json_beside, machine_info, script_command

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "bench" / "first-run.json"
PROMPT = "Name three rivers in Europe."

_CHILD = """
import json, time
t0 = time.perf_counter()
import lyanna  # first: it points numba's cache at $LYANNA_CACHE before numba is imported
from numba.core import event

compiled = [0]

class Count(event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        compiled[0] += 1

event.register("numba:compile", Count())
from lyanna.cli import decoder_from_options
from lyanna.decoding.decoder import GenerationRequest

decoder = decoder_from_options([])
t1 = time.perf_counter()
loaded = compiled[0]
ids = decoder.encode({prompt!r})
reply = decoder.generate(ids, GenerationRequest(max_new_tokens={max_new}), method="lyanna")
t2 = time.perf_counter()
plain = decoder.generate(ids, GenerationRequest(max_new_tokens={max_new}), method="ar")
print(json.dumps({{"load_s": t1 - t0, "first_lyanna_reply_s": t2 - t1, "compilations_loading": loaded,
                  "compilations_first_reply": compiled[0] - loaded, "same_as_ar": reply.tokens == plain.tokens}}))
"""


def measure(checkout: Path, max_new: int) -> dict:
    """One child's times and counts, with a cache of its own, removed afterwards."""
    cache = tempfile.mkdtemp(prefix="lyanna-first-run-")
    # the child's numba cache under its own LYANNA_CACHE: this process's (set when it imported
    # lyanna, and inherited otherwise) would hand it our compiled kernels
    before = {k: os.environ.pop(k, None) for k in ("LYANNA_CACHE", "NUMBA_CACHE_DIR")}
    os.environ["LYANNA_CACHE"] = cache
    try:
        return json_beside(checkout, ["-c", _CHILD.format(prompt=PROMPT, max_new=max_new)])
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop("LYANNA_CACHE", None)
        os.environ.update({k: v for k, v in before.items() if v is not None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout of this repository to measure beside ours")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every checkout, taking turns (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens a reply (default 48)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes (default: %(default)s)")
    args = parser.parse_args()
    if min(args.rounds, args.max_new_tokens) < 1:
        parser.error("--rounds and --max-new-tokens must be at least 1")
    checkouts = [REPO] + ([] if args.against is None else [args.against.resolve()])
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for checkout in checkouts if r % 2 == 0 else checkouts[::-1]:  # each side first in turn
            name = f"ours@{checkout_commit(checkout)}" if checkout == REPO else f"against@{checkout_commit(checkout)}"
            run = {k: round(v, 1) if isinstance(v, float) else v for k, v in measure(checkout, args.max_new_tokens).items()}
            runs.setdefault(name, []).append(run)
            print(name, json.dumps(run), flush=True)
    report = {
        "command": script_command("measure-first-run.py", parser, args, ("rounds", "max_new_tokens"), REPO, DEFAULT_OUT),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": DEFAULT_MODEL,
        "prompt": PROMPT,
        "max_new_tokens": args.max_new_tokens,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
