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
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..engines.base import PendingOutput, TargetEngine
from ..engines.kernels import linear, rms_norm
from ..engines.loading import Target
from ..engines.quant import QuantMatrix, fit_q4_1
from ..errors import LyannaError
from .base import BatchDrafter, DeviceDrafter, Drafter, DraftsTogether
from .checkpoint import decode_settings, head_taps, load_head
from .head import DraftHead, PairContext
from .host_round import CompiledChain
from .lyanna_batch import ChainRequest, HostChains
from .registry import register
from .suffix import SuffixDrafter
from .token_info import TokenInfo, token_info_tree
from .tree import DraftTree

if TYPE_CHECKING:
    import torch

    from ..engines.device import DeviceTree
    from .device import DeviceChainHead

ARCH = "lyanna"
POLICIES = ("fuse", "reuse", "off")
# Tree shape and token-info fallback when the checkpoint's settings.decode does not say otherwise.
DECODE_DEFAULTS = {"depth": 6, "topk": 4, "width": 4, "max_nodes": 64, "ti_fallback": "lowrank"}


class ChainHead(DraftHead):
    """The draft head plus the hidden-state chain and raw logits over the draft vocabulary."""

    def __init__(self, target: TargetEngine, weights: dict[str, np.ndarray]):
        super().__init__(target, weights)
        self.norm = np.asarray(weights["norm.weight"], np.float32)
        d2t = np.asarray(weights["d2t"], np.int64)
        if d2t.ndim != 1 or d2t.size == 0 or np.unique(d2t).size != d2t.size or d2t.min() < 0 or d2t.max() >= self.config.vocab_size:
            raise LyannaError("draft vocabulary map d2t must list distinct target token ids")
        self.d2t = d2t
        # The target's LM-head rows of the draft vocabulary; on a GGUF's blocks as Q4_1 blocks
        # fitted to them, as the head's own matrices (``DraftHead``): every round reads them from
        # memory again, and they are the largest matrix a round reads.
        lm = target.lm_head
        self.draft_lm_head = fit_q4_1(lm[d2t], lm.kernel) if isinstance(lm, QuantMatrix) else lm.take(d2t, axis=0)
        self.batch = HostChains(self)  # a batch's rounds drafted together
        self._compiled = CompiledChain.of(self)  # a round's passes in one call, where the head allows

    def drafts_together(self, pc: PairContext, length: int, depth: int) -> DraftsTogether | None:
        """What drafts a batch's rounds in one pass of the head a step (every context, here)."""
        return self.batch

    def chain(self, first: np.ndarray, root_position: int, depth: int, cache) -> np.ndarray:
        """``f_1..f_depth`` from ``f_1 = first``: ``f_k = layer(f_{k-1})`` (one row, no token
        input) at position ``root_position + k - 1``, written to ``cache`` (the caller rewinds it)."""
        features = [first]
        for k in range(2, depth + 1):
            features.append(self.layer_step(features[-1][None], [root_position + k - 1], cache, None)[0])
            cache.length += 1
        return np.stack(features)

    def raw_logits(self, features: np.ndarray) -> np.ndarray:
        return linear(rms_norm(features, self.norm, self.config.rms_norm_eps), self.draft_lm_head)

    def draft(self, pc: PairContext, ctx: np.ndarray, depth: int) -> np.ndarray:
        """Raw logits ``l_1..l_depth`` after ``ctx``: the catch-up, the chain, the logits; the
        context's cache is left at its committed pairs."""
        raw = None if self._compiled is None else self._compiled.draft(pc, ctx, depth)
        if raw is not None:
            return raw
        features = self.chain(pc.catch_up(ctx, extra=depth), len(ctx) - 1, depth, pc.cache)
        pc.passes += depth - 1
        pc.rewind()
        return self.raw_logits(features)

    def tree(self, raw: np.ndarray, root: int, ti: TokenInfo, topk: int, width: int, max_nodes: int,
             origin: int = 0) -> DraftTree:
        """The token-info tree of ``raw`` rooted at ``root`` (``token_info_tree``)."""
        return token_info_tree(raw, root, ti, self.d2t, topk, width, max_nodes, origin)

    def draft_trees(self, pc: PairContext, ctx: np.ndarray, depth: int, leftover: np.ndarray | None, ti: TokenInfo,
                    topk: int, width: int, max_nodes: int) -> tuple[np.ndarray, DraftTree]:
        """A round's drafting: the chain's raw logits after ``ctx`` (``draft``) and the round's tree,
        rooted at ``ctx[-1]``: their tree fused with the tree re-sampled from ``leftover`` rows (None:
        their tree alone), cut to ``max_nodes``: in one compiled call on blocks (``host_round``), as
        the device head does it in one call."""
        drafted = None if self._compiled is None else self._compiled.draft_trees(pc, ctx, depth, leftover, ti, self.d2t,
                                                                                  topk, width, max_nodes)
        if drafted is not None:
            return drafted
        raw, root = self.draft(pc, ctx, depth), int(ctx[-1])
        fresh = self.tree(raw, root, ti, topk, width, max_nodes)
        if leftover is None:
            return raw, fresh
        return raw, fresh.merged(self.tree(leftover, root, ti, topk, width, max_nodes, origin=1), max_nodes)


