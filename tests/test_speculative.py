"""The shared speculative loop: lossless for every drafter, greedy and sampled."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lyanna import verify as verify_module
from lyanna.bench import load_questions
from lyanna.config import ModelConfig
from lyanna.decoding import Decoder, GenerationRequest
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.drafters.lyanna import ChainHead, LyannaDrafter, TokenInfo
from lyanna.drafters.suffix import SuffixDrafter
from lyanna.engine import Transformer
from lyanna.loading import Target
from lyanna.sampling import SamplingParams, target_probs
from lyanna.training.fit import init_eagle_head, init_lyanna_head
from lyanna.tree import DraftTree

SMALL_VOCAB = 8


class LetterTokenizer:
    """Token i decodes to a letter; enough for the output tracker."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def small_vocab_target(seed=0) -> Target:
    """A random Llama with a vocabulary of 8 tokens, built in the test; no EOS."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig("LlamaForCausalLM", SMALL_VOCAB, 32, 64, 2, 4, 2, 8, 1e-6, 10000.0, None, 256, False, False, ())
    w = {"model.embed_tokens.weight": rng.normal(0, 1, (8, 32)), "model.norm.weight": np.ones(32),
         "lm_head.weight": rng.normal(0, 0.3, (8, 32))}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32), "self_attn.v_proj.weight": (16, 32),
                  "self_attn.o_proj.weight": (32, 32), "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
                  "mlp.down_proj.weight": (32, 64)}
        for k, s in shapes.items():
            w[p + k] = rng.normal(0, 0.3, s)
        w[p + "input_layernorm.weight"] = np.ones(32)
        w[p + "post_attention_layernorm.weight"] = np.ones(32)
    return Target("small", None, cfg, {k: v.astype(np.float32) for k, v in w.items()}, LetterTokenizer())


class RandomSampledDrafter:
    """A test double whose children are sampled i.i.d. from a fixed q (the p/q rule applies)."""

    taps = ()
    passes = 0

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.q = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])

    def start(self, prompt_ids, hidden):
        pass

    def commit(self, tokens, hidden):
        pass

    def propose(self, context, max_depth):
        parents = [-1, -1, 0, 0, 1, 2]
        return DraftTree(self.rng.choice(SMALL_VOCAB, size=6, p=self.q), parents,
                         sampled_from={p: self.q for p in set(parents)})


class PeekingDrafter(RandomSampledDrafter):
    """A test double that drafts the target's own top tokens deterministically, like a good
    drafter would: the two best at depth 1, the best after the first at depth 2."""

    def __init__(self, engine: Transformer):
        self.engine = engine

    def propose(self, context, max_depth):
        ctx = list(context)
        logits = self.engine.forward(ctx, np.arange(len(ctx)), self.engine.new_cache(len(ctx) + 1)).logits[-1]
        a, b = np.argsort(-logits)[:2]
        after_a = self.engine.forward(ctx + [a], np.arange(len(ctx) + 1), self.engine.new_cache(len(ctx) + 1)).logits[-1]
        return DraftTree([a, b, int(np.argmax(after_a))], [-1, -1, 0])


PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the suffix drafter proposes every round


N_NEW = 4  # root from prefill, drafts at depths 1-2, bonus tokens


def exact_distribution(engine: Transformer, params: SamplingParams) -> np.ndarray:
    """Exact target probability of every 4-token output, as an [8, 8, 8, 8] array."""
    probs = np.zeros((SMALL_VOCAB,) * N_NEW)
    for seq in itertools.product(range(SMALL_VOCAB), repeat=N_NEW - 1):
        ids = PROMPT + list(seq)
        logits = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids))).logits[len(PROMPT) - 1:]
        p = target_probs(logits, params)
        probs[seq] = p[0, seq[0]] * p[1, seq[1]] * p[2, seq[2]] * p[3]
    return probs


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def sampled_chi2(decoder: Decoder, method: str, params: SamplingParams, n: int, exact: np.ndarray) -> float:
    """Chi-square of the drafted positions: the marginals of tokens 2, 3 and 4 (8 cells each)."""
    counts = np.zeros_like(exact)
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed)
        toks = decoder.generate(PROMPT, GenerationRequest(max_new_tokens=N_NEW, sampling=p), method=method).tokens
        counts[tuple(toks)] += 1
    return sum(
        chi2(counts.sum(axis=other), exact.sum(axis=other)) for other in [(0, 2, 3), (0, 1, 3), (0, 1, 2)]
    )


@pytest.fixture(scope="module")
def small_decoder():
    d = Decoder(small_vocab_target())
    d.add_drafter("peek", PeekingDrafter(d.engine))
    d.add_drafter("random-sampled", RandomSampledDrafter())
    head = init_eagle_head(d.engine, d.target.weights)  # unfitted: losslessness must not depend on quality
    d.add_drafter("eagle", EagleDrafter(DraftHead(d.engine, head.numpy_weights()), tap=2, depth=3, topk=2, width=2))
    ly = init_lyanna_head(d.engine, d.target.weights, np.arange(SMALL_VOCAB)[::-1].copy(), rank=4)
    with torch.no_grad():
        ly.ti.b.normal_(0, 1.0)
    w = {**ly.numpy_weights(), "ti.hot": np.array([0, 1, 2, 3])}
    for name, knobs in {"lyanna": {"policy": "fuse"}, "lyanna-nofusion": {"policy": "reuse", "reuse_min_expected": 0.0}}.items():
        d.add_drafter(name, LyannaDrafter(ChainHead(d.engine, w), TokenInfo(w["ti.a"], w["ti.b"], w["ti.hot"]), tap=2,
                                          depth=3, topk=2, width=2, **knobs))
    return d


PARAMS = SamplingParams(temperature=1.0)
N_SAMPLES = 5000
CHI2_LIMIT = 60.0  # 21 degrees of freedom: p < 2e-5 for a correct sampler


@pytest.fixture(scope="module")
def joint2(small_decoder):
    return exact_distribution(small_decoder.engine, PARAMS)


@pytest.mark.parametrize("method", ["ar", "suffix", "eagle", "lyanna", "lyanna-nofusion", "peek", "random-sampled"])
def test_sampled_output_has_target_distribution(small_decoder, joint2, method):
    assert sampled_chi2(small_decoder, method, PARAMS, N_SAMPLES, joint2) < CHI2_LIMIT


def test_wrong_acceptance_rule_fails_end_to_end(small_decoder, joint2, monkeypatch):
    """The same statistic, through the whole loop, rejects a broken rule (a drafter that
    proposes likely tokens every round makes the bias large; suffix matches are too rare here)."""
    def no_residual(p, candidates, rng):  # the classic bug: a rejected draft keeps its mass
        for i, x in enumerate(candidates):
            if rng.random() < p[x]:
                return i, p
        return None, p

    monkeypatch.setattr(verify_module, "_deterministic_step", no_residual)
    assert sampled_chi2(small_decoder, "peek", PARAMS, N_SAMPLES, joint2) > CHI2_LIMIT


def test_speculative_greedy_equals_ar_with_limits(tiny_decoder):
    """Greedy output, finish reason and text are identical to ar under EOS, stops and limits."""
    prompts = ["abcabcabcabc", "the cat sat on the mat, the cat sat on the", "zzzzzzzz"]
    for prompt, max_new, stop in itertools.product(prompts, (1, 5, 40), ((), ("a",), ("cat s",))):
        ids = tiny_decoder.encode(prompt)
        req = GenerationRequest(max_new_tokens=max_new, stop=stop)
        ar = tiny_decoder.generate(ids, req)
        sp = tiny_decoder.generate(ids, req, method="suffix")
        assert (sp.tokens, sp.text, sp.finish_reason) == (ar.tokens, ar.text, ar.finish_reason)
        assert sp.new_tokens <= max_new


def test_streamed_text_never_passes_a_stop(tiny_decoder):
    ids = tiny_decoder.encode("abcabcabcabcabc")
    ar = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40))
    stop = ar.text[5:8]  # a stop string the output really contains
    streamed = []
    sp = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40, stop=(stop,)), method="suffix",
                               on_text=streamed.append)
    assert sp.finish_reason == "stop" and stop not in sp.text
    assert "".join(streamed) == sp.text == ar.text[: ar.text.find(stop)]


def test_suffix_drafter_builds_trie_from_latest_matches():
    d = SuffixDrafter(max_ngram=3, min_ngram=2, max_depth=3, branches=2, max_nodes=10)
    d.start([], {})
    ctx = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    tree = d.propose(ctx, 10)
    # "5 6" occurred twice before: continued by 7 8 9 (oldest) and 7 1 2 (latest, first)
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(len(tree)) if i not in tree.parents}
    assert paths == {(7, 1, 2), (7, 8, 9)}
    assert len(tree) == 5  # the shared "7" is one node
    assert len(d.propose([1, 2, 3, 4], 10)) == 0  # no repeated suffix
    assert d.propose(ctx, 1).depths.max() == 1


@pytest.mark.slow
def test_suffix_greedy_equals_ar_on_default_model(default_decoder):
    questions = [q for q in load_questions(limit=26) if q.category in ("summarization", "rag", "coding", "writing")]
    for q in questions[:5]:
        ids = default_decoder.encode(q.prompt)
        req = GenerationRequest(max_new_tokens=64)
        assert default_decoder.generate(ids, req, method="suffix").tokens == default_decoder.generate(ids, req).tokens
