"""The hardware-aware tree budget: tree trimming, the auto rule, calibration and its cache, lossless
generation under every budget, the fallback to plain decoding, bench health and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lyanna.cli import main
from lyanna.decoding import budget as budget_module
from lyanna.decoding.budget import (
    MAX_PROBE_WAIT,
    MAX_SKIP,
    MARGIN_DECAY,
    PROBE_SHARE,
    Budget,
    Evidence,
    LatencyCurve,
    Load,
    calibrate,
    calibration_path,
    load_curve,
    model_key,
    parse_budget,
    save_curve,
)
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.decoding.policy import FALLBACK_WARMUP_ROUNDS, FIRST_PAUSE_ROUNDS, PROBE_ROUNDS, Fallback
from lyanna.decoding.sampling import SamplingParams
from lyanna.drafters.base import Drafter
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.drafters.suffix import SuffixDrafter
from lyanna.drafters.tree import DraftTree
from lyanna.errors import LyannaError
from lyanna.measure.bench import health, make_runners, split_budget
from lyanna.training.fit import init_eagle_head

NODE0 = 100  # node i of a generated tree carries token NODE0 + i, so a subset can be traced back


@st.composite
def scored_trees(draw, max_nodes=16):
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    # a few repeated values so that ties (and their tie-breaking) are exercised
    scores = [draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]) | st.floats(0.001, 1.0)) for _ in range(n)]
    return DraftTree(np.arange(NODE0, NODE0 + n), np.array(parents, np.int64), np.array(scores))


def origin_of(sub: DraftTree) -> list[int]:
    return [int(t) - NODE0 for t in sub.tokens]


@settings(max_examples=200, deadline=None)
@given(scored_trees(), st.integers(0, 20))
def test_best_is_ancestor_closed_and_keeps_the_highest_closed_scores(tree, n):
    sub = tree.best(n)
    if n >= len(tree):
        assert sub is tree
        return
    kept = origin_of(sub)
    assert len(kept) == n and kept == sorted(kept)  # n nodes, still in topological order
    for j, old in enumerate(kept):  # every kept node keeps its own parent, renumbered
        parent = int(tree.parents[old])
        if parent == -1:
            assert sub.parents[j] == -1
        else:
            assert sub.parents[j] >= 0 and kept[sub.parents[j]] == parent
    np.testing.assert_array_equal(sub.scores, tree.scores[kept])
    closed = tree.closed_scores()
    dropped = sorted(set(range(len(tree))) - set(kept))
    if kept and dropped:
        assert closed[kept].min() >= closed[dropped].max()


@settings(max_examples=200, deadline=None)
@given(scored_trees())
def test_closed_scores_never_increase_from_parent_to_child(tree):
    closed = tree.closed_scores()
    assert np.all(closed <= tree.scores)
    for i, p in enumerate(tree.parents):
        if p >= 0:
            assert closed[i] <= closed[p]
        else:
            assert closed[i] == tree.scores[i]


def test_best_zero_is_empty_and_keeps_the_likely_branch():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 1], [0.2, 0.8, 0.9, 0.7])
    assert len(tree.best(0)) == 0
    # node 2 claims 0.9 under a 0.2 parent: closed, it is 0.2, below the 0.8 branch
    assert tree.best(2).tokens.tolist() == [6, 8]
    assert tree.best(3).tokens.tolist() == [5, 6, 8]


# ---------------------------------------------------------------- budget rule


def binary_tree(n: int, score: float) -> DraftTree:
    return DraftTree(np.arange(NODE0, NODE0 + n), (np.arange(n) - 1) // 2, np.full(n, score))


def curve(sizes, seconds) -> LatencyCurve:
    return LatencyCurve(tuple(sizes), tuple(seconds), "test-model", "test machine", 256)


# latency flat up to 8 tokens, then steep
FLAT_THEN_STEEP = curve([1, 2, 4, 8, 16, 32, 64], [0.01, 0.01, 0.01, 0.01, 0.09, 0.25, 0.57])
# every extra token costs 10% of a one-token step
MODERATE = curve([1, 64], [0.01, 0.01 + 63 * 0.001])


def expected_nodes(scores, latency, draft_seconds, c=1.0) -> int:
    """argmax over n of (1 + c * sum of the n best scores) / (draft seconds + latency(n + 1))."""
    best = sorted(scores, reverse=True)
    rate = [(1 + c * sum(best[:n])) / (draft_seconds + latency(n + 1)) for n in range(len(best) + 1)]
    return int(np.argmax(rate))


def flat_then_steep_latency(n: int) -> float:
    """FLAT_THEN_STEEP by hand: 10 ms up to 8 tokens, then +10 ms per token up to 16."""
    return 0.01 if n <= 8 else 0.01 + 0.01 * (n - 8)


@pytest.mark.parametrize("spec,ok", [("auto", "auto"), ("8", 8), (8, 8), (" 0 ", 0), ("auto ", "auto")])
def test_parse_budget_accepts(spec, ok):
    assert parse_budget(spec) == ok


@pytest.mark.parametrize("spec", ["-1", "x", "", "8.5", "Auto8", -1, True, "²"])
def test_parse_budget_rejects(spec):
    with pytest.raises(LyannaError, match="budget"):
        parse_budget(spec)


def test_auto_budget_needs_a_curve():
    with pytest.raises(LyannaError, match="calibrate"):
        Budget("auto")
    with pytest.raises(LyannaError):
        Budget(-2)


def test_fixed_budget_keeps_the_best_nodes():
    tree = DraftTree(np.arange(NODE0, NODE0 + 10), (np.arange(10) - 1) // 2, np.linspace(1.0, 0.1, 10))
    chosen = Budget(4).choose(tree, 0.0)
    assert len(chosen) == 4 and chosen.tokens.tolist() == tree.best(4).tokens.tolist()
    assert Budget(10).choose(tree, 0.0) is tree
    assert len(Budget(0).choose(tree, 0.0)) == 0


def test_fixed_budget_trims_sampled_trees_without_looking_at_scores():
    """Which i.i.d. samples survive must not depend on their values: here the scores favour the
    children of the first sample over the third sample, and the budget keeps the shallowest
    nodes in tree order all the same."""
    q = np.full(300, 1 / 300)
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, -1, 0, 0], [0.9, 0.2, 0.1, 0.8, 0.7],
                     sampled_from={-1: q, 0: q})
    with pytest.raises(ValueError, match="not lossless"):
        tree.best(4)  # ranking i.i.d. samples by score (it would keep 10, 11, 13, 14) is refused
    chosen = Budget(4).choose(tree, 0.0)
    assert chosen.tokens.tolist() == [10, 11, 12, 13]
    assert chosen.parents.tolist() == [-1, -1, -1, 0]
    assert set(chosen.sampled_from) == {-1, 0}
    assert Budget("auto", MODERATE).choose(tree, 0.0) is tree  # auto keeps sampled trees whole


def test_auto_keeps_what_a_flat_then_steep_curve_pays_for():
    scores = np.full(20, 0.9)
    want = expected_nodes(scores, flat_then_steep_latency, 0.0)
    assert want == 7  # 7 nodes + the root fill the flat 8-token block
    chosen = Budget("auto", FLAT_THEN_STEEP).choose(binary_tree(20, 0.9), 0.0)
    assert len(chosen) == want
    assert chosen.tokens.tolist() == binary_tree(20, 0.9).best(want).tokens.tolist()


def test_a_size_fixed_before_drafting_follows_what_auto_would_keep():
    """``nodes_ahead``: a fixed budget's size; under ``auto``, none before a tree was judged (the
    drafter must show one), then what it kept, filled to its row bucket (7 nodes and the root: 8
    rows), one bucket more after a tree it would have kept whole (so the size can grow back),
    unchanged by a tree it keeps nothing of or one offered free while drafting waits."""
    assert Budget(16).nodes_ahead() == 16
    b = Budget("auto", FLAT_THEN_STEEP)
    assert b.nodes_ahead() is None
    b.choose(binary_tree(20, 0.9), 0.0)  # keeps 7 of 20 (a tree seen before its pass)
    assert b.nodes_ahead() == 7
    b.choose_after(binary_tree(5, 0.9), 0.0)  # keeps 5 of 5
    assert b.nodes_ahead() == 7
    b.choose_after(binary_tree(7, 0.9), 0.0)  # keeps 7 of 7
    assert b.nodes_ahead() == 15
    b.choose_after(binary_tree(15, 0.9), 0.0)  # keeps 7 of 15
    assert b.nodes_ahead() == 7
    b.choose(binary_tree(20, 0.9), 0.0, free=True)
    assert b.nodes_ahead() == 7
    dear = Budget("auto", curve([1, 2, 64], [0.01, 0.012, 0.2]))  # a node costs a fifth of a step, more after
    dear.choose(binary_tree(10, 0.9), 0.0)
    ahead = dear.nodes_ahead()
    dear.choose_after(binary_tree(10, 0.05), 0.0)  # keeps nothing
    assert ahead and dear.nodes_ahead() == ahead
    steep = Budget("auto", curve([1, 2, 4, 8, 16], [0.01, 0.011, 0.013, 0.017, 0.5]))
    steep.choose_after(binary_tree(20, 0.9), 0.0)
    kept = len(steep.choose(binary_tree(20, 0.9), 0.0))
    assert 0 < kept <= steep.nodes_ahead() < 20 and steep.nodes_ahead() + 1 in (2, 4, 8, 16)


def test_auto_keeps_more_when_drafting_is_the_larger_cost():
    scores = np.full(20, 0.9)
    want = expected_nodes(scores, flat_then_steep_latency, 1.0)
    assert want > 7
    assert len(Budget("auto", FLAT_THEN_STEEP).choose(binary_tree(20, 0.9), 1.0)) == want


def test_auto_drafts_nothing_on_a_steep_curve_with_unlikely_drafts():
    steep = curve([1, 2, 64], [0.01, 0.02, 0.64])  # every token costs a full step
    assert expected_nodes(np.full(10, 0.05), lambda n: 0.01 * n, 0.0) == 0
    assert len(Budget("auto", steep).choose(binary_tree(10, 0.05), 0.0)) == 0


def test_auto_in_a_batch_pays_for_the_whole_pass():
    """Three other sequences with 4 rows in the pass: the flat part of the curve is half used, so
    the tree gets the rest of it (8 - 4 - root = 3 nodes), and the others' tokens count in the
    rate. In a full, compute-bound pass a node costs a whole step's worth of time: drafts that
    would pay alone (acceptance 0.5) then lower the pass's rate, and plain decoding is chosen."""
    tree = binary_tree(20, 0.9)
    alone = Budget("auto", FLAT_THEN_STEEP).choose(tree, 0.0)
    shared = Budget("auto", FLAT_THEN_STEEP, load=lambda: (3, 4)).choose(tree, 0.0)
    want = int(np.argmax([(3 + 1 + 0.9 * n) / flat_then_steep_latency(4 + n + 1) for n in range(21)]))
    assert len(alone) == 7 and len(shared) == want == 3
    coin_flips = binary_tree(20, 0.5)
    assert len(Budget("auto", FLAT_THEN_STEEP).choose(coin_flips, 0.0)) == 7
    assert len(Budget("auto", FLAT_THEN_STEEP, load=lambda: (7, 16)).choose(coin_flips, 0.0)) == 0


