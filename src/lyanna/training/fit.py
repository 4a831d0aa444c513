"""Fitting draft heads on target features, in packed batches.

Both heads are unrolled ``depth`` steps from every root of a packed batch (several sequences
per row, none attending to another) and scored only where the predicted token is one the
assistant wrote. EAGLE: smooth-L1 to the true next feature plus a soft cross-entropy (EAGLE-1's
losses, unrolled on its own predictions). Lyanna: cross-entropy of ``raw + TI(true parent)``
plus ``raw_weight`` times that of the raw logits (so re-sampled trees have something to stand
on), over the draft vocabulary. Labels are the target's own next-token distribution (``soft``)
or its argmax (``hard``), both read off the final-norm features with the target's LM head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..engines.base import Block, TargetEngine
from .modules import EagleHead, LyannaHead, pair_segments


@dataclass
class Example:
    tokens: np.ndarray  # [T]
    features: np.ndarray | None  # [T, taps * H] target features after each token (the taps side by side, final
    # norm last); None until a fit computing its features online fills them in
    mask: np.ndarray | None = None  # [T] bool: tokens the assistant wrote (scored); None = all

    def scored(self) -> np.ndarray:
        return np.ones(len(self.tokens), bool) if self.mask is None else self.mask


@dataclass
class Batch:
    """Packed rows: ``tokens``/``segments``/``mask`` [B, L], ``features`` [B, L, H]."""
    tokens: torch.Tensor
    features: torch.Tensor
    segments: torch.Tensor
    mask: torch.Tensor

    @property
    def positions(self) -> int:
        return int((self.segments >= 0).sum())


def target_features(engine: TargetEngine, sequences: Sequence[Sequence[int]], taps: int | Sequence[int]) -> list[Example]:
    """One prefill per sequence with the taps; the features the head learns from and predicts
    (several taps' rows side by side, in the order given)."""
    taps = (int(taps),) if isinstance(taps, (int, np.integer)) else tuple(taps)
    out = []
    for seq in sequences:
        ids = np.asarray(seq, np.int64)
        block = Block(ids, np.arange(len(ids)), engine.new_cache(len(ids)), logit_rows=[-1], taps=taps, prefill=True)
        hidden = engine.forward_batch([block])[0].hidden
        out.append(Example(ids, np.concatenate([hidden[t] for t in taps], axis=-1)))
    return out


PACK_WINDOW = 64  # open rows a sequence may join: first-fit quality at a bounded cost per sequence


def pack(examples: Sequence[Example], row_len: int) -> list[list[int]]:
    """First-fit packing of example indices into rows of at most ``row_len`` tokens, in the
    given order, looking at the last ``PACK_WINDOW`` rows (longer examples are cut to
    ``row_len`` by ``make_batch``)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, ex in enumerate(examples):
        n = min(len(ex.tokens), row_len)
        for r in range(max(0, len(rows) - PACK_WINDOW), len(rows)):
            if room[r] >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_len - n)
    return rows


def make_batch(examples: Sequence[Example], rows: Sequence[Sequence[int]], row_len: int,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, features: bool = True) -> Batch:
    """Tensors of packed rows; positions past the last sequence of a row are padding (segment
    -1). Without ``features`` the batch only tells which positions are scored."""
    hidden = examples[rows[0][0]].features.shape[1] if features else 0
    width = min(row_len, max(sum(min(len(examples[i].tokens), row_len) for i in row) for row in rows))
    tokens = np.zeros((len(rows), width), np.int64)
    feats = np.zeros((len(rows), width, hidden), np.float32)
    segments = np.full((len(rows), width), -1, np.int64)
    mask = np.zeros((len(rows), width), bool)
    for r, row in enumerate(rows):
        at = 0
        for s, i in enumerate(row):
            ex = examples[i]
            n = min(len(ex.tokens), width - at)
            tokens[r, at:at + n] = ex.tokens[:n]
            if features:
                feats[r, at:at + n] = ex.features[:n]
            segments[r, at:at + n] = s
            mask[r, at:at + n] = ex.scored()[:n]
            at += n
    return Batch(torch.from_numpy(tokens).to(device), torch.from_numpy(feats).to(device=device, dtype=dtype),
                 torch.from_numpy(segments).to(device), torch.from_numpy(mask).to(device))


def _label_logits(head: EagleHead, features: torch.Tensor) -> torch.Tensor:
    """The target's logits over the head's loss vocabulary (draft vocabulary for Lyanna)."""
    return features @ (head.draft_lm if isinstance(head, LyannaHead) else getattr(head, "loss_lm", head.lm_head)).T


def _scored_rows(batch: Batch, k: int, drafted: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L-1] bool: root row j of step k predicts token j + 1 + k of its own sequence, which
    the assistant wrote (and, given ``drafted`` ([vocab] bool), which the head can draft)."""
    pseg = pair_segments(batch.segments)
    n = pseg.shape[1]
    valid = torch.zeros_like(pseg, dtype=torch.bool)
    m = n - k  # rows whose predicted position j + 1 + k is inside the row
    if m > 0:
        target_seg = batch.segments[:, 1 + k: 1 + k + m]
        valid[:, :m] = (pseg[:, :m] >= 0) & (target_seg == pseg[:, :m]) & batch.mask[:, 1 + k: 1 + k + m]
        if drafted is not None:
            valid[:, :m] &= drafted[batch.tokens[:, 1 + k: 1 + k + m]]
    return valid


def scored_counts(batch: Batch, depth: int, drafted: torch.Tensor | None = None) -> list[int]:
    """Scored rows of each unrolled step (``drafted``: see ``_scored_rows``)."""
    return [int(_scored_rows(batch, k, drafted).sum()) for k in range(1, depth + 1)]


def drafted_tokens(head: EagleHead, mask: bool) -> torch.Tensor | None:
    """[vocab] bool of the tokens the loss scores: with ``mask`` (``run.OUTSIDE_VOCAB``'s
    ``mask``), a Lyanna head's draft vocabulary; None (every token) otherwise."""
    if not mask or not isinstance(head, LyannaHead):
        return None
    drafted = torch.zeros(head.c.vocab_size, dtype=torch.bool, device=head.d2t.device)
    drafted[head.d2t] = True
    return drafted


# Weight of unrolled step k's loss: DEPTH_DECAY ** (k - 1). A deeper step's token is accepted only
# after the ones above it, so it is worth less; 0.8 is what every shipped head was fitted with.
DEPTH_DECAY = 0.8


def depth_decay_of(settings: dict) -> float:
    """A fit's depth decay (fits from before the setting used the default)."""
    return settings.get("depth_decay", DEPTH_DECAY)


def batch_loss(head: EagleHead, batch: Batch, depth: int, decay: float = DEPTH_DECAY, raw_weight: float = 0.5,
               cls_weight: float = 0.1, labels: str = "soft", counts: Sequence[float] | None = None,
               drafted: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over scored rows of each unrolled step, weighted ``decay ** (k - 1)``. ``counts``
    replaces this batch's own scored rows per step as the divisor (data-parallel ranks divide by
    the whole batch's, so that averaging their gradients gives the single-process gradient).
    ``drafted``: score only positions whose token it holds (``drafted_tokens``)."""
    if labels not in ("soft", "hard"):
        raise ValueError(f"labels must be soft or hard, got {labels!r}")
    lyanna = isinstance(head, LyannaHead)
    feats = batch.features.float()
    total = feats.new_zeros(())
    for k, f in enumerate(head.unroll_batch(feats, batch.tokens, batch.segments, depth), start=1):
        valid = _scored_rows(batch, k, drafted)
        if not bool(valid.any()):
            if drafted is None:
                break  # deeper steps score fewer rows still
            continue
        b_idx, j_idx = valid.nonzero(as_tuple=True)
        fk = f[b_idx, j_idx]
        label_feats = feats[b_idx, j_idx + k, -head.c.hidden_size:]  # final norm after token j + k: token j + 1 + k's distribution
        with torch.no_grad():
            target_logits = _label_logits(head, label_feats)
            probs = torch.softmax(target_logits, -1)
            if labels == "hard":
                probs = F.one_hot(target_logits.argmax(-1), probs.shape[-1]).to(probs.dtype)
        if lyanna:
            raw = head.raw_logits(fk)
            injected = raw + head.token_info(batch.tokens[b_idx, j_idx + k])
            per_row = -(probs * F.log_softmax(injected, -1)).sum(-1)
            per_row = per_row + raw_weight * -(probs * F.log_softmax(raw, -1)).sum(-1)
        else:
            per_row = F.smooth_l1_loss(fk, label_feats, reduction="none").mean(-1)
            per_row = per_row + cls_weight * -(probs * F.log_softmax(head.loss_logits(fk), -1)).sum(-1)
        divisor = float(counts[k - 1]) if counts is not None else float(len(b_idx))
        total = total + decay ** (k - 1) * per_row.sum() / max(divisor, 1.0)
    return total


@torch.no_grad()
def batch_agreement(head: EagleHead, batch: Batch, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth (matches, counts) of the head's top-1 token against the target's (full
    vocabulary), teacher-forced, over the scored positions."""
    hits, counts = np.zeros(depth), np.zeros(depth)
    feats = batch.features.float()
    for k, f in enumerate(head.unroll_batch(feats, batch.tokens, batch.segments, depth), start=1):
        valid = _scored_rows(batch, k)
        b_idx, j_idx = valid.nonzero(as_tuple=True)
        if len(b_idx) == 0:
            break
        fk = f[b_idx, j_idx]
        target_top = head.logits(feats[b_idx, j_idx + k, -head.c.hidden_size:]).argmax(-1)
        if isinstance(head, LyannaHead):
            guess = head.d2t[(head.raw_logits(fk) + head.token_info(batch.tokens[b_idx, j_idx + k])).argmax(-1)]
        else:
            guess = head.logits(fk).argmax(-1)
        hits[k - 1] = float((guess == target_top).sum())
        counts[k - 1] = float(len(b_idx))
    return hits, counts


def example_loss(head: EagleHead, ex: Example, depth: int, **kw) -> torch.Tensor:
    """``batch_loss`` of one example."""
    return batch_loss(head, make_batch([ex], [[0]], len(ex.tokens)), depth, **kw)


def init_eagle_head(engine: TargetEngine, target_weights: dict[str, np.ndarray], seed: int = 0,
                    layers: int = 1) -> EagleHead:
    """A head whose layer starts from the target's last layer and whose fc starts as 'feature +
    s * embedding', with ``s`` matching the embedding's scale to the feature's (final-norm
    outputs are ~17x larger than embedding rows in SmolLM2: a small random init would hide the
    token from the head and stall training). Further ``layers`` start from that layer too with
    their output projections zero, so they pass their input through: the deeper head starts as
    the one-layer head (and ``--init`` from a one-layer checkpoint continues it exactly)."""
    torch.manual_seed(seed)
    c = engine.config
    head = EagleHead(c, engine.embed, engine.lm_head, layers=layers)
    prefix = f"model.layers.{c.num_layers - 1}."
    last = {k[len(prefix):]: torch.from_numpy(np.array(v, np.float32)) for k, v in target_weights.items()
            if k.startswith(prefix)}
    for layer in head.layers:
        layer.load_state_dict(last)
    with torch.no_grad():
        for layer in head.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, : c.hidden_size] = torch.eye(c.hidden_size)
        scale = float(np.sqrt(np.mean(np.square(engine.final_norm))) / np.sqrt(np.mean(np.square(engine.embed))))
        head.fc.weight[:, c.hidden_size :] = scale * torch.eye(c.hidden_size)
        head.fc.weight[:, c.hidden_size :].add_(torch.randn(c.hidden_size, c.hidden_size) * 0.02)
        head.fc.bias.zero_()
    return head


def init_lyanna_head(engine: TargetEngine, target_weights: dict[str, np.ndarray], d2t: np.ndarray, rank: int = 32,
                     seed: int = 0, taps: int = 1, layers: int = 1) -> LyannaHead:
    """Like ``init_eagle_head``, plus the raw-logit norm from the target's final norm and a zero TI.
    With several ``taps`` their projection starts as the final-norm tap alone (the last one), so
    the head starts as the one-tap head and the other layers come in as the fit finds them useful."""
    eagle = init_eagle_head(engine, target_weights, seed, layers)
    head = LyannaHead(engine.config, engine.embed, engine.lm_head, d2t, rank, taps, layers)
    state = {**eagle.state_dict(), "norm.weight": torch.from_numpy(engine.final_norm.copy()),
             "d2t": head.d2t, "ti.a": head.ti.a.detach(), "ti.b": head.ti.b.detach()}
    if taps > 1:
        h = engine.config.hidden_size
        state["taps_fc.weight"] = torch.cat([torch.zeros(h, (taps - 1) * h), torch.eye(h)], dim=1)
    head.load_state_dict(state)
    return head


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
