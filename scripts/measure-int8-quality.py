"""What 8-bit inputs cost in quality: the default model on its GGUF's blocks with integer dot
products (``--weights gguf``, ``intdot``) against the same blocks with fp32 inputs
(``--weights gguf-float``) and against Hugging Face transformers in fp32 on the checkpoint; and,
where llama-cpp-python is installed, llama.cpp on the same GGUF (its own 8-bit inputs), to show
what the same choice costs there.

1. Top-1 agreement, teacher-forced: for each of Spec-Bench's first ``--limit`` questions the
   fp32-input engine's greedy reply of ``--tokens`` tokens is fixed, every engine reads prompt +
   reply in one pass, and we count the reply positions where two engines' argmax agree.
   ``gguf`` is the default engine (its key/value cache of halves, ``transformer.kv_cache_kind``);
   ``gguf-kv32`` the same with a float32 cache, ``gguf-float`` the fp32-input reference with one,
   so each change's cost shows alone.
2. Perplexity of each engine on a fixed text: the packaged MT-bench questions (every turn, in file
   order, joined by blank lines), in windows of ``WINDOW`` tokens.

Writes docs/bench/int8-quality.json. Usage: .venv/bin/python scripts/measure-int8-quality.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
from datetime import datetime, timezone

import numpy as np
from tqdm import tqdm

from lyanna.data import MT_BENCH, packaged
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.engines.intdot import PATH
from lyanna.engines.loading import DEFAULT_MODEL, load_target, source_gguf
from lyanna.engines.torch_engine import load_torch_target
from lyanna.measure.bench import load_questions, machine_info

DEFAULT_OUT = "docs/bench/int8-quality.json"
WINDOW = 512  # tokens per perplexity window: every token predicted from at least its window's start


class LlamaCppLogits:
    """llama.cpp's logits for every position of a sequence (one eval on a reset context)."""

    def __init__(self, gguf):
        import os

        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_batch=4096, n_threads=os.cpu_count(),
                                   logits_all=True, verbose=False)

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], np.float32)


def all_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits of every position of ``ids`` from one pass on a fresh cache."""
    if isinstance(engine, LlamaCppLogits):
        return engine.logits(ids)
    return engine.forward(np.asarray(ids), np.arange(len(ids)), engine.new_cache(len(ids))).logits


def nll(logits: np.ndarray, targets: list[int]) -> float:
    """Summed negative log-likelihood of ``targets`` (row i predicts targets[i]), in fp64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float((log_norm - z[np.arange(len(targets)), targets]).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=26)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    decoders = {"gguf": Decoder(load_target(DEFAULT_MODEL, weight_format="gguf"))}
    os.environ["LYANNA_KV_CACHE"] = "float32"  # read when an engine is made
    decoders["gguf-kv32"] = Decoder(load_target(DEFAULT_MODEL, weight_format="gguf"))
    decoders["gguf-float"] = Decoder(load_target(DEFAULT_MODEL, weight_format="gguf-float"))
    del os.environ["LYANNA_KV_CACHE"]
    engines = {w: d.engine for w, d in decoders.items()}
    engines["hf-fp32"] = load_torch_target(DEFAULT_MODEL)[1]
    pairs = [("gguf", "gguf-float"), ("gguf", "hf-fp32"), ("gguf-kv32", "hf-fp32"), ("gguf-float", "hf-fp32")]
    if importlib.util.find_spec("llama_cpp") is not None:
        engines["llamacpp"] = LlamaCppLogits(source_gguf(DEFAULT_MODEL))
        pairs.append(("llamacpp", "hf-fp32"))
    reference = decoders["gguf-float"]
    agree = {f"{a} vs {b}": 0 for a, b in pairs}
    positions = 0
    for q in tqdm(load_questions(limit=args.limit), desc="agreement"):
        prompt = reference.encode(q.prompt)
        reply = reference.generate(prompt, GenerationRequest(max_new_tokens=args.tokens)).tokens
        ids = prompt + list(reply)
        top = {name: all_logits(e, ids)[len(prompt) - 1 : len(ids) - 1].argmax(axis=1) for name, e in engines.items()}
        for a, b in pairs:
            agree[f"{a} vs {b}"] += int((top[a] == top[b]).sum())
        positions += len(reply)
    text = "\n\n".join(t for line in packaged(MT_BENCH).read_text(encoding="utf-8").splitlines() if line.strip()
                       for t in json.loads(line)["turns"])
    tokens = reference.tokenizer(text)["input_ids"]
    windows = [tokens[i : i + WINDOW] for i in range(0, len(tokens) - 1, WINDOW) if len(tokens[i : i + WINDOW]) > 1]
    perplexity = {}
    for name, engine in engines.items():
        total = sum(nll(all_logits(engine, w)[:-1], w[1:]) for w in tqdm(windows, desc=f"perplexity {name}"))
        perplexity[name] = round(float(np.exp(total / sum(len(w) - 1 for w in windows))), 4)
    report = {
        "command": "python scripts/measure-int8-quality.py" + ("" if args.out == DEFAULT_OUT else f" --out {args.out}"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": DEFAULT_MODEL,
        "int8_path": PATH,
        "kv_caches": {name: getattr(e, "kv_cache", "float32") for name, e in engines.items()},
        "agreement": {"questions": args.limit, "reply_tokens": args.tokens, "positions": positions,
                      "top1": {k: round(v / positions, 5) for k, v in agree.items()}},
        "perplexity": {"text": "packaged MT-bench questions, every turn", "tokens": len(tokens), "window": WINDOW,
                       **perplexity},
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report["agreement"], indent=2), json.dumps(report["perplexity"], indent=2))


if __name__ == "__main__":
    main()