def test_drafting_that_does_not_pay_is_skipped_then_probed_again():
    """While the trees judged lately do not beat plain decoding on average (a loaded pass leaves
    no room, or the drafting time costs more than the trees save), drafting waits: 0, 1, 3, 7...
    rounds between probes (up to MAX_SKIP), each probe judged on its own; once drafting pays
    again it goes on every round, and one round that does not pay after rounds that did starts
    no wait."""
    load = [(7, 16)]
    budget = Budget("auto", FLAT_THEN_STEEP, load=lambda: load[0])
    assert budget.wants_drafts()
    for wait in (0, 1, 3, 7):  # each tree cut to nothing loses its 5 ms of drafting
        assert len(budget.choose(binary_tree(20, 0.5), 0.005)) == 0 and not budget.evidence.paid
        assert [budget.wants_drafts() for _ in range(wait + 1)] == [False] * wait + [True]
    load[0] = (0, 0)  # the others left: now trees pay, and the probe that finds it ends the waits
    assert len(budget.choose(binary_tree(20, 0.5), 0.005)) > 0
    assert budget.evidence.paid and budget.evidence.wait == 0 and budget.wants_drafts()
    for _ in range(4):
        assert len(budget.choose(binary_tree(20, 0.5), 0.0)) > 0
    load[0] = (7, 16)
    assert len(budget.choose(binary_tree(20, 0.5), 0.0)) == 0  # one round that does not pay
    assert budget.evidence.paid and budget.wants_drafts()
    # Alone: a tree that pays for its verification but not for its drafting time is not drafted again.
    flat = curve([1, 2, 64], [0.01, 0.0101, 0.02])
    cheap, dear = Budget("auto", flat), Budget("auto", flat)
    assert len(cheap.choose(binary_tree(20, 0.5), 0.001)) > 0 and cheap.wants_drafts()
    assert len(dear.choose(binary_tree(20, 0.5), 0.2)) > 0 and not dear.evidence.paid
    assert dear.wants_drafts()  # the first wait is no round at all
    assert len(dear.choose(binary_tree(20, 0.5), 0.2)) > 0 and not dear.wants_drafts()
    assert 0 < MARGIN_DECAY < 1 and MAX_SKIP >= 8


