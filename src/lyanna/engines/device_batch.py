"""Many sequences' greedy replies on the device engine, one pass a step for all of them: one
batched static cache (``[layers, 2, rows, kv heads, capacity, head dim]``: a row a sequence),
each step a single forward over every row at its own position, and a row whose reply ended
refilled with the next prompt while the others go on (continuous batching). This is how a small
target makes training data fast on a GPU (``lyanna train data --device``): a 135M model's step
costs about the same for one row as for hundreds, so the rows are nearly free.

Each row's numbers are its own (attention reads only its row of the cache, the matrices
multiply rows independently), so in float32 a reply is the one the engine gives the prompt
alone up to the last bits of a product's summation order: a near-tie may break differently,
which training data does not mind. Decoding steps run at fixed shapes (``FixedShapeCall``: a
CUDA graph per key range on a GPU); a refill's prefill runs at its own shape.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .device_slabs import KEY_BUCKET_MIN, FixedShapeCall, pow2_at_least
from .torch_layers import LayerHalves, PackedLayer, _qkv, rms_norm, rotation

# Padded prompt tokens a refill's prefill takes at most (more prompts wait for the next one), so
# that its activations stay small beside the cache.
PREFILL_TOKENS = 1 << 15


def _batch_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor,
                  qkv_bias: torch.Tensor | None, eps: float, heads: int, kv_heads: int, kv: torch.Tensor,
                  rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's first half over ``x`` [r, t, hidden] (``t`` tokens of each of ``r`` cache rows):
    the keys and values written into ``kv`` ([2, rows, kv heads, capacity, head dim]) at each
    token's slot of its row; queries ``[r, heads, t, head dim]``, keys and values ``[r, kv
    heads, t, head dim]`` (a prefill's attention reads its own)."""
    r, t, hidden = x.shape
    q, k, v = _qkv(rms_norm(x.reshape(r * t, hidden), norm, eps), cos, sin, qkv, qkv_bias, heads, kv_heads)
    d = q.shape[-1]
    k, v = k.reshape(kv_heads, r, t, d).transpose(0, 1), v.reshape(kv_heads, r, t, d).transpose(0, 1)
    kv[:, rows[:, None], :, slots] = torch.stack([k, v], 2).permute(0, 3, 2, 1, 4)  # [r, t, 2, kv heads, d]
    return q.reshape(heads, r, t, d).transpose(0, 1), k, v


def first_half(compiled: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``_batch_inputs``, through ``torch.compile`` where the engine compiles its layers."""
    return torch.compile(_batch_inputs, fullgraph=True) if compiled else _batch_inputs


def batch_layers(engine, first: Callable, kv_of: Callable[[int], torch.Tensor], tokens: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor,
                 keys: int | None, taps: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every layer of ``engine`` (a ``device.DeviceEngine``) over ``tokens`` [r, t] of cache
    ``rows`` at ``positions``, their keys and values written at ``slots`` of layer ``li``'s
    ``kv_of(li)`` ([2, rows, kv heads, capacity, head dim]); the final hidden rows ``[r, t,
    hidden]`` and the inputs of the layers in ``taps`` (the final norm's output for the layer
    count). ``keys``: attention reads that many slots of every row of the cache under ``bias``
    ([r, 1, t, keys], additive; ``rows`` must then be all of them); None: a prefill from slot 0,
    which reads its own keys."""
    c = engine.config
    cos, sin = rotation(positions.reshape(-1), engine._inv_freq, engine.dtype)
    x = engine._embed[tokens]
    hidden: dict[int, torch.Tensor] = {}
    for li, p in enumerate(engine.layers):
        if li in taps:
            hidden[li] = x
        x = batch_layer(p, engine.halves, first, x, cos, sin, kv_of(li), rows, slots, bias, keys)
    if c.num_layers in taps:
        hidden[c.num_layers] = rms_norm(x, engine._norm, c.rms_norm_eps)
    return x, hidden


def batch_layer(p: PackedLayer, halves: LayerHalves, first: Callable, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, bias: torch.Tensor,
                keys: int | None) -> torch.Tensor:
    """One layer of ``batch_layers`` over ``x`` [r, t, hidden] (RoPE's ``cos``, ``sin`` for its
    ``r * t`` rows; ``kv`` the layer's [2, rows, kv heads, capacity, head dim]); a draft head's
    layer over many sequences' rows runs it too."""
    c = p.config
    r, t = x.shape[:2]
    q, k, v = first(x, cos, sin, p.input_norm, p.qkv, p.qkv_bias, p.eps, c.num_heads, c.num_kv_heads, kv, rows, slots)
    if keys is not None:
        k, v = kv[0, :, :, :keys], kv[1, :, :, :keys]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=c.num_heads != c.num_kv_heads)
    return halves.second(x.reshape(r * t, -1), o.transpose(1, 2).reshape(r * t, c.num_heads, -1).transpose(0, 1),
                         p.o, p.post_norm, p.gate_up, p.down, p.eps).view(r, t, -1)


