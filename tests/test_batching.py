"""Batching: sequences that share forward passes get exactly what they would get alone."""
from __future__ import annotations

import threading
from dataclasses import replace

import httpx
import numpy as np
import pytest

from lyanna.decoding import verify as verify_module
from lyanna.decoding.decoder import GenerationRequest
from lyanna.drafters.base import NoDrafter
from lyanna.drafters.tree import DraftTree
from lyanna.engines.base import Block
from lyanna.measure.bench import load_questions
from lyanna.serving.app import create_app

from .conftest import ALPHA, chi2_pvalue, no_residual
from .test_server import Server
from .test_speculative import PROMPT, SAMPLING_GRID, SMALL_VOCAB, eos_decoder, exact_joints, small_decoder  # noqa: F401 (fixtures)


def _prefilled(engine, ids):
    cache = engine.new_cache(64)
    engine.forward(ids, np.arange(len(ids)), cache)
    return cache


def _copy(cache):
    new = type(cache).__new__(type(cache))
    new.k, new.v, new.length = cache.k.copy(), cache.v.copy(), cache.length
    return new


@pytest.fixture(scope="module")
def block_engines(tiny_model_dir):
    """The tiny model's layers on Q8_0 blocks: its engine, which runs every batch through
    ``fused.py`` in one compiled call, the same weights layer by layer, and the target."""
    from lyanna.engines.loading import load_target
    from lyanna.engines.quant import quantize_q8_0
    from lyanna.engines.transformer import Transformer

    target = load_target(tiny_model_dir)
    weights = {name: quantize_q8_0(w) if w.ndim == 2 and ".layers." in name else w for name, w in target.weights.items()}
    fused, plain = Transformer(target.config, weights), Transformer(target.config, weights)
    plain._fused = None
    assert fused._fused is not None and fused.blockwise_prefill
    return fused, plain, replace(target, weights=weights)


@pytest.mark.parametrize("weights", ["fp32", "blocks"])
def test_a_batched_forward_gives_every_block_its_own_forward_bit_for_bit(tiny_decoder, block_engines, weights):
    """A plain step, a tree block with its mask, and a prefill with taps, in one ragged pass; on
    blocks the batch goes through the fused layers, and must also match the layer-by-layer path."""
    engine = tiny_decoder.engine if weights == "fp32" else block_engines[0]
    top = engine.config.num_layers
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    specs = [
        dict(prefix=[5, 9, 11], tokens=[4], positions=[3]),
        dict(prefix=[7, 7, 8, 2, 3], tokens=[1, 2, 3, 4], positions=[5, 6, 6, 7], block_mask=tree, taps=(1, top)),
        dict(prefix=None, tokens=[3, 1, 4, 1, 5, 9], positions=list(range(6)), logit_rows=[-1], taps=(0,)),
        # prompts long enough for the prefill GEMM path (kernels.BULK_MIN_ROWS), two in one pass
        dict(prefix=None, tokens=list(range(10, 70)), positions=list(range(60)), logit_rows=[-1], taps=(1,), prefill=True),
        dict(prefix=None, tokens=list(range(80, 130)), positions=list(range(50)), prefill=True),
    ]
    alone, batched = [], []
    for spec in specs:
        prefix = spec.pop("prefix")
        cache = _prefilled(engine, prefix) if prefix else engine.new_cache(64)
        alone.append((Block(cache=_copy(cache), **spec)))
        batched.append((Block(cache=cache, **spec)))
    if weights == "blocks":  # the same batch layer by layer, on copies of the caches
        plain = [replace(b, cache=_copy(b.cache)) for b in batched]
        for mine, theirs in zip(engine.forward_batch([replace(b, cache=_copy(b.cache)) for b in batched]),
                                block_engines[1].forward_batch(plain)):
            assert np.array_equal(mine.logits, theirs.logits)
            assert all(np.array_equal(mine.hidden[t], theirs.hidden[t]) for t in mine.hidden)
    outs = engine.forward_batch(batched)
    for a, b, out in zip(alone, batched, outs):
        ref = engine.forward_batch([a])[0]
        assert np.array_equal(out.logits, ref.logits)
        assert out.hidden.keys() == ref.hidden.keys() == set(a.taps)
        for tap in a.taps:
            assert np.array_equal(out.hidden[tap], ref.hidden[tap])
        assert b.cache.length == a.cache.length
        assert np.array_equal(b.cache.k[:, :, : b.cache.length], a.cache.k[:, :, : a.cache.length])
        assert np.array_equal(b.cache.v[:, :, : b.cache.length], a.cache.v[:, :, : a.cache.length])


