"""The device engine (our own torch forward, static KV cache): the numpy engine's numbers, a
compaction that leaves the cache a fresh causal run would, greedy outputs equal to ``ar`` and to
the numpy engine's, and sampled outputs with the target's joint distribution. Run on CPU torch,
so CI covers the path a GPU takes; ``LYANNA_TEST_DEVICE=cuda`` runs the same tests on a GPU
(``scripts/gpu-bench.sh``), and ``LYANNA_TEST_GRAPHS=replayed`` on the CPU with every fixed-shape
call replayed as a CUDA graph is (``_ReplayedGraph``)."""
from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

from lyanna.decoding import verify as verify_module
from lyanna.decoding.verify import Verdict
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.decoding.sampling import SamplingParams
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.drafters.tree import DraftTree
from lyanna.drafters.base import DeviceDrafter
from lyanna.drafters.checkpoint import save_head
from lyanna.drafters.device import DeviceChainHead, DeviceDraftHead
from lyanna.drafters.lyanna import ChainHead, LyannaDrafter, TokenInfo, token_info_tree
from lyanna.engines.base import Block
from lyanna.engines.device import DeviceEngine, FixedShapeCall
from lyanna.engines.loading import load_target
from lyanna.engines.quant import quantize_q8_0
from lyanna.engines.transformer import Transformer
from lyanna.errors import LyannaError
from lyanna.training.fit import init_eagle_head, init_lyanna_head

from .conftest import ALPHA, chi2_pvalue, make_tiny_model, no_residual, stir_upper_layers
from .test_speculative import SAMPLING_GRID, PeekingDrafter, exact_joint, sample_outputs, small_vocab_target
from .test_torch_backend import LAYOUTS

DEVICE = os.environ.get("LYANNA_TEST_DEVICE", "cpu")
TREE = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)


@pytest.fixture(scope="module", params=LAYOUTS, ids=[a for a, _ in LAYOUTS])
def tiny(request, tmp_path_factory):
    arch, overrides = request.param
    return load_target(make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides))


def _blocks(engine, top):
    """Prefill with taps, a tree block with picked logit rows (at its own shape), compaction to a
    path, a step past a Mistral window, a tree of 3 rows with every logit row (padded to 4 on
    the device), compaction to its root."""
    cache = engine.new_cache(128)
    pre = engine.forward(np.arange(3, 40), np.arange(37), cache, logit_rows=[-1], taps=(0, 1, top))
    tree = engine.forward([7, 8, 9, 10], [37, 38, 38, 39], cache, block_mask=TREE, logit_rows=[1, 3], taps=(top,))
    cache.compact(37, [0, 2, 3])
    step = engine.forward([11], [40], cache, taps=(1,))
    small = engine.forward([12, 13, 14], [41, 42, 42], cache, block_mask=TREE[:3, :3], taps=(0, top))
    cache.compact(41, [0])
    return [pre, tree, step, small], cache.length


def test_device_blocks_match_the_numpy_engine(tiny):
    top = tiny.config.num_layers
    (mine, n_mine), (ref, n_ref) = _blocks(DeviceEngine(tiny.config, tiny.weights, DEVICE), top), _blocks(
        Transformer(tiny.config, tiny.weights), top)
    assert n_mine == n_ref == 42
    for a, b in zip(mine, ref):
        assert a.logits.shape == b.logits.shape and a.hidden.keys() == b.hidden.keys()
        np.testing.assert_allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        for tap in a.hidden:
            np.testing.assert_allclose(a.hidden[tap], b.hidden[tap], rtol=1e-4, atol=1e-4)


def test_compaction_leaves_the_cache_of_a_fresh_causal_run(tiny):
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    cache = e.new_cache(64)
    e.forward(np.arange(5, 25), np.arange(20), cache)
    e.forward([30, 31, 32, 33], [20, 21, 21, 22], cache, block_mask=TREE)
    cache.compact(20, [0, 2, 3])
    fresh = e.new_cache(64)
    e.forward(list(range(5, 25)) + [30, 32, 33], np.arange(23), fresh)
    assert cache.length == fresh.length == 23
    torch.testing.assert_close(cache.k[:, :, :23], fresh.k[:, :, :23], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :23], fresh.v[:, :, :23], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        cache.compact(5, [0, 0])
    with pytest.raises(ValueError, match="capacity"):
        e.forward(np.arange(50), np.arange(23, 73), cache)


