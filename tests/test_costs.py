"""The pass's price as decoding measures it (``costs.PassCost``): the host's drift apart from
the curve's shape, each block size correcting its own factor, and the auto budget pricing trees by
both."""
from __future__ import annotations

import statistics
from collections import deque

import numpy as np
import pytest

from lyanna.decoding.budget import Budget, LatencyCurve
from lyanna.decoding.costs import ANCHOR_PASSES, DRAFT_MEASURES, MAX_DEPTH, SHAPE_ROWS, DraftCost, PassCost, _draft_prices
from lyanna.drafters.tree import DraftTree

# A calibration that met a noisy moment: every block up to 8 rows priced like one row.
FLAT = LatencyCurve((1, 8, 64), (0.01, 0.01, 0.05), "test-model", "test machine", 256)


def passes_at(cost: PassCost, curve: LatencyCurve, first: int, count: int) -> np.ndarray:
    return cost.slowdown * cost.shaped(curve.span(first, count), first)


def test_a_host_that_drifts_moves_every_size_alike():
    """A host 1.5x slower than at calibration for every block: the drift takes it, not the shape
    (the first passes of a size, met while the drift was still catching up, lend its factor a
    little of it for a while)."""
    cost = PassCost(0.8)
    for _ in range(100):
        for rows in (1, 3):
            cost.observe(rows, 1.5 * float(FLAT(rows)), float(FLAT(rows)))
    assert cost.slowdown == pytest.approx(1.5, rel=0.02)
    assert np.allclose(cost.shaped(FLAT.span(1, 8), 1), FLAT.span(1, 8), rtol=0.02)


def test_each_size_learns_what_the_curve_got_wrong_and_larger_sizes_follow():
    """One-row passes as calibrated, three-row passes 30% dearer than the curve says: the price of
    3 rows becomes what was measured, the one-row price stays, 2 rows (not met) lie between them,
    larger sizes take the three-row factor, and no larger block is priced below a smaller one."""
    cost = PassCost(0.8)
    for _ in range(150):
        cost.observe(1, 0.01, 0.01)
        cost.observe(3, 0.013, 0.01)
    priced = passes_at(cost, FLAT, 1, 10)
    assert priced[0] == pytest.approx(0.01, rel=0.01) and priced[2] == pytest.approx(0.013, rel=0.01)
    assert priced[1] == pytest.approx(0.0115, rel=0.01)  # 2 rows: not met, halfway
    assert np.allclose(priced[3:8], 0.013, rtol=0.01)  # 4 to 8 rows: the three-row factor
    assert np.all(np.diff(priced) >= 0)
    assert cost.factor(10 * SHAPE_ROWS) == cost.factor(SHAPE_ROWS)


def test_a_size_met_later_keeps_its_own_factor_and_prices_those_above():
    cost = PassCost(0.8)
    for _ in range(100):
        cost.observe(1, 0.01, 0.01)
        cost.observe(2, 0.02, 0.01)  # 2 rows: twice the one-row pass's ratio to the curve
    factor_two = cost.factor(2)
    assert factor_two == pytest.approx(2.0, rel=1e-3) and cost.factor(5) == factor_two
    cost.observe(1, 0.01, 0.01)
    cost.observe(4, 0.01, 0.01)
    assert cost.factor(2) == factor_two and cost.factor(5) == cost.factor(4) < cost.factor(3) < factor_two
    priced = cost.shaped(FLAT.span(1, 6), 1)
    assert priced[3] == priced[1]  # 4 rows priced no lower than 2


def test_one_hiccup_does_not_price_a_size_out_of_reach():
    """A three-row pass that met a pause of the host (three times its price) moves that size's
    factor, and the larger sizes' priced through it, a tenth of the way: the auto budget still keeps
    a node worth half a token, so the size is measured again and its factor returns."""
    cost = PassCost(0.8)
    cost.observe(1, 0.01, 0.01)
    cost.observe(3, 0.03, 0.01)
    assert cost.factor(3) == pytest.approx(1.2) and cost.factor(8) == cost.factor(3)
    budget = Budget("auto", FLAT)
    budget.cost = cost
    tree = DraftTree(np.arange(2), np.array([-1, 0]), np.array([0.5, 0.3]))
    assert len(budget.choose(tree, 0.0)) == 2
    for _ in range(40):
        cost.observe(1, 0.01, 0.01)
        cost.observe(3, 0.01, 0.01)
    assert cost.factor(3) == pytest.approx(1.0, abs=0.01)


def test_the_auto_budget_stops_keeping_rows_the_host_charges_for():
    """The flat calibration makes 8 rows look free, so every node of a chain is kept; once the
    passes that verified it measured each row at 15% of a one-row pass, its unlikely tail is not."""
    tree = DraftTree(np.arange(7), np.arange(7) - 1, np.array([0.9, 0.6, 0.4, 0.2, 0.1, 0.05, 0.02]))
    budget = Budget("auto", FLAT)
    assert len(budget.choose(tree, 0.0)) == 7
    for _ in range(60):
        budget.observe(DraftTree.empty(), 0, 0.01)
        budget.observe(tree, 2, 0.01 * (1 + 0.15 * 7))
    kept = len(budget.choose(tree, 0.0))
    assert 0 < kept < 7
    assert budget.slowdown == pytest.approx(1.0, rel=0.02)  # one-row passes ran as calibrated


