"""A batch's caches as rows of one tensor (``engines.device_rows``): the host-verified decoding
blocks of several sequences run as one pass, each block's logits and taps those it gets alone
(plain steps and tree blocks, across compaction and a Mistral window), and continuous batching on
row caches gives every prompt its ``ar`` output, with host trees, device heads and sequences that
found no free row. ``LYANNA_TEST_DEVICE=cuda`` runs them on a GPU, CUDA graphs included."""
from __future__ import annotations

import numpy as np
import pytest

from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.engines.base import Block
from lyanna.engines.device import DeviceEngine
from lyanna.errors import LyannaError

from .test_device_engine import DEVICE, TREE, _with_heads, tiny  # noqa: F401  (tiny: the layouts' fixture)


def _run(engine: DeviceEngine, top: int):
    """Three prompts, then one batch of a plain step, a tree block and a plain step with
    different taps, a compaction of the tree, and a batch of three plain steps."""
    caches = [engine.new_cache(100) for _ in range(3)]
    for i, c in enumerate(caches):
        n = 10 + 7 * i
        engine.forward(np.arange(3, 3 + n), np.arange(n), c)
    n0, n1, n2 = (c.length for c in caches)
    first = engine.forward_batch([Block([5], [n0], caches[0], taps=(top,)),
                                  Block([7, 8, 9, 10], [n1, n1 + 1, n1 + 1, n1 + 2], caches[1], TREE, taps=(1, top)),
                                  Block([11], [n2], caches[2], taps=(1,))])
    caches[1].compact(n1, [0, 2, 3])
    second = engine.forward_batch([Block([12], [c.length], c, taps=(top,)) for c in caches])
    return first + second, [c.length for c in caches]


def test_blocks_on_rows_share_a_pass_and_give_each_blocks_own_outputs(tiny):
    top = tiny.config.num_layers
    (want, n_want), rows = _run(DeviceEngine(tiny.config, tiny.weights, DEVICE), top), DeviceEngine(
        tiny.config, tiny.weights, DEVICE, batch_rows=3, row_capacity=128)
    got, n_got = _run(rows, top)
    assert n_got == n_want and rows.row_slabs.passes_run == 2 and rows.batches_rows
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(a.logits.argmax(), b.logits.argmax())
        assert a.hidden.keys() == b.hidden.keys()
        for tap in a.hidden:
            np.testing.assert_allclose(a.hidden[tap], b.hidden[tap], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["ar", "lyanna", "eagle", "lyanna-device", "lyanna-device+suffix", "eagle-device"])
def test_a_batch_on_row_caches_decodes_as_each_prompt_alone(tiny, method, monkeypatch):
    """5 prompts, at most 4 at once, on 3 rows (a sequence finds no free row and runs on a cache
    of its own): each result is the prompt's ``ar`` output alone, and the batch's steps shared
    passes, host trees among them."""
    from lyanna.engines.device_rows import RowSlabs

    widest = []
    run = RowSlabs.run
    monkeypatch.setattr(RowSlabs, "run", lambda self, blocks, inputs: widest.append(max(len(i[0]) for i in inputs))
                        or run(self, blocks, inputs))
    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, batch_rows=3, row_capacity=512),
                            default_drafts=False), tiny)
    prompts = [[1, 40, 41, 42, 40, 41, 42], [1, 100, 101], list(range(3, 60)), list(range(5, 30)), [7, 8, 9]]
    req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
    alone = [Decoder(tiny, default_drafts=False).generate(p, req).tokens for p in prompts]
    head_rows = getattr(d.drafter_for(method), "head", None)
    head_rows = getattr(head_rows, "rows", None)
    assert head_rows is None or head_rows.idle == 3  # a drafter takes a row when it starts generating
    out = d.generate_batch(prompts, req, method=method, max_batch=4, budget=4)
    assert [o.tokens for o in out] == alone
    assert d.engine.row_slabs.passes_run == len(widest) > 0
    assert method == "ar" or sum(o.draft_tokens for o in out) > 0
    # Host trees share the batch's passes; so do a device Lyanna head's, drafted in one call for
    # the batch (its trees come to the host); EAGLE's device trees run in passes of their own.
    assert (max(widest) > 1) == (method in ("lyanna", "eagle", "lyanna-device", "lyanna-device+suffix"))
    if method.startswith("lyanna-device"):
        assert head_rows.calls > 0 and head_rows.most > 1


def test_a_batch_drafting_together_near_the_end_of_its_rows_decodes_as_alone(tiny):
    """Row caches of 64 positions with prompts that fill most of them: chains of several depths
    in one call (replies end at different times), contexts with no room for the deepest chain
    drafted at their own depth, one too long for a row on caches of its own: each result is
    ``ar``'s alone."""
    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, batch_rows=3, row_capacity=64),
                            default_drafts=False), tiny)
    prompts = [list(range(3, 33)), list(range(5, 52)), list(range(7, 62)), [1, 40, 41, 42, 40, 41, 42]]
    reqs = [GenerationRequest(max_new_tokens=n, eos_token_ids=()) for n in (24, 17, 12, 20)]
    alone = [Decoder(tiny, default_drafts=False).generate(p, r).tokens for p, r in zip(prompts, reqs)]
    out = d.generate_batch(prompts, reqs, method="lyanna-device", max_batch=3, budget=4)
    assert [o.tokens for o in out] == alone
    assert d.drafter_for("lyanna-device").head.rows.calls > 0


def test_bad_row_settings_are_refused(tiny):
    with pytest.raises(LyannaError, match="batch rows"):
        DeviceEngine(tiny.config, tiny.weights, DEVICE, batch_rows=1)
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, batch_rows=2, row_capacity=64)
    a, b, c = e.new_cache(64), e.new_cache(64), e.new_cache(64)  # two rows, then the pool
    assert (a.slab.row, b.slab.row, c.slab.row) == (0, 1, None)
    assert e.new_cache(65).slab.row is None  # longer than a row
    del a
    import gc

    gc.collect()
    assert e.new_cache(10).slab.row == 0  # a dropped row is free again


@pytest.mark.parametrize("method", ["ar", "lyanna-device"])
def test_a_row_cache_serves_a_generation_launched_ahead(tiny, method):
    """One generation alone on a row cache, its rounds launched ahead of the host's reading (the
    default on a GPU: trees and plain steps verified in their passes, each following the last on
    the device): the ``ar`` output, as on a cache of its own."""
    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True, batch_rows=2,
                                                      row_capacity=512), default_drafts=False), tiny)
    req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
    for prompt in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 60))):
        want = Decoder(tiny, default_drafts=False).generate(prompt, req).tokens
        assert d.generate(prompt, req, method=method, budget=4).tokens == want
    import gc

    gc.collect()
    assert sorted(d.engine.row_slabs._free) == [0, 1]  # the rows went back once the generations ended
