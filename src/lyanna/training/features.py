"""``lyanna train features`` (the target's hidden states of every example) and ``lyanna train select``
(flatness-based or random selection of examples)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..drafters.checkpoint import check_taps
from ..errors import LyannaError
from .run import (
    SHARD_EXAMPLES,
    TRAINING_WEIGHTS,
    hf_model,
    hf_taps,
    iter_data,
    load_data_examples,
    load_examples,
    progress,
    run_info,
    shard_taps,
    training_engine,
    write_features,
)


BATCH_TOKENS = 65536  # tokens per forward: large enough to fill a GPU, small enough for its memory


class TargetFeatures:
    """The taps' features of token sequences through the Hugging Face model on a torch device,
    fp32 without TF32 (the same function as the engine), rounded to fp16 as stored features are;
    padded batches of similar lengths."""

    def __init__(self, model_dir: Path, device: str, taps: Sequence[int]):
        self.model, self.device, self.taps = hf_model(model_dir, device), device, tuple(taps)

    def batches(self, seqs: Sequence[np.ndarray]) -> Iterator[list[tuple[int, np.ndarray]]]:
        """(index, [len, taps * H] fp16 features) of every sequence, a forward's worth at a time."""
        import torch

        order = np.argsort([-len(s) for s in seqs], kind="stable")
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # a fit turns TF32 on for its head's matmuls
        at = 0
        try:
            with torch.no_grad():
                while at < len(order):
                    width = len(seqs[order[at]])
                    chunk = order[at:at + max(1, BATCH_TOKENS // max(width, 1))]
                    ids = torch.zeros(len(chunk), width, dtype=torch.long)
                    att = torch.zeros(len(chunk), width, dtype=torch.long)
                    for r, i in enumerate(chunk):
                        ids[r, :len(seqs[i])] = torch.from_numpy(np.asarray(seqs[i], np.int64))
                        att[r, :len(seqs[i])] = 1
                    out = self.model.model(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                           output_hidden_states=len(self.taps) > 1)
                    hidden = hf_taps(out, self.taps).to(torch.float16).cpu().numpy()
                    yield [(int(i), hidden[r, :len(seqs[i])]) for r, i in enumerate(chunk)]
                    at += len(chunk)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    def of(self, seqs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The features of every sequence, in order."""
        out: list[np.ndarray] = [np.zeros(0)] * len(seqs)
        for got in self.batches(seqs):
            for i, f in got:
                out[i] = f
        return out


def stage_features(run: Path, device: str | None = None, taps: Sequence[int] | None = None) -> int:
    """Target features of every example, fp16 safetensors shards: one teacher-forced pass per
    example, on this engine, or with ``device`` (``cpu``, ``cuda``) through the Hugging Face
    model in batches. ``taps``: the hidden states kept, side by side (``check_taps``; default the
    final norm's output alone). A shard whose example ids or taps no longer match (the data stage
    was rerun with more examples, other taps were asked for) is redone."""
    from safetensors import safe_open

    from ..engines.loading import load_target, resolve_model
    from .corpus import reply_mask
    from .fit import target_features

    info = run_info(run)
    rows = list(iter_data(run))
    if not rows:
        raise LyannaError(f"{run} has no data yet: run `lyanna train data` first")
    target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
    taps = check_taps(taps, target.config.num_layers)
    n_tokens = sum(len(reply_mask(r)[0]) for r in rows)
    size = n_tokens * len(taps) * target.config.hidden_size * 2 / 1e6
    print(f"features: {len(rows)} examples, {n_tokens} tokens, taps {list(taps)}, about {size:.0f} MB fp16")
    out = run / "features"
    out.mkdir(exist_ok=True)
    shards = [rows[i:i + SHARD_EXAMPLES] for i in range(0, len(rows), SHARD_EXAMPLES)]

    def current(k: int, shard: list) -> bool:
        path = out / f"shard-{k:05d}.safetensors"
        if not path.is_file():
            return False
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        return meta.get("ids") == json.dumps([r["id"] for r in shard]) and shard_taps(meta) == taps

    todo = [k for k, shard in enumerate(shards) if not current(k, shard)]
    for stale in sorted(out.glob("shard-*.safetensors"))[len(shards):]:
        stale.unlink()  # data shrank: features of examples that are gone
    bar = progress(n_tokens, "features", n_tokens - sum(len(reply_mask(r)[0]) for k in todo for r in shards[k]))
    bar.unit = "tok"
    engine = None if device else training_engine(target)
    hf = TargetFeatures(resolve_model(info["model"]), device, taps) if device and todo else None
    t0, done_tokens = time.perf_counter(), 0
    for k in todo:
        shard = shards[k]
        seqs = [reply_mask(r) for r in shard]
        feats: dict[int, np.ndarray] = {}
        if device:
            for got in hf.batches([ids for ids, _ in seqs]):
                for i, f in got:
                    feats[i] = f
                    bar.update(len(f))
        else:
            for i, (ids, _) in enumerate(seqs):
                feats[i] = target_features(engine, [ids], taps)[0].features.astype(np.float16)
                bar.update(len(ids))
        write_features(out, k, shard, [feats[i] for i in range(len(shard))], taps)
        done_tokens += sum(len(ids) for ids, _ in seqs)
    bar.close()
    if done_tokens:
        rate = done_tokens / (time.perf_counter() - t0)
        print(f"features: {done_tokens} tokens at {rate:.0f} tokens/s ({device or 'engine'})")
        stats = {"tokens": done_tokens, "seconds": round(time.perf_counter() - t0, 1), "device": device or "engine"}
        (out / "report.json").write_text(json.dumps(stats))
    return len(rows)


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


def stage_select(run: Path, mode: str, keep: float, seed: int, device: str | None = None,
                 features: str = "stored") -> Path:
    """Keep a fraction of the examples: the flattest (``flat``), a random one (``random``), or ``all``.
    ``features``: ``stored`` (the features stage's) or ``online`` (the final-norm features of each
    example computed here, through the Hugging Face model on ``device`` or the CPU, and dropped once
    scored: a run at scale needs no features on disk)."""
    from ..engines.loading import load_target, resolve_model

    if mode not in ("flat", "random", "all"):
        raise LyannaError(f"selection mode must be flat, random or all, got {mode!r}")
    if not 0 < keep <= 1:
        raise LyannaError(f"--keep must be in (0, 1], got {keep}")
    if features not in ("stored", "online"):
        raise LyannaError(f"--features must be stored or online, got {features!r}")
    info = run_info(run)
    examples = load_data_examples(run) if features == "online" else load_examples(run)
    ids = [eid for eid, _ in examples]
    if mode == "flat":
        target = load_target(info["model"], weight_format=TRAINING_WEIGHTS)
        head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
        if device:
            import torch

            head = torch.from_numpy(np.asarray(head, np.float32)).to(device)  # copied to the device once
        if features == "online":
            featurize = TargetFeatures(resolve_model(info["model"]), device or "cpu", (target.config.num_layers,))
            scores = [0.0] * len(examples)
            bar = progress(len(examples), "select (flatness)")
            for got in featurize.batches([ex.tokens for _, ex in examples]):
                for i, f in got:
                    scores[i] = flatness(f, head, examples[i][1].scored())
                bar.update(len(got))
            bar.close()
        else:  # the final norm's rows
            scores = [flatness(ex.features[:, -head.shape[1]:], head, ex.scored()) for _, ex in examples]
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
