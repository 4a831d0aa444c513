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

from ..tree import DraftTree


class SuffixDrafter:
    taps: tuple[int, ...] = ()
    passes = 0  # model-free: no draft passes

    def __init__(self, max_ngram: int = 6, min_ngram: int = 3, max_depth: int = 7, branches: int = 1, max_nodes: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.branches, self.max_nodes = max_depth, branches, max_nodes
        self._tokens: list[int] = []
        self._index: list[dict[tuple[int, ...], list[int]]] = []

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self._tokens = []
        self._index = [defaultdict(list) for _ in range(self.max_ngram + 1)]

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass  # the context passed to propose() is the source of truth

    def _sync(self, context: Sequence[int]) -> None:
        """Index every n-gram ending at each new context position: n-gram -> where its continuation starts."""
        toks = self._tokens
        if len(context) < len(toks) or (toks and int(context[len(toks) - 1]) != toks[-1]):
            self.start((), {})  # not a continuation of what was indexed: a new generation
            toks = self._tokens
        for t in context[len(toks):]:
            toks.append(int(t))
            end = len(toks)
            for n in range(1, min(self.max_ngram, end) + 1):
                self._index[n][tuple(toks[end - n:end])].append(end)

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        self._sync(context)
        toks, end = self._tokens, len(self._tokens)
        depth = min(self.max_depth, max_depth)
        if depth < 1:
            return DraftTree.empty()
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            starts = [s for s in self._index[n].get(tuple(toks[end - n:]), ()) if s < end]
            if starts:
                return self._trie([toks[s:s + depth] for s in reversed(starts[-self.branches:])], n)
        return DraftTree.empty()

    def _trie(self, continuations: list[list[int]], match_len: int) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        child: dict[tuple[int, int], int] = {}
        for rank, cont in enumerate(continuations):
            parent = -1
            for t in cont:
                key = (parent, t)
                if key not in child:
                    if len(tokens) >= self.max_nodes:
                        break
                    child[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    scores.append(match_len / (rank + 1))  # rank by match length and recency
                parent = child[key]
        return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64), np.array(scores))
