"""A batch's Lyanna rounds drafted together (``base.DraftRequest``): on a CPU a draft step is one
row through the head, bound by streaming the head's weights (a layer and the draft vocabulary's
LM-head rows, several MB), so 8 sequences drafting one after another stream them 8 times where
one pass of the head a step streams them once for all.

``ChainRequest`` is a round's request (``LyannaDrafter.request``); ``HostChains`` drafts a batch of
them on the host head (``lyanna.ChainHead``): every sequence's catch-up in one step of the head,
each chain step in one (the sequences whose chains go that deep), the raw logits of every chain in
one product, then each sequence's trees as it builds them alone. The kernels compute a row the
same way whatever shares its block, so on a GGUF's blocks each sequence drafts exactly what it
drafts alone. The device head drafts a batch on its row caches (``device_rows.HeadRows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..engines.transformer import KVCache, attention_bias
from .base import DraftRequest
from .head import STEP_CATCH_UP, PairContext
from .tree import DraftTree

if TYPE_CHECKING:
    import torch


class TokenTable(Protocol):
    """What the heads read of a request's token information (``lyanna.TokenInfo``): stated here
    so that this module need not import ``lyanna``, which imports it."""

    fallback: str
    row_of: np.ndarray


class ChainDrafting(Protocol):
    """A request's drafter (``lyanna.LyannaDrafter``), told its outcome."""

    def drafted(self, request: "ChainRequest", chain: "np.ndarray | torch.Tensor", tree: DraftTree) -> DraftTree: ...


class HostChainHead(Protocol):
    """What ``HostChains`` runs of its head (``lyanna.ChainHead``)."""

    def fill(self, features: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cache: KVCache) -> None: ...

    def fuse(self, features: np.ndarray, tokens: np.ndarray) -> np.ndarray: ...

    def layers_over(self, x: np.ndarray, positions: np.ndarray | Sequence[int],
                    spans: Sequence[tuple[int, int, KVCache, np.ndarray | None]], below: bool = False) -> np.ndarray: ...

    def raw_logits(self, features: np.ndarray) -> np.ndarray: ...

    def tree(self, raw: np.ndarray, root: int, ti: Any, topk: int, width: int, max_nodes: int,
             origin: int = 0) -> DraftTree: ...


@dataclass
class ChainRequest(DraftRequest):
    """A Lyanna round's drafting (``LyannaDrafter.request``): its chain's depth, its context, its
    token information and tree shape, and the last chain's rows still valid (None: none; host
    rows on the host head, device rows on the device head)."""

    drafter: ChainDrafting
    chain: int
    pc: PairContext
    ti: TokenTable
    shape: tuple[int, int, int]  # top-k, width, max nodes
    leftover: "np.ndarray | torch.Tensor | None"


def chain_requests(requests: Sequence[DraftRequest]) -> list[ChainRequest]:
    """``requests`` as the ``ChainRequest``s a Lyanna head drafts (a clear error for others)."""
    reqs = [r for r in requests if isinstance(r, ChainRequest)]
    if len(reqs) != len(requests):
        raise TypeError("a Lyanna head drafts ChainRequests only")
    return reqs


class HostChains:
    """Drafts a batch's ``ChainRequest``s on the host ``head`` together (see the module)."""

    def __init__(self, head: HostChainHead):
        self.head = head
        self.calls, self.most = 0, 0  # calls run, and the most sequences one drafted for

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """Each request's tree, in order."""
        reqs = chain_requests(requests)
        self.calls, self.most = self.calls + 1, max(self.most, len(reqs))
        chains = self._chains(reqs)
        sizes = [r.chain for r in reqs]
        raw = np.split(self.head.raw_logits(np.concatenate(chains)), np.cumsum(sizes)[:-1])
        trees = []
        for r, rows in zip(reqs, raw):
            r.pc.rewind()
            topk, width, max_nodes = r.shape
            root = int(r.context[-1])
            tree = self.head.tree(rows, root, r.ti, topk, width, max_nodes)
            if r.leftover is not None:
                tree = tree.merged(self.head.tree(r.leftover, root, r.ti, topk, width, max_nodes, origin=1), max_nodes)
            trees.append(r.drafter.drafted(r, rows, tree))
        return trees

    def _chains(self, reqs: Sequence[ChainRequest]) -> list[np.ndarray]:
        """Each request's chain features ``f_1..f_chain``: the catch-ups in one step of the head
        (a new prompt's older pairs filled first), then a step for every level some chain
        reaches; the contexts' caches hold the speculative rows until ``rewind``."""
        head = self.head
        pendings = []
        for r in reqs:
            pending = r.pc.reserve(r.context, r.chain)
            if len(pending) > STEP_CATCH_UP:
                old = pending[:-1]
                head.fill(r.pc.features[old - 1], r.context[old], old, r.pc.cache)
                pending = pending[-1:]
            pendings.append(pending)
        x = head.fuse(np.concatenate([r.pc.features[p - 1] for r, p in zip(reqs, pendings)]),
                      np.concatenate([r.context[p] for r, p in zip(reqs, pendings)]))
        spans, lo = [], 0
        for r, p in zip(reqs, pendings):
            n = len(p)
            spans.append((lo, lo + n, r.pc.cache,
                          None if n == 1 else attention_bias(r.pc.cache.length, np.tril(np.ones((n, n), bool)))))
            lo += n
        out = head.layers_over(x, np.concatenate(pendings), spans)
        features = [[out[hi - 1]] for _, hi, _, _ in spans]
        for r, p in zip(reqs, pendings):
            r.pc.cache.length += len(p)
            r.pc.base = r.pc.cache.length
            r.pc.passes += r.chain
        for level in range(1, max(r.chain for r in reqs)):
            going = [i for i, r in enumerate(reqs) if r.chain > level]
            x = np.stack([features[i][-1] for i in going])
            positions = [len(reqs[i].context) - 1 + level for i in going]
            out = head.layers_over(x, positions, [(j, j + 1, reqs[i].pc.cache, None) for j, i in enumerate(going)])
            for j, i in enumerate(going):
                features[i].append(out[j])
                reqs[i].pc.cache.length += 1
        return [np.stack(f) for f in features]