def test_a_prefill_block_starts_from_an_empty_cache_and_is_causal(tiny_decoder):
    engine = tiny_decoder.engine
    with pytest.raises(ValueError, match="prefill"):
        engine.forward_batch([Block([1, 2], [3, 4], _prefilled(engine, [5, 6, 7]), prefill=True)])
    with pytest.raises(ValueError, match="prefill"):
        engine.forward_batch([Block([1, 2], [0, 1], engine.new_cache(8), block_mask=np.ones((2, 2), bool), prefill=True)])


def test_a_batch_refuses_two_blocks_on_one_cache(tiny_decoder):
    cache = tiny_decoder.engine.new_cache(8)
    with pytest.raises(ValueError, match="own cache"):
        tiny_decoder.engine.forward_batch([Block([1], [0], cache), Block([2], [0], cache)])


def _same(a, b) -> None:
    assert (a.tokens, a.finish_reason, a.text) == (b.tokens, b.finish_reason, b.text)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "suffix", "eagle", "lyanna", "lyanna+suffix"])
def test_default_model_batched_greedy_equals_each_alone(default_decoder, method):
    """Six prompts of different lengths, three at a time (so sequences join and leave while
    others run), each with its own limit and one with a stop string: every output, finish reason
    and text is what decoding that prompt alone gives."""
    d = default_decoder
    prompts = [d.encode(q.prompt) for q in load_questions()[:6]]
    assert len({len(p) for p in prompts}) > 3
    reqs = [GenerationRequest(max_new_tokens=n) for n in (24, 40, 8, 32, 16, 40)]
    reqs[1] = replace(reqs[1], stop=(d.generate(prompts[1], reqs[1]).text[20:24],))  # stops mid-output
    batched = d.generate_batch(prompts, reqs, method=method, max_batch=3)
    for ids, req, got in zip(prompts, reqs, batched):
        _same(got, d.generate(ids, req, method=method))
    assert batched[1].finish_reason == "stop"
    assert batched[2].new_tokens <= 8


@pytest.mark.parametrize("method", ["ar", "suffix"])
def test_eos_stops_and_limits_per_sequence_inside_shared_passes(eos_decoder, method):
    """Twelve generations, eight at a time, ending by EOS, a stop string or their own limit in
    the middle of each other's passes: each ends exactly as it does alone."""
    prompts = [[0], [4, 5], [6, 7, 1], [3, 3, 7]] * 3
    reqs = [GenerationRequest(max_new_tokens=n, stop=stop)
            for n, stop in zip((1, 5, 40) * 4, ((), ("h",), ("dcd",), ()) * 3)]
    batched = eos_decoder.generate_batch(prompts, reqs, method=method, max_batch=8, budget=None)
    for ids, req, got in zip(prompts, reqs, batched):
        _same(got, eos_decoder.generate(ids, req, method=method, budget=None))
    assert {r.finish_reason for r in batched} == {"stop", "length"}


