"""``DraftTree.best`` and ``DraftTree.merged`` on a torch device, at fixed shapes.

A draft head on the device grows candidate trees there; choosing the round's nodes there too
means that only the chosen tree (a few dozen ids, parents and scores) crosses to the host, and no
host code runs between the draft and its tree. The rules are the host's, tie-breaks included, so
the same candidates give the same tree: the best ``m`` by closed score (a node no likelier than
its ancestors), ties to the shallower and then the earlier node, kept in tree order; a union keeps
the first tree's nodes, then the second's that are new, a node of both with the higher score.

Trees are padded arrays: ``[trees, n]`` tensors of tokens, parents (indices among the tree's
nodes, -1 under the root), scores (probabilities, float64), depths (1 under the root), origins and
a ``valid`` mask; nodes are in topological order. Shapes never depend on data, so the code can be
captured as a CUDA graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class PaddedTrees(NamedTuple):
    """Trees as padded ``[trees, n]`` arrays (``count`` ``[trees, 1]``: the valid nodes, first)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    depths: torch.Tensor
    origin: torch.Tensor
    count: torch.Tensor


def best(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
         origin: torch.Tensor, valid: torch.Tensor, m: int, max_depth: int, joint: bool = False,
         leveled: bool = False) -> PaddedTrees:
    """Each tree's best ``m`` valid nodes (``DraftTree.best``), renumbered, in tree order, padded
    to ``min(m, n)`` columns. ``max_depth``: no node is deeper (the closed scores' levels);
    ``joint``: no score is above its parent's (a drafter's joint probabilities), so the closed
    scores are the scores and are not formed; ``leveled``: the nodes are in order of depth
    already (a level's candidates after the last's, as drafters grow them), so the tie-break's
    order needs no sort."""
    trees, n = parents.shape
    m = min(m, n)
    closed = torch.where(valid, scores, -1.0)  # scores are probabilities: invalid nodes sort last
    for d in range(2, 1 if joint else max_depth + 1):  # a level at a time: a parent is final before its children
        above = closed.gather(1, parents.clamp(min=0))
        closed = torch.where(depths == d, torch.minimum(closed, above), closed)
    if leveled:  # a stable sort keeps equal scores in node order: shallower, then earlier
        order = torch.sort(closed, dim=1, descending=True, stable=True).indices[:, :m]
    else:
        by_depth = torch.sort(depths, dim=1, stable=True).indices
        ranked = torch.sort(closed.gather(1, by_depth), dim=1, descending=True, stable=True).indices
        order = by_depth.gather(1, ranked)[:, :m]
    count = valid.sum(1, keepdim=True).clamp(max=m)
    slots = torch.arange(m, device=parents.device).expand(trees, m)
    keep = torch.sort(torch.where(slots < count, order, n), dim=1).values  # padding (index n) last
    remap = torch.full((trees, n + 1), -1, dtype=torch.int64, device=parents.device).scatter_(1, keep, slots)
    keep = keep.clamp(max=n - 1)
    up = parents.gather(1, keep)
    kept_parents = torch.where(up >= 0, remap.gather(1, up.clamp(min=0)), -1)
    return PaddedTrees(tokens.gather(1, keep), kept_parents, scores.gather(1, keep), depths.gather(1, keep),
                       origin.gather(1, keep), count)


def union(a: PaddedTrees, b: PaddedTrees, max_depth: int) -> tuple[PaddedTrees, torch.Tensor]:
    """The union of each tree of ``a`` and the tree of ``b`` in its place under one root
    (``DraftTree.merged`` before its cut; no sampled children; siblings have distinct tokens) as
    padded trees, with their ``valid`` mask. A node of ``b`` whose path is in ``a`` becomes that
    node (the higher score, ``a``'s origin); the others follow ``a``'s nodes in ``b``'s order,
    under their union parents. ``max_depth``: no node is deeper."""
    dev = a.parents.device
    (trees, ma), mb = a.parents.shape, b.parents.shape[1]
    size = ma + mb + 1  # the last slot takes the writes of nodes that go nowhere
    valid_a, valid_b = torch.arange(ma, device=dev) < a.count, torch.arange(mb, device=dev) < b.count
    pa, pb = a.parents, b.parents
    up_a, up_b = pa.clamp(min=0), pb.clamp(min=0)  # parents as indices (a root's child reads node 0, unused)
    # same[t, i, j]: b's node i and a's node j have one path (equal tokens, depths and parents'
    # paths), found for one more level each time round.
    alike = ((b.tokens[:, :, None] == a.tokens[:, None, :]) & (b.depths[:, :, None] == a.depths[:, None, :])
             & valid_b[:, :, None] & valid_a[:, None, :])
    top = (pb < 0)[:, :, None] & (pa < 0)[:, None, :]
    same = alike & top
    parents_pair = (up_b[:, :, None] * ma + up_a[:, None, :]).view(trees, -1)  # same's parents' entries, flat
    for _ in range(max_depth - 1):
        same = alike & (top | same.view(trees, -1).gather(1, parents_pair).view(trees, mb, ma))
    found = same.any(2)
    new = valid_b & ~found
    place = torch.where(found, same.long().argmax(2), a.count + torch.cumsum(new.long(), 1) - 1)  # in the union
    slot = torch.where(new, place, size - 1)
    from_b = torch.where(same, b.scores[:, :, None], 0.0).amax(1)  # 0 where no b node merged (scores >= 0)
    up = torch.where(pb >= 0, place.gather(1, up_b), -1)
    # ``a``'s values, then ``b``'s new nodes' at their places; the integer fields (tokens, parents,
    # depths, origins) as one array, so that each step is one kernel for the four of them.
    ints = torch.zeros((4, trees, size), dtype=torch.int64, device=dev)
    ints[1].fill_(-1)  # no parent where no node goes
    ints[:, :, :ma] = torch.stack([a.tokens, pa, a.depths, a.origin])
    ints.scatter_(2, slot.expand(4, -1, -1), torch.stack([b.tokens, up, b.depths, b.origin]))
    scores = torch.zeros((trees, size), dtype=a.scores.dtype, device=dev)
    scores[:, :ma] = torch.maximum(a.scores, from_b)
    scores.scatter_(1, slot, b.scores)
    count = a.count + new.sum(1, keepdim=True)
    tree = PaddedTrees(ints[0], ints[1], scores, ints[2], ints[3], count)
    return tree, torch.arange(size, device=dev)[None, :] < count


def packed_rows(t: PaddedTrees) -> torch.Tensor:
    """Each tree as one float64 row (``[trees, 5 m + 1]``) for one copy to the host
    (``DraftTree.from_packed``) or a verification pass on the device (``engines.device.
    DeviceTree``): tokens, parents, scores, origin, depths (each ``m``), then the node count."""
    rows = torch.stack([t.tokens.double(), t.parents.double(), t.scores, t.origin.double(), t.depths.double()], 1)
    return torch.cat([rows.reshape(rows.shape[0], -1), t.count.double()], 1)


def packed(t: PaddedTrees) -> torch.Tensor:
    """Tree 0 of ``packed_rows``, one vector."""
    return packed_rows(t)[0]
