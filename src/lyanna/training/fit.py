"""Fitting an EAGLE-style head on target features (EAGLE-1 losses: feature regression + soft
cross-entropy against the target's next-token distribution)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..engine import Transformer
from .modules import EagleHead


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