@pytest.mark.parametrize("method", ["ar", "suffix", "eagle", "lyanna", "lyanna-nofusion", "lyanna+suffix", "peek"])
def test_seeded_sampling_in_a_batch_equals_alone(small_decoder, method):
    """Per-request seeds: the same samples whatever else shares the passes ("peek" cannot fork,
    so its generations take turns in the batch)."""
    params = SAMPLING_GRID["t1.5-topp0.6"][0]
    reqs = [GenerationRequest(max_new_tokens=12, sampling=replace(params, seed=s)) for s in range(8)]
    prompts = [PROMPT[: 2 + s % 3] for s in range(8)]
    batch = getattr(getattr(small_decoder.drafter_for(method), "head", None), "batch", None)
    calls = 0 if batch is None else batch.calls
    batched = small_decoder.generate_batch(prompts, reqs, method=method, max_batch=5, budget=None)
    for ids, req, got in zip(prompts, reqs, batched):
        _same(got, small_decoder.generate(ids, req, method=method, budget=None))
    if method in ("lyanna", "lyanna+suffix"):  # the batch's rounds drafted together (lyanna_batch), several a call
        assert batch.calls > calls and batch.most > 1


def _batched_counts(decoder, method, params, horizon, n):
    reqs = [GenerationRequest(max_new_tokens=horizon, sampling=replace(params, seed=s)) for s in range(n)]
    counts = np.zeros((SMALL_VOCAB,) * horizon)
    for r in decoder.generate_batch([PROMPT] * n, reqs, method=method, max_batch=16, budget=None):
        counts[tuple(r.tokens)] += 1
    return counts


@pytest.mark.parametrize("method", ["ar", "eagle", "lyanna"])
def test_batched_sampling_keeps_the_target_joint_distribution(small_decoder, exact_joints, single_threaded_kernels,
                                                              method):
    params, horizon = SAMPLING_GRID["t1.5-topp0.6"]
    assert chi2_pvalue(_batched_counts(small_decoder, method, params, horizon, 600), exact_joints["t1.5-topp0.6"]) > ALPHA


def test_batched_sampling_with_a_broken_rule_fails_the_joint_test(small_decoder, exact_joints, single_threaded_kernels,
                                                                  monkeypatch):
    params, horizon = SAMPLING_GRID["t1.5-topp0.6"]
    monkeypatch.setattr(verify_module, "_deterministic_step", no_residual)
    assert chi2_pvalue(_batched_counts(small_decoder, "peek", params, horizon, 600), exact_joints["t1.5-topp0.6"]) < ALPHA


def test_server_batches_concurrent_requests_and_answers_each_as_alone(tiny_decoder, monkeypatch):
    """Six concurrent greedy requests against ``--max-batch 4``: passes held more than one
    sequence, and every completion equals the decoder's answer for that prompt alone."""
    sizes: list[int] = []
    real = tiny_decoder.engine.forward_batch

    def counting(blocks):
        sizes.append(len(blocks))
        return real(blocks)

    monkeypatch.setattr(tiny_decoder.engine, "forward_batch", counting)
    prompts = [f"tell me about {w} and {w}" for w in ("cats", "dogs", "owls", "a long river in spring", "x", "ink")]
    srv = Server(create_app(tiny_decoder, method="ar", max_pending=8, request_timeout=30, max_batch=4))
    try:
        answers: dict[int, dict] = {}

        def ask(i: int) -> None:
            body = {"messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 12 + i, "temperature": 0}
            answers[i] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    assert max(sizes) > 1 and max(sizes) <= 4
    for i, prompt in enumerate(prompts):
        ids = tiny_decoder.encode_messages([{"role": "user", "content": prompt}])
        alone = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=12 + i))
        assert answers[i]["choices"][0]["message"]["content"] == alone.text
        assert answers[i]["usage"]["completion_tokens"] == alone.new_tokens


class _TapRecorder(NoDrafter):
    """Drafts nothing; keeps the prompt's hidden rows each generation starts from."""

    def __init__(self, taps, seen):
        self.taps, self.seen = taps, seen

    def fork(self):
        return _TapRecorder(self.taps, self.seen)

    def start(self, prompt_ids, hidden):
        self.seen[tuple(prompt_ids)] = {t: h.copy() for t, h in hidden.items()}


