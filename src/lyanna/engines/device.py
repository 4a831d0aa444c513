"""The target on a torch device with our own forward pass and a static KV cache (the GPU path).

``torch_engine.TorchEngine`` runs transformers' model with a ``DynamicCache`` that is rebuilt by
``index_select`` after every verification; it stays the correctness oracle and covers models we
do not. This engine owns its layers (``torch_layers``, the Hugging Face layout, the weights the
numpy engine reads: safetensors, or a GGUF's blocks dequantized) and keeps each sequence's keys
and values in one tensor preallocated to its capacity on the device: a block's rows are written
in place at their slots, only the wanted rows go through the LM head, and compaction moves the
accepted rows into place with one gather per tensor. The loop, verifier and drafters see the
same ``TargetEngine`` as everywhere else.

Decoding blocks (one token, or a tree) run at fixed shapes, so that on a GPU each shape is
captured once as a CUDA graph and replayed with one launch: the rows are padded to a bucket of
``ROW_BUCKETS`` (padding rows write to scratch slots past the capacity and are dropped), attention
reads a key range of a power of two from ``KEY_BUCKET_MIN`` slots with a mask built on the host,
and caches come from a pool (``SlabPool``), so the graphs captured for one generation's cache
serve the next ones. Prefills and blocks longer than the last bucket run eagerly at their own
shape.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import LyannaError
from .base import Block, ForwardOutput, TargetEngine, block_inputs, compaction
from .config import ModelConfig, rope_inv_freq
from .device_verify import follow
from .loading import Target, load_target
from .quant import QuantMatrix
from .torch_layers import DecoderLayer, PackedLayer, cached_layer, rms_norm, rotation

DTYPES = ("float32", "bfloat16", "float16")


# Row counts a decoding block is padded to: powers of two, so padding at most doubles a block,
# up to the largest tree the decoder verifies (``decoder.MAX_TREE_TOKENS`` nodes and the root).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Key ranges attention reads: the smallest that holds the cache after the block (a short context
# does not pay for the whole capacity); powers of two from 256, so a few graphs per row bucket.
KEY_BUCKET_MIN = 256
# Caches are pooled by capacity rounded up to a power of two from this, so that generations with
# slightly different prompt lengths share one cache (and its graphs).
POOL_CAPACITY_MIN = 512
# Byte alignment of each input in a fixed-shape call's one block (the widest input type, int64).
STAGING_ALIGN = 8
# What a pass that verified its tree leaves on its cache's slab (``Slab.handoffs``, int64) for
# the next round's draft and pass to read where they run, while the host still waits for the
# copy: the next block's start, the path's length, the bonus token, then the tokens committed
# after the root (the path's, then the bonus token).
HANDOFF_START, HANDOFF_COUNT, HANDOFF_BONUS, HANDOFF_TOKENS = 0, 1, 2, 3


def pow2_at_least(n: int, smallest: int = 1) -> int:
    """The smallest power of two >= max(n, smallest)."""
    return 1 << (max(n, smallest) - 1).bit_length()


class Slab:
    """One pooled cache's device tensors, keys and values ``[layers, kv heads, capacity + scratch,
    head dim]`` as the two halves of one tensor (so that compaction moves both in one gather):
    slots past ``capacity`` take the padding rows of a fixed-shape call."""

    def __init__(self, shape: tuple[int, ...], capacity: int, dtype: torch.dtype, device: torch.device,
                 features: int = 0):
        """``features``: a draft head's slab also keeps ``[capacity + scratch, features]`` fp32
        rows for the committed tokens' target features (``drafters.device.DevicePairContext``;
        scratch rows stay zero), pooled with its keys and values so that graphs reading them serve
        later generations too."""
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.capacity = capacity
        self.features = torch.zeros((shape[2], features), dtype=torch.float32, device=device) if features else None
        # Two, written in turn: a pass that follows another reads that one's and writes the other,
        # so running it again (a CUDA graph's first run runs it twice) reads the same.
        self.handoffs = torch.zeros((2, HANDOFF_TOKENS + ROW_BUCKETS[-1]), dtype=torch.int64, device=device).unbind(0)


class SlabPool:
    """Caches whose tensors outlive them: a dropped cache's slab goes back to the pool and the
    next cache of about its capacity (rounded up to a power of two from ``smallest``) gets it,
    with the fixed-shape calls (CUDA graphs) captured on it."""

    def __init__(self, layers: int, c: ModelConfig, scratch: int, smallest: int, dtype: torch.dtype,
                 device: torch.device, features: int = 0):
        """``features``: see ``Slab``."""
        self.layers, self.config, self.scratch, self.smallest = layers, c, scratch, smallest
        self.dtype, self.device, self.features = dtype, device, features
        self._free: dict[int, list[Slab]] = {}  # pooled capacity -> slabs no cache holds

    def cache(self, capacity: int) -> "StaticCache":
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        pooled = pow2_at_least(capacity, self.smallest)
        free = self._free.setdefault(pooled, [])
        c = self.config
        slab = free.pop() if free else Slab((self.layers, c.num_kv_heads, pooled + self.scratch, c.head_dim), pooled,
                                            self.dtype, self.device, self.features)
        return StaticCache(slab, capacity, free.append)

    @property
    def idle(self) -> int:
        """Slabs no cache holds."""
        return sum(map(len, self._free.values()))


class StaticCache:
    """One sequence's keys and values on the device (``k``, ``v``: ``[layers, kv heads, slots,
    head dim]``); slot ``i`` holds position ``i`` of the committed sequence, ``length`` slots are
    valid, ``capacity`` may be used. Its tensors go back to the engine's pool when it is dropped."""

    def __init__(self, slab: Slab, capacity: int, release: Callable[[Slab], None]):
        self.slab, self.k, self.v, self.length = slab, slab.k, slab.v, 0
        self._capacity = capacity
        weakref.finalize(self, release, slab)

    @property
    def capacity(self) -> int:
        return self._capacity

    def compact(self, start: int, keep: Sequence[int] | np.ndarray) -> None:
        """Keep block slots ``start + keep[i]`` (in that order) after the prefix, drop the rest."""
        keep = compaction(start, self.length, keep)
        n = keep.size
        if n and not np.array_equal(keep, np.arange(n)):  # otherwise the kept rows are in place
            kv, rows = self.slab.kv, torch.from_numpy(start + keep)
            if kv.device.type == "cuda":  # sent without waiting (the caching host allocator keeps it alive)
                rows = rows.pin_memory().to(kv.device, non_blocking=True)
            kv[:, :, :, start : start + n] = kv.index_select(3, rows)
        self.length = start + n


