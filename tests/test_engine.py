"""The engine against Hugging Face, and the cache/tree mechanics speculative decoding relies on."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lyanna.drafters.tree import DraftTree
from lyanna.engines.base import Block
from lyanna.engines.loading import load_target
from lyanna.engines.transformer import KVCache, Transformer

from .conftest import make_tiny_model


def hf_logits(model_dir, ids, hidden=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=hidden)
    return out


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0}),
        ("mistral", {}),
        ("mistral", {"sliding_window": 16}),  # the 150-token sequence is far longer than the window
        ("qwen2", {}),
    ],
)
def test_logits_match_hf_for_each_layout(tmp_path, arch, overrides):
    model_dir = make_tiny_model(tmp_path, arch, **overrides)
    target = load_target(model_dir)
    engine = Transformer(target.config, target.weights)
    ids = list(np.random.default_rng(0).integers(3, 259, size=150))
    ref = hf_logits(model_dir, ids, hidden=True)
    out = engine.forward(ids, np.arange(len(ids)), engine.new_cache(200), taps=(0, 1, 2))
    # the same sequence as a prompt's prefill: PyTorch's GEMM and fused attention (kernels.linear_rows)
    cache = engine.new_cache(200)
    pre = engine.forward_batch([Block(ids, np.arange(len(ids)), cache, taps=(0, 1, 2), prefill=True)])[0]
    for got in (out, pre):
        assert np.abs(got.logits - ref.logits[0].numpy()).max() < 1e-4
        for tap in (0, 1, 2):
            assert np.abs(got.hidden[tap] - ref.hidden_states[tap][0].numpy()).max() < 1e-4
    assert cache.length == len(ids)


def test_sliding_window_decode_and_tree_blocks_match_hf(tmp_path):
    """With a window of 8, one token at a time and a tree block after a 20-token prefix: every row
    equals Hugging Face's logits for the same sequence (keys 8 or more positions back are masked)."""
    model_dir = make_tiny_model(tmp_path, "mistral", sliding_window=8)
    target = load_target(model_dir)
    assert target.config.sliding_window == 8
    engine = Transformer(target.config, target.weights)
    rng = np.random.default_rng(4)
    ids = [int(t) for t in rng.integers(3, 259, size=30)]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def last_logits(seq: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0].numpy()

    ref = last_logits(ids)
    cache = engine.new_cache(64)
    steps = np.concatenate([engine.forward([t], [i], cache).logits for i, t in enumerate(ids)])
    assert np.abs(steps - ref).max() < 1e-4
    prefix, tree = ids[:20], random_tree(rng, 10)
    cache = engine.new_cache(64)
    engine.forward(prefix, np.arange(20), cache)
    out = engine.forward(tree.tokens, tree.positions(20), cache, block_mask=tree.ancestor_mask()).logits
    for node in range(len(tree)):
        path = prefix + [int(tree.tokens[i]) for i in tree.path_to(node)]
        assert np.abs(out[node] - last_logits(path)[-1]).max() < 1e-4


def test_incremental_blocks_equal_one_prefill(tiny_decoder):
    engine = tiny_decoder.engine
    ids = list(np.random.default_rng(1).integers(3, 259, size=40))
    full = engine.forward(ids, np.arange(40), engine.new_cache(64)).logits
    cache = engine.new_cache(64)
    parts = [engine.forward(ids[a:b], np.arange(a, b), cache).logits for a, b in [(0, 17), (17, 18), (18, 31), (31, 40)]]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5)


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    return DraftTree(rng.integers(3, 259, size=n), parents)


def test_tree_block_equals_each_path_alone(tiny_decoder):
    """Every tree node gets the logits it would get if its path were decoded alone."""
    engine = tiny_decoder.engine
    rng = np.random.default_rng(2)
    prefix = list(rng.integers(3, 259, size=12))
    tree = random_tree(rng, 10)
    cache = engine.new_cache(64)
    engine.forward(prefix, np.arange(12), cache)
    out = engine.forward(tree.tokens, tree.positions(12), cache, block_mask=tree.ancestor_mask())
    for node in range(len(tree)):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        alone = engine.forward(prefix + path, np.arange(12 + len(path)), engine.new_cache(64)).logits[-1]
        np.testing.assert_allclose(out.logits[node], alone, atol=2e-5)


