"""The shared speculative loop: lossless for every drafter, greedy and sampled."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from lyanna.decoding import verify as verify_module
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.decoding.sampling import SamplingParams, target_probs
from lyanna.drafters.base import Drafter
from lyanna.drafters.eagle import EagleDrafter
from lyanna.drafters.head import DraftHead
from lyanna.drafters.lyanna import ChainHead, LyannaDrafter, TokenInfo
from lyanna.drafters.suffix import SuffixDrafter
from lyanna.drafters.tree import DraftTree
from lyanna.engines.config import ModelConfig
from lyanna.engines.loading import Target
from lyanna.engines.transformer import Transformer
from lyanna.measure.bench import load_questions
from lyanna.training.fit import init_eagle_head, init_lyanna_head

from .conftest import ALPHA, chi2_pvalue, no_residual, p_not_p_over_q

SMALL_VOCAB = 8


class LetterTokenizer:
    """Token i decodes to a letter; enough for the output tracker."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def small_vocab_target(seed=0, eos: tuple[int, ...] = ()) -> Target:
    """A random Llama with a vocabulary of 8 tokens, built in the test."""
    rng = np.random.default_rng(seed)
    cfg = ModelConfig("LlamaForCausalLM", SMALL_VOCAB, 32, 64, 2, 4, 2, 8, 1e-6, 10000.0, None, 256, False, False, eos)
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


class RandomSampledDrafter(Drafter):
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


# The start of the small target's own greedy cycle ("7 4 1 5 2 3 ..."), so suffix drafts are often accepted.
PROMPT = [0, 1, 5, 7, 4, 1, 5, 2, 3, 7, 4, 1, 5]

# Sampling settings of the end-to-end test and the number of output tokens whose joint
# distribution it checks: the first comes from prefill, the others from verification rounds; with
# 4 tokens, trees of depth 2 are verified. Horizons and sample counts keep cells at ~5+ expected.
SAMPLING_GRID = {
    "t1": (SamplingParams(temperature=1.0), 3),
    "t0.6-topk3": (SamplingParams(temperature=0.6, top_k=3), 4),
    "t1.5-topp0.6": (SamplingParams(temperature=1.5, top_p=0.6), 4),
}
N_SAMPLES = 600
METHODS = ["ar", "suffix", "eagle", "lyanna", "lyanna-noresample", "lyanna-nofusion", "lyanna+suffix", "peek",
           "random-sampled"]


def exact_joint(engine: Transformer, params: SamplingParams, horizon: int) -> np.ndarray:
    """The target's exact probability of every ``horizon``-token output after ``PROMPT``, as an
    array with one axis per output position (the chain rule over every prefix it can produce)."""
    probs = np.zeros((SMALL_VOCAB,) * horizon)

    def walk(prefix: list[int], mass: float) -> None:
        ids = PROMPT + prefix
        logits = engine.forward(ids, np.arange(len(ids)), engine.new_cache(len(ids)), logit_rows=[-1]).logits[-1]
        p = target_probs(logits, params)
        for t in np.flatnonzero(p):
            if len(prefix) + 1 == horizon:
                probs[tuple(prefix + [int(t)])] = mass * p[t]
            else:
                walk(prefix + [int(t)], mass * p[t])

    walk([], 1.0)
    return probs


@dataclass
class Sampled:
    counts: np.ndarray  # joint counts of the outputs, one axis per position
    draft_tokens: int
    accepted: int
    accepted_deeper: int  # accepted draft tokens below depth 1: multi-level verification happened


def sample_outputs(decoder: Decoder, method: str, params: SamplingParams, horizon: int, n: int) -> Sampled:
    """``n`` generations with seeds 0..n-1; the whole tree is verified (no budget), so the outcome
    depends on the seeds only."""
    out = Sampled(np.zeros((SMALL_VOCAB,) * horizon), 0, 0, 0)
    for seed in range(n):
        drafter = decoder.drafters.get(method)
        if isinstance(drafter, RandomSampledDrafter):  # its draws: seeded too, independent of the verifier's
            drafter.rng = np.random.default_rng([seed, 1])
        req = GenerationRequest(max_new_tokens=horizon, sampling=replace(params, seed=seed))
        r = decoder.generate(PROMPT, req, method=method, budget=None)
        out.counts[tuple(r.tokens)] += 1
        out.draft_tokens += r.draft_tokens
        out.accepted += r.accepted_draft_tokens
        out.accepted_deeper += sum(a for d, (a, _) in r.extra.get("accepted_by_depth", {}).items() if d > 1)
    return out


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
    variants = {"lyanna": {"policy": "fuse"}, "lyanna-noresample": {"policy": "off"},
                "lyanna-nofusion": {"policy": "reuse", "reuse_min_expected": 0.0},
                "lyanna+suffix": {"policy": "fuse", "suffix": True}}
    for name, knobs in variants.items():
        d.add_drafter(name, LyannaDrafter(ChainHead(d.engine, w), TokenInfo(w["ti.a"], w["ti.b"], w["ti.hot"]), taps=(2,),
                                          depth=3, topk=2, width=2, **knobs))
    return d


@pytest.fixture(scope="module")
def exact_joints(small_decoder):
    return {name: exact_joint(small_decoder.engine, params, horizon) for name, (params, horizon) in SAMPLING_GRID.items()}