def test_a_tree_left_on_the_device_verifies_like_the_host_block_of_it(tiny):
    """A block whose tree the drafter left on the device (``DeviceTree``: tokens, positions and
    the ancestor mask formed there) gives the host-built block's logits and taps for the root and
    every node, and the tree itself back; padding nodes past the count are left out and dropped
    by compaction, which leaves the cache the host block leaves. Trees up to 5 deep, past a
    Mistral window."""
    from lyanna.decoding.loop import _block
    from lyanna.drafters import device_tree
    from lyanna.engines.device import DeviceTree

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    top = tiny.config.num_layers
    rng = np.random.default_rng(3)
    for trial in range(6):
        n, pad = 3 + 3 * trial, trial % 3  # nodes, and padding after them
        parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
        tree = DraftTree(rng.integers(0, tiny.config.vocab_size, n), parents, rng.random(n), origin=rng.integers(0, 2, n))
        depth = int(tree.depths.max())
        prompt = rng.integers(0, tiny.config.vocab_size, 20 + 7 * trial)
        caches = [e.new_cache(128), e.new_cache(128)]
        for c in caches:
            e.forward(prompt, np.arange(len(prompt)), c)
        start, root = len(prompt), int(rng.integers(tiny.config.vocab_size))
        tokens, positions, mask = _block(tree, root, start)
        on_host = e.forward_batch([Block(tokens, positions, caches[0], mask, taps=(1, top))])[0]
        padded = device_tree.PaddedTrees(*(torch.as_tensor(np.concatenate([a, a[:pad]]))[None] for a in (
            tree.tokens, tree.parents, tree.scores, tree.depths, tree.origin.astype(np.int64))),
            count=torch.tensor([[n]]))
        on_device = e.forward_batch([Block([root], [start], caches[1], taps=(1, top),
                                          tree=DeviceTree(device_tree.packed(padded).to(DEVICE), n + pad, depth))])[0]
        got = DraftTree.from_packed(on_device.tree)
        np.testing.assert_array_equal(got.tokens, tree.tokens)
        np.testing.assert_array_equal(got.parents, tree.parents)
        assert on_device.logits.shape == on_host.logits.shape == (n + 1, tiny.config.vocab_size)
        np.testing.assert_allclose(np.asarray(on_device.logits), np.asarray(on_host.logits), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(on_device.logits.argmax(), on_host.logits.argmax())
        for tap in (1, top):
            np.testing.assert_allclose(on_device.hidden[tap], on_host.hidden[tap], rtol=1e-4, atol=1e-4)
        keep = [0] + [1 + i for i in tree.path_to(n - 1)]
        for c in caches:
            c.compact(start, keep)
        assert caches[0].length == caches[1].length == start + len(keep)
        torch.testing.assert_close(caches[1].slab.kv[..., : caches[1].length, :], caches[0].slab.kv[..., : caches[0].length, :],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="root alone"):
        e.forward_batch([Block([1, 2], [start, start + 1], caches[1], tree=DeviceTree(padded, n + pad, depth))])
    with pytest.raises(ValueError, match="runs on a device engine"):
        Transformer(tiny.config, tiny.weights).forward_batch([Block([1], [0], caches[1], tree=DeviceTree(padded, 1, 1))])


def _sequential(tree: DraftTree, probs: np.ndarray, uniforms: np.ndarray) -> tuple[list[int], int]:
    """``verify``'s sampling rule for deterministic children, written out with a given uniform
    for each node (the host's generator draws them as it goes) and one for the bonus token."""
    kids, node, path = tree.children(), -1, []
    while True:
        p = probs[node + 1].copy()
        for c in kids.get(node, []):
            x = tree.tokens[c]
            if p[x] > 0 and uniforms[c] < p[x]:
                path.append(c)
                node = c
                break
            if p[x] > 0:
                p[x] = 0.0
                p /= p.sum()
        else:
            cdf = np.cumsum(p)
            return path, int(min(np.searchsorted(cdf, uniforms[-1] * cdf[-1], side="right"), p.size - 1))


def test_a_tree_on_the_device_is_verified_and_compacted_there_as_the_host_does(tiny):
    """A block whose tree is on the device comes back verified (``ForwardOutput.kept``, ``bonus``):
    greedy, the host verifier's path and bonus on the same logits; sampling (with top-k and
    top-p), the sampling rule's with the same uniforms on the host's target distribution; the
    cache compacted to root + path as the host's compaction leaves it, the taps of the kept rows
    alone. Trees whose paths the target accepts to various depths (each chosen node's token set
    to its parent's argmax, a level at a time), with padding; a block without its verification
    leaves both to the host."""
    from lyanna.decoding.loop import _block
    from lyanna.decoding.sampling import target_probs
    from lyanna.decoding.verify import followed, verify
    from lyanna.drafters import device_tree
    from lyanna.engines.base import Verification
    from lyanna.engines.device import DeviceTree, pow2_at_least

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    top, vocab = tiny.config.num_layers, tiny.config.vocab_size
    rng = np.random.default_rng(5)
    lengths: dict[bool, list[int]] = {False: [], True: []}
    for trial in range(10):
        n, pad = 4 + 3 * trial, trial % 3
        parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
        tokens = rng.permutation(vocab)[:n]  # distinct, so siblings stay distinct
        prompt = rng.integers(0, vocab, 20 + 5 * trial)
        start, root = len(prompt), int(rng.integers(vocab))

        def host_pass(tree: DraftTree, taps=()):
            cache = e.new_cache(128)
            e.forward(prompt, np.arange(start), cache)
            t, pos, mask = _block(tree, root, start)
            return e.forward_batch([Block(t, pos, cache, mask, taps=taps)])[0], cache

        depths = DraftTree(tokens, parents).depths
        for d in range(1, depths.max() + 1):  # most children at depth d: their parent's row's likeliest tokens
            logits = np.asarray(host_pass(DraftTree(tokens, parents))[0].logits)
            for parent in np.unique(parents[depths == d]):
                if rng.random() < 0.8:
                    kids = np.flatnonzero(parents == parent)
                    tokens[kids] = rng.permutation(np.argsort(-logits[parent + 1], kind="stable")[: kids.size])
        tree = DraftTree(tokens, parents, rng.random(n))
        on_host, _ = host_pass(tree, taps=(1, top))
        padded = device_tree.PaddedTrees(*(torch.as_tensor(np.concatenate([a, a[:pad]]))[None] for a in (
            tree.tokens, tree.parents, tree.scores, tree.depths, tree.origin.astype(np.int64))), count=torch.tensor([[n]]))
        on_tree = DeviceTree(device_tree.packed(padded).to(DEVICE), n + pad, int(tree.depths.max()))
        # greedy; sampling at a low temperature (long paths) and with both filters; the host's
        sampled = SamplingParams(temperature=(0.05, 0.8)[trial % 2], top_p=(1.0, 0.9)[trial % 2], top_k=(0, 5)[trial % 2])
        for rule in (Verification(0.0), Verification(sampled.temperature, sampled.top_p, sampled.top_k,
                                                         rng.random(n + pad + 1)), None):
            if rule is None or rule.temperature == 0:
                expected = verify(tree, np.asarray(on_host.logits), SamplingParams(), rng)
            else:
                path, bonus = _sequential(tree, target_probs(np.asarray(on_host.logits), sampled), rule.uniforms)
                expected = Verdict(path, [int(tree.tokens[i]) for i in path] + [bonus])
            keep = [0] + [1 + i for i in expected.path]
            host_cache = host_pass(tree)[1]
            host_cache.compact(start, keep)
            cache = e.new_cache(128)
            e.forward(prompt, np.arange(start), cache)
            out = e.forward_batch([Block([root], [start], cache, taps=(1, top), tree=on_tree, verification=rule)])[0]
            if rule is None:  # the host's to do
                assert out.kept is None and cache.length == start + pow2_at_least(n + pad + 1)
                cache.compact(start, keep)
            else:
                assert out.kept.tolist() == keep
                assert followed(DraftTree.from_packed(out.tree), out.kept, out.bonus) == expected
                for tap in (1, top):  # left on the device, for the drafter's next call
                    assert isinstance(out.hidden[tap], torch.Tensor) and out.hidden[tap].device == e.device
                    np.testing.assert_allclose(out.hidden[tap].float().cpu(), on_host.hidden[tap][keep], rtol=1e-4, atol=1e-4)
                lengths[rule.temperature > 0].append(len(expected.path))
            assert cache.length == host_cache.length == start + len(keep)
            torch.testing.assert_close(cache.slab.kv[..., : cache.length, :], host_cache.slab.kv[..., : cache.length, :],
                                       rtol=1e-5, atol=1e-5)
    for tried in lengths.values():  # short and long paths both tried, greedy and sampling
        assert min(tried) <= 1 and max(tried) >= 3, lengths


def test_pooled_caches_serve_later_generations_with_the_same_passes(tiny):
    """A dropped cache goes back to the pool: the next generation gets it, stale rows from the
    last one stay invisible (the same tokens), and no new fixed-shape pass (graph) is built."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    d = Decoder(tiny, engine=e, default_drafts=False)
    req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
    first = d.generate([1, 40, 41, 42, 40, 41, 42], req, method="suffix", budget=None)
    passes = len(e._passes)
    assert passes > 0 and all(p.logits is not None for p in e._passes.values())
    d.generate(list(range(3, 50)), req)  # leaves other rows in the pooled cache
    again = d.generate([1, 40, 41, 42, 40, 41, 42], req, method="suffix", budget=None)
    assert again.tokens == first.tokens
    assert len(e._passes) == passes
    assert e.pool.idle == 1  # one slab served all three


def test_a_blocks_kind_is_read_once_from_its_fields_and_host_engines_refuse_device_kinds(tiny):
    """``Block.kind`` names what the loop sends (rows, a prefill, a tree left on the device, a
    pass that verifies, one that follows a pending pass); an engine without a device refuses the
    last three with one clear error; ``ForwardOutput.verified`` says who verified."""
    from lyanna.engines.base import BlockKind, ForwardOutput, Verification
    from lyanna.engines.device import DeviceTree

    cache = Transformer(tiny.config, tiny.weights).new_cache(32)
    tree = DeviceTree(torch.zeros(6), 1, 1)
    kinds = {BlockKind.ROWS: Block([1], [0], cache), BlockKind.PREFILL: Block([1, 2], [0, 1], cache, prefill=True),
             BlockKind.DEVICE_TREE: Block([1], [0], cache, tree=tree),
             BlockKind.VERIFIED: Block([1], [0], cache, verification=Verification(0.0)),
             BlockKind.FOLLOWS: Block((), (), cache, tree=tree, verification=Verification(0.0), follows=object())}
    engine = Transformer(tiny.config, tiny.weights)
    for kind, block in kinds.items():
        assert block.kind is kind
        if kind in (BlockKind.DEVICE_TREE, BlockKind.VERIFIED, BlockKind.FOLLOWS):
            with pytest.raises(ValueError, match="runs on a device engine"):
                engine.forward_batch([block])
    assert ForwardOutput(np.zeros((1, 2)), kept=np.array([0]), bonus=1).verified
    assert not ForwardOutput(np.zeros((1, 2))).verified


def test_logits_left_on_the_device_read_like_host_logits():
    """Rows on demand, all rows through numpy, and numpy's argmax (ties: the first maximum)."""
    from lyanna.engines.device import _Logits

    host = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [-1.0, -5.0, -1.0]], np.float32)
    lazy = _Logits(torch.from_numpy(host).to(DEVICE))
    assert lazy.shape == host.shape
    np.testing.assert_array_equal(lazy[1], host[1])
    np.testing.assert_array_equal(np.asarray(lazy), host)
    np.testing.assert_array_equal(lazy.argmax(), host.argmax(-1))


def test_cuda_graphs_give_the_same_tokens(tiny):
    """Captured and replayed, or run eagerly: the same greedy tokens for drafters whose trees
    vary in size (so several row buckets are captured), host drafters' and device heads' (their
    draft calls and tree passes captured too), and the same sampled tokens for a seed (the pass
    verifying by sampling)."""
    if not DEVICE.startswith("cuda"):
        with pytest.raises(LyannaError, match="CUDA"):
            DeviceEngine(tiny.config, tiny.weights, DEVICE, graphs=True)
        pytest.skip("CUDA graphs need a CUDA device (LYANNA_TEST_DEVICE=cuda)")
    outs = []
    for graphs in (False, True):
        e = DeviceEngine(tiny.config, tiny.weights, DEVICE, graphs=graphs)
        d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
        req = GenerationRequest(max_new_tokens=32, eos_token_ids=())
        sampled = GenerationRequest(max_new_tokens=32, eos_token_ids=(), sampling=SamplingParams(0.8, top_p=0.95, seed=3))
        outs.append([d.generate(p, r, method=m, budget=None).tokens
                     for m, r in (("ar", req), ("peek", req), ("lyanna", req), ("lyanna-device", req), ("eagle-device", req),
                                  ("lyanna-device", sampled), ("peek-device", sampled))
                     for p in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 60)))])
        # A pass that only ran inside a round's joined call (``_run_pass``) has no graph of its own.
        calls = [c for c in (*e._passes.values(), *e._tree_passes.values(), *e._joined.values()) if c._ran]
        assert len(e._tree_passes) >= 2 and calls and all(c.graph is not None for c in calls) == graphs
    assert outs[0] == outs[1]


@pytest.fixture(autouse=True)
def _replayed_graphs_everywhere(monkeypatch):
    """``LYANNA_TEST_GRAPHS=replayed``: every engine these tests make on the CPU replays its calls
    as CUDA graphs do (``_graphs_here``), so the whole file checks graph semantics without a GPU."""
    if os.environ.get("LYANNA_TEST_GRAPHS") != "replayed" or DEVICE.startswith("cuda"):
        return
    init = DeviceEngine.__init__

    def replaying(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if kwargs.get("graphs") is not False:
            _graphs_here(self, monkeypatch)
    monkeypatch.setattr(DeviceEngine, "__init__", replaying)


class _ReplayedGraph:
    """A CUDA graph as the CPU can have one: a replay writes into the outputs its capture made
    (``FixedShapeCall._outputs``) and leaves the call's attributes where they point now, which
    another capture of the same ``_forward`` (a round's ``JoinedCall``) may have moved."""

    def __init__(self, call: FixedShapeCall):
        self.call = call

    def replay(self) -> None:
        now = [getattr(c, name) for c, name, _ in self.call._outputs]
        self.call._forward()
        for (c, name, made), was in zip(self.call._outputs, now):
            _write(made, getattr(c, name))
            setattr(c, name, was)


def _write(into, value) -> None:
    if isinstance(into, torch.Tensor):
        into.copy_(value)
    elif isinstance(into, dict):
        for k in into:
            _write(into[k], value[k])
    elif isinstance(into, (tuple, list)):
        for a, b in zip(into, value):
            _write(a, b)


def _graphs_here(engine: DeviceEngine, monkeypatch) -> None:
    """``engine``'s fixed-shape calls captured and replayed: on CUDA its own graphs, on the CPU
    ``_ReplayedGraph``s (the warm-up and the capture each run ``_forward`` once, as CUDA's do)."""
    if DEVICE.startswith("cuda"):
        return
    engine._graph_pool, engine.shapes_compile = "emulated", True
    monkeypatch.setattr(FixedShapeCall, "_record", lambda call: call._forward() or call._forward() or _ReplayedGraph(call))


@pytest.mark.parametrize("method", ["eagle-device", "lyanna-device"])
def test_calls_that_run_alone_and_joined_replay_into_their_own_outputs(tiny, method, monkeypatch):
    """A draft call or a verifying pass captured alone and again inside a round's joined call
    reads, after each replay, what that replay wrote: its attributes point back at the outputs
    of the graph that ran. (On an H200 an ``auto`` budget's rounds, some joined and some alone,
    gave tokens no pass had chosen.)"""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True)
    _graphs_here(e, monkeypatch)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    from lyanna.decoding.budget import LatencyCurve
    d._curve = LatencyCurve((1, 2, 4, 8, 16), (0.01, 0.011, 0.013, 0.017, 0.5), "test-model", "test machine", 256)
    req = GenerationRequest(max_new_tokens=32, eos_token_ids=())
    prompt = list(range(3, 60))
    ar = d.generate(prompt, req)
    for budget in (None, 4, 1, 0, "auto"):
        assert d.generate(prompt, req, method=method, budget=budget, fallback=False).tokens == ar.tokens, budget
    joined = [c for c in e._joined.values() if c._ran]
    alone = {id(c) for c in (*e._passes.values(), *e._tree_passes.values()) if c._ran and c.graph is not None}
    assert joined and any(id(c.then) in alone for c in joined)


