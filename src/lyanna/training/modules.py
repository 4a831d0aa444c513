"""Torch twins of the draft head for training, in Hugging Face weight layout.

Parameter names match the checkpoint names read by ``drafters.head.DraftHead`` (``fc.*``,
``layer.*``), and a test checks that both forward passes agree.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


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
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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


class EagleHead(nn.Module):
    """fc([feature ; embedding(token)]) -> one decoder layer -> predicted next feature.

    Embedding and LM head are the target's, frozen (buffers, not parameters).
    """

    def __init__(self, c: ModelConfig, embed: np.ndarray, lm_head: np.ndarray):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layer = DecoderLayer(c)
        self.register_buffer("embed", torch.from_numpy(np.asarray(embed, np.float32)), persistent=False)
        self.register_buffer("lm_head", torch.from_numpy(np.asarray(lm_head, np.float32)), persistent=False)
        self.register_buffer("inv_freq", torch.from_numpy(rope_inv_freq(c)), persistent=False)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        x = self.fc(torch.cat([features, self.embed[tokens]], dim=-1))
        return self.layer(x, angles.cos(), angles.sin())

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.lm_head.T

    def restrict_loss_vocab(self, ids: np.ndarray) -> None:
        """Compute the training classification term over these target tokens only (the
        frequent ones): the full-vocabulary LM head in every unrolled step dominates the cost
        of fitting on a CPU. Drafting still uses the whole LM head."""
        self.register_buffer("loss_lm", self.lm_head[torch.as_tensor(np.asarray(ids), dtype=torch.long)].clone(),
                             persistent=False)

    def loss_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits the classification loss compares: the full vocabulary unless restricted."""
        return features @ getattr(self, "loss_lm", self.lm_head).T

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        c, attn = self.c, self.layer.self_attn
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        h = self.layer.input_layernorm(x)
        t = x.shape[0]
        q = _rope(attn.q_proj(h).view(t, c.num_heads, c.head_dim), cos, sin)
        k = _rope(attn.k_proj(h).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, attn.v_proj(h).view(t, c.num_kv_heads, c.head_dim)

    def _step(self, x: torch.Tensor, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
              own_k: list[torch.Tensor], own_v: list[torch.Tensor], offset: int = 0) -> torch.Tensor:
        """Rows ``offset..`` of the pair context as queries; each sees the pairs up to its own."""
        c = self.c
        t, g = x.shape[0], c.num_heads // c.num_kv_heads
        n = ctx_k.shape[0]
        qg = q.view(t, c.num_kv_heads, g, c.head_dim) / c.head_dim ** 0.5
        s = torch.einsum("tkgd,skd->tkgs", qg, ctx_k)
        causal = torch.ones(t, n, dtype=torch.bool, device=x.device).tril(offset)
        s = s.masked_fill(~causal[:, None, None, :], float("-inf"))
        if own_k:
            s = torch.cat([s, torch.stack([(qg * k[:, :, None, :]).sum(-1) for k in own_k], -1)], -1)
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("tkgs,skd->tkgd", p[..., :n], ctx_v)
        if own_k:
            o = o + torch.einsum("tkgj,jtkd->tkgd", p[..., n:], torch.stack(own_v))
        x = x + self.layer.self_attn.o_proj(o.reshape(t, -1))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def _chain_input(self, f: torch.Tensor, tokens: torch.Tensor, k: int, start: int) -> torch.Tensor:
        """Input of chain step k >= 2 for the roots from row ``start``: [f_{k-1} ; embedding of
        the token at root + k - 1]."""
        shifted = torch.zeros_like(tokens[1:])
        n = len(tokens) - k
        if n > 0:
            shifted[:n] = tokens[k : k + n]  # rows past the end are padding: no label uses them
        return self.fc(torch.cat([f, self.embed[shifted[start:]]], dim=-1))

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, depth: int, start: int = 0) -> list[torch.Tensor]:
        """Chain features ``f_1..f_depth`` for the roots at positions 1 + start..T-1 (pair i =
        (feature after token i-1, token i)); row j of step k (root row ``start + j``) predicts the
        token at position start + j + 1 + k.

        Every step attends to the pairs up to its root and to the earlier steps of its own chain,
        exactly as the drafter does at decode time. ``start`` skips roots whose drafts nobody
        needs (the prompt) while keeping all pairs as context."""
        positions = torch.arange(1, len(tokens), device=features.device)
        x = self.fc(torch.cat([features[:-1], self.embed[tokens[1:]]], dim=-1))
        q, ctx_k, ctx_v = self._qkv(x, positions)
        f = self._step(x[start:], q[start:], ctx_k, ctx_v, [], [], start)
        out = [f]
        own_k: list[torch.Tensor] = []
        own_v: list[torch.Tensor] = []
        for k in range(2, depth + 1):
            x = self._chain_input(f, tokens, k, start)
            q, kk, vv = self._qkv(x, positions[start:] + k - 1)
            own_k.append(kk)
            own_v.append(vv)
            f = self._step(x, q, ctx_k, ctx_v, own_k, own_v, start)
            out.append(f)
        return out

    def numpy_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}


class LyannaHead(EagleHead):
    """The Lyanna draft head: EAGLE's pair input for the first chain step, then ``f_k =
    layer(f_{k-1})`` with no token; raw logits over the draft vocabulary; low-rank token info
    ``A[y] @ B``."""

    def __init__(self, c: ModelConfig, embed: np.ndarray, lm_head: np.ndarray, d2t: np.ndarray, rank: int):
        super().__init__(c, embed, lm_head)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("d2t", torch.as_tensor(np.asarray(d2t), dtype=torch.long))
        self.register_buffer("draft_lm", self.lm_head[self.d2t].clone(), persistent=False)
        self.ti = nn.Module()
        self.ti.a = nn.Parameter(torch.randn(c.vocab_size, rank) * 0.01)
        self.ti.b = nn.Parameter(torch.zeros(rank, len(d2t)))

    def raw_logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.norm(f) @ self.draft_lm.T

    def token_info(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ti.a[tokens] @ self.ti.b

    def _chain_input(self, f: torch.Tensor, tokens: torch.Tensor, k: int, start: int) -> torch.Tensor:
        return f  # the hidden-state chain: no token enters after the first step