@pytest.mark.parametrize("grid", SAMPLING_GRID)
@pytest.mark.parametrize("method", METHODS)
def test_sampled_output_has_the_target_joint_distribution(small_decoder, exact_joints, single_threaded_kernels, method, grid):
    """Chi-square of the joint distribution of whole outputs (not per-position marginals, which a
    rule that correlates positions wrongly would pass) against the target's exact one."""
    params, horizon = SAMPLING_GRID[grid]
    s = sample_outputs(small_decoder, method, params, horizon, N_SAMPLES)
    if method != "ar":  # verification was exercised: drafts were accepted and rejected
        assert 0 < s.accepted < s.draft_tokens
        if horizon > 3:
            assert s.accepted_deeper > 0
    assert chi2_pvalue(s.counts, exact_joints[grid]) > ALPHA


@pytest.mark.parametrize("grid", SAMPLING_GRID)
@pytest.mark.parametrize("step, broken, method", [("_deterministic_step", no_residual, "peek"),
                                                  ("_sampled_step", p_not_p_over_q, "random-sampled")])
def test_a_wrong_acceptance_rule_fails_the_joint_test(small_decoder, exact_joints, single_threaded_kernels,
                                                      monkeypatch, grid, step, broken, method):
    """The control: the same statistic, through the whole loop, rejects a broken rule at every
    sampling setting (so a pass above means something)."""
    params, horizon = SAMPLING_GRID[grid]
    monkeypatch.setattr(verify_module, step, broken)
    s = sample_outputs(small_decoder, method, params, horizon, N_SAMPLES)
    assert chi2_pvalue(s.counts, exact_joints[grid]) < ALPHA


@pytest.fixture(scope="module")
def eos_decoder():
    """The small target with token 6 ('g') as EOS: its greedy outputs loop ("hebfcd..."), so
    suffix drafts are proposed and accepted, and most of them end at EOS within 40 tokens."""
    return Decoder(small_vocab_target(eos=(6,)))


def test_speculative_greedy_equals_ar_with_limits(eos_decoder):
    """Greedy output, finish reason and text are identical to ar under EOS, stops and limits,
    with rounds that commit several tokens at once (the whole tree is verified: no budget, so
    what is drafted does not depend on this machine's timing)."""
    prompts = [[0], [4, 5], [6, 7, 1], [3, 3, 7]]
    accepted, reasons = Counter(), Counter()
    for prompt, max_new, stop in itertools.product(prompts, (1, 5, 40), ((), ("h",), ("dcd",))):
        req = GenerationRequest(max_new_tokens=max_new, stop=stop)
        ar = eos_decoder.generate(prompt, req)
        sp = eos_decoder.generate(prompt, req, method="suffix", budget=None)
        assert (sp.tokens, sp.text, sp.finish_reason) == (ar.tokens, ar.text, ar.finish_reason)
        assert sp.new_tokens <= max_new and sp.accepted_draft_tokens <= sp.draft_tokens
        if max_new == 1:  # the one token comes from prefill: nothing to draft
            assert sp.draft_tokens == 0
        accepted[tuple(prompt)] += sp.accepted_draft_tokens
        reasons[sp.finish_reason] += 1
    assert all(accepted[tuple(p)] > 0 for p in prompts), accepted  # drafts were proposed and committed
    assert set(reasons) == {"stop", "length"}  # EOS or a stop string, and the limit, both happened


def test_streamed_text_never_passes_a_stop(eos_decoder):
    prompt = [0]
    ar = eos_decoder.generate(prompt, GenerationRequest(max_new_tokens=40))
    stop = "cdcdh"
    assert ar.text.find(stop) > 8  # the output contains it, after the loop repeats (drafts accepted)
    streamed = []
    sp = eos_decoder.generate(prompt, GenerationRequest(max_new_tokens=40, stop=(stop,)), method="suffix",
                              on_text=streamed.append, budget=None)
    assert sp.finish_reason == "stop" and stop not in sp.text
    assert "".join(streamed) == sp.text == ar.text[: ar.text.find(stop)]
    assert sp.accepted_draft_tokens > 0  # the text came partly from accepted drafts


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


def test_suffix_matches_are_the_naive_search_as_the_context_grows():
    """``match`` (an index grown token by token) finds what a search of the whole context does:
    the longest suffix of ``min_ngram``..``max_ngram`` tokens seen before, and what followed its
    latest occurrences."""
    def naive(ctx, d, depth):
        for n in range(min(d.max_ngram, len(ctx) - 1), d.min_ngram - 1, -1):
            starts = [e for e in range(n, len(ctx)) if ctx[e - n : e] == ctx[len(ctx) - n :]]
            if starts:
                return n, [ctx[s : s + depth] for s in reversed(starts[-d.branches :])]
        return 0, []

    rng = np.random.default_rng(3)
    found = 0
    for trial in range(40):
        d = SuffixDrafter(max_ngram=4 + trial % 3, min_ngram=1 + trial % 3, branches=1 + trial % 3)
        d.start([], {})
        ctx = list(rng.integers(0, 3 + trial % 4, size=5))
        while len(ctx) < 60:
            ctx += list(rng.integers(0, 3 + trial % 4, size=int(rng.integers(1, 4))))
            got = d.match(ctx, 4)
            assert got == naive(ctx, d, 4), (trial, ctx)
            found += got[0] > 0
    assert found > 500  # most contexts had a match


@pytest.mark.slow
def test_suffix_greedy_equals_ar_on_default_model(default_decoder):
    questions = [q for q in load_questions(limit=26) if q.category in ("summarization", "rag", "coding", "writing")]
    accepted = Counter()
    for q in questions[:5]:
        ids = default_decoder.encode(q.prompt)
        req = GenerationRequest(max_new_tokens=64)
        sp = default_decoder.generate(ids, req, method="suffix", budget=None)
        assert sp.tokens == default_decoder.generate(ids, req).tokens
        accepted[q.category] += sp.accepted_draft_tokens
    assert sum(accepted.values()) > 0, accepted  # summaries and RAG answers copy from the prompt
