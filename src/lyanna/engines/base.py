"""What every target engine offers the decode loop: forward a block with positions and a tree mask,
return logits and tapped hidden states, keep the accepted cache rows."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from .config import ModelConfig


def compaction(start: int, length: int, keep: Sequence[int] | np.ndarray) -> np.ndarray:
    """``keep`` as indices into the block ``[start, length)`` of a cache, checked (in range, no
    repeats): what every cache's ``compact`` accepts."""
    keep = np.asarray(keep, dtype=np.int64)
    block = length - start
    if start < 0 or block < 0:
        raise ValueError(f"compact start {start} outside cache of length {length}")
    if keep.size and (keep.min() < 0 or keep.max() >= block or np.unique(keep).size != keep.size):
        raise ValueError(f"compact keep indices {keep.tolist()} invalid for a block of {block}")
    return keep


class Verification(NamedTuple):
    """The loop's verification rule for a tree its engine verifies in the pass: the sampling
    settings (``temperature`` 0: greedy) and, when sampling, uniforms drawn ahead, one for each
    of the tree's nodes and one for the bonus token (so the pass reads no random state)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    uniforms: np.ndarray | None = None


class DeviceLogits(Protocol):
    """Logits an engine keeps where it computed them (a GPU's memory): a row crosses to the host
    when it is read, and greedy verification reads only every row's argmax (a few bytes a row
    instead of the vocabulary's floats)."""

    shape: tuple[int, ...]

    def __getitem__(self, row: int) -> np.ndarray: ...

    def argmax(self) -> np.ndarray: ...


class LeftTree(Protocol):
    """A draft tree its drafter left on the target's device (``engines.device.DeviceTree``): the
    loop knows its size and depth, and, once the pass that read it is back, the draft call's
    time on the device; its nodes come back with that pass (``ForwardOutput.tree``)."""

    nodes: int
    depth: int

    def device_seconds(self) -> float: ...


def first_runs(engine: "TargetEngine") -> int:
    """How many computations of a shape not met before ``engine`` and the drafters on its device
    have run (``DeviceEngine.first_runs``, ``Transformer.first_runs``; 0 for engines that keep no
    count): a round during which it grew timed a compile, not its work."""
    return int(getattr(engine, "first_runs", 0))


def shapes_compile(engine: "TargetEngine") -> bool:
    """Whether a computation's first call at a new shape compiles or captures on ``engine``
    (``DeviceEngine.shapes_compile``): few distinct shapes are then worth more than a size
    fitted to each round."""
    return bool(getattr(engine, "shapes_compile", False))


class PendingOutput(Protocol):
    """A pass launched ahead (``Block.ahead``; ``engines.device.PendingPass``): its outcome stays
    on the device until ``collect``; ``levels``: the most tree levels it can keep."""

    levels: int

    def collect(self) -> "ForwardOutput": ...

    def device_seconds(self) -> float: ...


@dataclass
class ForwardOutput:
    logits: np.ndarray | DeviceLogits  # [rows, vocab] for the requested rows
    # tap -> [n, hidden_size]: host arrays, but for a block verified where it ran (``kept``):
    # there, a device's rows stay on it, valid until the next pass on the cache (the loop hands
    # them to the drafter at once; a draft head on that device keeps them there).
    hidden: dict[int, Any] = field(default_factory=dict)
    # A block whose tree was left on the device (``Block.tree``): that tree, copied to the host
    # with the pass's outputs (the drafter's packed form); the rows above are the root's and its
    # nodes'. None for every other block.
    tree: np.ndarray | None = None
    # A tree block its engine verified where it ran (``Block.verification``): the rows the cache
    # kept, the root's (0) then the accepted nodes' (1 + node), root to leaf (``hidden`` holds
    # those rows alone), and the target's token after them. None: the loop verifies and compacts.
    kept: np.ndarray | None = None
    bonus: int | None = None

    @property
    def verified(self) -> bool:
        """Whether the engine verified the block in its pass (and compacted the cache there):
        the loop then follows ``kept`` and ``bonus`` instead of verifying the logits itself."""
        return self.kept is not None


class Cache(Protocol):
    """One sequence's target KV cache as the loop sees it: ``length`` committed positions
    (assigning a smaller one forgets the tail), a ``capacity``, and ``compact`` after verification."""


    length: int


    @property
    def capacity(self) -> int: ...


    def compact(self, start: int, keep: Sequence[int] | np.ndarray) -> None: ...


class TargetEngine(Protocol):
    """What the decode loop, the batch scheduler, the budget and the drafters need of a target,
    whichever engine computes it (``Transformer`` here, ``torch_engine.TorchEngine``): forward a
    block with positions and a tree mask, return logits and tapped hidden states as host fp32
    arrays, keep the accepted cache rows. The drafters share the target's embedding, LM head,
    final norm and RoPE frequencies as host fp32 arrays. An engine that subclasses it writes
    ``forward_batch`` only: ``forward`` is the batch of one."""


    config: ModelConfig
    name: str  # the engine and its settings, e.g. "numpy" or "torch-cuda-bfloat16": keys calibrations
    embed: np.ndarray
    lm_head: np.ndarray
    final_norm: np.ndarray
    inv_freq: np.ndarray


    def new_cache(self, capacity: int) -> Cache: ...


    def forward(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        cache: Cache,
        block_mask: np.ndarray | None = None,
        logit_rows: Sequence[int] | np.ndarray | slice | None = None,
        taps: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run a block of ``n`` new tokens after the ``cache.length`` cached positions.


        ``block_mask[i, j]`` says whether block token i may attend to block token j (every token
        always sees the whole cached prefix); ``None`` means causal. ``logit_rows`` picks the rows
        whose logits are computed (the LM head is costly), ``None`` means all. ``taps`` are
        Hugging Face ``hidden_states`` indices: ``k < num_layers`` is the input of layer k, and
        ``num_layers`` is the final-norm output.
        """
        return self.forward_batch([Block(tokens, positions, cache, block_mask, logit_rows, taps)])[0]


    def forward_batch(self, blocks: Sequence["Block"]) -> list["ForwardOutput"]: ...


def block_inputs(c: ModelConfig, b: "Block") -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A block's tokens, positions and within-block mask (None: a single row), checked against the
    model and the block's cache the same way by every engine."""
    if b.kind in ON_DEVICE:
        raise ValueError("a block whose tree was left on a device, or verified in its pass, runs on a device engine")
    tokens = np.asarray(b.tokens, dtype=np.int64).reshape(-1)
    positions = np.asarray(b.positions, dtype=np.int64)
    n = tokens.shape[0]
    start, end = b.cache.length, b.cache.length + n
    if n == 0 or positions.shape != (n,):
        raise ValueError(f"need n > 0 tokens and as many positions, got {n} and {positions.shape}")
    if end > b.cache.capacity:
        raise ValueError(f"cache capacity {b.cache.capacity} exceeded: {start} cached + {n} new")
    if tokens.min() < 0 or tokens.max() >= c.vocab_size:
        raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
    if b.prefill and (start != 0 or b.block_mask is not None):
        raise ValueError("a prefill block is causal and starts from an empty cache")
    if n == 1:
        return tokens, positions, None
    within = np.tril(np.ones((n, n), bool)) if b.block_mask is None else np.asarray(b.block_mask, bool)
    if within.shape != (n, n):
        raise ValueError(f"block_mask must be [{n}, {n}], got {within.shape}")
    return tokens, positions, within


class BlockKind(Enum):
    """What a block is, read from its fields once (``Block.kind``)."""

    PREFILL = "prefill"  # a prompt's causal rows from an empty cache
    ROWS = "rows"  # tokens at positions under a mask (a plain step, or root + a host tree): the loop verifies
    DEVICE_TREE = "device-tree"  # root + a tree left on the device; the loop verifies
    VERIFIED = "verified"  # root + a tree left on the device, or a plain step, verified in the pass
    FOLLOWS = "follows"  # as VERIFIED, continuing on the device a pass the host has not read


ON_DEVICE = frozenset({BlockKind.DEVICE_TREE, BlockKind.VERIFIED, BlockKind.FOLLOWS})  # what only a device engine runs


@dataclass
class Block:
    """One sequence's share of a forward pass (the arguments of ``Transformer.forward``)."""


    tokens: Sequence[int] | np.ndarray
    positions: Sequence[int] | np.ndarray
    cache: Cache
    block_mask: np.ndarray | None = None
    logit_rows: Sequence[int] | np.ndarray | slice | None = None
    taps: Sequence[int] = ()
    # A prompt's prefill (causal, from an empty cache): its rows are never compared with rows
    # computed in another block, so the engine may compute them with a faster GEMM.
    prefill: bool = False
    # A draft tree its drafter left on the target's device (``engines.device.DeviceTree``): the
    # block is the root (``tokens``, at ``positions``) and the tree's nodes, which the engine of
    # that device reads where they are, so that no copy waits between drafting and verifying.
    tree: LeftTree | None = None
    # How to verify that tree in the pass itself, compacting the cache there too
    # (``ForwardOutput.kept``); None: the loop verifies and compacts. With no tree: a plain step
    # whose next token the pass picks by the same rule (so that it can be launched ``ahead``).
    verification: Verification | None = None
    # Such a block only: return before the host has its outcome (``engines.device.PendingPass``,
    # whose ``collect`` gives the ``ForwardOutput``), so the next round can start meanwhile.
    ahead: bool = False
    # The pending pass (``ahead``) on the same cache this block continues on the device: the
    # root is that pass's bonus token, after its kept rows (``tokens``/``positions`` unused).
    # Only the cache's last pass, every pass before it read (the cache's length is its start).
    follows: PendingOutput | None = None

    @property
    def kind(self) -> BlockKind:
        if self.follows is not None:
            return BlockKind.FOLLOWS
        if self.verification is not None:
            return BlockKind.VERIFIED
        if self.tree is not None:
            return BlockKind.DEVICE_TREE
        return BlockKind.PREFILL if self.prefill else BlockKind.ROWS

    @property
    def rows(self) -> int:
        """The block's rows in the pass (a tree left on the device counts its padded nodes)."""
        roots = 1 if self.follows is not None else len(self.tokens)
        return roots + (0 if self.tree is None else self.tree.nodes)
