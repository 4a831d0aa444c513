"""Model-free drafting from suffix matches in the prompt and the output so far.

In the spirit of prompt lookup and SAM decoding: find the longest suffix of the context (up to
``max_ngram`` tokens) that occurred earlier, and propose what followed its most recent
occurrences, merged into a trie. It costs no model pass, and pays where outputs copy from the
prompt (summarization, RAG, code edits).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from .base import Drafter
from .registry import register
from .tree import DraftTree

# Probability that the target accepts the next token of a suffix-match continuation, given that
# everything before it in the tree was accepted, by match length. Measured with
# scripts/measure-suffix-acceptance.py (greedy; no tree budget, so every node is verified; the
# default model smollm2-135m-instruct; the first 12 bench questions, 96 new tokens each): accepted
# nodes over nodes whose parent was accepted, on the most recent continuation. Length 3: 110 of
# 155; 4 and 5: 0 of 1 each (too few to stand alone, pooled with 3: 110 of 157); 6: 64 of 73.
SUFFIX_ACCEPTANCE: dict[int, float] = {3: 0.70, 6: 0.88}


def acceptance_rate(match_len: int) -> float:
    """The rate of the longest measured match length not above ``match_len`` (the shortest for
    shorter matches)."""
    lengths = sorted(SUFFIX_ACCEPTANCE)
    return SUFFIX_ACCEPTANCE[max([n for n in lengths if n <= match_len], default=lengths[0])]


@register
class SuffixDrafter(Drafter):
    VARIANTS = {"suffix": {}}  # model-free: every target gets it

    def __init__(self, max_ngram: int = 6, min_ngram: int = 3, max_depth: int = 7, branches: int = 1, max_nodes: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.branches, self.max_nodes = max_depth, branches, max_nodes
        self._tokens: list[int] = []
        self._index: list[dict[tuple[int, ...], list[int]]] = []

    def fork(self) -> "SuffixDrafter":
        return SuffixDrafter(self.max_ngram, self.min_ngram, self.max_depth, self.branches, self.max_nodes)

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self._tokens = []
        self._index = [defaultdict(list) for _ in range(self.max_ngram + 1)]

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass  # the context passed to propose() is the source of truth

    def _sync(self, context: Sequence[int]) -> None:
        """Index every n-gram that ``match`` may look up (``min_ngram`` to ``max_ngram`` tokens)
        ending at each new context position: n-gram -> where its continuation starts."""
        toks = self._tokens
        if len(context) < len(toks) or (toks and int(context[len(toks) - 1]) != toks[-1]):
            self.start((), {})  # not a continuation of what was indexed: a new generation
            toks = self._tokens
        for t in context[len(toks):]:
            toks.append(int(t))
            end = len(toks)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._index[n][tuple(toks[end - n:end])].append(end)

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        match_len, continuations = self.match(context, min(self.max_depth, max_depth))
        return self._trie(continuations, acceptance_rate(match_len)) if continuations else DraftTree.empty()

    def propose_free(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """The same matches: they cost no draft-model pass, so they are proposed every round."""
        return self.propose(context, max_depth)

    def match(self, context: Sequence[int], depth: int) -> tuple[int, list[list[int]]]:
        """The longest suffix match (its length) and up to ``branches`` continuations of at most
        ``depth`` tokens, the most recent first; (0, []) when nothing matched."""
        self._sync(context)
        toks, end = self._tokens, len(self._tokens)
        if depth < 1:
            return 0, []
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            starts = [s for s in self._index[n].get(tuple(toks[end - n:]), ()) if s < end]
            if starts:
                return n, [toks[s:s + depth] for s in reversed(starts[-self.branches:])]
        return 0, []

    def _trie(self, continuations: list[list[int]], rate: float) -> DraftTree:
        """Continuations merged into a trie. A node scores its parent's score times ``rate``; a
        node beside k earlier siblings gets that share of what they leave, ``rate * (1 - rate)**k``
        (older continuations are taken as equally good guesses, and siblings exclude each other)."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        child: dict[tuple[int, int], int] = {}
        siblings: dict[int, int] = {}
        for cont in continuations:
            parent = -1
            for t in cont:
                key = (parent, t)
                if key not in child:
                    if len(tokens) >= self.max_nodes:
                        break
                    child[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    earlier = siblings.get(parent, 0)
                    siblings[parent] = earlier + 1
                    scores.append((1.0 if parent < 0 else scores[parent]) * rate * (1.0 - rate) ** earlier)
                parent = child[key]
        return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.array(scores))
