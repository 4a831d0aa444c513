"""``lyanna train``: data -> features -> select -> fit -> export, each stage resumable.

A run directory holds everything:
  run.json                      model and settings of the run
  data/shard-*.jsonl            self-distilled replies {"id", "prompt_ids", "output_ids"} or corpus
                                conversations {"id", "ids", "reply": [[start, end], ...]}
  features/shard-*.safetensors  fp16 target features (final-norm tap), tokens and reply mask per
                                example; the shard's example ids in its metadata
  select/<name>.json            the example ids a selection keeps
  fit/<arch>/state.safetensors  head and optimizer state (+ state.json: step, history)
Stages skip work already on disk, so a stopped run continues where it stopped.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import LyannaError

# The pipeline computes the target on fp32 weights: the heads' torch modules take the target's
# embedding and LM head as fp32 tensors, and the shipped heads' data and features were made so.
TRAINING_WEIGHTS = "fp32"
SHARD_EXAMPLES = 256


def _progress(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="ex", dynamic_ncols=True, disable=os.environ.get("LYANNA_NO_PROGRESS") == "1")


def _run_info(run: Path) -> dict[str, Any]:
    f = run / "run.json"
    if not f.is_file():
        raise LyannaError(f"{run} is not a training run (no run.json): start with `lyanna train data --run-dir {run}`")
    return json.loads(f.read_text())


def benchmark_prompts() -> set[str]:
    """Normalized turns of the packaged benchmark sets, which must never be trained on."""
    from ..data import BENCHMARK_FILES, packaged

    seen: set[str] = set()
    for name in BENCHMARK_FILES:
        for line in packaged(name).read_text(encoding="utf-8").split("\n"):
            if line.strip():
                for turn in json.loads(line).get("turns", []):
                    seen.add(" ".join(str(turn).split()).lower())
    return seen


def read_prompts(path: Path, limit: int | None, seed: int, exclude: set[str]) -> list[dict[str, str]]:
    """Training prompts in a seeded random order, benchmark questions removed."""
    if not path.is_file():
        raise LyannaError(f"training prompts {path} not found")
    rows = []
    for lineno, line in enumerate(path.read_text().split("\n"), 1):
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
        for line in shard.read_text().split("\n"):
            if line.strip():
                yield json.loads(line)


def _start_run(run: Path, info: dict[str, Any]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    info_file = run / "run.json"
    if info_file.is_file():
        old = json.loads(info_file.read_text())
        if old.get("model") != info["model"]:
            raise LyannaError(f"{run} was made for model {old.get('model')!r}, not {info['model']!r}: use another --run-dir")
        if old.get("source", "self-distillation") != info["source"]:
            raise LyannaError(f"{run} holds data from {old.get('source', 'self-distillation')!r}, not {info['source']!r}: "
                              "use another --run-dir")
    info_file.write_text(json.dumps(info, indent=2))
    (run / "data").mkdir(exist_ok=True)


def _write_shards(run: Path, rows: list[str], first: int) -> None:
    for k in range(0, len(rows), SHARD_EXAMPLES):
        idx = first + k // SHARD_EXAMPLES
        tmp = run / "data" / f".shard-{idx:05d}.tmp"
        tmp.write_text("\n".join(rows[k:k + SHARD_EXAMPLES]) + "\n")
        os.replace(tmp, run / "data" / f"shard-{idx:05d}.jsonl")  # a shard appears whole or not at all


def _hf_model(model_dir: Path, device: str):
    """The Hugging Face model in fp32 on ``device`` (no TF32: the same function as the engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()


def _hf_replies(model, prompts: list[list[int]], max_new_tokens: int, eos: Sequence[int],
                batch: int) -> list[tuple[list[int], np.ndarray]]:
    """Greedy replies of the Hugging Face ``model`` (on its device) to ``prompts``, ``batch``
    left-padded prompts of similar length at a time in a static cache, each reply ending at its
    first end-of-sequence token (kept, as the engine keeps it), together with the final-norm
    features of prompt + reply (fp16 [T, H]): the features stage's work comes free with the
    generation, which computes them anyway. Padded batches may break a near-tie differently
    from a reply generated alone: fine for training data, which is why the engine path stays
    the default."""
    import torch
    from transformers import StaticCache

    device = model.device
    out: list[tuple[list[int], np.ndarray]] = [([], np.zeros((0, 0), np.float16))] * len(prompts)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    stop = set(int(t) for t in eos)
    with torch.no_grad():
        for at in range(0, len(order), batch):
            chunk = order[at:at + batch]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), int(eos[0]), dtype=torch.long)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                att[r, width - len(prompts[i]):] = 1
            ids, att = ids.to(device), att.to(device)
            # a growing cache would copy itself every step; one column per step for every row
            cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            hidden = model.model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache,
                                 use_cache=True).last_hidden_state
            feats, tokens = [hidden.to(torch.float16).cpu()], []
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            stop_ids = torch.tensor(sorted(stop), device=device)
            for _ in range(max_new_tokens):
                nxt = model.lm_head(hidden[:, -1]).argmax(-1)
                tokens.append(nxt.cpu())
                done |= torch.isin(nxt, stop_ids)
                # one more pass for the feature after the newest token (the last one included)
                att = torch.cat([att, torch.ones_like(att[:, :1])], 1)
                pos = pos[:, -1:] + 1
                hidden = model.model(input_ids=nxt[:, None], attention_mask=att, position_ids=pos,
                                     past_key_values=cache, use_cache=True).last_hidden_state
                feats.append(hidden.to(torch.float16).cpu())
                if bool(done.all()):
                    break
            gen = torch.stack(tokens, 1).tolist()
            every = torch.cat(feats, 1).numpy()
            for r, i in enumerate(chunk):
                reply = []
                for t in gen[r]:
                    reply.append(int(t))
                    if t in stop:
                        break
                start = width - len(prompts[i])
                out[i] = (reply, every[r, start : width + len(reply)].copy())
    return out


