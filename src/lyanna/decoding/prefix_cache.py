"""Keys, values and tapped hidden states of recent prompts, so that a prompt sharing a prefix with
one of them prefills only the rest (what vLLM calls automatic prefix caching and llama.cpp's
server ``cache_prompt``).

Why: every chat request starts with the same template and system prompt, and every new turn of a
conversation re-sends the whole history; on a CPU a prompt's prefill is most of a short request.

Exact by construction, not approximately: it is only offered by engines whose rows do not depend
on the block they are computed in (``blockwise_prefill``: the GGUF engine's kernels), so a prompt
prefilled as a cached prefix plus its remainder gets the bits of a prompt prefilled whole, and
outputs never depend on what was served before (tested in ``test_prefix_cache.py``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..engines.transformer import KVCache


@dataclass
class PrefixHit:
    """The first ``length`` positions of a cached prompt: their cache rows and tapped hidden states."""

    length: int
    k: np.ndarray  # [layers, kv_heads, length, head_dim]
    v: np.ndarray
    hidden: dict[int, np.ndarray]  # tap -> [length, hidden]

    def head(self, length: int, taps: Sequence[int]) -> "PrefixHit":
        """Its first ``length`` positions and the hidden states of ``taps`` only (views)."""
        return PrefixHit(length, self.k[:, :, :length], self.v[:, :, :length],
                         {t: self.hidden[t][:length] for t in taps})

    def restore(self, cache: KVCache) -> None:
        """Write the prefix into an empty ``cache``."""
        cache.k[:, :, : self.length] = self.k
        cache.v[:, :, : self.length] = self.v
        cache.length = self.length


@dataclass
class _Entry:
    ids: np.ndarray
    rows: PrefixHit  # every position of the prompt


class PrefixCache:
    """Up to ``max_tokens`` prompt positions of recent prompts, least recently used dropped first."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError("a prefix cache needs room for at least one token")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        # counters, read by the server's health endpoint from another thread
        self.tokens = self.hits = self.reused_tokens = self.lookups = 0

    def lookup(self, ids: Sequence[int], taps: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of ``ids`` (leaving at least its last token to compute, whose
        logits the caller needs) that has every tap in ``taps``; None when nothing matches."""
        ids = np.asarray(ids, np.int64)
        wanted = set(taps)
        self.lookups += 1
        best, best_len = None, 0
        for key, e in self._entries.items():
            if not wanted <= e.rows.hidden.keys():
                continue
            m = min(e.ids.size, ids.size - 1)
            differs = np.flatnonzero(e.ids[:m] != ids[:m])
            common = int(differs[0]) if differs.size else m
            if common > best_len:
                best, best_len = key, common
        if best is None:
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += best_len
        return self._entries[best].rows.head(best_len, taps)

    def stats(self) -> dict[str, int]:
        """Its size and counters (the server's health endpoint)."""
        return {"max_tokens": self.max_tokens, "tokens": self.tokens, "lookups": self.lookups, "hits": self.hits,
                "reused_tokens": self.reused_tokens}

    def store(self, ids: Sequence[int], cache: KVCache, hidden: dict[int, np.ndarray]) -> None:
        """Keep a prefilled prompt: its ``len(ids)`` cache rows and hidden states (copied, the cache
        goes on to decode). Entries that are prefixes of it are dropped: it covers them."""
        ids = np.asarray(ids, np.int64)
        n = ids.size
        if n > self.max_tokens or cache.length < n or any(h.shape[0] != n for h in hidden.values()):
            return
        for key in [k for k, e in self._entries.items()
                    if e.ids.size <= n and np.array_equal(e.ids, ids[: e.ids.size])
                    and e.rows.hidden.keys() <= hidden.keys()]:
            self.tokens -= self._entries.pop(key).ids.size
        rows = PrefixHit(n, cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy(),
                         {t: np.array(h, np.float32) for t, h in hidden.items()})
        self._entries[self._next] = _Entry(ids, rows)
        self._next += 1
        self.tokens += n
        while self.tokens > self.max_tokens:
            self.tokens -= self._entries.popitem(last=False)[1].ids.size
