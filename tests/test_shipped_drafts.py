"""The draft heads shipped for the default model: loaded with no arguments, lossless, useful."""
from __future__ import annotations

import json

import pytest

from lyanna.decoding.decoder import DRAFTS_DIR, GenerationRequest

PROMPTS = ["Explain what a hash table is.", "Write a short poem about the sea.", "List three uses of copper."]
SHIPPED = DRAFTS_DIR / "smollm2-135m-instruct"


@pytest.mark.parametrize("arch", ["lyanna", "eagle"])
def test_shipped_checkpoint_is_small_and_has_a_model_card(arch):
    d = SHIPPED / arch
    assert (d / "config.json").is_file() and (d / "README.md").is_file()
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert 0 < size <= 40 * 2**20
    assert json.loads((d / "config.json").read_text())["arch"] == arch
    card = (d / "README.md").read_text()
    assert "lyanna train" in card and "agreement" in card


@pytest.mark.slow
def test_shipped_drafts_load_by_default_and_decode_losslessly(default_decoder):
    for method in ("eagle", "lyanna", "lyanna-noresample", "lyanna-nofusion", "lyanna+suffix"):
        assert method in default_decoder.methods
    assert default_decoder.default_method == "lyanna+suffix"  # with heads: the fastest measured
    accepted = {}
    for prompt in PROMPTS:
        ids = default_decoder.encode(prompt)
        req = GenerationRequest(max_new_tokens=48)
        ar = default_decoder.generate(ids, req)
        for method in ("eagle", "lyanna", "lyanna-nofusion", "lyanna+suffix"):
            out = default_decoder.generate(ids, req, method=method, budget=16)
            assert out.tokens == ar.tokens, (method, prompt)
            accepted[method] = accepted.get(method, 0) + out.accepted_draft_tokens
    # trained heads: their drafts are accepted well beyond chance (tau > 1 on real prompts)
    assert all(n >= 10 for n in accepted.values()), accepted
