"""Llama-family layers in PyTorch, in Hugging Face weight layout (parameter names are the
checkpoint's names under ``model.layers.N.``): the draft heads' training twins and the device
engine's target layers are built from them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in Hugging Face's half-split layout (``cos``/``sin`` repeat their halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotation(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin for ``positions`` ([n] int) in ``dtype``, angles in fp32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def project_kv(layer: "DecoderLayer", c: ModelConfig, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated) and values of normalized rows ``h`` [n, hidden], ``[kv heads, n, head dim]`` each."""
    attn, n = layer.self_attn, h.shape[0]
    k = rope(attn.k_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)
    return k, attn.v_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)


def cached_layer(layer: "DecoderLayer", c: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
                 keys: int) -> torch.Tensor:
    """``layer`` over rows ``x`` [n, hidden] of one sequence whose keys and values live in
    ``k_cache``/``v_cache`` ([kv heads, slots, head dim]): the rows' own are written at ``slots``,
    attention reads the first ``keys`` slots under ``mask`` ([n, keys] bool; None: all). The
    device engine's target layers and its draft heads' layer both run this."""
    attn, n = layer.self_attn, x.shape[0]
    h = layer.input_layernorm(x)
    k, v = project_kv(layer, c, h, cos, sin)
    k_cache.index_copy_(1, slots, k)
    v_cache.index_copy_(1, slots, v)
    q = rope(attn.q_proj(h).view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)
    o = F.scaled_dot_product_attention(q[None], k_cache[None, :, :keys], v_cache[None, :, :keys], attn_mask=mask,
                                       enable_gqa=c.num_heads != c.num_kv_heads)
    x = x + attn.o_proj(o[0].transpose(0, 1).reshape(n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In float32 whatever ``x`` is (as Hugging Face's Llama does), back to its dtype before the scale."""
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama-family pre-norm decoder layer, causal over the sequence."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))
