"""The Lyanna drafter: chain independence, token-info table, re-sampling without draft passes,
fusion, and losslessness."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from lyanna.decoding.decoder import GenerationRequest
from lyanna.drafters.checkpoint import save_head
from lyanna.drafters.lyanna import ChainHead, LyannaDrafter, TokenInfo, token_info_tree
from lyanna.drafters.tree import DraftTree
from lyanna.engines.transformer import attention_bias
from lyanna.training.fit import fit, init_lyanna_head, target_features

from .conftest import draft_loaded, stir_upper_layers

D2T = np.arange(259)[::-1].copy()  # a permuted draft vocabulary: the index mapping is exercised


def export(head, hot):
    w = head.numpy_weights()
    w["ti.hot"] = np.asarray(hot, np.int64)
    return w


@pytest.fixture(scope="module")
def fitted(tiny_decoder, tiny_examples):
    engine = tiny_decoder.engine
    examples = tiny_examples
    head = init_lyanna_head(engine, tiny_decoder.target.weights, D2T, rank=8)
    with torch.no_grad():
        head.ti.b.normal_(0, 0.5)  # make token info matter from the start
    losses = fit(head, examples, steps=40, depth=3, lr=2e-3)
    return head, losses, examples


def drafter_for(decoder, head, policy="fuse", hot=range(0, 259, 2), **knobs):
    w = export(head, list(hot))
    chain_head = ChainHead(decoder.engine, w)
    ti = TokenInfo(w["ti.a"], w["ti.b"], w["ti.hot"])
    return LyannaDrafter(chain_head, ti, (decoder.engine.config.num_layers,), policy=policy, **knobs)


def started(decoder, drafter, prompt="abc"):
    engine = decoder.engine
    ids = decoder.encode(prompt)
    out = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids) + 64), taps=drafter.taps)
    drafter.start(ids, out.hidden)
    return ids + [int(np.argmax(out.logits[-1]))]


def test_training_lowers_the_chain_loss(fitted):
    _, losses, _ = fitted
    assert np.mean(losses[-8:]) < 0.9 * np.mean(losses[:8])


def test_numpy_chain_matches_torch_unroll(tiny_decoder, fitted):
    head, _, examples = fitted
    ex = examples[0]
    drafter = drafter_for(tiny_decoder, head)
    drafter.start(list(ex.tokens[:-1]), {drafter.taps[0]: ex.features[:-1]})
    raw = drafter.chain(list(ex.tokens), 4)
    with torch.no_grad():
        chain = head.unroll(torch.from_numpy(ex.features), torch.from_numpy(ex.tokens), 4)
        ref = torch.stack([head.raw_logits(f[-1]) for f in chain]).numpy()
    np.testing.assert_allclose(raw, ref, atol=2e-4)


def test_catch_up_writes_the_cache_rows_a_full_step_writes(tiny_decoder, fitted):
    """A catch-up computes only the root's output and fills the other pairs' keys and values:
    the cache and the prediction must be bit-identical to one step over every pair."""
    head, _, examples = fitted
    ex = examples[0]
    drafter = drafter_for(tiny_decoder, head)
    tokens, features = np.asarray(ex.tokens), ex.features
    drafter.start(list(tokens[:-1]), {drafter.taps[0]: features[:-1]})
    pc = drafter.context
    pred = pc.catch_up(tokens, extra=0)
    n = len(tokens) - 1
    ref_cache = drafter.head.new_cache(n)
    pos = np.arange(1, n + 1)
    ref = drafter.head.step(features[:-1], tokens[1:], pos, ref_cache, attention_bias(0, np.tril(np.ones((n, n), bool))))
    assert pc.cache.length == ref_cache.length == n
    np.testing.assert_array_equal(pc.cache.k[:, :, :n], ref_cache.k[:, :, :n])
    np.testing.assert_array_equal(pc.cache.v[:, :, :n], ref_cache.v[:, :, :n])
    np.testing.assert_array_equal(pred, ref[-1])


def test_a_compiled_round_drafts_the_step_by_step_bits(tiny_model_dir, fitted):
    """On a GGUF's blocks a round's draft passes run in one compiled call (``host_round``): its raw
    logits and the head's cache rows must be bit-identical to the step-by-step path's, for
    catch-ups of one to several pairs and chains one to four deep."""
    from lyanna.engines.loading import load_target
    from lyanna.engines.quant import quantize_q8_0
    from lyanna.engines.transformer import Transformer

    target = load_target(tiny_model_dir)
    engine = Transformer(target.config, {n: quantize_q8_0(w) if w.ndim == 2 else w for n, w in target.weights.items()})
    head, _, examples = fitted
    w = export(head, range(0, 256, 2))
    w["d2t"] = D2T[:256].copy()  # a whole number of the kernel's output vectors: no padded rows
    compiled, steps = ChainHead(engine, w), ChainHead(engine, w)
    steps._compiled = None
    ti = TokenInfo(w["ti.a"], w["ti.b"], D2T[:256:5])
    assert compiled._compiled is not None
    tap = engine.config.num_layers
    tokens, features = np.asarray(examples[0].tokens), examples[0].features
    contexts = [h.context((tap,)) for h in (compiled, steps)]
    for pc in contexts:
        pc.start({tap: features[:4]})
    end = 4
    for step, depth in zip([0, 1, 3, 2, 5, 1, 4], [1, 2, 4, 3, 1, 2, 4]):
        for pc in contexts:
            pc.commit({tap: features[end : end + step]})
        end += step
        raws = [h.draft(pc, tokens[: end + 1], depth) for h, pc in zip((compiled, steps), contexts)]
        np.testing.assert_array_equal(raws[0], raws[1])
        assert raws[0].shape[0] == depth and contexts[0].cache.length == contexts[1].cache.length == end
        for kv in ("k", "v"):
            np.testing.assert_array_equal(getattr(contexts[0].cache, kv)[:, :, :end], getattr(contexts[1].cache, kv)[:, :, :end])
        # the whole round in one call: the same raw rows and the same tree, fused with leftover rows
        # leftover rows as sharp as the fresh ones, on other tokens: nodes of both make the cut
        leftover = None if depth < 2 else np.roll(raws[0][1:], 7, axis=1)
        rounds = [h.draft_trees(pc, tokens[: end + 1], depth, leftover, ti, 3, 2, 9) for h, pc in zip((compiled, steps), contexts)]
        np.testing.assert_array_equal(rounds[0][0], rounds[1][0])
        for field in ("tokens", "parents", "scores", "origin"):
            np.testing.assert_array_equal(getattr(rounds[0][1], field), getattr(rounds[1][1], field))
        assert len(rounds[0][1]) == 9 or depth == 1
        assert set(rounds[0][1].origin.tolist()) == ({0} if leftover is None else {0, 1})


def test_a_two_layer_chain_matches_its_torch_twin_and_decodes_losslessly(tiny_decoder, tiny_examples, tmp_path):
    """A head of two decoder layers: the numpy chain (catch-up through both layers, the second's
    cache filled from the first's outputs) gives the torch unroll's raw logits, the catch-up leaves
    the cache a full step leaves, and the method gives ``ar``'s tokens."""
    head = init_lyanna_head(tiny_decoder.engine, tiny_decoder.target.weights, D2T, rank=8, layers=2)
    stir_upper_layers(head, seed=1)
    with torch.no_grad():
        head.ti.b.normal_(0, 0.5)
    ex = tiny_examples[0]
    drafter = drafter_for(tiny_decoder, head)
    assert len(drafter.head.layers) == 2
    tokens, features = np.asarray(ex.tokens), ex.features
    drafter.start(list(tokens[:-1]), {drafter.taps[0]: features[:-1]})
    raw = drafter.chain(list(tokens), 4)
    with torch.no_grad():
        chain = head.unroll(torch.from_numpy(features), torch.from_numpy(tokens), 4)
        ref = torch.stack([head.raw_logits(f[-1]) for f in chain]).numpy()
    np.testing.assert_allclose(raw, ref, atol=2e-4)
    w1 = {k: v for k, v in export(head, range(0, 259, 2)).items() if not k.startswith("layer2.")}
    one = LyannaDrafter(ChainHead(tiny_decoder.engine, w1), drafter.ti, drafter.taps)
    one.start(list(tokens[:-1]), {one.taps[0]: features[:-1]})
    assert np.abs(one.chain(list(tokens), 4) - raw).max() > 1e-2  # the second layer matters
    pc = drafter.context
    n = len(tokens) - 1
    ref_cache = drafter.head.new_cache(n)
    drafter.head.step(features[:-1], tokens[1:], np.arange(1, n + 1), ref_cache,
                      attention_bias(0, np.tril(np.ones((n, n), bool))))
    assert pc.cache.k.shape[0] == 2 and pc.cache.length == n
    np.testing.assert_allclose(pc.cache.k[:, :, :n], ref_cache.k[:, :, :n], atol=1e-5)
    np.testing.assert_allclose(pc.cache.v[:, :, :n], ref_cache.v[:, :, :n], atol=1e-5)
    save_head(tmp_path / "deep", "lyanna", export(head, range(0, 259, 2)), tiny_decoder.target,
              tiny_decoder.engine.config.num_layers)
    with draft_loaded(tiny_decoder, tmp_path / "deep"):
        for prompt in ("abc", "tell me about item 3 and cats"):
            ids = tiny_decoder.encode(prompt)
            req = GenerationRequest(max_new_tokens=24)
            ar = tiny_decoder.generate(ids, req).tokens
            for m in ("lyanna", "lyanna+suffix"):
                assert tiny_decoder.generate(ids, req, method=m, budget=None).tokens == ar


def test_chain_is_identical_whatever_draft_tokens_are_chosen(tiny_decoder, fitted):
    head, _, _ = fitted
    chains = []
    for topk, width, scale in [(1, 1, 1.0), (4, 4, 1.0), (3, 2, -5.0)]:
        drafter = drafter_for(tiny_decoder, head, topk=topk, width=width)
        drafter.ti.table *= scale  # very different token info, so very different draft tokens
        ctx = started(tiny_decoder, drafter)
        drafter.propose(ctx, 6)
        chains.append(drafter._chain.copy())
    assert all(np.array_equal(chains[0], c) for c in chains[1:])  # bit-identical


def test_token_info_table_equals_low_rank_product():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(50, 4)).astype(np.float32), rng.normal(size=(4, 30)).astype(np.float32)
    hot = [3, 7, 11, 40]
    ti = TokenInfo(a, b, hot)
    for t in hot:
        np.testing.assert_allclose(ti(t), a[t] @ b, rtol=1e-5, atol=1e-6)
    assert ti.filled[0] == 4 and ti.table.shape[1] == 30  # four hot rows in use, spare rows for cold parents
    np.testing.assert_allclose(ti(5), a[5] @ b, rtol=1e-5)  # cold: computed on the fly
    assert not TokenInfo(a, b, hot, fallback="none")(5).any()  # cold: no token info


