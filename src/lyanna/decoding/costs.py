"""What a round costs on this host now, as the auto budget prices it: the target's pass over a
block of n rows (``PassCost``) and the drafting of d levels (``DraftCost``), both corrected by what
decoding measures.

The pass starts from the calibrated latency curve (``budget.LatencyCurve``) and is scaled by two
things: ``slowdown``, how much slower (or faster) than at calibration this host runs now, for every
block alike (a shared host's speed drifts over minutes); and a factor per block size against the
one-row pass, the curve's *shape* as decoding meets it, learned against one-row passes measured
shortly before (never against ``slowdown``: while one size made nearly every pass, a factor and the
drift traded off freely, and on a 2-core CPU a plain pass ended up priced a fifth above its
measure, so that every tree looked cheaper than plain decoding by that much). A calibration is a
few seconds of passes; on a noisy 2-core host its small sizes came out several tenths apart from
one calibration to the next (the pass over 4 rows 1.16x to 1.54x the one-row pass), so that an
auto budget trusting it kept trees whose rows cost more than their tokens were worth.

Drafting is priced by depth because a deeper tree is dearer to draft, not only to verify: a draft
head's chain takes one more step of its layer a level, and its tree one more level of logits.
Priced as one average whatever the depth, a tree kept deep looked as cheap to draft as a shallow
one, and the next rounds drafted ever deeper for nodes that did not pay for their levels.

In both, each size or depth measured corrects its own value; one not met yet is interpolated
between those met around it (above the largest, extended as explained at each class).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..drafters.tree import best_nodes, _closed_scores

# Block sizes whose factor is learned (a tree verified alone rarely has more rows; larger blocks
# take the last factor). The factor of one row is 1 by definition: ``slowdown`` holds the drift.
SHAPE_ROWS = 64
# Weight of what a factor knew before each new measure of its size: factors change only with the
# engine or the CPU, not with the host's load, so they average over more passes than the drift.
SHAPE_DECAY = 0.9
# A pass teaches its size's factor only within this many passes of a one-row pass, against that
# pass (see ``PassCost.observe``).
ANCHOR_PASSES = 16
MAX_DEPTH = 32  # drafting depths priced apart (deeper ones take the last)
DRAFT_MEASURES = 5  # a depth's last measures whose median prices it


def _filled(learned: np.ndarray) -> np.ndarray:
    """``learned`` (NaN where not met; index 0 unused) with its gaps interpolated and the sizes
    past the largest met holding its value."""
    met = np.flatnonzero(~np.isnan(learned))
    out = np.zeros_like(learned)
    out[1:] = np.interp(np.arange(1, len(learned)), met, learned[met])
    return out


class PassCost:
    """The pass's price model: ``shaped`` curve values, corrected by each ``observe``d pass."""

    def __init__(self, decay: float):
        """``decay``: the weight of the drift's earlier value at each measured pass."""
        self.decay = decay
        self.slowdown = 1.0
        self._learned = np.full(SHAPE_ROWS + 1, np.nan)  # per block size; NaN: not met yet
        self._learned[1] = 1.0
        self._factors = np.ones(SHAPE_ROWS + 1)  # ``_learned`` with its gaps interpolated
        self._one: float | None = None  # the last one-row pass's seconds over the curve's
        self._since_one = 0  # passes since it

    def factor(self, rows: int) -> float:
        """The shape factor of a block of ``rows`` rows."""
        return float(self._factors[min(max(rows, 1), SHAPE_ROWS)])

    @property
    def factors(self) -> np.ndarray:
        """Each block size's factor (index: rows, up to ``SHAPE_ROWS``; ``shaped`` applies them)."""
        return self._factors

    def shaped(self, passes: np.ndarray, first: int) -> np.ndarray:
        """Curve values ``passes`` for blocks of ``first``, ``first + 1``, ... rows, each times
        its size's factor, never decreasing with the size (without ``slowdown``: callers scale)."""
        return _shaped(np.asarray(passes, np.float64), self._factors, first)

    def observe(self, rows: int, seconds: float, predicted: float) -> None:
        """A pass over ``rows`` rows took ``seconds`` where the curve says ``predicted``: the
        drift moves by what the shape does not explain; the size's factor, if a one-row pass was
        measured within ``ANCHOR_PASSES`` passes, towards this pass's ratio over that one's (from
        the curve's own factor, 1, the first time)."""
        ratio = seconds / predicted
        self.slowdown = self.decay * self.slowdown + (1 - self.decay) * ratio / self.factor(rows)
        if rows <= 1:
            self._one, self._since_one = ratio, 0
            return
        self._since_one += 1
        if rows > SHAPE_ROWS or self._one is None or self._since_one > ANCHOR_PASSES:
            return
        seen, now = self._learned[rows], ratio / self._one
        # A size met for the first time starts from the curve's price (factor 1), not from that one
        # pass: a pass that met a pause of the host would price its size, and through the shape's
        # monotony every larger one, out of reach, and a size priced too dear is not verified
        # again, so never measured again (a model-free drafter's trees, worth a few tenths of a
        # token, then kept no node for the rest of a run).
        self._learned[rows] = SHAPE_DECAY * (1.0 if np.isnan(seen) else seen) + (1 - SHAPE_DECAY) * now
        self._factors = _filled(self._learned)


