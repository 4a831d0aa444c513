"""The Lyanna drafter: a hidden-state chain, token information injected late, trees by token-info
sampling, re-sampling after a rejection, and verification fusion.

- The chain: ``f_1`` comes from the head over the committed (feature, token) pairs, the root last;
  then ``f_k = layer(f_{k-1})`` with no token input. The chain depends only on verified context, so
  it stays valid whatever draft tokens are rejected.
- Raw logits ``l_k = norm(f_k) @ W_draft`` over the draft vocabulary (the target's LM head rows
  of the most frequent tokens, ``d2t`` maps them back to target ids).
- Token information: ``L_k = l_k + TI(parent token)``, ``TI(y) = A[y] @ B`` (low rank), with the
  rows of hot parent tokens materialized once into a table.
- Tree: per depth one shared ``l_k``; each frontier branch adds its parent's TI row, expands its
  top-k children, and the ``width`` best by joint probability form the next frontier.
- Re-sampling: after ``a`` accepted tokens and the target's bonus ``b``, rows ``l_{a+2}..l_D`` of
  the same chain plus ``TI(b)`` give a new tree rooted at ``b`` with no draft forward pass.
- Policy ``fuse`` merges that tree into the next fresh one (one verification for both), ``reuse``
  verifies it alone without drafting when its expected accepted length is high enough, ``off``
  always drafts afresh.
- ``lyanna+suffix`` also merges the suffix drafter's continuations (model-free matches in the
  prompt and output) into every tree; the budget then keeps the likeliest nodes of both, so
  copying stretches (summaries, RAG) get long branches and the rest keep the chain's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from ..engine import TargetEngine, layer_forward, rotation
from ..errors import LyannaError
from ..kernels import linear, rms_norm
from ..loading import Target
from ..tree import DraftTree
from .checkpoint import decode_settings, load_head
from .head import DraftHead, PairContext
from .suffix import SuffixDrafter

ARCH = "lyanna"
POLICIES = ("fuse", "reuse", "off")
# Tree shape and token-info fallback when the checkpoint's settings.decode does not say otherwise.
DECODE_DEFAULTS = {"depth": 6, "topk": 4, "width": 4, "max_nodes": 64, "ti_fallback": "lowrank"}


class TokenInfo:
    """``TI(y) = A[y] @ B`` over the draft vocabulary, with hot parents' rows materialized."""

    def __init__(self, a: np.ndarray, b: np.ndarray, hot: np.ndarray, fallback: str = "lowrank"):
        if fallback not in ("lowrank", "none"):
            raise LyannaError(f"token-info fallback must be 'lowrank' or 'none', got {fallback!r}")
        self.a, self.b, self.fallback = np.asarray(a, np.float32), np.asarray(b, np.float32), fallback
        hot = np.asarray(hot, np.int64)
        self.row_of = np.full(self.a.shape[0], -1, np.int64)
        self.row_of[hot] = np.arange(hot.size)
        self.table = self.a[hot] @ self.b  # [hot, draft vocab]: injection is a row read
        self._zero = np.zeros(self.b.shape[1], np.float32)

    def __call__(self, token: int) -> np.ndarray:
        row = self.row_of[token]
        if row >= 0:
            return self.table[row]
        return self.a[token] @ self.b if self.fallback == "lowrank" else self._zero