def test_a_probe_is_judged_on_its_own():
    """The round after a wait judges drafting afresh: the rounds before the wait are stale (a
    probe that paid, averaged with them, still looked like a loss, and the waits doubled)."""
    for probing in (True, False):
        budget = Budget("auto", FLAT_THEN_STEEP)
        budget.evidence.margin, budget._skip_left = -1.0, 2 if probing else 0  # a stretch that lost, a wait
        assert [budget.wants_drafts() for _ in range(3)] == ([False, False, True] if probing else [True] * 3)
        assert len(budget.choose(binary_tree(20, 0.5), 0.005)) > 0
        assert budget.evidence.paid == probing  # right after a wait, this tree's own margin decides


def _longest_wait(draft_seconds: float, rounds: int = 12, others: int = 0,
                  latency: LatencyCurve = curve([1, 2, 64], [0.01, 0.02, 0.64])) -> int:
    """The wait a budget settles on after ``rounds`` probes that do not beat plain decoding
    (by default every row costs a 10 ms step, more than any node is worth), alone or beside
    ``others`` one-row sequences."""
    budget = Budget("auto", latency, load=lambda: (others, others))
    for _ in range(rounds):
        budget.choose(binary_tree(20, 0.5), draft_seconds)
        assert not budget.evidence.paid
        while not budget.wants_drafts():
            pass
    return budget.evidence.wait


def test_a_dear_probe_waits_longer_than_a_cheap_one():
    """Waits double up to MAX_SKIP rounds, or until a probe costs PROBE_SHARE of the steps it
    waits for, never beyond MAX_PROBE_WAIT: a 25 ms probe against 10 ms steps waits up to 250."""
    assert _longest_wait(0.05e-3) == MAX_SKIP
    assert _longest_wait(0.025) == int(0.025 / (PROBE_SHARE * 0.01)) == 250
    assert _longest_wait(10.0) == MAX_PROBE_WAIT


def test_in_a_batch_a_probe_waits_for_its_stall_of_every_sequence():
    """A probe's drafting holds up every sequence of the pass, so beside 3 others it costs 4
    times its seconds against the whole pass: where a batched pass costs less than a step per
    sequence (8 ms here, against 10 ms alone), a batched probe waits longer than a lone one."""
    cheap_rows = curve([1, 2, 64], [0.01, 0.011, 0.64])  # a second row costs 1 ms, later ones ~10
    alone, batched = _longest_wait(0.025, latency=cheap_rows), _longest_wait(0.025, others=3, latency=cheap_rows)
    assert alone == int(0.025 / (PROBE_SHARE * 0.01)) == 250
    assert batched == int(4 * 0.025 / (PROBE_SHARE * cheap_rows(4))) > alone


def test_budgets_sharing_evidence_start_from_what_the_others_learned():
    """In a batch a method's budgets share their evidence: a generation that joins after the
    others found drafting not paying waits with them, and inherits their correction."""
    load = [(7, 16)]
    evidence = Evidence()
    first = Budget("auto", FLAT_THEN_STEEP, load=lambda: load[0], evidence=evidence)
    fresh = Budget("auto", FLAT_THEN_STEEP, load=lambda: load[0])
    assert first.wants_drafts() and len(first.choose(binary_tree(20, 0.5), 0.0)) == 0
    first.observe(DraftTree.empty(), 0)
    tree = binary_tree(4, 0.9)
    for _ in range(5):
        first.observe(tree, 0)  # trees verified and never accepted
    joined = Budget("auto", FLAT_THEN_STEEP, load=lambda: load[0], evidence=evidence)
    assert joined.correction == first.correction < 0.5 and fresh.correction == 1.0
    # The wait it joins is the one the first budget's next failed probe would start (doubled).
    assert not evidence.paid and evidence.wait == 1
    assert [joined.wants_drafts() for _ in range(2)] == [False, True]
    assert fresh.wants_drafts()


def test_the_cost_model_follows_a_slower_host():
    """Pass times measured above the curve's scale every verification cost: a tree that paid at
    calibration speed but not with the host 3x slower... is still chosen by its rate, and the
    measured ratio is what ``slowdown`` holds."""
    budget = Budget("auto", curve([1, 2, 64], [0.01, 0.012, 0.2]))
    budget.choose(binary_tree(4, 0.9), 0.0)  # loads the curve
    for _ in range(40):
        budget.observe(DraftTree.empty(), 0, 0.012)  # one-token passes 20% slower than calibrated
    assert abs(budget.slowdown - 1.2) < 1e-3
    # Drafting time is not scaled: the same 5 ms now weighs less against the slower passes.
    fast = Budget("auto", curve([1, 2, 64], [0.01, 0.012, 0.2]))
    assert len(budget.choose(binary_tree(6, 0.6), 0.005)) >= len(fast.choose(binary_tree(6, 0.6), 0.005))


