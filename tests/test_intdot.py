"""The integer kernel (``intdot``): every instruction-set path equals the numpy statement of its
rule bit for bit, whatever the number of rows, the layout or the tile, and the layouts round-trip."""
from __future__ import annotations

import numpy as np
import pytest

from lyanna.engines import intdot

ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 15, 16, 33)  # 6 and more on few tiles: even shares of up to 8 rows


def matrix(kind: str, n: int, k: int, seed: int, half: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-layout ``(d, m, q)`` with the value range of a GGUF block type; ``half``: scales that
    fp16 holds exactly, as a GGUF's (the kernel then reads them as fp16)."""
    rng = np.random.default_rng(seed)
    low, high = {"Q4_1": (0, 16), "Q4_0": (-8, 8), "Q8_0": (-128, 128)}[kind]  # -128: |q| = 128 still fits the sign trick
    q = rng.integers(low, high, (n, k)).astype(np.int8)
    q[0, :32] = high - 1  # a block of extreme weights
    d = (rng.random((n, k // 32)) * 0.02).astype(np.float32)
    m = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32) if kind == "Q4_1" else np.zeros_like(d)
    if half:
        d, m = (a.astype(np.float16).astype(np.float32) for a in (d, m))
        d[0, 0] = 2.0 ** -24  # the smallest subnormal fp16
    return d, m, q


def inputs(rows: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 3
    x[0, :32] = 0  # a block of zeros: step 0
    if rows > 1:
        x[1, 32:64] = 1e-30  # a block of tiny values
        x[1, :32] *= 1e4  # and one of large ones
    return x


@pytest.mark.parametrize("path", intdot.PATHS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("shape,half", [((8, 32), False), ((64, 96), False), ((1040, 608), False), ((64, 96), True),
                                        ((1040, 608), True), ((24, 64), True), ((1536, 64), False)])
def test_each_path_equals_the_reference(path, kind, shape, half):
    d, m, q = matrix(kind, *shape, seed=1, half=half)
    packed = intdot.pack(d, m, q)
    assert (packed[0].dtype == np.uint16) == (half and intdot.HAS_F16C)  # fp16 scales only where exact
    assert (packed[1].shape[-1] == 0) == (kind != "Q4_1")  # an all-zero m is left out
    tiles = packed[2].shape[0]
    if shape[0] == 1040:  # many tiles (``MANY_TILES``): row groups of up to GROUP, crossed by ROWS
        assert tiles >= intdot.WIDE_TILES  # and split by tiles at every block size
    elif shape[0] == 1536:  # many tiles but not wide: by tiles up to ROW_SHARES_WIDE rows, by rows from there
        assert intdot.MANY_TILES <= tiles < intdot.WIDE_TILES and intdot.ROW_SHARES_WIDE <= max(ROWS)
    else:  # few tiles: blocks of ROW_SHARES_MIN rows and more are shared by rows (24: a chunk of one vector)
        assert packed[2].shape[0] < intdot.MANY_TILES and intdot.ROW_SHARES_MIN <= max(ROWS)
    x = inputs(max(ROWS), shape[1], seed=2)
    want = intdot.reference(x, d, m, q)
    for rows in ROWS:
        out = np.empty((rows, shape[0]), np.float32)
        intdot.int_linear_kernel(x[:rows], *packed, out, intdot.ALL_PATHS.index(path))
        assert np.array_equal(out, want[:rows]), (rows, kind, shape)


def test_rows_go_in_an_even_number_of_shares_as_even_as_they_go():
    """``_by_rows``' shares: an even number (work for both cores of the project's CPU), none over
    ``ROW_SHARE`` rows, sizes at most one row apart, every row in one."""
    for rows in range(intdot.ROW_SHARES_MIN, 200):
        shares = intdot._shares(rows)
        spans = [intdot._share_span(rows, shares, share) for share in range(shares)]
        bounds = [start for start, _ in spans] + [spans[-1][0] + spans[-1][1]]
        sizes = np.diff(bounds)
        assert list(sizes) == [size for _, size in spans], rows
        assert shares % 2 == 0 and bounds[0] == 0 and bounds[-1] == rows, rows
        assert sizes.max() <= intdot.ROW_SHARE and sizes.max() - sizes.min() <= 1 and sizes.min() > 0, rows


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("kind,size", [("Q4_1", intdot.NIBBLE_BYTES), ("Q4_0", intdot.BYTE_BYTES),
                                       ("Q8_0", intdot.BYTE_BYTES)])
def test_layouts_round_trip(kind, size, half):
    d, m, q = matrix(kind, 1040, 96, seed=3, half=half)
    packed = intdot.pack(d, m, q)
    assert packed[2].shape[-1] == size  # 4-bit values packed two to a byte, others one
    for want, got in zip((d, m, q), intdot.unpack(*packed)):
        assert np.array_equal(want, got)
    rows = np.array([1039, 0, 517, 8])
    out = np.empty((len(rows), 96), np.float32)
    intdot.dequantize_rows(*packed, rows, out)
    dense = d.repeat(32, axis=1) * q.astype(np.float32) + m.repeat(32, axis=1)
    assert np.array_equal(out, dense[rows])


def test_the_reference_is_the_stated_rule():
    """A hand-computed case: inputs rounded to 8 bits per block, integer sums, scaled once."""
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [1.27, -0.5, 0.004]  # step 0.01: 127, -50, 0 (0.4 rounds down)
    q = np.zeros((1, 32), np.int8)
    q[0, :3] = [2, 3, 7]
    d, m = np.full((1, 1), 0.5, np.float32), np.full((1, 1), 0.25, np.float32)
    step = np.float32(1.27) / np.float32(127)
    want = np.float32(0.5) * step * np.float32(127 * 2 - 50 * 3) + np.float32(0.25) * np.float32(1.27 - 0.5 + 0.004)
    assert np.isclose(intdot.reference(x, d, m, q)[0, 0], want, rtol=1e-6)


def test_the_path_in_use_is_named():
    assert intdot.PATH in intdot.PATHS and "portable" in intdot.PATHS


def test_a_path_can_be_named_and_a_missing_one_is_refused(monkeypatch):
    monkeypatch.setenv("LYANNA_INTDOT_PATH", "portable")
    assert intdot._chosen_path() == "portable"
    monkeypatch.setenv("LYANNA_INTDOT_PATH", "sse9")
    with pytest.raises(ValueError, match="this CPU runs"):
        intdot._chosen_path()
