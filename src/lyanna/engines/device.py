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

from typing import Any, Sequence

import numpy as np
import torch

from ..errors import LyannaError
from .base import ON_DEVICE, Block, ForwardOutput, TargetEngine, block_inputs
from .config import ModelConfig, rope_inv_freq
from .device_passes import PendingPass, _fetch, _Logits, _StaticPass, _TreeBlockPass
from .device_rows import RowSlabs
from .device_slabs import (HANDOFF_BONUS, HANDOFF_COUNT, HANDOFF_START, HANDOFF_TOKENS, KEY_BUCKET_MIN,
                           POOL_CAPACITY_MIN, ROW_BUCKETS, DeviceTree, FixedShapeCall, JoinedCall, Slab, SlabPool,
                           StaticCache, pow2_at_least)
from .loading import Target, load_target
from .quant import QuantMatrix
from .torch_layers import DecoderLayer, LayerHalves, PackedLayer, attention_bias, cached_layer, rms_norm, rotation

__all__ = ["DTYPES", "DeviceEngine", "DeviceTree", "FixedShapeCall", "HANDOFF_BONUS", "HANDOFF_COUNT", "HANDOFF_START",
           "HANDOFF_TOKENS", "JoinedCall", "KEY_BUCKET_MIN", "PendingPass", "ROW_BUCKETS", "Slab", "StaticCache",
           "device_engine_of", "load_device_target", "pow2_at_least"]

DTYPES = ("float32", "bfloat16", "float16")