class ChainHead(DraftHead):
    """The draft head plus the hidden-state chain and raw logits over the draft vocabulary."""

    def __init__(self, target: TargetEngine, weights: dict[str, np.ndarray]):
        super().__init__(target, weights)
        self.norm = np.asarray(weights["norm.weight"], np.float32)
        d2t = np.asarray(weights["d2t"], np.int64)
        if d2t.ndim != 1 or d2t.size == 0 or np.unique(d2t).size != d2t.size or d2t.min() < 0 or d2t.max() >= self.config.vocab_size:
            raise LyannaError("draft vocabulary map d2t must list distinct target token ids")
        self.d2t = d2t
        self.draft_lm_head = np.ascontiguousarray(target.lm_head[d2t])

    def chain_step(self, feature: np.ndarray, position: int, cache) -> np.ndarray:
        """``f_k = layer(f_{k-1})``: one row, no token input."""
        out = layer_forward(self.layer, self.config, feature[None], rotation(self.inv_freq, [position]),
                            cache.k[0], cache.v[0], cache.length, None)
        cache.length += 1
        return out[0]

    def raw_logits(self, features: np.ndarray) -> np.ndarray:
        return linear(rms_norm(features, self.norm, self.config.rms_norm_eps), self.draft_lm_head)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_info_tree(raw: np.ndarray, root: int, ti: TokenInfo, d2t: np.ndarray, topk: int, width: int,
                    max_nodes: int, origin: int = 0) -> DraftTree:
    """A tree rooted at ``root`` from one raw-logit row per depth; no draft forward pass."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    frontier = [(-1, root, 0.0)]
    k = min(topk, raw.shape[1])
    for row in raw:
        logp = _log_softmax(row[None] + np.stack([ti(tok) for _, tok, _ in frontier]))
        children = []
        for (node, _, score), lp in zip(frontier, logp):
            top = np.argpartition(-lp, k - 1)[:k]
            for j in top[np.argsort(-lp[top])]:
                tokens.append(int(d2t[j]))
                parents.append(node)
                scores.append(score + float(lp[j]))
                children.append((len(tokens) - 1, int(d2t[j]), scores[-1]))
        frontier = sorted(children, key=lambda c: -c[2])[:width]
    return DraftTree.best_of(tokens, parents, scores, max_nodes, [origin] * len(tokens))


class LyannaDrafter:
    ARCH = ARCH  # the checkpoint arch it loads
    # The methods one checkpoint provides: Lyanna and its ablations (no re-sampling; re-sampling
    # without fusion, its tree verified alone whenever it has one).
    VARIANTS: dict[str, dict] = {
        ARCH: {"policy": "fuse"},
        f"{ARCH}-noresample": {"policy": "off"},
        f"{ARCH}-nofusion": {"policy": "reuse", "reuse_min_expected": 0.0},
        f"{ARCH}+suffix": {"policy": "fuse", "suffix": True},
    }

    def __init__(self, head: ChainHead, ti: TokenInfo, tap: int, depth: int = DECODE_DEFAULTS["depth"],
                 topk: int = DECODE_DEFAULTS["topk"], width: int = DECODE_DEFAULTS["width"],
                 max_nodes: int = DECODE_DEFAULTS["max_nodes"], policy: str = "fuse", reuse_min_expected: float = 1.5,
                 suffix: bool = False):
        """``reuse_min_expected``: policy ``reuse`` verifies the re-sampled tree alone when the sum of
        its acceptance probabilities (its expected accepted length) reaches this. ``suffix``: merge
        suffix-match continuations into every tree."""
        if policy not in POLICIES:
            raise LyannaError(f"resample policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.head, self.ti, self.tap = head, ti, tap
        self.taps = (tap,)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        self.policy, self.reuse_min_expected = policy, reuse_min_expected
        self.context = PairContext(head, tap)
        self.suffix = SuffixDrafter() if suffix else None
        self._chain: np.ndarray | None = None  # raw-logit rows the last tree was built from
        self._leftover: np.ndarray | None = None  # rows still valid after the next root

    @classmethod
    def methods_from_checkpoint(cls, path: str | Path, target: Target, engine: TargetEngine) -> dict[str, "LyannaDrafter"]:
        """Every method of ``VARIANTS``, built from the checkpoint at ``path`` (they share the
        stateless head and token-info table; each keeps its own context)."""
        config, weights = load_head(path, target, ARCH)
        knobs = decode_settings(config, DECODE_DEFAULTS, path)
        head = ChainHead(engine, weights)
        ti = TokenInfo(weights["ti.a"], weights["ti.b"], weights["ti.hot"], knobs.pop("ti_fallback"))
        tap = int(config["target"]["tap"])
        return {name: cls(head, ti, tap, **{**knobs, **variant}) for name, variant in cls.VARIANTS.items()}

    @property
    def passes(self) -> int:
        return self.context.passes

    def fork(self) -> "LyannaDrafter":
        """The same head, table and settings with a context and chain of its own (one per generation)."""
        return LyannaDrafter(self.head, self.ti, self.tap, self.depth, self.topk, self.width, self.max_nodes,
                             self.policy, self.reuse_min_expected, suffix=self.suffix is not None)

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self.context.start(hidden)
        self._chain = self._leftover = None
        if self.suffix is not None:
            self.suffix.start(prompt_ids, hidden)

    def skip(self) -> None:
        """A round without a proposal: the last chain does not continue the next root."""
        self._chain = self._leftover = None

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """``tokens`` = the root and the accepted drafts; the chain rows after them stay valid."""
        self.context.commit(hidden)
        if self._chain is not None:
            self._leftover = self._chain[len(tokens):]

    def chain(self, context: Sequence[int], depth: int) -> np.ndarray:
        """Raw logits ``l_1..l_depth`` after ``context`` (its last token is the root)."""
        ctx = np.asarray(context, np.int64)
        pc = self.context
        features = [pc.catch_up(ctx, extra=depth)]
        for k in range(2, depth + 1):
            features.append(self.head.chain_step(features[-1], len(ctx) - 2 + k, pc.cache))
            pc.passes += 1
        pc.rewind()
        return self.head.raw_logits(np.stack(features))

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        tree = self._propose_chain(context, max_depth)
        if self.suffix is None:
            return tree
        matched = self.suffix.propose(context, max_depth)
        return tree.merged(matched, self.max_nodes + len(matched)) if len(matched) else tree

    def _propose_chain(self, context: Sequence[int], max_depth: int) -> DraftTree:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return DraftTree.empty()
        root = int(context[-1])
        tree_args = (self.ti, self.head.d2t, self.topk, self.width, self.max_nodes)
        resampled = None
        if self.policy != "off" and self._leftover is not None and len(self._leftover):
            rows = self._leftover[:depth]
            resampled = token_info_tree(rows, root, *tree_args, origin=1)
            if self.policy == "reuse" and resampled.scores.sum() >= self.reuse_min_expected:
                self._chain = rows
                return resampled
        self._chain = self.chain(context, depth)
        fresh = token_info_tree(self._chain, root, *tree_args)
        if self.policy == "fuse" and resampled is not None:
            return fresh.merged(resampled, self.max_nodes)
        return fresh