def reference_tree(raw, root, ti, d2t, topk, width, max_nodes):
    """The token-info tree spelled out in numpy: per depth, each frontier branch's top-k children
    under log_softmax(raw[d] + TI(parent)), the ``width`` best by joint log-probability go on."""
    tokens, parents, scores = [], [], []
    frontier = [(-1, root, 0.0)]
    for row in raw.astype(np.float64):
        children = []
        for node, tok, score in frontier:
            x = row + ti(tok)
            logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            for j in np.argsort(-logp, kind="stable")[:topk]:
                tokens.append(int(d2t[j]))
                parents.append(node)
                scores.append(score + float(logp[j]))
                children.append((len(tokens) - 1, int(d2t[j]), scores[-1]))
        frontier = sorted(children, key=lambda c: -c[2])[:width]
    return DraftTree.best_of(tokens, parents, scores, max_nodes)


@pytest.mark.parametrize("fallback", ["lowrank", "none"])
@pytest.mark.parametrize("topk,width,max_nodes", [(1, 1, 8), (4, 4, 64), (3, 2, 10), (5, 3, 200)])
def test_compiled_tree_builder_matches_reference(fallback, topk, width, max_nodes):
    rng = np.random.default_rng(topk * 10 + width)
    vocab, draft_vocab = 40, 30
    a, b = rng.normal(size=(vocab, 4)).astype(np.float32), rng.normal(size=(4, draft_vocab)).astype(np.float32)
    d2t = rng.permutation(vocab)[:draft_vocab]
    ti = TokenInfo(a, b, hot=d2t[::2], fallback=fallback)  # half the draft tokens hot, the rest cold
    raw = (3 * rng.normal(size=(5, draft_vocab))).astype(np.float32)
    ref = reference_tree(raw, int(d2t[1]), ti, d2t, topk, width, max_nodes)
    for _ in range(2):  # the second time, cold parents met the first time have rows in the table
        tree = token_info_tree(raw, int(d2t[1]), ti, d2t, topk, width, max_nodes)
        assert np.array_equal(tree.tokens, ref.tokens) and np.array_equal(tree.parents, ref.parents)
        np.testing.assert_allclose(tree.scores, ref.scores, rtol=1e-5)
    assert len(tree) == min(max_nodes, topk + 4 * width * topk)
    hot = d2t[::2].size
    cold = np.flatnonzero(ti.row_of >= hot)
    assert cold.size == (ti.filled[0] - hot if fallback == "lowrank" else 0)
    assert cold.size or fallback == "none" or width == 1  # cold rows were really materialized
    for t in cold:
        np.testing.assert_allclose(ti.table[ti.row_of[t]], a[t] @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_top_k_skipping_blocks_equals_a_stable_sort(seed):
    """``_top_k`` skips a block whose maximum cannot enter the list: its picks are still a stable
    sort's first k (ties to the earlier column), over many blocks, a tail and ties."""
    from lyanna.drafters.token_info import _top_k

    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 200)), int(rng.integers(1, 7))
    x = rng.integers(-5, 6, n).astype(np.float32) if seed % 2 else rng.normal(size=n).astype(np.float32)
    if seed % 3 == 0:
        x = np.sort(x)  # rising: every block enters the list
    top_v, top_i = np.empty(k, np.float32), np.empty(k, np.int64)
    _top_k(x, top_v, top_i)
    want = np.argsort(-x, kind="stable")[:k]
    assert top_i[: want.size].tolist() == want.tolist() and np.array_equal(top_v[: want.size], x[want])
    assert (top_i[want.size:] == -1).all() and np.isneginf(top_v[want.size:]).all()


