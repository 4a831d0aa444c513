"""The torch backend: the Hugging Face model as the target engine (``--backend torch``,
``lyanna.hf``), lossless against ``model.generate`` and in distribution."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import lyanna.hf
from lyanna.cli import main
from lyanna.decoding import verify as verify_module
from lyanna.decoding.decoder import DRAFTS_DIR, Decoder, GenerationRequest
from lyanna.drafters.checkpoint import save_head
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.drafters.lyanna import ChainHead, LyannaDrafter, TokenInfo
from lyanna.engines.loading import load_target
from lyanna.engines.torch_engine import TorchEngine, load_torch_target
from lyanna.engines.transformer import Transformer
from lyanna.errors import LyannaError
from lyanna.measure.bench import load_questions, run_bench
from lyanna.training.fit import init_eagle_head, init_lyanna_head

from .conftest import ALPHA, chi2_pvalue, make_tiny_model, no_residual
from .test_speculative import (
    SAMPLING_GRID,
    SMALL_VOCAB,
    PeekingDrafter,
    exact_joint,
    sample_outputs,
    small_vocab_target,
)

LAYOUTS = [("llama", {}), ("mistral", {"sliding_window": 16}), ("qwen2", {})]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=LAYOUTS, ids=[a for a, _ in LAYOUTS])
def tiny(request, tmp_path_factory):
    """A tiny model of one layout: its directory, the HF model, and an (unfitted) Lyanna head
    for it whose token information is random enough to propose varied trees."""
    arch, overrides = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
    target = load_target(path)
    engine = Transformer(target.config, target.weights)
    head = init_lyanna_head(engine, target.weights, np.arange(259)[::-1].copy(), rank=8)
    with torch.no_grad():
        head.ti.b.normal_(0, 0.5)
    w = {**head.numpy_weights(), "ti.hot": np.arange(0, 259, 2)}
    save_head(path / "head", "lyanna", w, target, target.config.num_layers)
    return path, hf_model(path), target


def test_torch_engine_blocks_match_the_numpy_engine(tiny):
    """Prefill with taps, a tree block, compaction to a path, then a step: the same numbers as
    the numpy engine up to float rounding, and the same cache lengths."""
    path, model, target = tiny
    engines = [Transformer(target.config, target.weights), TorchEngine(model)]
    outs = []
    for e in engines:
        cache = e.new_cache(128)
        prompt = np.arange(3, 40)
        pre = e.forward(prompt, np.arange(37), cache, logit_rows=[-1], taps=(0, target.config.num_layers))
        mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
        tree = e.forward([7, 8, 9, 10], [37, 38, 38, 39], cache, block_mask=mask, logit_rows=[1, 3])
        cache.compact(37, [0, 2, 3])
        step = e.forward([11], [40], cache)
        outs.append((pre, tree, step, cache.length))
    (a_pre, a_tree, a_step, a_len), (b_pre, b_tree, b_step, b_len) = outs
    assert a_len == b_len == 41
    assert a_tree.logits.shape == b_tree.logits.shape == (2, 259)
    for a, b in [(a_pre.logits, b_pre.logits), (a_tree.logits, b_tree.logits), (a_step.logits, b_step.logits),
                 *((a_pre.hidden[k], b_pre.hidden[k]) for k in a_pre.hidden)]:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_torch_cache_compaction_equals_a_fresh_run(tiny):
    """After a tree block and ``compact``, the cache is what running the kept path causally gives."""
    _, model, _ = tiny
    e = TorchEngine(model)
    cache = e.new_cache(64)
    e.forward(np.arange(5, 25), np.arange(20), cache)
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    e.forward([30, 31, 32], [20, 21, 21], cache, block_mask=mask)
    cache.compact(20, [0, 2])
    fresh = e.new_cache(64)
    e.forward(list(range(5, 25)) + [30, 32], np.arange(22), fresh)
    for kept, ref in zip(cache.kv.layers, fresh.kv.layers):
        torch.testing.assert_close(kept.keys, ref.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kept.values, ref.values, rtol=1e-5, atol=1e-5)
    cache.length = 10  # rewinding forgets the tail
    assert cache.length == 10 and cache.kv.layers[0].keys.shape[-2] == 10
    with pytest.raises(ValueError):
        cache.compact(5, [0, 0])
    with pytest.raises(ValueError):
        cache.length = 11


@pytest.mark.parametrize("method", ["ar", "suffix", "lyanna", "peek"])
def test_hf_generate_greedy_equals_model_generate(tiny, method):
    """``lyanna.hf.generate`` returns what ``model.generate`` returns, for every layout and method,
    with EOS and max_new_tokens as transformers has them. The random tiny models never repeat
    themselves and the Lyanna head is unfitted, so ``peek`` (whose first draft is the target's own
    choice) makes sure accepted and rejected nodes both go through the torch cache compaction."""
    path, model, target = tiny
    decoder = lyanna.hf.decoder_for(model)
    if "peek" not in decoder.drafters:
        decoder.add_drafter("peek", PeekingDrafter(decoder.engine))
    tried = accepted = 0
    for prompt in ([1, 40, 41, 42, 40, 41, 42], [1, 100, 101], list(range(3, 60))):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=0)
        out, (result,) = lyanna.hf.generate(model, ids, draft=path / "head", method=method, max_new_tokens=40, budget=None,
                                            eos_token_id=2, return_results=True)
        assert torch.equal(out, ref), (method, prompt)
        tried += result.draft_tokens
        accepted += result.accepted_draft_tokens
    if method in ("lyanna", "peek"):
        assert tried > accepted
    if method == "peek":
        assert accepted > 0


def test_hf_generate_runs_our_forward_over_the_models_own_tensors(tiny):
    """A layout we cover decodes through the device engine, which holds the model's tensors
    themselves (no second copy of the weights) and the oracle engine's host arrays."""
    from lyanna.engines.device import DeviceEngine

    _, model, _ = tiny
    engine = lyanna.hf.decoder_for(model).engine
    assert isinstance(engine, DeviceEngine)
    ours, theirs = engine.layers[1].views(), model.model.layers[1]
    assert ours["mlp.up_proj.weight"].data_ptr() == theirs.mlp.up_proj.weight.data_ptr()
    assert ours["self_attn.k_proj.weight"].data_ptr() == theirs.self_attn.k_proj.weight.data_ptr()
    assert engine.layers[1].down.data_ptr() == theirs.mlp.down_proj.weight.data_ptr()
    assert engine._embed.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    np.testing.assert_array_equal(engine.lm_head, model.get_output_embeddings().weight.detach().numpy())


