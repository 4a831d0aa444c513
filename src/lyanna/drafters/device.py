"""The draft heads on the target's torch device (the GPU path).

On a ``DeviceEngine`` a draft head runs where the target does: the catch-up over committed pairs,
the head's steps, and for ``lyanna`` the chain, the raw logits over the draft vocabulary and the
trees built from them stay on the device; only candidate nodes (a few dozen token ids, parents
and scores) cross to the host to become a ``DraftTree``. ``DeviceDraftHead`` has the interface
of ``head.DraftHead`` (what ``PairContext`` and ``EagleDrafter`` call), ``DeviceChainHead`` that
of ``lyanna.ChainHead``; the same numbers up to floating-point rounding.

Token information is computed on the fly, ``TI(parent) = A[parent] @ B`` for the whole frontier
in one product: the hot-row table is a CPU optimization (a row read instead of a rank-r product),
while on a GPU the product is one small matmul. A ``TokenInfo`` with ``fallback == "none"`` still
gives cold parents no token information, as on the host.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..engines.config import ModelConfig
from ..engines.torch_layers import DecoderLayer, RMSNorm, rope
from ..errors import LyannaError
from .tree import DraftTree


class HeadCache:
    """The head's keys and values on the device, ``[1, kv heads, capacity, head dim]`` (the
    layout ``PairContext`` grows by copying slices)."""

    def __init__(self, c: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (1, c.num_kv_heads, capacity, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


class DeviceDraftHead:
    """The fusion layer and the head's decoder layer in torch, on the engine's device and in its
    dtype; the embedding and LM head are the engine's own tensors."""

    def __init__(self, engine, weights: dict[str, np.ndarray]):
        """``engine``: a ``DeviceEngine``; ``weights``: the checkpoint's tensors (host arrays)."""
        c = self.config = engine.config
        self.device, self.dtype = engine.device, engine.dtype
        fc_w = self._weight(weights, "fc.weight")
        if tuple(fc_w.shape) != (c.hidden_size, 2 * c.hidden_size):
            raise LyannaError(f"draft head fc.weight has shape {tuple(fc_w.shape)}, expected {(c.hidden_size, 2 * c.hidden_size)}")
        self.fc = torch.nn.Linear(2 * c.hidden_size, c.hidden_size)
        self.fc.load_state_dict({"weight": fc_w, "bias": self._weight(weights, "fc.bias")})
        self.layer = DecoderLayer(c)
        self.layer.load_state_dict({k: self._weight(weights, f"layer.{k}") for k in self.layer.state_dict()})
        for m in (self.fc, self.layer):
            m.to(self.device, self.dtype).eval().requires_grad_(False)
        self._embed = engine._embed
        self._lm_head = engine._lm_head
        self._inv_freq = engine._inv_freq

    @staticmethod
    def _weight(weights: dict[str, np.ndarray], name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(np.ascontiguousarray(weights[name], np.float32))
        except KeyError:
            raise LyannaError(f"draft head weight {name!r} is missing") from None

    def new_cache(self, capacity: int) -> HeadCache:
        return HeadCache(self.config, capacity, self.dtype, self.device)

    def _rows(self, a: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Feature rows on the device in the head's dtype (committed ones come from the host)."""
        t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a, np.float32))
        return t.to(self.device, self.dtype)

    def _rotation(self, positions: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.as_tensor(np.asarray(positions, np.int64), device=self.device)
        angles = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def _fuse(self, features: np.ndarray | torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
        emb = self._embed[torch.as_tensor(np.asarray(tokens, np.int64), device=self.device)]
        return self.fc(torch.cat([self._rows(features), emb], dim=-1))

    def _kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HeadCache) -> None:
        """Write the keys and values of normalized rows ``h`` after the cache's ``length`` rows."""
        c, attn, n = self.config, self.layer.self_attn, h.shape[0]
        end = cache.length + n
        cache.k[0, :, cache.length : end] = rope(attn.k_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)
        cache.v[0, :, cache.length : end] = attn.v_proj(h).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)

    def layer_step(self, x: torch.Tensor, positions: Sequence[int] | np.ndarray, cache: HeadCache,
                   bias: np.ndarray | None) -> torch.Tensor:
        """The head's layer over rows ``x`` written after the cache's ``length`` rows (the caller
        advances ``length``); ``bias``: additive ``[n, length + n]`` (None: causal in the block)."""
        c, attn, n = self.config, self.layer.self_attn, x.shape[0]
        cos, sin = self._rotation(positions)
        h = self.layer.input_layernorm(x)
        self._kv(h, cos, sin, cache)
        end = cache.length + n
        if bias is not None:
            mask = torch.from_numpy(np.asarray(bias, np.float32) == 0).to(self.device)
        elif n > 1:
            mask = torch.ones((n, end), dtype=torch.bool, device=self.device)
            mask[:, cache.length :] = torch.tril(mask[:, cache.length :])
        else:
            mask = None
        q = rope(attn.q_proj(h).view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)
        o = F.scaled_dot_product_attention(q[None], cache.k[:, :, :end], cache.v[:, :, :end], attn_mask=mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + attn.o_proj(o[0].transpose(0, 1).reshape(n, -1))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    @torch.inference_mode()
    def step(self, features: np.ndarray | torch.Tensor, tokens: np.ndarray, positions: np.ndarray,
             cache: HeadCache, bias: np.ndarray | None) -> torch.Tensor:
        """Predict the next features for n (feature, token) pairs appended to ``cache``."""
        out = self.layer_step(self._fuse(features, tokens), positions, cache, bias)
        cache.length += len(tokens)
        return out

    @torch.inference_mode()
    def fill(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: HeadCache) -> None:
        """Append pairs as ``step`` would, keys and values only (nobody reads their outputs)."""
        if not len(tokens):
            return
        self._kv(self.layer.input_layernorm(self._fuse(features, tokens)), *self._rotation(positions), cache)
        cache.length += len(tokens)

    @torch.inference_mode()
    def top_children(self, features: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``k`` likeliest next tokens under the target's LM head, likeliest first, and
        their log-probabilities (``[rows, k]`` host arrays; only these cross from the device)."""
        logp = torch.log_softmax((features @ self._lm_head.T).float(), dim=-1)
        top_v, top_i = torch.topk(logp, k, dim=-1)
        return top_i.cpu().numpy(), top_v.cpu().numpy()

    @staticmethod
    def stack(rows: Sequence[torch.Tensor]) -> torch.Tensor:
        """Feature rows (as ``step`` returns them) stacked into one block."""
        return torch.stack(list(rows))


class DeviceChainHead(DeviceDraftHead):
    """``DeviceDraftHead`` plus the chain's norm, the raw logits over the draft vocabulary (the
    engine's LM-head rows of ``d2t``) and token-info trees."""

    def __init__(self, engine, weights: dict[str, np.ndarray]):
        super().__init__(engine, weights)
        c = self.config
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm.load_state_dict({"weight": self._weight(weights, "norm.weight")})
        self.norm.to(self.device, self.dtype).eval().requires_grad_(False)
        d2t = np.asarray(weights["d2t"], np.int64)
        if d2t.ndim != 1 or d2t.size == 0 or np.unique(d2t).size != d2t.size or d2t.min() < 0 or d2t.max() >= c.vocab_size:
            raise LyannaError("draft vocabulary map d2t must list distinct target token ids")
        self.d2t = d2t
        self._d2t = torch.from_numpy(d2t).to(self.device)
        self._draft_lm_head = self._lm_head[self._d2t]
        # Token information in fp32 whatever the head's dtype: it shifts logits of order 1.
        self._ti_a = self._weight(weights, "ti.a").to(self.device)
        self._ti_b = self._weight(weights, "ti.b").to(self.device)

    @torch.inference_mode()
    def chain(self, first: torch.Tensor, root_position: int, depth: int, cache: HeadCache) -> torch.Tensor:
        """``f_1..f_depth`` from ``f_1 = first``: ``f_k = layer(f_{k-1})`` at position
        ``root_position + k - 1``, written to ``cache`` (the caller rewinds it)."""
        features = [first.reshape(1, -1)]
        for k in range(2, depth + 1):
            features.append(self.layer_step(features[-1], [root_position + k - 1], cache, None))
            cache.length += 1
        return torch.cat(features)

    @torch.inference_mode()
    def raw_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``norm(f_k) @ W_draft`` in fp32, ``[depth, draft vocab]``."""
        return (self.norm(features) @ self._draft_lm_head.T).float()

    @torch.inference_mode()
    def tree(self, raw: torch.Tensor, root: int, ti, topk: int, width: int, max_nodes: int, origin: int = 0) -> DraftTree:
        """``lyanna.token_info_tree`` on the device: per depth, each frontier branch's top-k
        children under ``log_softmax(raw[d] + TI(parent))``, the ``width`` best by joint
        log-probability (a stable sort: ties to the earlier child) form the next frontier; the
        candidates cross to the host once and the best ``max_nodes`` form the tree."""
        depth, v = raw.shape
        if depth == 0 or width < 1 or topk < 1:
            return DraftTree.empty()
        k = min(topk, v)
        hot = None if ti.fallback == "lowrank" else torch.from_numpy(ti.row_of >= 0).to(self.device)
        f_tok = torch.tensor([root], device=self.device)
        f_node = torch.tensor([-1], device=self.device)
        f_score = torch.zeros(1, dtype=torch.float64, device=self.device)
        tokens, parents, scores = [], [], []
        n = 0
        for d in range(depth):
            info = self._ti_a[f_tok] @ self._ti_b
            if hot is not None:
                info = info * hot[f_tok, None]
            x = raw[d][None, :] + info
            top_v, top_i = torch.topk(x, k, dim=-1)
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            s = (f_score[:, None] + (top_v - lse).double()).reshape(-1)
            tokens.append(self._d2t[top_i].reshape(-1))
            parents.append(f_node[:, None].expand(-1, k).reshape(-1))
            scores.append(s)
            order = torch.sort(s, descending=True, stable=True).indices[:width]
            f_node, f_tok, f_score = n + order, tokens[-1][order], s[order]
            n += s.shape[0]
        host = torch.stack([torch.cat(tokens).double(), torch.cat(parents).double(), torch.cat(scores)]).cpu().numpy()
        count = host.shape[1]
        return DraftTree.best_of(host[0].astype(np.int64), host[1].astype(np.int64), host[2], max_nodes,
                                 np.full(count, origin))
