"""Autoregressive decoding: greedy equality with Hugging Face generate(), sampling, limits."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from lyanna.bench import load_questions
from lyanna.decoding import GenerationRequest
from lyanna.errors import LyannaError
from lyanna.hf_baseline import HFGenerate
from lyanna.sampling import SamplingParams, target_probs

from .conftest import ALPHA, chi2_pvalue


def assert_equal_or_near_tie(ours, theirs, hf_model, prompt_ids):
    """Token-identical, or diverging only where the target's top-2 logit gap is below 1e-4."""
    if ours == theirs:
        return
    j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b) if any(
        a != b for a, b in zip(ours, theirs)) else min(len(ours), len(theirs))
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(prompt_ids) + ours[:j]])).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"diverged at token {j} with top-2 gap {gap}"


def test_tiny_greedy_equals_hf_generate(tiny_decoder):
    hf = HFGenerate(tiny_decoder.target.path, tiny_decoder.tokenizer, tiny_decoder.eos_token_ids)
    for prompt in ["hello", "speculative decoding", "zzz"]:
        ids = tiny_decoder.encode(prompt)
        ours = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40)).tokens
        theirs = hf.generate(ids, 40).tokens
        assert_equal_or_near_tie(ours, theirs, hf.model, ids)


@pytest.mark.slow
def test_default_greedy_equals_hf_generate(default_decoder, hf_default):
    hf = HFGenerate(default_decoder.target.path, default_decoder.tokenizer, default_decoder.eos_token_ids)
    hf.model = hf_default
    questions = load_questions(limit=20)
    assert len(questions) == 20
    exact = 0
    for q in questions:
        ids = default_decoder.encode(q.prompt)
        ours = default_decoder.generate(ids, GenerationRequest(max_new_tokens=64)).tokens
        theirs = hf.generate(ids, 64).tokens
        assert_equal_or_near_tie(ours, theirs, hf_default, ids)
        exact += ours == theirs
    assert exact >= 18  # near-ties are rare; many divergences would mean a real bug


def test_sampling_is_seeded_and_respects_max_new_tokens(tiny_decoder):
    ids = tiny_decoder.encode("hi")
    req = GenerationRequest(max_new_tokens=25, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7))
    a = tiny_decoder.generate(ids, req)
    b = tiny_decoder.generate(ids, req)
    c = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=25, sampling=SamplingParams(temperature=1.0, seed=8)))
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.new_tokens <= 25
    for n in (1, 2, 7):
        r = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=n))
        assert r.new_tokens <= n
        assert r.finish_reason == ("stop" if r.tokens[-1] in tiny_decoder.eos_token_ids else "length")


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
