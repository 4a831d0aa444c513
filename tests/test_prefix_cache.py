"""Prefix caching: a prompt that shares a prefix with a recent one prefills only the rest, and
gets exactly the outputs it gets alone (the GGUF engine's rows do not depend on their block)."""
from __future__ import annotations

import numpy as np
import pytest

from lyanna.decoding.prefix_cache import PrefixCache
from lyanna.engines.transformer import KVCache


def filled_cache(n: int, seed: int = 0) -> KVCache:
    cache = KVCache(2, 1, 4, n + 8)
    rng = np.random.default_rng(seed)
    cache.k[:, :, :n] = rng.standard_normal((2, 1, n, 4))
    cache.v[:, :, :n] = rng.standard_normal((2, 1, n, 4))
    cache.length = n
    return cache


def test_the_longest_shared_prefix_is_found_and_restored():
    pc = PrefixCache(100)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    ca, cb = filled_cache(6, 1), filled_cache(5, 2)
    pc.store(a, ca, {30: np.arange(6.0)[:, None] * np.ones((1, 3))})
    pc.store(b, cb, {30: np.zeros((5, 3))})
    hit = pc.lookup([1, 2, 3, 4, 7, 7, 7], taps=(30,))
    assert hit.length == 4 and np.array_equal(hit.hidden[30][:, 0], [0, 1, 2, 3])
    fresh = KVCache(2, 1, 4, 16)
    hit.restore(fresh)
    assert fresh.length == 4 and np.array_equal(fresh.k[:, :, :4], ca.k[:, :, :4])
    assert np.array_equal(fresh.v[:, :, :4], ca.v[:, :, :4])
    # the whole of a cached prompt: its last token is still left to compute
    assert pc.lookup(a, taps=(30,)).length == 5
    assert pc.lookup([7, 1, 2], taps=(30,)) is None  # nothing shared
    assert pc.lookup([1, 2, 3, 4], taps=(30, 12)) is None  # a tap it did not keep
    assert (pc.hits, pc.reused_tokens, pc.lookups) == (2, 9, 4)


def test_old_prompts_leave_first_and_covered_prefixes_go():
    pc = PrefixCache(10)
    pc.store([1, 2, 3], filled_cache(3), {})
    pc.store([1, 2, 3, 4, 5], filled_cache(5), {})  # covers [1, 2, 3]
    assert pc.tokens == 5
    pc.store([7, 8, 9, 10], filled_cache(4), {})
    assert pc.tokens == 9
    pc.lookup([1, 2, 3, 4, 0], taps=())  # used: the other one is older now
    pc.store([5, 5], filled_cache(2), {})
    assert pc.tokens == 7 and pc.lookup([7, 8, 9, 1], taps=()) is None
    pc.store(list(range(11)), filled_cache(11), {})  # longer than the whole cache: not kept
    assert pc.tokens == 7
    with pytest.raises(ValueError):
        PrefixCache(0)


@pytest.mark.slow
def test_prefix_hits_give_the_outputs_of_whole_prompts(default_target):
    """On the default model (GGUF blocks): prompts sharing the chat template, then a second turn
    of a conversation, decoded after their prefixes were cached: the same tokens as without a
    prefix cache, for ``ar`` and a drafter that reads the prompt's hidden states. Engines whose
    prefill rows depend on their block (fp32's GEMM) get no prefix cache."""
    from lyanna.decoding.decoder import Decoder, GenerationRequest
    from lyanna.engines.loading import DEFAULT_MODEL, load_target

    assert Decoder(default_target, prefix_cache_tokens=4096).prefix_cache is None  # fp32 weights
    gguf = load_target(DEFAULT_MODEL, weight_format="gguf")
    cached, default_decoder = Decoder(gguf, prefix_cache_tokens=4096), Decoder(gguf)
    assert cached.engine.blockwise_prefill and cached.prefix_cache is not None
    req = GenerationRequest(max_new_tokens=24)
    first = [{"role": "user", "content": "Name three rivers in Europe."}]
    turn = first + [{"role": "assistant", "content": "The Danube, the Rhine and the Seine."},
                    {"role": "user", "content": "Which one is the longest?"}]
    prompts = [cached.encode_messages(first), cached.encode("Write a haiku about rain."),
               cached.encode_messages(turn)]
    for method in ("ar", "lyanna"):
        for ids in prompts:
            assert cached.generate(ids, req, method=method).tokens == default_decoder.generate(ids, req, method=method).tokens
    pc = cached.prefix_cache  # the first prompt misses; every later one reuses at least the template
    assert pc.hits == 5 and pc.reused_tokens >= 5 * 20
