"""The verifier: greedy equals step-by-step greedy (property tests), and sampling is lossless
(statistical tests that a deliberately wrong rule fails)."""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lyanna.decoding import verify as verify_module
from lyanna.decoding.sampling import SamplingParams, sample, target_probs
from lyanna.decoding.verify import verify
from lyanna.drafters.tree import DraftTree

from .conftest import ALPHA, chi2_pvalue, no_residual, p_not_p_over_q

VOCAB = 6


@st.composite
def trees(draw, max_nodes=12):
    n = draw(st.integers(0, max_nodes))
    parents, tokens = [], []
    for i in range(n):
        parents.append(draw(st.integers(-1, i - 1)))
        tokens.append(draw(st.integers(0, VOCAB - 1)))
    return DraftTree(np.array(tokens, np.int64), np.array(parents, np.int64))


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 2**32 - 1))
def test_greedy_verification_equals_step_by_step_greedy(tree, seed):
    """For random trees and a random 'target' (logits as a function of the token path),
    the verdict equals walking greedily and stopping at the first miss."""
    rng = np.random.default_rng(seed)
    table: dict[tuple, np.ndarray] = {}

    def target_logits(path: tuple) -> np.ndarray:
        if path not in table:
            table[path] = rng.normal(size=VOCAB)
        return table[path]

    paths = [()] + [tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(len(tree))]
    logits = np.stack([target_logits(p) for p in paths])
    verdict = verify(tree, logits, SamplingParams(), np.random.default_rng(0))
    # Reference: greedy decoding, one token at a time, accepted while the tree has that child.
    expected, node, kids = [], -1, tree.children()
    while True:
        tok = int(np.argmax(target_logits(tuple(expected))))
        expected.append(tok)
        match = next((c for c in kids.get(node, []) if tree.tokens[c] == tok), None)
        if match is None:
            break
        node = match
    assert verdict.tokens == expected
    assert [int(tree.tokens[i]) for i in verdict.path] == expected[:-1]
    for a, b in zip(verdict.path, verdict.path[1:]):
        assert tree.parents[b] == a


@settings(max_examples=100, deadline=None)
@given(trees())
def test_positions_are_prefix_plus_depth_and_mask_is_ancestors(tree):
    depths = tree.depths
    assert np.array_equal(tree.positions(10), 10 + depths - 1)
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        assert set(np.flatnonzero(mask[i])) == set(tree.path_to(i))
        for j in range(len(tree)):
            if i != j and tree.parents[i] == tree.parents[j]:
                assert not mask[i, j]


# --- sampling: the committed token at each position must be distributed exactly as p --------

P_LOGITS = np.log(np.array([0.35, 0.25, 0.15, 0.1, 0.08, 0.07]))
PARAMS = SamplingParams(temperature=1.0)