def torch_device(device: str) -> torch.device:
    """``device`` checked; a CUDA device named by its index, as its tensors name it (cuda:N)."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise LyannaError(f"device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LyannaError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


class _Weights:
    """A checkpoint's weights by Hugging Face name (fp32 arrays, GGUF blocks or a model's own
    tensors) as the engine reads them: host fp32 arrays, or tensors (a torch tensor as it is: a
    model's own, shared, not copied)."""

    def __init__(self, weights: dict[str, Any], c: ModelConfig):
        self.weights, self.config = weights, c

    def _get(self, name: str) -> Any:
        try:
            return self.weights[name]
        except KeyError:
            raise LyannaError(f"weight {name!r} is missing from the checkpoint; is it a complete "
                              f"{self.config.architecture}?") from None

    def host(self, name: str) -> np.ndarray:
        w = self._get(name)
        if isinstance(w, torch.Tensor):
            return w.detach().float().cpu().numpy()
        return w.dense() if isinstance(w, QuantMatrix) else np.ascontiguousarray(w, dtype=np.float32)

    def tensor(self, name: str) -> torch.Tensor:
        w = self._get(name)
        return w.detach() if isinstance(w, torch.Tensor) else torch.from_numpy(self.host(name))


class DeviceEngine(TargetEngine):
    """A Llama-family target (Llama, Mistral, Qwen2 layouts) on ``device`` in ``dtype``."""

    heads_on_device = True  # draft heads that have a device twin run beside it (``drafters.device``)

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str = "cpu", dtype: str = "float32",
                 graphs: bool | None = None, pipelines: bool | None = None, compiled: bool | None = None,
                 batch_rows: int = 0, row_capacity: int = 4096, whole_layers: bool = False):
        """``weights``: Hugging Face names to fp32 arrays or GGUF blocks (``loading.load_target``).
        ``graphs``: capture decoding blocks as CUDA graphs (default: on a CUDA device; the same
        tokens either way, see the module docstring). ``pipelines``: a sequence may launch the
        round after a verified pass before the host reads its outcome (``Block.ahead``,
        ``PendingPass``); False: every round is read before the next. Default:
        on a CUDA device, where the device runs while the host reads (elsewhere each call runs
        as it is made, so launching ahead overlaps nothing). ``compiled``: each layer's work around
        its attention, the cache write included, through ``torch.compile`` (``torch_layers.LayerHalves``; the
        same tokens); default: on a CUDA device, where eager mode's many small kernels set a small
        model's step time. ``batch_rows``: that many caches of ``row_capacity`` positions are rows
        of one tensor (``device_rows.RowSlabs``), so that the decoding blocks of a continuous batch
        on them run as one pass (0: none; a batch then runs each sequence's passes on its own).
        ``whole_layers``: compiled, each layer as one function, its attention inside
        (``LayerHalves(whole=True)``; implies ``compiled``)."""
        if dtype not in DTYPES:
            raise LyannaError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.device = torch_device(device)
        self.config = c = config
        self.dtype = getattr(torch, dtype)
        self.name = f"device-{self.device.type}-{dtype}"
        cuda = self.device.type == "cuda"
        self.pipelines = cuda if pipelines is None else pipelines
        self.halves = LayerHalves(whole_layers or (cuda if compiled is None else compiled), whole_layers)
        self._load(_Weights(weights, c))
        if graphs and not cuda:
            raise LyannaError(f"CUDA graphs need a CUDA device, not {device!r}")
        # None: fixed-shape calls run eagerly (not CUDA, or --no-cuda-graphs)
        self._graph_pool = torch.cuda.graph_pool_handle() if (cuda if graphs is None else graphs) else None
        # A block of a shape not met before compiles or captures first (up to seconds on a GPU):
        # a bench runs each prompt once untimed before timing it (``bench._interleave``).
        self.shapes_compile = self._graph_pool is not None or self.halves.compiled
        self.pool = SlabPool(c.num_layers, c, ROW_BUCKETS[-1], POOL_CAPACITY_MIN, self.dtype, self.device)
        self.row_slabs = RowSlabs(self, batch_rows, row_capacity) if batch_rows else None
        self._passes: dict[tuple[int, int, int, tuple[int, ...]], _StaticPass] = {}
        self._tree_passes: dict[tuple[int, int, int, tuple[int, ...], int], _TreeBlockPass] = {}
        self._joined: dict[tuple[int, int], JoinedCall] = {}  # (draft call, pass): ``_run_pass``
        # The tree of a plain step verified in its pass (``_tree_of``): no nodes.
        self._no_tree = DeviceTree(torch.zeros(1, dtype=torch.float64, device=self.device), 0, 0)

    @property
    def first_runs(self) -> int:
        """Fixed-shape calls run for the first time so far, in this process (``base.first_runs``);
        always 0 where no shape compiles or captures."""
        return FixedShapeCall.first_runs if self.shapes_compile else 0

    def _load(self, w: "_Weights") -> None:
        """The host arrays the drafters share (``base.TargetEngine``) and the device's tensors."""
        c = self.config
        self.embed = w.host("model.embed_tokens.weight")
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise LyannaError(f"embedding shape {self.embed.shape} does not match config ({c.vocab_size}, {c.hidden_size})")
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in w.weights else w.host("lm_head.weight")
        self.final_norm = w.host("model.norm.weight")
        self.inv_freq = rope_inv_freq(c)
        # ``assign``: the modules hold the given tensors; ``to`` copies only what is not already
        # on the device in the dtype (so a model's own weights are shared, never duplicated).
        # Each layer packed for few kernels (``PackedLayer``); the module it was read into goes.
        self.layers: list[PackedLayer] = []
        for i in range(c.num_layers):
            layer = DecoderLayer(c)
            layer.load_state_dict({k: w.tensor(f"model.layers.{i}.{k}") for k in layer.state_dict()}, assign=True)
            with torch.no_grad():
                self.layers.append(PackedLayer(layer.to(self.device, self.dtype).requires_grad_(False), c))
        self._norm = w.tensor("model.norm.weight").to(self.device, self.dtype)
        self._embed = w.tensor("model.embed_tokens.weight").to(self.device, self.dtype)
        tied = self.lm_head is self.embed
        self._lm_head = self._embed if tied else w.tensor("lm_head.weight").to(self.device, self.dtype)
        self._inv_freq = torch.from_numpy(self.inv_freq).to(self.device)

    def new_cache(self, capacity: int) -> StaticCache:
        """A cache for ``capacity`` positions: a free row of ``row_slabs`` if it holds them, else
        one from the pool of caches no generation holds."""
        row = None if self.row_slabs is None else self.row_slabs.cache(capacity)
        return row if row is not None else self.pool.cache(capacity)

    @property
    def batches_rows(self) -> bool:
        """Whether the host-verified decoding blocks of a batch on row caches share one pass (so a
        batch's steps are better read by the host than launched ahead one sequence at a time)."""
        return self.row_slabs is not None

    def forward_batch(self, blocks: Sequence[Block]) -> list[ForwardOutput]:
        """The blocks, each on its own cache: host-verified decoding blocks on rows of
        ``row_slabs`` in one pass when there are several, the others one after another; every
        block is checked before any runs."""
        if len({id(b.cache) for b in blocks}) != len(blocks):
            raise ValueError("each block of a batch needs its own cache")
        passes = [b.kind in ON_DEVICE for b in blocks]  # a tree left here, or a step verified in its pass
        prepared = [(b, *(self._tree_inputs(b) if t else block_inputs(self.config, b))) for b, t in zip(blocks, passes)]
        shared = [] if self.row_slabs is None else [
            i for i, (p, t) in enumerate(zip(prepared, passes)) if not t and RowSlabs.takes(p[0], len(p[1]))]
        with torch.inference_mode():
            outs = {}
            if len(shared) > 1:
                outs = dict(zip(shared, self.row_slabs.run([blocks[i] for i in shared], [prepared[i][1:] for i in shared])))
            return [outs[i] if i in outs else self._run_tree(*p) if t else self._run(*p)
                    for i, (p, t) in enumerate(zip(prepared, passes))]

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
        self._run_pass(p, tree, timed=b.ahead)
        if mode is None:
            *hidden, argmax, packed = _fetch([p.hidden[tap][:rows] for tap in b.taps] + [p.argmax[:rows], p.tree])
            cache.length += rows
            cut = 1 + int(packed[-1])
            return ForwardOutput(logits=_Logits(p.logits[:cut].clone(), argmax[:cut]),
                                 hidden={tap: h[:cut] for tap, h in zip(b.taps, hidden)}, tree=packed)
        pending = PendingPass(p, cache, tuple(b.taps))
        return pending if b.ahead else pending.collect()

    def _run_pass(self, p: _TreeBlockPass, tree: DeviceTree, timed: bool) -> None:
        """Run ``p`` on ``tree``: alone, or joined with the draft call that ``tree``'s drafter
        deferred (``DeviceTree.deferred``: one launch for the round's drafting, verification,
        compaction and handoff), then what the drafter keeps of the draft's outputs."""
        first = tree.deferred
        if first is None:
            p.load(tree)
            p.run_fixed(timed)
            return
        key = (id(first), id(p))  # a call's shape fixes its tree's: one joined call per pair
        joined = self._joined.get(key)
        if joined is None:  # the draft's tree as it is when ``p`` loads it (eagerly, a new tensor a run)
            nodes, depth = tree.nodes, tree.depth
            joined = self._joined[key] = JoinedCall(first, lambda: p.load(DeviceTree(first.tree, nodes, depth)), p)
        joined.run_fixed(timed)
        p.timing = joined.timing  # the round's device time, drafting included
        for name, destination in tree.keep:
            destination.copy_(getattr(first, name))

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
        bias = attention_bias(mask, self.dtype)
        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in taps:
                hidden[li] = x
            x = cached_layer(layer, x, cos, sin, slab.kv[:, li], slots, bias, keys, self.halves)
        if c.num_layers in taps:  # the final norm of every row is wanted: normalize once, pick after
            hidden[c.num_layers] = rms_norm(x, self._norm, c.rms_norm_eps)
            normed = hidden[c.num_layers] if rows is None else hidden[c.num_layers][rows]
        else:
            normed = rms_norm(x if rows is None else x[rows], self._norm, c.rms_norm_eps)
        return normed @ self._lm_head.T, hidden


