"""The AMX path (``intdot_amx``): its tile layout in numpy, its kernel equal to ``intdot``'s rule bit
for bit on every host (the tile products emulated where the CPU has no AMX), its tile code compiled
to tile instructions, and the path run on tiles where the CPU has them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lyanna.engines import intdot, intdot_amx
from .test_intdot import inputs, matrix
from .test_quant import gguf_decoder  # noqa: F401  (the default model on its blocks)

ROWS = (1, 2, 3, 8, 15, 16, 17, 33, 64)  # within one A tile, a full one, and several row groups


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_the_tile_layout_holds_each_pairs_weights_as_tdpbssd_reads_them(kind):
    """B[p, n, t] is weight ``4p + t`` of the block for output ``n`` of the pair: the numpy model
    of the tile, checked against the row layout, not against the kernel."""
    d, m, q = matrix(kind, 64, 96, seed=3)
    packed = intdot.pack(d, m, q)
    tiles, groups, nb, g, _ = packed[2].shape
    tw = groups * g * intdot.OUT
    for tile in range(tiles):
        for pair in range(tw // intdot_amx.PAIR):
            for block in range(nb):
                b = intdot_amx.tile_model(*packed, tile, pair, block)
                rows = q[tile * tw + pair * intdot_amx.PAIR:][: intdot_amx.PAIR, block * 32 : (block + 1) * 32]
                assert np.array_equal(b.transpose(1, 0, 2).reshape(intdot_amx.PAIR, 32), rows)


def test_the_tile_products_of_the_model_are_the_blocks_integer_sums():
    """``TDPBSSD``'s sums over the modelled tiles equal the block's integer dot products."""
    d, m, q = matrix("Q8_0", 32, 64, seed=4)
    packed = intdot.pack(d, m, q)
    xq = np.random.default_rng(5).integers(-127, 128, (16, 64)).astype(np.int8)
    for block in range(2):
        b = intdot_amx.tile_model(*packed, 0, 0, block).astype(np.int64)
        a = xq[:, block * 32 : (block + 1) * 32].reshape(16, 8, 4).astype(np.int64)
        sums = np.einsum("rpt,pnt->rn", a, b)
        assert np.array_equal(sums, xq[:, block * 32 : (block + 1) * 32].astype(np.int64) @ q[:16, block * 32 : (block + 1) * 32].T.astype(np.int64))


def _amx(x: np.ndarray, packed) -> np.ndarray:
    xq, dx, xs, _ = intdot.quantize_rows(x)
    out = np.full((x.shape[0], packed[2].shape[0] * packed[2].shape[1] * packed[2].shape[3] * intdot.OUT), np.nan,
                  np.float32)
    intdot_amx.amx_by_tiles(xq, dx, xs, *packed, out)
    return out


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("shape,half", [((32, 32), False), ((64, 96), True), ((1536, 608), True), ((96, 64), False)])
def test_the_tile_kernel_equals_the_rule_at_every_block_size(kind, shape, half):
    """Bit for bit ``intdot.reference`` at 1..64 rows: the rows of a block have the bits each row
    has alone, on tiles and on every other path."""
    d, m, q = matrix(kind, *shape, seed=1, half=half)
    packed = intdot.pack(d, m, q)
    assert packed[2].shape[3] % 2 == 0  # groups of an even number of vectors: the kernel's pairs
    x = inputs(max(ROWS), shape[1], seed=2)
    want = intdot.reference(x, d, m, q)
    for rows in ROWS:
        assert np.array_equal(_amx(x[:rows], packed), want[:rows]), (rows, kind, shape)


def test_the_tile_configuration_names_each_registers_shape():
    config = np.empty(64, np.uint8)
    intdot_amx._configure(config, 5)
    assert config[0] == 1 and not config[1:16].any()
    widths = config[16:32].view(np.uint16)
    assert list(widths[:6]) == [64, 32, 64] * 2 and not widths[6:].any()  # C: 16 int32, A: 32 bytes, B: 64 bytes
    assert list(config[48:54]) == [5, 5, 8] * 2 and not config[54:].any()


def test_the_amx_path_is_asked_for_by_name_and_only_where_the_cpu_runs_it(monkeypatch):
    assert intdot.PATH != intdot.AMX or os.environ.get("LYANNA_INTDOT_PATH") == intdot.AMX
    assert (intdot.AMX in intdot.PATHS) == intdot_amx.AVAILABLE
    monkeypatch.setenv("LYANNA_INTDOT_PATH", intdot.AMX)
    if intdot_amx.AVAILABLE:
        assert intdot._chosen_path() == intdot.AMX
    else:
        with pytest.raises(ValueError, match="this CPU runs"):
            intdot._chosen_path()


_COMPILE = textwrap.dedent("""
    import numpy as np
    from numba import njit
    from lyanna.engines import intdot_amx as amx
    assert amx.HAS_AMX

    @njit
    def tile(q, xq, dx, xs, d, m, out, weights, sums, config):
        amx._configure(config, 16)
        amx._tile_configure(config)
        amx._pairs(q, 0, 18, 4, 128, xq, 0, 576, dx, xs, 0, d, m, 0, out, 0, 576, 16, 1, weights, sums, 2)

    tile.compile("(uint8[::1], int8[::1], float32[::1], float32[::1], uint16[::1], uint16[::1], float32[::1], "
                 "int8[::1], int32[::1], uint8[::1])")
    block = tile
    print(block.inspect_asm(block.signatures[0]))
