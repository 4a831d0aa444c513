"""Draft-head checkpoints: safetensors weights plus a JSON config naming the target they fit.

A head trained for one target is meaningless on another (it reads that target's hidden states and
shares its embedding and LM head), so loading checks a fingerprint of the target and refuses a
mismatch with a one-line error.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..engines.loading import Target
from ..errors import LyannaError
from .base import Drafter

FORMAT = "lyanna-draft-head"
VERSION = 1
# A decoder layer's tensors, in Hugging Face's names under the layer's prefix.
_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
          "mlp.up_proj.weight", "mlp.down_proj.weight")
_ATTENTION_BIASES = tuple(f"self_attn.{n}.bias" for n in ("q_proj", "k_proj", "v_proj"))


def layer_prefixes(count: int) -> list[str]:
    """The names a head's ``count`` decoder layers go by: ``layer.`` first (the only one of a
    one-layer head, so every checkpoint from before deeper heads loads as it was), then
    ``layer2.``, ``layer3.``, ... each reading the one before's output."""
    return ["layer."] + [f"layer{i}." for i in range(2, count + 1)]


def head_layer_count(weights: dict[str, Any]) -> int:
    """How many decoder layers a head's tensors hold (``layer_prefixes``)."""
    count = 1
    while f"layer{count + 1}.input_layernorm.weight" in weights:
        count += 1
    return count


def _required_tensors(head_tensors: tuple[str, ...], target: Target, layers: int) -> tuple[str, ...]:
    """The tensor names a complete head for ``target`` holds: its own ``head_tensors``, each of its
    ``layers`` decoder layers, with attention biases where the target's layers have them."""
    per_layer = _LAYER + (_ATTENTION_BIASES if target.config.attention_bias else ())
    return head_tensors + tuple(p + n for p in layer_prefixes(layers) for n in per_layer)


def target_fingerprint(target: Target, taps: int | Sequence[int]) -> dict[str, Any]:
    """What a head depends on: shapes, the tapped layers, and a hash of (a sample of) the LM head.
    One tap is written as ``tap`` (what every single-tap checkpoint holds), several as ``taps``."""
    c = target.config
    head = target.weights.get("lm_head.weight", target.weights["model.embed_tokens.weight"])
    sample = np.ascontiguousarray(head[:: max(1, head.shape[0] // 512)], dtype=np.float32)
    taps = [int(taps)] if isinstance(taps, (int, np.integer)) else [int(t) for t in taps]
    return {
        "architecture": c.architecture,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "num_layers": c.num_layers,
        **({"tap": taps[0]} if len(taps) == 1 else {"taps": taps}),
        "lm_head_sha256": hashlib.sha256(sample.tobytes()).hexdigest()[:16],
    }


def check_taps(taps: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """``taps`` as a tuple, if they are what a head can read: distinct hidden-state indices in
    ascending order, the last the final-norm output (``num_layers``: the features the head's
    labels and chain come from). Index ``l < num_layers`` is the input of layer ``l``. None: the
    final-norm output alone (what every head read before multi-layer taps)."""
    taps = (num_layers,) if taps is None else tuple(int(t) for t in taps)
    if not taps or list(taps) != sorted(set(taps)) or taps[0] < 0 or taps[-1] != num_layers:
        raise LyannaError(f"taps {list(taps)}: need distinct layer indices in ascending order from 0, "
                          f"ending with the final-norm output {num_layers}")
    return taps


def head_taps(config: dict[str, Any], num_layers: int, path: str | Path) -> tuple[int, ...]:
    """The target hidden states a checkpoint's head reads (``taps``, or the single ``tap`` every
    checkpoint before multi-layer taps names)."""
    fingerprint = config["target"]
    taps = fingerprint.get("taps", [fingerprint.get("tap", -1)])
    if not isinstance(taps, list) or not all(isinstance(t, int) for t in taps):
        raise LyannaError(f"{path}: target taps must be a list of layer indices, got {taps!r}")
    try:
        return check_taps(taps, num_layers)
    except LyannaError as e:
        raise LyannaError(f"{path}: {e}") from None


def save_head(out_dir: str | Path, arch: str, weights: dict[str, np.ndarray], target: Target, taps: int | Sequence[int],
              settings: dict[str, Any] | None = None) -> Path:
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32 if v.dtype.kind == "f" else v.dtype) for k, v in weights.items()},
              str(out / "model.safetensors"))
    config = {"format": FORMAT, "version": VERSION, "arch": arch, "target": target_fingerprint(target, taps),
              "settings": settings or {}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_head(path: str | Path, target: Target, head: type[Drafter]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a checkpoint of the draft head class ``head`` for ``target``; refuses other formats,
    archs and targets, and checkpoints missing a tensor of ``head.TENSORS`` or of its layer."""
    arch = head.ARCH
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    cfg_file, weights_file = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise LyannaError(f"{path} is not a draft checkpoint: it needs config.json and model.safetensors")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LyannaError(f"{cfg_file} is not valid JSON ({e})") from None
    if config.get("format") != FORMAT:
        raise LyannaError(f"{cfg_file} is not a Lyanna draft-head config (format {config.get('format')!r})")
    if config.get("arch") != arch:
        raise LyannaError(f"{path} holds a {config.get('arch')!r} head, not {arch!r}")
    if not isinstance(config.get("target"), dict):
        raise LyannaError(f"{cfg_file} has no target fingerprint: re-export the head with `lyanna train export`")
    taps = head_taps(config, target.config.num_layers, path)
    expected = target_fingerprint(target, taps)
    for key, want in expected.items():
        got = config["target"].get(key)
        if got != want:
            raise LyannaError(
                f"{path} was trained for another target ({key}: {got!r}, this target has {want!r}); "
                "train a head for this model with `lyanna train`"
            )
    try:
        weights = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LyannaError(f"cannot read {weights_file}: {str(e).splitlines()[0]}; the file is truncated or corrupt") from None
    required = (_required_tensors(head.TENSORS, target, head_layer_count(weights))
                + (("taps_fc.weight",) if len(taps) > 1 else ()))
    missing = [name for name in required if name not in weights]
    if missing:
        raise LyannaError(f"{weights_file} is an incomplete {arch} head: missing {', '.join(missing)}; "
                          "restore the file or re-export it with `lyanna train export`")
    h = target.config.hidden_size
    if len(taps) > 1 and weights["taps_fc.weight"].shape != (h, len(taps) * h):
        raise LyannaError(f"{weights_file}: taps_fc.weight has shape {weights['taps_fc.weight'].shape}, "
                          f"expected {(h, len(taps) * h)} for taps {list(taps)}")
    return config, weights


def decode_settings(config: dict[str, Any], defaults: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The drafter's decode settings (tree depth, width, top-k, ...): its own ``defaults``, overridden
    by the checkpoint's ``settings.decode`` where a head was tuned for other values. The other
    ``settings`` describe training (its ``depth`` is the training unroll, not the decode depth)."""
    given = (config.get("settings") or {}).get("decode") or {}
    if not isinstance(given, dict):
        raise LyannaError(f"{path}: settings.decode must be an object, got {given!r}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise LyannaError(f"{path}: unknown decode settings {', '.join(unknown)} (known: {', '.join(sorted(defaults))})")
    for key, value in given.items():
        if type(value) is not type(defaults[key]):
            raise LyannaError(f"{path}: decode setting {key} must be a {type(defaults[key]).__name__}, got {value!r}")
    return {**defaults, **given}