def device_engine_of(engine: Any, graphs: bool | None = None, compiled: bool | None = None) -> DeviceEngine | None:
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
    device = DeviceEngine(config, weights, str(engine.device), dtype, graphs, compiled=compiled)
    # The packed layers copied the attention and MLP input weights; the model holds slices of
    # them instead (the same values), so that those weights are not kept twice.
    with torch.no_grad():
        for i, layer in enumerate(device.layers):
            for name, view in layer.views().items():
                weights[f"model.layers.{i}.{name}"].data = view
    device.embed, device.lm_head, device.final_norm = engine.embed, engine.lm_head, engine.final_norm
    return device


# Positions a row cache of ``DeviceEngine.row_slabs`` holds at most (``load_device_target``).
ROW_CAPACITY = 4096


def load_device_target(name_or_path: str, device: str = "cpu", dtype: str = "float32", graphs: bool | None = None,
                       pipelines: bool | None = None, compiled: bool | None = None,
                       batch_rows: int = 0, whole_layers: bool = False) -> tuple[Target, DeviceEngine]:
    """A target (config, tokenizer, fp32 host weights for the drafters) and its device engine
    (``batch_rows`` row caches of ``ROW_CAPACITY`` positions, or the model's context if shorter)."""
    target = load_target(name_or_path, weight_format="fp32")
    capacity = min(ROW_CAPACITY, target.config.max_position_embeddings)
    return target, DeviceEngine(target.config, target.weights, device, dtype, graphs, pipelines, compiled, batch_rows,
                                capacity, whole_layers)
