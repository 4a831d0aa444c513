"""Committing blocks of tokens: EOS, stop strings and max_new_tokens end the output exactly."""
from __future__ import annotations

import types

import numpy as np

from lyanna.decoding.stopping import OutputTracker, text_decoder


class CharTokenizer:
    """Token i decodes to chr(i); token 0 is EOS. Enough to test the tracker's logic exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def toks(text):
    return [ord(c) for c in text]


def test_stop_string_inside_a_block_cuts_exactly():
    streamed = []
    t = OutputTracker(CharTokenizer(), [0], 100, stop=["END"], on_text=streamed.append)
    taken = t.extend(toks("abc"))
    assert taken == 3 and not t.finished
    taken = t.extend(toks("dEN") + toks("Dxyz"))  # the stop string completes at the 7th token
    assert taken == 4
    assert t.finish_reason == "stop"
    assert t.text == "abcd"
    assert t.tokens == toks("abcdEND")
    assert "".join(streamed) == "abcd"  # nothing past the stop was ever streamed


def test_partial_stop_string_is_held_back_while_streaming():
    streamed = []
    t = OutputTracker(CharTokenizer(), [0], 100, stop=["STOP"], on_text=streamed.append)
    t.extend(toks("hello ST"))
    assert "".join(streamed) == "hello "  # "ST" could start "STOP"
    t.extend(toks("ar"))
    assert "".join(streamed) == "hello STar"
    assert not t.finished


def test_eos_inside_a_block_ends_there():
    t = OutputTracker(CharTokenizer(), [0], 100)
    taken = t.extend(toks("ab") + [0] + toks("cd"))
    assert taken == 3
    assert t.finish_reason == "stop"
    assert t.tokens == toks("ab") + [0]
    assert t.text == "ab"


def test_max_new_tokens_inside_a_block():
    t = OutputTracker(CharTokenizer(), [0], 5)
    assert t.extend(toks("abc")) == 3
    assert t.extend(toks("defgh")) == 2
    assert t.finish_reason == "length"
    assert t.tokens == toks("abcde")
    assert t.extend(toks("z")) == 0


def test_earliest_of_several_stop_strings_wins():
    t = OutputTracker(CharTokenizer(), [0], 100, stop=["xyz", "b"])
    t.extend(toks("axyzb"))
    assert t.text == "a"
    assert t.tokens == toks("axyz")


def test_real_tokenizer_multibyte_text_streams_whole_characters(tiny_decoder):
    tok = tiny_decoder.tokenizer
    text = "héllo → wörld ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    streamed = []
    t = OutputTracker(tok, tiny_decoder.eos_token_ids, 100, on_text=streamed.append)
    for i in ids:
        t.extend([i])
    assert t.text == text
    assert "".join(streamed) == text
    assert all("\ufffd" not in s for s in streamed)


def test_the_backend_decodes_what_the_tokenizer_decodes(tiny_decoder, monkeypatch):
    """``text_decoder`` goes straight to the Rust backend only where transformers' decode would
    return the backend's text as it is: the same text for any ids (special tokens skipped, a
    multi-byte character cut anywhere) without the Python decode being called; a tokenizer that
    asks for clean-up or overrides ``_decode`` is decoded by its own ``decode``."""
    from transformers import PreTrainedTokenizerFast

    tok = tiny_decoder.tokenizer
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, len(tok), n).tolist() for n in rng.integers(0, 10, 300)]
    windows += [[*rng.choice(tok.all_special_ids, 2).tolist(), int(i)] for i in rng.integers(0, len(tok), 30)]
    accents = tok("héllo → wörld ✓", add_special_tokens=False)["input_ids"]
    windows += [accents[i:j] for i in range(len(accents)) for j in range(i, len(accents) + 1)]
    expected = [tok.decode(w, skip_special_tokens=True) for w in windows]
    calls = []
    own = PreTrainedTokenizerFast._decode

    def counted(self, *args, **kwargs):
        calls.append(1)
        return own(self, *args, **kwargs)

    decode = text_decoder(tok)
    monkeypatch.setattr(tok, "_decode", types.MethodType(counted, tok))  # the Python decode, counted from now
    assert [decode(w) for w in windows] == expected and not calls
    decode = text_decoder(tok)  # ``_decode`` overridden: the tokenizer's own decode
    assert [decode(w) for w in windows] == expected and len(calls) == len(windows)
    monkeypatch.undo()
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    decode = text_decoder(tok)  # clean-up asked for: the tokenizer's own decode
    monkeypatch.setattr(tok, "_decode", types.MethodType(counted, tok))
    calls.clear()
    assert [decode(w) for w in windows[:20]] == expected[:20] and len(calls) == 20
