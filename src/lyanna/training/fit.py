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
    """A head whose layer starts from the target's last layer and whose fc starts as 'feature +
    s * embedding', with ``s`` matching the embedding's scale to the feature's (final-norm
    outputs are ~17x larger than embedding rows in SmolLM2: a small random init would hide the
    token from the head and stall training)."""
    torch.manual_seed(seed)
    c = engine.config
    head = EagleHead(c, engine.embed, engine.lm_head)
    prefix = f"model.layers.{c.num_layers - 1}."
    head.layer.load_state_dict({k[len(prefix):]: torch.from_numpy(np.array(v, np.float32))
                                for k, v in target_weights.items() if k.startswith(prefix)})
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, : c.hidden_size] = torch.eye(c.hidden_size)
        scale = float(np.sqrt(np.mean(np.square(engine.final_norm))) / np.sqrt(np.mean(np.square(engine.embed))))
        head.fc.weight[:, c.hidden_size :] = scale * torch.eye(c.hidden_size)
        head.fc.weight[:, c.hidden_size :].add_(torch.randn(c.hidden_size, c.hidden_size) * 0.02)
        head.fc.bias.zero_()
    return head


def init_lyanna_head(engine: Transformer, target_weights: dict[str, np.ndarray], d2t: np.ndarray, rank: int = 32,
                     seed: int = 0) -> LyannaHead:
    """Like ``init_eagle_head``, plus the raw-logit norm from the target's final norm and a zero TI."""
    eagle = init_eagle_head(engine, target_weights, seed)
    head = LyannaHead(engine.config, engine.embed, engine.lm_head, d2t, rank)
    head.load_state_dict({**eagle.state_dict(), "norm.weight": torch.from_numpy(engine.final_norm.copy()),
                          "d2t": head.d2t, "ti.a": head.ti.a.detach(), "ti.b": head.ti.b.detach()})
    return head


def label_probs(head: EagleHead, ex: Example) -> torch.Tensor:
    """The target's next-token distribution after every position: its LM head on the final-norm
    features the heads are trained on (so no second target pass is needed). For a Lyanna head it
    is restricted to the draft vocabulary and renormalized, which is the softmax of those rows
    (likewise for an EAGLE head whose loss vocabulary is restricted)."""
    with torch.no_grad():
        feats = torch.from_numpy(ex.features)
        logits = feats @ head.draft_lm.T if isinstance(head, LyannaHead) else head.loss_logits(feats)
        return torch.softmax(logits, -1)


def example_loss(head: EagleHead, ex: Example, depth: int, decay: float = 0.8, raw_weight: float = 0.5,
                 cls_weight: float = 0.1, start: int = 0) -> torch.Tensor:
    """Multi-step unrolled loss; step k at root row j predicts the token at position j + 1 + k,
    whose target distribution is the label row j + k. Only roots from row ``start`` count.

    EAGLE: smooth-L1 to the true feature plus ``cls_weight`` soft cross-entropy (EAGLE-1's losses,
    unrolled on its own predictions). Lyanna: soft cross-entropy of ``l_k + TI(true parent)`` plus
    ``raw_weight`` times that of the raw ``l_k`` (so re-sampled trees have something to stand on),
    over the draft vocabulary."""
    toks = torch.from_numpy(ex.tokens)
    feats = torch.from_numpy(ex.features)
    probs = label_probs(head, ex)
    lyanna = isinstance(head, LyannaHead)
    total = torch.zeros(())
    t = len(toks)
    start = min(max(start, 0), max(t - 2, 0))
    for k, f in enumerate(head.unroll(feats, toks, depth, start), start=1):
        n = t - k - start  # rows of this step with a label
        if n <= 0:
            break
        label = probs[k + start : k + start + n]
        parents = toks[k + start : k + start + n]
        if lyanna:
            raw = head.raw_logits(f[:n])
            injected = raw + head.token_info(parents)
            step = -(label * F.log_softmax(injected, -1)).sum(-1).mean()
            step = step + raw_weight * -(label * F.log_softmax(raw, -1)).sum(-1).mean()
        else:
            step = F.smooth_l1_loss(f[:n], feats[k + start : k + start + n])
            step = step + cls_weight * -(label * F.log_softmax(head.loss_logits(f[:n]), -1)).sum(-1).mean()
        total = total + decay ** (k - 1) * step
    return total


def agreement(head: EagleHead, ex: Example, depth: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth (matches, counts) of the head's top-1 token against the target's, teacher-forced,
    over predicted positions >= ``start`` (the reply)."""
    toks = torch.from_numpy(ex.tokens)
    hits, counts = np.zeros(depth), np.zeros(depth)
    first = min(max(start - 2, 0), max(len(toks) - 2, 0))  # no earlier root predicts into the reply
    with torch.no_grad():
        target_top = head.logits(torch.from_numpy(ex.features)).argmax(-1)
        for k, f in enumerate(head.unroll(torch.from_numpy(ex.features), toks, depth, first), start=1):
            n = len(toks) - k - first
            if n <= 0:
                break
            if isinstance(head, LyannaHead):
                guess = head.d2t[(head.raw_logits(f[:n]) + head.token_info(toks[k + first : k + first + n])).argmax(-1)]
            else:
                guess = head.logits(f[:n]).argmax(-1)
            rows = torch.arange(n) + first + k + 1 >= start  # predicted position j + 1 + k in the reply
            hits[k - 1] += float((guess == target_top[k + first : k + first + n])[rows].sum())
            counts[k - 1] += float(rows.sum())
    return hits, counts


def fit(head: EagleHead, examples: Sequence[Example], steps: int, depth: int = 3, lr: float = 3e-4,
        seed: int = 0) -> list[float]:
    """Plain single-process Adam steps, one example per step (tests and small experiments)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = example_loss(head, examples[int(rng.integers(len(examples)))], depth)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