@pytest.mark.parametrize("ahead", [False, True])
def test_where_rounds_launch_ahead_the_default_method_is_lyanna(tiny, ahead):
    """lyanna+suffix's trees come to the host for the suffix matches a round at a time; where
    rounds launch ahead (CUDA's default) the device head's own method comes first."""
    from lyanna.drafters.suffix import SuffixDrafter

    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead),
                            default_drafts=False), tiny)
    d.add_drafter("lyanna+suffix", SuffixDrafter())
    assert d.default_method == ("lyanna" if ahead else "lyanna+suffix")
    d.add_drafter("suffix", SuffixDrafter())
    assert d.default_method == ("lyanna" if ahead else "lyanna+suffix")
    del d.drafters["lyanna"]
    assert d.default_method == ("suffix" if ahead else "lyanna+suffix")


def test_gguf_blocks_load_dequantized_and_bad_settings_are_refused(tiny):
    weights = {k: quantize_q8_0(w) if w.ndim == 2 and ".layers." in k else w for k, w in tiny.weights.items()}
    e = DeviceEngine(tiny.config, weights, DEVICE)
    np.testing.assert_array_equal(e.layers[0].views()["mlp.up_proj.weight"].cpu().numpy(),
                                  weights["model.layers.0.mlp.up_proj.weight"].dense())
    with pytest.raises(LyannaError, match="dtype"):
        DeviceEngine(tiny.config, tiny.weights, DEVICE, "float64")
    with pytest.raises(LyannaError, match="missing"):
        DeviceEngine(tiny.config, {k: w for k, w in tiny.weights.items() if "layers.1." not in k}, DEVICE)
    assert DeviceEngine(tiny.config, tiny.weights, DEVICE, "bfloat16").name == f"device-{torch.device(DEVICE).type}-bfloat16"


class DevicePeekingDrafter(PeekingDrafter, DeviceDrafter):
    """``PeekingDrafter``'s trees (the target's own likeliest tokens: most nodes accepted, the
    rest with much of the mass) left on the device, as a device head leaves its trees: they are
    verified in the target's pass."""

    def propose_sized(self, context, max_depth, nodes):
        from lyanna.drafters import device_tree
        from lyanna.engines.device import DeviceTree

        tree = self.propose(context, max_depth).prune_depth(max_depth)
        if not len(tree) or nodes is not None:
            return tree
        padded = device_tree.PaddedTrees(*(torch.tensor(a)[None] for a in (
            tree.tokens, tree.parents, tree.scores, tree.depths, tree.origin.astype(np.int64))),
            count=torch.tensor([[len(tree)]]))
        return DeviceTree(device_tree.packed(padded).to(DEVICE), len(tree), int(tree.depths.max()))


def _eager_beside(tiny, **engine):
    """Decoders with ``_with_heads``' heads on an eager device engine and on one made with
    ``engine``'s options, Dynamo's caches and counters cleared first (tests of compiled layers)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return tuple(_with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, **options),
                                     default_drafts=False), tiny) for options in ({"compiled": False}, engine))


def _with_heads(decoder, target):
    """An unfitted EAGLE head and a Lyanna head with random token information at the final-norm
    tap (layer 2 of these two-layer models): varied trees, some nodes accepted, most rejected."""
    eagle = init_eagle_head(decoder.engine, target.weights)
    decoder.add_drafter("eagle", EagleDrafter(DraftHead(decoder.engine, eagle.numpy_weights()), tap=2, depth=3,
                                              topk=2, width=2))
    vocab = target.config.vocab_size
    torch.manual_seed(0)
    ly = init_lyanna_head(decoder.engine, target.weights, np.arange(vocab)[::-1].copy(), rank=4)
    with torch.no_grad():
        ly.ti.b.normal_(0, 1.0)
    w = {**ly.numpy_weights(), "ti.hot": np.arange(0, vocab, 2)}
    ti = TokenInfo(w["ti.a"], w["ti.b"], w["ti.hot"])
    decoder.add_drafter("lyanna", LyannaDrafter(ChainHead(decoder.engine, w), ti, taps=(2,), depth=3, topk=2, width=2))
    if isinstance(decoder.engine, DeviceEngine):  # the same heads on the device (lyanna's chain and trees too)
        decoder.add_drafter("eagle-device", EagleDrafter(DeviceDraftHead(decoder.engine, eagle.numpy_weights()), tap=2,
                                                         depth=3, topk=2, width=2))
        for name, suffix in (("lyanna-device", False), ("lyanna-device+suffix", True)):
            decoder.add_drafter(name, LyannaDrafter(DeviceChainHead(decoder.engine, w), ti, taps=(2,), depth=3, topk=2, width=2,
                                                    suffix=suffix))
    decoder.add_drafter("peek", PeekingDrafter(decoder.engine))
    if isinstance(decoder.engine, DeviceEngine):
        decoder.add_drafter("peek-device", DevicePeekingDrafter(decoder.engine))
    return decoder


@pytest.mark.parametrize("ahead", [False, True], ids=["read", "ahead"])
@pytest.mark.parametrize("method", ["suffix", "eagle", "eagle-device", "lyanna", "lyanna-device", "lyanna-device+suffix",
                                    "peek", "peek-device"])
def test_greedy_on_the_device_equals_ar_there_and_the_numpy_engine(tiny, method, ahead):
    """Every method's greedy tokens are the device ``ar``'s, which are the numpy engine's; ``peek``
    makes sure accepted and rejected nodes both go through the static cache's compaction. With
    rounds launched ahead of the host's reading too (``pipelines``, CUDA's default), so the
    pipelined driver's paths run here as on a GPU."""
    engine = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead)
    device = _with_heads(Decoder(tiny, engine=engine, default_drafts=False), tiny)
    numpy_ar = Decoder(tiny, default_drafts=False)
    tried = accepted = 0
    for prompt in ([1, 40, 41, 42, 40, 41, 42], [1, 100, 101], list(range(3, 60))):
        req = GenerationRequest(max_new_tokens=32, eos_token_ids=())
        ar = device.generate(prompt, req)
        assert ar.tokens == numpy_ar.generate(prompt, req).tokens
        got = device.generate(prompt, req, method=method, budget=None)
        assert got.tokens == ar.tokens, (method, prompt)
        tried, accepted = tried + got.draft_tokens, accepted + got.accepted_draft_tokens
    if method in ("lyanna", "lyanna-device", "peek", "peek-device"):
        assert tried > accepted
    if method in ("peek", "peek-device"):
        assert accepted > 0


@pytest.mark.parametrize("method", ["eagle-device", "lyanna-device"])
def test_trees_sized_before_drafting_stay_on_the_device_under_every_budget(tiny, method, monkeypatch):
    """With the tree's size fixed before drafting (none: the drafter's cut; a fixed budget;
    ``auto``: from what it kept of the last tree) a device head's tree reaches the pass on the
    device (``_TreeBlockPass``), never as a host-built tree block (but ``auto``'s first tree and
    free trees while drafting waits), and verifies to ``ar``'s tokens; budget 0 drafts trees the
    host cuts to nothing (no tree block at all)."""
    from lyanna.decoding.budget import LatencyCurve
    from lyanna.engines import device as device_module

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    d._curve = LatencyCurve((1, 2, 4, 8, 16), (0.01, 0.011, 0.013, 0.017, 0.5), "test-model", "test machine", 256)
    blocks: list[tuple[str, int]] = []
    run_tree, run_static = device_module.DeviceEngine._run_tree, device_module.DeviceEngine._run_static
    monkeypatch.setattr(device_module.DeviceEngine, "_run_tree",
                        lambda self, b, *a: blocks.append(("device", b.tree.nodes) if b.tree is not None else ("plain", 1))
                        or run_tree(self, b, *a))  # a plain step launched ahead (CUDA's default) has no tree
    monkeypatch.setattr(device_module.DeviceEngine, "_run_static",
                        lambda self, b, t, *a: blocks.append(("host", len(t))) or run_static(self, b, t, *a))
    req = GenerationRequest(max_new_tokens=32, eos_token_ids=())
    prompt = list(range(3, 60))
    ar = d.generate(prompt, req)
    for budget in (None, 4, 1, 0, "auto"):
        blocks.clear()
        got = d.generate(prompt, req, method=method, budget=budget, fallback=False)
        assert got.tokens == ar.tokens, budget
        on_device = {n for kind, n in blocks if kind == "device"}
        on_host = [n for kind, n in blocks if kind == "host" and n > 1]  # trees that crossed before their pass
        if budget == "auto":  # the first tree is seen (its size unknown yet), and free trees while drafting waits
            assert on_device and (method == "lyanna-device" or len(on_host) <= 1)
            continue
        assert not on_host, budget
        if budget == 0:
            assert not on_device and got.draft_tokens == 0
        elif budget is None:
            assert on_device
        else:
            assert max(on_device) == budget


