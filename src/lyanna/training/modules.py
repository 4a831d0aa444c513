"""Torch twins of the draft head for training, in Hugging Face weight layout.

Parameter names match the checkpoint names read by ``drafters.head.DraftHead`` (``fc.*``,
``layer.*``, a deeper head's ``layer2.*`` ...), and a test checks that both forward passes agree.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..engines.config import ModelConfig, rope_inv_freq
from ..engines.torch_layers import DecoderLayer, RMSNorm, rope


def pair_segments(segments: torch.Tensor) -> torch.Tensor:
    """Segment of each pair row j (tokens j and j + 1 of a packed row); -1 where the pair
    straddles two sequences or padding."""
    a, b = segments[:, :-1], segments[:, 1:]
    return torch.where((a == b) & (b >= 0), b, torch.full_like(b, -1))


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its own sequence (0 at each sequence's first token)."""
    idx = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


class EagleHead(nn.Module):
    """fc([feature ; embedding(token)]) -> one decoder layer (or ``layers``, each reading the
    one before's output) -> predicted next feature.

    Embedding and LM head are the target's, frozen (buffers, not parameters).
    """

    def __init__(self, c: ModelConfig, embed: np.ndarray, lm_head: np.ndarray, taps: int = 1, layers: int = 1):
        super().__init__()
        self.c = c
        # Several taps' rows, side by side, are projected to one feature before the pair input.
        self.taps_fc = nn.Linear(taps * c.hidden_size, c.hidden_size, bias=False) if taps > 1 else None
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layer = DecoderLayer(c)
        for i in range(2, layers + 1):  # named as the checkpoint names them (``checkpoint.layer_prefixes``)
            setattr(self, f"layer{i}", DecoderLayer(c))
        self.layers = [self.layer] + [getattr(self, f"layer{i}") for i in range(2, layers + 1)]
        self.register_buffer("embed", torch.from_numpy(np.asarray(embed, np.float32)), persistent=False)
        self.register_buffer("lm_head", torch.from_numpy(np.asarray(lm_head, np.float32)), persistent=False)
        self.register_buffer("inv_freq", torch.from_numpy(rope_inv_freq(c)), persistent=False)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rotation(positions)
        x = self.fc(torch.cat([features, self.embed[tokens]], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x

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

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at ``positions`` (any shape; a trailing axis of size 1 gives the
        [B, N, 1, head_dim] that ``_qkv`` broadcasts over heads), once for all layers."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _qkv(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``layer``'s q, k, v of ``x`` [B, N, H] under RoPE's ``cos``/``sin`` (``_rotation``)."""
        c, attn = self.c, layer.self_attn
        h = layer.input_layernorm(x)
        b, t = x.shape[:2]
        q = rope(attn.q_proj(h).view(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rope(attn.k_proj(h).view(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, attn.v_proj(h).view(b, t, c.num_kv_heads, c.head_dim)

    def _step(self, layer: DecoderLayer, x: torch.Tensor, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
              own_k: list[torch.Tensor], own_v: list[torch.Tensor], ctx_mask: torch.Tensor) -> torch.Tensor:
        """``layer``'s step for every row of ``x`` [B, N, H]: attention to the pair context where
        ``ctx_mask`` [B, N, N] allows, and to the earlier steps of the row's own chain."""
        c = self.c
        b, t, g = x.shape[0], x.shape[1], c.num_heads // c.num_kv_heads
        qg = q.view(b, t, c.num_kv_heads, g, c.head_dim) / c.head_dim ** 0.5
        s = torch.einsum("btkgd,bskd->btkgs", qg, ctx_k)
        s = s.masked_fill(~ctx_mask[:, :, None, None, :], float("-inf"))
        n = s.shape[-1]
        if own_k:
            s = torch.cat([s, torch.stack([(qg * k[:, :, :, None, :]).sum(-1) for k in own_k], -1)], -1)
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("btkgs,bskd->btkgd", p[..., :n], ctx_v)
        if own_k:
            o = o + torch.einsum("btkgj,jbtkd->btkgd", p[..., n:], torch.stack(own_v))
        x = x + layer.self_attn.o_proj(o.reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _chain_input(self, f: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Input of chain step k >= 2 for every root row j: [f_{k-1} ; embedding of token
        j + k] (the token the previous step predicted, teacher-forced)."""
        shifted = torch.zeros_like(tokens[:, 1:])
        n = tokens.shape[1] - k
        if n > 0:
            shifted[:, :n] = tokens[:, k : k + n]  # rows past the end are padding: no label uses them
        return self.fc(torch.cat([f, self.embed[shifted]], dim=-1))

    def unroll_batch(self, features: torch.Tensor, tokens: torch.Tensor, segments: torch.Tensor,
                     depth: int) -> list[torch.Tensor]:
        """Chain features ``f_1..f_depth`` [B, L-1, H] of packed rows: ``features`` [B, L, taps * H],
        ``tokens`` [B, L], ``segments`` [B, L] (which sequence each position belongs to; -1 for
        padding). Pair row j = (feature after token j, token j + 1); row j of step k predicts the
        token at position j + 1 + k. Each step attends (in every layer) to the pairs of its own
        sequence up to its root and to the earlier steps of its own chain, exactly as the drafter
        does at decode time."""
        pseg = pair_segments(segments)
        n = pseg.shape[1]
        idx = torch.arange(n, device=features.device)
        ctx_mask = (idx[None, :, None] >= idx[None, None, :]) & (pseg[:, :, None] == pseg[:, None, :]) & (pseg[:, None, :] >= 0)
        ctx_mask = ctx_mask | torch.eye(n, dtype=torch.bool, device=features.device)  # a padding row sees itself: no NaN
        positions = segment_positions(segments)[:, 1:]
        taps = features[:, :-1]
        x = self.fc(torch.cat([taps if self.taps_fc is None else self.taps_fc(taps), self.embed[tokens[:, 1:]]], dim=-1))
        ctx = []  # each layer's keys and values of the pair rows
        rot = self._rotation(positions[..., None])
        for layer in self.layers:
            q, ctx_k, ctx_v = self._qkv(layer, x, *rot)
            ctx.append((ctx_k, ctx_v))
            x = self._step(layer, x, q, ctx_k, ctx_v, [], [], ctx_mask)
        f = x
        out = [f]
        own: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in self.layers]
        for k in range(2, depth + 1):
            x = self._chain_input(f, tokens, k)
            rot = self._rotation((positions + k - 1)[..., None])
            for layer, (ctx_k, ctx_v), (own_k, own_v) in zip(self.layers, ctx, own):
                q, kk, vv = self._qkv(layer, x, *rot)
                own_k.append(kk)
                own_v.append(vv)
                x = self._step(layer, x, q, ctx_k, ctx_v, own_k, own_v, ctx_mask)
            f = x
            out.append(f)
        return out

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, depth: int, start: int = 0) -> list[torch.Tensor]:
        """``unroll_batch`` of one sequence (``features`` [T, H], ``tokens`` [T]): rows for the
        roots at positions 1 + start..T-1."""
        seg = torch.zeros(1, len(tokens), dtype=torch.long, device=features.device)
        return [f[0, start:] for f in self.unroll_batch(features[None], tokens[None], seg, depth)]

    def numpy_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}


class LyannaHead(EagleHead):
    """The Lyanna draft head: EAGLE's pair input for the first chain step, then ``f_k =
    layer(f_{k-1})`` with no token; raw logits over the draft vocabulary; low-rank token info
    ``A[y] @ B``."""

    def __init__(self, c: ModelConfig, embed: np.ndarray, lm_head: np.ndarray, d2t: np.ndarray, rank: int,
                 taps: int = 1, layers: int = 1):
        super().__init__(c, embed, lm_head, taps, layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("d2t", torch.as_tensor(np.asarray(d2t), dtype=torch.long))
        self.ti = nn.Module()
        self.ti.a = nn.Parameter(torch.randn(c.vocab_size, rank) * 0.01)
        self.ti.b = nn.Parameter(torch.zeros(rank, len(d2t)))

    @property
    def draft_lm(self) -> torch.Tensor:
        """The LM head's rows of the draft vocabulary, gathered from ``d2t`` when asked (a
        resumed fit loads its saved ``d2t`` over the one the head was built with)."""
        return self.lm_head[self.d2t]

    def raw_logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.norm(f) @ self.draft_lm.T

    def token_info(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ti.a[tokens] @ self.ti.b

    def _chain_input(self, f: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        return f  # the hidden-state chain: no token enters after the first step