def test_a_rounds_host_work_is_priced_once_plain_and_drafting_rounds_measured_it():
    """A round pays its host work (reading the verdict, committing, the loop) whatever it
    verifies, so a tree that saves rounds saves it too: 1.33 expected tokens for 1 ms of drafting
    and a 3-token pass of 11.5-13 ms lose to a 10 ms one-token pass alone (0.095 against 0.1 a ms),
    and win with 5 ms of host work in every round (0.070 against 0.067). Priced only when both
    kinds of round were measured: a drafting round's work against nothing for plain rounds would
    overprice drafting."""
    tree = DraftTree(np.array([NODE0, NODE0 + 1]), np.array([-1, 0]), np.array([0.2, 0.13]))

    def after(plain: bool, drafting: bool) -> Budget:
        budget = Budget("auto", curve([1, 3, 64], [0.010, 0.013, 0.2]))
        budget.choose(binary_tree(4, 0.99), 0.001, free=True)  # a tree offered free: not judged
        budget.observe(DraftTree.empty(), 0, None, 0.005 if drafting else None)  # its round, nothing accepted
        if plain:
            budget.observe(DraftTree.empty(), 0, None, 0.005)  # a round that drafted nothing
        assert budget.correction == 1.0 and budget.wants_drafts()
        assert len(budget.choose(tree, 0.001)) > 0
        return budget

    assert after(plain=True, drafting=True).evidence.paid  # drafting goes on
    assert not after(plain=False, drafting=True).evidence.paid  # weighed without host work: it does not pay
    assert not after(plain=False, drafting=False).evidence.paid
    priced = after(plain=True, drafting=True)
    assert priced.plain_seconds() == pytest.approx(0.010 + 0.005)
    assert after(plain=False, drafting=True).plain_seconds() == pytest.approx(0.010)


def test_the_fallback_weighs_rounds_against_a_plain_round_as_it_costs_now():
    """Given what a plain round costs now (``Budget.plain_seconds``: this host's speed and a
    round's host work), the fallback judges drafting rounds against that, not the calibrated pass."""
    assert not Fallback(lambda: 1.0, warmup_rounds=1).keep_drafting(2.0, 1)  # 1 token in 2 s: slower than 1 s
    assert Fallback(lambda: 1.0, warmup_rounds=1).keep_drafting(2.0, 1, plain=lambda: 2.5)


def test_correction_learns_from_rejections_and_forgets_them():
    budget = Budget("auto", MODERATE)
    tree = binary_tree(20, 0.9)
    assert budget.correction == 1.0
    assert len(budget.choose(tree, 0.0)) == 20  # at face value every node pays on this curve
    for _ in range(30):
        budget.observe(tree.best(5), 0)  # nothing is ever accepted
    assert budget.correction < 0.2
    c = budget.correction
    assert len(budget.choose(tree, 0.0)) == expected_nodes(np.full(20, 0.9), MODERATE, 0.0, c) == 0
    budget.observe(DraftTree.empty(), 0)  # that drafted round, cut to nothing
    c = budget.correction
    for _ in range(30):
        budget.observe(DraftTree.empty(), 0)  # rounds that drafted nothing (a pause) teach nothing
    assert budget.correction == c
    for _ in range(30):
        budget.choose(tree, 0.0)
        budget.observe(DraftTree.empty(), 0)  # drafted rounds verifying nothing: the evidence fades
    assert budget.correction > 0.8
    assert len(budget.choose(tree, 0.0)) == 20


def test_correction_tracks_accepted_over_predicted():
    budget = Budget("auto", MODERATE)
    tree = binary_tree(4, 0.5)  # predicts 2 accepted tokens a round
    for _ in range(60):
        budget.observe(tree, 1)
    assert budget.correction == pytest.approx((1 / 0.2 + 1) / (2 / 0.2 + 1), rel=1e-3)


def test_curve_interpolates_and_never_extrapolates_downwards():
    c = curve([1, 3, 5], [0.01, 0.03, 0.02])
    assert c(2) == pytest.approx(0.02)
    assert c(50) == pytest.approx(0.02)
    assert MODERATE(128) == pytest.approx(0.01 + 127 * 0.001)
    with pytest.raises(LyannaError):
        curve([4, 2], [0.1, 0.2])


def test_curve_at_one_size_equals_the_curve_over_an_array():
    c = curve([1, 2, 3, 4, 6, 8, 16, 64], [0.0084, 0.0113, 0.0162, 0.0201, 0.0297, 0.0387, 0.0746, 0.2984])
    sizes = np.arange(0, 200)
    assert [c(int(n)) for n in sizes] == c(sizes).tolist()
    assert [c(n) for n in sizes] == c(sizes).tolist()  # numpy integers too


# ---------------------------------------------------------------- calibration and its cache


def test_calibrate_on_the_tiny_model(tiny_decoder, tmp_path):
    c = calibrate(tiny_decoder.engine, "tiny", sizes=(4, 1, 2, 8), context=16, repeats=1)
    assert c.sizes == (1, 2, 4, 8) and len(c.seconds) == 4
    assert all(s > 0 for s in c.seconds)
    assert c.context == 16 and c.model == model_key("tiny", tiny_decoder.engine)
    path = tmp_path / "deep" / "curve.json"
    save_curve(c, path)
    assert load_curve(path) == c
    path.write_text("{not json")
    assert load_curve(path) is None
    path.write_text(json.dumps({**c.to_json(), "sizes": [8, 1, 2, 4]}))
    assert load_curve(path) is None
    path.write_text(json.dumps({"sizes": [1, 2]}))
    assert load_curve(path) is None
    assert load_curve(tmp_path / "missing.json") is None
    with pytest.raises(LyannaError):
        calibrate(tiny_decoder.engine, "tiny", sizes=(0, 2))
    with pytest.raises(LyannaError):
        calibrate(tiny_decoder.engine, "tiny", sizes=(2,))


def test_decoder_reads_its_calibration_from_the_cache(tiny_decoder, tmp_path, monkeypatch):
    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    real = budget_module.calibrate
    calls = []

    def counted(engine, name, **kwargs):
        calls.append(name)
        return real(engine, name, sizes=(1, 2, 4), context=8, repeats=1)

    monkeypatch.setattr(budget_module, "calibrate", counted)
    first = Decoder(tiny_decoder.target, default_drafts=False)
    c1 = first.latency_curve()
    path = calibration_path(tiny_decoder.target.name, first.engine)
    assert path.is_file() and tmp_path in path.parents
    assert first.latency_curve() is c1 and len(calls) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(budget_module, "calibrate", refuse)
    assert Decoder(tiny_decoder.target, default_drafts=False).latency_curve() == c1
    monkeypatch.setattr(budget_module, "calibrate", counted)
    assert first.latency_curve(recalibrate=True) is not c1 and len(calls) == 2


# ---------------------------------------------------------------- generation


