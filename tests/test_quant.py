"""Computing on a GGUF's quantized blocks: the blocks are read exactly as GGUF's own dequantizer
reads them, the kernel equals fp32 arithmetic over those weights to rounding, and a row's output
never depends on the block it is computed in (greedy equality and batching rely on that)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from lyanna.engines.kernels import linear
from lyanna.engines.quant import (KERNELS, SUPPORTED, QuantMatrix, fit_q4_1, from_blocks, hf_name, quantize_blocks,
                                  quantize_q8_0)

from .conftest import stir_upper_layers

ROWS = (1, 2, 3, 5, 8, 17, 31, 64)


def gguf_matrix(kind: str, n: int, k: int, seed: int = 0, kernel: str = "int8") -> tuple[QuantMatrix, np.ndarray]:
    """A random [n, k] matrix quantized by gguf's reference quantizer, as our blocks and as gguf's
    own fp32 dequantization."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(w, qtype)
    return from_blocks(kind, raw, (n, k), kernel), quants.dequantize(raw, qtype).astype(np.float32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", SUPPORTED)
@pytest.mark.parametrize("shape", [(48, 64), (37, 96), (200, 32), (1040, 608)])
def test_blocks_read_exactly_as_gguf_dequantizes_them(kind, shape, kernel):
    matrix, reference = gguf_matrix(kind, *shape, kernel=kernel)
    assert matrix.shape == shape
    assert np.array_equal(matrix.dense(), reference)
    rows = np.array([shape[0] - 1, 0, 5])
    assert np.array_equal(matrix[rows], reference[rows])
    assert np.array_equal(matrix[3], reference[3])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", SUPPORTED)
@pytest.mark.parametrize("shape", [(48, 64), (37, 96), (1040, 608)])
def test_quantized_linear_equals_fp32_over_the_same_weights(kind, shape, kernel):
    matrix, reference = gguf_matrix(kind, *shape, seed=1, kernel=kernel)
    x = np.random.default_rng(2).standard_normal((max(ROWS), shape[1])).astype(np.float32)
    exact = x.astype(np.float64) @ reference.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(reference).astype(np.float64).T
    # int8: each input moves by at most half its block's step (max |x| / 127 / 2) when rounded
    step = np.repeat(np.abs(x.reshape(len(x), -1, 32)).max(axis=-1) / 127 / 2, 32, axis=1)
    rounding = step @ np.abs(reference).astype(np.float64).T if kernel == "int8" else 0
    for rows in ROWS:
        out = linear(x[:rows], matrix)
        assert out.shape == (rows, shape[0]) and out.dtype == np.float32
        # fp32 sums of at most k terms: a few units of rounding of the sum of magnitudes
        bound = 1e-6 * shape[1] * scale[:rows] + 1e-30 + (rounding[:rows] * (1 + 1e-5) if kernel == "int8" else 0)
        assert np.all(np.abs(out - exact[:rows]) <= bound)
    assert np.array_equal(linear(x[0], matrix), linear(x[:1], matrix)[0])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_output_does_not_depend_on_its_block(kind, kernel):
    matrix, _ = gguf_matrix(kind, 1040, 608, seed=3, kernel=kernel)
    x = np.random.default_rng(4).standard_normal((max(ROWS), 608)).astype(np.float32)
    alone = np.stack([linear(x[i : i + 1], matrix)[0] for i in range(max(ROWS))])
    for rows in ROWS:
        for start in (0, 1):
            block = x[start : start + rows]
            assert np.array_equal(linear(block, matrix), alone[start : start + block.shape[0]]), (rows, start)


def test_a_prompts_rows_stay_on_the_blocks_kernel():
    """``linear_rows`` with a packed matrix: a prompt's rows, long enough that fp32 weights would
    take the GEMM, get the blocks' kernel's bits, alone and beside other rows."""
    from lyanna.engines.kernels import BULK_MIN_ROWS, linear_rows

    matrix, _ = gguf_matrix("Q4_1", 96, 64, seed=8)
    x = np.random.default_rng(9).standard_normal((BULK_MIN_ROWS + 5, 64)).astype(np.float32)
    assert np.array_equal(linear_rows(x, matrix, [(5, x.shape[0])]), linear(x, matrix))
    assert np.array_equal(linear_rows(x[5:], matrix, [(0, x.shape[0] - 5)]), linear(x[5:], matrix))


@pytest.mark.parametrize("kernel", KERNELS)
def test_take_and_concat_keep_the_weights(kernel):
    a, ra = gguf_matrix("Q4_1", 64, 96, seed=5, kernel=kernel)
    b, rb = gguf_matrix("Q8_0", 37, 96, seed=6, kernel=kernel)
    both = QuantMatrix.concat([a, b])
    assert both.kernel == kernel
    assert np.array_equal(both.dense(), np.concatenate([ra, rb]))
    order = np.random.default_rng(7).permutation(101)
    assert np.array_equal(both.take(order).dense(), np.concatenate([ra, rb])[order])
    assert np.array_equal(np.take(np.concatenate([ra, rb]), order, axis=0), both.take(order, axis=0).dense())
    with pytest.raises(ValueError, match="rows only"):
        both.take(order, axis=1)


def test_fp32_matrices_quantize_to_q8_0_within_half_a_step():
    w = (np.random.default_rng(10).standard_normal((40, 96)) * 0.1).astype(np.float32)
    blocks = quantize_q8_0(w)
    step = np.abs(w.reshape(40, 3, 32)).max(axis=-1, keepdims=True) / 127  # Q8_0's scale per 32
    # half a step of rounding, plus the scale's own fp16 rounding (2^-11 relative) times |q| <= 127
    assert np.all(np.abs(blocks.dense() - w).reshape(40, 3, 32) <= step * (0.5 + 127 * 2.0**-11))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((4, 40), np.float32))