def test_hf_generate_batches_left_padded_rows(tiny):
    """A left-padded batch gives each row what it gives alone, shorter rows padded on the right."""
    _, model, _ = tiny
    rows = [[1, 40, 41, 42, 40, 41, 42], [1, 100, 101]]
    ids = torch.tensor([rows[0], [0] * 4 + rows[1]])
    mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
    out = lyanna.hf.generate(model, ids, attention_mask=mask, method="suffix", max_new_tokens=12, eos_token_id=5)
    for i, row in enumerate(rows):
        alone = lyanna.hf.generate(model, torch.tensor([row]), method="suffix", max_new_tokens=12, eos_token_id=5)
        new = alone[0, len(row):].tolist()
        assert out[i, ids.shape[1]:ids.shape[1] + len(new)].tolist() == new
        assert out[i, ids.shape[1] + len(new):].eq(0).all()  # the pad token of the tiny models
    with pytest.raises(LyannaError, match="left"):
        lyanna.hf.generate(model, ids, attention_mask=torch.tensor([[1] * 7, [1] * 3 + [0] * 4]), max_new_tokens=2)


def test_custom_generate_runs_inside_model_generate(tiny):
    path, model, _ = tiny
    ids = torch.tensor([[1, 40, 41, 42, 40, 41, 42]])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0,
                         custom_generate=lyanna.hf.custom_generate, draft=str(path / "head"))
    assert torch.equal(out, ref)
    with pytest.raises(LyannaError, match="RepetitionPenalty"):
        model.generate(ids, max_new_tokens=4, repetition_penalty=1.3, custom_generate=lyanna.hf.custom_generate)


def test_a_draft_for_another_model_is_refused(tiny, tmp_path):
    path, model, _ = tiny
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    with pytest.raises(LyannaError, match="different|another|fingerprint|trained for"):
        lyanna.hf.generate(hf_model(other), torch.tensor([[1, 2, 3]]), draft=path / "head", max_new_tokens=4)


def test_hf_generate_sampling_is_seeded_by_torch(tiny):
    _, model, _ = tiny
    ids = torch.tensor([[1, 40, 41]])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(lyanna.hf.generate(model, ids, method="suffix", max_new_tokens=16, do_sample=True, temperature=1.0))
    torch.manual_seed(8)
    other = lyanna.hf.generate(model, ids, method="suffix", max_new_tokens=16, do_sample=True, temperature=1.0)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], other)


# --- sampling keeps the target distribution on the torch backend ---------------------------------