class DraftCost:
    """A drafting round's seconds by the depth it drafted: the median of that depth's last few
    measures (one round that met a hiccup of the host must not price a depth out of reach, for a
    depth priced too dear is not drafted again, so never measured again). Depths shallower than
    any met cost what the shallowest met does; deeper than any met, each further level adds what
    the last level between the two deepest met did (nothing while only one depth was met). No
    depth costs less than the one above it, nor more than it plus a whole round of the shallowest
    depth met: a level adds a chain step and a row of logits, never more than a round's catch-up,
    step and logits together."""

    def __init__(self) -> None:
        # each depth's last DRAFT_MEASURES measures, oldest first, and how many it has
        self._recent = np.zeros((MAX_DEPTH + 1, DRAFT_MEASURES))
        self._count = np.zeros(MAX_DEPTH + 1, np.int64)
        self._learned = np.full(MAX_DEPTH + 1, np.nan)  # each depth's median; NaN: not met yet
        self._by_depth: np.ndarray | None = None  # filled; None: nothing met yet

    def observe(self, depth: int, seconds: float) -> None:
        """Told every judged drafting round, so in the decode loop: only the depth measured
        changes its median, in the same compiled call as the bounds (``_measured``)."""
        self._by_depth = _measured(self._recent, self._count, self._learned, min(max(depth, 1), MAX_DEPTH),
                                   float(seconds), False)

    def at_most(self, depth: int, seconds: float) -> None:
        """A drafting round whose time only bounds its drafting's (it caught the drafter up on
        many tokens, or ran a shape first): where it is below the depth's price, that depth's
        measures are cut to it (one measure where none was; nothing while no depth has a price).
        Without it, one outlier measured (a kernel loaded on first use, a pause of the host)
        priced drafting out of reach for good: nothing kept meant waits, and after a wait every
        drafting round catches up, so none was measured again."""
        depth = min(max(depth, 1), MAX_DEPTH)
        if self._by_depth is None or seconds >= self._by_depth[depth]:
            return
        self._by_depth = _measured(self._recent, self._count, self._learned, depth, float(seconds), True)

    def by_depth(self) -> np.ndarray | None:
        """Seconds of a round drafting 0, 1, ... ``MAX_DEPTH`` levels (None before any measure)."""
        return self._by_depth


@njit(cache=True)
def _measured(recent: np.ndarray, count: np.ndarray, learned: np.ndarray, depth: int, seconds: float,
              bound: bool) -> np.ndarray:  # pragma: no cover - compiled
    """``DraftCost``'s measures of ``depth`` told ``seconds`` (appended, the oldest dropped past
    ``DRAFT_MEASURES``; ``bound``: each cut to it instead, or it alone where none was), that
    depth's median in ``learned`` and every depth's price from them (``_draft_prices``)."""
    k, row = count[depth], recent[depth]
    if bound and k:
        for i in range(k):
            row[i] = min(row[i], seconds)
    elif k < row.shape[0]:
        row[k] = seconds
        count[depth] = k = k + 1
    else:
        row[:-1] = row[1:].copy()
        row[-1] = seconds
    ordered = np.sort(row[:k])
    half = k // 2
    learned[depth] = ordered[half] if k % 2 else (ordered[half - 1] + ordered[half]) / 2
    return _draft_prices(learned)