class BatchedGreedy:
    """Greedy replies to many prompts, ``rows`` at a time on one batched cache of ``capacity``
    positions a row (``replies``). ``engine``: a ``device.DeviceEngine`` (its packed layers,
    device, dtype, compiled halves and CUDA graph pool)."""

    def __init__(self, engine, rows: int, capacity: int):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        c = engine.config
        self.engine, self.config, self.rows, self.capacity = engine, c, rows, capacity
        self.kv = torch.zeros((c.num_layers, 2, rows, c.num_kv_heads, capacity, c.head_dim), dtype=engine.dtype,
                              device=engine.device)
        self._every = torch.arange(rows, device=engine.device)
        self._first = first_half(engine.halves.compiled)
        self._steps: dict[int, _Step] = {}

    @classmethod
    def for_prompts(cls, engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, rows: int) -> "BatchedGreedy":
        """A cache of at most ``rows`` rows (no more than the prompts), each just long enough for the
        longest of ``prompts`` and its reply."""
        return cls(engine, min(rows, len(prompts)), max(map(len, prompts)) + max_new_tokens)

    def _bias(self, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[r, 1, t, k]`` additive bias: a token at ``positions`` [r, t] sees the keys at
        ``keys`` [k] up to its own position (and inside the sliding window, if any)."""
        seen = keys[None, None, :] <= positions[:, :, None]
        window = self.config.sliding_window
        if window is not None:
            seen &= positions[:, :, None] - keys[None, None, :] < window
        bias = torch.zeros(seen.shape, dtype=self.engine.dtype, device=seen.device)
        return bias.masked_fill_(~seen, float("-inf"))[:, None]

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, keys: int | None) -> torch.Tensor:
        """Every layer over ``tokens`` [r, t] of cache ``rows`` at ``positions`` (their slots);
        the final hidden rows ``[r, t, hidden]``. ``keys``: attention reads that many slots of
        every row of the cache (a step, ``rows`` all of them); None: a prefill from position 0."""
        t = tokens.shape[1]
        bias = self._bias(positions, torch.arange(t if keys is None else keys, device=tokens.device))
        return batch_layers(self.engine, self._first, self.kv.__getitem__, tokens, positions, positions, rows, bias, keys)[0]

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        """The argmax token after each of the hidden rows ``x`` [r, hidden]."""
        e = self.engine
        return (rms_norm(x, e._norm, self.config.rms_norm_eps) @ e._lm_head.T).argmax(-1)

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Write ``prompts`` into cache ``rows`` (from position 0, padded together to the
        longest: a padding token sits after its prompt's last, so no real token sees it, and its
        slot is overwritten by the reply before any step reads it); each one's first reply token."""
        e = self.engine
        lengths = np.array([len(p) for p in prompts])
        tokens = np.zeros((len(prompts), int(lengths.max())), np.int64)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        dev = e.device
        positions = torch.arange(tokens.shape[1], device=dev).expand(len(prompts), -1)
        with torch.inference_mode():
            x = self._layers(torch.from_numpy(tokens).to(dev), positions, torch.as_tensor(rows, device=dev), None)
            last = x[torch.arange(len(prompts), device=dev), torch.from_numpy(lengths - 1).to(dev)]
            return self._greedy(last).cpu().numpy()

    def step(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One decoding step of every row: ``tokens[i]`` at ``positions[i]`` of row ``i`` (an
        idle row takes token 0 at position 0); each row's next token."""
        keys = min(pow2_at_least(int(positions.max()) + 1, KEY_BUCKET_MIN), self.capacity)
        s = self._steps.get(keys)
        if s is None:
            s = self._steps[keys] = _Step(self, keys)
        s.host("tokens")[:], s.host("positions")[:] = tokens, positions
        with torch.inference_mode():
            s.run_fixed()
            return s.next.cpu().numpy()

    def replies(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int],
                refill: int | None = None) -> Iterator[tuple[int, list[int]]]:
        """``(index, reply)`` for each of ``prompts`` as its reply ends (at its first
        end-of-sequence token, kept, or after ``max_new_tokens``): rows are refilled, ``refill``
        free rows at a time (default an eighth of them; fewer once no prompt is left), so that
        a prefill serves several prompts."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.capacity - max_new_tokens:
                raise ValueError(f"prompt {i} has {len(p)} tokens: need 1 to {self.capacity - max_new_tokens} "
                                 f"(capacity {self.capacity} less {max_new_tokens} new tokens)")
        refill = min(max(1, self.rows // 8) if refill is None else max(1, refill), self.rows)
        stop = set(int(t) for t in eos)
        yield from _Rows(self, prompts, max_new_tokens, stop, refill).run()


class _Rows:
    """The host side of ``BatchedGreedy.replies``: which prompt each row holds and its reply so
    far, in arrays (a step's bookkeeping is a few vector operations, whatever the rows)."""

    def __init__(self, gen: BatchedGreedy, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: set[int],
                 refill: int):
        self.gen, self.prompts, self.max_new, self.refill = gen, prompts, max_new_tokens, refill
        self.stop = np.array(sorted(stop), np.int64)
        self.owner = np.full(gen.rows, -1)  # the prompt a row holds; -1: idle
        self.positions = np.zeros(gen.rows, np.int64)  # where each row's newest token goes
        self.made = np.zeros((gen.rows, max_new_tokens), np.int64)  # each row's reply so far
        self.count = np.zeros(gen.rows, np.int64)
        self.next_prompt = 0

    def run(self) -> Iterator[tuple[int, list[int]]]:
        while True:
            idle = np.flatnonzero(self.owner < 0)
            left = len(self.prompts) - self.next_prompt
            if left and len(idle) >= min(self.refill, left):
                yield from self._fill(idle[:left])
                continue  # a reply may have ended at its first token, freeing its row again
            busy = self.owner >= 0
            if not busy.any():  # (every row idle, so no prompt is left)
                return
            newest = self.made[np.arange(self.gen.rows), np.maximum(self.count - 1, 0)]
            nxt = self.gen.step(np.where(busy, newest, 0), np.where(busy, self.positions, 0))
            self.positions[busy] += 1
            yield from self._take(np.flatnonzero(busy), nxt[busy])

    def _fill(self, idle: np.ndarray) -> Iterator[tuple[int, list[int]]]:
        """The next prompts into the ``idle`` rows (prefills of at most ``PREFILL_TOKENS`` padded
        tokens each), each one's first token taken."""
        chosen = list(self.prompts[self.next_prompt : self.next_prompt + len(idle)])
        rows = idle[: len(chosen)]
        self.owner[rows] = self.next_prompt + np.arange(len(chosen))
        self.positions[rows] = [len(p) for p in chosen]
        self.count[rows] = 0
        self.next_prompt += len(chosen)
        at = 0
        while at < len(chosen):
            longest, n = 0, 0
            while at + n < len(chosen) and max(longest, len(chosen[at + n])) * (n + 1) <= max(PREFILL_TOKENS, len(chosen[at])):
                longest, n = max(longest, len(chosen[at + n])), n + 1
            first = self.gen.prefill(rows[at : at + n].tolist(), chosen[at : at + n])
            yield from self._take(rows[at : at + n], first)
            at += n

    def _take(self, rows: np.ndarray, tokens: np.ndarray) -> Iterator[tuple[int, list[int]]]:
        """Each of ``rows``' next token: a reply ends (and its row is freed) at a stop token or
        the length limit; otherwise the token is its row's next step's input."""
        self.made[rows, self.count[rows]] = tokens
        self.count[rows] += 1
        ended = rows[np.isin(tokens, self.stop) | (self.count[rows] >= self.max_new)]
        for r in ended:
            yield int(self.owner[r]), self.made[r, : self.count[r]].tolist()
        self.owner[ended] = -1


class _Step(FixedShapeCall):
    """One decoding step of every row of a ``BatchedGreedy`` over ``keys`` slots a row."""

    def __init__(self, gen: BatchedGreedy, keys: int):
        super().__init__(gen.engine.device, gen.engine._graph_pool)
        self.gen, self.keys = gen, keys
        self._input("tokens", (gen.rows,), torch.int64)
        self._input("positions", (gen.rows,), torch.int64)
        self.next: torch.Tensor | None = None

    def _forward(self) -> None:
        x = self.gen._layers(self.tokens[:, None], self.positions[:, None], self.gen._every, self.keys)
        self.next = self.gen._greedy(x[:, 0])


def greedy_replies(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int],
                   rows: int) -> list[list[int]]:
    """Every prompt's greedy reply (``BatchedGreedy.replies``), in the prompts' order, on a cache
    sized for them (``BatchedGreedy.for_prompts``)."""
    out: list[list[int]] = [[] for _ in prompts]
    if prompts:
        for i, reply in BatchedGreedy.for_prompts(engine, prompts, max_new_tokens, rows).replies(prompts, max_new_tokens,
                                                                                                 eos):
            out[i] = reply
    return out
