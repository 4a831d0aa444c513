"""Committing generated tokens: EOS, stop strings, ``max_new_tokens`` and streamed text.

Speculative decoding commits several tokens at once, which is where other systems leak text past
a stop string or exceed ``max_new_tokens``. Every decoder commits through ``OutputTracker.extend``,
which takes tokens one at a time and stops exactly where the output must end.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, or the same call on its Rust
    ``tokenizers`` backend where transformers' decode would do no more than that: its ``decode``
    and ``_decode`` are the library's own (a subclass that overrides either keeps them) and no
    clean-up of spaces is asked for. The text is the same; the wrapper's Python is not paid, and
    the tracker decodes twice for every committed token, between passes that leave the
    interpreter's code and data cold."""
    def slow(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return slow
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return slow
    own = (PreTrainedTokenizerBase.decode, PreTrainedTokenizerFast._decode)
    if any(getattr(getattr(tokenizer, name), "__func__", None) is not f for name, f in zip(("decode", "_decode"), own)):
        return slow

    def fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    return fast


class OutputTracker:
    """Accumulates output tokens and their text; knows when and why generation finished."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if tokenizer is None and any(stop):
            raise ValueError("stop strings need a tokenizer (to see the text)")
        self._decode = None if tokenizer is None else text_decoder(tokenizer)  # None: token ids only, no text
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(s for s in stop if s)
        self.on_text = on_text
        self.should_cancel = should_cancel
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None  # perf_counter() when the first token was committed
        self._prefix = 0  # incremental detokenization window [_prefix, _read) already in text
        self._read = 0
        self._emitted = 0  # characters of text already streamed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, tokens: Sequence[int]) -> int:
        """Commit ``tokens`` in order until generation ends; returns how many were committed."""
        taken = 0
        if self.should_cancel is not None and not self.finished and self.should_cancel():
            self.finish_reason = "cancelled"  # a client went away or a deadline passed
        for t in tokens:
            if self.finished:
                break
            t = int(t)
            self.tokens.append(t)
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            taken += 1
            if t in self.eos:
                self.finish_reason = "stop"
                break
            self._decode_new()
            if self.finished:
                break
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
        self._stream()
        return taken

    def _decode_new(self) -> None:
        if self._decode is None:
            return
        seen = self._decode(self.tokens[self._prefix : self._read])
        full = self._decode(self.tokens[self._prefix :])
        if len(full) <= len(seen) or full.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        before = len(self.text)
        self.text += full[len(seen) :]
        self._prefix, self._read = self._read, len(self.tokens)
        if self.stop:
            lookback = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, lookback) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"

    def _stream(self) -> None:
        if self.on_text is None:
            return
        safe = len(self.text) if self.finished else len(self.text) - self._held_back()
        if safe > self._emitted:
            self.on_text(self.text[self._emitted : safe])
            self._emitted = safe

    def _held_back(self) -> int:
        """Length of the text tail that could still become a stop string: not streamed yet."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