def test_a_tree_from_nan_logits_is_refused():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(40, 4)).astype(np.float32), rng.normal(size=(4, 30)).astype(np.float32)
    ti, d2t = TokenInfo(a, b, hot=np.arange(5)), np.arange(30)
    with pytest.raises(ValueError, match="invalid tree"):
        token_info_tree(np.full((2, 30), np.nan, np.float32), 3, ti, d2t, 2, 2, 8)


def test_resampled_tree_needs_zero_draft_passes(tiny_decoder, fitted):
    head, _, _ = fitted
    drafter = drafter_for(tiny_decoder, head, policy="reuse", reuse_min_expected=0.0, depth=5)
    ctx = started(tiny_decoder, drafter)
    drafter.propose(ctx, 5)
    chain = drafter._chain.copy()
    passes = drafter.passes
    # verification accepted one draft token (5) and the target then chose 9
    hidden = {drafter.taps[0]: np.zeros((2, tiny_decoder.engine.config.hidden_size), np.float32)}
    drafter.commit([ctx[-1], 5], hidden)
    tree = drafter.propose(ctx + [5, 9], 5)
    assert drafter.passes == passes  # no draft forward pass
    assert len(tree) > 0 and tree.origin.all() and tree.depths.max() <= 3
    expected = token_info_tree(chain[2:], 9, drafter.ti, drafter.head.d2t, drafter.topk, drafter.width, drafter.max_nodes)
    assert np.array_equal(tree.tokens, expected.tokens) and np.array_equal(tree.parents, expected.parents)


