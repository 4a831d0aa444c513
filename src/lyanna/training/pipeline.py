"""``lyanna train``: data -> features -> select -> fit -> export, each stage resumable.

A run directory holds everything:
  run.json                      model and settings of the run
  data/shard-*.jsonl            self-distilled replies: {"id", "prompt_ids", "output_ids"}
  features/shard-*.safetensors  fp16 target features (final-norm tap) per example
  select/<name>.json            the example ids a selection keeps
  fit/<arch>/state.safetensors  head and optimizer state (+ state.json: step, history)
Stages skip work already on disk, so a stopped run continues where it stopped.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import LyannaError

SHARD_EXAMPLES = 256


def _progress(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="ex", dynamic_ncols=True, disable=os.environ.get("LYANNA_NO_PROGRESS") == "1")


def _run_info(run: Path) -> dict[str, Any]:
    f = run / "run.json"
    if not f.is_file():
        raise LyannaError(f"{run} is not a training run (no run.json): start with `lyanna train data --run {run}`")
    return json.loads(f.read_text())


def benchmark_prompts(data_dir: Path) -> set[str]:
    """Normalized first turns of the benchmark sets, which must never be trained on."""
    seen: set[str] = set()
    for name in ("spec_bench_question.jsonl", "mt_bench_question.jsonl"):
        f = data_dir / name
        if f.is_file():
            for line in f.read_text().splitlines():
                if line.strip():
                    for turn in json.loads(line).get("turns", []):
                        seen.add(" ".join(str(turn).split()).lower())
    return seen


def read_prompts(path: Path, limit: int | None, seed: int, exclude: set[str]) -> list[dict[str, str]]:
    """Training prompts in a seeded random order, benchmark questions removed."""
    if not path.is_file():
        raise LyannaError(f"training prompts {path} not found")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, pid = str(row["prompt"]), str(row.get("id", lineno))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LyannaError(f"{path}:{lineno}: need a JSON object with 'prompt' ({e})") from None
        if " ".join(prompt.split()).lower() not in exclude:
            rows.append({"id": pid, "prompt": prompt})
    order = np.random.default_rng(seed).permutation(len(rows))
    rows = [rows[i] for i in order]
    return rows[:limit] if limit else rows


def iter_data(run: Path) -> Iterator[dict[str, Any]]:
    for shard in sorted((run / "data").glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def stage_data(run: Path, model: str, prompts_file: Path, data_dir: Path, limit: int | None, max_new_tokens: int,
               max_prompt_tokens: int, seed: int) -> int:
    """Self-distillation: the target answers training prompts greedily with its chat template."""
    from ..decoding import Decoder, GenerationRequest
    from ..loading import load_target

    run.mkdir(parents=True, exist_ok=True)
    info_file = run / "run.json"
    info = {"model": model, "seed": seed, "prompts": str(prompts_file), "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens}
    if info_file.is_file():
        old = json.loads(info_file.read_text())
        if old.get("model") != model:
            raise LyannaError(f"{run} was made for model {old.get('model')!r}, not {model!r}: use another --run")
    info_file.write_text(json.dumps(info, indent=2))
    prompts = read_prompts(prompts_file, limit, seed, benchmark_prompts(data_dir))
    done = {row["id"] for row in iter_data(run)}
    todo = [p for p in prompts if p["id"] not in done]
    decoder = Decoder(load_target(model))
    (run / "data").mkdir(exist_ok=True)
    shard_idx = len(list((run / "data").glob("shard-*.jsonl")))
    bar = _progress(len(prompts), "data (self-distillation)", len(prompts) - len(todo))
    buffer: list[str] = []
    for i, p in enumerate(todo):
        ids = decoder.encode(p["prompt"])[:max_prompt_tokens]
        out = decoder.generate(ids, GenerationRequest(max_new_tokens=max_new_tokens))
        buffer.append(json.dumps({"id": p["id"], "prompt_ids": ids, "output_ids": out.tokens}))
        bar.update(1)
        if len(buffer) == SHARD_EXAMPLES or i == len(todo) - 1:
            tmp = run / "data" / f".shard-{shard_idx:05d}.tmp"
            tmp.write_text("\n".join(buffer) + "\n")
            os.replace(tmp, run / "data" / f"shard-{shard_idx:05d}.jsonl")  # a shard appears whole or not at all
            shard_idx += 1
            buffer = []
    bar.close()
    return len(prompts)


def stage_features(run: Path) -> int:
    """Target features (final-norm tap) of every example, fp16 safetensors shards."""
    from safetensors.numpy import save_file

    from ..engine import Transformer
    from ..loading import load_target

    info = _run_info(run)
    rows = list(iter_data(run))
    if not rows:
        raise LyannaError(f"{run} has no data yet: run `lyanna train data` first")
    target = load_target(info["model"])
    engine = Transformer(target.config, target.weights)
    tap = target.config.num_layers
    n_tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows)
    print(f"features: {len(rows)} examples, {n_tokens} tokens, about {n_tokens * target.config.hidden_size * 2 / 1e6:.0f} MB fp16")
    out = run / "features"
    out.mkdir(exist_ok=True)
    shards = [rows[i:i + SHARD_EXAMPLES] for i in range(0, len(rows), SHARD_EXAMPLES)]
    done = sum(len(s) for k, s in enumerate(shards) if (out / f"shard-{k:05d}.safetensors").is_file())
    bar = _progress(len(rows), "features", done)
    for k, shard in enumerate(shards):
        path = out / f"shard-{k:05d}.safetensors"
        if path.is_file():
            continue
        tensors: dict[str, np.ndarray] = {}
        for r in shard:
            ids = np.asarray(r["prompt_ids"] + r["output_ids"], np.int64)
            fwd = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids)), logit_rows=[-1], taps=(tap,))
            tensors[f"{r['id']}/tokens"] = ids.astype(np.int32)
            tensors[f"{r['id']}/features"] = fwd.hidden[tap].astype(np.float16)
            tensors[f"{r['id']}/prompt_len"] = np.array([len(r["prompt_ids"])], np.int32)
            bar.update(1)
        save_file(tensors, str(out / f".{path.name}.tmp"), metadata={"tap": str(tap)})
        os.replace(out / f".{path.name}.tmp", path)
    bar.close()
    return len(rows)


def load_examples(run: Path, ids: set[str] | None = None):
    """(id, Example, prompt_len) for every example with features, optionally only ``ids``."""
    from safetensors.numpy import load_file

    from .fit import Example

    shards = sorted((run / "features").glob("shard-*.safetensors"))
    if not shards:
        raise LyannaError(f"{run} has no features yet: run `lyanna train features` first")
    out = []
    for shard in shards:
        t = load_file(str(shard))
        for key in sorted(k for k in t if k.endswith("/tokens")):
            eid = key[: -len("/tokens")]
            if ids is None or eid in ids:
                out.append((eid, Example(t[key].astype(np.int64), t[f"{eid}/features"].astype(np.float32)),
                            int(t[f"{eid}/prompt_len"][0])))
    return out


def flatness(features: np.ndarray, lm_head: np.ndarray, start: int) -> float:
    """Mean normalized entropy of the target's next-token distributions over the reply tokens
    (flatter distributions carry more of what a draft head must learn, per SFDD)."""
    logits = features[max(start - 1, 0):] @ lm_head.T
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    entropy = -(p * np.log(np.clip(p, 1e-30, None))).sum(-1)
    return float(entropy.mean() / math.log(lm_head.shape[0]))


def stage_select(run: Path, mode: str, keep: float, seed: int) -> Path:
    """Keep a fraction of the examples: the flattest (``flat``), a random one (``random``), or ``all``."""
    from ..loading import load_target

    if mode not in ("flat", "random", "all"):
        raise LyannaError(f"selection mode must be flat, random or all, got {mode!r}")
    if not 0 < keep <= 1:
        raise LyannaError(f"--keep must be in (0, 1], got {keep}")
    info = _run_info(run)
    examples = load_examples(run)
    ids = [eid for eid, _, _ in examples]
    if mode == "flat":
        target = load_target(info["model"])
        head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
        scores = [flatness(ex.features, head, plen) for _, ex, plen in examples]
        order = np.argsort(scores)[::-1]
    elif mode == "random":
        order = np.random.default_rng(seed).permutation(len(ids))
    else:
        order = np.arange(len(ids))
    chosen = [ids[i] for i in order[: max(1, round(keep * len(ids)))]]
    out = run / "select" / f"{mode}-{keep:g}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"mode": mode, "keep": keep, "ids": chosen}))
    print(f"select: kept {len(chosen)} of {len(ids)} examples -> {out}")
    return out