def test_tree_mask_and_positions():
    #        0     1
    #       / \    |
    #      2   3   4
    #      |
    #      5
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.positions(7).tolist() == [7, 7, 8, 8, 8, 9]
    mask = tree.ancestor_mask()
    assert not mask[0, 1] and not mask[1, 0]  # siblings at depth 1
    assert not mask[2, 3] and not mask[3, 2]  # siblings at depth 2
    assert not mask[4, 0] and not mask[5, 3]  # cousins
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert tree.path_to(5) == [0, 2, 5]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1])  # parent after child


def test_compaction_equals_fresh_recompute(tiny_decoder):
    """Verify a tree, keep one path, continue: identical to recomputing without the tree."""
    engine = tiny_decoder.engine
    rng = np.random.default_rng(3)
    prefix = list(rng.integers(3, 259, size=9))
    tree = DraftTree([20, 21, 22, 23, 24, 25, 26], [-1, -1, 0, 1, 2, 2, 4])
    cache = engine.new_cache(64)
    engine.forward(prefix, np.arange(9), cache)
    engine.forward(tree.tokens, tree.positions(9), cache, block_mask=tree.ancestor_mask())
    keep = tree.path_to(6)  # nodes 0, 2, 4, 6
    cache.compact(9, keep)
    assert cache.length == 9 + len(keep)
    nxt = engine.forward([30, 31], [cache.length, cache.length + 1], cache).logits
    committed = prefix + [int(tree.tokens[i]) for i in keep] + [30, 31]
    fresh_cache = engine.new_cache(64)
    fresh = engine.forward(committed, np.arange(len(committed)), fresh_cache).logits[-2:]
    np.testing.assert_allclose(nxt, fresh, atol=2e-5)
    np.testing.assert_allclose(cache.k[:, :, : cache.length], fresh_cache.k[:, :, : cache.length], atol=1e-5)
    np.testing.assert_allclose(cache.v[:, :, : cache.length], fresh_cache.v[:, :, : cache.length], atol=1e-5)


def test_compaction_moves_the_kept_slots_whatever_their_order():
    """A verified path (increasing slots, compiled) and any other order (numpy's fancy indexing)
    both leave slot ``start + i`` holding what ``start + keep[i]`` held, the prefix untouched."""
    rng = np.random.default_rng(7)
    for keep in ([0, 2, 5, 6], [0], [], [1, 3], [4, 1, 2], [0, 1, 2, 3, 4, 5, 6]):
        cache = KVCache(3, 2, 4, 16)
        cache.k[:], cache.v[:] = rng.standard_normal(cache.k.shape), rng.standard_normal(cache.v.shape)
        cache.length = 12
        k, v = cache.k.copy(), cache.v.copy()
        cache.compact(5, keep)
        assert cache.length == 5 + len(keep)
        src = 5 + np.asarray(keep, np.int64)
        np.testing.assert_array_equal(cache.k[:, :, 5 : 5 + len(keep)], k[:, :, src])
        np.testing.assert_array_equal(cache.v[:, :, 5 : 5 + len(keep)], v[:, :, src])
        np.testing.assert_array_equal(cache.k[:, :, :5], k[:, :, :5])


def test_compaction_rejects_bad_indices(tiny_decoder):
    cache = tiny_decoder.engine.new_cache(16)
    tiny_decoder.engine.forward([5, 6, 7], [0, 1, 2], cache)
    with pytest.raises(ValueError):
        cache.compact(1, [2])  # the block has 2 positions
    with pytest.raises(ValueError):
        cache.compact(1, [0, 0])


def test_forward_rejects_bad_blocks(tiny_decoder):
    engine = tiny_decoder.engine
    with pytest.raises(ValueError, match="capacity"):
        engine.forward([5] * 5, np.arange(5), engine.new_cache(4))
    with pytest.raises(ValueError, match="token ids"):
        engine.forward([5, 999], [0, 1], engine.new_cache(4))
    with pytest.raises(ValueError, match="block_mask"):
        engine.forward([5, 6], [0, 1], engine.new_cache(4), block_mask=np.ones((3, 3), bool))


@pytest.mark.slow
def test_default_model_logits_match_hf(default_decoder, hf_default):
    engine = default_decoder.engine
    for prompt in ["What is the capital of France?", "Write a haiku about autumn leaves falling."]:
        ids = default_decoder.encode(prompt)
        with torch.no_grad():
            ref = hf_default(torch.tensor([ids])).logits[0].numpy()
        out = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids)))
        assert np.abs(out.logits - ref).max() <= 1e-3