def test_first_runs_count_each_fixed_shape_once(tiny):
    """A fixed-shape call counts its first run (a compile and a capture where shapes compile),
    once: a second generation over the same shapes, on the pool's same cache, counts none. An
    engine where no shape compiles reports none at all."""
    req = GenerationRequest(max_new_tokens=12, eos_token_ids=())
    prompt = list(range(3, 40))
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    if not e.shapes_compile:
        Decoder(tiny, engine=e, default_drafts=False).generate(prompt, req)
        assert e.first_runs == 0
        e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
        e.shapes_compile = True
    d = Decoder(tiny, engine=e, default_drafts=False)
    before = e.first_runs
    first = d.generate(prompt, req)
    met = e.first_runs
    assert met > before
    assert d.generate(prompt, req).tokens == first.tokens and e.first_runs == met


@pytest.mark.parametrize("ahead", [False, True])
def test_a_device_trees_draft_time_counts_as_drafting_not_verification(tiny, ahead, monkeypatch):
    """The pass that reads a tree left on the device also waits for the draft call's device
    time (on a GPU the host launches the draft and goes on): the loop moves that time from the
    pass to drafting, in the stats and for the budget. On CPU torch the call runs synchronously
    (no device time to move); a draft taking longer than any pass moves the whole pass. Rounds
    launched ahead (``DeviceEngine.pipelines``) take each call's own device time instead: the
    pass keeps its time, drafting gets the draft's."""
    from lyanna.decoding.budget import Budget
    from lyanna.engines import device as device_module

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
    prompt = list(range(3, 60))
    # Warm: on a GPU each shape's first call compiles and captures, and a draft call that long
    # moves its whole pass to drafting (the rule checked with a slow draft below).
    d.generate(prompt, req, method="lyanna-device", budget=4, fallback=False)
    observed: list[float] = []
    observe = Budget.observe
    monkeypatch.setattr(Budget, "observe", lambda self, tree, accepted, seconds=None, overhead=None:
                        observed.append(seconds) or observe(self, tree, accepted, seconds, overhead))
    device_seconds = device_module.DeviceTree.device_seconds
    timed: list[tuple[bool, float]] = []  # (the draft call ran alone, its device seconds)
    monkeypatch.setattr(device_module.DeviceTree, "device_seconds", lambda self: timed.append(
        (self.deferred is None, device_seconds(self))) or timed[-1][1])
    real = d.generate(prompt, req, method="lyanna-device", budget=4, fallback=False)
    # A draft call deferred into its round's joined call has no device time apart from the pass's.
    assert timed and all((s > 0) == (alone and DEVICE.startswith("cuda")) for alone, s in timed)
    assert ahead == any(not alone for alone, _ in timed)
    # The first drafted round catches the head up on the prompt: its times are not the budget's (None).
    assert observed.count(None) == 1 and min(s for s in observed if s is not None) > 0
    observed.clear()
    drafted: list[float] = []
    monkeypatch.setattr(device_module.DeviceTree, "device_seconds", lambda self: drafted.append(1e6) or 1e6)
    slow = d.generate(prompt, req, method="lyanna-device", budget=4, fallback=False)
    assert slow.tokens == real.tokens
    if ahead:
        assert min(s for s in observed if s is not None) > 0 and len(drafted) > len(observed) // 2
    else:  # (the last rounds, with no room to draft, verify no tree)
        assert observed.count(0.0) + observed.count(None) == len(drafted) > len(observed) // 2
    assert slow.extra["draft_seconds"] > slow.extra["verify_seconds"]


@pytest.mark.parametrize("method,ahead", [("eagle-device", False), ("lyanna-device", False), ("ar", True),
                                          ("eagle-device", True), ("lyanna-device", True)])
