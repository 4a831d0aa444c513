"""The ``lyanna`` command line: generate, bench, demo."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .engines.loading import DEFAULT_MODEL, WEIGHT_FORMATS
from .errors import LyannaError

DEMO_PROMPT = "Explain in a few sentences why the sky is blue."
# Prompt positions a served prefill takes per pass: a pass of 128 rows costs ~0.6 s on two cores
# with the default GGUF, so the sequences decoding beside a long prompt still get a token about
# twice a second, while a row in a 128-row block costs what it costs in a whole prompt's block.
DEFAULT_PREFILL_CHUNK = 128


def _int_at_least(minimum: int, what: str):
    """An argparse type for integers >= ``minimum``, with a clear message otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _positive_seconds(text: str) -> float:
    """An argparse type for a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off")
    p.add_argument("--seed", type=_non_negative_int, default=None, help="an integer >= 0 (as numpy needs)")


def _budget(text: str):
    from .decoding.budget import parse_budget

    try:
        return parse_budget(text)
    except LyannaError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=_budget, default="auto",
                   help="draft nodes verified per round: 'auto' (default; from this machine's latency, see "
                        "lyanna calibrate) or a number; in bench, METHOD@N overrides it per method")
    _fallback_arg(p)


def _fallback_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="pause drafting while a stretch of rounds commits tokens more slowly than ar would, "
                        "and probe again later (default on)")


def _known_methods() -> str:
    """Every method name ``bench`` knows: the peers, ``ar`` and every registered drafter's."""
    from .drafters.registry import method_names
    from .measure.bench import PEER_METHODS

    return ", ".join([*PEER_METHODS, *method_names()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lyanna", description="Fast, lossless LLM decoding by hidden-state speculative decoding.")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, Hugging Face model directory or .gguf file (default {DEFAULT_MODEL})")
    parser.add_argument("--draft", action="append", default=[], metavar="DIR",
                        help="draft-head checkpoint to load; its method (e.g. eagle) becomes available (repeatable)")
    parser.add_argument("--backend", choices=("numpy", "torch", "hf"), default="numpy",
                        help="what computes the target: our numpy engine (default, the faster one on a CPU), our "
                             "PyTorch forward with a static KV cache on any device (torch), or the Hugging Face "
                             "model in PyTorch (hf)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="numpy backend: gguf computes on a GGUF target's quantized blocks with 8-bit inputs "
                             "and integer dot products (the fastest); gguf-float on the same blocks with fp32 inputs; "
                             "fp32 streams the weights dequantized; auto (default): gguf for a GGUF target, else fp32")
    parser.add_argument("--device", default=None, help="torch and hf backends: cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="torch and hf backends: the model's dtype (default float32; greedy output equals ar only "
                             "in float32)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="torch backend on CUDA: run decoding blocks eagerly instead of replaying captured CUDA "
                             "graphs (the same tokens, slower; for comparison)")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="torch backend on CUDA: read every round's outcome before launching the next (by "
                             "default a round whose tree the pass verifies on the device is followed there by the "
                             "next one while the host reads it; the same greedy tokens, for comparison)")
    parser.add_argument("--batch-rows", type=int, default=0, metavar="N",
                        help="torch backend: N sequences' caches (of up to 4096 positions, or the model's context if "
                             "shorter) as rows of one tensor, so that a batch's decoding steps (serve, loadtest) run "
                             "as one pass instead of one pass a sequence; the host then reads each step (default 0: off)")
    parser.add_argument("--compile", choices=("auto", "yes", "no", "whole"), default="auto",
                        help="torch backend: each layer's norms, RoPE, residuals and SiLU-mul through torch.compile "
                             "(fewer, fused kernels; the same tokens; compiles for a while on first use); auto "
                             "(default): on CUDA; whole: each layer as one compiled function, its attention inside")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt (streamed)")
    g.add_argument("prompt")
    g.add_argument("--method", default=None, help="decoding method (default: the model's default method, "
                   "the fastest lossless one measured on its default engine)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")
    _budget_args(g)
    _sampling_args(g)

    b = sub.add_parser("bench", help="benchmark methods on the same prompts in one process")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated, from {_known_methods()} (a head's methods need its checkpoint: shipped, or "
                        "--draft); METHOD@N fixes a tree budget (default: every method available here)")
    b.add_argument("--questions", default=None, help="MT-bench-format JSONL (default: the Spec-Bench questions shipped in the package)")
    b.add_argument("--limit", type=_positive_int, default=None, help="take N questions round-robin across categories")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128)
    b.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the report as JSON to OUT")
    b.add_argument("--repeats", type=_positive_int, default=1,
                   help="run each question N times per method, interleaved, and keep the fastest run (greedy only; "
                        "for a shared host, whose bursts of load would otherwise land on one method's runs)")
    b.add_argument("--time-limit", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="start no new prompt once this many seconds have passed; the report covers the "
                        "prompts every method finished (for runs that must end inside a slot)")
    b.add_argument("--no-progress", action="store_true")
    _budget_args(b)
    _sampling_args(b)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default loopback only; any other needs an API key or "
                         "--allow-unauthenticated)")
    sv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every /v1 route and /metrics (repeat for several "
                         "keys; LYANNA_API_KEY adds one, and keeps it out of the process list)")
    sv.add_argument("--api-key-file", default=None, metavar="FILE",
                    help="accepted keys, one a line ('#' comments), read again whenever the file changes")
    sv.add_argument("--allow-unauthenticated", action="store_true",
                    help="serve a non-loopback address without a key (only behind a proxy that checks callers)")
    sv.add_argument("--metrics-open", action="store_true", help="serve /metrics without a key (for a scraper)")
    sv.add_argument("--port", type=_int_at_least(1, "a port number"), default=8000)
    sv.add_argument("--method", default="ar", help="default decoding method (requests may pick another with lyanna_method)")
    sv.add_argument("--queue-size", type=_positive_int, default=16, help="requests queued or running before 429")
    sv.add_argument("--max-batch", type=_positive_int, default=None,
                    help="requests that share each forward pass (continuous batching; default 8, see BENCHMARKS.md)")
    sv.add_argument("--request-timeout", type=_positive_seconds, default=300.0, help="seconds before a request is cancelled (504)")
    sv.add_argument("--max-body-bytes", type=_positive_int, default=None,
                    help="largest request body accepted, 413 beyond it (default 2 MiB)")
    sv.add_argument("--prefix-cache-tokens", type=_non_negative_int, default=4096,
                    help="prompt positions kept so that a prompt sharing a prefix with a recent one prefills only "
                         "the rest (about 50 KB each on the default model; 0: off; GGUF weights only, where it is exact)")
    sv.add_argument("--prefill-chunk", type=_non_negative_int, default=DEFAULT_PREFILL_CHUNK,
                    help="prompt positions prefilled per forward pass, so that a long prompt does not stall the "
                         f"requests decoding beside it (default {DEFAULT_PREFILL_CHUNK}; 0: whole prompts; GGUF weights only)")

    lt = sub.add_parser("loadtest", help="bounded load test of a running server (loopback only)")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--requests", type=_positive_int, default=100)
    lt.add_argument("--concurrency", type=_positive_int, default=8)
    lt.add_argument("--max-tokens", type=_positive_int, default=64)
    lt.add_argument("--questions", default=None, help="MT-bench-format JSONL for prompts (default Spec-Bench)")
    lt.add_argument("--method", default=None, help="decoding method to ask for (default: the server's)")
    lt.add_argument("--api-key", default=None, metavar="KEY", help="the server's API key (default: LYANNA_API_KEY)")
    lt.add_argument("--json", dest="json_out", default=None, metavar="OUT")

    cb = sub.add_parser("calibrate", help="measure target latency against tree size on this machine (cached)")
    cb.add_argument("--force", action="store_true", help="measure again even when a calibration is cached")

    rp = sub.add_parser("report", help="turn bench JSON files into BENCHMARKS.md with figures")
    rp.add_argument("bench_json", nargs="+", help="bench JSON files (with --scaling: fit state.json files)")
    rp.add_argument("--out", default="BENCHMARKS.md")
    rp.add_argument("--scaling", default=None, metavar="PNG",
                    help="instead: a data-scaling figure of held-out agreement from `lyanna train fit` state files")

    sub.add_parser("train", help="draft training pipeline: lyanna train {prompts,data,merge,features,select,fit,export} ...")

    dm = sub.add_parser("demo", help="a reply by the default method, then its speed against ar on Spec-Bench questions "
                                     "(make run)")
    _fallback_arg(dm)
    return parser