def test_fitted_q4_1_blocks_err_less_than_the_reference_quantizers():
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((48, 128)) * rng.uniform(0.01, 1, (48, 1))).astype(np.float32)
    w[0, :32] = 0.25  # a block of one value
    w[1, 32:64] = 0  # and of zeros
    fitted, reference = fit_q4_1(w), quantize_blocks(w, "Q4_1")
    d, m, q = fitted.row_layout()
    assert q.min() >= 0 and q.max() <= 15  # 4-bit codes, kept packed by the kernel
    assert all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (d, m))  # as a file holds them
    blocks = lambda a: ((a.dense() - w) ** 2).reshape(48, 4, 32).sum(axis=-1)
    # no block worse than the reference (both round their scales to fp16, hence the slack), the
    # matrix better by a clear margin
    assert np.all(blocks(fitted) <= blocks(reference) * (1 + 1e-3) + 1e-12)
    assert blocks(fitted).sum() < 0.95 * blocks(reference).sum()
    assert np.array_equal(fitted.dense()[0, :32], w[0, :32]) and not fitted.dense()[1, 32:64].any()
    with pytest.raises(ValueError, match="multiple of 32"):
        fit_q4_1(np.zeros((4, 40), np.float32))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="not supported"):
        from_blocks("Q6_K", np.zeros((4, 210), np.uint8), (4, 256))
    with pytest.raises(ValueError, match="int8"):
        QuantMatrix(np.zeros((4, 1), np.float32), np.zeros((4, 1), np.float32), np.zeros((4, 32), np.uint8))
    with pytest.raises(ValueError, match="choose one of int8, float"):
        QuantMatrix(np.zeros((4, 1), np.float32), np.zeros((4, 1), np.float32), np.zeros((4, 32), np.int8), "int4")
    with pytest.raises(ValueError, match="linear needs"):
        linear(np.zeros((2, 64), np.float32), gguf_matrix("Q8_0", 16, 96)[0])


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_norm.weight") is None  # norms stay fp32
    assert hf_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def gguf_decoder(default_target):
    from lyanna.decoding.decoder import Decoder
    from lyanna.engines.loading import DEFAULT_MODEL, load_target

    return Decoder(load_target(DEFAULT_MODEL, weight_format="gguf"))


