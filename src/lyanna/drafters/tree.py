"""The draft tree: a small typed object every drafter produces and the verifier consumes.

Nodes are stored in topological order (a parent comes before its children). ``parents[i] == -1``
means node i continues the committed context directly. Everything the target needs to verify
the tree in one pass (positions and the ancestor-only attention mask) is derived here.

Two contracts hold for every tree, checked on construction or by the operations that could
break them: ``scores`` are probabilities in [0, 1] (the tree budget adds them up as expected
accepted tokens), and children drawn at random (``sampled_from``) are never chosen, dropped or
merged by value, which would bias the verifier's sampling rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from numba import njit


@dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # [n] int64 draft token ids
    parents: np.ndarray  # [n] int64, -1 for children of the committed context
    # [n] the drafter's estimate of the probability that verification accepts node i (its whole
    # path: a joint probability, in [0, 1]). The tree budget sums them as expected accepted
    # tokens and ranks nodes by them. Default 1 (no estimate: the budget's online correction learns).
    scores: np.ndarray = field(default=None)
    # Parents (-1 for the root) whose children were *sampled* i.i.d. from a draft distribution q,
    # mapped to that q (a [vocab] array). Children of other parents were chosen deterministically.
    # The verifier needs the whole q to form the residual max(p - q, 0) losslessly.
    sampled_from: dict[int, np.ndarray] = field(default_factory=dict)
    # Where each node came from (0: a fresh draft, 1: re-sampled from an earlier draft chain);
    # statistics only.
    origin: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(self.parents, dtype=np.int64).reshape(-1)
        scores = np.ones(tokens.shape, np.float64) if self.scores is None else np.asarray(self.scores, np.float64).reshape(-1)
        if parents.shape != tokens.shape or scores.shape != tokens.shape:
            raise ValueError(f"tokens, parents and scores must have one entry per node: {tokens.shape}, {parents.shape}, {scores.shape}")
        flaw = _flaw(parents, scores)
        if flaw == 1:
            raise ValueError("each parent must be -1 or an earlier node (topological order)")
        if flaw == 2:
            raise ValueError("DraftTree scores are acceptance-probability estimates and must lie in [0, 1]; got "
                             f"values from {np.min(scores)} to {np.max(scores)}")
        for parent, q in self.sampled_from.items():
            if not -1 <= parent < tokens.size:
                raise ValueError(f"sampled_from names parent {parent}, which is not in the tree")
            if np.ndim(q) != 1 or not np.all(np.isfinite(q)) or np.any(np.asarray(q) < 0):
                raise ValueError(f"sampled_from[{parent}] must be a draft distribution: one finite, non-negative row")
            if np.any(q[tokens[parents == parent]] <= 0):
                raise ValueError(f"a sampled child of parent {parent} has zero draft probability")
        origin = np.zeros(tokens.shape, np.int8) if self.origin is None else np.asarray(self.origin, np.int8).reshape(-1)
        if origin.shape != tokens.shape:
            raise ValueError("origin must have one entry per node")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "scores", scores)
        object.__setattr__(self, "origin", origin)

    @classmethod
    def empty(cls) -> "DraftTree":
        """The tree with no nodes. One instance serves every caller (a tree never changes once
        made), since every round that drafts nothing asks for one."""
        return _EMPTY

    @classmethod
    def valid(cls, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, origin: np.ndarray,
              depths: np.ndarray) -> "DraftTree":
        """A tree without sampled children from parts that hold its contracts already, with their
        depths: a compiled builder's output (its scores checked by ``_flaw`` where it ran; the
        tests check each builder's trees) or a cut of a valid tree. The checks and conversions of
        construction are skipped: a round makes a tree, prunes it and cuts it, each with its data
        cold after the target's pass, and they cost about what building the tree did."""
        tree = object.__new__(cls)
        for name, value in (("tokens", tokens), ("parents", parents), ("scores", scores), ("sampled_from", {}),
                            ("origin", origin)):
            object.__setattr__(tree, name, value)
        depths.flags.writeable = False
        tree.__dict__["depths"] = depths  # the cached property, known already
        return tree

    @classmethod
    def best_of(cls, tokens: list[int], parents: list[int], scores: list[float], max_nodes: int,
                origin: list[int] | None = None) -> "DraftTree":
        """The ``max_nodes`` candidates (parents listed before children, all chosen deterministically)
        with the highest acceptance probability; ``scores`` are their logs (<= 0)."""
        candidates = cls(np.asarray(tokens, np.int64), np.asarray(parents, np.int64),
                         np.exp(np.asarray(scores, np.float64)), origin=origin)
        return candidates.best(max_nodes)

    @classmethod
    def from_packed(cls, v: np.ndarray) -> "DraftTree":
        """The tree a drafter chose on a device, as that one vector crossed to the host
        (``device_tree.packed``: tokens, parents, scores, origin and depths rows of equal
        length, padding after the nodes, then the node count)."""
        n, rows = int(v[-1]), v[:-1].reshape(5, -1)
        return cls(rows[0, :n].astype(np.int64), rows[1, :n].astype(np.int64), rows[2, :n],
                   origin=rows[3, :n].astype(np.int8))

    def merged(self, other: "DraftTree", max_nodes: int) -> "DraftTree":
        """Union of two trees under the same root, cut to ``max_nodes``.

        Deterministic children with equal paths become one node (the higher score, this tree's
        origin; the max only raises parents, so children stay no likelier than their parents).
        Sampled children stay distinct nodes with their ``sampled_from``: where both trees sampled
        children of one node from the same q, this tree's come first and the union is still i.i.d.
        from q. Any other mix under one node (samples from different q's, or samples beside
        deterministic children) has no lossless verification rule here and is refused. A result
        with sampled children is cut by depth (``shallowest``), never by score."""
        if not self.sampled_from and not other.sampled_from:  # every round's case, compiled
            tokens, parents, scores, origin = _union(self.tokens, self.parents, self.scores, self.origin,
                                                     other.tokens, other.parents, other.scores, other.origin)
            return DraftTree(tokens, parents, scores, origin=origin).best(max_nodes)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        origin: list[int] = []
        sampled_from: dict[int, np.ndarray] = {}
        source: dict[int, int] = {}  # merged parent -> the tree that first gave it children
        by_token: dict[tuple[int, int], int] = {}  # (merged parent, token) -> deterministic child
        for which, tree in enumerate((self, other)):
            remap: list[int] = []
            for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
                parent = remap[p] if p >= 0 else -1
                q = tree.sampled_from.get(p)
                if source.setdefault(parent, which) != which:
                    mine = sampled_from.get(parent)
                    if (q is None) != (mine is None) or (q is not None and not np.array_equal(q, mine)):
                        raise ValueError(
                            f"cannot merge children of node {parent}: one tree sampled them and the other "
                            "chose them otherwise (or sampled from another distribution), and no verification "
                            "rule keeps that mix lossless")
                if q is None and (parent, t) in by_token:
                    node = by_token[(parent, t)]
                    scores[node] = max(scores[node], float(tree.scores[i]))
                    remap.append(node)
                    continue
                node = len(tokens)
                if q is None:
                    by_token[(parent, t)] = node
                else:
                    sampled_from[parent] = q
                remap.append(node)
                tokens.append(t)
                parents.append(parent)
                scores.append(float(tree.scores[i]))
                origin.append(int(tree.origin[i]))
        union = DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(scores),
                          sampled_from, np.asarray(origin, np.int8))
        return union.shallowest(max_nodes) if sampled_from else union.best(max_nodes)

    @classmethod
    def chain(cls, tokens: list[int] | np.ndarray, scores: np.ndarray | None = None) -> "DraftTree":
        """A single path: each token continues the previous one."""
        return cls(np.asarray(tokens, np.int64), np.arange(len(tokens)) - 1, scores)

    def children(self) -> dict[int, list[int]]:
        """Children of each parent (-1 for the root), in tree order (made once: do not change it)."""
        return self._children

    @cached_property
    def _children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents.tolist()):
            kids.setdefault(p, []).append(i)
        return kids

    def prune_depth(self, max_depth: int) -> "DraftTree":
        """Drop nodes deeper than ``max_depth`` (children are never kept without their parent)."""
        if len(self) <= max_depth:  # n nodes are never deeper than n
            return self
        keep = np.flatnonzero(self.depths <= max_depth)
        return self if keep.size == len(self) else self._subset(keep)

    def closed_scores(self) -> np.ndarray:
        """Scores made non-increasing from parent to child (a node is no likelier than its
        ancestors), so the best ``n`` by this score always form an ancestor-closed tree."""
        return _closed_scores(self.parents, self.scores)

    def best(self, n: int, closed: np.ndarray | None = None) -> "DraftTree":
        """The ``n`` nodes with the highest (closed) scores, ties to the shallower and earlier node;
        ``closed`` is ``closed_scores()`` when the caller has it already. Refused for a tree with
        sampled children, where dropping samples by value would bias verification (``shallowest``)."""
        if n >= len(self):
            return self
        if self.sampled_from:
            raise ValueError("choosing among sampled children by score is not lossless; cut the tree with shallowest()")
        # the kept nodes' tokens, renumbered parents, scores, origins and depths in one compiled call
        if closed is None:
            closed = self.closed_scores()
        return DraftTree.valid(*best_nodes(self.tokens, self.parents, self.scores, self.origin, self.depths, closed,
                                           max(n, 0)))

    def shallowest(self, n: int) -> "DraftTree":
        """The first ``n`` nodes by depth, then tree order, scores unseen (for trees of i.i.d.
        sampled children, where choosing by score would bias the sampling rule)."""
        if n >= len(self):
            return self
        return self._subset(np.sort(np.lexsort((np.arange(len(self)), self.depths))[:max(n, 0)]))

    def _subset(self, keep: np.ndarray) -> "DraftTree":
        """The nodes ``keep`` (ancestor-closed, increasing), renumbered."""
        remap = np.full(len(self) + 1, -1, np.int64)  # index -1 (the root) stays -1
        remap[keep] = np.arange(keep.size)
        tokens, parents, scores, origin = self.tokens[keep], remap[self.parents[keep]], self.scores[keep], self.origin[keep]
        if not self.sampled_from:
            return DraftTree.valid(tokens, parents, scores, origin, self.depths[keep])
        sampled = {int(remap[p]): q for p, q in self.sampled_from.items() if p == -1 or remap[p] >= 0}
        return DraftTree(tokens, parents, scores, sampled, origin)

    def __len__(self) -> int:
        return int(self.tokens.size)

    @cached_property
    def depths(self) -> np.ndarray:
        """Depth of each node, 1 for children of the committed context (read-only: computed once)."""
        out = _depths(self.parents)
        out.flags.writeable = False
        return out

    def positions(self, prefix_len: int) -> np.ndarray:
        """Position ids: the committed prefix length plus depth - 1 (never the node index)."""
        return prefix_len + self.depths - 1

    def ancestor_mask(self) -> np.ndarray:
        """``mask[i, j]``: node j is node i or one of its ancestors; siblings never see each other."""
        return _ancestor_mask(self.parents)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the top of the tree down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]


