"""The compiled kernels against plain numpy: any shape, masks included."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lyanna.engines.attention import AttentionSpan, attention, ragged_attention
from lyanna.engines.kernels import linear


@settings(max_examples=60, deadline=None)
@given(m=st.integers(0, 9), n=st.integers(0, 41), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_linear_matches_numpy(m: int, n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    got = linear(x, w)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_linear_takes_a_vector_and_strided_input() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((19, 12), dtype=np.float32)
    x = rng.standard_normal((12, 6), dtype=np.float32).T  # not contiguous
    np.testing.assert_allclose(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear(x[0], w), x[0] @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="linear needs"):
        linear(x, w.T)


@pytest.mark.parametrize("n,k", [(64, 576), (13, 37), (7, 64)])
def test_a_rows_result_does_not_depend_on_its_block(n: int, k: int) -> None:
    """Bit for bit: a token verified inside a block (or a batch) must get the logits it gets
    alone, or greedy speculative output can drift from ``ar`` on a near tie. The earlier kernel,
    with a separate path for an odd last row, failed this."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((9, k)).astype(np.float32)
    alone = np.stack([linear(x[i : i + 1], w)[0] for i in range(9)])
    for m in range(1, 10):
        for start in range(0, 10 - m):
            assert np.array_equal(linear(x[start : start + m], w), alone[start : start + m]), (m, start)


