"""Whole forward passes: ms per forward block of 1 / 2 / 8 / 16 / 64 tokens after 256
cached tokens, on the default model, for our engine on fp32 weights (numba kernels), our engine on
the GGUF's quantized blocks with 8-bit inputs (``--weights gguf``, ``intdot.py``, on each of its
instruction-set paths this CPU runs but the portable one) and with fp32
inputs (``--weights gguf-float``, ``quant.py``), and llama.cpp on the same GGUF (llama-cpp-python,
logits for every row as verification needs, in a child process: a native build that dies of
SIGILL on an AMX host leaves its reason in the JSON's ``llamacpp`` and the other rows intact).
Also each block's cost in one-token steps. Each engine's row is the fastest of ``ROUNDS``
interleaved measurements, size by size.

``--against DIR``: also the default engine (``ours-gguf``) of another checkout of this repository
(e.g. ``git worktree add /tmp/before <commit>``), in a child process that imports that checkout's
``src`` each round, and ours in a child alike, interleaved: a change's speed measured beside what
it changed, on the same host at the same time (rows ``ours-gguf@<commit>``; a child holds one
engine, where this process holds four).
Writes docs/bench/blocks.json (``--out`` elsewhere).
``--rounds N``: passes over every engine (default 3); on a host whose speed moves a lot between
runs, more rounds let each engine meet its fast moments.
``--sizes 1,2,5,8``: other block sizes (1 first; default 1,2,8,16,64): a change for some sizes
measured at those.
``--context N``: cached tokens before each block (default 256): a one-token pass reads every
cached key and value, so at long contexts their bytes, not the weights', set its time.
``--weights gguf``: only these of our engines (``fp32``, ``gguf-float``, ``gguf``; default all): the
integer paths alone where time is short (a lent machine compiling every kernel afresh).
Usage: .venv/bin/python scripts/measure-blocks.py [--against DIR] [--rounds N] [--sizes LIST] [--weights LIST]
       [--context N] [--out PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from lyanna.decoding.budget import calibrate
from lyanna.engines import intdot
from lyanna.engines.loading import DEFAULT_MODEL, load_target, source_gguf
from lyanna.engines.transformer import Transformer
from lyanna.measure.bench import checkout_commit, json_beside, machine_info
from lyanna.measure.peers import LLAMACPP_HINT, PeerFailed, call_in_child

SIZES = (1, 2, 8, 16, 64)
WEIGHTS = ("fp32", "gguf-float", "gguf")  # our engines: ``--weights`` of load_target
CONTEXT = 256
REPEATS = 7
ROUNDS = 3  # passes over every engine (see ``main``)


def llamacpp_ms(gguf: Path, vocab: int, sizes: tuple[int, ...] = SIZES, context: int = CONTEXT) -> list[float]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context + max(sizes) + 8, n_threads=os.cpu_count(),
                          logits_all=True, verbose=False)
    rng = np.random.default_rng(0)
    llm.eval(rng.integers(vocab, size=context).tolist())
    out = []
    for n in sizes:
        tokens = rng.integers(vocab, size=n).tolist()
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up
            llm.n_tokens = context  # eval() drops the cache rows past n_tokens first
            t0 = time.perf_counter()
            llm.eval(tokens)
            times.append(time.perf_counter() - t0)
        out.append(round(float(np.median(times[1:])) * 1e3, 2))
    return out


_AGAINST = """
import json
from lyanna.decoding.budget import calibrate
from lyanna.engines.loading import load_target
from lyanna.engines.transformer import Transformer
target = load_target({model!r}, weight_format="gguf")
engine = Transformer(target.config, target.weights)
curve = calibrate(engine, {model!r}, sizes={sizes!r}, context={context!r}, repeats={repeats!r})
print(json.dumps([round(s * 1e3, 2) for s in curve.seconds]))
"""


def against_ms(checkout: Path, sizes: tuple[int, ...] = SIZES, context: int = CONTEXT) -> list[float]:
    """The default engine's row of ms in a child that imports ``checkout``'s package."""
    code = _AGAINST.format(model=DEFAULT_MODEL, sizes=sizes, context=context, repeats=REPEATS)
    return json_beside(checkout, ["-c", code])


REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "bench" / "blocks.json"


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def fastest(kept: list[float] | None, new: list[float]) -> list[float]:
    """Size by size, the faster of two rows of ms (``kept`` None: the new row)."""
    return new if kept is None else [min(a, b) for a, b in zip(kept, new)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout of this repository to measure beside ours")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON goes (default: docs/bench/blocks.json)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"passes over every engine (default {ROUNDS})")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="block sizes in tokens, comma-separated, 1 first (default: %(default)s)")
    parser.add_argument("--weights", default=",".join(WEIGHTS),
                        help="our engines to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--context", type=int, default=CONTEXT, help=f"cached tokens before each block (default {CONTEXT})")
    args = parser.parse_args()
    if args.context < 1:
        parser.error("--context must be at least 1")
    weights_run = tuple(w.strip() for w in args.weights.split(","))
    if not weights_run or any(w not in WEIGHTS for w in weights_run):
        parser.error(f"--weights {args.weights!r}: a comma-separated choice of {', '.join(WEIGHTS)}")
    try:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: comma-separated whole numbers")
    if sizes[0] != 1 or len(sizes) < 2 or any(b <= a for a, b in zip(sizes, sizes[1:])):
        parser.error(f"--sizes {args.sizes!r}: 1 first, then larger sizes in increasing order")
    kernels, kv_caches = {}, {}
    default_path = intdot.PATH
    # The default engine on each integer path this CPU runs (the same bits, different instructions).
    runs = [("fp32", default_path), ("gguf-float", default_path)]
    runs += [("gguf", p) for p in intdot.PATHS if p != "portable"]
    runs = [(w, p) for w, p in runs if w in weights_run]
    engines = {}
    for weights, path in runs:
        intdot.PATH = path
        target = load_target(DEFAULT_MODEL, weight_format=weights)
        name = f"ours-{weights}" if path == default_path else f"ours-{weights}-{path}"
        engines[name] = (path, Transformer(target.config, target.weights))
        kernels[name] = engines[name][1].kernel
        kv_caches[name] = engines[name][1].kv_cache
        vocab = target.config.vocab_size
    # Every engine in turn, ROUNDS times, each size's fastest median kept: a shared host's bursts of
    # load last seconds, and measured one engine after another a burst bent one engine's row only.
    ms: dict[str, list[float]] = {}
    gguf = source_gguf(DEFAULT_MODEL)
    llamacpp_failed = None if importlib.util.find_spec("llama_cpp") else "llama-cpp-python is not installed"
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for i in range(args.rounds):
        for name, (path, engine) in engines.items():
            intdot.PATH = path
            curve = calibrate(engine, DEFAULT_MODEL, sizes=sizes, context=args.context, repeats=REPEATS)
            ms[name] = fastest(ms.get(name), [round(s * 1e3, 2) for s in curve.seconds])
        for checkout in () if args.against is None else (REPO, args.against.resolve()):  # alike: each in a child
            name = f"ours-gguf@{checkout_commit(checkout)}"
            ms[name] = fastest(ms.get(name), against_ms(checkout, sizes, args.context))
            kernels[name] = kernels.get("ours-gguf", "intdot")
        if llamacpp_failed is None:  # in a child (loading the model each round, as before): a crash kills only it
            try:
                row = call_in_child(llamacpp_ms, gguf, vocab, sizes, args.context, kind="llamacpp", hint=LLAMACPP_HINT)
                ms["llamacpp"] = fastest(ms.get("llamacpp"), row)
            except PeerFailed as e:
                llamacpp_failed = f"round {i + 1} of {args.rounds}: {e}"  # rounds before it stay in ms
    intdot.PATH = default_path
    report = {
        "command": "python scripts/measure-blocks.py" + (" --against CHECKOUT" if args.against else "")
                   + (f" --rounds {args.rounds}" if args.rounds != ROUNDS else "")
                   + (f" --sizes {','.join(map(str, sizes))}" if sizes != SIZES else "")
                   + (f" --weights {','.join(weights_run)}" if weights_run != WEIGHTS else "")
                   + (f" --context {args.context}" if args.context != CONTEXT else "")
                   + (f" --out {_shown(args.out)}" if args.out != DEFAULT_OUT else ""),
        "rounds": args.rounds,
        "commit": checkout_commit(REPO),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": DEFAULT_MODEL,
        "context": args.context,
        "sizes": list(sizes),
        "kernels": kernels,
        "kv_caches": kv_caches,  # what each of our engines' key/value cache holds (``--against``'s: its own default)
        "ms": ms,
    }
    if llamacpp_failed is not None:
        report["llamacpp"] = llamacpp_failed
    out = args.out
    report["x_one_token"] = {k: [round(t / v[0], 2) for t in v] for k, v in report["ms"].items()}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("ms", "x_one_token")}, indent=1))


if __name__ == "__main__":
    main()