def test_chunked_prefill_in_a_batch_gives_what_a_whole_prefill_gives(block_engines, tiny_decoder):
    """In a batch a prompt is prefilled ``prefill_chunk`` positions a pass on an engine whose rows
    do not depend on their block: the same tokens and the same prompt hidden rows as a whole
    prefill alone, one more pass per extra chunk; alone, prompts stay whole."""
    from lyanna.decoding.decoder import Decoder, GenerationRequest

    engine, _, target = block_engines
    taps = (1, engine.config.num_layers)
    seen_chunked, seen_whole = {}, {}
    chunked = Decoder(target, engine=engine, prefill_chunk=3, default_drafts=False)
    whole = Decoder(target, engine=engine, default_drafts=False)
    assert chunked.effective_prefill_chunk == 3  # fp32 weights: prefill rows depend on their block, never chunked
    assert Decoder(tiny_decoder.target, prefill_chunk=3, default_drafts=False).effective_prefill_chunk == 0
    chunked.add_drafter("rec", _TapRecorder(taps, seen_chunked))
    whole.add_drafter("rec", _TapRecorder(taps, seen_whole))
    prompts = [[5, 9, 11, 2, 7, 1, 4, 8, 3, 6], [2, 3], [7, 7, 1, 9, 4, 2, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    reqs = [GenerationRequest(max_new_tokens=n) for n in (6, 9, 4, 7)]
    for method in ("ar", "suffix", "rec"):
        batched = chunked.generate_batch(prompts, reqs, method=method, max_batch=2)
        for ids, req, got in zip(prompts, reqs, batched):
            alone = whole.generate(ids, req, method=method)
            _same(got, alone)
            assert chunked.generate(ids, req, method=method).target_passes == alone.target_passes
            if method == "ar":  # one pass per token after the first, and one per chunk before it
                assert got.target_passes == alone.target_passes + (len(ids) - 1) // 3
    assert seen_chunked.keys() == seen_whole.keys() == {tuple(p) for p in prompts}
    for ids, rows in seen_whole.items():
        assert rows.keys() == set(taps) and all(rows[t].shape[0] == len(ids) for t in taps)
        assert all(np.array_equal(seen_chunked[ids][t], rows[t]) for t in taps)


class _QueueWatcher(NoDrafter):
    """Proposes one node every round, drafted or free, and records how many requests waited
    for the batch (``seen``) each time it was asked."""

    def __init__(self, schedulers, seen):
        self.schedulers, self.seen = schedulers, seen

    def fork(self):
        return _QueueWatcher(self.schedulers, self.seen)

    def propose(self, context, max_depth):
        self.seen.append(self.schedulers[-1].waiting)
        return DraftTree.chain([context[-1]])

    propose_free = propose


def test_a_batch_with_requests_waiting_drafts_nothing(tiny_decoder, monkeypatch):
    """Six prompts, two at a time under the auto budget: no proposal (drafted or free) while
    prompts wait for a place, proposals once none waits, and every output as alone."""
    from lyanna.decoding import decoder as decoder_module

    schedulers, seen = [], []

    class Watched(decoder_module.BatchScheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            schedulers.append(self)

    monkeypatch.setattr(decoder_module, "BatchScheduler", Watched)
    tiny_decoder.add_drafter("watch", _QueueWatcher(schedulers, seen))
    prompts = [[5, 9, 11, 2], [2, 3], [7, 7, 1], [1, 2, 3, 4, 5], [6, 1], [8, 4, 2]]
    reqs = [GenerationRequest(max_new_tokens=n) for n in (6, 9, 4, 7, 12, 10)]
    batched = tiny_decoder.generate_batch(prompts, reqs, method="watch", max_batch=2)
    assert seen and set(seen) == {0}
    for ids, req, got in zip(prompts, reqs, batched):
        _same(got, tiny_decoder.generate(ids, req))
