"""Autoregressive decoding: greedy equality with Hugging Face generate(), sampling, limits."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from lyanna.decoding.decoder import GenerationRequest
from lyanna.decoding.sampling import SamplingParams, target_probs
from lyanna.errors import LyannaError
from lyanna.measure.bench import load_questions
from lyanna.measure.hf_baseline import HFGenerate

from .conftest import ALPHA, chi2_pvalue

# Two logits closer than this are a tie that float32 summation order decides: our kernels and
# PyTorch's add the same products in different orders, and on the default model their logits
# differ by at most 8.7e-5 (measured over six benchmark prompts, every position; logits reach
# ~40). Two tokens can swap places only if their gap is below the sum of their two errors.
TIE = 2e-4


def divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two greedy outputs differ, None when they are identical."""
    if ours == theirs:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def assert_same_or_tie(ours, theirs, hf_model, engine, prompt_ids) -> bool:
    """Token-identical (False), or the outputs part at a tie (True): at the first differing
    position both models rank the two tokens as their top two, less than ``TIE`` apart. After that
    the contexts differ, so nothing later is compared."""
    j = divergence(ours, theirs)
    if j is None:
        return False
    assert j < min(len(ours), len(theirs)), f"one output stops at {j} and the other goes on: {ours} vs {theirs}"
    ctx = list(prompt_ids) + ours[:j]
    with torch.no_grad():
        hf_logits = hf_model(torch.tensor([ctx])).logits[0, -1].numpy()
    our_logits = engine.forward(ctx, np.arange(len(ctx)), engine.new_cache(len(ctx)), logit_rows=[-1]).logits[-1]
    pair = {ours[j], theirs[j]}
    for name, logits in (("hf", hf_logits), ("ours", our_logits)):
        top2 = np.argsort(-logits, kind="stable")[:2]
        gap = abs(float(logits[ours[j]] - logits[theirs[j]]))
        assert set(top2.tolist()) == pair and gap < TIE, f"{name}: diverged at token {j} ({pair}), top-2 {top2}, gap {gap}"
    return True


def test_tiny_greedy_equals_hf_generate(tiny_decoder):
    """Exact: the tiny model's logits have no near-ties on these prompts."""
    hf = HFGenerate(tiny_decoder.target.path, tiny_decoder.tokenizer, tiny_decoder.eos_token_ids)
    for prompt in ["hello", "speculative decoding", "zzz"]:
        ids = tiny_decoder.encode(prompt)
        ours = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40)).tokens
        assert ours == hf.generate(ids, 40).tokens


@pytest.mark.slow
def test_default_greedy_equals_hf_generate(default_decoder, hf_default):
    """Each output equals Hugging Face's, or parts from it only at a measured tie: one question of
    each of the 13 categories (the suite's slowest test at 20 questions)."""
    hf = HFGenerate(default_decoder.target.path, default_decoder.tokenizer, default_decoder.eos_token_ids)
    hf.model = hf_default
    questions = load_questions(limit=13)
    assert len({q.category for q in questions}) == 13
    for q in questions:
        ids = default_decoder.encode(q.prompt)
        ours = default_decoder.generate(ids, GenerationRequest(max_new_tokens=64)).tokens
        assert_same_or_tie(ours, hf.generate(ids, 64).tokens, hf_default, default_decoder.engine, ids)


def test_a_divergence_without_a_tie_is_refused(tiny_decoder):
    """The tie rule itself: a real difference (a token the target does not rank first or second)
    fails, and identical outputs need no explanation."""
    hf = HFGenerate(tiny_decoder.target.path, tiny_decoder.tokenizer, tiny_decoder.eos_token_ids)
    ids = tiny_decoder.encode("hello")
    ours = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=8)).tokens
    assert assert_same_or_tie(ours, list(ours), hf.model, tiny_decoder.engine, ids) is False
    logits = tiny_decoder.engine.forward(ids + ours[:3], np.arange(len(ids) + 3), tiny_decoder.engine.new_cache(len(ids) + 3)).logits[-1]
    wrong = ours[:3] + [int(np.argsort(-logits)[5])] + ours[4:]
    with pytest.raises(AssertionError, match="diverged at token 3"):
        assert_same_or_tie(wrong, ours, hf.model, tiny_decoder.engine, ids)


AR_GRID = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.3)]
AR_SAMPLES = 1500


@pytest.mark.parametrize("params", AR_GRID, ids=["t0.7-topk5", "t1.3-topp0.3"])
def test_sampled_tokens_follow_target_distribution(tiny_decoder, single_threaded_kernels, params):
    """The first two tokens ``generate`` samples (seeds 0..n-1) follow the filtered target
    distribution jointly (chi-square over every pair of tokens)."""
    ids = tiny_decoder.encode("abc")
    engine = tiny_decoder.engine
    vocab = engine.config.vocab_size

    def probs_after(ctx):
        return target_probs(engine.forward(ctx, np.arange(len(ctx)), engine.new_cache(len(ctx)), logit_rows=[-1]).logits[-1], params)

    first = probs_after(ids)
    exact = np.zeros((vocab, vocab))
    for t in np.flatnonzero(first):
        exact[t] = first[t] * probs_after(ids + [int(t)])
    counts = np.zeros_like(exact)
    for seed in range(AR_SAMPLES):
        r = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=2, sampling=replace(params, seed=seed)))
        counts[tuple(r.tokens)] += 1
    assert 1 < np.count_nonzero(exact) < vocab  # the filter is active, and there is something to test
    assert chi2_pvalue(counts, exact) > ALPHA


def test_target_probs_filters():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(p, [1, 0, 0, 0, 0])
    for tiny in (1e-300, 1e-320, 5e-324):  # logits / temperature overflows: the limit is greedy, ties shared
        np.testing.assert_array_equal(target_probs(np.array([1.0, 3.0, -2.0, 3.0]), SamplingParams(temperature=tiny)),
                                      [0, 0.5, 0, 0.5])
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(LyannaError):
            SamplingParams(**bad)


def test_context_window_and_empty_prompt_are_refused(tiny_decoder):
    with pytest.raises(LyannaError, match="context window"):
        tiny_decoder.generate([5] * 500, GenerationRequest(max_new_tokens=100))
    with pytest.raises(LyannaError, match="empty"):
        tiny_decoder.generate([], GenerationRequest(max_new_tokens=5))
    with pytest.raises(LyannaError, match="unknown method"):
        tiny_decoder.generate([5], GenerationRequest(max_new_tokens=5), method="nope")
