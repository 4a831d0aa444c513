"""The one speculative decode loop every drafter runs through.

A round: the drafter proposes a tree that continues the committed context (whose last token,
the root, is not in the target's cache yet); the target runs root + tree in one pass; the
verifier picks the accepted path and the bonus token; the output tracker commits them (cutting
at EOS, stop strings, ``max_new_tokens``); the target cache keeps only root + accepted path; and
the drafter is told what was committed, with the target hidden states it asked for.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Protocol, Sequence

import numpy as np

from .budget import Budget
from .decoding import DecodeState
from .sampling import next_token
from .tree import DraftTree
from .verify import verify


class Drafter(Protocol):
    """Proposes draft trees; learns what was committed."""

    taps: tuple[int, ...]  # target hidden-state taps (HF hidden_states indices) it consumes

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """A new generation: the prompt and its target hidden states."""

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """A tree continuing ``context`` (prompt + committed tokens; the last one is the root)."""

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """Tokens just written to the target cache (root + accepted path) and their hidden rows."""


def _block(tree: DraftTree, root: int, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, positions and mask of root + tree as one verification block."""
    n = len(tree) + 1
    mask = np.zeros((n, n), bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.ancestor_mask()
    tokens = np.concatenate([[root], tree.tokens])
    positions = np.concatenate([[start], tree.positions(start + 1)])
    return tokens, positions, mask


FALLBACK_WARMUP_ROUNDS = 8


def decode_speculative(state: DecodeState, drafter: Drafter, budget: Budget | None = None,
                       fallback_step_seconds: float | None = None) -> None:
    """``budget`` trims each proposed tree (None: verify it whole). ``fallback_step_seconds``
    (the target's one-token latency): after a warm-up, stop drafting for the rest of this
    generation once speculation commits tokens more slowly than plain decoding would."""
    engine, cache, tracker = state.engine, state.cache, state.tracker
    stats = state.stats
    drafter.start(state.prompt_ids, state.prefill_hidden)
    passes_before = getattr(drafter, "passes", 0)
    root = next_token(state.last_logits, state.params, state.rng)
    tracker.extend([root])
    by_depth_tried: Counter[int] = Counter()
    by_depth_accepted: Counter[int] = Counter()
    accepted_lengths: list[int] = []
    drafting = True
    spec_seconds = 0.0
    spec_tokens = 0
    while not tracker.finished:
        t0 = time.perf_counter()
        remaining = tracker.max_new_tokens - len(tracker.tokens)
        if drafting:
            tree = drafter.propose(state.prompt_ids + tracker.tokens, remaining - 1)
            tree = tree.prune_depth(remaining - 1)
            if budget is not None:
                tree = budget.choose(tree, time.perf_counter() - t0)
        else:
            tree = DraftTree.empty()
        t1 = time.perf_counter()
        start = cache.length
        tokens, positions, mask = _block(tree, root, start)
        out = engine.forward(tokens, positions, cache, block_mask=mask, taps=drafter.taps if drafting else ())
        state.target_passes += 1
        verdict = verify(tree, out.logits, state.params, state.rng)
        taken = tracker.extend(verdict.tokens)
        keep = [0] + [1 + i for i in verdict.path]
        cache.compact(start, keep)
        t2 = time.perf_counter()
        committed_drafts = min(len(verdict.path), taken)
        if budget is not None and drafting:
            budget.observe(tree, len(verdict.path))
        stats["recovered_tokens"] = stats.get("recovered_tokens", 0) + int(tree.origin[verdict.path[:committed_drafts]].sum())
        state.draft_tokens += len(tree)
        state.accepted_draft_tokens += committed_drafts
        accepted_lengths.append(committed_drafts)
        depths = tree.depths
        kids = tree.children()
        for d, node in enumerate([-1] + verdict.path, start=1):
            if any(depths[c] == d for c in kids.get(node, [])):
                by_depth_tried[d] += 1
                by_depth_accepted[d] += d <= len(verdict.path)
        if not tracker.finished:
            if drafting:
                drafter.commit(tokens[keep].tolist(), {k: v[keep] for k, v in out.hidden.items()})
            root = verdict.tokens[-1]
        t3 = time.perf_counter()
        if drafting and fallback_step_seconds is not None:
            spec_seconds += t3 - t0
            spec_tokens += taken
            if len(accepted_lengths) >= FALLBACK_WARMUP_ROUNDS and spec_tokens * fallback_step_seconds < spec_seconds:
                drafting = False
                stats["fell_back_after_tokens"] = len(tracker.tokens)
        stats["draft_seconds"] = stats.get("draft_seconds", 0.0) + (t1 - t0)
        stats["verify_seconds"] = stats.get("verify_seconds", 0.0) + (t2 - t1)
        stats["other_seconds"] = stats.get("other_seconds", 0.0) + (t3 - t2)
    stats["rounds"] = len(accepted_lengths)
    if hasattr(drafter, "passes"):
        stats["draft_passes"] = drafter.passes - passes_before
    stats["accepted_by_depth"] = {d: [by_depth_accepted[d], by_depth_tried[d]] for d in sorted(by_depth_tried)}
