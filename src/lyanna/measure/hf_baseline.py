"""Hugging Face ``generate()`` on the same weights: the external peer for benchmarks and tests.
The bench runs it in a child process (``peers.py``), one for both ``hf`` and ``hf-pld``."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from ..decoding.decoder import GenerationResult
from .peers import Peer


def hf_peer(model_dir: Path, eos_token_ids: Sequence[int], device: str, dtype: str,
            prompt_lookup: int | None = None) -> Peer:
    """The child-process peer for ``hf`` (``prompt_lookup`` tokens: ``hf-pld``); both methods
    share one child, so the model loads once. The child gets no tokenizer: the runner decodes."""
    return Peer(kind="hf", factory=f"{__name__}:HFGenerate",
                kwargs={"model_dir": model_dir, "tokenizer": None, "eos_token_ids": [int(t) for t in eos_token_ids],
                        "device": device, "dtype": dtype},
                call={"prompt_lookup": prompt_lookup} if prompt_lookup else {})


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_time is None:  # call 1 is the prompt
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerate:
    """Greedy ``model.generate`` with the same EOS tokens as our decoder, on the device and in the
    dtype of the engine it is compared with (fp32 on the CPU); with ``prompt_lookup`` it is
    Hugging Face's prompt lookup decoding (method ``hf-pld``). Without a ``tokenizer`` a result's
    text is left empty (the bench's runner decodes it, off the clock)."""

    def __init__(self, model_dir: Path, tokenizer: Any, eos_token_ids: Sequence[int], device: str = "cpu",
                 dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, prompt_lookup: int | None = None) -> GenerationResult:
        torch = self.torch
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([list(prompt_ids)], device=self.device),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.eos_token_ids,
                pad_token_id=self.eos_token_ids[0],
                streamer=clock,
                **({"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}),
            )
        t1 = time.perf_counter()
        tokens = out[0, len(prompt_ids):].tolist()
        return GenerationResult(
            method="hf-pld" if prompt_lookup else "hf",
            prompt_tokens=len(prompt_ids),
            tokens=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else "",
            finish_reason="stop" if tokens and tokens[-1] in self.eos_token_ids else "length",
            prefill_seconds=(clock.first_token_time or t1) - t0,
            seconds=t1 - t0,
            target_passes=0,
        )