def after_one_round(decoder, drafter):
    """Start ``drafter``, propose once, and commit as if verification accepted one draft token (5)
    and the target then chose 9; return the next proposal and the first round's raw-logit chain."""
    ctx = started(decoder, drafter)
    first_chain = drafter.chain(ctx, 5)  # the rows the first proposal is built from (a pure function of ctx)
    drafter.propose(ctx, 5)
    hidden = {drafter.taps[0]: np.zeros((2, decoder.engine.config.hidden_size), np.float32)}
    drafter.commit([ctx[-1], 5], hidden)
    before = drafter.passes
    tree = drafter.propose(ctx + [5, 9], 5)
    return tree, drafter.passes - before, first_chain


def node_paths(tree):
    """The token path of each node, in tree order."""
    return [tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(len(tree))]


def paths_of(tree):
    return set(node_paths(tree))


def test_fusion_merges_resampled_into_fresh_tree(tiny_decoder, fitted):
    """Policy ``fuse`` verifies the fresh tree and the re-sampled one together: its tree is their
    union (cut to the budget), with re-sampled nodes in it; ``off`` would give the fresh tree alone."""
    head, _, _ = fitted
    knobs = dict(depth=5, max_nodes=24)
    fused, fused_passes, chain = after_one_round(tiny_decoder, drafter_for(tiny_decoder, head, policy="fuse", **knobs))
    alone = drafter_for(tiny_decoder, head, policy="off", **knobs)
    fresh, fresh_passes, _ = after_one_round(tiny_decoder, alone)
    resampled = token_info_tree(chain[2:], 9, alone.ti, alone.head.d2t, alone.topk, alone.width, alone.max_nodes, origin=1)
    assert fused_passes == fresh_passes == 5  # a fresh chain was drafted too: catch-up + 4 chain steps
    assert len(fused) == 24 and len(paths_of(fused)) == 24  # equal paths were merged into one node
    assert paths_of(fused) == paths_of(fresh.merged(resampled, 24))
    only_resampled = paths_of(resampled) - paths_of(fresh)
    recovered = {path for path, origin in zip(node_paths(fused), fused.origin) if origin}
    assert recovered and recovered <= only_resampled  # re-sampled nodes made the cut, marked as such