@pytest.mark.slow
def test_default_model_runs_on_its_gguf_blocks(gguf_decoder, default_decoder, monkeypatch):
    from lyanna.decoding.decoder import GenerationRequest

    engine = gguf_decoder.engine
    assert engine.name == "numpy-gguf"
    weights = gguf_decoder.target.weights
    # Every matrix of the file is computed on blocks: each was checked bit for bit against the
    # fp32 checkpoint (q and k after undoing llama.cpp's row interleaving), or it would stay fp32.
    assert sum(isinstance(w, QuantMatrix) for w in weights.values()) == 211
    # The same model: with fp32 inputs (gguf-float) logits as the fp32 engine's up to summation
    # order; with 8-bit inputs the same next token at almost every position of a reply (teacher-
    # forced; scripts/measure-int8-quality.py measured 94.9% over Spec-Bench's 26 x 128 tokens).
    # Over 4 replies of 64 tokens, so that one reply's share (0.89 to 0.97 across hosts: each
    # host's fp32 reply differs) cannot sit at the bar: 256 positions put 0.88 about five
    # standard deviations below the measured rate.
    from lyanna.engines.loading import DEFAULT_MODEL, load_target
    from lyanna.engines.transformer import Transformer

    float_inputs = load_target(DEFAULT_MODEL, weight_format="gguf-float")
    half_cache = Transformer(float_inputs.config, float_inputs.weights)
    monkeypatch.setenv("LYANNA_KV_CACHE", "float32")  # the kernels alone: a float32 cache as the fp32 engine's
    float_engine = Transformer(float_inputs.config, float_inputs.weights)
    agree, replies = [], []
    for question in ("Name three rivers in Europe.", "Write a haiku about autumn rain.",
                     "How do vaccines train the immune system?", "Give two tips for a job interview."):
        prompt = default_decoder.encode(question)
        ids = prompt + list(default_decoder.generate(prompt, GenerationRequest(max_new_tokens=64)).tokens)

        def logits(e, ids=ids, start=len(prompt) - 1):
            return e.forward(ids, np.arange(len(ids)), e.new_cache(len(ids))).logits[start:-1]

        fp32 = logits(default_decoder.engine)
        assert np.abs(logits(float_engine) - fp32).max() <= 2e-3
        # The default cache's halves move these logits a little (about 0.02 at most where first
        # measured): bounded with a wide margin, so that a cache read wrongly fails here.
        assert np.abs(logits(half_cache) - fp32).max() <= 0.1
        agree.extend(logits(engine).argmax(axis=1) == fp32.argmax(axis=1))
        replies.append(ids)
    assert len(agree) >= 200 and np.mean(agree) >= 0.88, np.mean(agree)
    ids = replies[0]
    # Lossless against this engine's own ar, every drafter.
    req = GenerationRequest(max_new_tokens=40)
    ar = gguf_decoder.generate(ids, req)
    for method in ("suffix", "eagle", "lyanna", "lyanna+suffix"):
        assert gguf_decoder.generate(ids, req, method=method, budget=16).tokens == ar.tokens, method
    # The draft heads' matrices follow the target onto blocks (4-bit: drafts need no exact weights).
    head = gguf_decoder.drafter_for("lyanna").head
    assert isinstance(head.layers[0].w_down, QuantMatrix) and isinstance(head.fc_w, QuantMatrix)
    assert head.fc_w.row_layout()[1].any() and head.layers[0].w_down.row_layout()[2].max() <= 15  # Q4_1's offsets, nibbles
    # Their layer runs as one fused call, with the layer-by-layer path's bits.
    from lyanna.engines.transformer import attention_bias

    rng = np.random.default_rng(12)
    feats, toks = rng.standard_normal((3, head.config.hidden_size)).astype(np.float32), rng.integers(0, 999, 3)
    runs, compiled = [], head._fused
    assert compiled is not None
    for fused in (compiled, None):
        head._fused, cache = fused, head.new_cache(16)
        step = head.step(feats, toks, np.arange(3), cache, attention_bias(0, np.tril(np.ones((3, 3), bool))))
        runs.append((step, head.chain(step[-1], 2, 2, cache), cache.k.copy()))
    head._fused = compiled
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_layers_give_the_layer_by_layer_bits(tiny_model_dir, kernel):
    """One sequence's pass through every layer in one compiled call (``fused.py``) equals the
    layer-by-layer path bit for bit: logits, tapped hidden states and KV cache, for a prompt, a
    tree-masked block and a single token; and a batch (layer by layer) equals each sequence alone."""
    from lyanna.engines.base import Block
    from lyanna.engines.loading import load_target
    from lyanna.engines.transformer import Transformer

    target = load_target(tiny_model_dir)
    weights = {name: quantize_q8_0(w, kernel) if w.ndim == 2 and ".layers." in name else w
               for name, w in target.weights.items()}
    fused = Transformer(target.config, weights)
    assert fused._fused is not None
    assert fused.kv_cache == "float16" and fused.new_cache(4).k.dtype == np.uint16  # written by both paths below
    plain = Transformer(target.config, weights)
    plain._fused = None
    tokens = np.random.default_rng(11).integers(3, 259, 30)
    mask = np.tril(np.ones((5, 5), bool))
    mask[3, 1] = False
    results = []
    for engine in (fused, plain):
        cache = engine.new_cache(64)
        outs = [engine.forward(tokens[:20], np.arange(20), cache, taps=(0, 1, 2)),
                engine.forward(tokens[20:25], np.arange(20, 25), cache, block_mask=mask, taps=(1,)),
                engine.forward(tokens[25:26], [25], cache, taps=(0, 2))]
        results.append((outs, cache))
    (ours, ours_cache), (theirs, theirs_cache) = results
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.logits, b.logits)
        assert a.hidden.keys() == b.hidden.keys()
        assert all(np.array_equal(a.hidden[t], b.hidden[t]) for t in a.hidden)
    assert np.array_equal(ours_cache.k, theirs_cache.k) and np.array_equal(ours_cache.v, theirs_cache.v)
    caches = [fused.new_cache(64) for _ in range(2)]
    batch = fused.forward_batch([Block(tokens[:7], np.arange(7), caches[0]), Block(tokens[7:10], np.arange(3), caches[1])])
    alone = [fused.forward(tokens[:7], np.arange(7), fused.new_cache(64)), fused.forward(tokens[7:10], np.arange(3), fused.new_cache(64))]
    assert all(np.array_equal(b.logits, a.logits) for b, a in zip(batch, alone))


