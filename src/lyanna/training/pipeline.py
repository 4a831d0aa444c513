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
import shlex
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import LyannaError

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


def stage_data(run: Path, model: str, prompts_file: Path, limit: int | None, max_new_tokens: int,
               max_prompt_tokens: int, seed: int) -> int:
    """Self-distillation: the target answers training prompts greedily with its chat template."""
    from ..decoding import Decoder, GenerationRequest
    from ..loading import load_target

    prompts = read_prompts(prompts_file, limit, seed, benchmark_prompts())
    if not prompts:  # checked before the run exists: an empty run would only fail later, less clearly
        raise LyannaError(f"{prompts_file} has no training prompts (empty, or every prompt is a benchmark question)")
    run.mkdir(parents=True, exist_ok=True)
    info_file = run / "run.json"
    info = {"model": model, "seed": seed, "prompts": str(prompts_file), "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens}
    if info_file.is_file():
        old = json.loads(info_file.read_text())
        if old.get("model") != model:
            raise LyannaError(f"{run} was made for model {old.get('model')!r}, not {model!r}: use another --run")
    info_file.write_text(json.dumps(info, indent=2))
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
    from .fit import target_features

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
            example = target_features(engine, [r["prompt_ids"] + r["output_ids"]], tap)[0]
            tensors[f"{r['id']}/tokens"] = example.tokens.astype(np.int32)
            tensors[f"{r['id']}/features"] = example.features.astype(np.float16)
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
    for _, ex, plen in examples:
        np.add.at(counts, ex.tokens[plen:], 1)  # what the target writes is what gets drafted
    return counts


def _split(examples) -> tuple[list, list]:
    held = [e for i, e in enumerate(examples) if i % 20 == 19] or examples[-1:]
    train = [e for i, e in enumerate(examples) if i % 20 != 19] or examples
    return train, held


def stage_fit(run: Path, arch: str, steps: int, batch: int = 8, lr: float = 3e-4, depth: int = 4, rank: int = 32,
              draft_vocab: int = 8192, selection: str | None = None, seed: int = 0, eval_every: int = 50,
              save_every: int = 50, name: str | None = None) -> dict[str, Any]:
    """Train a draft head; data-parallel under torchrun (every rank takes a slice of each batch)."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..engine import Transformer
    from ..loading import load_target
    from .fit import agreement, example_loss, init_eagle_head, init_lyanna_head

    if arch not in ("lyanna", "eagle"):
        raise LyannaError(f"--arch must be lyanna or eagle, got {arch!r}")
    if steps < 1 or batch < 1 or depth < 1:
        raise LyannaError("steps, batch and depth must be >= 1")
    rank_id, world = _distributed()
    if batch % world:
        raise LyannaError(f"--batch {batch} must be a multiple of the {world} processes")
    info = _run_info(run)
    ids = set(json.loads((run / "select" / selection).read_text())["ids"]) if selection else None
    train, held = _split(load_examples(run))
    if ids is not None:  # a selection picks training examples; every arm is judged on the same held-out split
        train = [e for e in train if e[0] in ids]
        if not train:
            raise LyannaError(f"selection {selection} keeps no training examples")
    target = load_target(info["model"])
    engine = Transformer(target.config, target.weights)
    out = run / "fit" / (name or arch)
    out.mkdir(parents=True, exist_ok=True)
    state_json = out / "state.json"
    state: dict[str, Any] = json.loads(state_json.read_text()) if state_json.is_file() else {
        "arch": arch, "step": 0, "history": [], "seconds": 0.0, "selection": selection,
        "settings": {"batch": batch, "lr": lr, "depth": depth, "rank": rank, "draft_vocab": draft_vocab, "seed": seed},
        "train_examples": len(train), "held_out_examples": len(held),
        "train_tokens": int(sum(len(ex.tokens) for _, ex, _ in train)),
    }
    if state["arch"] != arch:
        raise LyannaError(f"{out} holds a {state['arch']} run; pass another --name")
    counts = _token_frequencies(train, target.config.vocab_size)
    d2t = np.argsort(-counts, kind="stable")[: min(draft_vocab, target.config.vocab_size)]
    if arch == "lyanna":
        head = init_lyanna_head(engine, target.weights, d2t, rank=rank, seed=seed)
    else:
        head = init_eagle_head(engine, target.weights, seed=seed)
        head.restrict_loss_vocab(d2t)  # same frequent tokens as lyanna's draft vocabulary
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    if (out / "state.safetensors").is_file():
        saved = load_file(str(out / "state.safetensors"))
        head.load_state_dict({k[len("head/"):]: v for k, v in saved.items() if k.startswith("head/")}, strict=False)
        names = [n for n, p in head.named_parameters() if p.requires_grad]
        for n, p in zip(names, params):
            if f"opt/{n}/exp_avg" in saved:
                opt.state[p] = {"step": torch.tensor(float(state["step"])), "exp_avg": saved[f"opt/{n}/exp_avg"],
                                "exp_avg_sq": saved[f"opt/{n}/exp_avg_sq"]}

    class _Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = head

        def forward(self, exs: list) -> torch.Tensor:
            # roots from two before the reply: the drafts a decode ever asks for
            return torch.stack([example_loss(self.head, ex, depth, start=max(plen - 2, 0)) for ex, plen in exs]).mean()

    model: torch.nn.Module = _Loss()
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)

    def evaluate() -> list[float]:
        hits, counts = np.zeros(depth), np.zeros(depth)
        for _, ex, plen in held:
            h, c = agreement(head, ex, depth, start=plen)
            hits += h
            counts += c
        return [round(float(x), 4) for x in hits / np.maximum(counts, 1)]

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
    while state["step"] < steps:
        step = state["step"]
        picks = np.random.default_rng([seed, step]).integers(len(train), size=batch)
        local = [(train[i][1], train[i][2]) for i in picks[rank_id::world]]
        loss = model(local)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        done = state["step"] == steps
        if rank_id == 0 and (state["step"] % eval_every == 0 or done):
            acc = evaluate()
            state["history"].append({"step": state["step"], "loss": round(float(loss.detach()), 4), "agreement": acc})
            bar.write(f"step {state['step']}: loss {float(loss.detach()):.4f}, held-out agreement by depth {acc}")
        if rank_id == 0 and (state["step"] % save_every == 0 or done):
            state["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            save()
    bar.close()
    return state


def stage_export(run: Path, arch: str, out_dir: Path, name: str | None = None, hot: int = 2048, command: str = "") -> Path:
    """Write the draft checkpoint (and, for Lyanna, the hot-token list the table is built from)
    plus a model card."""
    from safetensors.numpy import load_file

    from ..drafters.checkpoint import save_head
    from ..loading import load_target

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
    target = load_target(info["model"])
    coverage = None
    if arch == "lyanna":
        counts = _token_frequencies(load_examples(run), target.config.vocab_size)
        hot_ids = np.argsort(-counts, kind="stable")[:hot]
        weights["ti.hot"] = hot_ids.astype(np.int64)
        coverage = float(counts[hot_ids].sum() / max(counts.sum(), 1))
        d2t_cov = float(counts[weights["d2t"]].sum() / max(counts.sum(), 1))
    tap = target.config.num_layers
    settings = {**state["settings"], "steps": state["step"], "train_seconds": round(state["seconds"], 1),
                "train_examples": state["train_examples"], "train_tokens": state["train_tokens"],
                "selection": state.get("selection"), "hot_tokens": hot if arch == "lyanna" else None,
                "hot_coverage": coverage, "command": command}
    save_head(out_dir, arch, weights, target, tap, settings)
    last = state["history"][-1] if state["history"] else {}
    lines = [
        f"# {arch} draft head for {model}",
        "",
        f"Trained with Lyanna's own pipeline (`lyanna train`), {time.strftime('%Y-%m-%d')}.",
        "",
        f"- target: `{model}`, tapped hidden state: final-norm output (index {tap})",
        f"- data: {state['train_examples']} training examples ({state['train_tokens']} tokens; prompts from "
        f"`{Path(info['prompts']).name}` answered greedily by the target, at most {info['max_new_tokens']} new tokens), "
        f"{state['held_out_examples']} held out; selection: {state.get('selection') or 'all'}",
        f"- steps: {state['step']} (batch {state['settings']['batch']}, lr {state['settings']['lr']}, unrolled depth "
        f"{state['settings']['depth']}), wall time {state['seconds'] / 60:.1f} min",
        f"- held-out top-1 agreement with the target by depth (teacher-forced): {last.get('agreement')}",
    ]
    if arch == "lyanna":
        lines.append(f"- draft vocabulary: {len(weights['d2t'])} tokens covering {d2t_cov:.1%} of reply tokens; "
                     f"token-info rank {state['settings']['rank']}; materialized hot rows: {hot} ({coverage:.1%} of reply tokens)")
    lines += ["", "Reproduce:", "", "```", command or "(see run.json)", "```", ""]
    (Path(out_dir) / "README.md").write_text("\n".join(lines))
    print(f"export: wrote {out_dir}")
    return Path(out_dir)