def test_trees_left_on_the_device_serve_a_batch(tiny, method, ahead, monkeypatch):
    """Continuous batching (what the server runs) with device heads: every sequence's tree reaches
    its pass on the device and each result is the prompt's ``ar`` output alone; rounds launched
    ahead of the host's reading too (``ar``'s plain steps among them), each sequence's following
    its own last pass while the others' run."""
    from lyanna.engines import device as device_module

    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead),
                            default_drafts=False), tiny)
    trees, follows = [], []
    run_tree = device_module.DeviceEngine._run_tree
    monkeypatch.setattr(device_module.DeviceEngine, "_run_tree", lambda self, b, *a: trees.append(id(b.cache)) or
                        follows.append(b.follows is not None) or run_tree(self, b, *a))
    prompts = [[1, 40, 41, 42, 40, 41, 42], [1, 100, 101], list(range(3, 60)), list(range(5, 30))]
    req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
    alone = [Decoder(tiny, default_drafts=False).generate(p, req).tokens for p in prompts]
    for budget in (None, 4):
        trees.clear()
        follows.clear()
        out = d.generate_batch(prompts, req, method=method, max_batch=3, budget=budget)
        assert [o.tokens for o in out] == alone, budget
        assert len(set(trees)) >= 3 and (method == "ar" or sum(o.draft_tokens for o in out) > 0)
        assert (sum(follows) > len(follows) // 2) == ahead


def test_whole_compiled_layers_give_the_eager_tokens(tiny, method="lyanna-device"):
    """Each layer as one compiled function, its attention written out inside (``--compile whole``,
    ``torch_layers._whole_layer``): the eager greedy tokens, the target's and a device head's,
    over prefills, steps and verified trees; one graph a shape, none broken; its attention alone
    equals ``scaled_dot_product_attention`` under a tree mask with grouped key heads."""
    from torch._dynamo.utils import counters

    from lyanna.engines.torch_layers import _grouped_attention

    eager, whole = _eager_beside(tiny, whole_layers=True)
    assert whole.engine.halves.compiled and whole.engine.halves.whole is not None
    for prompt in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 40))):
        req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
        assert whole.generate(prompt, req, method=method, budget=None).tokens == \
            eager.generate(prompt, req, method=method, budget=None).tokens, (method, prompt)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(6, 4, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[:, 3:] = torch.from_numpy(np.tril(np.ones((4, 4), bool)) | np.eye(4, 4, -2, dtype=bool))
    want = torch.nn.functional.scaled_dot_product_attention(q[None], kv[0, None, :, :7], kv[1, None, :, :7],
                                                            attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(_grouped_attention(q, kv, mask, 7), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole"):
        from lyanna.engines.torch_layers import LayerHalves

        LayerHalves(compiled=False, whole=True)


@pytest.fixture(scope="module")
def device_small_decoder():
    target = small_vocab_target()
    return _with_heads(Decoder(target, engine=DeviceEngine(target.config, target.weights, DEVICE), default_drafts=False), target)


@pytest.mark.parametrize("method", ["ar", "eagle", "eagle-device", "lyanna", "lyanna-device", "peek", "peek-device"])
def test_device_sampled_output_has_the_target_joint_distribution(device_small_decoder, method):
    params, horizon = SAMPLING_GRID["t1"]
    s = sample_outputs(device_small_decoder, method, params, horizon, 600)
    if method != "ar":
        assert 0 < s.accepted < s.draft_tokens
    assert chi2_pvalue(s.counts, exact_joint(device_small_decoder.engine, params, horizon)) > ALPHA


def test_plain_steps_launched_ahead_sample_the_target_joint_distribution():
    """``ar``'s rounds launched ahead (each next token sampled in the pass, as a tree's bonus
    token is) keep the target's joint distribution."""
    target = small_vocab_target()
    decoder = Decoder(target, engine=DeviceEngine(target.config, target.weights, DEVICE, pipelines=True),
                      default_drafts=False)
    params, horizon = SAMPLING_GRID["t0.6-topk3"]
    s = sample_outputs(decoder, "ar", params, horizon, 600)
    assert chi2_pvalue(s.counts, exact_joint(decoder.engine, params, horizon)) > ALPHA


def test_device_path_fails_a_wrong_acceptance_rule(device_small_decoder, monkeypatch):
    """The control: the same statistic rejects a broken verifier on the device path, the host's
    (a tree that crosses) and the pass's (a device head's tree, verified where it is: the bonus
    token drawn without setting its rejected siblings to zero)."""
    from lyanna.engines import device_verify

    params, horizon = SAMPLING_GRID["t1"]
    joint = exact_joint(device_small_decoder.engine, params, horizon)
    with monkeypatch.context() as m:
        m.setattr(verify_module, "_deterministic_step", no_residual)
        assert chi2_pvalue(sample_outputs(device_small_decoder, "peek", params, horizon, 600).counts, joint) < ALPHA
    monkeypatch.setattr(device_verify, "residual", lambda row, tokens, rejected: row)
    assert chi2_pvalue(sample_outputs(device_small_decoder, "peek-device", params, horizon, 600).counts, joint) < ALPHA


def _lyanna_head(tiny, seed: int, varied: bool = False, layers: int = 1):
    """A device engine and an unfitted Lyanna head's weights for it (``varied``: token
    information random enough to change which children win; ``layers``: decoder layers, the
    further ones stirred so that they matter)."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    torch.manual_seed(seed)
    ly = init_lyanna_head(e, tiny.weights, np.arange(tiny.config.vocab_size)[::-1].copy(), rank=4, layers=layers)
    stir_upper_layers(ly, seed)
    if varied:
        with torch.no_grad():
            ly.ti.b.normal_(0, 1.0)
    return e, ly.numpy_weights()


def _candidates(rng: np.random.Generator, vocab: int, depth: int, topk: int, width: int, ties: int,
                joint: bool) -> tuple:
    """A token-info-like candidate list in depth order: each frontier node's ``topk`` distinct
    children, the ``width`` likeliest of a level expanded; probabilities rounded to ``ties``
    steps (0: none), so that many nodes tie; ``joint``: a child's score is its parent's times a
    step (never above it, as drafters' joint probabilities), else any (closed scores decide)."""
    tokens, parents, scores, depths, frontier = [], [], [], [], [-1]
    for d in range(1, depth + 1):
        level = []
        for f in frontier:
            for t in rng.choice(vocab, topk, replace=False):
                u = rng.random()
                scores.append((1.0 if f < 0 or not joint else scores[f]) * (np.round(u * ties) / ties if ties else u))
                tokens.append(t), parents.append(f), depths.append(d), level.append(len(tokens) - 1)
        frontier = sorted(level, key=lambda i: -scores[i])[:width]
    return tuple(np.asarray(a) for a in (tokens, parents, scores, depths))


def test_device_tree_choice_and_union_follow_the_host_rules():
    """``device_tree.best`` and ``union`` (the round's nodes chosen on the device) give
    ``DraftTree.best`` and ``merged``'s trees: the same nodes, parents, scores, origins and order,
    over random candidate lists with many tied scores (tie-breaks decide), trees cut shorter than
    their candidates and longer, and a second tree valid only to some depth (leftover rows);
    ``leveled`` (no sort by depth) changes nothing on candidates in depth order."""
    from lyanna.drafters import device_tree

    def t(a, dtype=None):
        return torch.as_tensor(np.asarray(a, dtype))[None].to(DEVICE)

    rng = np.random.default_rng(0)
    merged_any = 0
    for trial in range(300):
        depth, topk, width, vocab = 1 + trial % 5, 1 + trial % 4, 1 + trial // 3 % 4, 4 + trial % 7
        m, ties, levels = 1 + trial % 13, (0, 2, 4)[trial % 3], 1 + trial % (1 + trial % 5)
        ca, cb = (_candidates(rng, vocab, depth, topk, width, ties, joint=trial % 4 > 0) for _ in range(2))
        nb = int((cb[3] <= levels).sum())
        host_a = DraftTree(ca[0], ca[1], ca[2]).best(m)
        host_b = DraftTree(cb[0][:nb], cb[1][:nb], cb[2][:nb], origin=np.ones(nb)).best(m)
        want = host_a.merged(host_b, m)
        joint = trial % 4 > 0
        a = device_tree.best(t(ca[0]), t(ca[1]), t(ca[2], np.float64), t(ca[3]), t(np.zeros(len(ca[0]), np.int64)),
                             t(np.ones(len(ca[0]), bool)), m, depth, joint)
        b = device_tree.best(t(cb[0]), t(cb[1]), t(cb[2], np.float64), t(cb[3]), t(np.ones(len(cb[0]), np.int64)),
                             t(cb[3] <= levels), m, depth, joint)
        fused, valid = device_tree.union(a, b, depth)
        got = [DraftTree.from_packed(device_tree.packed(x).cpu().numpy())
               for x in (a, b, device_tree.best(*fused[:5], valid, m, depth, joint))]
        # Candidates in order of depth (as drafters grow them) need no sort by depth: the same trees.
        for x, c, o, v in ((a, ca, 0, np.ones(len(ca[0]), bool)), (b, cb, 1, cb[3] <= levels)):
            lev = device_tree.best(t(c[0]), t(c[1]), t(c[2], np.float64), t(c[3]), t(np.full(len(c[0]), o)), t(v),
                                   m, depth, joint, leveled=True)
            assert torch.equal(device_tree.packed(lev), device_tree.packed(x)), trial
        merged_any += len(host_a.merged(host_b, 10**6)) < len(host_a) + len(host_b)
        for g, w in zip(got, (host_a, host_b, want)):
            assert len(g) == len(w), trial
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(g.parents, w.parents)
            np.testing.assert_array_equal(g.origin, w.origin)
            np.testing.assert_array_equal(g.scores, w.scores)
    assert merged_any > 100  # most unions had nodes in both trees


def test_device_unions_of_several_pairs_at_once_equal_each_pair_alone():
    """``device_tree.union`` over a batch's pairs of trees at once (each sequence's fresh and
    re-sampled tree, ``HeadRows``) gives each pair's own union, row for row."""
    from lyanna.drafters import device_tree

    def t(a, dtype=None):
        return torch.as_tensor(np.asarray(a, dtype))[None].to(DEVICE)

    def cut(c, origin, levels, m, depth):
        return device_tree.best(t(c[0]), t(c[1]), t(c[2], np.float64), t(c[3]), t(np.full(len(c[0]), origin)),
                                t(c[3] <= levels), m, depth, joint=True, leveled=True)

    def stacked(trees):
        return device_tree.PaddedTrees(*(torch.cat(field) for field in zip(*trees)))

    rng = np.random.default_rng(1)
    for trial in range(30):
        depth, topk, width, vocab, m = 1 + trial % 4, 1 + trial % 3, 1 + trial % 2, 5 + trial % 4, 2 + trial % 9
        pairs = [(cut(_candidates(rng, vocab, depth, topk, width, 2, True), 0, depth, m, depth),
                  cut(_candidates(rng, vocab, depth, topk, width, 2, True), 1, i % (depth + 1), m, depth))
                 for i in range(3)]
        fused, valid = device_tree.union(stacked([a for a, _ in pairs]), stacked([b for _, b in pairs]), depth)
        for i, (a, b) in enumerate(pairs):
            one, one_valid = device_tree.union(a, b, depth)
            assert all(torch.equal(x, y[i : i + 1]) for x, y in zip(one, fused)), trial
            assert torch.equal(one_valid, valid[i : i + 1]), trial
            assert torch.equal(device_tree.packed(one), device_tree.packed_rows(fused)[i]), trial


@pytest.mark.parametrize("fallback", ["lowrank", "none"])
def test_device_trees_equal_the_host_trees_on_the_same_raw_rows(tiny, fallback):
    """Token-info trees built on the device (token information formed on the fly) are the host
    builder's trees (hot-row table, cold rows formed once) on the same raw rows: same nodes,
    parents and order, scores equal to rounding; fresh and re-sampled (``origin``)."""
    e, w = _lyanna_head(tiny, seed=1, varied=True)
    vocab = tiny.config.vocab_size
    head = DeviceChainHead(e, w)
    rng = np.random.default_rng(5)
    for trial in range(6):
        ti = TokenInfo(w["ti.a"], w["ti.b"], rng.choice(vocab, vocab // 3, replace=False), fallback)
        raw = (rng.standard_normal((1 + trial % 4, head.d2t.size)) * 2).astype(np.float32)
        root, topk, width, max_nodes, origin = int(rng.integers(vocab)), 1 + trial % 3, 1 + trial % 4, 5 + 3 * trial, trial % 2
        want = token_info_tree(raw, root, ti, head.d2t, topk, width, max_nodes, origin)
        got = head.tree(torch.from_numpy(raw).to(DEVICE), root, ti, topk, width, max_nodes, origin)
        assert len(got) == len(want) > 0
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.parents, want.parents)
        np.testing.assert_array_equal(got.origin, want.origin)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)


def test_a_head_reading_several_taps_decodes_losslessly_on_the_device_engine(tiny, tmp_path):
    """A Lyanna head on two taps (layer 1's input and the final norm's output, projected): the
    device engine returns both in its pass, the host projects them, and the method gives ``ar``'s tokens."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    vocab, h = tiny.config.vocab_size, tiny.config.hidden_size
    ly = init_lyanna_head(e, tiny.weights, np.arange(vocab)[::-1].copy(), rank=4, taps=2)
    w = ly.numpy_weights()
    w["taps_fc.weight"] = w["taps_fc.weight"] + np.random.default_rng(0).normal(0, 0.05, (h, 2 * h)).astype(np.float32)
    save_head(tmp_path / "lyanna", "lyanna", {**w, "ti.hot": np.arange(0, vocab, 2)}, tiny, (1, 2))
    d = Decoder(tiny, engine=e, default_drafts=False)
    d.load_draft(str(tmp_path / "lyanna"))
    assert d.drafter_for("lyanna").taps == (1, 2)
    req = GenerationRequest(max_new_tokens=16, eos_token_ids=())
    ar = d.generate([1, 40, 41, 42, 40, 41, 42], req)
    for method in ("lyanna", "lyanna+suffix"):
        assert d.generate([1, 40, 41, 42, 40, 41, 42], req, method=method, budget=None).tokens == ar.tokens


def test_two_layer_heads_decode_losslessly_on_the_device_engine(tiny, tmp_path):
    """Checkpoints of two-layer eagle and Lyanna heads load as device heads of two layers, and
    every method gives ``ar``'s tokens."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    vocab = tiny.config.vocab_size
    eagle = init_eagle_head(e, tiny.weights, layers=2)
    stir_upper_layers(eagle, 3)
    save_head(tmp_path / "eagle", "eagle", eagle.numpy_weights(), tiny, 2)
    ly = init_lyanna_head(e, tiny.weights, np.arange(vocab)[::-1].copy(), rank=4, layers=2)
    stir_upper_layers(ly, 4)
    save_head(tmp_path / "lyanna", "lyanna", {**ly.numpy_weights(), "ti.hot": np.arange(0, vocab, 2)}, tiny, 2)
    d = Decoder(tiny, engine=e, default_drafts=False)
    for arch in ("eagle", "lyanna"):
        d.load_draft(str(tmp_path / arch))
        assert len(d.drafter_for(arch).head.layers) == 2
    req = GenerationRequest(max_new_tokens=16, eos_token_ids=())
    for prompt in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 40))):  # the second's pairs are filled first
        ar = d.generate(prompt, req)
        for method in ("eagle", "lyanna", "lyanna+suffix"):
            assert d.generate(prompt, req, method=method, budget=None).tokens == ar.tokens, method


def test_checkpoints_load_their_device_heads_on_the_device_engine(tiny, tmp_path):
    """``--backend torch``: a head loaded from a checkpoint runs on the engine's device, and its
    method gives ``ar``'s tokens."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    vocab = tiny.config.vocab_size
    save_head(tmp_path / "eagle", "eagle", init_eagle_head(e, tiny.weights).numpy_weights(), tiny, 2)
    ly = init_lyanna_head(e, tiny.weights, np.arange(vocab)[::-1].copy(), rank=4)
    save_head(tmp_path / "lyanna", "lyanna", {**ly.numpy_weights(), "ti.hot": np.arange(0, vocab, 2)}, tiny, 2)
    d = Decoder(tiny, engine=e, default_drafts=False)
    for arch in ("eagle", "lyanna"):
        d.load_draft(str(tmp_path / arch))
    assert isinstance(d.drafter_for("eagle").head, DeviceDraftHead)
    assert isinstance(d.drafter_for("lyanna").head, DeviceChainHead)
    req = GenerationRequest(max_new_tokens=16, eos_token_ids=())
    ar = d.generate([1, 40, 41, 42, 40, 41, 42], req)
    for method in ("eagle", "lyanna", "lyanna+suffix"):
        assert d.generate([1, 40, 41, 42, 40, 41, 42], req, method=method, budget=None).tokens == ar.tokens


@pytest.mark.parametrize("layers", [1, 2])
def test_fixed_shape_draft_equals_the_host_heads_draft(tiny, layers):
    """The device head's draft in one fixed-shape call (catch-up padded to a bucket, the chain, raw
    logits) gives the host head's raw logits and leaves its context where the host's is left:
    a new prompt's pairs (more than one call takes), then a round with a few pending pairs (whose
    features the device head is handed on the device, as a pass verified there hands them); for
    a head of one decoder layer and of two."""
    e, w = _lyanna_head(tiny, seed=4, layers=layers)
    hidden = np.random.default_rng(6).standard_normal((40, tiny.config.hidden_size)).astype(np.float32)
    ctx = np.arange(30, 71)
    states = []
    for head, rows in ((ChainHead(e, w), np.asarray), (DeviceChainHead(e, w), lambda r: torch.from_numpy(r).to(DEVICE))):
        pc, raws = head.context((2,)), []
        pc.start({2: hidden[:20]})
        raws.append(head.draft(pc, ctx[:21], 4))  # 20 pairs pending: more than a fixed catch-up takes
        pc.commit({2: rows(hidden[20:23])})
        raws.append(head.draft(pc, ctx[:24], 3))  # 3 pending: padded to 4 rows
        raws.append(head.draft(pc, ctx[:24], 1))  # the same context again, no chain step
        states.append((raws, pc.cache.length, pc.base, pc.passes))
    (host, *h_state), (dev, *d_state) = states
    assert h_state == d_state == [23, 23, 8]
    for a, b in zip(host, dev):
        np.testing.assert_allclose(np.asarray(b.cpu()), a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fallback", ["lowrank", "none"])
def test_a_rounds_drafting_in_one_call_equals_the_host_heads(tiny, fallback):
    """``draft_trees`` (draft, its tree, the tree re-sampled from leftover rows and their fusion,
    one call on the device) gives the host head's raw rows and tree: with and without leftover
    rows, the fused tree holding nodes of both origins."""
    e, w = _lyanna_head(tiny, seed=9, varied=True)
    vocab = tiny.config.vocab_size
    ti = TokenInfo(w["ti.a"], w["ti.b"], np.arange(0, vocab, 3), fallback)
    hidden = np.random.default_rng(10).standard_normal((40, tiny.config.hidden_size)).astype(np.float32)
    ctx = np.arange(30, 71)
    rounds = []
    for head, rows in ((ChainHead(e, w), np.asarray), (DeviceChainHead(e, w), lambda r: torch.from_numpy(r).to(DEVICE))):
        pc = head.context((2,))
        pc.start({2: hidden[:20]})
        raw, fresh = head.draft_trees(pc, ctx[:21], 4, None, ti, 3, 2, 12)
        pc.commit({2: hidden[20:22]})
        leftover = rows(np.asarray(raw.cpu() if isinstance(raw, torch.Tensor) else raw)[2:])
        raw2, fused = head.draft_trees(pc, ctx[:23], 3, leftover, ti, 3, 2, 12)
        assert np.all(fresh.origin == 0) and set(fused.origin.tolist()) == {0, 1}
        rounds.append((raw, fresh, raw2, fused, pc.passes))
    host, dev = rounds
    assert host[-1] == dev[-1]
    for a, b in zip(host[:-1], dev[:-1]):
        if isinstance(a, DraftTree):
            np.testing.assert_array_equal(b.tokens, a.tokens)
            np.testing.assert_array_equal(b.parents, a.parents)
            np.testing.assert_array_equal(b.origin, a.origin)
            np.testing.assert_allclose(b.scores, a.scores, rtol=1e-4)
        else:
            np.testing.assert_allclose(np.asarray(b.cpu()), a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["lyanna", "lyanna-noresample", "eagle"])
def test_a_draft_after_an_unread_pass_equals_the_draft_after_reading_it(tiny, kind):
    """A head's call for the round after a verified pass the host has not read (its inputs formed
    on the device from what the pass left there: ``draft_trees_after``, ``eagle_tree_after``)
    gives the draft the host makes after reading that pass and committing its kept rows (for
    ``lyanna``, with the leftover rows past the accepted ones): the same tree (and raw rows),
    for paths of every length (the pass's tree is the target's own greedy chain with a wrong
    token at one level), and the context it leaves counts the same features once settled."""
    from lyanna.drafters import device_tree
    from lyanna.engines.base import Verification
    from lyanna.engines.device import DeviceTree

    e, w = _lyanna_head(tiny, seed=9, varied=True)
    vocab, taps, depth = tiny.config.vocab_size, (2,), 3
    ti = TokenInfo(w["ti.a"], w["ti.b"], np.arange(0, vocab, 3), "lowrank")
    resample = kind == "lyanna"
    if kind == "eagle":
        head = DeviceDraftHead(e, init_eagle_head(e, tiny.weights).numpy_weights())
        draft = lambda pc, ctx, leftover: (None, head.eagle_tree(pc, np.array(ctx), depth, 2, 2, 8, ahead=True))
        after = lambda pc, pending, length, chain: (None, head.eagle_tree_after(pc, pending, length, depth, 2, 2, 8))
    else:
        head = DeviceChainHead(e, w)
        draft = lambda pc, ctx, leftover: head.draft_trees(pc, np.array(ctx), depth, leftover, ti, 2, 2, 8, ahead=True)
        after = lambda pc, pending, length, chain: head.draft_trees_after(pc, pending, length, chain, depth, resample,
                                                                          ti, 2, 2, 8, None)
    numpy_target = Transformer(tiny.config, tiny.weights)
    prompt = list(range(3, 40))
    for count in range(depth + 1):
        cache = e.new_cache(128)
        pre = e.forward(prompt, np.arange(len(prompt)), cache, logit_rows=[-1], taps=taps)
        ctx = prompt + [int(np.argmax(pre.logits[-1]))]
        greedy = []  # the target's greedy continuation after the root
        for _ in range(depth + 1):
            seq = ctx + greedy
            greedy.append(int(np.argmax(numpy_target.forward(seq, np.arange(len(seq)), numpy_target.new_cache(len(seq))).logits[-1])))
        path = greedy[:depth]
        if count < depth:
            path[count] = (path[count] + 1) % vocab  # rejected there
        contexts = [head.context(taps), head.context(taps)]
        for pc in contexts:
            pc.start({t: pre.hidden[t] for t in taps})
            chain, _ = draft(pc, ctx, None)
        padded = device_tree.PaddedTrees(*(torch.as_tensor(np.asarray(a))[None] for a in (
            path, [-1, 0, 1], [0.9, 0.8, 0.7], [1, 2, 3], [0, 0, 0])), count=torch.tensor([[depth]]))
        pending = e.forward_batch([Block([ctx[-1]], [len(ctx) - 1], cache, taps=taps, ahead=True,
                                         tree=DeviceTree(device_tree.packed(padded).to(DEVICE), depth, depth),
                                         verification=Verification(0.0))])[0]
        raw_ahead, tree_ahead = after(contexts[0], pending, len(ctx), chain)
        out = pending.collect()
        assert len(out.kept) == count + 1 and cache.length == len(ctx) + count
        assert out.bonus == greedy[count]
        contexts[1].commit(out.hidden)
        leftover = chain[count + 1 :] if resample and count + 1 < depth else None
        raw, tree = draft(contexts[1], ctx + greedy[: count + 1], leftover)  # the accepted tokens, the bonus token
        contexts[0].settle(count + 1)
        if raw is not None:
            np.testing.assert_allclose(np.asarray(raw_ahead.cpu()), np.asarray(raw.cpu()), rtol=1e-4, atol=1e-4)
        got, want = (DraftTree.from_packed(t.packed.cpu().numpy()) for t in (tree_ahead, tree))
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.parents, want.parents)
        np.testing.assert_array_equal(got.origin, want.origin)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4)
        if leftover is not None:
            assert 1 in want.origin  # the leftover rows took part
        a, b = contexts
        assert (a.cache.length, a.base, a._count, a.passes) == (b.cache.length, b.base, b._count, b.passes)
        torch.testing.assert_close(a.features, b.features)


@pytest.mark.parametrize("method,budget", [("lyanna-device", None), ("lyanna-device", 4), ("lyanna-device", "auto"),
                                           ("eagle-device", None), ("eagle-device", 4), ("ar", "auto")])
def test_rounds_launched_ahead_give_the_rounds_read_one_by_one(tiny, method, budget, monkeypatch):
    """A device head's rounds launched before the last one is read (the draft and pass formed on
    the device from its outcome; ``ar``'s plain steps, the next token picked in the pass) give the
    same outputs as rounds read one at a time, greedy and seeded sampling, and they do run ahead. Under a fixed budget they verify the same trees,
    round by round, but for the last rounds (a round launched ahead leaves room for every level
    of the one before it, so its tree may be shallower there); under ``auto`` the trees may
    differ, sized a round later."""
    from lyanna.decoding import loop
    from lyanna.decoding.budget import LatencyCurve

    depth, n = 3, 32  # the head's depth (``_with_heads``), the tokens generated
    rounds: list[tuple] = []
    real_followed = loop.followed
    monkeypatch.setattr(loop, "followed", lambda tree, kept, bonus: rounds.append(
        (tree.tokens.tolist(), tree.parents.tolist(), kept.tolist(), bonus)) or real_followed(tree, kept, bonus))
    follows = []
    real_forward = DeviceEngine.forward_batch
    monkeypatch.setattr(DeviceEngine, "forward_batch", lambda self, blocks: follows.extend(
        b.follows is not None for b in blocks) or real_forward(self, blocks))
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
        runs = []
        for ahead in (False, True):
            e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead)  # a decoder whose budget starts afresh
            d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
            d._curve = LatencyCurve((1, 2, 4, 8, 16), (0.01, 0.0101, 0.0102, 0.0103, 0.5), "test-model", "test machine", 256)
            follows.clear()
            outputs, trees = [], []
            for prompt in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 60))):
                rounds.clear()
                outputs.append(d.generate(prompt, GenerationRequest(max_new_tokens=n, sampling=params, eos_token_ids=()),
                                          method=method, budget=budget, fallback=budget == "auto").tokens)
                before = 1 + np.cumsum([0] + [len(kept) for _, _, kept, _ in rounds])  # tokens committed before each
                trees.append([r for r, b in zip(rounds, before) if b + 2 * (depth + 1) <= n])
            runs.append((outputs, trees, sum(follows)))
        (sync, sync_trees, none), (ahead, ahead_trees, chained) = runs
        # Sampled outputs draw one number a node: with other trees (the last rounds'; auto's sized
        # a round later) they draw other numbers from there on; ``ar``'s, picked in the pass when
        # launched ahead, draw theirs as a tree's bonus token does.
        cut = n if params.greedy else 0 if budget == "auto" or method == "ar" else n - 2 * (depth + 1)
        assert [t[:cut] for t in ahead] == [t[:cut] for t in sync] and none == 0
        assert chained >= (1 if method != "ar" and budget == "auto" else 6), chained  # (auto drafts little here)
        if budget != "auto":
            assert ahead_trees == sync_trees


@pytest.mark.parametrize("method", ["lyanna-device", "eagle-device"])
def test_rounds_that_do_not_draft_follow_on_the_device_as_ar_steps_do(tiny, method, monkeypatch):
    """A device head's rounds that do not draft (the budget's waits, the fallback's pauses) are
    plain steps launched after the last round before the host reads it, as ``ar``'s are, that
    round's rows handed to the head on the device: the same tokens, and the same trees round by
    round, as rounds read one by one. (Lyanna's round after a drafted one re-samples the chain's
    leftover rows on the host instead.)"""
    import itertools

    from lyanna.decoding import loop
    from lyanna.decoding.policy import Policy

    depth, n = 3, 48
    records: list[tuple] = []
    real_record = loop.RoundStats.record
    monkeypatch.setattr(loop.RoundStats, "record", lambda self, tree, verdict, committed: records.append(
        (tree.tokens.tolist(), tree.parents.tolist(), list(verdict.tokens))) or real_record(self, tree, verdict, committed))
    plain_follows = []
    real_forward = DeviceEngine.forward_batch
    monkeypatch.setattr(DeviceEngine, "forward_batch", lambda self, blocks: plain_follows.extend(
        b.follows is not None and b.tree is None for b in blocks) or real_forward(self, blocks))
    runs = []
    for ahead in (False, True):
        d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead),
                                default_drafts=False), tiny)
        rounds = itertools.count()
        monkeypatch.setattr(Policy, "gate", lambda self: next(rounds) % 6 == 0)  # one round in six drafts
        records.clear()
        plain_follows.clear()
        out = d.generate(list(range(3, 60)), GenerationRequest(max_new_tokens=n, eos_token_ids=()), method=method,
                         budget=4, fallback=False)
        before = 1 + np.cumsum([0] + [len(r[2]) for r in records])  # tokens committed before each round
        runs.append((out.tokens, [r for r, b in zip(records, before) if b + 2 * (depth + 1) <= n], sum(plain_follows)))
    (sync, sync_rounds, none), (ahead, ahead_rounds, followed) = runs
    assert ahead == sync and none == 0
    assert ahead_rounds == sync_rounds and any(tokens for tokens, _, _ in sync_rounds)
    assert followed >= 3, followed


@pytest.mark.parametrize("layers", [1, 2])
def test_device_eagle_trees_equal_the_host_eagle_trees(tiny, layers):
    """EAGLE-2's tree grown on the device in one fixed-shape call (frontier, ancestor masks,
    top-k all on the device) is the host drafter's tree for the same context: same nodes,
    parents and order, scores equal to rounding; across rounds with a few pending pairs; for a
    head of one decoder layer and of two."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    torch.manual_seed(7)
    eagle = init_eagle_head(e, tiny.weights, layers=layers)
    stir_upper_layers(eagle, 7)
    w = eagle.numpy_weights()
    hidden = np.random.default_rng(8).standard_normal((40, tiny.config.hidden_size)).astype(np.float32)
    ctx = np.arange(30, 71)
    trees = []
    for head in (DraftHead(e, w), DeviceDraftHead(e, w)):
        drafter = EagleDrafter(head, tap=2, depth=4, topk=3, width=2, max_nodes=12)
        drafter.start(ctx[:20].tolist(), {2: hidden[:20]})
        got = [drafter.propose(ctx[:21], 4)]
        drafter.commit(ctx[21:24].tolist(), {2: hidden[20:23]})
        got += [drafter.propose(ctx[:24], 3), drafter.propose(ctx[:24], 1)]
        trees.append((got, drafter.context.cache.length, drafter.passes))
    (host, *h_state), (dev, *d_state) = trees
    assert h_state == d_state
    for a, b in zip(host, dev):
        assert len(a) > 0
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.parents, a.parents)
        np.testing.assert_allclose(b.scores, a.scores, rtol=1e-4)


