"""``lyanna bench``: every method on the same prompts, each generation timed the same way.

Methods run interleaved prompt by prompt after a warm-up, each prompt starting at the next
method, so drift on the machine and a run's place in the sequence hit them all alike. Aggregates are ratios of sums (total tokens / total seconds), never means of ratios.
The peers (Hugging Face, llama.cpp) run in child processes (``peers.py``) and time each
generation there, with the same clock around the same work, so that a peer that crashes loses
only its own row.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..data import SPEC_BENCH, packaged
from ..decoding.decoder import Decoder, GenerationRequest, GenerationResult
from ..decoding.sampling import SamplingParams
from ..engines.base import shapes_compile
from ..errors import LyannaError
from .llamacpp_baseline import METHODS as LLAMACPP_METHODS
from .peers import Peer, PeerFailed, start_peers

if TYPE_CHECKING:
    from argparse import ArgumentParser, Namespace
    from importlib.resources.abc import Traversable

EXTERNAL_METHODS = ("hf", "hf-pld")
PEER_METHODS = (*EXTERNAL_METHODS, *LLAMACPP_METHODS)  # methods that are another library, not our loop
PLD_TOKENS = 10  # Hugging Face's documented example value for prompt_lookup_num_tokens


@dataclass(frozen=True)
class Question:
    question_id: Any
    category: str
    prompt: str


def load_questions(path: str | Path | None = None, limit: int | None = None) -> list[Question]:
    """First turns of an MT-bench-format JSONL file (default: the packaged Spec-Bench questions);
    ``limit`` takes them round-robin across categories."""
    source: Path | Traversable = Path(path) if path else packaged(SPEC_BENCH)
    if not source.is_file():
        raise LyannaError(f"questions file {source} not found")
    by_cat: dict[str, list[Question]] = defaultdict(list)
    with source.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q = Question(row.get("question_id", lineno), str(row.get("category", "uncategorized")), str(row["turns"][0]))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise LyannaError(f"{source}:{lineno}: not an MT-bench question (need 'turns': [...]): {e}") from None
            by_cat[q.category].append(q)
    if not by_cat:
        raise LyannaError(f"{source} holds no questions")
    if limit is not None and limit < 1:
        raise LyannaError(f"--limit must be >= 1, got {limit}")
    ordered: list[Question] = []
    queues = [list(qs) for qs in by_cat.values()]
    while any(queues):
        for qs in queues:
            if qs:
                ordered.append(qs.pop(0))
    return ordered[:limit] if limit else ordered


def machine_info() -> dict[str, Any]:
    import numpy as np
    import torch

    from ..decoding.budget import cpu_features, cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        # The accelerator, when one is visible (a bench on one names it beside the host's CPU).
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def script_record(script: str, options: dict[str, Any]) -> dict[str, Any]:
    """Where a measuring script in ``scripts/`` ran, for its JSON: the machine, the date (UTC) and
    its command line with every option it ran with (``options``: its parsed arguments' ``vars``)."""
    return {"machine": machine_info(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": f"python scripts/{script} " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in options.items() if v is not None)}


def checkout_commit(checkout: str | Path) -> str:
    """A checkout's commit as a measuring script names an engine it timed, ``<commit>-dirty``
    where its tracked files differ from that commit (a change measured before it is committed)."""
    import subprocess

    return subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
                          capture_output=True, text=True, check=True).stdout.strip()


def script_command(script: str, parser: ArgumentParser, args: Namespace, options: Sequence[str], repo: Path,
                   default_out: Path) -> str:
    """How a measuring script ran, as its JSON records it: ``options`` that differ from their
    defaults, ``--against`` as CHECKOUT, ``--out`` relative to ``repo`` where it lies inside."""
    parts = [f"python scripts/{script}"] + [" --against CHECKOUT"] * bool(getattr(args, "against", None))
    parts += [f" --{k.replace('_', '-')} {getattr(args, k)}" for k in options if getattr(args, k) != parser.get_default(k)]
    if args.out != default_out:
        out = args.out.resolve()
        parts.append(f" --out {out.relative_to(repo) if out.is_relative_to(repo) else out}")
    return "".join(parts)


def json_beside(checkout: str | Path, argv: Sequence[str]) -> Any:
    """The JSON on the last line a child Python (``argv`` after the interpreter) prints while it
    imports ``checkout``'s package instead of ours: how a measuring script times an earlier
    commit's engine beside this one. A failed child's error is raised with its last lines."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(checkout) / "src"))
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise LyannaError(f"a child importing {checkout}'s package failed (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


Runner = Callable[[list[int], int], GenerationResult]


def split_budget(spec: str, default: int | str) -> tuple[str, int | str]:
    """``lyanna@8`` -> (lyanna, 8); ``lyanna`` -> (lyanna, default)."""
    from ..decoding.budget import parse_budget

    method, _, budget = spec.partition("@")
    return method, parse_budget(budget) if budget else default


def make_runners(decoder: Decoder, methods: Sequence[str], sampling: SamplingParams, budget: int | str = "auto",
                 fallback: bool = False, peers: Mapping[str, Peer] | None = None) -> dict[str, Runner]:
    """One runner per method spec; a spec ``METHOD@N`` (or ``@auto``) fixes the tree budget. Peer
    methods (the built-in ones, and ``peers``: more by name, as a test's stand-in) each run in a
    child process (``peers.py``): close the runners with :func:`close_runners`."""
    ours: dict[str, Runner] = {}
    planned: dict[str, Peer] = {}
    for spec in methods:
        m, b = split_budget(spec, budget)
        if "@" in spec and (m not in decoder.drafters):
            raise LyannaError(f"{spec}: only speculative methods take a tree budget")
        if m in PEER_METHODS or (peers and m in peers):
            if not sampling.greedy:
                raise LyannaError(f"method {m} is benchmarked greedy only (temperature 0)")
            planned[spec] = peers[m] if peers and m in peers else _builtin_peer(decoder, m)
        elif m in decoder.methods:
            ours[spec] = lambda ids, n, m=m, b=b: decoder.generate(
                ids, GenerationRequest(max_new_tokens=n, sampling=sampling), method=m, budget=b, fallback=fallback)
        else:
            known = ", ".join([*PEER_METHODS, *decoder.methods])
            raise LyannaError(f"unknown method {m!r}; available: {known}")
    started = start_peers(planned, lambda ids: decoder.tokenizer.decode(ids, skip_special_tokens=True))
    return {spec: ours.get(spec) or started[spec] for spec in methods}


def _builtin_peer(decoder: Decoder, method: str) -> Peer:
    """``llamacpp*`` on the target's GGUF file; ``hf*`` where and in what dtype the target engine
    runs (a torch engine's), else fp32 on the CPU."""
    if method in LLAMACPP_METHODS:
        from .llamacpp_baseline import llamacpp_peer

        return llamacpp_peer(decoder.target, decoder.eos_token_ids, lookup=method != "llamacpp")
    from .hf_baseline import hf_peer

    engine = decoder.engine
    return hf_peer(decoder.target.path, decoder.eos_token_ids, str(getattr(engine, "device", "cpu")),
                   str(getattr(engine, "dtype", "float32")).removeprefix("torch."),
                   prompt_lookup=PLD_TOKENS if method == "hf-pld" else None)


def close_runners(runners: Mapping[str, Runner]) -> None:
    """End the peers' child processes (a runner of ours has nothing to close)."""
    for run in runners.values():
        close = getattr(run, "close", None)
        if close is not None:
            close()


def default_methods(decoder: Decoder, sampling: SamplingParams) -> list[str]:
    """Everything that can run here: the Hugging Face baselines (greedy only), ``ar``, every
    drafter the decoder has, and llama.cpp when ``llama-cpp-python`` is installed."""
    import importlib.util

    external = list(EXTERNAL_METHODS) if sampling.greedy else []
    if sampling.greedy and importlib.util.find_spec("llama_cpp") is not None:
        external.extend(LLAMACPP_METHODS)
    return [*external, *decoder.methods]


HEALTHY_TAU = 1.3
FEW_DRAFTS = 0.25  # verified draft tokens per new token below which a method mostly did not draft


def health(result: dict[str, Any]) -> list[str]:
    """Warnings for a speculative method that does not pay: tau near 1 or slower than ``ar``; for
    a peer that failed, why (its row has no numbers to judge)."""
    if result.get("failed"):
        return [f"failed: {result['failed']}"]
    notes = []
    if result["tau"] is not None and result["draft_tokens"] and result["tau"] < HEALTHY_TAU:
        # Few drafts for many tokens: the budget (or the fallback) stopped drafting, tau says nothing of acceptance.
        few = result["draft_tokens"] < FEW_DRAFTS * result.get("new_tokens", 0)
        why = ("it drafted on few rounds: its trees did not pay for their drafting time here" if few
               else "its drafts are rarely accepted here")
        notes.append(f"tau {result['tau']:.2f} is near 1: {why}")
    if result["speedup"] is not None and result["method"] != "ar" and result["speedup"] < 1.0:
        hint = (" (use method ar; the budget and the fallback stop drafting that does not pay, but their probes "
                "still cost)" if result["draft_tokens"] else "")
        notes.append(f"{result['speedup']:.2f}x ar: slower than plain decoding on this machine{hint}")
    return notes


def _aggregate(results: list[GenerationResult]) -> dict[str, Any]:
    tokens = sum(r.new_tokens for r in results)
    seconds = sum(r.seconds for r in results)
    decode_s = sum(r.seconds - r.prefill_seconds for r in results)
    passes = sum(r.target_passes for r in results)
    drafted = sum(r.draft_tokens for r in results)
    by_depth: dict[int, list[int]] = {}
    for r in results:
        for d, (acc, tried) in r.extra.get("accepted_by_depth", {}).items():
            cell = by_depth.setdefault(int(d), [0, 0])
            cell[0] += acc
            cell[1] += tried
    split = {k: round(sum(r.extra.get(f"{k}_seconds", 0.0) for r in results), 3) for k in ("draft", "verify", "other")}
    by_size: dict[int, list[float]] = {}
    for r in results:
        for n, (count, committed, secs) in r.extra.get("rounds_by_size", {}).items():
            cell = by_size.setdefault(int(n), [0, 0, 0.0])
            cell[0], cell[1], cell[2] = cell[0] + count, cell[1] + committed, cell[2] + secs
    return {
        "new_tokens": tokens,
        "seconds": round(seconds, 3),
        "prefill_seconds": round(sum(r.prefill_seconds for r in results), 3),
        "time_split": split if any(split.values()) else None,
        "acceptance_by_depth": {str(d): round(a / t, 4) for d, (a, t) in sorted(by_depth.items()) if t} or None,
        "rounds_by_size": _by_size(by_size),
        "recovered_tokens": sum(r.extra.get("recovered_tokens", 0) for r in results) if any("recovered_tokens" in r.extra for r in results) else None,
        "draft_passes_per_token": round(sum(r.extra.get("draft_passes", 0) for r in results) / tokens, 4)
        if tokens and any("draft_passes" in r.extra for r in results) else None,
        "tokens_per_s": round(tokens / seconds, 3) if seconds else None,
        "decode_tokens_per_s": round(sum(max(r.new_tokens - 1, 0) for r in results) / decode_s, 3) if decode_s > 0 else None,
        "tau": round(tokens / passes, 4) if passes and all(r.target_passes for r in results) else None,
        "draft_tokens": drafted,
        "fell_back": sum("fell_back_after_tokens" in r.extra for r in results),
        # shapes met for the first time inside timed runs: on a GPU each compiled and captured in the clock
        "first_runs": sum(r.extra.get("first_runs", 0) for r in results),
        "waste_ratio": round(1 - sum(r.accepted_draft_tokens for r in results) / drafted, 4) if drafted else None,
    }


def _by_size(cells: dict[int, list[float]]) -> dict[str, dict[str, float]] | None:
    """Per draft nodes verified a round (0: plain rounds): the share of rounds and the tokens a
    second those rounds committed (their own seconds, from drafting to the next round)."""
    total = sum(c[0] for c in cells.values())
    if not total:
        return None
    return {str(n): {"rounds": int(c[0]), "share": round(c[0] / total, 4),
                     "tokens_per_s": round(c[1] / c[2], 1) if c[2] > 0 else None} for n, c in sorted(cells.items())}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first new token where two greedy outputs differ (None: equal), which
    says whether a bfloat16 run drifted from ``ar`` at a near-tie late or went wrong early."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _method_row(method: str, rs: list[GenerationResult], greedy_ar: list[GenerationResult] | None,
                ar: list[GenerationResult] | None, questions: Sequence[Question]) -> dict[str, Any]:
    """One method's report row: totals, speedup over ``ar`` overall and per category, and per
    question; ``greedy_ar`` (``ar``'s results when decoding is greedy) decides ``equal_to_ar``."""
    ar_total = _aggregate(ar) if ar else None
    agg = _aggregate(rs)
    speedup = round(agg["tokens_per_s"] / ar_total["tokens_per_s"], 3) if ar_total and agg["tokens_per_s"] else None
    cats: dict[str, dict[str, Any]] = {}
    for cat in dict.fromkeys(q.category for q in questions):
        idx = [i for i, q in enumerate(questions) if q.category == cat]
        c = _aggregate([rs[i] for i in idx])
        ca = _aggregate([ar[i] for i in idx]) if ar else None
        cats[cat] = {
            "tokens_per_s": c["tokens_per_s"],
            "speedup": round(c["tokens_per_s"] / ca["tokens_per_s"], 3) if ca and ca["tokens_per_s"] else None,
        }
    row = {
        "method": method,
        **agg,
        "speedup": speedup,
        "equal_to_ar": all(r.tokens == a.tokens for r, a in zip(rs, greedy_ar)) if greedy_ar else None,
        "per_category": cats,
        "per_question": [
            {"question_id": q.question_id, "category": q.category, "new_tokens": r.new_tokens,
             "seconds": round(r.seconds, 4), "prefill_seconds": round(r.prefill_seconds, 4),
             "equal_to_ar": (r.tokens == greedy_ar[i].tokens) if greedy_ar else None,
             "first_difference": _first_difference(r.tokens, greedy_ar[i].tokens) if greedy_ar else None}
            for i, (q, r) in enumerate(zip(questions, rs))
        ],
    }
    row["health"] = health(row)
    return row


def _failed_row(method: str, failure: PeerFailed, rs: list[GenerationResult], questions: Sequence[Question]) -> dict[str, Any]:
    """The row of a peer whose child died: the same keys as any row, so that readers of the JSON
    and the table need no special case, with every aggregate None (over fewer questions than the
    others ran, they would not compare), ``failed`` (why) and the questions it finished."""
    row: dict[str, Any] = {"method": method, "failed": str(failure), "failed_signal": failure.signal,
                           "questions_done": len(rs)}
    row.update(dict.fromkeys([*_aggregate([]), "speedup", "equal_to_ar"]))  # every aggregate a row has
    row["per_category"] = {c: {"tokens_per_s": None, "speedup": None} for c in dict.fromkeys(q.category for q in questions)}
    row["per_question"] = [{"question_id": q.question_id, "category": q.category, "new_tokens": r.new_tokens,
                            "seconds": round(r.seconds, 4), "prefill_seconds": round(r.prefill_seconds, 4)}
                           for q, r in zip(questions, rs)]
    row["health"] = health(row)
    return row


def _interleave(runners: Mapping[str, Runner], prompts: list[list[int]], max_new_tokens: int, repeats: int,
                deadline: float | None, progress: bool,
                warm_each: bool = False) -> tuple[dict[str, list[GenerationResult]], dict[str, PeerFailed], int]:
    """Each method's fastest run on each prompt, the failure of each peer that died (it runs no
    more; the prompt it died on is dropped from its results) and how many prompts ran.
    ``warm_each``: our methods run each prompt once untimed first. An engine whose new shapes
    compile or capture (``DeviceEngine.shapes_compile``) meets them on any prompt (a longer
    prompt's prefill, a larger key range): on a GPU such a first run cost seconds where a reply
    takes a fifth of one, inside whichever method met the shape first."""
    from tqdm import tqdm

    per_method: dict[str, list[GenerationResult]] = {m: [] for m in runners}
    failed: dict[str, PeerFailed] = {}
    peer = {m: m.split("@")[0] in PEER_METHODS for m in runners}

    def attempt(m: str, run: Runner, ids: list[int], n: int) -> GenerationResult | None:
        if m in failed:
            return None
        try:
            return run(ids, n)
        except PeerFailed as e:
            failed[m] = e
            return None

    for m, run in runners.items():
        # Warm-up: first-call allocations and lazy imports, and for our methods a whole reply, so
        # that the shapes a reply reaches (longer key ranges, tree sizes) are compiled and captured
        # before the clock runs (on a GPU each costs more than a prompt's decoding); a peer's few tokens.
        attempt(m, run, prompts[0], min(8, max_new_tokens) if peer[m] else max_new_tokens)
    bar = tqdm(total=len(prompts) * len(runners) * repeats, desc="bench", unit="run", disable=not progress)
    order, turn, done = list(runners.items()), 0, 0
    for ids in prompts:
        if deadline is not None and done and time.perf_counter() > deadline:
            break
        runs: dict[str, list[GenerationResult]] = {m: [] for m in runners}
        for m, run in order if warm_each else ():
            if not peer[m]:
                attempt(m, run, ids, max_new_tokens)
        for _ in range(repeats):
            # Each turn starts at the next method, so that no method always runs first (or last)
            # on a prompt: the position in the sequence must not favour anyone.
            first, turn = turn % len(order), turn + 1
            for m, run in order[first:] + order[:first]:
                result = attempt(m, run, ids, max_new_tokens)
                if result is not None:
                    runs[m].append(result)
                bar.update(1)
        for m, rs in runs.items():
            if m not in failed:
                per_method[m].append(min(rs, key=lambda r: r.seconds))
        done += 1
    bar.close()
    return per_method, failed, done


def _check_options(methods: Sequence[str], max_new_tokens: int, repeats: int, sampling: SamplingParams) -> None:
    """The bench's options, checked before any model loads or child process starts."""
    if not methods:
        raise LyannaError("give at least one method")
    if max_new_tokens < 1:
        raise LyannaError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if repeats < 1:
        raise LyannaError(f"--repeats must be >= 1, got {repeats}")
    if repeats > 1 and not sampling.greedy:
        raise LyannaError("--repeats keeps the fastest of identical runs: greedy decoding only (temperature 0)")


def run_bench(
    decoder: Decoder,
    methods: Sequence[str],
    questions: Sequence[Question],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    settings: dict[str, Any] | None = None,
    progress: bool = True,
    budget: int | str = "auto",
    fallback: bool = False,
    repeats: int = 1,
    time_limit: float | None = None,
    peers: Mapping[str, Peer] | None = None,
) -> dict[str, Any]:
    """Run every method on every question and return the JSON-ready report. ``repeats`` > 1
    (greedy only) runs each question that many times per method, interleaved, and keeps each
    method's fastest run: its tokens are the same every time, and noise on a shared host only
    ever adds time, so the fastest run is the one a burst of load from elsewhere missed.
    ``time_limit`` (seconds from the call, warm-up included) starts no new prompt once passed, so a
    bench fits a lent machine's slot; every method still runs the same prompts. A peer whose child
    process dies (``peers``: more peer methods by name) gets a row that says it failed and why; the
    other methods run on, and their rows are whole."""
    started = time.perf_counter()
    _check_options(methods, max_new_tokens, repeats, sampling)
    runners = make_runners(decoder, methods, sampling, budget, fallback, peers)
    try:
        prompts = [decoder.encode(q.prompt) for q in questions]
        deadline = None if time_limit is None else started + time_limit
        warm_each = shapes_compile(decoder.engine)
        per_method, failed, done = _interleave(runners, prompts, max_new_tokens, repeats, deadline, progress, warm_each)
    finally:
        close_runners(runners)
    questions = questions[:done]
    ar = per_method.get("ar")
    results = [_failed_row(m, failed[m], per_method[m], questions) if m in failed
               else _method_row(m, per_method[m], ar if sampling.greedy else None, ar, questions) for m in methods]
    return {
        "model": decoder.target.name,
        "engine": decoder.engine.name,
        "kernel": getattr(decoder.engine, "kernel", decoder.engine.name),
        "kv_cache": getattr(decoder.engine, "kv_cache", None),
        "memory": memory_info(decoder),
        "machine": machine_info(),
        "settings": {
            "methods": list(methods),
            "questions": len(questions),
            "time_limit": time_limit,
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "budget": budget,
            "fallback": fallback,
            "repeats": repeats,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(settings or {}),
        },
        "results": results,
    }


def memory_info(decoder: Decoder) -> dict[str, float]:
    """The target's weights as the engine holds them and this process's peak resident memory, MiB
    (the peers' child processes, with their own copies of the model, are not counted)."""
    import resource

    weights = sum(int(w.nbytes) for w in decoder.target.weights.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return {"target_weights_mb": round(weights / 2**20, 1), "peak_rss_mb": round(peak, 1)}


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the aggregate results."""
    def fmt(v: Any, spec: str = ".2f") -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return format(v, spec) if isinstance(v, float) else str(v)

    lines = [
        "| method | new tokens | seconds | tokens/s | decode tokens/s | speedup | tau | waste | equal to ar |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r.get("failed"):  # why goes to the warnings; the table says which signal
            what = f"failed: {r['failed_signal']}" if r.get("failed_signal") else "failed"
            lines.append(f"| {r['method']} | {what} |" + " - |" * 7)
            continue
        lines.append(
            f"| {r['method']} | {r['new_tokens']} | {fmt(r['seconds'])} | {fmt(r['tokens_per_s'])} | "
            f"{fmt(r['decode_tokens_per_s'])} | {fmt(r['speedup'], '.3f')} | {fmt(r['tau'])} | "
            f"{fmt(r['waste_ratio'])} | {fmt(r['equal_to_ar'])} |"
        )
    return "\n".join(lines)
