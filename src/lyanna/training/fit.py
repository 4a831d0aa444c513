"""Fitting an EAGLE-style head on target features (EAGLE-1 losses: feature regression + soft
cross-entropy against the target's next-token distribution)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..engine import Transformer
from .modules import EagleHead, LyannaHead


@dataclass
class Example:
    tokens: np.ndarray  # [T]
    features: np.ndarray  # [T, H] target feature after each token (the tapped layer)


def target_features(engine: Transformer, sequences: Sequence[Sequence[int]], tap: int) -> list[Example]:
    """One prefill per sequence with the tap; the features the head learns from and predicts."""
    out = []
    for seq in sequences:
        ids = np.asarray(seq, np.int64)
        fwd = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids)), logit_rows=[-1], taps=(tap,))
        out.append(Example(ids, fwd.hidden[tap]))
    return out


def init_eagle_head(engine: Transformer, target_weights: dict[str, np.ndarray], seed: int = 0) -> EagleHead:
    """A head whose layer starts from the target's last layer and whose fc starts as 'pass the feature'."""
    torch.manual_seed(seed)
    c = engine.config
    head = EagleHead(c, engine.embed, engine.lm_head)
    prefix = f"model.layers.{c.num_layers - 1}."
    head.layer.load_state_dict({k[len(prefix):]: torch.from_numpy(np.array(v, np.float32))
                                for k, v in target_weights.items() if k.startswith(prefix)})
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, : c.hidden_size] = torch.eye(c.hidden_size)
        head.fc.weight[:, c.hidden_size :].normal_(0, 0.02)
        head.fc.bias.zero_()
    return head


def fit_eagle(head: EagleHead, examples: Sequence[Example], steps: int, lr: float = 3e-4, cls_weight: float = 0.1,
              seed: int = 0) -> list[float]:
    """Adam steps over (feature_{i-1}, token_i) -> feature_i pairs, one example per step; returns losses."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        ex = examples[int(rng.integers(len(examples)))]
        feats = torch.from_numpy(ex.features)
        toks = torch.from_numpy(ex.tokens)
        positions = torch.arange(1, len(toks))
        pred = head(feats[:-1][None], toks[1:][None], positions)[0]
        target = feats[1:]
        with torch.no_grad():
            soft = F.softmax(head.logits(target), dim=-1)
        loss = F.smooth_l1_loss(pred, target) + cls_weight * -(soft * F.log_softmax(head.logits(pred), dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def init_lyanna_head(engine: Transformer, target_weights: dict[str, np.ndarray], d2t: np.ndarray, rank: int = 32,
                     seed: int = 0) -> LyannaHead:
    """Like ``init_eagle_head``, plus the raw-logit norm from the target's final norm and a zero TI."""
    torch.manual_seed(seed)
    eagle = init_eagle_head(engine, target_weights, seed)
    head = LyannaHead(engine.config, engine.embed, engine.lm_head, d2t, rank)
    head.load_state_dict({**eagle.state_dict(), "norm.weight": torch.from_numpy(engine.final_norm.copy()),
                          "d2t": head.d2t, "ti.a": head.ti.a.detach(), "ti.b": head.ti.b.detach()})
    return head


def lyanna_loss(head: LyannaHead, ex: Example, target_probs: torch.Tensor, depth: int, raw_weight: float = 0.5,
                decay: float = 0.8) -> torch.Tensor:
    """Unrolled chain loss: at step k, soft cross-entropy of ``l_k + TI(true parent)`` and of the raw
    ``l_k`` against the target's next-token distribution over the draft vocabulary."""
    toks = torch.from_numpy(ex.tokens)
    chain = head.unroll(torch.from_numpy(ex.features), toks, depth)
    probs = target_probs[:, head.d2t]
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)
    total = torch.zeros(())
    t = len(toks)
    for k, f in enumerate(chain, start=1):
        n = t - k  # roots at positions 1..t-k still have a labelled position k ahead
        if n <= 0:
            break
        raw = head.raw_logits(f[:n])
        label = probs[k : k + n]  # target's distribution after position j + k (rows j = 1..n)
        parents = toks[k : k + n]  # the true token before the predicted one
        injected = raw + head.token_info(parents)
        ce = -(label * F.log_softmax(injected, -1)).sum(-1).mean()
        ce_raw = -(label * F.log_softmax(raw, -1)).sum(-1).mean()
        total = total + decay ** (k - 1) * (ce + raw_weight * ce_raw)
    return total


def fit_lyanna(head: LyannaHead, examples: Sequence[Example], engine: Transformer, steps: int, depth: int = 4,
               lr: float = 3e-4, seed: int = 0) -> list[float]:
    """Adam steps on ``lyanna_loss``; the target's distributions come from its LM head on the
    final-norm features when the head taps them, else from one extra target pass."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    probs_cache: dict[int, torch.Tensor] = {}
    losses = []
    for _ in range(steps):
        i = int(rng.integers(len(examples)))
        if i not in probs_cache:
            ex = examples[i]
            logits = engine.forward(ex.tokens, np.arange(len(ex.tokens)), engine.new_cache(len(ex.tokens))).logits
            probs_cache[i] = torch.softmax(torch.from_numpy(logits), -1)
        loss = lyanna_loss(head, examples[i], probs_cache[i], depth)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