def test_fixed_shape_calls_issue_no_op_a_cuda_graph_cannot_capture(tiny, monkeypatch):
    """Every fixed-shape call (target blocks, lyanna's draft and trees, eagle's tree) runs only
    ops a CUDA graph can capture: no Python scalar lifted to a host tensor (``t[i] = True`` copies
    it host-to-device), no read of a device value on the host (``.item()``), no op whose output
    size depends on data. Checked on CPU, so CI catches what only a GPU run would show."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lyanna.engines.device import FixedShapeCall

    banned = {torch.ops.aten.lift_fresh.default, torch.ops.aten._local_scalar_dense.default,
              torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default}
    seen: dict[str, set[str]] = {}

    class Watch(TorchDispatchMode):
        def __init__(self, name: str):
            super().__init__()
            self.name = name

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.setdefault(self.name, set())
            if func in banned:
                seen[self.name].add(str(func))
            return func(*args, **(kwargs or {}))

    def watched(self, timed=False):
        with Watch(type(self).__name__):
            self._run()  # the inputs' copy, then the call (eager: not on a GPU)

    monkeypatch.setattr(FixedShapeCall, "run_fixed", watched)
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True)  # rounds launched ahead too, as on a GPU
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    req = GenerationRequest(max_new_tokens=12, eos_token_ids=())
    for method in ("ar", "suffix", "eagle-device", "lyanna-device"):  # suffix: blocks from the host
        d.generate(list(range(3, 30)), req, method=method, budget=None)
    sampled = GenerationRequest(max_new_tokens=12, eos_token_ids=(), sampling=SamplingParams(0.8, top_p=0.9, top_k=5, seed=0))
    d.generate(list(range(3, 30)), sampled, method="lyanna-device", budget=None)  # the pass verifying by sampling
    lyanna = d.drafters["lyanna-device"].fork()  # the draft and the tree alone, as other policies call them
    lyanna.start(list(range(3, 30)), {2: np.zeros((27, tiny.config.hidden_size), np.float32)})
    raw = lyanna.chain(list(range(3, 30)), 3)
    lyanna.head.tree(raw, 5, lyanna.ti, 2, 2, 8)
    assert set(seen) == {"_StaticPass", "_TreeBlockPass", "_DraftPass", "_DraftTreesPass", "_TreePass", "_EagleTreePass",
                         "JoinedCall"}  # a round launched ahead: its draft call and pass as one
    assert seen == {name: set() for name in seen}


@pytest.mark.parametrize("budget", [None, 4])
def test_every_fixed_shape_call_is_harmless_to_run_twice(tiny, budget, monkeypatch):
    """A CUDA graph's first run runs its call twice (a warm-up, then the captured replay), so
    every fixed-shape call must leave what one run leaves: decoding with each call run twice,
    rounds launched ahead included (a pass that follows another reads the handoff that one
    wrote and writes the other), gives ``ar``'s tokens. Checked on CPU, where calls run once."""
    def twice(self):
        self._send()  # the inputs' copy (a joined call's: both calls')
        self._forward()
        self._forward()

    prompt, req = list(range(3, 60)), GenerationRequest(max_new_tokens=24, eos_token_ids=())
    want = Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE), default_drafts=False).generate(prompt, req)
    monkeypatch.setattr(FixedShapeCall, "_run", twice)
    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True),
                            default_drafts=False), tiny)
    for method in ("ar", "eagle-device", "lyanna-device"):
        assert d.generate(prompt, req, method=method, budget=budget).tokens == want.tokens, method


