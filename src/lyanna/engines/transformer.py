"""Our own forward pass for Llama-family targets (Llama, Mistral, Qwen2 weight layouts).

The engine is numpy on purpose: on this class of CPU, numpy's per-op overhead is lower than
PyTorch's, and its matmuls go through ``kernels.linear``, which keeps a block of 2 to 64
tokens nearly as cheap as one (BLAS sgemm does not, see that module). On fp32 weights a prompt's
prefill, where a GEMM's blocking pays, goes through PyTorch's sgemm and batched attention GEMMs
instead (``Block.prefill``; ``kernels.linear_rows``); on a GGUF's blocks it stays on the kernels
(``blockwise_prefill``). It takes a block of new tokens with explicit
positions and an explicit within-block attention mask (tree verification), appends their
keys/values to a preallocated cache, and can later keep only a chosen subset of the block
(``KVCache.compact``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np
from numba import njit

from ..errors import LyannaError
from .attention import AttentionSpan, prefill_attention, ragged_attention
from .base import Block, ForwardOutput, TargetEngine, block_inputs, compaction
from .config import ModelConfig, rope_inv_freq
from .fused import FusedLayers
from .halves import as_stored
from .kernels import BULK_MIN_ROWS, SameTypes, _launch, linear, linear_rows, rms_norm, rope_qk, silu_mul
from . import intdot
from .intdot_ir import HAS_F16C
from .quant import QuantMatrix

Weight = np.ndarray | QuantMatrix  # a matrix in fp32, or computed on a GGUF's blocks (``quant``)

# Bumped whenever the forward pass's cost or its calibration changes, so cached latency calibrations are redone.
ENGINE_REVISION = 22
KV_CACHES = ("float16", "float32")  # what ``LYANNA_KV_CACHE`` may name


def kv_cache_kind(blocks: bool) -> str:
    """What an engine's key/value cache holds: ``LYANNA_KV_CACHE`` (``float16`` or ``float32``),
    else half-precision floats where the weights are a GGUF's blocks and the CPU converts halves in
    one instruction (F16C), float32 otherwise. Why halves: a one-token pass reads every cached key
    and value, at long contexts more bytes than the weights, and half the bytes read faster. Those
    weights are 4- and 8-bit already, as llama.cpp, whose default cache is also float16, runs
    them; fp32 weights keep a float32 cache, so their passes stay the model's own float32 numbers.
    A key or value is rounded once, when it is written, and read back exactly, so every row still
    gets the same bits whatever its block, batch or method."""
    name = os.environ.get("LYANNA_KV_CACHE", "").strip() or "auto"
    if name == "auto":
        return "float16" if blocks and HAS_F16C else "float32"
    if name not in KV_CACHES:
        raise LyannaError(f"LYANNA_KV_CACHE={name!r}: choose auto, {' or '.join(KV_CACHES)}")
    if name == "float16" and not HAS_F16C:
        raise LyannaError("LYANNA_KV_CACHE=float16: this CPU lacks F16C (half-precision conversions)")
    return name


class KVCache:
    """Preallocated keys and values of every layer; the first ``length`` positions are valid.
    ``halves``: each value a half-precision float's 16 bits (``uint16``: the compiled kernels take
    no float16 arrays; ``halves.as_floats`` reads them in numpy), else float32."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, halves: bool = False):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        dtype = np.uint16 if halves else np.float32
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def compact(self, start: int, keep: Sequence[int] | np.ndarray) -> None:
        """Keep only block positions ``start + keep[i]`` (in that order) and drop the rest.

        Used after verification: of a block of tree nodes appended at ``start``, only the accepted
        path survives, moved to be contiguous right after the prefix.
        """
        keep = np.asarray(keep, np.int64)
        # a verified path (every round's case) in one compiled call; anything else checked here
        if not (0 <= start <= self.length and _moved_forward(self.k, self.v, start, self.length, keep)):
            keep = compaction(start, self.length, keep)
            src = start + keep
            dst = slice(start, start + keep.size)
            self.k[:, :, dst] = self.k[:, :, src]  # fancy indexing copies first, so overlap is safe
            self.v[:, :, dst] = self.v[:, :, src]
        self.length = start + int(keep.size)


@njit(nogil=True, cache=True)
def _moved_forward(k, v, start, length, keep):  # pragma: no cover - compiled
    """Slot ``start + keep[i]`` moved to ``start + i`` in every layer and head, in order, where
    ``keep`` is strictly increasing within the block ``[start, length)`` (then no slot is
    overwritten before it is read); False, with nothing moved, for any other ``keep``."""
    for i in range(keep.shape[0]):
        if keep[i] < 0 or start + keep[i] >= length or (i > 0 and keep[i] <= keep[i - 1]):
            return False
    for i in range(keep.shape[0]):
        src, dst = start + keep[i], start + i
        if src != dst:
            for layer in range(k.shape[0]):
                for g in range(k.shape[1]):
                    k[layer, g, dst] = k[layer, g, src]
                    v[layer, g, dst] = v[layer, g, src]
    return True


