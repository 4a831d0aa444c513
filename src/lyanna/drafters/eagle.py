"""The ``eagle`` baseline: a token-based feature drafter (EAGLE-1 head) with EAGLE-2's dynamic tree.

Every draft step feeds [predicted feature of the parent ; embedding of the drafted token] through
the head, so each branch needs its own row, and a wrong token poisons everything drafted after
it: the contrast Lyanna's hidden-state chain is measured against.

Tree growth (EAGLE-2): the children of the root are the head's top-k tokens; at each further
depth the w best frontier nodes by joint log-probability are expanded (one head pass over the w
rows, tree-masked), each to its top-k children; finally the best N nodes by joint probability
form the tree (a child never scores above its parent, so the set is ancestor-closed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..engine import Transformer
from ..loading import Target
from ..tree import DraftTree
from .checkpoint import load_head
from .head import DraftHead


class EagleDrafter:
    def __init__(self, head: DraftHead, tap: int, depth: int = 5, topk: int = 4, width: int = 4, max_nodes: int = 16):
        self.head, self.tap = head, tap
        self.taps = (tap,)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        self.cache = head.new_cache(1024)
        self.features = np.zeros((0, head.config.hidden_size), np.float32)  # target feature after each fed token

    @classmethod
    def from_checkpoint(cls, path: str | Path, target: Target, engine: Transformer, **tree: int) -> "EagleDrafter":
        config, weights = load_head(path, target, "eagle")
        return cls(DraftHead(engine, weights), int(config["target"]["tap"]), **tree)

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self.features = hidden[self.tap]
        self.cache.length = 0

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self.features = np.concatenate([self.features, hidden[self.tap]])

    def _ensure_capacity(self, need: int) -> None:
        if need > self.cache.capacity:
            bigger = self.head.new_cache(max(need, 2 * self.cache.capacity))
            bigger.k[:, :, : self.cache.length] = self.cache.k[:, :, : self.cache.length]
            bigger.v[:, :, : self.cache.length] = self.cache.v[:, :, : self.cache.length]
            bigger.length = self.cache.length
            self.cache = bigger

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return DraftTree.empty()
        ctx = np.asarray(context, np.int64)
        # Catch up: pair (feature after token i-1, token i) for every committed token i not yet fed,
        # the root last. Pair i sits at position i and cache slot i - 1; a root fed already (a repeated
        # proposal for the same context) is fed again to get its prediction back.
        self.cache.length = min(self.cache.length, len(ctx) - 2)
        first = self.cache.length + 1
        self._ensure_capacity(len(ctx) + self.width * depth + 1)
        pending = np.arange(first, len(ctx))
        out = self.head.step(self.features[pending - 1], ctx[pending], pending, self.cache, None if len(pending) == 1
                             else _causal_bias(self.cache.length, len(pending)))
        base = self.cache.length  # committed pairs, root included
        root_pos = len(ctx) - 1

        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        slot: dict[int, int] = {}  # node -> draft-cache slot of its (parent feature, token) pair
        ancestors: list[set[int]] = []

        def add_children(parent: int, logp: np.ndarray, parent_score: float, d: int) -> list[int]:
            top = np.argpartition(-logp, self.topk)[: self.topk]
            top = top[np.argsort(-logp[top])]
            new = []
            for t in top:
                tokens.append(int(t))
                parents.append(parent)
                scores.append(parent_score + float(logp[t]))
                depths.append(d)
                ancestors.append((ancestors[parent] | {parent}) if parent >= 0 else set())
                new.append(len(tokens) - 1)
            return new

        frontier_feats = {-1: out[-1]}
        candidates = add_children(-1, self.head.log_probs(out[-1:])[0], 0.0, 1)
        for d in range(2, depth + 1):
            frontier = sorted(candidates, key=lambda i: -scores[i])[: self.width]
            feats = np.stack([frontier_feats[parents[i]] for i in frontier])
            start = self.cache.length
            bias = np.full((len(frontier), start + len(frontier)), -np.inf, np.float32)
            bias[:, :base] = 0.0
            for r, node in enumerate(frontier):
                for a in ancestors[node]:
                    bias[r, slot[a]] = 0.0
                bias[r, start + r] = 0.0
                slot[node] = start + r
            pos = np.array([root_pos + depths[i] for i in frontier])
            pred = self.head.step(feats, np.array([tokens[i] for i in frontier]), pos, self.cache, bias)
            logps = self.head.log_probs(pred)
            candidates = []
            for r, node in enumerate(frontier):
                frontier_feats[node] = pred[r]
                candidates += add_children(node, logps[r], scores[node], d)
        self.cache.length = base  # speculative pairs are dropped; committed ones stay

        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: self.max_nodes]
        keep = sorted(order, key=lambda i: (depths[i], i))
        remap = {-1: -1, **{old: new for new, old in enumerate(keep)}}
        return DraftTree(
            np.array([tokens[i] for i in keep], np.int64),
            np.array([remap[parents[i]] for i in keep], np.int64),
            np.exp(np.array([scores[i] for i in keep])),
        )


def _causal_bias(start: int, n: int) -> np.ndarray:
    from ..engine import attention_bias

    return attention_bias(start, np.tril(np.ones((n, n), bool)))
