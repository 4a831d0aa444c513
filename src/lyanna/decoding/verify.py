"""Lossless verification of a draft tree against one target pass.

Greedy: follow the target's argmax down the tree as long as a child matches, then take the
target's own token. Sampling: at each node, decide among its children so that the token finally
committed at that position is distributed exactly as the target's filtered distribution p:

- deterministically chosen children (top-k, suffix matches): try them in order; accept child x
  with probability p(x), otherwise set p(x) = 0 and renormalize; if all are rejected, sample
  from what is left;
- children sampled i.i.d. from a draft distribution q: accept x with probability
  min(1, p(x) / q(x)), otherwise p = normalize(max(p - q, 0)) and try the next one.

The first rule is exact for any candidates fixed before verification, however they were drawn;
the second accepts more (sum(min(p, q)) against sum(p * q) for one candidate) but is exact only
when the children really are i.i.d. draws from q, which ``DraftTree`` operations preserve.

After the accepted path ends, the next token (bonus) always comes from the target.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..drafters.tree import DraftTree
from .sampling import SamplingParams, sample, target_probs


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # accepted tree nodes, root to leaf
    tokens: list[int]  # the accepted draft tokens, then the target's bonus token


def _deterministic_step(p: np.ndarray, candidates: list[int], rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    """Return (index into candidates or None, residual distribution)."""
    for i, x in enumerate(candidates):
        px = p[x]
        if px > 0 and rng.random() < px:
            return i, p
        if px > 0:
            p = p.copy()
            p[x] = 0.0
            p /= p.sum()
    return None, p


def _sampled_step(p: np.ndarray, q: np.ndarray, candidates: list[int], rng: np.random.Generator) -> tuple[int | None, np.ndarray]:
    for i, x in enumerate(candidates):
        if rng.random() * q[x] < p[x]:
            return i, p
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        if total <= 0:  # p <= q everywhere means p == q: rejection cannot happen in exact arithmetic
            continue
        p = residual / total
    return None, p


def followed(tree: DraftTree, kept: np.ndarray, bonus: int) -> Verdict:
    """The verdict of a path an engine verified where it ran (``ForwardOutput.kept``: the root's
    row, then ``1 +`` each accepted node; ``bonus``, the target's token after them)."""
    path = [int(k) - 1 for k in kept[1:]]
    return Verdict(path, [int(tree.tokens[i]) for i in path] + [int(bonus)])


def verify(tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Verdict:
    """Decide the accepted path and the bonus token.

    ``logits`` is float32 ``[len(tree) + 1, vocab]``: row 0 holds the target's logits after the
    committed context (they judge the children of the root, ``parents == -1``), row ``1 + i`` the
    logits after tree node i. Host rows are read as the path goes; logits left on a device
    (``DeviceLogits``) give greedy decoding every row's argmax in one copy.
    """
    if logits.shape[0] != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} rows of logits for a tree of {len(tree)} nodes, got {logits.shape[0]}")
    kids = tree.children()
    tokens = tree.tokens
    on_host = isinstance(logits, np.ndarray)
    argmax = None if on_host or not params.greedy else logits.argmax()
    path: list[int] = []
    node = -1
    while True:
        children = kids.get(node, [])
        if params.greedy:
            best = int(np.argmax(logits[node + 1]) if argmax is None else argmax[node + 1])
            match = next((c for c in children if tokens[c] == best), None)
            if match is None:
                return Verdict(path, [int(tokens[i]) for i in path] + [best])
            path.append(match)
            node = match
            continue
        p = target_probs(logits[node + 1], params)
        candidates = [int(tokens[c]) for c in children]
        if node in tree.sampled_from:
            chosen, residual = _sampled_step(p, tree.sampled_from[node], candidates, rng)
        else:
            chosen, residual = _deterministic_step(p, candidates, rng)
        if chosen is None:
            return Verdict(path, [int(tokens[i]) for i in path] + [sample(residual, rng)])
        path.append(children[chosen])
        node = children[chosen]
