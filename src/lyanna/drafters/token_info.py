"""Token information and the trees built from it: ``TI(y) = A[y] @ B`` over the draft vocabulary
(hot parents' rows materialized, cold ones formed once), and the token-info tree of a chain's raw
logit rows, compiled, with the fused tree of a round (fresh rows and re-sampled leftover rows)
in one call so that a compiled draft round (``host_round``) can build its tree without leaving
compiled code.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..engines.kernels import exp_nonpositive
from ..errors import LyannaError
from .tree import DraftTree, _best_subset, _depths, _flaw, _union

# Cold parents whose token-info rows the tree builder keeps once computed (32 KB each for an
# 8192-token draft vocabulary): a cold row costs 35-50 us to form (rank 32), against a row read for
# a hot one, and the same cold tokens come back round after round. Pages are committed only when a
# row is written, so unused spare rows cost no memory.
COLD_ROWS = 1024


class TokenInfo:
    """``TI(y) = A[y] @ B`` over the draft vocabulary, with hot parents' rows materialized and
    cold parents' rows materialized the first time a tree meets them (up to ``COLD_ROWS``)."""

    def __init__(self, a: np.ndarray, b: np.ndarray, hot: np.ndarray, fallback: str = "lowrank"):
        if fallback not in ("lowrank", "none"):
            raise LyannaError(f"token-info fallback must be 'lowrank' or 'none', got {fallback!r}")
        self.a = np.ascontiguousarray(a, np.float32)
        self.b = np.ascontiguousarray(b, np.float32)
        self.fallback = fallback
        hot = np.asarray(hot, np.int64)
        self.row_of = np.full(self.a.shape[0], -1, np.int64)
        self.row_of[hot] = np.arange(hot.size)
        spare = COLD_ROWS if fallback == "lowrank" else 0
        self.table = np.zeros((hot.size + spare, self.b.shape[1]), np.float32)  # injection is a row read
        self.table[: hot.size] = self.a[hot] @ self.b
        self.filled = np.array([hot.size], np.int64)  # rows of ``table`` in use
        self._zero = np.zeros(self.b.shape[1], np.float32)

    def kernel_args(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
        """What the compiled tree builders read of the table: ``(table, row_of, filled, a, b, lowrank)``."""
        return self.table, self.row_of, self.filled, self.a, self.b, self.fallback == "lowrank"

    @staticmethod
    def tree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, origin: np.ndarray, depths: np.ndarray,
             flaw: int) -> DraftTree:
        """The ``DraftTree`` of a compiled builder's nodes (``as_tree``'s outputs)."""
        if flaw:  # NaN logits, say: a tree must not carry them to the budget
            raise ValueError(f"the token-info tree builder made an invalid tree (DraftTree flaw {flaw})")
        return DraftTree.valid(tokens, parents, scores, origin, depths) if tokens.size else DraftTree.empty()

    def __call__(self, token: int) -> np.ndarray:
        row = self.row_of[token]
        if row >= 0:
            return self.table[row]
        return self.a[token] @ self.b if self.fallback == "lowrank" else self._zero



@njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _add_low_rank(a: np.ndarray, b: np.ndarray, token: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out += A[token] @ B``, one row of B at a time (vectorized over the draft vocabulary)."""
    for q in range(a.shape[1]):
        aq = a[token, q]
        for j in range(out.shape[0]):
            out[j] += aq * b[q, j]


@njit(cache=True)
def _branch_logits(raw: np.ndarray, tok: int, table: np.ndarray, row_of: np.ndarray, filled: np.ndarray,
                   a: np.ndarray, b: np.ndarray, lowrank: bool, x: np.ndarray) -> None:  # pragma: no cover - compiled
    """``x = raw + TI(tok)``: a hot parent's row from the table; a cold one's formed into the
    table once (while it has room), else on the fly."""
    r = row_of[tok]
    if r < 0 and lowrank and filled[0] < table.shape[0]:  # a cold parent: form its row once
        r = filled[0]
        table[r] = 0.0
        _add_low_rank(a, b, tok, table[r])
        row_of[tok] = r
        filled[0] += 1
    if r >= 0:
        for j in range(x.shape[0]):
            x[j] = raw[j] + table[r, j]
    else:  # the table is full: this cold row is formed on the fly
        x[:] = raw
        if lowrank:
            _add_low_rank(a, b, tok, x)


# Columns a block of ``_top_k``'s scan: their maximum, taken in vector lanes, decides whether the
# block is scanned one column at a time (rarely, after the first blocks: a row's top few stand out).
TOP_K_BLOCK = 16


@njit(cache=True)
def _insert(x: np.ndarray, j: int, top_v: np.ndarray, top_i: np.ndarray) -> None:  # pragma: no cover - compiled
    """Column ``j`` into the sorted top list if it beats its last entry (ties: the earlier column stays first)."""
    k = top_v.shape[0]
    if x[j] > top_v[k - 1]:
        p = k - 1
        while p > 0 and x[j] > top_v[p - 1]:
            top_v[p] = top_v[p - 1]
            top_i[p] = top_i[p - 1]
            p -= 1
        top_v[p] = x[j]
        top_i[p] = j


@njit(cache=True)
def _top_k(x: np.ndarray, top_v: np.ndarray, top_i: np.ndarray) -> None:  # pragma: no cover - compiled
    """The ``len(top_v)`` largest of ``x`` and their columns, largest first, earlier columns
    first among equals: the columns in order, a block of ``TOP_K_BLOCK`` skipped whole where its
    maximum does not beat the list's last entry (none of its columns would enter)."""
    k, blocks = top_v.shape[0], x.shape[0] // TOP_K_BLOCK
    top_v[:] = -np.inf
    top_i[:] = -1
    for blk in range(blocks):
        lo = blk * TOP_K_BLOCK
        m = x[lo]
        for j in range(lo + 1, lo + TOP_K_BLOCK):
            m = max(m, x[j])
        if m > top_v[k - 1]:
            for j in range(lo, lo + TOP_K_BLOCK):
                _insert(x, j, top_v, top_i)
    for j in range(blocks * TOP_K_BLOCK, x.shape[0]):
        _insert(x, j, top_v, top_i)


# Reassociation lets LLVM vectorize the softmax sums (a draft tree needs no fixed rounding). The GIL
# stays held: the kernel writes new cold rows into the token-info table every fork shares.
@njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _tree_candidates(raw: np.ndarray, root: int, table: np.ndarray, row_of: np.ndarray, filled: np.ndarray,
                     a: np.ndarray, b: np.ndarray, lowrank: bool, d2t: np.ndarray, topk: int,
                     width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover - compiled
    """Every candidate node of a token-info tree: per depth, each frontier branch's top-k children
    under ``log_softmax(raw[d] + TI(parent))``, then the ``width`` best by joint log-probability
    (ties to the earlier child) form the next frontier. Compiled because in numpy, 24 softmaxes
    over 8192 columns a tree, this cost about what the draft forward passes did."""
    depth, v = raw.shape
    k = min(topk, v)
    cap = depth * width * k
    tokens = np.empty(cap, np.int64)
    parents = np.empty(cap, np.int64)
    scores = np.empty(cap, np.float64)
    f_node = np.full(width, -1, np.int64)
    f_tok = np.full(width, root, np.int64)
    f_score = np.zeros(width, np.float64)
    nf, n = 1, 0
    x = np.empty(v, np.float32)
    top_i = np.empty(k, np.int64)
    top_v = np.empty(k, np.float32)
    for d in range(depth):
        start = n
        for f in range(nf):
            _branch_logits(raw[d], f_tok[f], table, row_of, filled, a, b, lowrank, x)
            _top_k(x, top_v, top_i)
            mx = top_v[0]
            total = np.float32(0.0)
            for j in range(v):
                total += exp_nonpositive(x[j] - mx)
            lse = mx + np.log(total)
            for c in range(k):
                tokens[n] = d2t[top_i[c]]
                parents[n] = f_node[f]
                scores[n] = f_score[f] + (top_v[c] - lse)
                n += 1
        order = np.argsort(-scores[start:n], kind="mergesort")[:width]
        nf = order.size
        for f in range(nf):
            f_node[f] = start + order[f]
            f_tok[f] = tokens[start + order[f]]
            f_score[f] = scores[start + order[f]]
    return tokens[:n], parents[:n], scores[:n]


@njit(cache=True)
def _best_tree(raw, root, table, row_of, filled, a, b, lowrank, d2t, topk, width, max_nodes):  # pragma: no cover
    """The ``max_nodes`` candidates of ``_tree_candidates`` with the highest joint probability
    (``DraftTree.best``), their parents renumbered, their scores still logs: exp is monotonic, so
    the closed scores rank the nodes as their probabilities do."""
    if raw.shape[0] == 0 or width < 1 or topk < 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    tokens, parents, scores = _tree_candidates(raw, root, table, row_of, filled, a, b, lowrank, d2t, topk, width)
    if max_nodes >= tokens.shape[0]:
        return tokens, parents, scores
    keep, kept, _ = _best_subset(parents, scores, max(max_nodes, 0))
    return tokens[keep], kept, scores[keep]


@njit(cache=True)
def round_tree(raw, leftover, root, table, row_of, filled, a, b, lowrank, d2t, topk, width,
               max_nodes):  # pragma: no cover - compiled
    """A round's tree in log scores, with each node's origin: the best tree of ``raw`` fused
    (``DraftTree.merged``) with the best tree re-sampled from the ``leftover`` rows (none: the
    first alone), cut to ``max_nodes``."""
    knobs = (table, row_of, filled, a, b, lowrank, d2t, topk, width, max_nodes)
    tokens, parents, scores = _best_tree(raw, root, *knobs)
    origin = np.zeros(tokens.shape[0], np.int8)
    if leftover.shape[0] == 0:
        return as_tree(tokens, parents, scores, origin)
    t2, p2, s2 = _best_tree(leftover, root, *knobs)
    tokens, parents, scores, origin = _union(tokens, parents, scores, origin, t2, p2, s2, np.ones(t2.shape[0], np.int8))
    if max_nodes >= tokens.shape[0]:
        return as_tree(tokens, parents, scores, origin)
    keep, kept, _ = _best_subset(parents, scores, max(max_nodes, 0))
    return as_tree(tokens[keep], kept, scores[keep], origin[keep])


@njit(cache=True)
def as_tree(tokens, parents, log_scores, origin):  # pragma: no cover - compiled
    """A builder's nodes as ``TokenInfo.tree`` takes them: scores as probabilities, with the
    nodes' depths and ``DraftTree``'s check of parents and scores (``_flaw``: 0 where valid)."""
    scores = np.exp(log_scores)
    return tokens, parents, scores, origin, _depths(parents), _flaw(parents, scores)


def token_info_tree(raw: np.ndarray, root: int, ti: TokenInfo, d2t: np.ndarray, topk: int, width: int,
                    max_nodes: int, origin: int = 0) -> DraftTree:
    """A tree rooted at ``root`` from one raw-logit row per depth; no draft forward pass."""
    tokens, parents, scores = _best_tree(np.ascontiguousarray(raw, np.float32), int(root), *ti.kernel_args(), d2t,
                                         topk, width, max_nodes)
    return ti.tree(*as_tree(tokens, parents, scores, np.full(tokens.size, origin, np.int8)))
