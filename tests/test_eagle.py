"""The EAGLE-style baseline: numpy head == torch head, checkpoints, fitting, lossless decoding."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.drafters.checkpoint import save_head
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.engines.loading import load_target
from lyanna.engines.transformer import attention_bias
from lyanna.errors import LyannaError
from lyanna.training.fit import fit, init_eagle_head, target_features

from .conftest import draft_loaded, make_tiny_model, stir_upper_layers


def random_sequences(n, length, seed=0, low=3, high=259):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(low, high, size=length)) for _ in range(n)]


@pytest.fixture(scope="module")
def fitted(tiny_decoder, tiny_examples):
    """A head fitted for a few steps on the tiny model's own greedy outputs."""
    engine = tiny_decoder.engine
    tap = engine.config.num_layers
    examples = tiny_examples
    head = init_eagle_head(engine, tiny_decoder.target.weights)
    losses = fit(head, examples, steps=60, depth=2, lr=1e-3)
    return head, losses, tap


def test_numpy_head_matches_torch_head(tiny_decoder, fitted):
    head, _, tap = fitted
    engine = tiny_decoder.engine
    ex = target_features(engine, random_sequences(1, 20), tap)[0]
    with torch.no_grad():
        ref = head(torch.from_numpy(ex.features[:-1])[None], torch.from_numpy(ex.tokens[1:])[None], torch.arange(1, 20))[0]
    np_head = DraftHead(engine, head.numpy_weights())
    cache = np_head.new_cache(32)
    out = np_head.step(ex.features[:-1], ex.tokens[1:], np.arange(1, 20), cache, attention_bias(0, np.tril(np.ones((19, 19), bool))))
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-4)


def test_a_two_layer_numpy_head_matches_its_torch_twin(tiny_decoder):
    """Two decoder layers, the second reading the first's output: the numpy step equals the torch
    head's forward, and ``fill`` (the first layer whole, the second's keys and values only) leaves
    the cache that step leaves."""
    engine = tiny_decoder.engine
    tap = engine.config.num_layers
    head = init_eagle_head(engine, tiny_decoder.target.weights, layers=2)
    stir_upper_layers(head, seed=2)
    ex = target_features(engine, random_sequences(1, 20), tap)[0]
    with torch.no_grad():
        ref = head(torch.from_numpy(ex.features[:-1])[None], torch.from_numpy(ex.tokens[1:])[None], torch.arange(1, 20))[0]
    np_head = DraftHead(engine, head.numpy_weights())
    cache, filled = np_head.new_cache(32), np_head.new_cache(32)
    causal = attention_bias(0, np.tril(np.ones((19, 19), bool)))
    out = np_head.step(ex.features[:-1], ex.tokens[1:], np.arange(1, 20), cache, causal)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-4)
    np_head.fill(ex.features[:-1], ex.tokens[1:], np.arange(1, 20), filled)
    assert cache.k.shape[0] == 2 and filled.length == cache.length == 19
    np.testing.assert_allclose(filled.k[:, :, :19], cache.k[:, :, :19], atol=1e-5)
    np.testing.assert_allclose(filled.v[:, :, :19], cache.v[:, :, :19], atol=1e-5)


def test_fitting_lowers_the_loss(fitted):
    _, losses, _ = fitted
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])


def test_eagle_greedy_equals_ar_and_drafts_are_accepted(tmp_path, tiny_decoder, fitted):
    head, _, tap = fitted
    save_head(tmp_path / "eagle", "eagle", head.numpy_weights(), tiny_decoder.target, tap)
    assert tiny_decoder.load_draft(str(tmp_path / "eagle")) == ["eagle"]
    accepted = 0
    for prompt, stop in [("abc", ()), ("hello there", ("e",)), ("the cat", ())]:
        ids = tiny_decoder.encode(prompt)
        req = GenerationRequest(max_new_tokens=40, stop=stop)
        ar = tiny_decoder.generate(ids, req)
        # whole trees: the auto budget skips drafts that do not pay on a target this small
        eg = tiny_decoder.generate(ids, req, method="eagle", budget=None)
        assert (eg.tokens, eg.text, eg.finish_reason) == (ar.tokens, ar.text, ar.finish_reason)
        accepted += eg.accepted_draft_tokens
    assert accepted > 0  # the fitted head predicts something the target agrees with


def test_eagle_tree_is_ancestor_closed_and_within_budget(tiny_decoder, fitted):
    head, _, tap = fitted
    engine = tiny_decoder.engine
    drafter = EagleDrafter(DraftHead(engine, head.numpy_weights()), tap, depth=4, topk=3, width=3, max_nodes=10)
    ids = tiny_decoder.encode("abc")
    out = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids)), taps=(tap,))
    drafter.start(ids, out.hidden)
    tree = drafter.propose(ids + [int(np.argmax(out.logits[-1]))], 10)
    assert 0 < len(tree) <= 10 and tree.depths.max() <= 4
    assert all(p < i for i, p in enumerate(tree.parents))
    for i, p in enumerate(tree.parents):  # a child never outscores its parent
        if p >= 0:
            assert tree.scores[i] <= tree.scores[p] + 1e-12
    cached = drafter.context.cache.length
    drafter.propose(ids + [int(np.argmax(out.logits[-1]))], 10)
    assert drafter.context.cache.length == cached  # speculative pairs never stay in the draft cache


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_decoder, fitted):
    head, _, tap = fitted
    save_head(tmp_path / "eagle", "eagle", head.numpy_weights(), tiny_decoder.target, tap)
    other = Decoder(load_target(make_tiny_model(tmp_path / "other", seed=1)))
    with pytest.raises(LyannaError, match="another target"):
        other.load_draft(str(tmp_path / "eagle"))
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    cfg["format"] = "something-else"
    (tmp_path / "eagle" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LyannaError, match="not a Lyanna draft-head"):
        tiny_decoder.load_draft(str(tmp_path / "eagle"))
    with pytest.raises(LyannaError, match="not a known draft"):
        tiny_decoder.load_draft(str(tmp_path))


@pytest.mark.slow
def test_eagle_greedy_equals_ar_on_default_model(tmp_path, default_decoder):
    """A head fitted for a few steps on the default model: lossless whatever its quality."""
    d = default_decoder
    engine = d.engine
    tap = engine.config.num_layers
    prompts = ["What is the capital of France?", "Write a short poem about rain.", "List three uses of copper."]
    seqs = []
    for p in prompts:
        ids = d.encode(p)
        seqs.append(ids + d.generate(ids, GenerationRequest(max_new_tokens=48)).tokens)
    head = init_eagle_head(engine, d.target.weights)
    fit(head, target_features(engine, seqs, tap), steps=4, depth=2, lr=1e-4)
    save_head(tmp_path / "eagle", "eagle", head.numpy_weights(), d.target, tap)
    with draft_loaded(d, tmp_path / "eagle"):
        for p in prompts + ["Explain photosynthesis in two sentences."]:
            ids = d.encode(p)
            req = GenerationRequest(max_new_tokens=48)
            assert d.generate(ids, req, method="eagle").tokens == d.generate(ids, req).tokens