def small_vocab_hf_model(target):
    """The numpy test target of ``test_speculative`` as a Hugging Face Llama with the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = target.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                      max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in target.weights.items()})
    return model


@pytest.fixture(scope="module")
def torch_small_decoder():
    target = small_vocab_target()
    d = Decoder(target, engine=TorchEngine(small_vocab_hf_model(target), config=target.config))
    head = init_eagle_head(d.engine, target.weights)  # unfitted: losslessness must not depend on quality
    d.add_drafter("eagle", EagleDrafter(DraftHead(d.engine, head.numpy_weights()), tap=2, depth=3, topk=2, width=2))
    ly = init_lyanna_head(d.engine, target.weights, np.arange(SMALL_VOCAB)[::-1].copy(), rank=4)
    with torch.no_grad():
        ly.ti.b.normal_(0, 1.0)
    w = {**ly.numpy_weights(), "ti.hot": np.array([0, 1, 2, 3])}
    d.add_drafter("lyanna", LyannaDrafter(ChainHead(d.engine, w), TokenInfo(w["ti.a"], w["ti.b"], w["ti.hot"]), taps=(2,),
                                          depth=3, topk=2, width=2))
    d.add_drafter("peek", PeekingDrafter(d.engine))
    return d


TORCH_GRID = ["t1", "t0.6-topk3"]
TORCH_SAMPLES = 600


@pytest.mark.parametrize("grid", TORCH_GRID)
@pytest.mark.parametrize("method", ["ar", "eagle", "lyanna", "peek"])
def test_torch_sampled_output_has_the_target_joint_distribution(torch_small_decoder, grid, method):
    params, horizon = SAMPLING_GRID[grid]
    s = sample_outputs(torch_small_decoder, method, params, horizon, TORCH_SAMPLES)
    if method != "ar":
        assert 0 < s.accepted < s.draft_tokens
    assert chi2_pvalue(s.counts, exact_joint(torch_small_decoder.engine, params, horizon)) > ALPHA


def test_torch_backend_fails_a_wrong_acceptance_rule(torch_small_decoder, monkeypatch):
    """The control: the same statistic on the torch backend rejects a broken verifier."""
    params, horizon = SAMPLING_GRID["t1"]
    monkeypatch.setattr(verify_module, "_deterministic_step", no_residual)
    s = sample_outputs(torch_small_decoder, "peek", params, horizon, TORCH_SAMPLES)
    assert chi2_pvalue(s.counts, exact_joint(torch_small_decoder.engine, params, horizon)) < ALPHA


# --- the default model ---------------------------------------------------------------------------

PROMPTS = ["Explain in a few sentences why the sky is blue.", "Write a python function that adds two numbers."]


@pytest.mark.slow
def test_hf_generate_equals_model_generate_on_the_default_model(default_decoder, hf_default):
    """The shipped Lyanna head on the Hugging Face model: ``model.generate``'s tokens, drafts accepted."""
    draft = DRAFTS_DIR / "smollm2-135m-instruct" / "lyanna"
    for prompt in PROMPTS:
        ids = torch.tensor([default_decoder.encode(prompt)])
        ref = hf_default.generate(ids, max_new_tokens=48, do_sample=False)
        # whole trees: on a CPU the auto budget may stop drafting that does not pay, and this checks the drafts
        out, (result,) = lyanna.hf.generate(hf_default, ids, draft=draft, max_new_tokens=48, return_results=True,
                                            budget=None)
        assert result.method == "lyanna" and result.accepted_draft_tokens > 0
        assert torch.equal(out, ref)
        assert torch.equal(hf_default.generate(ids, max_new_tokens=48, do_sample=False, draft=str(draft),
                                               custom_generate=lyanna.hf.custom_generate), ref)


@pytest.mark.slow
def test_cli_torch_backend_generates_what_the_numpy_engine_does(default_decoder, capsys):
    ar = default_decoder.generate(default_decoder.encode(PROMPTS[0]), GenerationRequest(max_new_tokens=48))
    assert main(["--backend", "torch", "generate", "--method", "lyanna", "--max-new-tokens", "48", "--json", PROMPTS[0]]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == "lyanna" and out["text"] == ar.text and out["new_tokens"] == ar.new_tokens
    assert main(["--device", "cuda", "generate", "x"]) == 1
    assert "--backend torch" in capsys.readouterr().err


@pytest.mark.slow
def test_torch_backend_bench_every_method_equals_ar(default_target, default_decoder):
    """``lyanna --backend torch bench``'s report: every method equal to the torch ``ar``, which
    equals the numpy engine's ``ar``."""
    target, engine = load_torch_target("smollm2-135m-instruct")
    decoder = Decoder(target, engine=engine)
    questions = load_questions(None, 2)
    report = run_bench(decoder, ["ar", "suffix", "eagle", "lyanna"], questions, 32, progress=False)
    rows = {r["method"]: r for r in report["results"]}
    assert all(rows[m]["equal_to_ar"] for m in ("suffix", "eagle", "lyanna")), rows
    for q in questions:
        ids = decoder.encode(q.prompt)
        req = GenerationRequest(max_new_tokens=32)
        assert decoder.generate(ids, req).tokens == default_decoder.generate(ids, req).tokens


def test_a_16_bit_model_keeps_the_heads_trained_for_it(tiny):
    """In bfloat16 the drafters still see the checkpoint's float32 embedding and LM head, so the
    head's fingerprint matches and it drafts; the output has the requested length."""
    from transformers import AutoModelForCausalLM

    path, _, target = tiny
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    engine = TorchEngine(model)
    assert engine.name == "torch-cpu-bfloat16"
    np.testing.assert_array_equal(engine.lm_head, target.weights["lm_head.weight"])
    out, (result,) = lyanna.hf.generate(model, torch.tensor([[1, 40, 41]]), draft=path / "head", max_new_tokens=8,
                                        eos_token_id=[], budget=None, return_results=True)
    assert out.shape == (1, 11) and result.method == "lyanna" and result.draft_tokens > 0
