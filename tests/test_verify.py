"""The verifier: greedy equals step-by-step greedy (property tests), and sampling is lossless
(statistical tests that a deliberately wrong rule fails)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lyanna import verify as verify_module
from lyanna.sampling import SamplingParams, target_probs
from lyanna.tree import DraftTree
from lyanna.verify import verify

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
    """Accepting a candidate without removing it from p on rejection biases the output."""
    def no_residual(p, candidates, rng):
        for i, x in enumerate(candidates):
            if rng.random() < p[x]:
                return i, p
        return None, p

    monkeypatch.setattr(verify_module, "_deterministic_step", no_residual)
    p = target_probs(P_LOGITS, PARAMS)
    assert chi2(first_token_frequencies(deterministic_tree), p) > CHI2_LIMIT


def test_wrong_pq_rule_is_caught(monkeypatch):
    """Using p(x) instead of p(x)/q(x) as the acceptance probability must fail the test."""
    def wrong(p, q, candidates, rng):
        for i, x in enumerate(candidates):
            if rng.random() < p[x]:
                return i, p
            residual = np.maximum(p - q, 0.0)
            p = residual / residual.sum()
        return None, p

    monkeypatch.setattr(verify_module, "_sampled_step", wrong)
    p = target_probs(P_LOGITS, PARAMS)
    assert chi2(first_token_frequencies(sampled_tree), p) > CHI2_LIMIT


def test_verify_checks_logit_rows():
    with pytest.raises(ValueError):
        verify(DraftTree.chain([1, 2]), np.zeros((2, VOCAB)), PARAMS, np.random.default_rng(0))
