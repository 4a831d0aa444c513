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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as one fused kernel on a GPU (``RMSNorm`` below is Hugging Face's formula, kernel by
    kernel, for training); the same in fp32, within a rounding of it in bf16."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _half_rotated(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows (or a bias) ``w`` of ``heads`` heads such that ``w_rot @ h`` is RoPE's rotated half of
    ``w @ h``, ``cat(-second half, first half)`` per head: a sign and a permutation of rows, exact."""
    per_head = w.reshape(heads, head_dim, *w.shape[1:])
    half = head_dim // 2
    return torch.cat([-per_head[:, half:], per_head[:, :half]], dim=1).reshape(w.shape)


class PackedLayer:
    """A decoder layer's weights as the device path multiplies them, for few kernels a layer (on
    a GPU a small model's step is bound by how many kernels it launches, not by their work):
    one matmul gives q, k, their rotated halves and v (rows ``[q | k | q_rot | k_rot | v]``, so
    RoPE is two elementwise kernels for q and k together), one gives gate and up, the output
    and down projections add the residual in their matmul (``addmm``), and the norms are fused
    ``rms_norm``s. ``views`` names the slices that hold a Hugging Face layer's own weights."""

    def __init__(self, layer: "DecoderLayer", c: ModelConfig):
        attn, mlp = layer.self_attn, layer.mlp
        qk_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight])
        qk_heads = c.num_heads + c.num_kv_heads
        self.qkv = torch.cat([qk_w, _half_rotated(qk_w, qk_heads, c.head_dim), attn.v_proj.weight])
        self.qkv_bias = None
        if attn.q_proj.bias is not None:
            qk_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias])
            self.qkv_bias = torch.cat([qk_b, _half_rotated(qk_b, qk_heads, c.head_dim), attn.v_proj.bias])
        self.o = attn.o_proj.weight
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.down = mlp.down_proj.weight
        self.input_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps, self.config = layer.input_layernorm.eps, c

    def views(self) -> dict[str, torch.Tensor]:
        """Hugging Face parameter names (under ``model.layers.N.``) -> the packed tensors' slices
        that equal them, so a model whose weights this layer copied can hold these instead."""
        c, d = self.config, self.config.head_dim
        q, k = c.num_heads * d, c.num_kv_heads * d
        v0 = 2 * (q + k)
        names = {"self_attn.q_proj.weight": self.qkv[:q], "self_attn.k_proj.weight": self.qkv[q : q + k],
                 "self_attn.v_proj.weight": self.qkv[v0:],
                 "mlp.gate_proj.weight": self.gate_up[: c.intermediate_size],
                 "mlp.up_proj.weight": self.gate_up[c.intermediate_size :]}
        if self.qkv_bias is not None:
            names |= {"self_attn.q_proj.bias": self.qkv_bias[:q], "self_attn.k_proj.bias": self.qkv_bias[q : q + k],
                      "self_attn.v_proj.bias": self.qkv_bias[v0:]}
        return names

    def qkv_rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries and keys (rotated) and values of normalized rows ``h`` [n, hidden]:
        ``[heads, n, head dim]`` each (views of one product)."""
        c = self.config
        return _qkv(h, cos, sin, self.qkv, self.qkv_bias, c.num_heads, c.num_kv_heads)


def _qkv(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
         heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``PackedLayer.qkv_rows`` over the packed tensors themselves (what a compiled layer is given)."""
    n, d = h.shape[0], cos.shape[-1]
    qk_heads = heads + kv_heads
    proj = F.linear(h, qkv, qkv_bias)
    qk, qk_rot = proj[:, : qk_heads * d].view(n, qk_heads, d), proj[:, qk_heads * d : 2 * qk_heads * d].view(n, qk_heads, d)
    qk = torch.addcmul(qk * cos[:, None], qk_rot, sin[:, None]).transpose(0, 1)
    v = proj[:, 2 * qk_heads * d :].view(n, kv_heads, d).transpose(0, 1)
    return qk[:heads], qk[heads:], v


def _attention_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor,
                      qkv_bias: torch.Tensor | None, eps: float, heads: int, kv_heads: int, kv: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """A layer's first half: the input norm, the q/k/v product and RoPE; the rows' keys and
    values written into the cache ``kv`` at ``slots`` (compiled, in RoPE's kernel: Inductor
    scatters into the cache in place, no copy of it); the queries ``[heads, n, head dim]``."""
    q, k, v = _qkv(rms_norm(x, norm, eps), cos, sin, qkv, qkv_bias, heads, kv_heads)
    kv.index_copy_(2, slots, torch.stack([k, v]))
    return q