def _write_features(out: Path, k: int, shard: list[dict[str, Any]], feats: list[np.ndarray], tap: int) -> None:
    """Features shard ``k``: tokens, fp16 features and assistant mask of each example, the
    shard's example ids in its metadata (how a stale shard is recognized)."""
    from safetensors.numpy import save_file

    from .corpus import reply_mask

    tensors: dict[str, np.ndarray] = {}
    for r, f in zip(shard, feats):
        ids, mask = reply_mask(r)
        if len(f) != len(ids):
            raise LyannaError(f"features of {r['id']} cover {len(f)} tokens, the example has {len(ids)}")
        tensors[f"{r['id']}/tokens"] = ids.astype(np.int32)
        tensors[f"{r['id']}/features"] = f.astype(np.float16)
        tensors[f"{r['id']}/mask"] = mask.astype(np.uint8)
    path = out / f"shard-{k:05d}.safetensors"
    out.mkdir(exist_ok=True)
    save_file(tensors, str(out / f".{path.name}.tmp"), metadata={"tap": str(tap), "ids": json.dumps([r["id"] for r in shard])})
    os.replace(out / f".{path.name}.tmp", path)


def stage_data(run: Path, model: str, prompts_file: Path, limit: int | None, max_new_tokens: int,
               max_prompt_tokens: int, seed: int, batch: int = 8, device: str | None = None) -> int:
    """Self-distillation: the target answers training prompts greedily with its chat template,
    ``batch`` replies sharing each forward pass (on this engine each is token-identical to
    generating it alone; with ``device`` the Hugging Face model generates padded batches, much
    faster for large batches)."""
    from ..decoding.decoder import Decoder, GenerationRequest
    from ..engines.loading import load_target, resolve_model

    if batch < 1:
        raise LyannaError(f"--batch must be >= 1, got {batch}")
    prompts = read_prompts(prompts_file, limit, seed, benchmark_prompts())
    if not prompts:  # checked before the run exists: an empty run would only fail later, less clearly
        raise LyannaError(f"{prompts_file} has no training prompts (empty, or every prompt is a benchmark question)")
    _start_run(run, {"model": model, "source": "self-distillation", "seed": seed, "prompts": Path(prompts_file).name,
                     "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                     "generator": f"hf-{device}" if device else "engine"})
    done = {row["id"] for row in iter_data(run)}
    todo = [p for p in prompts if p["id"] not in done]
    decoder = Decoder(load_target(model, weight_format=TRAINING_WEIGHTS))
    hf = _hf_model(resolve_model(model), device) if device else None
    shard_idx = len(list((run / "data").glob("shard-*.jsonl")))
    bar = _progress(len(prompts), "data (self-distillation)", len(prompts) - len(todo))
    request = GenerationRequest(max_new_tokens=max_new_tokens)
    started, made = time.perf_counter(), 0
    shard_started = started
    for first in range(0, len(todo), SHARD_EXAMPLES):  # one shard at a time: a shard is the unit of resumption
        rows: list[str] = []
        feats: list[np.ndarray] = []
        chunk = todo[first : first + SHARD_EXAMPLES]
        for k in range(0, len(chunk), 4 * batch):  # progress every few batches
            part = chunk[k : k + 4 * batch]
            ids = [decoder.encode(p["prompt"])[:max_prompt_tokens] for p in part]
            if device:
                got = _hf_replies(hf, ids, max_new_tokens, decoder.eos_token_ids, batch)
                replies = [reply for reply, _ in got]
                feats += [f for _, f in got]
            else:
                replies = [out.tokens for out in decoder.generate_batch(ids, request, max_batch=batch)]
            for p, pid, reply in zip(part, ids, replies):
                rows.append(json.dumps({"id": p["id"], "prompt_ids": pid, "output_ids": reply}))
            made += len(part)
            bar.update(len(part))
            bar.set_postfix(replies_per_s=f"{made / max(time.perf_counter() - started, 1e-9):.2f}", refresh=False)
        if device:  # features before data: the data shard is what marks these prompts done
            _write_features(run / "features", shard_idx, [json.loads(r) for r in rows], feats, decoder.engine.config.num_layers)
        _write_shards(run, rows, shard_idx)
        shard_idx += 1
        _add_data_seconds(run, time.perf_counter() - shard_started, device)
        shard_started = time.perf_counter()
    bar.close()
    return len(prompts)


def _add_data_seconds(run: Path, seconds: float, device: str | None) -> None:
    """Self-distillation's wall time, summed over resumed sessions (the model card's cost line)."""
    f = run / "data" / "report.json"
    report = json.loads(f.read_text()) if f.is_file() else {"seconds": 0.0}
    report["seconds"] = round(report["seconds"] + seconds, 1)
    report["device"] = f"hf-{device}, features included" if device else "engine"
    f.write_text(json.dumps(report))


def stage_corpus(run: Path, model: str, source: str, limit: int | None, reply_tokens: int | None,
                 max_tokens: int, seed: int) -> int:
    """Teacher-forcing data: conversations of a corpus (``sharegpt`` or a file) in the target's
    chat template, in a seeded order, benchmark questions removed. Written once, whole."""
    from ..engines.loading import load_tokenizer, resolve_model
    from .corpus import read_corpus, sharegpt_path

    path = sharegpt_path() if source == "sharegpt" else Path(source)
    if not path.is_file():
        raise LyannaError(f"corpus {source} not found (use sharegpt or a JSON/JSONL file)")
    _start_run(run, {"model": model, "source": source if source == "sharegpt" else path.name, "seed": seed,
                     "max_tokens": max_tokens, "limit": limit, "reply_tokens": reply_tokens})
    if list((run / "data").glob("shard-*.jsonl")):
        n = sum(1 for _ in iter_data(run))
        print(f"data: {run / 'data'} already holds {n} conversations")
        return n
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(resolve_model(model))
    rows, skipped = read_corpus(path, tokenizer, benchmark_prompts(), max_tokens, seed, limit, reply_tokens)
    if not rows:
        raise LyannaError(f"{source}: no usable conversation ({dict(skipped)})")
    _write_shards(run, [json.dumps(r) for r in rows], 0)
    report = {"conversations": len(rows), "tokens": sum(len(r["ids"]) for r in rows),
              "reply_tokens": sum(b - a for r in rows for a, b in r["reply"]), "skipped": dict(skipped),
              "seconds": round(time.perf_counter() - t0, 1)}
    (run / "data" / "report.json").write_text(json.dumps(report, indent=2))
    print(f"data: kept {report['conversations']} conversations ({report['tokens']} tokens, {report['reply_tokens']} "
          f"assistant tokens); skipped {sum(skipped.values())}: " + ", ".join(f"{v} {k}" for k, v in skipped.most_common()))
    return len(rows)


def _hf_features(model_dir: Path, seqs: list[np.ndarray], device: str):
    """Final-norm features of each sequence from the Hugging Face model itself on ``device``
    (fp32, no TF32: the same function as the engine), batched by length."""
    import torch

    model = _hf_model(model_dir, device)
    out: list[np.ndarray | None] = [None] * len(seqs)
    order = np.argsort([-len(s) for s in seqs], kind="stable")
    budget = 65536  # tokens per forward: large enough to fill a GPU, small enough for its memory
    at = 0
    with torch.no_grad():
        while at < len(order):
            width = len(seqs[order[at]])
            n = max(1, budget // max(width, 1))
            chunk = order[at:at + n]
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, :len(seqs[i])] = torch.from_numpy(seqs[i])
                att[r, :len(seqs[i])] = 1
            hidden = model.model(input_ids=ids.to(device), attention_mask=att.to(device)).last_hidden_state
            hidden = hidden.to(torch.float16).cpu().numpy()
            for r, i in enumerate(chunk):
                out[i] = hidden[r, :len(seqs[i])]
            at += len(chunk)
            yield [(int(i), out[i]) for i in chunk]


def stage_features(run: Path, device: str | None = None) -> int:
    """Target features (final-norm tap) of every example, fp16 safetensors shards: one
    teacher-forced pass per example, on this engine, or with ``device`` (``cpu``, ``cuda``)
    through the Hugging Face model in batches. A shard whose example ids no longer match the
    data (the data stage was rerun with more examples) is redone."""
    from safetensors import safe_open

    from ..engines.loading import load_target, resolve_model
    from .corpus import reply_mask
    from .fit import target_features

    info = _run_info(run)
    rows = list(iter_data(run))
    if not rows:
        raise LyannaError(f"{run} has no data yet: run `lyanna train data` first")
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    tap = target.config.num_layers
    n_tokens = sum(len(reply_mask(r)[0]) for r in rows)
    print(f"features: {len(rows)} examples, {n_tokens} tokens, about {n_tokens * target.config.hidden_size * 2 / 1e6:.0f} MB fp16")
    out = run / "features"
    out.mkdir(exist_ok=True)
    shards = [rows[i:i + SHARD_EXAMPLES] for i in range(0, len(rows), SHARD_EXAMPLES)]

    def current(k: int, shard: list) -> bool:
        path = out / f"shard-{k:05d}.safetensors"
        if not path.is_file():
            return False
        with safe_open(str(path), "np") as f:
            return (f.metadata() or {}).get("ids") == json.dumps([r["id"] for r in shard])

    todo = [k for k, shard in enumerate(shards) if not current(k, shard)]
    for stale in sorted(out.glob("shard-*.safetensors"))[len(shards):]:
        stale.unlink()  # data shrank: features of examples that are gone
    bar = _progress(n_tokens, "features", n_tokens - sum(len(reply_mask(r)[0]) for k in todo for r in shards[k]))
    bar.unit = "tok"
    engine = None if device else _engine(target)
    t0, done_tokens = time.perf_counter(), 0
    for k in todo:
        shard = shards[k]
        seqs = [reply_mask(r) for r in shard]
        feats: dict[int, np.ndarray] = {}
        if device:
            for got in _hf_features(resolve_model(info["model"]), [ids for ids, _ in seqs], device):
                for i, f in got:
                    feats[i] = f
                    bar.update(len(f))
        else:
            for i, (ids, _) in enumerate(seqs):
                feats[i] = target_features(engine, [ids], tap)[0].features.astype(np.float16)
                bar.update(len(ids))
        _write_features(out, k, shard, [feats[i] for i in range(len(shard))], tap)
        done_tokens += sum(len(ids) for ids, _ in seqs)
    bar.close()
    if done_tokens:
        rate = done_tokens / (time.perf_counter() - t0)
        print(f"features: {done_tokens} tokens at {rate:.0f} tokens/s ({device or 'engine'})")
        stats = {"tokens": done_tokens, "seconds": round(time.perf_counter() - t0, 1), "device": device or "engine"}
        (out / "report.json").write_text(json.dumps(stats))
    return len(rows)


def _engine(target):
    from ..engines.transformer import Transformer

    return Transformer(target.config, target.weights)


def load_examples(run: Path, ids: set[str] | None = None, max_reply_tokens: int | None = None):
    """(id, Example) for every example with features, optionally only ``ids``, and stopping
    once ``max_reply_tokens`` assistant tokens are loaded (so a small run need not hold a large
    corpus's features in memory)."""
    from safetensors.numpy import load_file

    from .fit import Example

    shards = sorted((run / "features").glob("shard-*.safetensors"))
    if not shards:
        raise LyannaError(f"{run} has no features yet: run `lyanna train features` first")
    out, kept = [], 0
    for shard in shards:
        if max_reply_tokens is not None and kept >= max_reply_tokens:
            break
        t = load_file(str(shard))
        for key in sorted(k for k in t if k.endswith("/tokens")):
            eid = key[: -len("/tokens")]
            if ids is None or eid in ids:
                mask = t[f"{eid}/mask"].astype(bool)
                out.append((eid, Example(t[key].astype(np.int64), t[f"{eid}/features"], mask)))
                kept += int(mask.sum())
    return out


def flatness(features: np.ndarray, lm_head, mask: np.ndarray) -> float:
    """Mean normalized entropy of the target's next-token distributions over the reply tokens
    (flatter distributions carry more of what a draft head must learn, per SFDD); ``lm_head`` is
    a numpy array, or a torch tensor on the device that computes it."""
    before = np.zeros(len(mask), bool)
    before[:-1] = mask[1:]  # the feature after token i predicts token i + 1
    if not isinstance(lm_head, np.ndarray):
        import torch

        logp = torch.log_softmax(torch.from_numpy(np.asarray(features[before], np.float32)).to(lm_head.device) @ lm_head.T, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        return float(entropy.mean() / math.log(lm_head.shape[0]))
    logits = np.asarray(features[before], np.float32) @ lm_head.T
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    entropy = -(p * np.log(np.clip(p, 1e-30, None))).sum(-1)
    return float(entropy.mean() / math.log(lm_head.shape[0]))


def stage_select(run: Path, mode: str, keep: float, seed: int, device: str | None = None) -> Path:
    """Keep a fraction of the examples: the flattest (``flat``), a random one (``random``), or ``all``."""
    from ..engines.loading import load_target

    if mode not in ("flat", "random", "all"):
        raise LyannaError(f"selection mode must be flat, random or all, got {mode!r}")
    if not 0 < keep <= 1:
        raise LyannaError(f"--keep must be in (0, 1], got {keep}")
    info = _run_info(run)
    examples = load_examples(run)
    ids = [eid for eid, _ in examples]
    if mode == "flat":
        target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
        head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
        if device:
            import torch

            head = torch.from_numpy(np.asarray(head, np.float32)).to(device)  # copied to the device once
        scores = [flatness(ex.features, head, ex.scored()) for _, ex in examples]
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


def _distributed() -> tuple[int, int]:
    """(rank, world) under torchrun, initializing the process group once; (0, 1) otherwise."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _token_frequencies(examples, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for _, ex in examples:
        np.add.at(counts, ex.tokens[ex.scored()], 1)  # what the target writes is what gets drafted
    return counts


def _split(examples) -> tuple[list, list]:
    held = [e for i, e in enumerate(examples) if i % 20 == 19] or examples[-1:]
    train = [e for i, e in enumerate(examples) if i % 20 != 19] or examples
    return train, held


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth of ``lr`` at ``steps``
    (a function of the step alone, so a resumed run continues the same schedule)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _batches(train: list, row_len: int, rows_per_batch: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch of packed batches: a seeded shuffle, first-fit packing, rows grouped into batches."""
    from .fit import pack

    order = np.random.default_rng([seed, epoch]).permutation(len(train))
    rows = [[int(order[i]) for i in row] for row in pack([train[i] for i in order], row_len)]
    rows = [rows[i] for i in np.random.default_rng([seed, epoch, 1]).permutation(len(rows))]
    return [rows[i:i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]


def stage_fit(run: Path, arch: str, steps: int, batch: int = 8, lr: float = 3e-4, depth: int = 4, rank: int = 32,
              draft_vocab: int = 8192, selection: str | None = None, seed: int = 0, eval_every: int = 50,
              save_every: int = 50, name: str | None = None, row_len: int = 2048, warmup: int = 0,
              labels: str = "soft", device: str = "cpu", eval_run: Path | None = None, max_train_tokens: int | None = None,
              eval_examples: int = 64, init: Path | None = None, until: int | None = None) -> dict[str, Any]:
    """Train a draft head on packed batches of ``batch`` rows of ``row_len`` tokens;
    data-parallel under torchrun (every rank takes a slice of each batch's rows). Held-out
    agreement is measured on this run's held-out split, or on all of ``eval_run`` (for example
    the target's own replies, when training on a corpus). ``init``, a draft checkpoint of the
    same arch, is the starting point instead of the target's last layer (continued training on
    new data, e.g. the target's own replies after a corpus); a Lyanna head keeps its draft
    vocabulary and rank. ``until`` stops after that step while the learning-rate schedule still
    spans ``steps`` (a long fit in sessions: rerun with a later ``until``, or none, to go on)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..drafters.checkpoint import load_head
    from ..engines.loading import load_target
    from .fit import (
        batch_agreement,
        batch_loss,
        init_eagle_head,
        init_lyanna_head,
        make_batch,
        pack,
        scored_counts,
    )

    if arch not in ("lyanna", "eagle"):
        raise LyannaError(f"--arch must be lyanna or eagle, got {arch!r}")
    if steps < 1 or batch < 1 or depth < 1 or row_len < 2:
        raise LyannaError("steps, batch and depth must be >= 1 and --row-len >= 2")
    if labels not in ("soft", "hard"):
        raise LyannaError(f"--labels must be soft or hard, got {labels!r}")
    rank_id, world = _distributed()
    if batch % world:
        raise LyannaError(f"--batch {batch} must be a multiple of the {world} processes")
    info = _run_info(run)
    ids = set(json.loads((run / "select" / selection).read_text())["ids"]) if selection else None
    # a scaling run loads a little more than it needs: the held-out split takes one example in 20
    train, held = _split(load_examples(run, ids, int(max_train_tokens * 1.2) if max_train_tokens else None))
    if eval_run is not None:  # a run nothing is trained on: all of it is held out
        held = load_examples(Path(eval_run))
    elif ids is not None:  # every arm of a selection is judged on the same held-out split: the whole run's
        held = _split(load_examples(run))[1]
    if ids is not None:
        held_ids = {e[0] for e in held}
        train = [e for e in train if e[0] in ids and e[0] not in held_ids]
        if not train:
            raise LyannaError(f"selection {selection} keeps no training examples")
    if max_train_tokens:  # a prefix of the (already seeded) order: the data-scaling points
        kept, total = [], 0
        for e in train:
            if total >= max_train_tokens:
                break
            kept.append(e)
            total += int(e[1].scored().sum())
        train = kept
    held = held[:eval_examples]
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    engine = _engine(target)
    out = run / "fit" / (name or arch)
    out.mkdir(parents=True, exist_ok=True)
    state_json = out / "state.json"
    state: dict[str, Any] = json.loads(state_json.read_text()) if state_json.is_file() else {
        "arch": arch, "step": 0, "history": [], "seconds": 0.0, "selection": selection,
        "settings": {"batch": batch, "row_len": row_len, "lr": lr, "warmup": warmup, "labels": labels, "depth": depth,
                     "rank": rank, "draft_vocab": draft_vocab, "seed": seed},
        "train_examples": len(train), "held_out_examples": len(held),
        "train_tokens": int(sum(len(ex.tokens) for _, ex in train)),
        "train_reply_tokens": int(sum(ex.scored().sum() for _, ex in train)),
        "eval_run": Path(eval_run).name if eval_run else None,
    }
    if state["arch"] != arch:
        raise LyannaError(f"{out} holds a {state['arch']} run; pass another --name")
    state["device"] = str(device)
    start = None
    if init is not None:
        init_config, start = load_head(init, target, arch)
        state.setdefault("init", {"path": str(init), "settings": init_config.get("settings", {})})
    counts = _token_frequencies(train, target.config.vocab_size)
    d2t = np.argsort(-counts, kind="stable")[: min(draft_vocab, target.config.vocab_size)]
    if arch == "lyanna":
        if start is not None:  # the checkpoint's draft vocabulary and rank: its tables index them
            d2t, rank = start["d2t"], int(start["ti.a"].shape[1])
            state["settings"].update(rank=rank, draft_vocab=len(d2t))
        head = init_lyanna_head(engine, target.weights, d2t, rank=rank, seed=seed)
    else:
        head = init_eagle_head(engine, target.weights, seed=seed)
        head.restrict_loss_vocab(d2t)  # same frequent tokens as lyanna's draft vocabulary
    if start is not None:
        head.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in start.items() if k != "ti.hot"})
    head = head.to(device)
    if str(device).startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # the head's matmuls; labels are computed from stored fp32-exact features
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    if (out / "state.safetensors").is_file():
        saved = load_file(str(out / "state.safetensors"), device=str(device))
        head.load_state_dict({k[len("head/"):]: v for k, v in saved.items() if k.startswith("head/")}, strict=False)
        names = [n for n, p in head.named_parameters() if p.requires_grad]
        for n, p in zip(names, params):
            if f"opt/{n}/exp_avg" in saved:
                opt.state[p] = {"step": torch.tensor(float(state["step"])), "exp_avg": saved[f"opt/{n}/exp_avg"],
                                "exp_avg_sq": saved[f"opt/{n}/exp_avg_sq"]}
    train_ex = [ex for _, ex in train]
    held_ex = [ex for _, ex in held]

    class _Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, b, counts: list[float] | None) -> torch.Tensor:
            if b is None:  # more ranks than rows: take part in the gradient average with zero
                return sum(p.sum() * 0 for p in params)
            return batch_loss(self.head, b, depth, labels=labels, counts=counts)

    model: torch.nn.Module = _Loss()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)

    def evaluate() -> list[float]:
        hits, counts_ = np.zeros(depth), np.zeros(depth)
        for rows in [r[i:i + batch] for r in [pack(held_ex, row_len)] for i in range(0, len(r), batch)]:
            h, c = batch_agreement(head, make_batch(held_ex, rows, row_len, device), depth)
            hits += h
            counts_ += c
        return [round(float(x), 4) for x in hits / np.maximum(counts_, 1)]

    def save() -> None:
        tensors = {f"head/{k}": v.detach().clone().contiguous() for k, v in head.state_dict().items()}
        for n, p in head.named_parameters():
            st = opt.state.get(p)
            if st:
                tensors[f"opt/{n}/exp_avg"] = st["exp_avg"].contiguous()
                tensors[f"opt/{n}/exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        save_file(tensors, str(out / ".state.tmp"))
        os.replace(out / ".state.tmp", out / "state.safetensors")
        state_json.write_text(json.dumps(state, indent=2))

    from tqdm import tqdm

    bar = tqdm(total=steps, initial=state["step"], desc=f"fit {arch}", unit="step", dynamic_ncols=True,
               disable=rank_id != 0 or os.environ.get("LYANNA_NO_PROGRESS") == "1")
    t0 = time.perf_counter()
    # epochs pack differently, so their lengths differ: walk them up to the current step
    epoch, epoch_start = 0, 0
    epoch_batches = _batches(train_ex, row_len, batch, seed, 0)
    positions = 0
    if start is not None and state["step"] == 0 and rank_id == 0:  # where the continued head starts
        state["history"].append({"step": 0, "epoch": 0.0, "loss": None, "agreement": evaluate(), "seconds": 0.0})
        bar.write(f"step 0 (from {init}): held-out agreement by depth {state['history'][-1]['agreement']}")
    last = steps if until is None else min(until, steps)
    while state["step"] < last:
        step = state["step"]
        while step - epoch_start >= len(epoch_batches):
            epoch_start += len(epoch_batches)
            epoch += 1
            epoch_batches = _batches(train_ex, row_len, batch, seed, epoch)
        rows = epoch_batches[step - epoch_start]
        per_epoch = len(epoch_batches)
        # every rank divides by the whole batch's scored rows, times the ranks DDP averages over
        # (one process: its own rows are the whole batch, batch_loss counts them itself)
        counts = ([c / world for c in scored_counts(make_batch(train_ex, rows, row_len, features=False), depth)]
                  if world > 1 else None)
        mine = rows[rank_id::world]
        b = make_batch(train_ex, mine, row_len, device) if mine else None
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(b, counts)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        positions += b.positions * world if b is not None else 0
        state["step"] = step + 1
        bar.update(1)
        elapsed = state["seconds"] + time.perf_counter() - t0
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", pos_s=f"{positions / max(time.perf_counter() - t0, 1e-9):.0f}")
        done = state["step"] == last
        if rank_id == 0 and (state["step"] % eval_every == 0 or done):
            acc = evaluate()
            state["history"].append({"step": state["step"], "epoch": round(epoch + (step - epoch_start) / per_epoch, 3), "loss": round(float(loss.detach()), 4),
                                     "agreement": acc, "seconds": round(elapsed, 1)})
            bar.write(f"step {state['step']} (epoch {epoch + (step - epoch_start) / per_epoch:.2f}): loss {float(loss.detach()):.4f}, "
                      f"held-out agreement by depth {acc}, {positions / max(time.perf_counter() - t0, 1e-9):.0f} positions/s")
        if rank_id == 0 and (state["step"] % save_every == 0 or done):
            state["seconds"] += time.perf_counter() - t0
            state["positions_per_s"] = round(positions / max(time.perf_counter() - t0, 1e-9), 1)
            t0 = time.perf_counter()
            positions = 0
            save()
    bar.close()
    return state


def _reply_counts(run: Path, vocab: int) -> np.ndarray:
    """How often each token is written by the assistant in the run's data (no features needed)."""
    from .corpus import reply_mask

    counts = np.zeros(vocab, np.int64)
    for row in iter_data(run):
        ids, mask = reply_mask(row)
        np.add.at(counts, ids[mask], 1)
    return counts


def _stage_costs(run: Path, fit_state: dict[str, Any]) -> str:
    """Wall time of each stage that recorded one, for the model card."""
    parts = []
    for name, f in (("data", run / "data" / "report.json"), ("features", run / "features" / "report.json")):
        if f.is_file():
            r = json.loads(f.read_text())
            if "seconds" in r:
                parts.append(f"{name} {r['seconds'] / 60:.1f} min" + (f" ({r['device']})" if r.get("device") else ""))
    parts.append(f"fit {fit_state['seconds'] / 60:.1f} min" + (f" ({fit_state['device']})" if fit_state.get("device") else ""))
    return ", ".join(parts)


def _init_lines(init: dict[str, Any] | None, shown) -> list[str]:
    """The model card's lines on the checkpoints a continued fit descends from, newest first, each
    with its own training: a head continued in several stages shows all of them (and their cost)."""
    lines, lead = [], "- initialized from `{}` (continued training)"
    while init:
        st = init.get("settings", {})
        if st.get("train_seconds") is None:
            fit = "fit time not recorded"
        else:
            fit = f"fit {st['train_seconds'] / 60:.1f} min" + (f" ({st['device']})" if st.get("device") else "")
        lines.append(f"{lead.format(shown(init['path']))}; that head: {st.get('source', '?')} data, "
                     f"{st.get('train_reply_tokens', '?')} assistant tokens, {st.get('steps', '?')} steps, {fit}, "
                     f"held-out agreement {st.get('held_out_agreement')}")
        init, lead = st.get("init"), "  - which was initialized from `{}`"
    return lines


def stage_export(run: Path, arch: str, out_dir: Path, name: str | None = None, hot: int = 2048, command: str = "",
                 decode: dict[str, Any] | None = None) -> Path:
    """Write the draft checkpoint (and, for Lyanna, the hot-token list the table is built from)
    plus a model card. ``decode`` holds decode-time tree settings stored in the checkpoint."""
    from safetensors.numpy import load_file

    from ..drafters.checkpoint import save_head
    from ..engines.loading import load_target

    info = _run_info(run)

    def shown(arg: str) -> str:  # card and config travel with the draft: no absolute machine paths in them
        p = Path(arg)
        return {Path(run): "RUN", Path(out_dir): "OUT"}.get(p, p.name) if p.is_absolute() else arg

    command, model = shlex.join(shown(a) for a in shlex.split(command)), shown(info["model"])
    fit_dir = run / "fit" / (name or arch)
    if not (fit_dir / "state.safetensors").is_file():
        raise LyannaError(f"{fit_dir} has no trained state: run `lyanna train fit --arch {arch}` first")
    state = json.loads((fit_dir / "state.json").read_text())
    if state["arch"] != arch:
        raise LyannaError(f"{fit_dir} holds a {state['arch']} head, not {arch}")
    saved = load_file(str(fit_dir / "state.safetensors"))
    weights = {k[len("head/"):]: v for k, v in saved.items() if k.startswith("head/")}
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    coverage = d2t_cov = None
    if arch == "lyanna":
        counts = _reply_counts(run, target.config.vocab_size)
        hot_ids = np.argsort(-counts, kind="stable")[:hot]
        weights["ti.hot"] = hot_ids.astype(np.int64)
        coverage = float(counts[hot_ids].sum() / max(counts.sum(), 1))
        d2t_cov = float(counts[weights["d2t"]].sum() / max(counts.sum(), 1))
    tap = target.config.num_layers
    last = state["history"][-1] if state["history"] else {}
    settings = {**state["settings"], "steps": state["step"], "train_seconds": round(state["seconds"], 1),
                "train_examples": state["train_examples"], "train_tokens": state["train_tokens"],
                "train_reply_tokens": state.get("train_reply_tokens"), "source": info.get("source", "self-distillation"),
                "held_out_agreement": last.get("agreement"), "selection": state.get("selection"),
                "init": {**state["init"], "path": shown(state["init"]["path"])} if state.get("init") else None,
                "hot_tokens": hot if arch == "lyanna" else None, "hot_coverage": coverage, "command": command,
                "device": state.get("device"),
                **({"decode": decode} if decode else {})}
    save_head(out_dir, arch, weights, target, tap, settings)
    source = info.get("source", "self-distillation")
    if source == "self-distillation":
        data = (f"prompts from `{info.get('prompts')}` answered greedily by the target, at most "
                f"{info.get('max_new_tokens')} new tokens")
    else:
        data = (f"`{source}` conversations in the target's chat template, cut to {info.get('max_tokens')} tokens, "
                "teacher-forced (the target's own next-token distribution as labels)")
    held_desc = (f"{state['held_out_examples']} held-out examples of the run `{state['eval_run']}` (the target's own replies)"
                 if state.get("eval_run") else f"{state['held_out_examples']} held out")
    st = state["settings"]
    lines = [
        f"# {arch} draft head for {model}",
        "",
        f"Trained with Lyanna's own pipeline (`lyanna train`), {time.strftime('%Y-%m-%d')}.",
        "",
        f"- target: `{model}`, tapped hidden state: final-norm output (index {tap})",
        f"- data: {state['train_examples']} training examples, {state['train_tokens']} tokens of which "
        f"{state.get('train_reply_tokens', '?')} written by the assistant ({data}); {held_desc}; "
        f"selection: {state.get('selection') or 'all'}",
        *_init_lines(state.get("init"), shown),
        f"- steps: {state['step']} (batch {st['batch']} rows of {st.get('row_len', '-')} tokens, lr {st['lr']}, "
        f"warmup {st.get('warmup', 0)}, {st.get('labels', 'soft')} labels, unrolled depth {st['depth']})",
        f"- cost: {_stage_costs(run, state)}",
        f"- held-out top-1 agreement with the target by depth (teacher-forced): {last.get('agreement')}",
    ]
    if arch == "lyanna":
        lines.append(f"- draft vocabulary: {len(weights['d2t'])} tokens covering {d2t_cov:.1%} of reply tokens; "
                     f"token-info rank {st['rank']}; materialized hot rows: {hot} ({coverage:.1%} of reply tokens)")
    if decode:
        lines.append(f"- decode-time tree settings: {json.dumps(decode)}")
    lines += ["", "Reproduce:", "", "```", command or "(see run.json)", "```", ""]
    (Path(out_dir) / "README.md").write_text("\n".join(lines))
    print(f"export: wrote {out_dir}")
    return Path(out_dir)