# Compiled: a round builds, merges and cuts a few trees of ~100 nodes, and in Python these loops
# cost a sizeable part of a CPU step (their data is cold after the target's pass).


@njit(cache=True)
def _flaw(parents: np.ndarray, scores: np.ndarray) -> int:  # pragma: no cover - compiled
    """0 for a valid tree; 1: a parent not -1 or an earlier node; 2: a score outside [0, 1] (NaN too)."""
    for i in range(parents.shape[0]):
        if parents[i] < -1 or parents[i] >= i:
            return 1
    for i in range(scores.shape[0]):
        if not (0.0 <= scores[i] <= 1.0):
            return 2
    return 0


@njit(cache=True)
def _depths(parents: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.ones(parents.shape[0], np.int64)
    for i in range(parents.shape[0]):
        if parents[i] >= 0:
            out[i] = out[parents[i]] + 1
    return out


@njit(cache=True)
def _closed_scores(parents: np.ndarray, scores: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """Each node's score, lowered to its parent's closed score where that is lower (topological order)."""
    out = scores.copy()
    for i in range(parents.shape[0]):
        p = parents[i]
        if p >= 0 and out[p] < out[i]:
            out[i] = out[p]
    return out


@njit(cache=True)
def _best_nodes(depths: np.ndarray, closed: np.ndarray, n: int) -> np.ndarray:  # pragma: no cover - compiled
    """The ``n`` nodes first by closed score (descending), then depth, then tree order, in tree
    order: two stable sorts, the secondary key first (none for no nodes: a tree kept whole or
    cut to nothing, most of a budget's rounds)."""
    if n <= 0:
        return np.empty(0, np.int64)
    by_depth = np.argsort(depths, kind="mergesort")
    order = by_depth[np.argsort(-closed[by_depth], kind="mergesort")]
    return np.sort(order[:n])


@njit(cache=True)
def _best_closed(parents: np.ndarray, depths: np.ndarray, closed: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``best(n, closed)`` of a valid tree: the kept nodes (``_best_nodes``), their parents
    renumbered among them and their depths."""
    keep = _best_nodes(depths, closed, n)
    remap = np.full(parents.shape[0], -1, np.int64)
    remap[keep] = np.arange(keep.shape[0])
    kept = np.empty(keep.shape[0], np.int64)
    for i in range(keep.shape[0]):
        p = parents[keep[i]]
        kept[i] = remap[p] if p >= 0 else -1
    return keep, kept, depths[keep]


@njit(cache=True)
def _best_subset(parents: np.ndarray, scores: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """``best(n)`` of a valid tree in one call (``_best_closed`` of its depths and closed scores)."""
    return _best_closed(parents, _depths(parents), _closed_scores(parents, scores), n)


@njit(cache=True)
def best_nodes(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, origin: np.ndarray, depths: np.ndarray,
               closed: np.ndarray, n: int):  # pragma: no cover - compiled
    """``best(n, closed)`` of a valid tree as ``DraftTree.valid``'s arguments: each kept node's
    token, renumbered parent, score, origin and depth (``_best_closed``), gathered here, where a
    round's cut would otherwise make a numpy call of each with its data cold."""
    keep, kept, kept_depths = _best_closed(parents, depths, closed, n)
    m = keep.shape[0]
    out_tokens, out_scores, out_origin = np.empty(m, np.int64), np.empty(m, np.float64), np.empty(m, np.int8)
    for i in range(m):
        out_tokens[i], out_scores[i], out_origin[i] = tokens[keep[i]], scores[keep[i]], origin[keep[i]]
    return out_tokens, kept, out_scores, out_origin, kept_depths


@njit(cache=True)
def _ancestor_mask(parents: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    n = parents.shape[0]
    mask = np.zeros((n, n), np.bool_)
    for i in range(n):
        p = parents[i]
        if p >= 0:
            mask[i, :i] = mask[p, :i]
        mask[i, i] = True
    return mask


@njit(cache=True)
def _union(ta: np.ndarray, pa: np.ndarray, sa: np.ndarray, oa: np.ndarray, tb: np.ndarray, pb: np.ndarray,
           sb: np.ndarray, ob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover
    """``DraftTree.merged`` of two trees without sampled children: nodes in order, the first
    tree's then the second's; a child whose parent already has a child of its token becomes that
    node (the higher score, the first origin)."""
    size = ta.shape[0] + tb.shape[0]
    tokens, parents = np.empty(size, np.int64), np.empty(size, np.int64)
    scores, origin = np.empty(size, np.float64), np.empty(size, np.int8)
    remap = np.empty(max(ta.shape[0], tb.shape[0]), np.int64)
    m = 0
    for which in range(2):
        tt, pp, ss, oo = (ta, pa, sa, oa) if which == 0 else (tb, pb, sb, ob)
        for i in range(tt.shape[0]):
            parent = remap[pp[i]] if pp[i] >= 0 else -1
            node = -1
            for j in range(m):  # ~100 nodes: a scan beats a hash map
                if parents[j] == parent and tokens[j] == tt[i]:
                    node = j
                    break
            if node >= 0:
                scores[node] = max(scores[node], ss[i])
            else:
                node = m
                tokens[m], parents[m], scores[m], origin[m] = tt[i], parent, ss[i], oo[i]
                m += 1
            remap[i] = node
    return tokens[:m], parents[:m], scores[:m], origin[:m]


_EMPTY = DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int64))