def test_a_fixed_shape_calls_inputs_travel_together_and_arrive_whole():
    """Inputs of several types and shapes (one empty) share one block, each aligned for its type:
    what the host writes is what the call reads, run after run."""
    class Echo(FixedShapeCall):
        def __init__(self):
            super().__init__(torch.device(DEVICE), None)
            self._input("flag", (3,), torch.bool)  # 3 bytes: the next input must still be aligned
            self._input("ids", (2, 5), torch.int64)
            self._input("none", (0,), torch.int64)
            self._input("rows", (4, 3), torch.float32)
            self.seen = None

        def _forward(self):
            self.seen = (self.flag.clone(), self.ids.clone(), self.none.clone(), self.rows.clone())

    call, rng = Echo(), np.random.default_rng(0)
    for _ in range(2):
        want = (rng.random(3) < 0.5, rng.integers(-2**40, 2**40, (2, 5)), np.zeros(0, np.int64),
                rng.standard_normal((4, 3)).astype(np.float32))
        for name, value in zip(("flag", "ids", "none", "rows"), want):
            call.host(name)[:] = value
        call.run_fixed()
        for got, value in zip(call.seen, want):
            np.testing.assert_array_equal(got.cpu().numpy(), value)


@pytest.mark.parametrize("method", ["ar", "lyanna-device", "eagle-device"])
def test_compiled_layers_give_the_eager_tokens(tiny, method):
    """Layers whose glue runs through ``torch.compile`` (``LayerHalves``, the default on CUDA),
    and with them lyanna's round tree, give the eager greedy tokens, the target's and the device
    heads' alike, over prefills, one-token steps and verified trees of several sizes; and Dynamo
    really compiled them (its counters: graphs captured, none broken, as with fullgraph)."""
    from torch._dynamo.utils import counters

    eager, compiled = _eager_beside(tiny, compiled=True)
    assert compiled.engine.halves.compiled and not eager.engine.halves.compiled
    for prompt in ([1, 40, 41, 42, 40, 41, 42], list(range(3, 40))):
        req = GenerationRequest(max_new_tokens=24, eos_token_ids=())
        want = eager.generate(prompt, req, method=method, budget=None)
        got = compiled.generate(prompt, req, method=method, budget=None)
        assert got.tokens == want.tokens, (method, prompt)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    if method == "lyanna-device":  # a round's tree (growth, choice, union) compiled with the layers
        from lyanna.drafters import device_calls

        assert device_calls._COMPILED_ROUND_TREE