class WrongDrafter(Drafter):
    """Always drafts a chain whose first token is not the target's greedy choice (it peeks at
    the reference output to make sure)."""

    taps = ()
    passes = 0

    def __init__(self, vocab: int):
        self.vocab, self.reference, self.prompt_len = vocab, [], 0

    def start(self, prompt_ids, hidden):
        self.prompt_len = len(prompt_ids)

    def propose(self, context, max_depth):
        i = len(context) - self.prompt_len  # the reference index of the token after the root
        right = self.reference[i] if i < len(self.reference) else 0
        k = min(3, max_depth)
        return DraftTree.chain([(right + j) % self.vocab for j in range(1, k + 1)], np.full(k, 0.9))

    def commit(self, tokens, hidden):
        pass


PROMPTS = ["abcabcabcabc", "the cat sat on the mat, the cat sat on the", "hello hello hello"]
N_NEW = 32


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    """A decoder of its own (the session one stays untouched), with an unfitted EAGLE head,
    a drafter that is always wrong, and a handmade latency curve (nothing is measured)."""
    d = Decoder(tiny_decoder.target, default_drafts=False)
    head = init_eagle_head(d.engine, d.target.weights)
    d.add_drafter("eagle-random", EagleDrafter(DraftHead(d.engine, head.numpy_weights()), tap=d.engine.config.num_layers,
                                               depth=4, topk=3, width=3, max_nodes=24))
    d.add_drafter("wrong", WrongDrafter(d.engine.config.vocab_size))
    # the default suffix drafter rarely matches the random tiny model's output: match single tokens too
    d.add_drafter("suffix-wide", SuffixDrafter(min_ngram=1, branches=3, max_nodes=16))
    d._curve = MODERATE
    return d


@pytest.fixture(scope="module")
def ar_outputs(decoder):
    return {p: decoder.generate(decoder.encode(p), GenerationRequest(max_new_tokens=N_NEW)) for p in PROMPTS}


@pytest.mark.parametrize("method", ["suffix", "suffix-wide", "eagle-random"])
def test_greedy_output_equals_ar_under_every_budget(decoder, ar_outputs, method):
    drafted = 0
    for prompt, ar in ar_outputs.items():
        ids = decoder.encode(prompt)
        for budget, fallback in [("auto", False), (1, False), (4, False), (None, False), ("auto", True), (0, False)]:
            r = decoder.generate(ids, GenerationRequest(max_new_tokens=N_NEW), method=method, budget=budget,
                                 fallback=fallback)
            assert (r.tokens, r.text, r.finish_reason) == (ar.tokens, ar.text, ar.finish_reason), (prompt, budget)
            if isinstance(budget, int):
                assert r.draft_tokens <= budget * r.extra["rounds"]
            drafted += r.draft_tokens
    if method != "suffix":
        assert drafted > 0  # the drafter did propose, so the budgets had something to trim


@pytest.mark.parametrize("method", ["suffix-wide", "eagle-random"])
def test_while_drafting_waits_only_free_trees_are_verified(decoder, ar_outputs, method):
    """A budget that makes drafting wait still weighs what costs no draft pass: the suffix
    drafter's matches are verified every round, a draft head drafts nothing at all."""
    drafted = 0
    for prompt, ar in ar_outputs.items():
        waiting = Budget("auto", decoder.latency_curve)
        waiting._skip_left = 10**6
        decoder._budgets[(method, "auto")] = waiting
        r = decoder.generate(decoder.encode(prompt), GenerationRequest(max_new_tokens=N_NEW), method=method)
        assert r.tokens == ar.tokens
        assert r.extra["draft_passes"] == 0
        drafted += r.draft_tokens
    del decoder._budgets[(method, "auto")]
    assert (drafted > 0) == (method == "suffix-wide")


def test_a_useless_drafter_falls_back_to_plain_decoding(decoder, ar_outputs, monkeypatch):
    monkeypatch.setattr(decoder, "_curve", curve([1, 2], [1e-9, 2e-9]))  # plain decoding looks free
    drafter = decoder.drafters["wrong"]
    for prompt, ar in ar_outputs.items():
        assert len(ar.tokens) > FALLBACK_WARMUP_ROUNDS + 1
        drafter.reference = ar.tokens
        ids = decoder.encode(prompt)
        req = GenerationRequest(max_new_tokens=N_NEW)
        decoder._fallbacks.clear()  # each prompt from a fresh fallback and budget (they carry over otherwise)
        decoder._budgets.clear()
        r = decoder.generate(ids, req, method="wrong", budget=None, fallback=True)
        assert r.tokens == ar.tokens
        assert r.accepted_draft_tokens == 0
        # every round commits one token: the prefill's, the first drafted round's (it catches the
        # drafter up on the prompt: not judged), then one per warm-up round
        assert r.extra["fell_back_after_tokens"] == FALLBACK_WARMUP_ROUNDS + 2
        # then a pause of plain rounds, one probe that does not pay either (after its own
        # catch-up round), and a longer pause; a round drafts 3 tokens, or what room is left
        start = FALLBACK_WARMUP_ROUNDS + 2 + FIRST_PAUSE_ROUNDS + 1  # tokens before the probe's judged rounds
        probe = [min(3, N_NEW - t - 1) for t in range(start, min(start + PROBE_ROUNDS, N_NEW))]
        assert r.draft_tokens == 3 * (FALLBACK_WARMUP_ROUNDS + 2) + sum(probe) and r.extra["fallback_pauses"] == 2
        # The next generation starts where this one left off: in its pause, so it opens with plain rounds.
        again = decoder.generate(ids, req, method="wrong", budget=None, fallback=True)
        assert again.tokens == ar.tokens and again.draft_tokens < r.draft_tokens
        # Another tree budget of the same method has a fallback of its own: it starts drafting afresh.
        fixed = decoder.generate(ids, req, method="wrong", budget=3, fallback=True)
        assert fixed.tokens == ar.tokens and fixed.extra["fell_back_after_tokens"] == FALLBACK_WARMUP_ROUNDS + 2
        # Under the auto budget the drafting time alone (against passes that look free) stops the
        # drafts before the fallback has a stretch to judge: a probe now and then.
        decoder._fallbacks.clear()
        decoder._budgets.clear()
        auto = decoder.generate(ids, req, method="wrong", budget="auto", fallback=True)
        assert auto.tokens == ar.tokens and auto.draft_tokens < r.draft_tokens
        kept = decoder.generate(ids, req, method="wrong", budget=None, fallback=False)
        assert kept.tokens == ar.tokens and "fell_back_after_tokens" not in kept.extra
        assert kept.draft_tokens > 3 * FALLBACK_WARMUP_ROUNDS


