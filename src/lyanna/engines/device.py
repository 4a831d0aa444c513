"""The target on a torch device with our own forward pass and a static KV cache (the GPU path).

``torch_engine.TorchEngine`` runs transformers' model with a ``DynamicCache`` that is rebuilt by
``index_select`` after every verification; it stays the correctness oracle and covers models we
do not. This engine owns its layers (``torch_layers``, the Hugging Face layout, the weights the
numpy engine reads: safetensors, or a GGUF's blocks dequantized) and keeps each sequence's keys
and values in one tensor preallocated to its capacity on the device: a block's rows are written
in place at their slots, the tree mask is built on the device, only the wanted rows go through
the LM head, and compaction moves the accepted rows into place with one gather per tensor. The
loop, verifier and drafters see the same ``TargetEngine`` as everywhere else.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import LyannaError
from .base import Block, ForwardOutput, TargetEngine, block_inputs, compaction
from .config import ModelConfig, rope_inv_freq
from .loading import Target, load_target
from .quant import QuantMatrix
from .torch_layers import DecoderLayer, RMSNorm, rope

DTYPES = ("float32", "bfloat16", "float16")


class StaticCache:
    """One sequence's keys and values, ``[layers, kv heads, capacity, head dim]`` each on the
    device; slot ``i`` holds position ``i`` of the committed sequence, ``length`` slots are valid."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.length = k, v, 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def compact(self, start: int, keep: Sequence[int] | np.ndarray) -> None:
        """Keep block slots ``start + keep[i]`` (in that order) after the prefix, drop the rest."""
        keep = compaction(start, self.length, keep)
        n = keep.size
        if n and not np.array_equal(keep, np.arange(n)):  # otherwise the kept rows are in place
            rows = torch.from_numpy(start + keep).to(self.k.device)
            self.k[:, :, start : start + n] = self.k.index_select(2, rows)
            self.v[:, :, start : start + n] = self.v.index_select(2, rows)
        self.length = start + n


class DeviceEngine(TargetEngine):
    """A Llama-family target (Llama, Mistral, Qwen2 layouts) on ``device`` in ``dtype``."""

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str = "cpu", dtype: str = "float32"):
        """``weights``: Hugging Face names to fp32 arrays or GGUF blocks (``loading.load_target``)."""
        if dtype not in DTYPES:
            raise LyannaError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise LyannaError(f"device {device!r}: {e}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LyannaError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
        self.config = c = config
        self.dtype = getattr(torch, dtype)
        self.name = f"device-{self.device.type}-{dtype}"

        def host(name: str) -> np.ndarray:
            try:
                w = weights[name]
            except KeyError:
                raise LyannaError(f"weight {name!r} is missing from the checkpoint; is it a complete {c.architecture}?") from None
            return w.dense() if isinstance(w, QuantMatrix) else np.ascontiguousarray(w, dtype=np.float32)

        # What the drafters share, as host fp32 arrays (base.TargetEngine).
        self.embed = host("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise LyannaError(f"embedding shape {self.embed.shape} does not match config ({c.vocab_size}, {c.hidden_size})")
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights else host("lm_head.weight")
        self.final_norm = host("model.norm.weight")
        self.inv_freq = rope_inv_freq(c)

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device, self.dtype)

        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        for i, layer in enumerate(self.layers):
            layer.load_state_dict({k: torch.from_numpy(host(f"model.layers.{i}.{k}")) for k in layer.state_dict()})
        self.layers.to(self.device, self.dtype).eval().requires_grad_(False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm.load_state_dict({"weight": torch.from_numpy(self.final_norm)})
        self.norm.to(self.device, self.dtype).requires_grad_(False)
        self._embed = put(self.embed)
        self._lm_head = self._embed if self.lm_head is self.embed else put(self.lm_head)
        self._inv_freq = torch.from_numpy(self.inv_freq).to(self.device)

    def new_cache(self, capacity: int) -> StaticCache:
        c = self.config
        shape = (c.num_layers, c.num_kv_heads, capacity, c.head_dim)
        return StaticCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))

    def forward_batch(self, blocks: Sequence[Block]) -> list[ForwardOutput]:
        """The blocks one after another, each on its own cache; every block is checked before any runs."""
        if len({id(b.cache) for b in blocks}) != len(blocks):
            raise ValueError("each block of a batch needs its own cache")
        prepared = [(b, *block_inputs(self.config, b)) for b in blocks]
        with torch.inference_mode():
            return [self._run(*p) for p in prepared]

    def _mask(self, start: int, positions: torch.Tensor, within: np.ndarray | None) -> torch.Tensor | None:
        """Which of the ``start + n`` slots each block row sees: the cached prefix, the block's own
        ancestors (``within``; None: a single row), keys inside a sliding window. None: all."""
        n, window = positions.shape[0], self.config.sliding_window
        if within is None and window is None:
            return None
        allowed = torch.ones((n, start + n), dtype=torch.bool, device=self.device)
        if within is not None:
            allowed[:, start:] = torch.from_numpy(within).to(self.device)
        if window is not None:
            keys = torch.cat([torch.arange(start, device=self.device), positions])
            allowed &= positions[:, None] - keys[None, :] < window
        return allowed

    def _run(self, b: Block, tokens: np.ndarray, positions: np.ndarray, within: np.ndarray | None) -> ForwardOutput:
        c, cache = self.config, b.cache
        n, start = tokens.shape[0], cache.length
        end = start + n
        pos = torch.from_numpy(positions).to(self.device)
        angles = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        mask = self._mask(start, pos, within)
        x = self._embed[torch.from_numpy(tokens).to(self.device)]
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in b.taps:
                hidden[li] = x
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q = rope(attn.q_proj(h).view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)
            cache.k[li, :, start:end] = rope(attn.k_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)
            cache.v[li, :, start:end] = attn.v_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[None], cache.k[li, :, :end][None], cache.v[li, :, :end][None],
                                               attn_mask=mask, enable_gqa=c.num_heads != c.num_kv_heads)
            x = x + attn.o_proj(o[0].transpose(0, 1).reshape(n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.length = end
        rows = torch.from_numpy(np.arange(n)[slice(None) if b.logit_rows is None else b.logit_rows]).to(self.device)
        if c.num_layers in b.taps:  # the final norm of every row is wanted: normalize once, pick after
            hidden[c.num_layers] = self.norm(x)
            normed = hidden[c.num_layers][rows]
        else:
            normed = self.norm(x[rows])
        logits = normed @ self._lm_head.T
        return ForwardOutput(logits=_host(logits), hidden={tap: _host(hidden[tap]) for tap in b.taps})


def _host(t: torch.Tensor) -> np.ndarray:
    """A device tensor as a host fp32 array."""
    return t.detach().float().cpu().numpy()


def load_device_target(name_or_path: str, device: str = "cpu", dtype: str = "float32") -> tuple[Target, DeviceEngine]:
    """A target (config, tokenizer, fp32 host weights for the drafters) and its device engine."""
    target = load_target(name_or_path, weight_format="fp32")
    return target, DeviceEngine(target.config, target.weights, device, dtype)
