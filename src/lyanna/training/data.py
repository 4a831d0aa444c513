"""``lyanna train data``: training examples, from a conversation corpus or the target's own replies."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..drafters.checkpoint import check_taps
from ..errors import LyannaError
from .run import (
    SHARD_EXAMPLES,
    TRAINING_WEIGHTS,
    hf_model,
    hf_taps,
    iter_data,
    progress,
    run_info,
    start_run,
    write_features,
    write_shards,
)


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
    seen: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text().split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, pid = str(row["prompt"]), str(row.get("id", lineno))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LyannaError(f"{path}:{lineno}: need a JSON object with 'prompt' ({e})") from None
        if pid in seen:  # a run marks prompts done by id: two with one id would be one prompt
            raise LyannaError(f"{path}:{lineno}: id {pid!r} is also the id of line {seen[pid]}")
        seen[pid] = lineno
        if " ".join(prompt.split()).lower() not in exclude:
            rows.append({"id": pid, "prompt": prompt})
    order = np.random.default_rng(seed).permutation(len(rows))
    rows = [rows[i] for i in order]
    return rows[:limit] if limit else rows


def _hf_replies(model, prompts: list[list[int]], max_new_tokens: int, eos: Sequence[int],
                batch: int, taps: Sequence[int]) -> list[tuple[list[int], np.ndarray]]:
    """Greedy replies of the Hugging Face ``model`` (on its device) to ``prompts``, ``batch``
    left-padded prompts of similar length at a time in a static cache, each reply ending at its
    first end-of-sequence token (kept, as the engine keeps it), together with the ``taps``'
    features of prompt + reply (fp16 [T, taps * H]): the features stage's work comes free with the
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
            step = model.model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache,
                               use_cache=True, output_hidden_states=len(taps) > 1)
            hidden = step.last_hidden_state
            feats, tokens = [hf_taps(step, taps).to(torch.float16).cpu()], []
            done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
            stop_ids = torch.tensor(sorted(stop), device=device)
            for _ in range(max_new_tokens):
                nxt = model.lm_head(hidden[:, -1]).argmax(-1)
                tokens.append(nxt.cpu())
                done |= torch.isin(nxt, stop_ids)
                # one more pass for the feature after the newest token (the last one included)
                att = torch.cat([att, torch.ones_like(att[:, :1])], 1)
                pos = pos[:, -1:] + 1
                step = model.model(input_ids=nxt[:, None], attention_mask=att, position_ids=pos,
                                   past_key_values=cache, use_cache=True, output_hidden_states=len(taps) > 1)
                hidden = step.last_hidden_state
                feats.append(hf_taps(step, taps).to(torch.float16).cpu())
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


# How ``stage_data`` generates replies: the GGUF engine here, one at a time as decoding them
# alone (``engine``); our batched device engine (``device``); the Hugging Face model in padded
# batches, with the features of ``--taps`` (``hf``).
GENERATORS = ("engine", "device", "hf")
# Replies a shard holds, from a generator that answers prompts in the order they end.
Reply = tuple[int, list[int], "np.ndarray | None"]  # prompt index, reply, its features (hf) or None