@register
class LyannaDrafter(DeviceDrafter, BatchDrafter):
    ARCH = ARCH
    # The methods one checkpoint provides: Lyanna and its ablations (no re-sampling; re-sampling
    # without fusion, its tree verified alone whenever it has one).
    VARIANTS = {
        ARCH: {"policy": "fuse"},
        f"{ARCH}-noresample": {"policy": "off"},
        f"{ARCH}-nofusion": {"policy": "reuse", "reuse_min_expected": 0.0},
        f"{ARCH}+suffix": {"policy": "fuse", "suffix": True},
    }
    # The chain's norm, the draft-vocabulary map and the token-information factors.
    TENSORS = ("fc.weight", "fc.bias", "norm.weight", "d2t", "ti.a", "ti.b", "ti.hot")
    TRAINING = "lyanna.training.recipes:LyannaRecipe"

    def __init__(self, head: "ChainHead | DeviceChainHead", ti: TokenInfo, taps: Sequence[int],
                 depth: int = DECODE_DEFAULTS["depth"],
                 topk: int = DECODE_DEFAULTS["topk"], width: int = DECODE_DEFAULTS["width"],
                 max_nodes: int = DECODE_DEFAULTS["max_nodes"], policy: str = "fuse", reuse_min_expected: float = 1.5,
                 suffix: bool = False):
        """``reuse_min_expected``: policy ``reuse`` verifies the re-sampled tree alone when the sum of
        its acceptance probabilities (its expected accepted length) reaches this. ``suffix``: merge
        suffix-match continuations into every tree."""
        if policy not in POLICIES:
            raise LyannaError(f"resample policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.head, self.ti, self.taps = head, ti, tuple(taps)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        if not isinstance(head, ChainHead):  # a device head builds calls as deep as its drafters draft
            head.drafts_to(depth)
        self.policy, self.reuse_min_expected = policy, reuse_min_expected
        self.context = head.context(self.taps)
        self.suffix = SuffixDrafter() if suffix else None
        self._chain: np.ndarray | None = None  # raw-logit rows the last tree was built from
        self._leftover: np.ndarray | None = None  # rows still valid after the next root

    @classmethod
    def build(cls, target: Target, engine: TargetEngine, checkpoint: Path | None = None) -> dict[str, Drafter]:
        """Every method of ``VARIANTS``, built from the checkpoint at ``path`` (they share the
        stateless head and token-info table; each keeps its own context)."""
        if checkpoint is None:
            raise LyannaError(f"{cls.ARCH} is a draft head: it needs a checkpoint")
        config, weights = load_head(checkpoint, target, cls)
        knobs = decode_settings(config, DECODE_DEFAULTS, checkpoint)
        if getattr(engine, "heads_on_device", False):  # the target runs on a torch device: the head runs there too
            from .device import DeviceChainHead

            head = DeviceChainHead(engine, weights)
        else:
            head = ChainHead(engine, weights)
        ti = TokenInfo(weights["ti.a"], weights["ti.b"], weights["ti.hot"], knobs.pop("ti_fallback"))
        taps = head_taps(config, target.config.num_layers, checkpoint)
        return {name: cls(head, ti, taps, **{**knobs, **variant}) for name, variant in cls.VARIANTS.items()}

    @property
    def passes(self) -> int:
        return self.context.passes

    def fork(self) -> "LyannaDrafter":
        """The same head, table and settings with a context and chain of its own (one per generation)."""
        return LyannaDrafter(self.head, self.ti, self.taps, self.depth, self.topk, self.width, self.max_nodes,
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

    def propose_after(self, pending: PendingOutput, context: Sequence[int], max_depth: int,
                      nodes: int | None) -> "DeviceTree | None":
        """A device head's next round drafted from the pending pass's outcome on the device
        (``DeviceChainHead.draft_trees_after``), for trees left there as ``propose_sized``'s
        are; the last round's chain gives the leftover rows (policy ``fuse``)."""
        depth = min(self.depth, max_depth)
        if (not self.on_device or self.suffix is not None or self.policy == "reuse" or nodes == 0
                or depth < 1 or self._chain is None):
            return None
        drafted = self.head.draft_trees_after(self.context, pending, len(context), self._chain, depth,
                                              self.policy == "fuse", self.ti, self.topk, self.width, self.max_nodes,
                                              nodes)
        if drafted is None:
            return None
        self._chain, tree = drafted
        return tree

    @property
    def on_device(self) -> bool:
        return not isinstance(self.head, ChainHead)

    def follow_plain(self, pending: PendingOutput, context: Sequence[int]) -> bool:
        """A device head hands the pending round's rows over for a plain step after it, where
        this round would propose nothing from the host: no chain rows left over, no suffix."""
        if not self.on_device or self.suffix is not None or self._chain is not None:
            return False
        self.head.follow_plain(self.context, pending, len(context))
        return True

    def settle(self, tokens: Sequence[int]) -> None:
        """The head's draft (or plain step) after that round took its rows and its leftover
        chain rows already."""
        self.context.settle(len(tokens))

    def chain(self, context: Sequence[int], depth: int) -> np.ndarray:
        """Raw logits ``l_1..l_depth`` after ``context`` (its last token is the root)."""
        return self.head.draft(self.context, np.asarray(context, np.int64), depth)

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        return self._with_suffix(self._propose_chain(context, max_depth), context, max_depth)

    def request(self, context: Sequence[int], max_depth: int) -> ChainRequest | None:
        """A batch's rounds draft together (``lyanna_batch``; on the device, on its row caches);
        the tree comes to the host, where the budget cuts it and suffix matches join it (policy
        ``reuse`` chooses on the host first: it proposes on its own)."""
        depth = min(self.depth, max_depth)
        if self.policy == "reuse" or depth < 1 or self.topk < 1 or self.width < 1:
            return None
        together = self.head.drafts_together(self.context, len(context), depth)
        if together is None:
            return None
        leftover = None
        if self.policy == "fuse" and self._leftover is not None and len(self._leftover):
            leftover = self._leftover[:depth]
        return ChainRequest(together, self, np.asarray(context, np.int64), max_depth, depth, self.context, self.ti,
                            (self.topk, self.width, self.max_nodes), leftover)

    def drafted(self, request: ChainRequest, chain: "np.ndarray | torch.Tensor", tree: DraftTree) -> DraftTree:
        """A request's outcome (``HeadRows.draft``): its chain's raw-logit rows and its tree."""
        self._chain = chain
        return self._with_suffix(tree, request.context, request.depth)

    def propose_sized(self, context: Sequence[int], max_depth: int, nodes: int | None) -> "DraftTree | DeviceTree":
        """A device head leaves its best ``nodes`` on the device (``DeviceDrafter.propose_sized``), but
        for trees the host still changes (suffix matches merged in, policy ``reuse``'s choice)."""
        if not self.on_device or self.suffix is not None or self.policy == "reuse" or nodes == 0:
            return self.propose(context, max_depth)
        return self._propose_chain(context, max_depth, nodes, ahead=True)

    def propose_free(self, context: Sequence[int], max_depth: int) -> DraftTree:
        """What needs no draft pass: the tree re-sampled from the last chain's leftover rows
        (whatever the policy but ``off``) and, for ``lyanna+suffix``, the suffix matches."""
        depth = min(self.depth, max_depth)
        resampled = self._resampled(int(context[-1]), depth) if depth >= 1 else None
        if resampled is None:
            self.skip()
            return self._with_suffix(DraftTree.empty(), context, max_depth)
        self._chain, tree = resampled
        return self._with_suffix(tree, context, max_depth)

    def _with_suffix(self, tree: DraftTree, context: Sequence[int], max_depth: int) -> DraftTree:
        """``tree`` with the suffix drafter's matches merged in (``lyanna+suffix``; else as is)."""
        if self.suffix is None:
            return tree
        matched = self.suffix.propose(context, max_depth)
        if not len(matched):
            return tree
        return tree.merged(matched, self.max_nodes + len(matched)) if len(tree) else matched

    def _resampled(self, root: int, depth: int) -> tuple[np.ndarray, DraftTree] | None:
        """The leftover chain rows (up to ``depth``) and the tree re-sampled from them with
        ``root`` as its root; None without leftover rows or under policy ``off``."""
        if self.policy == "off" or self._leftover is None or not len(self._leftover):
            return None
        rows = self._leftover[:depth]
        return rows, self.head.tree(rows, root, self.ti, self.topk, self.width, self.max_nodes, origin=1)

    def _propose_chain(self, context: Sequence[int], max_depth: int, nodes: int | None = None,
                       ahead: bool = False) -> "DraftTree | DeviceTree":
        """The round's tree (``ahead``: left on the device, cut to ``nodes``; see ``draft_trees``)."""
        depth = min(self.depth, max_depth)
        if depth < 1:
            return DraftTree.empty()
        if self.policy == "reuse":  # the re-sampled tree alone, when it is likely enough
            found = self._resampled(int(context[-1]), depth)
            if found is not None and found[1].scores.sum() >= self.reuse_min_expected:
                self._chain = found[0]
                return found[1]
        leftover = None
        if self.policy == "fuse" and self._leftover is not None and len(self._leftover):
            leftover = self._leftover[:depth]
        sized = {"nodes": nodes, "ahead": True} if ahead else {}  # a device head's
        self._chain, tree = self.head.draft_trees(self.context, np.asarray(context, np.int64), depth, leftover, self.ti,
                                                  self.topk, self.width, self.max_nodes, **sized)
        return tree
