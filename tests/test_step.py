"""The one-row pass on held threads (``engines/step.py``) gives every step the bits of the fused pass."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from lyanna.engines.base import Block


@pytest.fixture(autouse=True)
def held_one_row_passes(monkeypatch):
    """One-row passes on the held threads (the engine's default, ``step.MOST_ROWS``), whatever it becomes."""
    monkeypatch.setattr("lyanna.engines.step.MOST_ROWS", 1)


TOKENS = [5, 9, 11, 3, 200, 17, 4, 4, 90, 1, 250, 33]  # a prompt of 5, then 7 one-token passes


def held_and_fused(model_dir, kind: str) -> tuple:
    """The tiny model's layers on blocks of ``kind``: an engine whose one-row passes take the held
    threads, and one whose passes all go through ``fused._layers``."""
    from lyanna.engines.loading import load_target
    from lyanna.engines.quant import quantize_blocks
    from lyanna.engines.transformer import Transformer

    target = load_target(model_dir)
    weights = {name: quantize_blocks(w, kind) if w.ndim == 2 and ".layers." in name else w
               for name, w in target.weights.items()}
    held, fused = Transformer(target.config, weights), Transformer(target.config, weights)
    assert held._fused is not None and held._fused._steps is not None
    fused._fused._steps = None
    return held, fused


@pytest.fixture(scope="module", params=["Q8_0", "Q4_1", "Q4_0"])
def step_engines(request, tiny_model_dir):
    return held_and_fused(tiny_model_dir, request.param)


def _steps(engine, tokens: list[int], taps: tuple[int, ...]) -> tuple[list, object]:
    """A prompt's prefill, then one token a pass (each with ``taps``): the outputs and the cache."""
    cache = engine.new_cache(32)
    engine.forward(np.array(tokens[:5]), np.arange(5), cache)
    outs = [engine.forward_batch([Block(tokens=[t], positions=[5 + i], cache=cache, taps=taps)])[0]
            for i, t in enumerate(tokens[5:])]
    return outs, cache


def test_one_row_steps_on_held_threads_equal_the_fused_pass(step_engines):
    held, fused = step_engines
    top = held.config.num_layers
    (a, cache_a), (b, cache_b) = _steps(held, TOKENS, (0, 1, top)), _steps(fused, TOKENS, (0, 1, top))
    for x, y in zip(a, b):
        assert np.array_equal(x.logits, y.logits)
        assert x.hidden.keys() == y.hidden.keys() == {0, 1, top}
        assert all(np.array_equal(x.hidden[t], y.hidden[t]) for t in x.hidden)
    assert cache_a.length == cache_b.length == len(TOKENS)
    assert np.array_equal(cache_a.k[:, :, : len(TOKENS)], cache_b.k[:, :, : len(TOKENS)])
    assert np.array_equal(cache_a.v[:, :, : len(TOKENS)], cache_b.v[:, :, : len(TOKENS)])


@pytest.mark.parametrize("threads", [1, 3])
def test_held_threads_finish_with_fewer_or_more_threads_than_asked(step_engines, threads, monkeypatch):
    """Tasks are claimed, not assigned: one thread does every task itself (no wait on a thread that
    never comes), and more iterations than threads still end, with the same bits."""
    from lyanna.engines import fused as fused_module

    held, fused = step_engines
    tokens = [7, 7, 8, 2, 3, 61, 12, 5]
    want, _ = _steps(fused, tokens, (1,))
    before = numba.get_num_threads()
    monkeypatch.setattr(fused_module, "get_num_threads", lambda: threads)
    try:
        if threads == 1:
            numba.set_num_threads(1)
        got, _ = _steps(held, tokens, (1,))
    finally:
        numba.set_num_threads(before)
    for x, y in zip(got, want):
        assert np.array_equal(x.logits, y.logits) and np.array_equal(x.hidden[1], y.hidden[1])



# The comparison above in a new process, whose passes numba loads from the cache that the tests
# above wrote (``compile_cache``): ``sys.argv[1]`` the tiny model, ``[2]`` the block kind.
_FROM_THE_CACHE = """
import sys
import numpy as np
from lyanna.engines import step
from tests.test_step import TOKENS, _steps, held_and_fused

step.MOST_ROWS = 1
held, fused = held_and_fused(sys.argv[1], sys.argv[2])
pairs = list(zip(_steps(held, TOKENS, (1,))[0], _steps(fused, TOKENS, (1,))[0]))
print(sum(np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden[1], b.hidden[1]) for a, b in pairs), len(pairs))
"""


def test_held_passes_loaded_from_numbas_cache_equal_the_fused_pass(step_engines, tiny_model_dir, request):
    """Compiled in one process and loaded from numba's cache in another, the two passes still
    agree: a fastmath loop (SiLU's) once came out a last bit apart only in passes loaded from the
    cache, which every in-process comparison missed and ``make run`` (after ``make test``) met."""
    kind = request.node.callspec.params["step_engines"]
    out = subprocess.run([sys.executable, "-c", _FROM_THE_CACHE, str(tiny_model_dir), kind], capture_output=True,
                         text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    equal, steps = map(int, out.stdout.split()[-2:])
    assert steps == 7 and equal == steps