def stage_data(run: Path, model: str, prompts_file: Path, limit: int | None, max_new_tokens: int,
               max_prompt_tokens: int, seed: int, batch: int = 8, device: str | None = None,
               taps: Sequence[int] | None = None, done_file: Path | None = None, generator: str | None = None,
               dtype: str = "float32", reply_tokens: int | None = None) -> int:
    """Self-distillation: the target answers training prompts greedily with its chat template,
    ``batch`` replies sharing each forward pass. ``generator`` (``GENERATORS``; default ``device``
    where a ``device`` is named, else ``engine``): on this engine each reply is token-identical to
    generating it alone; ``device`` runs our batched device engine in ``dtype`` (replies only, the
    fastest on a GPU); ``hf`` the Hugging Face model, which writes the features of ``taps`` as it
    goes (see ``stage_features``, which makes them otherwise). ``done_file``: ids of prompts
    answered in another copy of the run (one a line), skipped: a lent machine grows its own copy
    without receiving the replies made so far, and ``stage_merge`` brings its shards home.
    ``reply_tokens``: stop at the end of the shard that brings this sitting's reply tokens to it
    (a lent machine's output must fit what comes back; rerun to go on)."""
    generator = generator or ("device" if device else "engine")
    if reply_tokens is not None and reply_tokens < 1:
        raise LyannaError(f"--reply-tokens must be >= 1, got {reply_tokens}")
    _check_generator(generator, batch, device, taps)
    prompts = read_prompts(prompts_file, limit, seed, benchmark_prompts())
    if not prompts:  # checked before the run exists: an empty run would only fail later, less clearly
        raise LyannaError(f"{prompts_file} has no training prompts (empty, or every prompt is a benchmark question)")
    made_by = {"engine": "engine", "hf": f"hf-{device}", "device": f"device-{device}-{dtype}"}[generator]
    start_run(run, {"model": model, "source": "self-distillation", "seed": seed, "prompts": Path(prompts_file).name,
                     "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "generator": made_by})
    done = {row["id"] for row in iter_data(run)}
    if done_file is not None:
        if not Path(done_file).is_file():
            raise LyannaError(f"--done {done_file} not found")
        done |= {line.strip() for line in Path(done_file).read_text().split("\n") if line.strip()}
    todo = [p for p in prompts if p["id"] not in done]
    decoder, replies, taps = _generator(generator, model, device, dtype, batch, max_new_tokens, taps)
    ids = [decoder.encode(p["prompt"])[:max_prompt_tokens] for p in todo]
    shard_idx = len(list((run / "data").glob("shard-*.jsonl")))
    bar = progress(len(prompts), f"data (self-distillation, {made_by})", len(prompts) - len(todo))
    started = shard_started = time.perf_counter()
    shard: list[Reply] = []
    made = answered = 0
    for i, reply, feats in replies(ids):
        shard.append((i, reply, feats))
        made, answered = made + len(reply), answered + 1
        bar.update(1)
        bar.set_postfix(reply_tokens_per_s=f"{made / max(time.perf_counter() - started, 1e-9):.0f}", refresh=False)
        if len(shard) == SHARD_EXAMPLES or answered == len(todo):  # a shard is the unit of resumption
            rows = [{"id": todo[k]["id"], "prompt_ids": ids[k], "output_ids": out} for k, out, _ in shard]
            if generator == "hf":  # features before data: the data shard is what marks these prompts done
                write_features(run / "features", shard_idx, rows, [f for _, _, f in shard], taps)
            write_shards(run, [json.dumps(r) for r in rows], shard_idx)
            _add_data_seconds(run, time.perf_counter() - shard_started, made_by, sum(len(r) for _, r, _ in shard))
            shard_idx, shard, shard_started = shard_idx + 1, [], time.perf_counter()
            if reply_tokens is not None and made >= reply_tokens:
                break
    bar.close()
    return len(prompts)


def _check_generator(generator: str, batch: int, device: str | None, taps: Sequence[int] | None) -> None:
    if generator not in GENERATORS:
        raise LyannaError(f"--generator must be one of {', '.join(GENERATORS)}, got {generator!r}")
    if batch < 1:
        raise LyannaError(f"--batch must be >= 1, got {batch}")
    if generator != "engine" and not device:
        raise LyannaError(f"--generator {generator} runs on a torch device: name it with --device (cpu, cuda)")
    if generator == "engine" and device:
        raise LyannaError("--generator engine runs on this machine's engine: leave out --device")
    if taps is not None and generator != "hf":
        raise LyannaError("--taps names the features the Hugging Face generator writes with its replies "
                          "(--generator hf); otherwise give them to `lyanna train features --taps`")


def _generator(generator: str, model: str, device: str | None, dtype: str, batch: int, max_new_tokens: int,
               taps: Sequence[int] | None):
    """The decoder that encodes the prompts, a function from encoded prompts to their ``Reply``s
    (in any order) and the taps whose features come with them (``hf``; else None)."""
    from ..decoding.decoder import Decoder, GenerationRequest
    from ..engines.loading import load_target, resolve_model

    if generator == "device":
        from ..engines.device import load_device_target
        from ..engines.device_batch import BatchedGreedy

        target, engine = load_device_target(model, device, dtype)
        decoder = Decoder(target, default_drafts=False, engine=engine)

        def on_device(ids: list[list[int]]):
            if ids:
                gen = BatchedGreedy.for_prompts(engine, ids, max_new_tokens, batch)
                for i, reply in gen.replies(ids, max_new_tokens, decoder.eos_token_ids):
                    yield i, reply, None
        return decoder, on_device, None
    decoder = Decoder(load_target(model, weight_format=TRAINING_WEIGHTS), default_drafts=False)
    hf = hf_model(resolve_model(model), device) if generator == "hf" else None
    check = check_taps(taps, decoder.engine.config.num_layers) if hf is not None else None
    request = GenerationRequest(max_new_tokens=max_new_tokens)

    def in_chunks(ids: list[list[int]]):
        for k in range(0, len(ids), 4 * batch):  # replies come back every few batches
            part = ids[k : k + 4 * batch]
            if hf is not None:
                got = _hf_replies(hf, part, max_new_tokens, decoder.eos_token_ids, batch, check)
            else:
                got = [(out.tokens, None) for out in decoder.generate_batch(part, request, max_batch=batch)]
            for j, (reply, feats) in enumerate(got):
                yield k + j, reply, feats
    return decoder, in_chunks, check


# What two copies of a self-distillation run must share for their replies to be one data set.
MERGE_KEYS = ("model", "source", "seed", "prompts", "max_new_tokens", "max_prompt_tokens")


def stage_merge(run: Path, others: Sequence[Path]) -> int:
    """Add the replies of other copies of a self-distillation run (made elsewhere with ``--done``)
    to ``run``, as new shards after its own; return the replies added. The copies must agree on
    the model, prompts and generation settings, and no prompt may be answered twice. Features do
    not travel (a GPU makes them with the replies, three taps of 30M tokens are ~100 GB): make
    them where the fit runs (``stage_features``, which skips shards that have them)."""
    info = run_info(run)
    if info.get("source") != "self-distillation":
        raise LyannaError(f"{run} holds a corpus, written whole: only self-distillation runs grow in copies")
    have = {row["id"] for row in iter_data(run)}
    added = 0
    for other in others:
        theirs = run_info(Path(other))
        differ = [k for k in MERGE_KEYS if theirs.get(k) != info.get(k)]
        if differ:
            raise LyannaError(f"{other} differs from {run} in {', '.join(differ)}: not one data set")
        rows = list(iter_data(Path(other)))
        ids = [row["id"] for row in rows]
        if len(set(ids)) != len(ids):
            raise LyannaError(f"{other} answers a prompt twice: not a run `lyanna train data` made")
        twice = set(ids) & have
        if twice:
            raise LyannaError(f"{other} answers {len(twice)} prompt(s) {run} already holds (e.g. {sorted(twice)[0]!r}): "
                              "make its replies with --done")
        write_shards(run, [json.dumps(row) for row in rows], len(list((run / "data").glob("shard-*.jsonl"))))
        report = Path(other) / "data" / "report.json"
        if report.is_file():
            r = json.loads(report.read_text())
            made = r.get("device", "elsewhere").replace(", features included", "")  # its features stayed there
            # the copy's time, and the reply tokens it brought (a copy may leave shards behind)
            _add_data_seconds(run, float(r.get("seconds", 0.0)), None, sum(len(row["output_ids"]) for row in rows),
                              f"{made}, a merged copy")
        have |= set(ids)
        added += len(ids)
    return added


def _add_data_seconds(run: Path, seconds: float, made_by: str | None, tokens: int = 0,
                      described: str | None = None) -> None:
    """Self-distillation's wall time and reply tokens, summed over resumed sessions (the model
    card's cost line, and the generator's speed: ``reply_tokens_per_s``)."""
    f = run / "data" / "report.json"
    report = json.loads(f.read_text()) if f.is_file() else {"seconds": 0.0}
    report["seconds"] = round(report["seconds"] + seconds, 3)
    report["reply_tokens"] = report.get("reply_tokens", 0) + tokens
    if tokens and report["seconds"] > 0:
        report["reply_tokens_per_s"] = round(report["reply_tokens"] / report["seconds"], 1)
    here = described or (f"{made_by}, features included" if made_by and made_by.startswith("hf-") else made_by or "engine")
    made = [part for part in report.get("device", "").split("; ") if part]  # each way a merged copy was made, once
    report["device"] = "; ".join(made if here in made else [*made, here])
    f.write_text(json.dumps(report))


def stage_prompts(out: Path, source: str, max_chars: int = 4000) -> int:
    """Self-distillation prompts from a conversation corpus (``sharegpt`` or a file): the first
    user turn of each conversation, written as the JSON lines ``--prompts`` reads, ids prefixed
    by the source (``sharegpt:...``) so that they never meet another prompts file's; benchmark
    questions removed. Returns the prompts written."""
    from .corpus import first_user_turns, sharegpt_path

    path = sharegpt_path() if source == "sharegpt" else Path(source)
    if not path.is_file():
        raise LyannaError(f"corpus {source} not found (use sharegpt or a JSON/JSONL file)")
    if max_chars < 1:
        raise LyannaError(f"--max-chars must be >= 1, got {max_chars}")
    prompts, skipped = first_user_turns(path, benchmark_prompts(), max_chars)
    if not prompts:
        raise LyannaError(f"{source}: no usable first user turn ({dict(skipped)})")
    tag = "sharegpt" if source == "sharegpt" else path.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps({"id": f"{tag}:{p['id']}", "prompt": p["prompt"]}, ensure_ascii=False) + "\n"
                           for p in prompts), encoding="utf-8")
    tmp.replace(out)
    print(f"prompts: wrote {len(prompts)} to {out}; skipped {sum(skipped.values())}: "
          + ", ".join(f"{v} {k}" for k, v in skipped.most_common()))
    return len(prompts)