def _sampling(args: argparse.Namespace):
    from .decoding.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def _generate(args: argparse.Namespace) -> None:
    from .decoding.decoder import GenerationRequest

    request = GenerationRequest(max_new_tokens=args.max_new_tokens, sampling=_sampling(args), stop=tuple(args.stop))
    decoder = _decoder(args)
    ids = decoder.encode(args.prompt, chat=not args.no_chat)
    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = decoder.generate(ids, request, method=args.method or decoder.default_method, on_text=stream,
                              budget=args.budget,
                              fallback=args.fallback)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print()
    print(_stats_line(result), file=sys.stderr)


def decoder_from_options(options: Sequence[str]):
    """A ``Decoder`` built from ``lyanna``'s engine options (``--model``, ``--backend``,
    ``--device``, ``--dtype``, ...), read as ``lyanna`` reads them: for a script that takes them
    beside its own."""
    return _decoder(build_parser().parse_args([*options, "bench"]))


def _decoder(args: argparse.Namespace):
    from .decoding.decoder import Decoder
    from .engines.loading import load_target

    cache_tokens = getattr(args, "prefix_cache_tokens", 0)  # the server's options
    chunk = getattr(args, "prefill_chunk", 0)
    if args.backend != "numpy" and args.weights.startswith("gguf"):
        raise LyannaError(f"--weights {args.weights} is a numpy-backend engine: drop --backend {args.backend} or --weights")
    if args.backend != "numpy":
        from .engines.device import load_device_target
        from .engines.torch_engine import load_torch_target

        if args.backend == "torch":
            target, engine = load_device_target(args.model, args.device or "cpu", args.dtype or "float32",
                                                graphs=False if args.no_cuda_graphs else None,
                                                pipelines=False if args.no_pipeline else None,
                                                compiled={"auto": None, "yes": True, "no": False, "whole": True}[args.compile],
                                                batch_rows=args.batch_rows, whole_layers=args.compile == "whole")
        elif args.no_cuda_graphs or args.no_pipeline or args.compile != "auto" or args.batch_rows:
            raise LyannaError("--no-cuda-graphs, --no-pipeline, --compile and --batch-rows are options of --backend torch "
                              "(the hf backend never compiles, captures graphs, launches a round ahead or shares a pass)")
        else:
            target, engine = load_torch_target(args.model, args.device or "cpu", args.dtype or "float32")
        decoder = Decoder(target, engine=engine, prefix_cache_tokens=cache_tokens, prefill_chunk=chunk)
    elif args.device or args.dtype or args.no_cuda_graphs or args.no_pipeline or args.compile != "auto" or args.batch_rows:
        raise LyannaError("--device, --dtype, --no-cuda-graphs, --no-pipeline, --compile and --batch-rows choose how the "
                          "torch backend runs: add --backend torch")
    else:
        decoder = Decoder(load_target(args.model, weight_format=args.weights), prefix_cache_tokens=cache_tokens,
                          prefill_chunk=chunk)
    for path in args.draft:
        decoder.load_draft(path)
    return decoder