@njit(cache=True)
def _draft_prices(learned: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """``DraftCost``'s seconds by depth from each depth's median (``learned``, NaN where not met,
    at least one met): the gaps interpolated, shallower than the shallowest met at its value,
    deeper than the deepest met each level adding the last level's step between the two deepest
    (nothing with one met); then non-decreasing, each depth at most the shallowest met's price
    above the one before. One compiled call: the decode loop tells it every drafting round."""
    n = learned.shape[0]
    met = np.flatnonzero(~np.isnan(learned))
    out = np.empty(n)
    first, top = met[0], met[-1]
    out[: first + 1] = learned[first]
    for i in range(len(met) - 1):  # linear between neighbours met
        a, b = met[i], met[i + 1]
        slope = (learned[b] - learned[a]) / (b - a)
        for d in range(a + 1, b + 1):
            out[d] = learned[a] + slope * (d - a)
    step = max(0.0, (learned[top] - learned[met[-2]]) / (top - met[-2])) if len(met) > 1 else 0.0
    for d in range(top, n):
        out[d] = learned[top] + step * (d - top)
    level_at_most = learned[first]
    for d in range(1, n):
        out[d] = min(max(out[d], out[d - 1]), out[d - 1] + level_at_most)
    return out


@njit(cache=True)
def _shaped(passes: np.ndarray, factors: np.ndarray, first: int) -> np.ndarray:  # pragma: no cover - compiled
    """``PassCost.shaped``: each curve value times its size's factor, then the running maximum."""
    out = np.empty(passes.shape[0])
    top = -np.inf
    for i in range(passes.shape[0]):
        top = max(top, passes[i] * factors[min(max(first + i, 1), SHAPE_ROWS)])
        out[i] = top
    return out


@njit(cache=True)
def _best_size(closed: np.ndarray, depths: np.ndarray, correction: float, base: float, drafting: np.ndarray,
               host: float, slowdown: float, passes: np.ndarray) -> tuple[int, float]:  # pragma: no cover - compiled
    """The node count ``n`` that maximizes ``(base + sum of the n best min(correction * closed, 1))
    / (drafting + host + slowdown * passes[n])`` (the first of equals) and that rate, in one
    compiled call: a round sizes its tree with this while its data is cold, where each numpy call
    costs several microseconds. ``drafting[d]`` is a round drafting ``d`` levels (deeper ones take
    the last entry; one entry prices every tree alike); the ``n`` best, kept to depth ``k``, are
    priced at ``drafting[k + 1]``: what the rounds after them draft (``Budget.limit_depth``)."""
    order = np.argsort(-closed, kind="mergesort")
    last = drafting.shape[0] - 1
    accepted = 0.0  # summed on its own, then added to base: the order numpy's cumsum had, bit for bit
    deepest = 0
    best, best_rate = 0, base / ((drafting[min(1, last)] + host) + slowdown * passes[0])
    for n in range(1, order.shape[0] + 1):
        node = order[n - 1]
        accepted += min(closed[node] * correction, 1.0)
        deepest = max(deepest, depths[node])
        rate = (base + accepted) / ((drafting[min(deepest + 1, last)] + host) + slowdown * passes[n])
        if rate > best_rate:
            best, best_rate = n, rate
    return best, best_rate


@njit(cache=True)
def sized_cut(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, origin: np.ndarray, depths: np.ndarray,
              correction: float, base: float, drafting: np.ndarray, host: float, slowdown: float, span: np.ndarray,
              factors: np.ndarray, first: int):  # pragma: no cover - compiled
    """``Budget.choose``'s arithmetic on a tree in one compiled call: its closed scores, the pass
    of each size (``span``: the curve from ``first`` rows, ``_shaped`` by ``factors``), the best
    size and its rate (``_best_size``), the pass of ``first`` rows, and the kept nodes as
    ``DraftTree.valid``'s arguments (``best_nodes``; none, unsorted, where the tree is kept whole). Called
    one by one, each of these cost a few microseconds more, every round, with the data cold."""
    closed = _closed_scores(parents, scores)
    passes = _shaped(span, factors, first)
    n, rate = _best_size(closed, depths, correction, base, drafting, host, slowdown, passes)
    return n, rate, passes[0], best_nodes(tokens, parents, scores, origin, depths, closed,
                                          n if n < parents.shape[0] else 0)