def stage_corpus(run: Path, model: str, source: str, limit: int | None, reply_tokens: int | None,
                 max_tokens: int, seed: int) -> int:
    """Teacher-forcing data: conversations of a corpus (``sharegpt`` or a file) in the target's
    chat template, in a seeded order, benchmark questions removed. Written once, whole."""
    from ..engines.loading import load_tokenizer, resolve_model
    from .corpus import read_corpus, sharegpt_path

    path = sharegpt_path() if source == "sharegpt" else Path(source)
    if not path.is_file():
        raise LyannaError(f"corpus {source} not found (use sharegpt or a JSON/JSONL file)")
    start_run(run, {"model": model, "source": source if source == "sharegpt" else path.name, "seed": seed,
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
    write_shards(run, [json.dumps(r) for r in rows], 0)
    report = {"conversations": len(rows), "tokens": sum(len(r["ids"]) for r in rows),
              "reply_tokens": sum(b - a for r in rows for a, b in r["reply"]), "skipped": dict(skipped),
              "seconds": round(time.perf_counter() - t0, 1)}
    (run / "data" / "report.json").write_text(json.dumps(report, indent=2))
    print(f"data: kept {report['conversations']} conversations ({report['tokens']} tokens, {report['reply_tokens']} "
          f"assistant tokens); skipped {sum(skipped.values())}: " + ", ".join(f"{v} {k}" for k, v in skipped.most_common()))
    return len(rows)