def first_token_frequencies(make_tree, n=6000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.zeros(VOCAB)
    for _ in range(n):
        tree = make_tree(rng)
        logits = np.tile(P_LOGITS, (len(tree) + 1, 1))
        counts[verify(tree, logits, PARAMS, rng).tokens[0]] += 1
    return counts


def chi2(counts, p):
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_LIMIT = 25.0  # 5 degrees of freedom: p < 2e-4 for a correct rule


def deterministic_tree(rng):
    return DraftTree(np.array([4, 5, 0]), np.array([-1, -1, -1]))  # unlikely tokens first


def sampled_tree(rng):
    q = np.array([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    kids = rng.choice(VOCAB, size=3, p=q)
    return DraftTree(kids, np.array([-1, -1, -1]), sampled_from={-1: q})


@pytest.mark.parametrize("make_tree", [deterministic_tree, sampled_tree])
def test_sampling_keeps_target_distribution(make_tree):
    p = target_probs(P_LOGITS, PARAMS)
    assert chi2(first_token_frequencies(make_tree), p) < CHI2_LIMIT


def test_wrong_deterministic_rule_is_caught(monkeypatch):
    monkeypatch.setattr(verify_module, "_deterministic_step", no_residual)
    p = target_probs(P_LOGITS, PARAMS)
    assert chi2(first_token_frequencies(deterministic_tree), p) > CHI2_LIMIT


def test_wrong_pq_rule_is_caught(monkeypatch):
    monkeypatch.setattr(verify_module, "_sampled_step", p_not_p_over_q)
    p = target_probs(P_LOGITS, PARAMS)
    assert chi2(first_token_frequencies(sampled_tree), p) > CHI2_LIMIT


def test_verify_checks_logit_rows():
    with pytest.raises(ValueError):
        verify(DraftTree.chain([1, 2]), np.zeros((2, VOCAB)), PARAMS, np.random.default_rng(0))


# --- sampling over several tree levels, every node with its own logit row ---------------------
#
# The target is a fixed function from token paths to logits (a different row for every path), so
# a verifier that reads the wrong row, or gets the rule wrong below the first level, is caught.
# After the verdict, tokens are drawn from the target itself up to HORIZON: the joint law of those
# HORIZON tokens must be the target's exactly, whatever the tree.

DEEP_GRID = {  # sampling settings and the horizon checked (kept near 100-200 cells)
    "t1": (SamplingParams(temperature=1.0), 3),
    "t0.7-topk3": (SamplingParams(temperature=0.7, top_k=3), 4),
    "t1.3-topp0.7": (SamplingParams(temperature=1.3, top_p=0.7), 4),
}
DEEP_SAMPLES = 2000
CHILDREN_PER_LEVEL = (2, 2, 1)  # a tree of depth 3: 2 + 4 + 4 nodes


@functools.cache
def path_logits(path: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([11, len(path), *path]).normal(0.0, 1.5, VOCAB)


@functools.cache
def draft_q(path: tuple[int, ...]) -> np.ndarray:
    """A drafter's distribution after ``path``: close to the target's, never equal (distinct per node)."""
    z = 0.8 * path_logits(path) + np.random.default_rng([29, len(path), *path]).normal(0.0, 0.7, VOCAB)
    return np.exp(z) / np.exp(z).sum()


def deep_tree(rng: np.random.Generator, sampled_levels: set[int]) -> DraftTree:
    """Children at the levels in ``sampled_levels`` (1 = children of the root) are drawn i.i.d.
    from ``draft_q``; the others are the target's most likely tokens, in order."""
    tokens, parents, sampled_from, paths = [], [], {}, {-1: ()}
    frontier = [-1]
    for level, k in enumerate(CHILDREN_PER_LEVEL, start=1):
        nxt = []
        for node in frontier:
            path = paths[node]
            if level in sampled_levels:
                q = draft_q(path)
                kids = rng.choice(VOCAB, size=k, p=q)
                sampled_from[node] = q
            else:
                kids = np.argsort(-path_logits(path), kind="stable")[:k]
            for t in kids:
                tokens.append(int(t))
                parents.append(node)
                paths[len(tokens) - 1] = path + (int(t),)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(np.array(tokens), np.array(parents), sampled_from=sampled_from)


def exact_deep_joint(params: SamplingParams, horizon: int) -> np.ndarray:
    probs = np.zeros((VOCAB,) * horizon)
    for seq in itertools.product(range(VOCAB), repeat=horizon):
        probs[seq] = np.prod([target_probs(path_logits(seq[:i]), params)[seq[i]] for i in range(horizon)])
    return probs


def deep_counts(sampled_levels: set[int], params: SamplingParams, horizon: int, n: int = DEEP_SAMPLES,
                seed: int = 0) -> tuple[np.ndarray, int]:
    """Joint counts of the first ``horizon`` committed tokens, and how many draft tokens below
    the first level were accepted (the deep levels were really exercised)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((VOCAB,) * horizon)
    deep = 0
    for _ in range(n):
        tree = deep_tree(rng, sampled_levels)
        rows = [path_logits(())] + [path_logits(tuple(int(tree.tokens[j]) for j in tree.path_to(i))) for i in range(len(tree))]
        verdict = verify(tree, np.stack(rows), params, rng)
        deep += max(len(verdict.path) - 1, 0)
        seq = list(verdict.tokens)
        while len(seq) < horizon:
            seq.append(sample(target_probs(path_logits(tuple(seq)), params), rng))
        counts[tuple(seq[:horizon])] += 1
    return counts, deep


SAMPLED_LEVELS = {"deterministic": set(), "sampled": {1, 2, 3}, "sampled-root": {1}, "sampled-below": {2, 3}}


@pytest.mark.parametrize("grid", DEEP_GRID)
@pytest.mark.parametrize("levels", SAMPLED_LEVELS)
def test_deep_sampled_verification_keeps_the_joint_distribution(levels, grid):
    params, horizon = DEEP_GRID[grid]
    counts, deep = deep_counts(SAMPLED_LEVELS[levels], params, horizon)
    assert deep > DEEP_SAMPLES // 10  # drafts below the first level were accepted often
    assert chi2_pvalue(counts, exact_deep_joint(params, horizon)) > ALPHA


@pytest.mark.parametrize("grid", DEEP_GRID)
@pytest.mark.parametrize("step, broken, levels", [("_deterministic_step", no_residual, "deterministic"),
                                                  ("_sampled_step", p_not_p_over_q, "sampled")])
def test_a_wrong_rule_fails_the_deep_test(monkeypatch, grid, step, broken, levels):
    params, horizon = DEEP_GRID[grid]
    monkeypatch.setattr(verify_module, step, broken)
    counts, _ = deep_counts(SAMPLED_LEVELS[levels], params, horizon)
    assert chi2_pvalue(counts, exact_deep_joint(params, horizon)) < ALPHA