def test_a_pass_timed_by_phase_keeps_its_bits_and_counts_every_phase(tiny_model_dir):
    """The fused layers given a clock (``fused.PHASES``, what ``measure-block-parts.py`` reads)
    add cycles to every phase and compute what an untimed pass computes, bit for bit."""
    from lyanna.engines.fused import PHASES
    from lyanna.engines.loading import load_target
    from lyanna.engines.transformer import Transformer

    target = load_target(tiny_model_dir)
    weights = {name: quantize_q8_0(w, "int8") if w.ndim == 2 and ".layers." in name else w
               for name, w in target.weights.items()}
    engine = Transformer(target.config, weights)
    untimed, clock = engine._fused, np.zeros(len(PHASES), np.int64)
    tokens, mask = np.random.default_rng(12).integers(3, 259, 12), np.tril(np.ones((4, 4), bool))
    outs = []
    for fused in (untimed, lambda x, rot, blocks, taps: untimed(x, rot, blocks, taps, clock=clock)):
        engine._fused, cache = fused, engine.new_cache(32)
        engine.forward(tokens[:8], np.arange(8), cache)
        outs.append((engine.forward(tokens[8:], np.arange(8, 12), cache, block_mask=mask, taps=(1,)), cache))
    engine._fused = untimed
    (plain, plain_cache), (timed, timed_cache) = outs
    assert np.array_equal(plain.logits, timed.logits) and np.array_equal(plain.hidden[1], timed.hidden[1])
    assert np.array_equal(plain_cache.k, timed_cache.k) and np.array_equal(plain_cache.v, timed_cache.v)
    assert (clock > 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_two_layer_head_on_blocks_runs_fused_with_the_layer_by_layer_bits(tiny_model_dir, kernel):
    """On a target computed on blocks a two-layer draft head's matrices become blocks too, and its
    layers (and a catch-up's fill through the lower one) run as compiled calls: the same bits as
    layer by layer."""
    from lyanna.drafters.head import DraftHead
    from lyanna.engines.loading import load_target
    from lyanna.engines.transformer import Transformer
    from lyanna.training.fit import init_eagle_head

    target = load_target(tiny_model_dir)
    weights = {name: quantize_q8_0(w, kernel) if w.ndim == 2 and (".layers." in name or name == "lm_head.weight") else w
               for name, w in target.weights.items()}
    torch_head = init_eagle_head(Transformer(target.config, target.weights), target.weights, layers=2)
    stir_upper_layers(torch_head, seed=5)
    head = DraftHead(Transformer(target.config, weights), torch_head.numpy_weights())
    assert isinstance(head.layers[1].w_down, QuantMatrix)
    compiled = (head._fused, head._fused_below)
    assert None not in compiled
    rng = np.random.default_rng(13)
    feats, toks = rng.standard_normal((6, head.config.hidden_size)).astype(np.float32), rng.integers(3, 259, 6)
    runs = []
    for fused, below in (compiled, (None, None)):
        head._fused, head._fused_below, cache = fused, below, head.new_cache(16)
        head.fill(feats[:5], toks[:5], np.arange(1, 6), cache)
        runs.append((head.step(feats[5:], toks[5:], np.arange(6, 7), cache, None), cache.k.copy(), cache.v.copy()))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