def _layer_rest(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, eps: float) -> torch.Tensor:
    """A layer's second half, from attention's output ``o`` [heads, n, head dim]: the output
    projection and residual, the post-attention norm, the MLP and its residual."""
    x = torch.addmm(x, o.transpose(0, 1).reshape(x.shape[0], -1), o_w.T)
    gate, up = F.linear(rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, down.T)


def _grouped_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, keys: int) -> torch.Tensor:
    """Attention of queries ``q`` [heads, n, head dim] over the first ``keys`` slots of ``kv``
    ([2, kv heads, slots, head dim]) under ``mask`` ([n, keys]: bool, or additive; None: all),
    written out (q·k, softmax in fp32, ·v) with the query heads of one key head side by side,
    so that no key or value is copied per query head; inside a compiled layer Inductor fuses the
    scale, the mask and the softmax around the two products."""
    heads, n, d = q.shape
    kv_heads = kv.shape[1]
    g = heads // kv_heads
    k, v = kv[0, :, :keys], kv[1, :, :keys]
    scores = (q.reshape(kv_heads, g * n, d) @ k.transpose(1, 2)).view(kv_heads, g, n, keys).float() * d ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, -1).to(q.dtype).view(kv_heads, g * n, keys)
    return (weights @ v).view(heads, n, d)


def _whole_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor,
                 qkv_bias: torch.Tensor | None, eps: float, heads: int, kv_heads: int, kv: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor | None, keys: int, o_w: torch.Tensor, post_norm: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A whole layer, attention included (``_attention_inputs``, ``_grouped_attention``,
    ``_layer_rest``): what ``LayerHalves(whole=True)`` compiles as one function."""
    q = _attention_inputs(x, cos, sin, norm, qkv, qkv_bias, eps, heads, kv_heads, kv, slots)
    return _layer_rest(x, _grouped_attention(q, kv, mask, keys), o_w, post_norm, gate_up, down, eps)


class LayerHalves:
    """The two halves of a layer around its attention, run as they are or
    compiled (``torch.compile``: on a GPU, Inductor fuses each half's norms, RoPE, residuals
    and SiLU·mul into a few kernels around the matmuls, where eager mode launches one kernel an
    operation). The cache write is in the first half (keys and values as one view of the slab,
    so no two inputs alias); attention stays outside, as one fused kernel of its own."""

    def __init__(self, compiled: bool, whole: bool = False):
        """``whole``: compile each layer as one function, its attention written out inside it
        (``_whole_layer``), instead of two around ``scaled_dot_product_attention`` (which, under
        a mask with grouped key heads, is not one fused kernel on every device); compiled only."""
        if whole and not compiled:
            raise ValueError("a whole layer is compiled: whole=True needs compiled=True")
        self.compiled = compiled
        self.whole = torch.compile(_whole_layer, fullgraph=True) if whole else None
        if compiled:
            # One compiled function serves every layer (its weights are arguments); shapes that
            # change (rows, keys) become symbolic after the first change instead of recompiling
            # each time, but each engine's sizes, dtypes and mask/no-mask add entries.
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64))
            self.first = torch.compile(_attention_inputs, fullgraph=True)
            self.second = torch.compile(_layer_rest, fullgraph=True)
        else:
            self.first, self.second = _attention_inputs, _layer_rest


EAGER = LayerHalves(compiled=False)


def attention_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean attention mask as the additive bias attention applies (0 where a row sees a key,
    -inf where not): what ``scaled_dot_product_attention`` makes of a boolean mask itself, made
    once for every layer of a pass instead of once a layer."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def cached_layer(p: PackedLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor | None, keys: int, halves: LayerHalves = EAGER) -> torch.Tensor:
    """A layer over rows ``x`` [n, hidden] of one sequence whose keys and values live in ``kv``
    ([2, kv heads, slots, head dim], keys then values): the rows' own are written at ``slots``,
    attention reads the first ``keys`` slots under ``mask`` ([n, keys]: bool, or its
    ``attention_bias``; None: all). The device engine's target layers and its draft heads' layers
    both run this; ``halves``: the layer's work around the cache eager or compiled (the same tokens)."""
    c = p.config
    if halves.whole is not None:
        return halves.whole(x, cos, sin, p.input_norm, p.qkv, p.qkv_bias, p.eps, c.num_heads, c.num_kv_heads, kv, slots,
                            mask, keys, p.o, p.post_norm, p.gate_up, p.down)
    q = halves.first(x, cos, sin, p.input_norm, p.qkv, p.qkv_bias, p.eps, c.num_heads, c.num_kv_heads, kv, slots)
    o = F.scaled_dot_product_attention(q[None], kv[0, None, :, :keys], kv[1, None, :, :keys], attn_mask=mask,
                                       enable_gqa=c.num_heads != c.num_kv_heads)
    return halves.second(x, o[0], p.o, p.post_norm, p.gate_up, p.down, p.eps)


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