class FixedShapeCall:
    """A computation over fixed device buffers that the host fills and reads (``_forward``, in a
    subclass): on CUDA with graphs it is captured on its first run and replayed after (one launch);
    elsewhere, or where capture fails, it runs eagerly. Its inputs are declared (``_input``) in
    the constructor, filled through ``host(name)`` and read by ``_forward`` as attributes; they
    travel to the device in one copy a run (from pinned memory on CUDA: the host does not wait
    for it). Other buffers must be allocated before the first run, and every run must be harmless
    to repeat with the same inputs (the capture's warm-up runs it once more)."""

    def __init__(self, device: torch.device, graph_pool: Any):
        self.device, self._pool = device, graph_pool
        self.graph: Any = None
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._staged: tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray]] | None = None
        self._sent: Any = None  # the CUDA event after the last copy of the inputs, until the host waits for it
        self.timing: tuple[Any, Any] | None = None  # CUDA events around the last timed run (``run_fixed``)

    def _input(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Declare an input the host fills before each run (``self.<name>`` once allocated)."""
        self._specs[name] = (shape, dtype)

    def _staging(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray]]:
        """The inputs' device block, its host twin and the host views, made on first use (every
        input is declared by then), with each input's device view set as an attribute."""
        if self._staged is None:
            offsets, size = {}, 0
            for name, (shape, dtype) in self._specs.items():
                offsets[name] = size
                size += -(-math.prod(shape) * dtype.itemsize // STAGING_ALIGN) * STAGING_ALIGN
            dev = torch.zeros(max(size, STAGING_ALIGN), dtype=torch.uint8, device=self.device)
            host = torch.zeros(dev.shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            views = {}
            for name, (shape, dtype) in self._specs.items():
                at = slice(offsets[name], offsets[name] + math.prod(shape) * dtype.itemsize)
                setattr(self, name, dev[at].view(dtype).view(shape))
                views[name] = host[at].view(dtype).view(shape).numpy()
            self._staged = (dev, host, views)
        return self._staged

    def host(self, name: str) -> np.ndarray:
        """The host side of input ``name``, to fill before ``run_fixed`` (once the last run's copy
        of it has left, which a round's read of any result has waited for already)."""
        if self._sent is not None:
            self._sent.synchronize()
            self._sent = None
        return self._staging()[2][name]

    def _forward(self) -> None:
        raise NotImplementedError

    def run_fixed(self, timed: bool = False) -> None:
        """Run once; ``timed``: on CUDA, keep events around the computation (``timing``) for
        ``device_seconds``, whose caller has waited for the run by then."""
        self.timing = None
        if timed and self.device.type == "cuda":
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            self._run()
            ended.record()
            self.timing = (began, ended)
        else:
            self._run()

    def _run(self) -> None:
        if self._specs:
            dev, host, _ = self._staging()
            dev.copy_(host, non_blocking=True)
            if self.device.type == "cuda":
                self._sent = torch.cuda.Event()
                self._sent.record()
        if self._pool is None:
            self._forward()
            return
        if self.graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    self._forward()
            except RuntimeError as e:  # an op this torch cannot capture: this shape runs eagerly
                warnings.warn(f"CUDA graph capture of {type(self).__name__} failed ({e}); it runs eagerly",
                              RuntimeWarning, stacklevel=2)
                self._pool = None
                self._forward()
                return
            self.graph = graph
        self.graph.replay()


class _StaticPass(FixedShapeCall):
    """A decoding block at one fixed shape (``rows`` padded rows, ``keys`` slots of attention) on
    one cache slab, with the taps asked for: input buffers the host fills, outputs it reads."""

    def __init__(self, engine: "DeviceEngine", slab: Slab, rows: int, keys: int, taps: tuple[int, ...]):
        super().__init__(engine.device, engine._graph_pool)
        self.engine, self.slab, self.keys, self.taps = engine, slab, keys, taps
        self.rows = rows
        for name in ("tokens", "positions", "slots"):
            self._input(name, (rows,), torch.int64)
        self._input("mask", (rows, keys), torch.bool)
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None  # every row's, for greedy verification
        self.hidden: dict[int, torch.Tensor] = {}

    def _forward(self) -> None:
        self.logits, self.hidden = self.engine._layers_pass(
            self.slab, self.tokens, self.positions, self.slots, self.mask, self.keys, self.taps, None)
        self.argmax = self.logits.argmax(-1)

    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, mask: np.ndarray) -> None:
        """Fill the inputs (the mask is built on the host) and run."""
        for name, value in (("tokens", tokens), ("positions", positions), ("slots", slots), ("mask", mask)):
            self.host(name)[:] = value
        self.run_fixed()


class DeviceTree(NamedTuple):
    """A draft tree its drafter left on this engine's device for the verification pass to read:
    ``packed``, a float64 vector of five rows of ``nodes`` entries (tokens, parents, scores,
    origin, depths; nodes past the count are padding) and the node count (the drafter's
    ``device_tree.packed``); no node deeper than ``depth``. The tensor is the drafter's output
    buffer: the pass copies it in, before the drafter's next call can overwrite it. ``timing``:
    the draft call's CUDA events (None where calls run synchronously)."""

    packed: torch.Tensor
    nodes: int
    depth: int
    timing: tuple[Any, Any] | None = None

    def device_seconds(self) -> float:
        """The draft call's time on the device, once the pass that read the tree was waited for:
        the host did not wait for the draft, the pass's wait did (0.0 where the call ran
        synchronously: its time was the host's)."""
        return _elapsed(self.timing)


def _elapsed(timing: tuple[Any, Any] | None) -> float:
    """Seconds between a run's CUDA events (``FixedShapeCall.timing``), waited for; 0.0 without."""
    if timing is None:
        return 0.0
    began, ended = timing
    ended.synchronize()
    return began.elapsed_time(ended) / 1e3


class _TreeBlockPass(FixedShapeCall):
    """A verification block whose tree is on the device (``DeviceTree``), at one fixed shape: the
    root and ``rows - 1`` tree rows (a tree of fewer nodes is padded), attention over ``keys``
    slots, ancestors up to ``depth``. Its tokens, positions, slots and mask are formed here from
    the tree (``load``) and the block's start and root (host inputs): the same block the host
    builds for a tree. ``rule`` ``"greedy"`` or ``"sampling"``: the pass also verifies the tree
    (``device_verify.follow``; sampling's settings and random numbers are inputs) and compacts
    the cache to root + accepted path, leaving what the next round needs in ``Slab.handoffs[writes]``;
    None: it leaves both to the host. ``chained``: the block's start and root are the last
    verified pass's (the other of ``Slab.handoffs``), not host inputs."""

    def __init__(self, engine: "DeviceEngine", slab: Slab, rows: int, keys: int, taps: tuple[int, ...], depth: int,
                 rule: str | None, chained: bool = False, writes: int = 0):
        super().__init__(engine.device, engine._graph_pool)
        self.engine, self.slab, self.rows, self.keys, self.taps = engine, slab, rows, keys, taps
        self.nodes, self.depth, self.rule, self.chained, self.writes = rows - 1, depth, rule, chained, writes
        if not chained:
            self._input("start", (1,), torch.int64)
            self._input("root", (1,), torch.int64)
        if rule == "sampling":
            for name in ("temperature", "top_p"):
                self._input(name, (1,), torch.float64)
            self._input("top_k", (1,), torch.int64)
            self._input("uniforms", (rows,), torch.float64)  # one a node, then the bonus token's
        # ``DeviceTree.packed``'s layout at ``nodes`` columns (padding past a tree's own columns
        # keeps earlier values: nodes past the count, never read but as rows dropped after).
        self.tree = torch.zeros(5 * self.nodes + 1, dtype=torch.float64, device=engine.device)
        self.logits: torch.Tensor | None = None
        self.argmax: torch.Tensor | None = None
        self.hidden: dict[int, torch.Tensor] = {}
        # What crosses to the host, in one copy (float64): ``tree``, the block's start, the path's
        # length, the bonus token, the rows kept (padded); and the tapped rows of those rows, which stay.
        self.result: torch.Tensor | None = None
        self.kept_hidden: dict[int, torch.Tensor] = {}
        self._slots = torch.arange(keys, device=engine.device)  # every slot's index, made once for every run
        # A greedy plain step (no tree: ``ar`` launched ahead) takes a short path (``_plain``),
        # its constant made here too: a captured graph allocates nothing.
        self._plain_step = rows == 1 and rule == "greedy" and engine.config.sliding_window is None
        if self._plain_step:
            self._first = torch.zeros(1, dtype=torch.int64, device=engine.device)

    def _forward(self) -> None:
        m, rows, keys, dev = self.nodes, self.rows, self.keys, self.device
        if self.chained:
            last = self.slab.handoffs[1 - self.writes]
            start, root = last[HANDOFF_START : HANDOFF_START + 1], last[HANDOFF_BONUS : HANDOFF_BONUS + 1]
        else:
            start, root = self.start, self.root
        if self._plain_step:
            self._plain(start, root)
            return
        count = self.tree[-1:].long()
        tree = self.tree[:-1].view(5, m)
        at = torch.arange(m, device=dev)
        valid = at < count
        parents = tree[1].long()
        depths = torch.cat([torch.zeros_like(start), torch.where(valid, tree[4].long(), 1)])  # the root's is 0
        pad = rows - m - 1
        tokens = torch.cat([root, torch.where(valid, tree[0].long(), 0), torch.zeros(pad, dtype=torch.int64, device=dev)])
        positions = torch.cat([start + depths, torch.zeros(pad, dtype=torch.int64, device=dev)])
        slots = torch.cat([start + torch.arange(m + 1, device=dev), self.slab.capacity + torch.arange(pad, device=dev)])
        # Ancestors, a level more each time round: seen[i, j], node j is node i or above it.
        own = at[:, None] == at[None, :]
        above, has = parents.clamp(min=0), (parents >= 0)[:, None]
        seen = own
        for _ in range(self.depth - 1):
            seen = own | (has & seen[above])
        within = torch.cat([torch.ones((m + 1, 1), dtype=torch.bool, device=dev),
                            torch.cat([torch.zeros((1, m), dtype=torch.bool, device=dev), seen])], 1)  # [m+1, m+1]
        key = self._slots
        inside = key - start  # a slot's row in the block
        in_block = (inside >= 0) & (inside <= m)
        mask = (key < start)[None, :] | (within[:, inside.clamp(0, m)] & in_block[None, :])
        window = self.engine.config.sliding_window
        if window is not None:
            key_positions = torch.where(in_block, start + depths[inside.clamp(0, m)], key)
            mask = mask & (positions[: m + 1, None] - key_positions[None, :] < window)
        mask = torch.cat([mask, (key == 0)[None, :].expand(pad, keys)])  # padding rows read slot 0 and are dropped
        self.logits, self.hidden = self.engine._layers_pass(self.slab, tokens, positions, slots, mask, keys, self.taps,
                                                            None)
        # Every row's argmax: the host's (no rule) or greedy verification's; sampling reads none.
        self.argmax = None if self.rule == "sampling" else self.logits.argmax(-1)
        if self.rule is not None:
            self._follow(start, tokens[1 : m + 1], parents, depths[1:], valid)

    def _plain(self, start: torch.Tensor, root: torch.Tensor) -> None:
        """The pass of a tree of no nodes under greedy verification, as the general path computes
        it with a fraction of its kernels: the root alone at ``start``, seeing every slot up to its
        own; the next token its row's argmax; the cache kept as it is (the root's row is the whole
        path); the handoff and the result laid out as ``_follow`` lays them."""
        self.logits, self.hidden = self.engine._layers_pass(self.slab, root, start, start,
                                                            (self._slots <= start)[None, :], self.keys, self.taps, None)
        self.argmax = self.logits.argmax(-1)
        bonus, none = self.argmax[:1], self._first  # no node accepted: the bonus token follows the root's row
        self.result = torch.cat([self.tree, start.double(), none.double(), bonus.double(), none.double()])
        self.kept_hidden = {tap: h[none] for tap, h in self.hidden.items()}
        self.slab.handoffs[self.writes][: HANDOFF_TOKENS + 1] = torch.cat([start + 1, none, bonus, bonus])

    @property
    def levels(self) -> int:
        """The deepest a path can be."""
        return min(self.depth, self.nodes)

    def _follow(self, start: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                valid: torch.Tensor) -> None:
        """Verify (``device_verify.follow``), then move rows ``start + keep`` to ``start + 0..``
        (``keep`` padded with self-copies past the path, so the shape stays fixed), and leave the
        next round's start, root and new tokens in ``Slab.handoffs[writes]``."""
        levels, dev = self.levels, self.device
        sampling = None if self.rule == "greedy" else (self.temperature, self.top_p, self.top_k, self.uniforms)
        path = follow(tokens, parents, depths, valid, self.logits[: self.nodes + 1], self.argmax, levels, sampling)
        kv = self.slab.kv
        kv.index_copy_(3, start + torch.arange(levels + 1, device=dev), kv.index_select(3, start + path.keep))
        self.result = torch.cat([self.tree, start.double(), path.count.double(), path.bonus.double(), path.keep.double()])
        self.kept_hidden = {tap: h[path.keep] for tap, h in self.hidden.items()}
        at = torch.arange(levels + 1, device=dev)
        after = torch.cat([tokens[(path.keep[1:] - 1).clamp(min=0)], path.bonus])  # the path's tokens, padded
        hand = self.slab.handoffs[self.writes]
        hand[: HANDOFF_TOKENS + levels + 1] = torch.cat([start + path.count + 1, path.count, path.bonus,
                                                         torch.where(at == path.count, path.bonus, after)])

    def load(self, tree: DeviceTree) -> None:
        """Copy ``tree`` in (on the device, in stream order: before its drafter's next call)."""
        self.tree[:-1].view(5, self.nodes)[:, : tree.nodes].copy_(tree.packed[:-1].view(5, tree.nodes))
        self.tree[-1:].copy_(tree.packed[-1:])


class PendingPass:
    """A tree pass verified on the device whose outcome the host has not read yet (``Block.ahead``):
    its one small result is on its way to host memory (pinned, not waited for), and the next round
    may already follow it there (``Block.follows``, reading ``handoff``, the one of
    ``Slab.handoffs`` it wrote); ``collect`` waits for the copy and gives the ``ForwardOutput``.
    ``kept_hidden``: the kept rows' taps (``levels + 1`` rows, the path's first), on the device
    until the next pass on the cache."""

    def __init__(self, p: _TreeBlockPass, cache: StaticCache, taps: tuple[int, ...]):
        self.cache, self.levels, self.writes = cache, p.levels, p.writes
        self.handoff = cache.slab.handoffs[p.writes]
        self.kept_hidden, self.timing = p.kept_hidden, p.timing
        self._taps, self._logits, self._width = taps, p.logits, p.tree.shape[0]
        cuda = p.result.device.type == "cuda"
        self._result = torch.empty(p.result.shape, dtype=torch.float64, pin_memory=cuda)
        self._result.copy_(p.result, non_blocking=cuda)
        self._copied = None
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._out: ForwardOutput | None = None

    def device_seconds(self) -> float:
        """The pass's time on the device once collected (0.0 where it ran synchronously)."""
        return _elapsed(self.timing)

    def collect(self) -> ForwardOutput:
        """Wait for the result; the cache's length is then the pass's."""
        if self._out is None:
            if self._copied is not None:
                self._copied.synchronize()
            result = self._result.numpy()
            packed, start, path = result[: self._width], int(result[self._width]), result[self._width + 1 :].astype(np.int64)
            kept, bonus = path[2 : 3 + int(path[0])], int(path[1])
            self.cache.length = start + kept.size
            self._out = ForwardOutput(logits=_Logits(self._logits[: 1 + int(packed[-1])]),
                                      hidden={tap: self.kept_hidden[tap][: kept.size] for tap in self._taps},
                                      tree=packed, kept=kept, bonus=bonus)
        return self._out


class DeviceEngine(TargetEngine):
    """A Llama-family target (Llama, Mistral, Qwen2 layouts) on ``device`` in ``dtype``."""

    heads_on_device = True  # draft heads that have a device twin run beside it (``drafters.device``)

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str = "cpu", dtype: str = "float32",
                 graphs: bool | None = None, pipelines: bool | None = None):
        """``weights``: Hugging Face names to fp32 arrays or GGUF blocks (``loading.load_target``).
        ``graphs``: capture decoding blocks as CUDA graphs (default: on a CUDA device; the same
        tokens either way, see the module docstring). ``pipelines``: a sequence may launch the
        round after a verified pass before the host reads its outcome (``Block.ahead``,
        ``PendingPass``); False: every round is read before the next. Default:
        on a CUDA device, where the device runs while the host reads (elsewhere each call runs
        as it is made, so launching ahead overlaps nothing)."""
        if dtype not in DTYPES:
            raise LyannaError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            self.device = torch.device(device)
        except RuntimeError as e:
            raise LyannaError(f"device {device!r}: {e}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LyannaError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
        self.config = c = config
        self.dtype = getattr(torch, dtype)
        self.name = f"device-{self.device.type}-{dtype}"
        self.pipelines = self.device.type == "cuda" if pipelines is None else pipelines

        def fetch(name: str) -> Any:
            try:
                return weights[name]
            except KeyError:
                raise LyannaError(f"weight {name!r} is missing from the checkpoint; is it a complete {c.architecture}?") from None

        def host(name: str) -> np.ndarray:
            w = fetch(name)
            if isinstance(w, torch.Tensor):
                return w.detach().float().cpu().numpy()
            return w.dense() if isinstance(w, QuantMatrix) else np.ascontiguousarray(w, dtype=np.float32)

        def tensor(name: str) -> torch.Tensor:
            """A weight as a tensor: a torch tensor as it is (a model's own, shared, not copied)."""
            w = fetch(name)
            return w.detach() if isinstance(w, torch.Tensor) else torch.from_numpy(host(name))

        # What the drafters share, as host fp32 arrays (base.TargetEngine).
        self.embed = host("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise LyannaError(f"embedding shape {self.embed.shape} does not match config ({c.vocab_size}, {c.hidden_size})")
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights else host("lm_head.weight")
        self.final_norm = host("model.norm.weight")
        self.inv_freq = rope_inv_freq(c)

        # ``assign``: the modules hold the given tensors; ``to`` copies only what is not already
        # on the device in the dtype (so a model's own weights are shared, never duplicated).
        # Each layer packed for few kernels (``PackedLayer``); the module it was read into goes.
        self.layers: list[PackedLayer] = []
        for i in range(c.num_layers):
            layer = DecoderLayer(c)
            layer.load_state_dict({k: tensor(f"model.layers.{i}.{k}") for k in layer.state_dict()}, assign=True)
            with torch.no_grad():
                self.layers.append(PackedLayer(layer.to(self.device, self.dtype).requires_grad_(False), c))
        self._norm = tensor("model.norm.weight").to(self.device, self.dtype)
        self._embed = tensor("model.embed_tokens.weight").to(self.device, self.dtype)
        tied = self.lm_head is self.embed
        self._lm_head = self._embed if tied else tensor("lm_head.weight").to(self.device, self.dtype)
        self._inv_freq = torch.from_numpy(self.inv_freq).to(self.device)
        cuda = self.device.type == "cuda"
        if graphs and not cuda:
            raise LyannaError(f"CUDA graphs need a CUDA device, not {device!r}")
        # None: fixed-shape calls run eagerly (not CUDA, or --no-cuda-graphs)
        self._graph_pool = torch.cuda.graph_pool_handle() if (cuda if graphs is None else graphs) else None
        self.pool = SlabPool(c.num_layers, c, ROW_BUCKETS[-1], POOL_CAPACITY_MIN, self.dtype, self.device)
        self._passes: dict[tuple[int, int, int, tuple[int, ...]], _StaticPass] = {}
        self._tree_passes: dict[tuple[int, int, int, tuple[int, ...], int], _TreeBlockPass] = {}
        # The tree of a plain step verified in its pass (``_tree_of``): no nodes.
        self._no_tree = DeviceTree(torch.zeros(1, dtype=torch.float64, device=self.device), 0, 0)

    def new_cache(self, capacity: int) -> StaticCache:
        """A cache for ``capacity`` positions, from the pool of caches no generation holds."""
        return self.pool.cache(capacity)

    def forward_batch(self, blocks: Sequence[Block]) -> list[ForwardOutput]:
        """The blocks one after another, each on its own cache; every block is checked before any runs."""
        if len({id(b.cache) for b in blocks}) != len(blocks):
            raise ValueError("each block of a batch needs its own cache")
        passes = [b.tree is not None or b.verification is not None for b in blocks]  # a tree, or a step verified there
        prepared = [(b, *(self._tree_inputs(b) if t else block_inputs(self.config, b))) for b, t in zip(blocks, passes)]
        with torch.inference_mode():
            return [self._run_tree(*p) if t else self._run(*p) for p, t in zip(prepared, passes)]

    def _tree_of(self, b: Block) -> DeviceTree:
        """The block's tree on the device; a plain step verified in its pass has one of no nodes."""
        return self._no_tree if b.tree is None else b.tree

    def _tree_inputs(self, b: Block) -> tuple[int | None, int]:
        """A block whose tree is on the device, checked as ``block_inputs`` checks others: its
        root (None: the bonus token of the pass it follows, on the device) and its start (the
        most it can be, for a block that follows a pass whose outcome the host has not read)."""
        tree = self._tree_of(b)
        if not isinstance(tree, DeviceTree):
            raise ValueError(f"a block's tree on the device must be a DeviceTree, got {type(tree).__name__}")
        if b.prefill or b.block_mask is not None or b.logit_rows is not None:
            raise ValueError("a block whose tree is on the device takes no mask, logit rows or prefill")
        rule = b.verification
        if (b.ahead or b.follows is not None) and rule is None:
            raise ValueError("only a block verified in its pass can be left uncollected or follow one that is")
        if rule is not None and rule.temperature > 0 and np.shape(rule.uniforms) != (tree.nodes + 1,):
            raise ValueError(f"sampling verification needs {tree.nodes + 1} uniforms (one a node, the bonus token's)")
        if b.follows is not None:  # the pass it follows starts at the cache's length (the host read the one before)
            if not isinstance(b.follows, PendingPass) or b.follows.cache is not b.cache:
                raise ValueError("a block follows a pass left uncollected on its own cache")
            root, start = None, b.cache.length + b.follows.levels + 1
        else:
            tokens, positions = np.asarray(b.tokens, np.int64).reshape(-1), np.asarray(b.positions, np.int64).reshape(-1)
            if tokens.shape != (1,) or positions.tolist() != [b.cache.length]:
                raise ValueError("a block whose tree is on the device holds its root alone, at the cache's length")
            if not 0 <= tokens[0] < self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
            root, start = int(tokens[0]), b.cache.length
        rows = pow2_at_least(tree.nodes + 1)  # the tree is padded to its row bucket
        if start + rows > b.cache.capacity:
            raise ValueError(f"cache capacity {b.cache.capacity} exceeded: {start} cached + {rows} new")
        return root, start

    def _run_tree(self, b: Block, root: int | None, start: int) -> "ForwardOutput | PendingPass":
        """A block whose tree is on the device (``_TreeBlockPass``), at its bucketed shape (the
        tree padded to fill it: one pass per bucket, whatever the tree's size): the tree comes to
        the host with the tapped rows and every row's argmax, in one wait. Rows past its node
        count (padding) are left out of the output; they stay in the cache until compaction.
        A block with its ``verification`` is verified and compacted in the pass: the tree, the
        kept rows and the bonus token (``ForwardOutput.kept``) cross in one small copy, while
        the kept rows' taps stay on the device for the drafter's next call and the logits are
        the pass's own buffer (both valid until the next pass on this cache); with ``ahead``
        that copy is not waited for (``PendingPass``). ``start``: the block's, or the most it
        can be (``follows``: attention reads enough keys for it)."""
        cache, tree, rule = b.cache, self._tree_of(b), b.verification
        slab = cache.slab
        rows = pow2_at_least(tree.nodes + 1)
        keys = min(pow2_at_least(start + rows, KEY_BUCKET_MIN), slab.capacity)
        taps = tuple(sorted(set(b.taps)))
        mode = None if rule is None else "greedy" if rule.temperature == 0 else "sampling"
        chained = b.follows is not None
        writes = 1 - b.follows.writes if chained else 0  # the handoff it leaves: not the one it reads
        key = (id(slab), rows, keys, taps, tree.depth, mode, chained, writes)
        p = self._tree_passes.get(key)
        if p is None:
            p = self._tree_passes[key] = _TreeBlockPass(self, slab, rows, keys, taps, tree.depth, mode, chained, writes)
        if not chained:
            p.host("start")[0], p.host("root")[0] = start, root
        if mode == "sampling":
            p.host("temperature")[0], p.host("top_p")[0], p.host("top_k")[0] = rule.temperature, rule.top_p, rule.top_k
            uniforms = p.host("uniforms")  # past the tree's nodes: padding nodes', never read (they are not valid)
            uniforms[: tree.nodes], uniforms[-1] = rule.uniforms[:-1], rule.uniforms[-1]
        p.load(tree)
        p.run_fixed(timed=b.ahead)
        if mode is None:
            *hidden, argmax, packed = _fetch([p.hidden[tap][:rows] for tap in b.taps] + [p.argmax[:rows], p.tree])
            cache.length += rows
            cut = 1 + int(packed[-1])
            return ForwardOutput(logits=_Logits(p.logits[:cut].clone(), argmax[:cut]),
                                 hidden={tap: h[:cut] for tap, h in zip(b.taps, hidden)}, tree=packed)
        pending = PendingPass(p, cache, tuple(b.taps))
        return pending if b.ahead else pending.collect()

    def _run(self, b: Block, tokens: np.ndarray, positions: np.ndarray, within: np.ndarray | None) -> ForwardOutput:
        n, cache = tokens.shape[0], b.cache
        if b.prefill or b.logit_rows is not None or n > ROW_BUCKETS[-1]:
            out = self._run_eager(b, tokens, positions, within)
        else:
            out = self._run_static(b, tokens, positions, within)
        cache.length += n
        return out

    def _run_static(self, b: Block, tokens: np.ndarray, positions: np.ndarray, within: np.ndarray | None) -> ForwardOutput:
        """A decoding block at its bucketed shape (see the module docstring)."""
        cache: StaticCache = b.cache
        slab, n, start = cache.slab, tokens.shape[0], cache.length
        end = start + n
        rows, keys = pow2_at_least(n), min(pow2_at_least(end, KEY_BUCKET_MIN), slab.capacity)
        taps = tuple(sorted(set(b.taps)))
        key = (id(slab), rows, keys, taps)
        if key not in self._passes:
            self._passes[key] = _StaticPass(self, slab, rows, keys, taps)
        p = self._passes[key]
        pad = rows - n
        mask = self._visible(start, positions, within, rows, keys)
        mask[n:, 0] = True  # padding rows read slot 0 (never empty after a prefill) and are dropped
        p.run(np.concatenate([tokens, np.zeros(pad, np.int64)]), np.concatenate([positions, np.zeros(pad, np.int64)]),
              np.concatenate([np.arange(start, end), slab.capacity + np.arange(pad)]), mask)
        # The logits stay on the device (copied out of the pass's buffers, which its next run
        # overwrites); the tapped rows, which every drafter reads, and every row's argmax come
        # over now, in one wait for the pass.
        *hidden, argmax = _fetch([p.hidden[tap][:n] for tap in b.taps] + [p.argmax[:n]])
        return ForwardOutput(logits=_Logits(p.logits[:n].clone(), argmax), hidden=dict(zip(b.taps, hidden)))

    def _visible(self, start: int, positions: np.ndarray, within: np.ndarray | None, rows: int, keys: int) -> np.ndarray:
        """``[rows, keys]``: which slots each of the block's ``n`` rows sees (the cached prefix, the
        block's own ancestors (``within``; None: a single row), keys inside a sliding window);
        rows past ``n`` see nothing."""
        n = positions.shape[0]
        end = start + n
        mask = np.zeros((rows, keys), bool)
        mask[:n, :start] = True
        mask[:n, start:end] = True if within is None else within
        window = self.config.sliding_window
        if window is not None:
            key_positions = np.concatenate([np.arange(start), positions])
            mask[:n, :end] &= positions[:, None] - key_positions[None, :] < window
        return mask

    def _run_eager(self, b: Block, tokens: np.ndarray, positions: np.ndarray, within: np.ndarray | None) -> ForwardOutput:
        """A block at its own shape (prefills, blocks past the last bucket)."""
        start, n = b.cache.length, tokens.shape[0]
        pos = torch.from_numpy(positions).to(self.device)
        rows = None if b.logit_rows is None else torch.from_numpy(np.arange(n)[b.logit_rows]).to(self.device)
        everything = within is None and self.config.sliding_window is None  # a single row sees every slot
        mask = None if everything else torch.from_numpy(self._visible(start, positions, within, n, start + n)).to(self.device)
        logits, hidden = self._layers_pass(
            b.cache.slab, torch.from_numpy(tokens).to(self.device), pos, torch.arange(start, start + n, device=self.device),
            mask, start + n, tuple(b.taps), rows)
        host_logits, *host_hidden = _fetch([logits] + [hidden[tap] for tap in b.taps])
        return ForwardOutput(logits=host_logits, hidden=dict(zip(b.taps, host_hidden)))

    def _layers_pass(self, slab: Slab, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     mask: torch.Tensor | None, keys: int, taps: tuple[int, ...],
                     rows: torch.Tensor | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every layer over the block: keys and values written at ``slots``, attention over the
        first ``keys`` slots under ``mask`` (None: all of them), the logits of ``rows`` (None: all)."""
        c = self.config
        cos, sin = rotation(positions, self._inv_freq, self.dtype)
        x = self._embed[tokens]
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in taps:
                hidden[li] = x
            x = cached_layer(layer, x, cos, sin, slab.k[li], slab.v[li], slots, mask, keys)
        if c.num_layers in taps:  # the final norm of every row is wanted: normalize once, pick after
            hidden[c.num_layers] = rms_norm(x, self._norm, c.rms_norm_eps)
            normed = hidden[c.num_layers] if rows is None else hidden[c.num_layers][rows]
        else:
            normed = rms_norm(x if rows is None else x[rows], self._norm, c.rms_norm_eps)
        return normed @ self._lm_head.T, hidden


class _Logits:
    """A block's logits on the device (``base.DeviceLogits``), with every row's argmax on the
    host when the pass computed it."""

    def __init__(self, t: torch.Tensor, argmax: np.ndarray | None = None):
        self._t, self.shape, self._argmax = t, tuple(t.shape), argmax

    def __getitem__(self, row: int) -> np.ndarray:
        return _fetch([self._t[row]])[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """All rows on the host (``np.asarray``): for tests and tools, not the decoding loop."""
        a = _fetch([self._t])[0]
        return a if dtype is None else a.astype(dtype)

    def argmax(self) -> np.ndarray:
        """Every row's argmax (the first of equal maxima, as numpy's), in one small copy."""
        return self._t.argmax(-1).cpu().numpy() if self._argmax is None else self._argmax


def _fetch(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Device tensors as host arrays (floats as fp32), copied out of buffers a later run
    overwrites; from CUDA asynchronously into pinned memory and one wait for them all."""
    wanted = [torch.float32 if t.is_floating_point() else t.dtype for t in tensors]
    if tensors and tensors[0].device.type == "cuda":
        out = [torch.empty(t.shape, dtype=d, pin_memory=True) for t, d in zip(tensors, wanted)]
        for o, t in zip(out, tensors):
            o.copy_(t, non_blocking=True)
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return [o.numpy() for o in out]
    return [t.to(d).numpy().copy() for t, d in zip(tensors, wanted)]


def device_engine_of(engine: Any, graphs: bool | None = None) -> DeviceEngine | None:
    """Our forward pass over the tensors of a ``TorchEngine``'s Hugging Face model (shared, on its
    device, in its dtype; the drafters get that engine's host arrays), or None when the model's
    weights are not the Llama-family layout the device engine computes."""
    config, model = engine.config, engine.model
    weights = {name: t for name, t in model.named_parameters() if name.startswith(("model.", "lm_head."))}
    dtype = str(engine.dtype).removeprefix("torch.")
    layer = DecoderLayer(config).state_dict()
    wanted = {f"model.layers.{i}.{k}": v.shape for i in range(config.num_layers) for k, v in layer.items()}
    if dtype not in DTYPES or any(name not in weights or weights[name].shape != shape for name, shape in wanted.items()):
        return None
    device = DeviceEngine(config, weights, str(engine.device), dtype, graphs)
    # The packed layers copied the attention and MLP input weights; the model holds slices of
    # them instead (the same values), so that those weights are not kept twice.
    with torch.no_grad():
        for i, layer in enumerate(device.layers):
            for name, view in layer.views().items():
                weights[f"model.layers.{i}.{name}"].data = view
    device.embed, device.lm_head, device.final_norm = engine.embed, engine.lm_head, engine.final_norm
    return device


def load_device_target(name_or_path: str, device: str = "cpu", dtype: str = "float32",
                       graphs: bool | None = None, pipelines: bool | None = None) -> tuple[Target, DeviceEngine]:
    """A target (config, tokenizer, fp32 host weights for the drafters) and its device engine."""
    target = load_target(name_or_path, weight_format="fp32")
    return target, DeviceEngine(target.config, target.weights, device, dtype, graphs, pipelines)
