"""Verification of a draft tree on the device, inside the target's pass (fixed shapes, no data
read on the host: a CUDA graph captures it): ``decoding.verify``'s rules and
``decoding.sampling.target_probs``'s distribution, for the trees device heads draft (every
child chosen deterministically, siblings with distinct tokens).

Greedy: a node is accepted when its token is its parent's row's argmax and its parent was
accepted. Sampling: a parent's children are tried in order, child ``x`` accepted with probability
``p(x) / (1 - p(earlier siblings))`` (the residual rule: each rejected sibling's probability set to
zero, the rest renormalized), with one uniform drawn ahead per node, so the first child whose own
draw accepts it is the one the sequential rule accepts, with the same law; the bonus token is drawn
from the last accepted node's row without its (rejected) children, by inverse CDF with one more
uniform. Either way the accepted nodes form one chain, one a depth, found a level at a time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Followed(NamedTuple):
    """The path the pass followed: ``count`` ``[1]`` accepted nodes, ``keep`` ``[levels + 1]`` the
    rows to keep (the root's 0, then ``1 +`` each accepted node by depth; self-indices past the
    path), ``bonus`` ``[1]`` the target's next token after it."""

    count: torch.Tensor
    keep: torch.Tensor
    bonus: torch.Tensor


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
    """``sampling.target_probs`` of ``[rows, vocab]`` logits (float64), its settings as ``[1]``
    tensors (a pass's inputs: top-k 0 and top-p 1 turn those filters off)."""
    z = logits.double()
    z = (z - z.amax(-1, keepdim=True)) / temperature
    vocab = z.shape[-1]
    kth = z.sort(-1, descending=True).values.gather(-1, (top_k.clamp(1, vocab) - 1).expand(z.shape[0], 1))
    z = torch.where((top_k > 0) & (z < kth), float("-inf"), z)
    p = torch.softmax(z, -1)
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    drop = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (before >= top_p) & (top_p < 1.0))
    p = torch.where(drop, 0.0, p)
    return p / p.sum(-1, keepdim=True)


def residual(row: torch.Tensor, tokens: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``row`` (a distribution over the vocabulary) with the ``rejected`` nodes' tokens set to
    zero, not renormalized (the inverse CDF scales by the total)."""
    vocab = row.shape[0]
    sink = torch.where(rejected, tokens, vocab)  # the others write past the vocabulary
    return torch.cat([row, row.new_zeros(1)]).scatter(0, sink, 0.0)[:vocab]


def follow(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor,
           logits: torch.Tensor, argmax: torch.Tensor | None, levels: int, sampling: tuple | None) -> Followed:
    """The accepted path of a tree of ``m`` node columns (``tokens``, ``parents`` (-1 under the
    root), ``depths`` and ``valid``, each ``[m]``; no path deeper than ``levels``) under the
    pass's ``[1 + m, vocab]`` ``logits`` (row 0 the root's) and (greedy only) their ``argmax``: greedy, or
    (``sampling``: ``(temperature, top_p, top_k, uniforms)``, ``uniforms`` ``[m + 1]``) by the
    sampling rules."""
    m, dev = tokens.shape[0], tokens.device
    row_of_parent = (parents + 1).clamp(0, m)
    top, above = parents < 0, parents.clamp(min=0)
    if sampling is None:
        match = valid & (tokens == argmax[row_of_parent])
    else:
        temperature, top_p, top_k, uniforms = sampling
        probs = target_probs(logits, temperature, top_p, top_k)
        p = torch.where(valid, probs[row_of_parent, tokens], 0.0)
        at = torch.arange(m, device=dev)
        earlier = (parents[:, None] == parents[None, :]) & (at[None, :] < at[:, None])  # [i, j]: j, i's earlier sibling
        tried = (earlier.double() * p[None, :]).sum(1)
        accepts = valid & (p > 0) & (uniforms[:m] * (1.0 - tried) < p)
        match = accepts & ~(earlier & accepts[None, :]).any(1)  # the first sibling whose draw accepts it
    ok = match & top
    for _ in range(levels - 1):  # a level more each time round
        ok = match & (top | ok[above])
    # The deepest accepted node's depth (a tree of no nodes: a plain step, whose count is 0).
    count = torch.where(ok, depths, 0).amax().view(1) if m else torch.zeros(1, dtype=torch.int64, device=dev)
    rows = torch.arange(levels + 2, device=dev)  # the root's row, one a depth, and a sink for the rest
    keep = rows.scatter(0, torch.where(ok, depths, levels + 1), 1 + torch.arange(m, device=dev))[: levels + 1]
    last = keep.gather(0, count)  # the row after which the bonus token comes
    if sampling is None:
        bonus = argmax.gather(0, last)
    else:
        rest = residual(probs.index_select(0, last)[0], tokens, valid & (row_of_parent == last))
        cdf = rest.cumsum(0)
        bonus = torch.searchsorted(cdf, uniforms[m:] * cdf[-1:], right=True).clamp(max=cdf.shape[0] - 1)
    return Followed(count, keep, bonus)