def test_a_round_that_ran_a_shape_first_teaches_acceptance_not_costs():
    """On a GPU a shape's first call compiles and captures: seconds, where a replay takes a
    millisecond. A tree drafted during one neither sets the drafting time nor starts a wait, a
    pass timed then does not scale the curve, and the fallback does not judge the round."""
    from lyanna.decoding.policy import Policy

    flat = curve([1, 2, 64], [0.01, 0.0101, 0.02])
    compiled, timed = Budget("auto", flat), Budget("auto", flat)
    assert len(timed.choose(binary_tree(20, 0.5), 5.0)) > 0 and not timed.evidence.paid
    compiled.choose(binary_tree(20, 0.5), 5.0, measured=False)
    assert compiled.evidence.draft_seconds is None and compiled.evidence.margin == 0.0
    assert len(compiled.choose(binary_tree(20, 0.5), 0.001)) > 0 and compiled.evidence.paid
    assert compiled.evidence.draft_seconds == 0.001
    fallback = Fallback(lambda: 0.01, warmup_rounds=1)
    policy = Policy(compiled, fallback)
    tree = binary_tree(4, 0.9)
    assert not policy.observe(tree, 2, 10.0, True, 10.0, 1, measured=False)
    assert compiled.slowdown == 1.0 and fallback.pauses == 0 and compiled.evidence.accepted == 2
    assert policy.observe(tree, 0, 10.0, True, 10.0, 1)  # measured: that slow round pauses drafting
    assert compiled.slowdown > 1.0 and fallback.pauses == 1


def test_a_round_that_catches_its_drafter_up_teaches_acceptance_not_costs():
    """A generation's first drafted round catches the head up on the whole prompt, and the first
    after plain rounds on every token since: tens of ms once, not a round's drafting cost. Such a
    round neither sets the drafting time nor is judged by the fallback; the rounds after it are."""
    from lyanna.decoding.policy import Policy

    budget = Budget("auto", curve([1, 2, 64], [0.01, 0.0101, 0.02]))
    fallback = Fallback(lambda: 0.01, warmup_rounds=1)
    policy = Policy(budget, fallback)
    tree = binary_tree(4, 0.9)
    assert len(policy.cut(tree, 5.0, free=False)) > 0  # the prompt's catch-up: 5 s
    assert budget.evidence.draft_seconds is None and budget.wants_drafts()
    assert not policy.observe(tree, 2, 0.01, True, 5.0, 1) and fallback.pauses == 0
    policy.cut(tree, 0.001, free=False)  # a steady round: timed
    assert budget.evidence.draft_seconds == 0.001
    assert not policy.observe(tree, 2, 0.01, True, 0.012, 3)
    assert not policy.observe(DraftTree.empty(), 0, 0.01, False, 0.011, 1)  # a plain round: the head falls behind
    policy.cut(tree, 7.0, free=False)  # the catch-up after it
    assert budget.evidence.draft_seconds == 0.001
    assert not policy.observe(tree, 0, 0.01, True, 7.0, 1) and fallback.pauses == 0
    policy.cut(tree, 7.0, free=False)  # a steady round as slow: judged, and it pauses drafting
    assert policy.observe(tree, 0, 0.01, True, 7.0, 1) and fallback.pauses == 1


def test_the_loop_does_not_measure_rounds_that_ran_a_shape_first(decoder, ar_outputs, monkeypatch):
    """The rounds during which the engine ran a shape for the first time (``first_runs`` grew)
    are observed as not measured; the rest are, and the tokens do not change."""
    from lyanna.decoding.policy import Policy

    engine, real = decoder.engine, decoder.engine.forward_batch
    passes: list[int] = []
    flags: list[bool] = []

    def counting(blocks):
        passes.append(len(blocks))
        engine.first_runs = min(len(passes), 3)  # the prefill and the first two rounds' passes
        return real(blocks)

    observe = Policy.observe

    def recorded(self, *args, measured=True, drafted=None):
        flags.append(measured)
        return observe(self, *args, measured=measured, drafted=drafted)

    monkeypatch.setattr(engine, "forward_batch", counting)
    monkeypatch.setattr(type(engine), "first_runs", 0, raising=False)  # a count the test sets
    monkeypatch.setattr(Policy, "observe", recorded)
    prompt = PROMPTS[0]
    r = decoder.generate(decoder.encode(prompt), GenerationRequest(max_new_tokens=N_NEW), method="suffix-wide",
                         budget="auto", fallback=True)
    assert r.tokens == ar_outputs[prompt].tokens
    assert flags[:2] == [False, False] and all(flags[2:]) and len(flags) > 4


def test_the_fallback_pauses_probes_and_learns_back():
    """The policy alone, on a one-token step of 1 s: a stretch of rounds slower than that pauses
    drafting, each failed probe doubles the pause, and a probe that pays resumes drafting."""
    fb = Fallback(lambda: 1.0, warmup_rounds=3, probe_rounds=2, first_pause=4, max_pause=8)

    def stretch(rounds: int, seconds: float, tokens: int) -> list[bool]:
        return [fb.keep_drafting(seconds, tokens) for _ in range(rounds)]

    def paused_rounds() -> int:
        n = 0
        while not fb.wants_drafts():
            n += 1
        return n

    assert fb.wants_drafts() and stretch(3, 2.0, 1) == [True, True, False]  # 3 tokens in 6 s: slower
    assert paused_rounds() == 4 and stretch(2, 2.0, 1) == [True, False]
    assert paused_rounds() == 8 and stretch(2, 2.0, 1) == [True, False]
    assert paused_rounds() == 8  # capped
    assert stretch(2, 2.0, 3) == [True, True]  # the text turned predictable: 6 tokens in 4 s
    assert paused_rounds() == 0 and stretch(3, 2.0, 3) == [True, True, True]  # judged by the warm-up stretch again
    assert stretch(3, 2.0, 1)[-1] is False and paused_rounds() == 4 and fb.pauses == 4  # the pause starts over


# ---------------------------------------------------------------- bench


