"""Model configuration for the Llama family, read through transformers' ``AutoConfig``.

transformers interprets ``config.json`` (defaults, legacy keys, RoPE parameters); this module keeps
the few numbers our forward pass needs and refuses, with one line, what the engine cannot reproduce
exactly (other activations, biases it does not apply, RoPE that changes with the sequence length,
a sliding window on only some layers).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LyannaError

# Architecture -> transformers' model type (the module its config and rotary embedding live in).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
# Fields a config.json must state itself: transformers would otherwise fill in its defaults (a 7B shape).
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# RoPE types whose frequencies change with the sequence length: our engine precomputes them once.
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """The few numbers our forward pass needs; everything else in config.json is ignored."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # transformers' RoPE parameters; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # a query sees keys fewer than this many positions back (Mistral); None: all

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``model_dir/config.json`` with transformers' ``AutoConfig``; one-line errors."""
        from transformers import AutoConfig

        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise LyannaError(f"{path} not found: a model directory needs a config.json") from None
        except json.JSONDecodeError as e:
            raise LyannaError(f"{path} is not valid JSON ({e}); restore or re-create the file") from None
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise LyannaError(f"{path}: missing required field {missing[0]!r}")
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else {v: k for k, v in MODEL_TYPES.items()}.get(raw.get("model_type"), raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise LyannaError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            hf = AutoConfig.from_pretrained(str(model_dir))
        except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' ways of refusing a config
            raise LyannaError(f"{path}: transformers cannot read it: {str(e).splitlines()[0]}") from None
        return cls.from_hf(hf, arch, source=str(path))

    @classmethod
    def from_hf(cls, hf: Any, architecture: str, source: str = "config.json") -> "ModelConfig":
        """Our configuration from a transformers config object, refusing what the engine cannot honour."""
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise LyannaError(f"{source}: architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise LyannaError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise LyannaError(f"{source}: mlp_bias is not supported (no MLP biases in the engine)")
        qwen2 = architecture == "Qwen2ForCausalLM"  # Qwen2 always has q/k/v biases and no o_proj bias
        if not qwen2 and getattr(hf, "attention_bias", False):
            raise LyannaError(f"{source}: attention_bias is not supported for {architecture} (it biases o_proj too)")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = int(hf.num_attention_heads)
        eos = getattr(hf, "eos_token_id", None)
        config = cls(
            architecture=architecture,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type, "rope_theta": theta},
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=qwen2,
            eos_token_ids=tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else ((int(eos),) if eos is not None else ()),
            sliding_window=_sliding_window(hf, source),
        )
        rope_inv_freq(config, source)  # refuses a RoPE the engine cannot reproduce now, not at first use
        return config


def _sliding_window(hf: Any, source: str) -> int | None:
    """The attention window of every layer, None for full attention; a window on only some layers is refused."""
    window = getattr(hf, "sliding_window", None)
    if window is None or getattr(hf, "use_sliding_window", True) is False:  # Qwen2 states a window it does not use
        return None
    kinds = set(getattr(hf, "layer_types", None) or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise LyannaError(f"{source}: a sliding window on only some layers ({sorted(kinds)}) is not supported")
    if int(window) < 1:
        raise LyannaError(f"{source}: sliding_window must be >= 1, got {window}")
    return int(window)


def rope_inv_freq(config: ModelConfig, source: str = "config") -> np.ndarray:
    """RoPE inverse frequencies (fp32) from transformers' own rotary embedding for the architecture,
    so each RoPE type is computed exactly as Hugging Face computes it; refuses the types our engine
    cannot apply (frequencies that change with the sequence length, scaled cos/sin, partial rotary)."""
    from transformers import AutoConfig

    model_type = MODEL_TYPES[config.architecture]
    hf = AutoConfig.for_model(
        model_type, hidden_size=config.hidden_size, num_attention_heads=config.num_heads, head_dim=config.head_dim,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
    )
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    if rope_type in _DYNAMIC_ROPE:
        raise LyannaError(f"{source}: rope type {rope_type!r} is not supported (its frequencies change with the sequence length)")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    try:
        rotary = getattr(module, type(hf).__name__.removesuffix("Config") + "RotaryEmbedding")(hf)
    except (KeyError, ValueError, TypeError) as e:  # unknown rope type or missing parameters
        raise LyannaError(f"{source}: rope parameters {config.rope_scaling} are not usable: {e}") from None
    inv_freq = rotary.inv_freq.float().numpy().astype(np.float32)
    if float(rotary.attention_scaling) != 1.0:
        raise LyannaError(f"{source}: rope type {rope_type!r} scales cos/sin by {float(rotary.attention_scaling):.4f}; not supported")
    if inv_freq.shape != (config.head_dim // 2,):
        raise LyannaError(f"{source}: partial rotary embeddings are not supported")
    return inv_freq
