"""The ``eagle`` baseline: a token-based feature drafter (EAGLE-1 head) with EAGLE-2's dynamic tree.

Every draft step feeds [predicted feature of the parent ; embedding of the drafted token] through
the head, so each branch needs its own row, and a wrong token poisons everything drafted after
it: the contrast Lyanna's hidden-state chain is measured against.

Tree growth (EAGLE-2): the children of the root are the head's top-k tokens; at each further
depth the w best frontier nodes by joint log-probability are expanded (one head pass over the w
rows, tree-masked), each to its top-k children; finally the best N nodes by joint probability
form the tree (a child never scores above its parent, so the set is ancestor-closed).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..engines.base import PendingOutput, TargetEngine
from ..engines.loading import Target
from ..errors import LyannaError
from .base import DeviceDrafter, Drafter
from .checkpoint import decode_settings, head_taps, load_head
from .head import DraftHead
from .registry import register
from .tree import DraftTree

if TYPE_CHECKING:
    from ..engines.device import DeviceTree
    from .device import DeviceDraftHead

ARCH = "eagle"
# Tree shape when the checkpoint's settings.decode does not say otherwise.
DECODE_DEFAULTS = {"depth": 5, "topk": 4, "width": 4, "max_nodes": 64}


@register
class EagleDrafter(DeviceDrafter):
    ARCH = ARCH
    VARIANTS = {ARCH: {}}
    TENSORS = ("fc.weight", "fc.bias")
    TRAINING = "lyanna.training.recipes:EagleRecipe"

    def __init__(self, head: "DraftHead | DeviceDraftHead", tap: int, depth: int = DECODE_DEFAULTS["depth"], topk: int = DECODE_DEFAULTS["topk"],
                 width: int = DECODE_DEFAULTS["width"], max_nodes: int = DECODE_DEFAULTS["max_nodes"]):
        self.head, self.tap = head, tap
        self.taps = (tap,)
        self.depth, self.topk, self.width, self.max_nodes = depth, topk, width, max_nodes
        if hasattr(head, "drafts_to"):  # a device head builds calls as deep as its drafters draft
            head.drafts_to(depth)
        self.context = head.context(self.taps)

    @classmethod
    def build(cls, target: Target, engine: TargetEngine, checkpoint: Path | None = None) -> dict[str, Drafter]:
        """Every method of ``VARIANTS``, built from the checkpoint at ``checkpoint``."""
        if checkpoint is None:
            raise LyannaError(f"{cls.ARCH} is a draft head: it needs a checkpoint")
        config, weights = load_head(checkpoint, target, cls)
        knobs = decode_settings(config, DECODE_DEFAULTS, checkpoint)
        if getattr(engine, "heads_on_device", False):  # the target runs on a torch device: the head runs there too
            from .device import DeviceDraftHead

            head = DeviceDraftHead(engine, weights)
        else:
            head = DraftHead(engine, weights)
        taps = head_taps(config, target.config.num_layers, checkpoint)
        if len(taps) > 1:  # its drafted rows feed the head's own predicted features back, one tap's worth
            raise LyannaError(f"{checkpoint}: an {cls.ARCH} head reads one tap, this one names {list(taps)}")
        return {name: cls(head, taps[0], **{**knobs, **variant}) for name, variant in cls.VARIANTS.items()}

    @property
    def passes(self) -> int:
        return self.context.passes

    def fork(self) -> "EagleDrafter":
        """The same head and settings with a context of its own (one per generation)."""
        return EagleDrafter(self.head, self.tap, self.depth, self.topk, self.width, self.max_nodes)

    def start(self, prompt_ids: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self.context.start(hidden)

    def commit(self, tokens: Sequence[int], hidden: dict[int, np.ndarray]) -> None:
        self.context.commit(hidden)

    def propose_sized(self, context: Sequence[int], max_depth: int, nodes: int | None) -> "DraftTree | DeviceTree":
        """A device head leaves its best ``nodes`` on the device (``DeviceDrafter.propose_sized``)."""
        depth = min(self.depth, max_depth)
        if not self.on_device or depth < 1 or nodes == 0:
            return self.propose(context, max_depth)
        return self.head.eagle_tree(self.context, np.asarray(context, np.int64), depth, self.topk, self.width,
                                    self.max_nodes, nodes, ahead=True)

    def propose_after(self, pending: PendingOutput, context: Sequence[int], max_depth: int,
                      nodes: int | None) -> "DeviceTree | None":
        """A device head's next tree grown from the pending pass's outcome on the device
        (``DeviceDraftHead.eagle_tree_after``), left there as ``propose_sized``'s is."""
        depth = min(self.depth, max_depth)
        if not self.on_device or depth < 1 or nodes == 0:
            return None
        return self.head.eagle_tree_after(self.context, pending, len(context), depth, self.topk, self.width,
                                          self.max_nodes, nodes)

    @property
    def on_device(self) -> bool:
        return not isinstance(self.head, DraftHead)

    def follow_plain(self, pending: PendingOutput, context: Sequence[int]) -> bool:
        """A device head hands the pending round's rows over for a plain step after it."""
        if not self.on_device:
            return False
        self.head.follow_plain(self.context, pending, len(context))
        return True

    def settle(self, tokens: Sequence[int]) -> None:
        """The head's tree (or plain step) after that round took its rows already."""
        self.context.settle(len(tokens))

    def propose(self, context: Sequence[int], max_depth: int) -> DraftTree:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return DraftTree.empty()
        ctx = np.asarray(context, np.int64)
        pc = self.context
        if self.on_device:  # a device head grows the tree in one fixed-shape call
            return self.head.eagle_tree(pc, ctx, depth, self.topk, self.width, self.max_nodes)
        root_pred = pc.catch_up(ctx, extra=self.width * depth + 1)
        base, cache = pc.base, pc.cache
        root_pos = len(ctx) - 1

        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        slot: dict[int, int] = {}  # node -> draft-cache slot of its (parent feature, token) pair
        ancestors: list[set[int]] = []

        def add_children(parent: int, top: np.ndarray, logp: np.ndarray, parent_score: float, d: int) -> list[int]:
            new = []
            for t, lp in zip(top, logp):
                tokens.append(int(t))
                parents.append(parent)
                scores.append(parent_score + float(lp))
                depths.append(d)
                ancestors.append((ancestors[parent] | {parent}) if parent >= 0 else set())
                new.append(len(tokens) - 1)
            return new

        frontier_feats = {-1: root_pred}
        top, logp = self.head.top_children(root_pred[None], self.topk)
        candidates = add_children(-1, top[0], logp[0], 0.0, 1)
        for d in range(2, depth + 1):
            frontier = sorted(candidates, key=lambda i: -scores[i])[: self.width]
            feats = np.stack([frontier_feats[parents[i]] for i in frontier])
            start = cache.length
            bias = np.full((len(frontier), start + len(frontier)), -np.inf, np.float32)
            bias[:, :base] = 0.0
            for r, node in enumerate(frontier):
                for a in ancestors[node]:
                    bias[r, slot[a]] = 0.0
                bias[r, start + r] = 0.0
                slot[node] = start + r
            pos = np.array([root_pos + depths[i] for i in frontier])
            pred = self.head.step(feats, np.array([tokens[i] for i in frontier]), pos, cache, bias)
            pc.passes += 1
            top, logp = self.head.top_children(pred, self.topk)
            candidates = []
            for r, node in enumerate(frontier):
                frontier_feats[node] = pred[r]
                candidates += add_children(node, top[r], logp[r], scores[node], d)
        pc.rewind()  # speculative pairs are dropped; committed ones stay

        return DraftTree.best_of(tokens, parents, scores, self.max_nodes)
