"""A training run's directory: its layout, its settings, and what every stage reads from it.

A run directory holds everything:
  run.json                      model and settings of the run
  data/shard-*.jsonl            self-distilled replies {"id", "prompt_ids", "output_ids"} or corpus
                                conversations {"id", "ids", "reply": [[start, end], ...]}
  features/shard-*.safetensors  fp16 target features (the taps' rows side by side, the final-norm
                                output last), tokens and reply mask per example; the shard's
                                example ids and taps in its metadata
  select/<name>.json            the example ids a selection keeps
  fit/<name>/state.safetensors  head and optimizer state (+ state.json: step, history)
Stages skip work already on disk, so a stopped run continues where it stopped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import LyannaError

# The pipeline computes the target on fp32 weights: the heads' torch modules take the target's
# embedding and LM head as fp32 tensors, and the shipped heads' data and features were made so.
TRAINING_WEIGHTS = "fp32"


SHARD_EXAMPLES = 256
# What a Lyanna fit does with a position whose token lies outside the draft vocabulary: ``score``
# it against the target's distribution renormalized over the draft vocabulary (what the shipped
# heads were fitted with), or ``mask`` it out of the loss, as EAGLE-3 does (the head can never
# draft that token, and the renormalized label says little of what to draft instead).
OUTSIDE_VOCAB = ("score", "mask")


def progress(total: int, desc: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="ex", dynamic_ncols=True, disable=os.environ.get("LYANNA_NO_PROGRESS") == "1")


def run_info(run: Path) -> dict[str, Any]:
    f = run / "run.json"
    if not f.is_file():
        raise LyannaError(f"{run} is not a training run (no run.json): start with `lyanna train data --run-dir {run}`")
    return json.loads(f.read_text())


def iter_data(run: Path) -> Iterator[dict[str, Any]]:
    for shard in sorted((run / "data").glob("shard-*.jsonl")):
        for line in shard.read_text().split("\n"):
            if line.strip():
                yield json.loads(line)


def start_run(run: Path, info: dict[str, Any]) -> None:
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


def write_shards(run: Path, rows: list[str], first: int) -> None:
    (run / "data").mkdir(exist_ok=True)  # a run grown only from merged copies has made none itself
    for k in range(0, len(rows), SHARD_EXAMPLES):
        idx = first + k // SHARD_EXAMPLES
        tmp = run / "data" / f".shard-{idx:05d}.tmp"
        tmp.write_text("\n".join(rows[k:k + SHARD_EXAMPLES]) + "\n")
        os.replace(tmp, run / "data" / f"shard-{idx:05d}.jsonl")  # a shard appears whole or not at all


def hf_model(model_dir: Path, device: str):
    """The Hugging Face model in fp32 on ``device`` (no TF32: the same function as the engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()


def hf_taps(out, taps: Sequence[int]):
    """The taps' rows side by side from a Hugging Face model's output (run with
    ``output_hidden_states`` unless the one tap is the final norm's): its ``hidden_states[l]``
    is the input of layer ``l`` and the last one the final norm's output, as the engine's taps."""
    import torch

    if out.hidden_states is None:
        return out.last_hidden_state
    return torch.cat([out.hidden_states[t] for t in taps], dim=-1)


def training_engine(target):
    from ..engines.transformer import Transformer

    return Transformer(target.config, target.weights)


def fitted_taps(settings: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The taps a fit's head reads, from its settings (a fit before multi-layer taps: the final norm's)."""
    return tuple(settings.get("taps", [num_layers]))


def head_layers_of(settings: dict[str, Any]) -> int:
    """The decoder layers of a fit's head, from its settings (a fit before deeper heads: one)."""
    return int(settings.get("head_layers", 1))


def shard_taps(metadata: dict[str, str]) -> tuple[int, ...]:
    """The taps a features shard holds (``tap``: a shard written before multi-layer taps)."""
    return tuple(json.loads(metadata["taps"])) if "taps" in metadata else (int(metadata.get("tap", -1)),)


def feature_taps(run: Path) -> tuple[int, ...]:
    """The target hidden states the run's features hold side by side, in that order."""
    from safetensors import safe_open

    found = set()
    for shard in sorted((run / "features").glob("shard-*.safetensors")):
        with safe_open(str(shard), "np") as f:
            found.add(shard_taps(f.metadata() or {}))
    if not found:
        raise LyannaError(f"{run} has no features yet: run `lyanna train features` first")
    if len(found) > 1:
        raise LyannaError(f"{run}'s feature shards hold different taps ({sorted(found)}): "
                          "rerun `lyanna train features` with the --taps you want")
    return found.pop()


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


def load_data_examples(run: Path, ids: set[str] | None = None, max_reply_tokens: int | None = None):
    """(id, Example without features) for every example of the run's data, in the order
    ``load_examples`` gives them (shards of ``SHARD_EXAMPLES`` rows, ids sorted within a shard as
    a features shard's keys are), so that a fit computing its features online trains and holds
    out the same examples as one reading them from the features stage."""
    from .corpus import reply_mask
    from .fit import Example

    rows = list(iter_data(run))
    if not rows:
        raise LyannaError(f"{run} has no data yet: run `lyanna train data` first")
    out, kept = [], 0
    for first in range(0, len(rows), SHARD_EXAMPLES):
        if max_reply_tokens is not None and kept >= max_reply_tokens:
            break
        for r in sorted(rows[first:first + SHARD_EXAMPLES], key=lambda r: f"{r['id']}/tokens"):
            if ids is None or r["id"] in ids:
                tokens, mask = reply_mask(r)
                out.append((r["id"], Example(tokens, None, mask)))
                kept += int(mask.sum())
    return out


def split_held_out(examples) -> tuple[list, list]:
    held = [e for i, e in enumerate(examples) if i % 20 == 19] or examples[-1:]
    train = [e for i, e in enumerate(examples) if i % 20 != 19] or examples
    return train, held


def token_frequencies(examples, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab, np.int64)
    for _, ex in examples:
        np.add.at(counts, ex.tokens[ex.scored()], 1)  # what the target writes is what gets drafted
    return counts


def draft_vocabulary(counts: np.ndarray, spec: int | float) -> np.ndarray:
    """The draft vocabulary: the most frequent target tokens (``counts``), ``spec`` of them, or,
    for ``spec`` in (0, 1), as few as cover that share of the target tokens (a token outside it
    is never drafted, so its coverage caps every depth's agreement)."""
    order = np.argsort(-counts, kind="stable")
    if isinstance(spec, float):
        if not 0.0 < spec < 1.0:
            raise LyannaError(f"a draft vocabulary's coverage must lie in (0, 1), got {spec}")
        covered = np.cumsum(counts[order]) / max(int(counts.sum()), 1)
        size = int(np.searchsorted(covered, spec)) + 1
    else:
        if spec < 1:
            raise LyannaError(f"a draft vocabulary needs at least one token, got {spec}")
        size = spec
    return order[: min(size, counts.size)]


def coverage(counts: np.ndarray, vocabulary: np.ndarray) -> float:
    """The share of the target tokens (``counts``) inside ``vocabulary``."""
    return float(counts[np.asarray(vocabulary)].sum() / max(int(counts.sum()), 1))


def write_features(out: Path, k: int, shard: list[dict[str, Any]], feats: list[np.ndarray], taps: Sequence[int]) -> None:
    """Features shard ``k``: tokens, fp16 features and assistant mask of each example, the
    shard's example ids and taps in its metadata (how a stale shard is recognized)."""
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
    save_file(tensors, str(out / f".{path.name}.tmp"),
              metadata={"taps": json.dumps([int(t) for t in taps]), "ids": json.dumps([r["id"] for r in shard])})
    os.replace(out / f".{path.name}.tmp", path)
