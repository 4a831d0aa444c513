"""llama.cpp (through llama-cpp-python) on the model's own GGUF file: the native CPU peer for benchmarks.

It runs the quantized GGUF with its own numerics (int8 activations), so its tokens can differ from
``ar`` on near ties; it is a speed reference, not a losslessness check. Greedy only. ``llamacpp`` evaluates one token per call after the prompt; ``llamacpp-lookup``
adds llama-cpp-python's prompt-lookup drafting (``LlamaPromptLookupDecoding``: n-gram matches in
the context, verified by llama.cpp in one call). llama-cpp-python is optional: it is imported
only when one of these methods is asked for, and only in the child process the bench runs it in
(``peers.py``): a native build that dies of SIGILL takes only its own row down.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Sequence

from ..decoding.decoder import GenerationResult
from ..engines.loading import Target, source_gguf
from ..errors import LyannaError
from .peers import LLAMACPP_HINT, Peer

# How llama-cpp-python was built for the project's measurements (an optional extra, never installed
# by `make setup`): from source without AMX, which these Intel VMs advertise but do not allow
# ("Illegal instruction" otherwise); about 8 minutes on 2 cores.
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" '
           "pip install llama-cpp-python==0.3.36 diskcache")


# Drafted tokens per lookup: llama-cpp-python's documentation advises 10 on a GPU and 2 on a CPU,
# where a longer block costs nearly its length in one-token steps.
LOOKUP_TOKENS = 2
METHODS = ("llamacpp", "llamacpp-lookup")


def llamacpp_peer(target: Target, eos_token_ids: Sequence[int], lookup: bool = False) -> Peer:
    """The child-process peer for method ``llamacpp`` (``lookup``: ``llamacpp-lookup``). A missing
    package or a model that is not a GGUF file is an error here, before any child starts."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise LyannaError(f"method llamacpp needs llama-cpp-python, which is not installed: {INSTALL}")
    gguf = source_gguf(target.name)
    if gguf is None:
        raise LyannaError(f"method llamacpp needs a GGUF model (the default alias or a .gguf file); "
                          f"{target.name} is not one")
    return Peer(kind=METHODS[lookup], factory=f"{__name__}:LlamaCppGenerate", hint=LLAMACPP_HINT,
                kwargs={"gguf": str(gguf), "n_ctx": target.config.max_position_embeddings,
                        "eos_token_ids": [int(t) for t in eos_token_ids], "lookup": lookup})


class LlamaCppGenerate:
    """Greedy generation with ``llama_cpp.Llama`` over the same prompt ids, token by token or
    (``lookup``) with prompt-lookup drafts. Built from plain values so that it can be built in a
    peer's child process; without a ``tokenizer`` a result's text is left empty (the bench's
    runner decodes it)."""

    def __init__(self, gguf: str | Path, n_ctx: int, eos_token_ids: Sequence[int], lookup: bool = False,
                 tokenizer: Any = None):
        try:
            import llama_cpp
        except ImportError:
            raise LyannaError(f"method llamacpp needs llama-cpp-python, which is not installed: {INSTALL}") from None
        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        self.method = METHODS[lookup]
        # With a draft model llama-cpp-python keeps every row's logits, but sizes its logits buffer
        # by the logits_all argument: left False, a context past n_batch tokens fails to broadcast.
        extra = {"draft_model": draft, "logits_all": True} if lookup else {}
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False, **extra)
        self.tokenizer = tokenizer
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.evals = 0
        eval_tokens = self.llm.eval

        def counted_eval(tokens):  # Llama.generate calls self.eval once per forward pass
            self.evals += 1
            return eval_tokens(tokens)

        self.llm.eval = counted_eval

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous call: every run pays its own prefill
        self.evals = 0
        tokens: list[int] = []
        first_token_time = None
        t0 = time.perf_counter()
        if max_new_tokens > 0:
            for token in llm.generate([int(t) for t in prompt_ids], temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
                if first_token_time is None:
                    first_token_time = time.perf_counter()
                tokens.append(int(token))
                if token in self.eos_token_ids or len(tokens) >= max_new_tokens:
                    break  # before the generator evaluates this token: it is never needed
        t1 = time.perf_counter()
        return GenerationResult(
            method=self.method,
            prompt_tokens=len(prompt_ids),
            tokens=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else "",
            finish_reason="stop" if tokens and tokens[-1] in self.eos_token_ids else "length",
            prefill_seconds=(first_token_time or t1) - t0,
            seconds=t1 - t0,
            target_passes=self.evals,
        )