def test_health_warns_only_when_speculation_does_not_pay():
    row = {"method": "suffix", "tau": 2.1, "draft_tokens": 50, "speedup": 1.4}
    assert health(row) == []
    assert health({**row, "method": "ar", "tau": 1.0, "draft_tokens": 0, "speedup": 1.0}) == []
    assert health({**row, "tau": 1.05, "draft_tokens": 0}) == []  # drafted nothing: no acceptance to judge
    (tau_note,) = health({**row, "tau": 1.05})
    assert "tau 1.05" in tau_note and "rarely accepted" in tau_note
    (skipped_note,) = health({**row, "tau": 1.05, "new_tokens": 2807})  # 50 drafts for 2807 tokens
    assert "drafted on few rounds" in skipped_note
    (slow_note,) = health({**row, "speedup": 0.9})
    assert "0.90x ar" in slow_note and "method ar" in slow_note
    assert len(health({**row, "tau": 1.05, "speedup": 0.9})) == 2
    assert health({**row, "tau": None, "speedup": None}) == []


def test_method_budget_specs(decoder):
    assert split_budget("lyanna@8", "auto") == ("lyanna", 8)
    assert split_budget("lyanna", "auto") == ("lyanna", "auto")
    assert split_budget("suffix@auto", 4) == ("suffix", "auto")
    with pytest.raises(LyannaError):
        split_budget("suffix@x", "auto")
    for spec in ("ar@8", "nope@2"):
        with pytest.raises(LyannaError):
            make_runners(decoder, [spec], SamplingParams())
    runners = make_runners(decoder, ["suffix-wide@2", "suffix-wide"], SamplingParams(), budget=0)
    ids = decoder.encode(PROMPTS[0])
    two, zero = runners["suffix-wide@2"](ids, N_NEW), runners["suffix-wide"](ids, N_NEW)
    assert 0 < two.draft_tokens <= 2 * two.extra["rounds"]
    assert zero.draft_tokens == 0 and two.tokens == zero.tokens


# ---------------------------------------------------------------- CLI