def test_a_generation_counts_the_shapes_its_rounds_ran_first(tiny, monkeypatch):
    """Where shapes compile and capture (a GPU), a call of a shape met for the first time costs
    seconds: a generation says how many of its rounds' calls did (``first_runs``, summed in
    the bench's JSON), so a timed run that compiled inside its clock shows it; a generation that
    meets only shapes met before says 0 on an engine that keeps them."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True)
    monkeypatch.setattr(e, "shapes_compile", True)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    req = GenerationRequest(max_new_tokens=16, eos_token_ids=())
    first = d.generate(list(range(3, 30)), req, method="lyanna-device", budget=None)
    again = d.generate(list(range(3, 30)), req, method="lyanna-device", budget=None)
    assert first.extra["first_runs"] > again.extra["first_runs"] >= 0 and again.tokens == first.tokens
    monkeypatch.setattr(e, "shapes_compile", False)  # an engine whose every shape costs the same: none counted
    assert d.generate(list(range(3, 40)), req, method="lyanna-device", budget=None).extra["first_runs"] == 0


def _watch_full_depth(monkeypatch, call, head, drafts: str, pair: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The depth each ``call`` (a draft call class) is built at, and each tree ``head.<drafts>``
    returns (``pair``: a (raw, tree) pair) as (its depth, the depth asked for)."""
    built, init = [], call.__init__
    monkeypatch.setattr(call, "__init__", lambda self, *a, **k: built.append(a[3]) or init(self, *a, **k))
    deepest, original = [], getattr(head, drafts)

    def held(self, pc, ctx, depth, *a, **k):  # each tree's depth against the depth asked for
        out = original(self, pc, ctx, depth, *a, **k)
        tree = out[1] if pair else out
        seen = tree if isinstance(tree, DraftTree) else DraftTree.from_packed(tree.packed.cpu().numpy())
        deepest.append((int(seen.depths.max()) if len(seen) else 0, depth))
        return out

    monkeypatch.setattr(head, drafts, held)
    return built, deepest


def test_where_shapes_compile_every_draft_call_is_built_at_full_depth(tiny, monkeypatch):
    """Where each new shape compiles and captures, a lyanna round's call is built at its drafter's
    full depth whatever depth the room left in a reply allows (that depth moved in every reply's
    last rounds: a new shape each time), its tree held to that depth by the call's ``levels``: the
    tokens stay ``ar``'s, and a repeated prompt meets no draft call or verification pass of a new
    shape."""
    from lyanna.drafters.device_calls import _DraftTreesPass

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True)
    monkeypatch.setattr(e, "shapes_compile", True)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    built, deepest = _watch_full_depth(monkeypatch, _DraftTreesPass, DeviceChainHead, "draft_trees", pair=True)
    req = GenerationRequest(max_new_tokens=13, eos_token_ids=())
    prompt = list(range(3, 30))
    want = d.generate(prompt, req, method="ar", budget=None).tokens
    assert d.generate(prompt, req, method="lyanna-device", budget=None).tokens == want
    assert built and set(built) == {3}  # the drafter's depth, also in the reply's last rounds
    assert all(got <= asked for got, asked in deepest) and min(asked for _, asked in deepest) < 3
    calls = len(built), len(e._tree_passes)
    again = d.generate(prompt, req, method="lyanna-device", budget=None)
    assert again.tokens == want and (len(built), len(e._tree_passes)) == calls
    monkeypatch.setattr(e, "shapes_compile", False)  # elsewhere the call is as deep as the room allows
    assert d.generate(prompt, req, method="lyanna-device", budget=None).tokens == want and min(built) < 3


@pytest.mark.parametrize("ahead", [False, True])
def test_where_shapes_compile_every_eagle_call_is_built_at_full_depth(tiny, ahead, monkeypatch):
    """The same for an EAGLE head's tree call: built at its drafter's depth in a reply's last
    rounds too, its tree held to the depth asked by the call's ``levels`` (the same tree a call
    of that depth chooses: the tokens stay ``ar``'s), and a repeated prompt meets no new shape."""
    from lyanna.drafters.device_calls import _EagleTreePass

    e = DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=ahead)
    monkeypatch.setattr(e, "shapes_compile", True)
    d = _with_heads(Decoder(tiny, engine=e, default_drafts=False), tiny)
    built, deepest = _watch_full_depth(monkeypatch, _EagleTreePass, DeviceDraftHead, "eagle_tree", pair=False)
    req = GenerationRequest(max_new_tokens=13, eos_token_ids=())
    prompt = list(range(3, 30))
    want = d.generate(prompt, req, method="ar", budget=None).tokens
    assert d.generate(prompt, req, method="eagle-device", budget=None).tokens == want
    assert built and set(built) == {3} and deepest
    assert all(got <= asked for got, asked in deepest) and (ahead or min(asked for _, asked in deepest) < 3)
    calls = len(built), len(e._tree_passes)
    again = d.generate(prompt, req, method="eagle-device", budget=None)
    assert again.tokens == want and (len(built), len(e._tree_passes)) == calls
    monkeypatch.setattr(e, "shapes_compile", False)  # elsewhere the call is as deep as the room allows
    assert d.generate(prompt, req, method="eagle-device", budget=None).tokens == want and min(built) < 3


@pytest.mark.parametrize("method", ["lyanna-device", "eagle-device"])
def test_a_round_launched_ahead_is_one_call(tiny, method, monkeypatch):
    """A round launched ahead runs its draft call and the pass that verifies its tree as one
    (``JoinedCall``: one CUDA graph a round on a GPU, not two): once every shape has run, such a
    round runs no draft call of its own, only rounds the host starts do, and the tokens are
    ``ar``'s."""
    runs: collections.Counter[str] = collections.Counter()
    run_fixed = FixedShapeCall.run_fixed

    def counted(self, timed=False):
        runs[type(self).__name__] += 1
        run_fixed(self, timed)

    d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True),
                            default_drafts=False), tiny)
    prompt, req = list(range(3, 40)), GenerationRequest(max_new_tokens=24, eos_token_ids=())
    want = d.generate(prompt, req, method="ar", budget=None).tokens
    d.generate(prompt, req, method=method, budget=None)  # every shape's first run (a draft call's goes alone)
    monkeypatch.setattr(FixedShapeCall, "run_fixed", counted)
    out = d.generate(prompt, req, method=method, budget=None)
    assert out.tokens == want
    rounds = out.extra["rounds"]  # a few the host starts (the first, one after a round it reads first)
    assert runs["JoinedCall"] >= 0.75 * rounds, (dict(runs), rounds)
    assert sum(runs.values()) < 1.25 * rounds, (dict(runs), rounds)  # a draft call and a pass apart: 2 a round


@pytest.mark.parametrize("method", ["lyanna-device", "eagle-device"])
def test_a_joined_round_verifies_the_tree_its_draft_call_made(tiny, method, monkeypatch):
    """Verification is lossless for any tree, so equal tokens would not show a joined call that
    verified a stale tree (the last run's) or kept a stale chain: the same generation with each
    round's draft call and pass run apart, the tree loaded from the call just run, verifies the
    same trees, round by round, and keeps the same tokens."""
    from lyanna.engines.device import DeviceTree
    from lyanna.engines.device_passes import _TreeBlockPass

    if DEVICE.startswith("cuda") or os.environ.get("LYANNA_TEST_GRAPHS") == "replayed":
        pytest.skip("a hook in a joined call's Python runs when the call is captured, not when it is replayed")

    def apart(self, p, tree, timed):
        first = tree.deferred
        if first is not None:
            first.run_fixed()
            tree = DeviceTree(first.tree, tree.nodes, tree.depth, keep=tree.keep)
        p.load(tree)
        p.run_fixed(timed)
        for name, destination in tree.keep:
            destination.copy_(getattr(first, name))

    loaded: list[np.ndarray] = []
    load = _TreeBlockPass.load

    def recorded(self, tree):
        loaded.append(tree.packed.detach().cpu().numpy().copy())
        load(self, tree)

    monkeypatch.setattr(_TreeBlockPass, "load", recorded)
    prompt, req = list(range(3, 40)), GenerationRequest(max_new_tokens=24, eos_token_ids=())
    runs = []
    for launch in (None, apart):
        if launch is not None:
            monkeypatch.setattr(DeviceEngine, "_run_pass", launch)
        d = _with_heads(Decoder(tiny, engine=DeviceEngine(tiny.config, tiny.weights, DEVICE, pipelines=True),
                                default_drafts=False), tiny)
        d.generate(prompt, req, method=method, budget=None)  # first runs of shapes go alone
        loaded.clear()
        out = d.generate(prompt, req, method=method, budget=None)
        runs.append((out.tokens, out.draft_tokens, out.accepted_draft_tokens, [t.tolist() for t in loaded]))
    assert runs[0] == runs[1]
    trees = runs[0][3]
    assert len(trees) >= out.extra["rounds"] - 4 and len({str(t) for t in trees}) > 1  # the trees change
