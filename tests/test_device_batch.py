"""Greedy replies of many sequences on one batched cache (``engines.device_batch``): each reply is
the one the device engine gives its prompt alone, whatever the rows, refills and prefill chunks,
in every layer layout (a Mistral window crossed), eager and compiled. ``LYANNA_TEST_DEVICE=cuda``
runs them on a GPU, CUDA graphs included."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.engines import device_batch
from lyanna.engines.device import DeviceEngine
from lyanna.engines.device_batch import BatchedGreedy, greedy_replies
from lyanna.engines.loading import load_target

from .conftest import make_tiny_model
from .test_torch_backend import LAYOUTS

DEVICE = os.environ.get("LYANNA_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", params=LAYOUTS, ids=[a for a, _ in LAYOUTS])
def tiny(request, tmp_path_factory):
    arch, overrides = request.param
    return load_target(make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides))


def _alone(engine: DeviceEngine, target, prompts, new: int) -> list[list[int]]:
    decoder = Decoder(target, default_drafts=False, engine=engine)
    return [decoder.generate(p, GenerationRequest(max_new_tokens=new, eos_token_ids=())).tokens for p in prompts]


def _prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]


def test_batched_replies_are_each_prompts_own(tiny, monkeypatch):
    """9 prompts of 1-29 tokens on 1, 3 and 4 rows (refilled one or two at a time, prefills cut
    to a few prompts each), 20 new tokens (past the window of 16): the replies alone; a stop
    token ends a reply there (kept) and its row takes the next prompt."""
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    prompts = _prompts(tiny.config.vocab_size, 9)
    want = _alone(e, tiny, prompts, 20)
    monkeypatch.setattr(device_batch, "PREFILL_TOKENS", 40)
    for rows in (1, 3, 4):
        assert greedy_replies(e, prompts, 20, (), rows) == want, rows
    stop = want[4][6]
    ended = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    assert sum(len(a) < 20 for a in ended) >= 1
    order = []
    gen = BatchedGreedy(e, 3, 50)
    got = dict((i, r) for i, r in gen.replies(prompts, 20, [stop], refill=2) if not order.append(i))
    assert [got[i] for i in range(len(prompts))] == ended and sorted(order) == list(range(len(prompts)))
    assert greedy_replies(e, prompts, 1, (), 4) == [w[:1] for w in want]


def test_compiled_batched_replies_equal_the_eager_ones(tiny):
    """The layer's halves compiled (the default on a GPU) give the eager replies."""
    if tiny.config.sliding_window is None and tiny.config.attention_bias:  # two layouts are enough here
        pytest.skip("covered by the other layouts")
    prompts = _prompts(tiny.config.vocab_size, 5, seed=1)
    eager = greedy_replies(DeviceEngine(tiny.config, tiny.weights, DEVICE, compiled=False), prompts, 12, (), 2)
    assert greedy_replies(DeviceEngine(tiny.config, tiny.weights, DEVICE, compiled=True), prompts, 12, (), 2) == eager


def test_bad_input_is_refused(tiny):
    e = DeviceEngine(tiny.config, tiny.weights, DEVICE)
    with pytest.raises(ValueError, match="rows"):
        BatchedGreedy(e, 0, 64)
    gen = BatchedGreedy(e, 2, 32)
    with pytest.raises(ValueError, match="prompt 1 has 0 tokens"):
        list(gen.replies([[1, 2], []], 8, ()))
    with pytest.raises(ValueError, match="prompt 0 has 30 tokens"):
        list(gen.replies([list(range(30))], 8, ()))
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(gen.replies([[1]], 0, ()))
    assert greedy_replies(e, [], 8, (), 4) == []


def test_the_datagen_script_measures_each_row_count(tmp_path):
    """`scripts/measure-datagen.py` (a GPU bench step) on the tiny model: a result for each row
    count, its reply tokens over its seconds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import make_tiny_model

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "datagen.json"
    subprocess.run([sys.executable, str(repo / "scripts" / "measure-datagen.py"), "--model",
                    str(make_tiny_model(tmp_path / "tiny")), "--rows", "2,3", "--prompts", "1", "--max-new-tokens", "4",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert [r["rows"] for r in got["results"]] == [2, 3] and got["device"] == "device-cpu-float32"
    for r in got["results"]:
        assert r["prompts"] == r["rows"] and 0 < r["reply_tokens"] <= 4 * r["prompts"]
        assert r["reply_tokens_per_s"] == pytest.approx(r["reply_tokens"] / r["seconds"], rel=0.01)