def test_drafting_is_priced_by_depth_from_the_depths_met():
    """Between the depths met, interpolated; shallower, the shallowest met; deeper, each level
    adds what the last level between the two deepest met did; one depth alone prices them all."""
    cost = DraftCost()
    assert cost.by_depth() is None
    cost.observe(3, 0.0012)
    assert np.allclose(cost.by_depth(), 0.0012)
    cost.observe(5, 0.0016)
    by_depth = cost.by_depth()
    assert by_depth[1] == by_depth[3] == pytest.approx(0.0012) and by_depth[4] == pytest.approx(0.0014)
    assert by_depth[7] == pytest.approx(0.002) and by_depth[MAX_DEPTH] == pytest.approx(0.0016 + 0.0002 * (MAX_DEPTH - 5))
    cost.observe(5, 0.0020)  # two measures of a depth: their median
    assert cost.by_depth()[5] == pytest.approx(0.0018)


def test_a_depths_price_is_the_median_of_its_last_measures_and_a_bound_cuts_them():
    """Against a plain model of the rule (a deque of each depth's last ``DRAFT_MEASURES`` measures,
    their median, every measure cut to a bound below the depth's price): random measures and
    bounds over a few depths give the same prices, bit for bit."""
    rng = np.random.default_rng(7)
    cost, recent = DraftCost(), {}
    for _ in range(400):
        depth, seconds = int(rng.integers(0, 6)), float(rng.lognormal(-7.0, 0.5))
        d = min(max(depth, 1), MAX_DEPTH)
        if rng.random() < 0.2:  # a bound: only where some depth has a price and it is below d's
            priced = cost.by_depth()
            cost.at_most(depth, seconds)
            if priced is None or seconds >= priced[d]:
                continue
            recent[d] = deque([min(x, seconds) for x in recent[d]] if recent.get(d) else [seconds], maxlen=DRAFT_MEASURES)
        else:
            cost.observe(depth, seconds)
            recent.setdefault(d, deque(maxlen=DRAFT_MEASURES)).append(seconds)
        learned = np.full(MAX_DEPTH + 1, np.nan)
        for k, measures in recent.items():
            learned[k] = statistics.median(measures)
        assert np.array_equal(cost.by_depth(), _draft_prices(learned))


def test_one_hiccup_does_not_price_a_depth_out_of_reach():
    """A round that met a pause of the host (36 ms where rounds take 1): once the depth is measured
    again the median drops it, and meanwhile no level is priced above a whole shallow round."""
    cost = DraftCost()
    for _ in range(3):
        cost.observe(2, 0.001)
        cost.observe(3, 0.0012)
    cost.observe(4, 0.036)
    by_depth = cost.by_depth()
    assert by_depth[4] == pytest.approx(0.0022) and np.all(np.diff(by_depth[1:]) <= 0.001 + 1e-12)
    cost.observe(4, 0.0014)
    cost.observe(4, 0.0015)
    assert cost.by_depth()[4] == pytest.approx(0.0015)
    cost.observe(1, 0.003)  # never cheaper deeper
    assert np.all(np.diff(cost.by_depth()) >= 0)


def test_the_auto_budget_keeps_a_tree_shallow_where_its_levels_cost_more_than_they_bring():
    """A chain whose deeper nodes are worth a little: while every depth drafts at the same price
    the budget keeps it deep (and ``limit_depth`` would draft deeper still); once rounds that
    drafted deeper measured each level at a fifth of a pass, it keeps the shallow nodes only."""
    chain = DraftTree(np.arange(6), np.arange(6) - 1, np.array([0.9, 0.5, 0.45, 0.4, 0.35, 0.3]))
    flat = LatencyCurve((1, 64), (0.01, 0.01), "test-model", "test machine", 256)  # rows cost nothing
    same, dear = Budget("auto", flat), Budget("auto", flat)
    for depth in (2, 6):
        same.evidence.drafting.observe(depth, 0.002)
        dear.evidence.drafting.observe(depth, 0.002 * depth)
    assert len(same.choose(chain, 0.002, free=False)) == 6
    kept = dear.choose(chain, 0.012, free=False)
    assert 0 < len(kept) < 6 and dear.limit_depth(6) == len(kept) + 1


def test_a_factor_learns_only_against_a_recent_one_row_pass():
    """While one size makes every pass, its factor and the drift explain each other equally well:
    learned against the drift, they wandered apart and priced the one-row pass a fifth above its
    measure. A factor moves only with a one-row pass measured within ``ANCHOR_PASSES`` passes,
    and then the plain pass is priced as the one-row passes measured it."""
    cost = PassCost(0.8)
    for _ in range(200):  # only four-row passes, 1.3x the curve: no one-row pass to learn against
        cost.observe(4, 0.013, 0.01)
    assert cost.factor(4) == 1.0 and cost.slowdown == pytest.approx(1.3, rel=0.01)
    cost.observe(1, 0.010, 0.01)  # the one-row pass runs as calibrated
    for _ in range(ANCHOR_PASSES):
        cost.observe(4, 0.013, 0.01)
    learned = cost.factor(4)
    assert learned > 1.05
    for _ in range(10):
        cost.observe(4, 0.013, 0.01)  # too long after it: the factor stays
    assert cost.factor(4) == learned
    for _ in range(100):  # one plain pass in nine: the factor settles, the drift with it
        cost.observe(1, 0.010, 0.01)
        for _ in range(8):
            cost.observe(4, 0.013, 0.01)
    assert cost.factor(4) == pytest.approx(1.3, rel=0.02)
    assert cost.slowdown * cost.factor(1) == pytest.approx(1.0, rel=0.05)