def reference_attention(q, k, v, end, bias):
    n, heads, hd = q.shape
    groups = heads // k.shape[0]
    out = np.empty((n, heads, hd), np.float64)
    for i in range(n):
        for h in range(heads):
            s = k[h // groups, :end].astype(np.float64) @ q[i, h]
            if bias is not None:
                s = s + bias[i]
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[h // groups, :end]
    return out.reshape(n, heads * hd)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 7), start=st.integers(0, 30), kv=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_attention_matches_reference(n: int, start: int, kv: int, groups: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    hd, end = 8, start + n
    q = rng.standard_normal((n, kv * groups, hd), dtype=np.float32)
    k = rng.standard_normal((kv, end + 5, hd), dtype=np.float32)
    v = rng.standard_normal((kv, end + 5, hd), dtype=np.float32)
    within = rng.random((n, n)) < 0.5
    np.fill_diagonal(within, True)
    bias = np.zeros((n, end), np.float32)
    bias[:, start:] = np.where(within, 0.0, -np.inf)
    np.testing.assert_allclose(attention(q, k, v, end, bias), reference_attention(q, k, v, end, bias), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(attention(q, k, v, end, None), reference_attention(q, k, v, end, None), rtol=1e-4, atol=1e-5)


def test_attention_masked_slots_have_no_weight() -> None:
    """A row that sees only its own slot returns that slot's value exactly, whatever the others hold."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 4), dtype=np.float32)
    k = rng.standard_normal((1, 6, 4), dtype=np.float32) * 100
    v = rng.standard_normal((1, 6, 4), dtype=np.float32)
    bias = np.full((1, 6), -np.inf, np.float32)
    bias[0, 3] = 0.0
    out = attention(q, k, v, 6, bias)
    np.testing.assert_allclose(out.reshape(2, 4), np.stack([v[0, 3], v[0, 3]]), rtol=1e-6)
    with pytest.raises(ValueError, match="bias must be"):
        attention(q, k, v, 6, bias[:, :5])


@pytest.mark.parametrize("cached", [5, 37, 100])
@pytest.mark.parametrize("extra", [1, 11, 16, 33])
def test_a_querys_attention_does_not_depend_on_masked_keys_after_it(cached: int, extra: int) -> None:
    """Bit for bit: a token attended alone (keys up to itself) and the same token as the first
    row of a tree block whose later keys it cannot see (what verification against ``ar`` needs).
    The float32 softmax denominator, summed in an order that depends on the number of keys,
    failed this for 5 and 100 cached keys. Several block sizes, so that a key's exp falls in the
    vectorized body of the loop for one count of keys and in its scalar tail for another."""
    rng = np.random.default_rng(cached)
    kv, groups, hd = 3, 3, 64
    q = rng.standard_normal((1, kv * groups, hd)).astype(np.float32)
    k = rng.standard_normal((kv, cached + 1 + extra, hd)).astype(np.float32)
    v = rng.standard_normal((kv, cached + 1 + extra, hd)).astype(np.float32)
    alone = attention(q, k, v, cached + 1, None)
    bias = np.zeros((1, cached + 1 + extra), np.float32)
    bias[0, cached + 1 :] = -np.inf
    assert np.array_equal(attention(q, k, v, cached + 1 + extra, bias), alone)


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("hd", [64, 60, 12, 5])
def test_queries_in_lanes_score_as_keys_in_lanes(half: bool, hd: int) -> None:
    """Bit for bit: a task's scores with its queries in a vector's lanes (``_dot_keys_lanes``, for
    8 queries and more) equal those of a head at a time with the keys in the lanes (``_dot_keys``),
    for every count of queries and keys around the vectors' sizes, over float32 and half caches,
    the task's scores called from a function compiled with fastmath flags as the attention's tasks
    are (they must not reach the scores' arithmetic)."""
    from numba import njit

    from lyanna.engines.attention import LANES_FROM, _scores
    from lyanna.engines.attention_ir import _dot_keys
    from lyanna.engines.kernels import _FAST, LANES

    @njit(fastmath=_FAST)
    def lanes(q, r0, rows, h0, nh, k, kv_at, p, scratch):
        _scores(q, r0, rows, h0, nh, k, kv_at, p, scratch)

    @njit
    def keys(q, r0, rows, h0, nh, k, kv_at, p):
        heads, width = q.shape[1], p.shape[1]
        for i in range(nh):
            _dot_keys(q, (r0 * heads + h0 + i) * hd, heads * hd, rows, k, kv_at, hd, width, p[i * rows :], width)

    rng = np.random.default_rng(hd)
    scratch = np.zeros(2 * hd * LANES + LANES * LANES, np.float32)
    for rows, nh in [(3, 3), (5, 3), (8, 1), (6, 4), (2, 8)]:
        assert rows * nh >= LANES_FROM
        for nkeys in [1, 7, LANES, LANES + 1, 40, 131]:
            q = rng.standard_normal((rows + 2, 9 if nh < 8 else 16, hd)).astype(np.float32)
            k = rng.standard_normal((3, 140, hd)).astype(np.float32)
            if half:
                k = k.astype(np.float16).view(np.uint16)
            want, got = np.full((2, rows * nh, nkeys), np.nan, np.float32)
            keys(q, 1, rows, 1, nh, k, 140 * hd, want)
            lanes(q, 1, rows, 1, nh, k, 140 * hd, got, scratch)
            assert np.array_equal(got, want), (rows, nh, nkeys)


_LANES_ON_OTHER_CPUS = """
import numpy as np
from numba import njit
from lyanna.engines.attention import _scores
from lyanna.engines.attention_ir import _dot_keys
from lyanna.engines.intdot_ir import HAS_F16C
from lyanna.engines.kernels import _FAST, LANES

@njit(fastmath=_FAST)
def lanes(q, k, p, scratch):
    _scores(q, 0, 4, 0, 4, k, 0, p, scratch)

@njit
def keys(q, k, want):
    for i in range(4):
        _dot_keys(q, i * 64, 16 * 64, 4, k, 0, 64, want.shape[1], want[i * 4 :], want.shape[1])

rng = np.random.default_rng(0)
q = rng.standard_normal((4, 16, 64)).astype(np.float32)
k = rng.standard_normal((1, 50, 64)).astype(np.float16)
k = k.view(np.uint16) if HAS_F16C else k.astype(np.float32)  # halves are widened by F16C's instruction
p, want = np.zeros((2, 16, 50), np.float32)
lanes(q, k, p, np.zeros(2 * 64 * LANES + LANES * LANES, np.float32))
keys(q, k, want)
print(LANES, np.array_equal(p, want))
"""


@pytest.mark.parametrize("dropped", [("+avx512",), ("+avx", "+fma", "+f16c", "+vaes", "+vpclmul", "+amx", "+gfni")])
def test_queries_in_lanes_score_as_keys_in_lanes_without_avx512_or_avx(tmp_path, dropped):
    """The same comparison compiled for this CPU without AVX-512 (8 lanes, ymm registers) and
    without AVX at all (8 lanes in two xmm halves, where the sums' barrier takes each half)."""
    import os
    import subprocess
    import sys

    from llvmlite.binding import get_host_cpu_features

    if dropped[0] not in get_host_cpu_features().flatten():
        pytest.skip(f"the CPU has no {dropped[0][1:]} to leave out")
    features = ",".join("-" + f[1:] if f.startswith(dropped) else f for f in get_host_cpu_features().flatten().split(","))
    env = dict(os.environ, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _LANES_ON_OTHER_CPUS], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["8", "True"]


@pytest.mark.parametrize("hd", [64, 12])
@pytest.mark.parametrize("cached", [3, 40])
def test_a_tree_rows_attention_is_its_paths_attention_alone(hd: int, cached: int) -> None:
    """Bit for bit: every row of a tree block (siblings and cousins interleaved among its
    ancestors, rows run several to a task) gets what the same query gets alone over the
    cache holding only its path, as after acceptance. Head sizes with and without dimensions
    past the last full vector."""
    rng = np.random.default_rng(hd + cached)
    kv, groups, n = 3, 3, 13
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    within = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            within[i, j], j = True, parents[j]
    q = rng.standard_normal((n, kv * groups, hd)).astype(np.float32)
    k = rng.standard_normal((kv, cached + n, hd)).astype(np.float32)
    v = rng.standard_normal((kv, cached + n, hd)).astype(np.float32)
    bias = np.zeros((n, cached + n), np.float32)
    bias[:, cached:] = np.where(within, 0.0, -np.inf)
    block = attention(q, k, v, cached + n, bias)
    for i in range(n):
        keep = np.concatenate([np.arange(cached), cached + np.flatnonzero(within[i])])
        alone = attention(q[i : i + 1], k[:, keep], v[:, keep], keep.size, None)
        assert np.array_equal(block[i : i + 1], alone), i


def test_exp_nonpositive_is_float32_exp() -> None:
    """The attention kernel's own exp: within 4e-7 relative of the true value over the whole
    range a softmax meets, exactly 1 at 0, and exactly 0 for masked keys and underflow."""
    from lyanna.engines.kernels import exp_nonpositive

    xs = np.concatenate([-np.geomspace(1e-8, 86.9, 20_000), np.linspace(-86.9, 0, 20_000)]).astype(np.float32)
    got = np.array([exp_nonpositive(x) for x in xs], np.float64)
    true = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(got - true) / true) < 4e-7  # a few float32 ulps (worst 3.0e-7 near -86.6)
    assert exp_nonpositive(np.float32(0.0)) == 1.0
    assert exp_nonpositive(np.float32(-np.inf)) == 0.0 and exp_nonpositive(np.float32(-88.0)) == 0.0


def test_attention_softmax_weights_are_exp_in_vectors_and_alone() -> None:
    """The attention kernel's vectorized softmax weights: exp(x - max) within 4e-7 relative over
    the range a softmax meets, 0 for masked keys and underflow, and each weight the same bits
    in a vector or in the scalar tail (rows of every length up to two vectors, and alone)."""
    from numba import njit

    from lyanna.engines.attention import _softmax_weights

    @njit
    def weights(row):
        _softmax_weights(row, 0, row.shape[0])

    xs = np.concatenate([[0.0], -np.geomspace(1e-8, 86.9, 20_000), np.linspace(-86.9, 0, 20_001),
                         [-np.inf, -88.0, -1e30]]).astype(np.float32)
    got = xs.copy()
    weights(got)
    true = np.exp(xs.astype(np.float64))
    live = xs >= -87
    assert np.max(np.abs(got[live] - true[live]) / true[live]) < 4e-7 and got[0] == 1.0
    assert np.all(got[-3:] == 0.0)
    for size in range(1, 34):
        row = np.concatenate([[0.0], xs[1 : size]]).astype(np.float32)
        weights(row)
        assert np.array_equal(row, got[:size]), size
    for x in xs[1:200]:
        alone = np.array([0.0, x], np.float32)
        weights(alone)
        assert alone[1] == got[np.flatnonzero(xs == x)[0]]


@pytest.mark.parametrize("n", [48, 61, 130])
def test_prefill_attention_matches_reference_and_pytorchs_fused_attention(n: int) -> None:
    """The prefill path (batched GEMMs per key/value head) computes causal attention, and what
    PyTorch's fused ``scaled_dot_product_attention`` computes with the same mask."""
    import torch

    from lyanna.engines.attention import prefill_attention

    rng = np.random.default_rng(n)
    kv, groups, hd = 3, 3, 64
    q = rng.standard_normal((n, kv * groups, hd)).astype(np.float32) / 8
    k = rng.standard_normal((kv, n + 5, hd)).astype(np.float32)  # capacity beyond the prompt
    v = rng.standard_normal((kv, n + 5, hd)).astype(np.float32)
    bias = np.where(np.tril(np.ones((n, n), bool)), 0.0, -np.inf).astype(np.float32)
    got = prefill_attention(q, k, v, bias)
    np.testing.assert_allclose(got, reference_attention(q, k, v, n, bias), rtol=1e-4, atol=1e-5)
    fused = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1), torch.from_numpy(k[:, :n]).repeat_interleave(groups, 0),
        torch.from_numpy(v[:, :n]).repeat_interleave(groups, 0), attn_mask=torch.from_numpy(bias), scale=1.0)
    np.testing.assert_allclose(got, fused.transpose(0, 1).reshape(n, -1).numpy(), rtol=1e-6, atol=1e-6)


def test_prefill_rows_get_the_same_numbers_alone_and_beside_other_rows():
    """``linear_rows``: a prompt's rows (a bulk range, through the GEMM) get the same bits whatever
    rows surround them and wherever they sit in the pass; the other rows get ``linear``'s bits;
    a range shorter than ``BULK_MIN_ROWS`` stays on ``linear``."""
    from lyanna.engines.kernels import BULK_MIN_ROWS, linear, linear_rows

    rng = np.random.default_rng(3)
    x = rng.standard_normal((10 + 2 * BULK_MIN_ROWS + 3, 64), dtype=np.float32)
    w = rng.standard_normal((96, 64), dtype=np.float32)
    a, b = (10, 10 + BULK_MIN_ROWS + 3), (10 + BULK_MIN_ROWS + 3, x.shape[0])
    mixed = linear_rows(x, w, [a, b])
    assert np.array_equal(mixed[a[0]:a[1]], linear_rows(x[a[0]:a[1]], w, [(0, a[1] - a[0])]))
    assert np.array_equal(mixed[:10], linear(x[:10], w))
    np.testing.assert_allclose(mixed, x @ w.T, rtol=1e-4, atol=1e-4)
    short = x[: BULK_MIN_ROWS - 1]
    assert np.array_equal(linear_rows(short, w, [(0, len(short))]), linear(short, w))


@pytest.mark.parametrize("sequences", [2, 3, 5])
def test_ragged_attention_gives_each_sequence_its_numbers_alone(sequences: int) -> None:
    """One launch for several sequences (own caches, ends, masks or none): every row gets the
    bits it gets alone, whatever the batch around it (3 and 5 spans pad the kernel's tuple of
    caches); rows outside every span are left untouched."""
    rng = np.random.default_rng(sequences)
    kv, groups, hd = 3, 3, 64
    spans, lo = [], 2  # rows 0..1 belong to nobody
    for s in range(sequences):
        rows, end = [1, 4, 2, 7, 1][s], [9, 30, 17, 64, 3][s]
        k = rng.standard_normal((kv, end + 5, hd)).astype(np.float32)
        v = rng.standard_normal((kv, end + 5, hd)).astype(np.float32)
        bias = None
        if rows > 1:
            bias = np.where(rng.random((rows, end)) < 0.3, -np.inf, 0.0).astype(np.float32)
            bias[:, 0] = 0.0  # every row sees at least one key
        spans.append(AttentionSpan(lo, lo + rows, k, v, end, bias))
        lo += rows
    q = rng.standard_normal((lo, kv * groups, hd)).astype(np.float32)
    out = np.full((lo, kv * groups * hd), 7.0, np.float32)
    ragged_attention(q, spans, out)
    assert np.all(out[:2] == 7.0)
    for sp in spans:
        alone = attention(q[sp.lo : sp.hi], sp.k_cache, sp.v_cache, sp.end, sp.bias)
        assert np.array_equal(out[sp.lo : sp.hi], alone)
        np.testing.assert_allclose(alone, reference_attention(q[sp.lo : sp.hi], sp.k_cache, sp.v_cache, sp.end, sp.bias),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="bias must be"):
        ragged_attention(q, [spans[-1]._replace(bias=np.zeros((1, 2), np.float32))])
    with pytest.raises(ValueError, match="do not fit"):
        ragged_attention(q, [spans[0]._replace(end=10_000)])


def test_rms_norm_matches_numpy_and_a_row_keeps_its_bits() -> None:
    from lyanna.engines.kernels import rms_norm

    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 576), dtype=np.float32) * 3
    w = rng.standard_normal(576, dtype=np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    got = rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(rms_norm(x[3], w, 1e-5), got[3])  # a vector, and a row alone
    assert all(np.array_equal(rms_norm(x[i:i + 1], w, 1e-5)[0], got[i]) for i in range(9))


def test_silu_mul_matches_numpy_over_the_whole_range() -> None:
    from lyanna.engines.kernels import silu_mul

    rng = np.random.default_rng(5)
    gate = np.concatenate([rng.standard_normal((3, 40)) * 4, np.array([[-1e4, -100.0, -88.0, -20.0, -1e-3, 0.0,
                                                                          1e-3, 20.0, 88.0, 100.0] * 4])]).astype(np.float32)
    up = rng.standard_normal(gate.shape, dtype=np.float32)
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(1e4) is inf in float64 too: silu(-1e4) is then -0
        want = g64 / (1.0 + np.exp(-g64)) * up
    got = silu_mul(np.concatenate([gate, up], axis=1))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    assert np.all(np.isfinite(got))
    with pytest.raises(ValueError, match="silu_mul needs"):
        silu_mul(np.zeros((2, 5), np.float32))


def _rms_norm_as_written(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``kernels._rms_norm_kernel``'s operations in numpy float32, one rounding each: eight
    running sums (column c to sum c % 8, a row's last d % 8 columns to sum 0), added pairwise."""
    f = np.float32
    n, d = x.shape
    body = d - d % 8
    sums = np.zeros((n, 8), f)
    if body:
        sums = np.cumsum((x[:, :body] * x[:, :body]).reshape(n, -1, 8), axis=1, dtype=f)[:, -1].copy()
    for c in range(body, d):
        sums[:, 0] += x[:, c] * x[:, c]
    s = sums.T
    total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))
    inv = f(1.0) / np.sqrt(total / f(d) + f(eps))
    return x * inv[:, None] * w


@pytest.mark.parametrize("d", [576, 37, 8, 5])
def test_rms_norm_is_its_written_operations_bit_for_bit(d: int) -> None:
    """No order left to the compiler: a copy of the norm compiled inside another function (the
    one-token pass on held threads) must give the same bits, and only the written order does."""
    from lyanna.engines.kernels import rms_norm

    rng = np.random.default_rng(d)
    x = (rng.standard_normal((6, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    assert np.array_equal(rms_norm(x, w, 1e-5), _rms_norm_as_written(x, w, 1e-5))


def _silu_mul_as_written(g: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``kernels.silu_mul_row`` (with ``exp_nonpositive``) in numpy float32, one rounding per
    operation, no multiply-add fused."""
    from lyanna.engines import kernels

    f = np.float32
    x = -np.abs(g)
    n = np.floor(x * kernels._LOG2E + f(0.5))
    r = (x - n * kernels._LN2_HI) - n * kernels._LN2_LO
    p = np.full_like(x, f(1.0 / 5040.0))
    for coef in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = p * r + f(coef)
    live = x >= kernels._EXP_FLOOR
    two_n = ((np.where(live, n, f(0.0)).astype(np.int32) + np.int32(127)) << np.int32(23)).view(f)
    e = np.where(live, p * two_n, f(0.0))
    return g * (np.where(g >= 0, f(1.0), e) / (f(1.0) + e)) * up


def test_silu_mul_is_its_written_operations_bit_for_bit_in_every_lane() -> None:
    """The same gate and up values in a row's vector body and in its scalar tail, in rows of
    several lengths: every value equals the numpy model of the written operations (with
    fastmath flags, contraction made the vectors and the tail, and copies compiled inside other
    functions, disagree in the last bit)."""
    from lyanna.engines.kernels import silu_mul

    rng = np.random.default_rng(6)
    gate = np.concatenate([rng.standard_normal(61) * 4, [-1e4, -100.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0]])
    gate, up = gate.astype(np.float32), rng.standard_normal(gate.size).astype(np.float32)
    want = _silu_mul_as_written(gate, up)
    for shift in range(0, 19, 3):  # the values land in other lanes, some in the loop's tail
        g = np.concatenate([np.ones(shift, np.float32), gate])
        u = np.concatenate([np.ones(shift, np.float32), up])
        got = silu_mul(np.concatenate([g, u])[None])[0, shift:]
        assert np.array_equal(got, want), f"shift {shift}: {np.sum(got != want)} values differ"


@pytest.mark.parametrize("n", [1, 5, 70])
def test_rope_qk_matches_complex_rotation_and_a_row_keeps_its_bits(n: int) -> None:
    from lyanna.engines.kernels import rope_qk
    from lyanna.engines.transformer import rotation

    rng = np.random.default_rng(n)
    heads, kv_heads, hd = 6, 2, 16
    inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    qkv = rng.normal(size=(n, (heads + 2 * kv_heads) * hd)).astype(np.float32)
    rot = rotation(inv_freq, rng.integers(0, 4000, n))
    q, k = rope_qk(qkv, rot, heads, kv_heads, hd)
    # reference: adjacent pairs as complex numbers times the unit factors, in float64
    z = qkv[:, : (heads + kv_heads) * hd].astype(np.float64).reshape(n, heads + kv_heads, hd // 2, 2)
    turned = (z[..., 0] + 1j * z[..., 1]) * rot.astype(np.complex128)[:, None, :]
    ref = np.stack([turned.real, turned.imag], -1).reshape(n, heads + kv_heads, hd)
    np.testing.assert_allclose(q, ref[:, :heads] / np.sqrt(hd), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k, ref[:, heads:], rtol=1e-5, atol=1e-6)
    q1, k1 = rope_qk(qkv[-1:].copy(), rot[-1:].copy(), heads, kv_heads, hd)
    assert np.array_equal(q1[0], q[-1]) and np.array_equal(k1[0], k[-1])
    with pytest.raises(ValueError, match="rope_qk"):
        rope_qk(qkv, rot[:, :-1], heads, kv_heads, hd)


def test_rotation_table_rows_are_the_computed_rows_bit_for_bit() -> None:
    from lyanna.engines.transformer import Rotations, rotation

    rng = np.random.default_rng(7)
    for hd in (16, 64):
        inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
        table = Rotations(inv_freq, positions=8)
        for positions in (np.array([3]), rng.integers(0, 8, 5), rng.integers(0, 3000, 7), np.arange(2990, 3010),
                          np.array([40000, 5])):  # grown past its rows twice
            assert np.array_equal(table(positions), rotation(inv_freq, positions)), positions
        assert table(np.zeros(0, np.int64)).shape == (0, hd // 2)


def test_kernel_launches_warn_once_when_a_second_live_thread_launches():
    import threading
    import warnings

    from lyanna.engines.kernels import KernelLaunches

    launches = KernelLaunches()

    def launch():
        with launches:
            pass

    def on_a_thread():
        t = threading.Thread(target=launch)
        t.start()
        t.join()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on_a_thread()  # a thread launches and ends: its team is gone with it
        launch()
        launch()
        assert not seen and not launches.warned
        on_a_thread()  # while this (main) thread, which launched, is alive
        on_a_thread()
    assert [w.category for w in seen] == [RuntimeWarning] and "one thread" in str(seen[0].message)


def test_a_compiled_call_met_first_counts_as_a_first_run_of_the_engine(tiny_decoder):
    """The first call of a ``SameTypes`` function compiles it or loads it from numba's cache (up
    to minutes after a change to the package): the host engine counts it in ``first_runs``, so
    a round that held one is not taken for what its work costs; later calls are not counted."""
    from numba import njit

    from lyanna.engines.base import first_runs
    from lyanna.engines.kernels import SameTypes

    twice = SameTypes(njit(lambda x: 2 * x))
    before = first_runs(tiny_decoder.engine)
    assert twice(np.float32(2.0)) == 4.0 and first_runs(tiny_decoder.engine) == before + 1
    assert twice(np.float32(3.0)) == 6.0 and first_runs(tiny_decoder.engine) == before + 1
    assert first_runs(tiny_decoder.engine) == SameTypes.first_calls


def _halves(x: np.ndarray) -> np.ndarray:
    """``x`` as a 16-bit cache holds it (``KVCache(halves=True)``)."""
    return x.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("hd", [64, 40, 12])
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_a_half_cache_gives_the_bits_of_its_values_in_float32(hd: int, rows: int) -> None:
    """Keys and values read from a cache of halves' bits (the default on a GGUF's blocks) give
    exactly what the same rounded values give from a float32 cache: widening a half is exact. Head
    sizes with and without whole vectors, masked blocks and a batch of such caches beside a
    float32 cache's reference."""
    rng = np.random.default_rng(hd * rows)
    kv, groups, cached = 3, 3, 37
    q = rng.standard_normal((rows, kv * groups, hd)).astype(np.float32) / 8
    k = (rng.standard_normal((kv, cached + rows + 3, hd)) * 4).astype(np.float32)
    v = (rng.standard_normal((kv, cached + rows + 3, hd)) * 4).astype(np.float32)
    rounded_k, rounded_v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    assert not np.array_equal(rounded_k, k)  # the rounding is real: it could show
    bias = None
    if rows > 1:
        bias = np.zeros((rows, cached + rows), np.float32)
        bias[:, cached:] = np.where(np.tril(np.ones((rows, rows), bool)), 0.0, -np.inf)
    ours = attention(q, _halves(k), _halves(v), cached + rows, bias)
    assert np.array_equal(ours, attention(q, rounded_k, rounded_v, cached + rows, bias))
    np.testing.assert_allclose(ours, reference_attention(q, rounded_k, rounded_v, cached + rows, bias), rtol=1e-4, atol=1e-5)
    out = np.empty((2 * rows, kv * groups * hd), np.float32)
    ragged_attention(np.concatenate([q, q]), [AttentionSpan(0, rows, _halves(k), _halves(v), cached + rows, bias),
                                             AttentionSpan(rows, 2 * rows, _halves(k), _halves(v), cached + rows, bias)], out)
    assert np.array_equal(out[:rows], ours) and np.array_equal(out[rows:], ours)
    if rows > 1:  # a prompt's prefill (PyTorch's GEMMs) reads the halves as the same float32 values
        from lyanna.engines.attention import prefill_attention

        causal = bias[:, cached:]
        assert np.array_equal(prefill_attention(q, _halves(k), _halves(v), causal),
                              prefill_attention(q, rounded_k, rounded_v, causal))


def test_compiled_cache_writes_round_as_numpy_does() -> None:
    """``halves.cache_value`` (what compiled passes write) and ``as_stored`` (what the numpy
    path writes) store the same half for every float32 class: ties to even, the smallest halves,
    overflow to infinity, signed zeros, NaN; and a float32 cache keeps the value as it is."""
    from numba import njit

    from lyanna.engines.halves import as_floats, as_stored, cache_value

    @njit
    def write(cache, x):
        for i in range(x.size):
            cache[i] = cache_value(cache, x[i])

    rng = np.random.default_rng(5)
    half_steps = np.arange(-2048, 2048, dtype=np.float32) * np.float32(2.0 ** -11) + np.float32(1.0)  # ties at 1 + odd/2^11
    special = np.array([0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30,
                        np.inf, -np.inf], np.float32)
    x = np.concatenate([special, half_steps, (rng.standard_normal(20000) * 10.0 ** rng.uniform(-8, 5, 20000)).astype(np.float32)])
    halves = np.zeros(x.size, np.uint16)
    write(halves, x)
    assert np.array_equal(halves, as_stored(halves, x))
    assert np.array_equal(as_floats(halves), x.astype(np.float16).astype(np.float32))
    nan = np.zeros(1, np.uint16)
    write(nan, np.array([np.nan], np.float32))
    assert np.isnan(as_floats(nan)).all()
    floats = np.zeros(x.size, np.float32)
    write(floats, x)
    assert np.array_equal(floats, x) and as_stored(floats, x) is x


def test_the_key_value_cache_is_half_on_blocks_unless_asked_otherwise(monkeypatch) -> None:
    """``LYANNA_KV_CACHE``: float16 or float32 as asked, else halves on a GGUF's blocks and float32
    on fp32 weights; anything else refused by name."""
    from lyanna.engines.intdot_ir import HAS_F16C
    from lyanna.engines.transformer import KVCache, kv_cache_kind
    from lyanna.errors import LyannaError

    monkeypatch.delenv("LYANNA_KV_CACHE", raising=False)
    assert kv_cache_kind(blocks=False) == "float32"
    assert kv_cache_kind(blocks=True) == ("float16" if HAS_F16C else "float32")
    monkeypatch.setenv("LYANNA_KV_CACHE", "float32")
    assert kv_cache_kind(blocks=True) == "float32"
    monkeypatch.setenv("LYANNA_KV_CACHE", "bfloat16")
    with pytest.raises(LyannaError, match="LYANNA_KV_CACHE='bfloat16'"):
        kv_cache_kind(blocks=True)
    assert KVCache(2, 3, 8, 5, halves=True).k.dtype == np.uint16 and KVCache(2, 3, 8, 5).v.dtype == np.float32
