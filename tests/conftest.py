"""Shared fixtures: tiny models built in the test (any architecture) and the real default model."""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@contextlib.contextmanager
def draft_loaded(decoder, path):
    """Load a head into a shared (session) decoder for one test; its own heads come back afterwards."""
    shipped = dict(decoder.drafters)
    decoder.load_draft(str(path))
    try:
        yield
    finally:
        decoder.drafters.clear()
        decoder.drafters.update(shipped)


def stir_upper_layers(head, seed: int = 0, scale: float = 0.05) -> None:
    """Random output projections for a deeper torch head's further layers, which start by passing
    their input through: what they compute then changes the head's output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in head.layers[1:]:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(torch.randn(w.shape, generator=g) * scale)


def make_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer with no merges (256 byte symbols + 3 specials), built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random Hugging Face model (vocab 259) saved as safetensors with a tokenizer."""
    import torch
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = dict(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).float().eval()
    if arch == "qwen2":  # make the attention biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_decoder(tiny_model_dir):
    from lyanna.decoding.decoder import Decoder
    from lyanna.engines.loading import load_target

    return Decoder(load_target(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_examples(tiny_decoder):
    """Training examples for draft heads: prompts plus the tiny model's own greedy replies, with
    the target features at the final-norm tap."""
    from lyanna.decoding.decoder import GenerationRequest
    from lyanna.training.fit import target_features

    seqs = []
    for prompt in ["abc", "hello there", "xyz xyz", "the cat"]:
        ids = tiny_decoder.encode(prompt)
        seqs.append(ids + tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=48)).tokens)
    return target_features(tiny_decoder.engine, seqs, tiny_decoder.engine.config.num_layers)


# The real cache, read before the session points ``LYANNA_CACHE`` elsewhere.
_REAL_CACHE = Path(os.environ.get("LYANNA_CACHE") or Path.home() / ".cache" / "lyanna")


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Every cache write of the session (calibrations, converted GGUF files) lands in a session
    tmp dir, never in the user's cache. The default model's conversion is the one exception: it
    takes ~15 s to rebuild and is the same for every session, so it is shared, read-only, through
    a link (see ``default_target``). Subprocesses (CLI, server) inherit the variable."""
    tmp = tmp_path_factory.mktemp("lyanna-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LYANNA_CACHE", str(tmp))
        _link_default_model(tmp)
        yield tmp


def _link_default_model(cache: Path) -> None:
    """Link the user's converted default model into ``cache`` when it exists."""
    from lyanna.engines.loading import DEFAULT_MODEL

    name = f"{DEFAULT_MODEL}-fp32"
    if (_REAL_CACHE / name / ".complete").is_file() and not (cache / name).exists():
        (cache / name).symlink_to(_REAL_CACHE / name, target_is_directory=True)


@pytest.fixture(scope="session")
def default_target(isolated_cache):
    """The default model, converted once into the user's cache (what ``lyanna`` itself would do)
    and reached through the session cache's link."""
    from lyanna.engines.loading import DEFAULT_MODEL, load_target, resolve_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LYANNA_CACHE", str(_REAL_CACHE))
        resolve_model(DEFAULT_MODEL)
    _link_default_model(isolated_cache)
    # fp32 weights: the engine the Hugging Face comparisons and the training pipeline use; the
    # default for GGUF targets, computing on the file's blocks, is tested in test_quant.py.
    return load_target(weight_format="fp32")


@pytest.fixture(scope="session")
def default_decoder(default_target):
    from lyanna.decoding.decoder import Decoder

    return Decoder(default_target)


@pytest.fixture(scope="session")
def hf_default(default_target):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_target.path), dtype=torch.float32).eval()


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# Statistical tests run on fixed seeds, so each one's outcome is fixed; this level keeps the chance
# that some correct test in the suite fails for a fixed seed small (about 40 such tests: < 0.5%).
ALPHA = 1e-4
MIN_EXPECTED = 5.0  # Pearson's chi-square needs about 5 expected counts per cell


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against the exact ``probs`` (same shape,
    every cell of a joint distribution). Cells expected below ``MIN_EXPECTED`` are pooled into one;
    an observed outcome the target gives probability 0 yields 0. The chi-square tail is the
    Wilson-Hilferty normal approximation (scipy is not a dependency), good to a few percent of
    the p-value at the levels used here."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= MIN_EXPECTED
    obs, exp = list(counts[big]), list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs, exp = np.array(obs), np.array(exp)
    if exp[-1] < MIN_EXPECTED and len(exp) > 2:  # a small pool joins the smallest cell
        k = int(np.argmin(exp[:-1]))
        obs[k] += obs[-1]
        exp[k] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    dof = len(exp) - 1
    if dof < 1:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture
def single_threaded_kernels():
    """Statistical tests run thousands of tiny forward passes, where waking numba's worker
    threads costs far more than the work; one thread gives the same numbers several times faster."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


# Deliberately broken acceptance rules: the statistical tests must fail with them (controls).
def no_residual(p, candidates, rng):
    """The classic bug: a rejected deterministic draft keeps its mass in p."""
    for i, x in enumerate(candidates):
        if rng.random() < p[x]:
            return i, p
    return None, p


def p_not_p_over_q(p, q, candidates, rng):
    """Another bug: a sampled draft accepted with probability p(x) instead of min(1, p(x)/q(x))."""
    import numpy as np

    for i, x in enumerate(candidates):
        if rng.random() < p[x]:
            return i, p
        residual = np.maximum(p - q, 0.0)
        p = residual / residual.sum()
    return None, p