def test_suffix_branches_join_the_chain_tree(tiny_decoder, fitted):
    """``lyanna+suffix``: every path of the plain Lyanna tree stays, and a repeated stretch of the
    context adds the suffix drafter's continuation as a branch."""
    head, _, _ = fitted
    plain = drafter_for(tiny_decoder, head, policy="off")
    both = drafter_for(tiny_decoder, head, policy="off", suffix=True)
    engine = tiny_decoder.engine
    ctx = tiny_decoder.encode("the cat sat. the cat sat. the cat", chat=False)  # its last token is the root
    out = engine.forward(ctx[:-1], np.arange(len(ctx) - 1), engine.new_cache(len(ctx) + 64), taps=plain.taps)
    for d in (plain, both):
        d.start(ctx[:-1], out.hidden)
    t_plain, t_both = plain.propose(ctx, 6), both.propose(ctx, 6)
    matched = both.suffix.propose(ctx, 6)
    assert len(matched) > 0 and paths_of(matched) - paths_of(t_plain)  # the match proposes something new
    assert paths_of(t_plain) | paths_of(matched) == paths_of(t_both)
    assert np.all((t_both.scores >= 0) & (t_both.scores <= 1))


def test_greedy_equals_ar_with_every_policy(tmp_path, tiny_decoder, fitted, single_threaded_kernels):
    """Every policy is lossless; re-sampling commits re-sampled tokens, and ``reuse`` (nofusion)
    saves draft passes against drafting afresh every round (noresample)."""
    head, _, _ = fitted
    save_head(tmp_path / "ly", "lyanna", export(head, range(0, 259, 3)), tiny_decoder.target, tiny_decoder.engine.config.num_layers)
    stats = {m: Counter() for m in ("lyanna", "lyanna-noresample", "lyanna-nofusion")}
    with draft_loaded(tiny_decoder, tmp_path / "ly"):
        depth = tiny_decoder.drafters["lyanna"].depth
        for prompt, stop in [("abc", ()), ("hello there", ("e",)), ("the cat", ()), ("xyz xyz", ())]:
            ids = tiny_decoder.encode(prompt)
            req = GenerationRequest(max_new_tokens=40, stop=stop)
            ar = tiny_decoder.generate(ids, req)
            for method, st in stats.items():
                ly = tiny_decoder.generate(ids, req, method=method, budget=None)
                assert (ly.tokens, ly.text, ly.finish_reason) == (ar.tokens, ar.text, ar.finish_reason)
                st.update(rounds=ly.extra["rounds"], passes=ly.extra["draft_passes"], accepted=ly.accepted_draft_tokens,
                          recovered=ly.extra["recovered_tokens"])
    for method, st in stats.items():
        assert st["accepted"] > 0, method
    for method in ("lyanna", "lyanna-noresample"):  # a fresh chain every round: catch-up, then one pass per extra depth
        assert stats[method]["rounds"] <= stats[method]["passes"] <= depth * stats[method]["rounds"]
    assert stats["lyanna-noresample"]["recovered"] == 0
    assert stats["lyanna"]["recovered"] > 0 and stats["lyanna-nofusion"]["recovered"] > 0
    per_round = {m: st["passes"] / st["rounds"] for m, st in stats.items()}
    assert per_round["lyanna-nofusion"] < per_round["lyanna-noresample"]  # rounds that re-sample draft nothing


