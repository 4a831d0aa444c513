"""What a drafter is to the decode loop: it proposes draft trees and learns what was committed."""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from .tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees; learns what was committed."""


    taps: tuple[int, ...]  # target hidden-state taps (HF hidden_states indices) it consumes


    @property
    def passes(self) -> int:
        """Draft-model forward passes so far (0 for a model-free drafter), for statistics."""


    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """A new generation: the prompt and its target hidden states."""


    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """A tree continuing ``context`` (prompt + committed tokens; the last one is the root; the
        loop grows this list afterwards, so keep a copy of what must outlive the call)."""


    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        """Tokens just written to the target cache (root + accepted path) and their hidden rows."""


def fork(drafter: Drafter) -> Drafter:
    """A drafter for one more generation: ``drafter.fork()`` (same weights and settings, its own
    per-sequence state) where it has one, else ``drafter`` itself, which can then serve only one
    generation at a time (``can_fork`` says which)."""
    return drafter.fork() if can_fork(drafter) else drafter  # type: ignore[attr-defined]


def can_fork(drafter: Drafter) -> bool:
    return callable(getattr(drafter, "fork", None))


class NoDrafter:
    """The drafter of ``ar``: it proposes nothing, so every round is one plain decoding step."""


    taps: tuple[int, ...] = ()
    passes = 0
    _EMPTY = DraftTree.empty()


    def fork(self) -> "NoDrafter":
        return self  # stateless


    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass


    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        return self._EMPTY


    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        pass
