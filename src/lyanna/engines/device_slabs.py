"""What the device path keeps on the device between calls, and the calls that run there at fixed
shapes: pooled caches (``Slab``, ``SlabPool``, ``StaticCache``), the fixed-shape call captured as a
CUDA graph (``FixedShapeCall``), a draft tree left on the device (``DeviceTree``) and the layout of
the handoff a verified pass leaves for the next round. The target's passes (``engines.device``) and
the draft heads' calls (``drafters.device``) both build on these, so both import them from here.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from .base import compaction
from .config import ModelConfig


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
                 features: int | torch.Tensor = 0, kv: torch.Tensor | None = None):
        """``features``: a draft head's slab also keeps ``[capacity + scratch, features]`` fp32
        rows for the committed tokens' target features (``drafters.device.DevicePairContext``;
        scratch rows stay zero), pooled with its keys and values so that graphs reading them serve
        later generations too (a tensor: a view to keep them in, a row of ``drafters.device_rows.
        HeadRows``). ``kv``: a view of ``(2, *shape)`` to hold the keys and values in (a row of
        ``device_rows.RowSlabs``), instead of a tensor of its own."""
        self.kv = torch.zeros((2, *shape), dtype=dtype, device=device) if kv is None else kv
        self.row: int | None = None  # its row of a ``device_rows.RowSlabs``, if it is one
        self.k, self.v = self.kv[0], self.kv[1]
        self.capacity = capacity
        if isinstance(features, torch.Tensor):
            self.features: torch.Tensor | None = features
        else:
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
    to repeat with the same inputs (the capture's warm-up runs it once more). Its outputs are the
    attributes ``_forward`` sets: a graph writes those its capture made, so each replay points the
    attributes back at them (a joined call's capture of the same ``_forward`` moves them) and holds
    them, so that the pool never lends their memory to a later capture.

    ``first_runs`` counts, over every call in the process, the runs of a shape not run before:
    such a run compiles and captures (up to seconds on a GPU, where a replay takes a
    millisecond), so a round that contains one says nothing about what drafting costs."""

    first_runs = 0

    def __init__(self, device: torch.device, graph_pool: Any):
        self.device, self._pool = device, graph_pool
        self.graph: Any = None
        self._outputs: tuple[tuple[FixedShapeCall, str, Any], ...] = ()  # what the graph's capture made
        self._ran = False
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
        if not self._ran:
            FixedShapeCall.first_runs += 1
            self._ran = True
        self._send()
        self._launch()

    def _send(self) -> None:
        """The inputs' one copy to the device."""
        if self._specs:
            dev, host, _ = self._staging()
            dev.copy_(host, non_blocking=True)
            if self.device.type == "cuda":
                self._sent = torch.cuda.Event()
                self._sent.record()

    def _launch(self) -> None:
        """``_forward`` replayed from its graph (captured on the first launch), or run eagerly."""
        if self._pool is None:
            self._forward()
            return
        if self.graph is None:
            before = [dict(vars(c)) for c in self._parts()]
            try:
                graph = self._record()
            except RuntimeError as e:  # an op this torch cannot capture: this shape runs eagerly
                warnings.warn(f"CUDA graph capture of {type(self).__name__} failed ({e}); it runs eagerly",
                              RuntimeWarning, stacklevel=2)
                self._pool = None
                self._forward()
                return
            self._outputs = tuple((c, name, value) for c, was in zip(self._parts(), before)
                                  for name, value in vars(c).items() if was.get(name) is not value)
            self.graph = graph
        self.graph.replay()
        for call, name, value in self._outputs:  # where another capture (a joined call's) moved them
            setattr(call, name, value)

    def _record(self) -> Any:
        """``_forward`` warmed up on a side stream, then captured: the graph (not run yet)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward()
        return graph

    def _parts(self) -> tuple[FixedShapeCall, ...]:
        """The calls whose ``_forward`` this one runs (whose attributes hold its outputs)."""
        return (self,)


class JoinedCall(FixedShapeCall):
    """Two calls that follow one another on the device as one (one graph on CUDA): ``first``, then
    ``between`` (device operations from ``first``'s outputs to ``then``'s inputs), then ``then``;
    each keeps its own inputs, and both travel before the launch. A round's draft call and the
    target's pass that verifies its tree run this way: one launch a round, not two."""

    def __init__(self, first: FixedShapeCall, between: Callable[[], None], then: FixedShapeCall):
        super().__init__(then.device, then._pool if first._pool is not None else None)
        self.first, self.between, self.then = first, between, then

    def _send(self) -> None:
        self.first._send()
        self.then._send()

    def _parts(self) -> tuple[FixedShapeCall, ...]:
        return (self.first, self.then)

    def _forward(self) -> None:
        self.first._forward()
        self.between()
        self.then._forward()


class DeviceTree(NamedTuple):
    """A draft tree its drafter left on this engine's device for the verification pass to read:
    ``packed``, a float64 vector of five rows of ``nodes`` entries (tokens, parents, scores,
    origin, depths; nodes past the count are padding) and the node count (the drafter's
    ``device_tree.packed``); no node deeper than ``depth``. The tensor is the drafter's output
    buffer: the pass copies it in, before the drafter's next call can overwrite it. ``timing``:
    the draft call's CUDA events (None where calls run synchronously, or where the call is
    ``deferred``). ``deferred``: the draft call itself, not run yet (its tree its ``tree``
    attribute once it has run, ``packed`` the last run's): the pass runs it joined with its own
    (``JoinedCall``), then copies each output the drafter ``keep``s (the call's attribute of
    that name) to the tensor beside it."""

    packed: torch.Tensor
    nodes: int
    depth: int
    timing: tuple[Any, Any] | None = None
    deferred: FixedShapeCall | None = None
    keep: tuple[tuple[str, torch.Tensor], ...] = ()

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