def test_cli_calibrate_prints_the_curve_and_caches_it(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LYANNA_CACHE", str(tmp_path))
    real = budget_module.calibrate
    calls = []

    def small(engine, name, **kwargs):
        calls.append(name)
        return real(engine, name, sizes=(1, 2, 4, 8), context=16, repeats=1)

    monkeypatch.setattr(budget_module, "calibrate", small)
    assert main(["--model", str(tiny_model_dir), "calibrate"]) == 0
    out = capsys.readouterr().out
    assert "| block tokens | ms | x one-token step |" in out
    assert [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "ms" not in line] == ["1", "2", "4", "8"]
    cached = [line for line in out.splitlines() if line.startswith("cached in ")]
    assert len(cached) == 1
    path = Path(cached[0][len("cached in "):])
    assert tmp_path in path.parents and json.loads(path.read_text())["sizes"] == [1, 2, 4, 8]
    assert main(["--model", str(tiny_model_dir), "calibrate"]) == 0 and len(calls) == 1  # read, not measured
    assert main(["--model", str(tiny_model_dir), "calibrate", "--force"]) == 0 and len(calls) == 2
    capsys.readouterr()
    assert main(["--model", str(tiny_model_dir), "generate", "abcabcabc", "--method", "suffix", "--budget", "2",
                 "--fallback", "--max-new-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "suffix"


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"]])
@pytest.mark.parametrize("value", ["x", "-1"])
def test_cli_rejects_a_bad_budget(capsys, command, value):
    with pytest.raises(SystemExit) as e:
        main([*command, "--budget", value])
    assert e.value.code == 2
    assert "budget must be 'auto' or a number" in capsys.readouterr().err


def test_auto_budget_drafts_one_level_deeper_than_it_kept_last():
    """What ``choose`` prices a kept tree at: the next round drafting one level below it; a round
    that keeps nothing does not reset it."""
    budget = Budget("auto", FLAT_THEN_STEEP)
    assert budget.limit_depth(100) == 100  # nothing kept yet: draft as deep as there is room
    chosen = budget.choose(binary_tree(20, 0.9), 0.0)
    assert len(chosen) == 7 and chosen.depths.max() == 3
    assert budget.limit_depth(100) == 4 and budget.limit_depth(2) == 2
    star = DraftTree(np.arange(NODE0, NODE0 + 5), np.full(5, -1), np.full(5, 0.9))  # depth 1
    budget.choose(star, 0.0)
    assert budget.limit_depth(100) == 2
    budget.cost._factors[2:] = 100.0  # every block of two rows or more now costs 100 plain passes
    assert not len(budget.choose(binary_tree(20, 0.9), 0.0))
    assert budget.limit_depth(100) == 2  # a tree cut to nothing leaves the depth of the last one kept
    first = Budget("auto", FLAT_THEN_STEEP)
    first.cost._factors[2:] = 100.0
    assert not len(first.choose(binary_tree(20, 0.9), 0.0)) and first.limit_depth(100) == 1  # none kept yet
    fixed = Budget(4)
    fixed.choose(binary_tree(20, 0.9), 0.0)
    assert fixed.limit_depth(100) == 4 and fixed.limit_depth(3) == 3  # 4 nodes are never deeper than 4


def test_where_each_shape_compiles_every_round_drafts_one_shape_as_deep_as_there_is_room(monkeypatch, tiny_decoder):
    """On an engine whose calls compile and capture at each new shape (a GPU's), the depth and
    the tree size the budget would move round to round are a new shape each time: the policy
    drafts as deep as there is room and leaves ``SHAPED_NODES`` nodes on the device instead (a
    fixed budget its own); the loop asks for that wherever ``shapes_compile`` says so, nowhere else."""
    from lyanna.decoding import loop
    from lyanna.decoding.policy import SHAPED_NODES, Policy

    budget = Budget("auto", FLAT_THEN_STEEP)
    budget.choose(binary_tree(20, 0.9), 0.0)
    assert Policy(budget, None).plan(True, 9).depth == 4
    assert Policy(budget, None).plan(True, 9).nodes == budget.nodes_ahead() != SHAPED_NODES
    shaped = [Policy(budget, None, fixed_shapes=True).plan(True, room) for room in (9, 2)]
    assert [(p.depth, p.nodes, p.seen) for p in shaped] == [(9, SHAPED_NODES, False), (2, SHAPED_NODES, False)]
    assert Policy(Budget(3, FLAT_THEN_STEEP), None, fixed_shapes=True).plan(True, 9).nodes == 3
    assert Policy(budget, None, fixed_shapes=True).plan(False, 9).nodes is None
    made = []
    monkeypatch.setattr(loop, "Policy", lambda *a, **k: made.append(k["fixed_shapes"]) or Policy(*a, **k))
    d = Decoder(tiny_decoder.target, default_drafts=False)
    req = GenerationRequest(max_new_tokens=4, eos_token_ids=())
    want = d.generate([1, 2, 3], req, method="ar").tokens
    monkeypatch.setattr(d.engine, "shapes_compile", True, raising=False)
    assert d.generate([1, 2, 3], req, method="ar").tokens == want and made == [False, True]


def test_a_shared_pass_verifies_only_trees_that_clearly_beat_plain_decoding(monkeypatch):
    """Beside 7 other sequences on a curve still flat, unlikely drafts add a few % to the pass's
    tokens: alone such a tree is verified (it costs nothing), in a shared pass it is not (it would
    spread latency for no throughput) unless it beats plain decoding by ``SHARED_MARGIN``; likely
    drafts are verified in both."""
    flat = curve([1, 16, 64], [0.01, 0.01, 0.05])
    unlikely, likely = binary_tree(20, 0.02), binary_tree(20, 0.9)
    assert len(Budget("auto", flat).choose(unlikely, 0.0)) > 0
    assert len(Budget("auto", flat, load=lambda: (7, 7)).choose(unlikely, 0.0)) == 0
    assert len(Budget("auto", flat, load=lambda: (7, 7)).choose(likely, 0.0)) > 0
    monkeypatch.setattr(budget_module, "SHARED_MARGIN", 0.0)  # the margin is what drops it
    assert len(Budget("auto", flat, load=lambda: (7, 7)).choose(unlikely, 0.0)) > 0


def test_an_auto_budget_drafts_nothing_while_requests_wait_for_the_batch():
    """Requests queued behind a full batch make the pass throughput-bound: no drafts, no free
    trees, and the wait and evidence stay as they were, so drafting resumes where it left off
    once the queue is empty. A fixed budget drafts as told; alone nothing ever waits."""
    load = [Load(7, 7, 3)]
    budget = Budget("auto", FLAT_THEN_STEEP, load=lambda: load[0])
    before = vars(budget.evidence).copy()
    assert budget.throughput_bound() and not any(budget.wants_drafts() for _ in range(2 * MAX_PROBE_WAIT))
    assert vars(budget.evidence) == before
    load[0] = Load(7, 7, 0)
    assert not budget.throughput_bound() and budget.wants_drafts()
    fixed = Budget(4, load=lambda: Load(7, 7, 3))
    assert not fixed.throughput_bound() and fixed.wants_drafts()
    assert not Budget("auto", FLAT_THEN_STEEP).throughput_bound()
    assert Budget("auto", FLAT_THEN_STEEP, load=lambda: (3, 4)).load() == Load(3, 4, 0)  # two fields: none waits


def test_a_curve_span_is_the_curve_at_each_size():
    """``span`` reads a table inside it and interpolates beyond, the values ``curve(n)`` gives."""
    from lyanna.decoding.budget import TABLE_ROWS

    for first, count in ((1, 5), (37, 64), (TABLE_ROWS - 3, 8), (TABLE_ROWS + 10, 4)):
        assert np.array_equal(MODERATE.span(first, count), [MODERATE(n) for n in range(first, first + count)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40), st.floats(0.1, 3.0), st.integers(0, 7),
       st.integers(0, 300), st.floats(0.0, 0.05), st.floats(0.5, 2.0))
def test_auto_choose_keeps_the_size_of_the_best_rate(scores, correction, others, other_rows, seconds, slowdown):
    """``choose``'s compiled sizing against the rule written out in numpy: the rate of 0..n nodes
    for the pass with the others' rows, its first maximum, none in a shared pass below the margin."""
    tree = DraftTree(np.arange(len(scores)), np.arange(len(scores)) - 1, np.array(scores))  # a chain
    budget = Budget("auto", MODERATE, load=lambda: (others, other_rows))
    budget.slowdown = slowdown
    budget.evidence.accepted, budget.evidence.predicted = correction * 3.0 - 1.0 + 1e-9, 2.0  # correction
    c = budget.correction
    p = np.sort(tree.closed_scores())[::-1]
    gain = others + 1.0 + np.concatenate([[0.0], np.cumsum(np.minimum(p * c, 1.0))])
    passes = slowdown * MODERATE(other_rows + np.arange(1, len(p) + 2))
    rate = gain / (seconds + passes)
    want = int(np.argmax(rate))
    if others and rate[want] < (1.0 + budget_module.SHARED_MARGIN) * rate[0]:
        want = 0
    assert len(budget.choose(tree, seconds, free=True)) == want


def test_one_outlier_of_drafting_time_does_not_price_drafting_out_of_reach_for_good():
    """A drafting round that met a first use's compile or a pause of the host priced drafting far
    above a round's cost: its margin started waits, and after a wait every drafting round catches
    its drafter up, so none was judged and drafting stayed that dear, a method drafting almost
    never for the rest of a run. Such a round's time only bounds what drafting costs, so one
    below the price brings it down, and the budget judges drafting worth it again; one above
    it changes nothing."""
    from lyanna.decoding.policy import Policy

    budget = Budget("auto", FLAT_THEN_STEEP)
    likely = binary_tree(7, 0.9)
    budget.choose(likely, 0.3)  # the outlier, measured: drafting does not pay at that price
    assert not budget.evidence.paid and budget.evidence.drafting.by_depth()[3] == 0.3
    policy = Policy(budget, None)
    policy.observe(DraftTree.empty(), 0, 0.01, False, 0.011, 1)  # a plain round: the next drafts after it
    policy.cut(likely, 0.5, free=False)  # a catch-up above the price: nothing learned
    assert budget.evidence.drafting.by_depth()[3] == 0.3
    policy.cut(likely, 0.002, free=False)  # below it: drafting costs at most that
    assert budget.evidence.drafting.by_depth()[3] == 0.002 and budget.evidence.draft_seconds == 0.002
    assert len(budget.choose(likely, 0.002)) == len(likely) and budget.evidence.paid