@dataclass
class LayerWeights:
    """One decoder layer, fused and permuted for the numpy forward."""

    attn_norm: np.ndarray
    wqkv: Weight  # [q+k+v, hidden]; q/k rows permuted so RoPE pairs are adjacent
    bqkv: np.ndarray | None
    wo: Weight
    mlp_norm: np.ndarray
    w_gate_up: Weight  # [2 * intermediate, hidden]
    w_down: Weight

    @classmethod
    def from_hf(cls, get: Callable[[str], Weight], prefix: str, c: ModelConfig) -> "LayerWeights":
        """Build from Hugging Face names under ``prefix`` (e.g. ``model.layers.3.``)."""
        q = _interleave_rows(get(prefix + "self_attn.q_proj.weight"), c.num_heads, c.head_dim)
        k = _interleave_rows(get(prefix + "self_attn.k_proj.weight"), c.num_kv_heads, c.head_dim)
        v = get(prefix + "self_attn.v_proj.weight")
        bias = None
        if c.attention_bias:
            bias = np.concatenate([
                _interleave_rows(get(prefix + "self_attn.q_proj.bias"), c.num_heads, c.head_dim),
                _interleave_rows(get(prefix + "self_attn.k_proj.bias"), c.num_kv_heads, c.head_dim),
                get(prefix + "self_attn.v_proj.bias"),
            ])
        return cls(
            attn_norm=get(prefix + "input_layernorm.weight"),
            wqkv=_stack_rows([q, k, v]),
            bqkv=bias,
            wo=get(prefix + "self_attn.o_proj.weight"),
            mlp_norm=get(prefix + "post_attention_layernorm.weight"),
            w_gate_up=_stack_rows([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]),
            w_down=get(prefix + "mlp.down_proj.weight"),
        )