@pytest.mark.slow
def test_lyanna_greedy_equals_ar_on_default_model(tmp_path, default_decoder):
    """A head fitted for a few steps on the default model (hot draft vocabulary of 4096 tokens)."""
    d = default_decoder
    engine = d.engine
    tap = engine.config.num_layers
    prompts = ["What is the capital of France?", "Write a short poem about rain."]
    seqs = []
    for p in prompts:
        ids = d.encode(p)
        seqs.append(ids + d.generate(ids, GenerationRequest(max_new_tokens=40)).tokens)
    counts = np.bincount(np.concatenate(seqs), minlength=engine.config.vocab_size)
    d2t = np.argsort(-counts, kind="stable")[:4096]
    head = init_lyanna_head(engine, d.target.weights, d2t, rank=16)
    examples = target_features(engine, seqs, tap)
    fit(head, examples, steps=4, depth=3, lr=1e-4)
    save_head(tmp_path / "ly", "lyanna", export(head, d2t[:512]), d.target, tap)
    with draft_loaded(d, tmp_path / "ly"):
        for p in prompts + ["Explain photosynthesis in two sentences."]:
            ids = d.encode(p)
            req = GenerationRequest(max_new_tokens=40)
            ar = d.generate(ids, req).tokens
            for m in ("lyanna", "lyanna-nofusion", "lyanna+suffix"):
                assert d.generate(ids, req, method=m).tokens == ar