def _stats_line(result) -> str:
    decode = result.decode_tokens_per_s
    tau = "" if result.tau is None else f", tau {result.tau:.2f}"
    return (
        f"[{result.method}] {result.new_tokens} tokens in {result.seconds:.2f} s: "
        f"{result.tokens_per_s:.1f} tokens/s (decode {decode or 0:.1f}){tau}, finish: {result.finish_reason}"
    )


def _bench(args: argparse.Namespace) -> None:
    from .measure.bench import default_methods, format_table, load_questions, run_bench

    sampling = _sampling(args)
    questions = load_questions(args.questions, args.limit)
    decoder = _decoder(args)
    methods = ([m.strip() for m in args.methods.split(",") if m.strip()] if args.methods
               else default_methods(decoder, sampling))
    report = run_bench(
        decoder, methods, questions, args.max_new_tokens, sampling,
        settings={"questions_file": str(args.questions or "spec_bench_question.jsonl"), "limit": args.limit,
                  "command": "lyanna " + shlex.join(args.argv)},
        progress=not args.no_progress,
        budget=args.budget,
        fallback=args.fallback,
        repeats=args.repeats,
        time_limit=args.time_limit,
    )
    print(format_table(report))
    for row in report["results"]:
        for note in row["health"]:
            print(f"warning: {row['method']}: {note}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_out}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> None:
    from .serving.auth import ApiKeys, check_exposure
    from .serving.body import DEFAULT_MAX_BODY_BYTES
    from .serving.server import serve
    from .serving.worker import DEFAULT_MAX_BATCH

    keys = ApiKeys.configure(args.api_key, args.api_key_file)
    check_exposure(args.host, keys, args.allow_unauthenticated)  # before the model loads: a mistake fails at once
    serve(_decoder(args), args.host, args.port, args.method, args.queue_size, args.request_timeout,
          args.max_body_bytes or DEFAULT_MAX_BODY_BYTES, args.max_batch or DEFAULT_MAX_BATCH, keys=keys,
          metrics_open=args.metrics_open)


def _loadtest(args: argparse.Namespace) -> None:
    from .measure.bench import load_questions
    from .serving.loadtest import run_load

    prompts = [q.prompt for q in load_questions(args.questions)]
    report = run_load(args.url, prompts, args.requests, args.concurrency, args.max_tokens, method=args.method,
                      api_key=args.api_key)
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


def _calibrate(args: argparse.Namespace) -> None:
    from .decoding.budget import calibration_path

    decoder = _decoder(args)
    curve = decoder.latency_curve(recalibrate=args.force)
    print(f"model {curve.model} on {curve.machine}, {curve.context} tokens of context, measured {curve.date}")
    kv = getattr(decoder.engine, "kv_cache", None)
    print(f"engine {decoder.engine.name}, kernel {getattr(decoder.engine, 'kernel', decoder.engine.name)}"
          + (f", {kv} key/value cache" if kv else ""))
    print("| block tokens | ms | x one-token step |\n|---|---|---|")
    for n, t in zip(curve.sizes, curve.seconds):
        print(f"| {n} | {t * 1e3:.1f} | {t / curve.seconds[0]:.2f} |")
    print(f"cached in {calibration_path(decoder.target.name, decoder.engine)}")


def _report(args: argparse.Namespace) -> None:
    from .measure.report import scaling_figure, write_report

    if args.scaling:
        print(f"wrote {scaling_figure(args.bench_json, args.scaling)}")
        return
    print(f"wrote {write_report(args.bench_json, args.out)}")


DEMO_NEW_TOKENS = 64  # per question: 13 questions x 64 tokens for each method, a minute or two on two cores
# Each method runs each question this many times and keeps its fastest run (``bench --repeats``):
# with one run, a burst of load elsewhere on a shared host moved the printed ratios by a tenth
# between fresh clones (`suffix` 1.00x then 0.93x ar in two CI runs an hour apart, no decoding
# code changed between them).
DEMO_REPEATS = 2


def _demo_questions(decoder, new_tokens: int) -> list:
    """The first Spec-Bench question of each category whose prompt leaves room for ``new_tokens``
    in the model's context window."""
    from .measure.bench import load_questions

    room = decoder.target.config.max_position_embeddings - new_tokens
    chosen: dict[str, object] = {}
    for q in load_questions():
        if q.category not in chosen and len(decoder.encode(q.prompt)) <= room:
            chosen[q.category] = q
    return list(chosen.values())


def _demo(args: argparse.Namespace) -> None:
    """The product's point in one screen: a streamed reply by the default method, then the default
    method, ``lyanna`` and plain decoding (``ar``) on the same Spec-Bench questions, one of each
    category: their speed, tokens per target pass, and whether every output equals ``ar``'s."""
    from .decoding.decoder import GenerationRequest
    from .measure.bench import format_table, run_bench

    decoder = _decoder(args)
    method = decoder.default_method
    print(f"model: {args.model} (engine: {decoder.engine.name})\nprompt: {DEMO_PROMPT}\n")
    ids = decoder.encode(DEMO_PROMPT)
    decoder.generate(ids, GenerationRequest(max_new_tokens=8), method=method)  # warm the kernels and caches
    reply = decoder.generate(ids, GenerationRequest(max_new_tokens=128), method=method, fallback=args.fallback,
                             on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    print(f"\n\n{_stats_line(reply)}\n")
    methods = list(dict.fromkeys(["ar", method, *(["lyanna"] if "lyanna" in decoder.methods else [])]))
    questions = _demo_questions(decoder, DEMO_NEW_TOKENS)
    print(f"{', '.join(methods)} on {len(questions)} Spec-Bench questions (one per category), "
          f"{DEMO_NEW_TOKENS} new tokens each, the fastest of {DEMO_REPEATS} runs:")
    report = run_bench(decoder, methods, questions, DEMO_NEW_TOKENS, progress=False, fallback=args.fallback,
                       repeats=DEMO_REPEATS)
    print(format_table(report) + "\n")
    rows = {r["method"]: r for r in report["results"]}
    for m in methods[1:]:
        r = rows[m]
        same = ("every output token-identical to ar" if r["equal_to_ar"]
                else "outputs DIFFERENT from ar (a bug: please report it)")
        role = "the default method" if m == method else "Lyanna's hidden-state drafter"
        print(f"{m} ({role}): {r['speedup']:.2f}x ar over these questions, tau {r['tau']:.2f} tokens per "
              f"target pass, {same}")
    if "lyanna" not in decoder.methods:
        print("(no Lyanna draft head for this model: train one with `lyanna train`)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser, shared with `python -m lyanna.train` (torchrun)
        from .train import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        {"generate": _generate, "bench": _bench, "serve": _serve, "loadtest": _loadtest, "report": _report, "demo": _demo,
         "calibrate": _calibrate}[args.command](args)
    except LyannaError as e:
        print(f"lyanna: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lyanna: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