def rotation(inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """RoPE as complex unit factors, [n, head_dim / 2]."""
    angles = np.outer(np.asarray(positions).astype(np.float32), inv_freq).astype(np.float32)
    return (np.cos(angles) + 1j * np.sin(angles)).astype(np.complex64)


class Rotations:
    """``rotation`` of positions read from a table of every position up to the highest asked
    (grown by doubling). Why: a pass and a draft round each need a few positions' factors, and
    computed afresh, with cos, sin and complex temporaries whose code and data the pass before
    left cold, they cost about as much as a small kernel call. Every entry is ``rotation``'s
    own element for its position (each is computed on its own, whatever else shares the array),
    so rows read from the table are bit-identical to rows computed."""

    def __init__(self, inv_freq: np.ndarray, positions: int = 1024):
        self.inv_freq = inv_freq
        self._table = rotation(inv_freq, np.arange(positions))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        top = int(positions.max()) + 1 if positions.size else 0
        if top > self._table.shape[0]:
            self._table = rotation(self.inv_freq, np.arange(max(top, 2 * self._table.shape[0])))
        return self._table[positions]


def attention_bias(start: int, within: np.ndarray) -> np.ndarray:
    """Additive mask [n, start + n]: the cached prefix is visible, the block as ``within`` says."""
    n = within.shape[0]
    bias = np.zeros((n, start + n), np.float32)
    bias[:, start:] = np.where(within, 0.0, -np.inf)
    return bias


def window_bias(bias: np.ndarray | None, start: int, positions: np.ndarray, window: int) -> np.ndarray:
    """``bias`` (updated in place; None: no mask yet) with every key ``window`` or more positions
    behind its query masked, as in Hugging Face's sliding-window attention. Cached slot i holds
    position i (the cache keeps only the committed sequence), block slot ``start + j`` holds
    ``positions[j]``."""
    n = positions.shape[0]
    keys = np.concatenate([np.arange(start), positions])
    out = np.zeros((n, start + n), np.float32) if bias is None else bias
    out[positions[:, None] - keys[None, :] >= window] = -np.inf
    return out


class Span(NamedTuple):
    """One sequence's rows ``[lo, hi)`` of a (batched) block and where they go in its cache: this
    layer's [kv_heads, capacity, head_dim] arrays, slots from ``start``, an additive
    [hi - lo, start + hi - lo] mask or None (every row sees everything up to its own slot);
    ``prefill``: a prompt's rows, whose linear layers may go through a GEMM (``linear_rows``)."""

    lo: int
    hi: int
    k_cache: np.ndarray
    v_cache: np.ndarray
    start: int
    bias: np.ndarray | None
    prefill: bool = False


def layer_forward(
    layer: LayerWeights, c: ModelConfig, x: np.ndarray, rot: np.ndarray,
    k_cache: np.ndarray, v_cache: np.ndarray, start: int, bias: np.ndarray | None,
) -> np.ndarray:
    """One pre-norm decoder layer over a block of n rows of one sequence, written to cache slots
    [start, start + n). Shared by the target engine and the draft heads."""
    return ragged_layer_forward(layer, c, x, rot, [Span(0, x.shape[0], k_cache, v_cache, start, bias)])


def ragged_layer_forward(layer: LayerWeights, c: ModelConfig, x: np.ndarray, rot: np.ndarray,
                         spans: Sequence[Span]) -> np.ndarray:
    """One decoder layer over the rows of several sequences at once: the linear layers stream
    their weights once for every row (the point of batching on a CPU), attention runs per span."""
    n = x.shape[0]
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q_dim, kv_dim = nh * hd, nkv * hd
    bulk = [(s.lo, s.hi) for s in spans if s.prefill]
    h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
    qkv = linear_rows(h, layer.wqkv, bulk)
    if layer.bqkv is not None:
        qkv += layer.bqkv
    q, k = rope_qk(qkv, rot, nh, nkv, hd)
    v = qkv[:, q_dim + kv_dim :].reshape(n, nkv, hd)
    o = np.empty((n, q_dim), np.float32)
    small = []  # every span our kernel serves goes into one launch
    for span in spans:
        end = span.start + span.hi - span.lo
        span.k_cache[:, span.start : end] = as_stored(span.k_cache, k[span.lo : span.hi].transpose(1, 0, 2))
        span.v_cache[:, span.start : end] = as_stored(span.v_cache, v[span.lo : span.hi].transpose(1, 0, 2))
        if span.prefill and span.hi - span.lo >= BULK_MIN_ROWS:
            o[span.lo : span.hi] = prefill_attention(q[span.lo : span.hi], span.k_cache, span.v_cache, span.bias)
        else:
            small.append(AttentionSpan(span.lo, span.hi, span.k_cache, span.v_cache, end, span.bias))
    if small:
        ragged_attention(q, small, o)
    x = x + linear_rows(o, layer.wo, bulk)
    h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
    return x + linear_rows(silu_mul(linear_rows(h, layer.w_gate_up, bulk)), layer.w_down, bulk)


def _interleave_rows(w: Weight, heads: int, head_dim: int) -> Weight:
    """Reorder each head's rows from Hugging Face's half-split RoPE layout to adjacent pairs.

    Attention scores are dot products, so permuting q and k the same way leaves them unchanged,
    and adjacent pairs let RoPE be one complex multiplication.
    """
    perm = np.stack([np.arange(head_dim // 2), np.arange(head_dim // 2) + head_dim // 2], 1).reshape(-1)
    return w.take((np.arange(heads)[:, None] * head_dim + perm).reshape(-1), axis=0)


def _stack_rows(parts: Sequence[Weight]) -> Weight:
    """Matrices stacked by rows into one fused matrix (its linear layer streams them in one call);
    quantized if every part is, else fp32."""
    if all(isinstance(p, QuantMatrix) for p in parts):
        return QuantMatrix.concat(parts)
    return np.ascontiguousarray(np.concatenate([p.dense() if isinstance(p, QuantMatrix) else p for p in parts]))


class Transformer(TargetEngine):
    """A Llama-family decoder over numpy fp32 weights with a tree-capable block forward."""

    name = "numpy"

    def __init__(self, config: ModelConfig, weights: dict[str, Weight]):
        self.config = config
        c = config

        def get(name: str) -> Weight:
            try:
                w = weights[name]
                return w if isinstance(w, QuantMatrix) else np.ascontiguousarray(w, dtype=np.float32)
            except KeyError:
                raise LyannaError(f"weight {name!r} is missing from the checkpoint; is it a complete {c.architecture}?") from None

        self.embed = get("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise LyannaError(f"embedding shape {self.embed.shape} does not match config ({c.vocab_size}, {c.hidden_size})")
        self.final_norm = get("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights else get("lm_head.weight")
        self.layers = [LayerWeights.from_hf(get, f"model.layers.{i}.", c) for i in range(c.num_layers)]
        self.inv_freq = rope_inv_freq(c)
        self.rotations = Rotations(self.inv_freq)
        # Calibrations are cached per engine name: each kernel has its own latency curve.
        kernels = {w.kernel for w in weights.values() if isinstance(w, QuantMatrix)}
        if kernels:
            self.name = "numpy-gguf" if kernels == {"int8"} else "numpy-gguf-float"
        # What multiplies the matrices, for calibrations and bench reports to name.
        self.kernel = f"intdot-{intdot.PATH}" if "int8" in kernels else "blocks-fp32" if kernels else "fp32"
        # One sequence's passes through every layer in one compiled call where the layers allow it.
        self._fused = FusedLayers.of(self.layers, c)
        # Whether a prompt's prefill may take PyTorch's GEMMs (``Block.prefill``), whose rows can
        # depend on the block. On a GGUF's blocks it never does: the blocks' kernel beat the GEMM
        # over dequantized weights at every length (``kernels.linear_rows``), and without that route
        # every row's numbers are the same however the prompt is split into blocks, which lets a
        # cached prefix stand in for its rows bit for bit (``prefix_cache.py``).
        self.blockwise_prefill = bool(kernels)
        # What the key/value cache holds (``kv_cache_kind``), for calibrations and bench reports to name.
        self.kv_cache = kv_cache_kind(bool(kernels))

    @property
    def first_runs(self) -> int:
        """Compiled calls (the layers', a host draft round's: ``kernels.SameTypes``) run for the
        first time in this process (``base.first_runs``): such a call compiles or loads its
        machine code, up to minutes after a change to the package, so a round holding one timed
        that, not what drafting costs."""
        return SameTypes.first_calls

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.kv_cache == "float16")

    def forward_batch(self, blocks: Sequence["Block"]) -> list[ForwardOutput]:
        """``forward`` for the blocks of several sequences (each its own cache) in one pass.

        Every row's numbers are bit-identical to running its block alone (the kernels compute a
        row the same way whatever shares its block), so batching never changes an output.
        """
        c = self.config
        if not blocks:
            return []
        if len({id(b.cache) for b in blocks}) != len(blocks):
            raise ValueError("each block of a batch needs its own cache")
        tokens, positions, biases, bounds = [], [], [], []
        lo = 0
        for b in blocks:
            t, p, bias = self._prepare(b)
            tokens.append(t)
            positions.append(p)
            biases.append(bias)
            bounds.append((lo, lo + t.shape[0], b.cache.length))
            lo += t.shape[0]
        rot = self.rotations(np.concatenate(positions))
        x = self.embed[np.concatenate(tokens)]
        wanted = set().union(*(b.taps for b in blocks))
        hidden: dict[int, np.ndarray] = {}
        # A prompt of BULK_MIN_ROWS rows or more takes the GEMM path (``ragged_layer_forward``).
        bulk = [b.prefill and not self.blockwise_prefill for b in blocks]
        if self._fused is not None and not any(g and hi - lo >= BULK_MIN_ROWS for g, (lo, hi, _) in zip(bulk, bounds)):
            with _launch:
                x, hidden = self._fused(x, rot, [(lo, hi, b.cache.k, b.cache.v, start, bias)
                                                 for (lo, hi, start), b, bias in zip(bounds, blocks, biases)],
                                        sorted(t for t in wanted if t < c.num_layers))
        else:
            for li, layer in enumerate(self.layers):
                if li in wanted:
                    hidden[li] = x
                spans = [Span(lo, hi, b.cache.k[li], b.cache.v[li], start, bias, gemm)
                         for (lo, hi, start), b, bias, gemm in zip(bounds, blocks, biases, bulk)]
                x = ragged_layer_forward(layer, c, x, rot, spans)
        for (lo, hi, start), b in zip(bounds, blocks):
            b.cache.length = start + hi - lo
        if c.num_layers in wanted:
            hidden[c.num_layers] = rms_norm(x, self.final_norm, c.rms_norm_eps)
        # Rows whose logits are wanted, gathered so that the LM head also runs once for the batch.
        picks = [np.arange(lo, hi)[slice(None) if b.logit_rows is None else b.logit_rows]
                 for (lo, hi, _), b in zip(bounds, blocks)]
        rows = np.concatenate(picks)
        normed = hidden[c.num_layers][rows] if c.num_layers in hidden else rms_norm(x[rows], self.final_norm, c.rms_norm_eps)
        logits = linear(normed, self.lm_head)
        outs, at = [], 0
        for (lo, hi, _), b, pick in zip(bounds, blocks, picks):
            outs.append(ForwardOutput(logits=logits[at : at + pick.size],
                                      hidden={tap: hidden[tap][lo:hi] for tap in b.taps}))
            at += pick.size
        return outs

    def _prepare(self, b: "Block") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A block's tokens, positions and additive attention mask, checked against its cache."""
        tokens, positions, within = block_inputs(self.config, b)
        start = b.cache.length
        bias = None if within is None else attention_bias(start, within)
        window = self.config.sliding_window
        if window is not None and positions.max() >= window:  # some key is out of the window
            bias = window_bias(bias, start, positions, window)
        return tokens, positions, bias