""")


def test_the_tile_code_compiles_to_tile_instructions(tmp_path):
    """Built for a CPU with AMX (LLVM told so, on any host) the product is ``ldtilecfg``, tile loads,
    ``tdpbssd`` and a tile store; nothing runs, so any CPU checks it."""
    from llvmlite.binding import get_host_cpu_features

    features = get_host_cpu_features().flatten() + ",+amx-tile,+amx-int8,-prefer-256-bit"
    env = dict(os.environ, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path))
    asm = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert asm.returncode == 0, asm.stderr[-3000:]
    for op in ("ldtilecfg", "tilezero", "tileloadd", "tdpbssd", "tilestored"):
        assert op in asm.stdout, op


@pytest.mark.skipif(not intdot_amx.AVAILABLE, reason="the CPU has no AMX-INT8 (or Linux did not grant the tiles)")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_on_tiles_the_amx_path_equals_the_rule(kind):
    """Where the CPU has AMX: ``int_linear_kernel`` on the amx path, blocks of fewer than
    ``AMX_ROWS`` rows on VNNI and larger ones on tiles, bit for bit the rule."""
    d, m, q = matrix(kind, 1536, 608, seed=1, half=True)
    packed = intdot.pack(d, m, q)
    x = inputs(max(ROWS), 608, seed=2)
    want = intdot.reference(x, d, m, q)
    for rows in ROWS:
        out = np.empty((rows, 1536), np.float32)
        intdot.int_linear_kernel(x[:rows], *packed, out, intdot.ALL_PATHS.index(intdot.AMX))
        assert np.array_equal(out, want[:rows]), rows


@pytest.mark.slow
def test_whole_passes_and_drafted_replies_have_the_same_bits_on_the_amx_path(gguf_decoder, monkeypatch):
    """The default model on its blocks, the amx path against the CPU's first path: a prompt's
    logits (its rows on tiles) and a reply drafted by lyanna (blocks of tree rows verified on tiles,
    smaller blocks elsewhere; the head's own matrices too) are the same bits. Tiles emulated where
    the CPU has no AMX."""
    from lyanna.decoding.decoder import GenerationRequest

    engine = gguf_decoder.engine
    prompt = gguf_decoder.encode("Name three rivers in Europe.")

    def run():
        logits = engine.forward(prompt, np.arange(len(prompt)), engine.new_cache(len(prompt))).logits
        reply = gguf_decoder.generate(prompt, GenerationRequest(max_new_tokens=24), method="lyanna", budget=16)
        return logits, reply.tokens

    first = run()
    monkeypatch.setattr(intdot, "PATH", intdot.AMX)
    assert intdot.path_index() == len(intdot.ALL_PATHS) - 1
    on_tiles = run()
    assert np.array_equal(on_tiles[0], first[0]) and len(prompt) >= intdot.AMX_ROWS
    assert on_tiles[1] == first[1]
