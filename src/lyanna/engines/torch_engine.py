"""The target as a Hugging Face model in PyTorch, on any device and dtype (``--backend torch``).

It speaks the same small interface as the numpy engine (``base.TargetEngine``), so the decode
loop, the verifier, the budget, the batch scheduler and the drafters are the same code: one
forward runs a block of tree nodes with explicit position ids and a 4D attention mask, and the
cache (a transformers ``DynamicCache``) keeps only the accepted rows afterwards. Logits and tapped
hidden states come back as host fp32 arrays, because verification and the drafters run on the
host (the arrays are a block's rows: a tree of 64 nodes is 64 rows of logits and hidden state).

Causal blocks (prefill, a plain decoding step) are run without a mask, exactly as
``model.generate`` runs them, so ``ar`` here is ``generate()`` token for token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import LyannaError
from .base import Block, ForwardOutput, TargetEngine, block_inputs, compaction
from .config import ModelConfig, rope_inv_freq
from .loading import Target, load_target, load_weights

DTYPES = ("float32", "bfloat16", "float16")


class TorchCache:
    """A ``DynamicCache`` with the loop's cache contract: ``length``, ``capacity``, ``compact``."""

    def __init__(self, capacity: int):
        import transformers
        from transformers import DynamicCache

        self.kv = DynamicCache()
        if not hasattr(self.kv, "layers"):  # compaction edits each layer's keys and values
            raise LyannaError(f"the torch backend needs a transformers whose DynamicCache keeps per-layer "
                              f"objects (5.x); this one is {transformers.__version__}")
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()

    @length.setter
    def length(self, value: int) -> None:
        if not 0 <= value <= self.length:
            raise ValueError(f"a torch cache can only be cut shorter: {value} for a cache of {self.length}")
        self._select(slice(0, value))

    def _select(self, rows: Any) -> None:
        """Keep the cached positions ``rows`` (a slice or an index tensor) of every layer."""
        for layer in self.kv.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            if isinstance(rows, slice):
                layer.keys, layer.values = layer.keys[..., rows, :], layer.values[..., rows, :]
            else:
                index = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys.index_select(-2, index), layer.values.index_select(-2, index)

    def compact(self, start: int, keep: Sequence[int] | np.ndarray) -> None:
        """Keep block positions ``start + keep[i]`` (in that order) after the prefix, drop the rest."""
        import torch

        keep = compaction(start, self.length, keep)
        if np.array_equal(keep, np.arange(keep.size)):  # the kept rows are already in place
            self._select(slice(0, start + keep.size))
        else:
            self._select(torch.from_numpy(np.concatenate([np.arange(start), start + keep])))


class TorchEngine(TargetEngine):
    """A Hugging Face causal LM (Llama, Mistral, Qwen2 layouts) as a Lyanna target engine."""

    def __init__(self, model: Any, config: ModelConfig | None = None):
        """``model``: an ``AutoModelForCausalLM`` on any device and dtype, in eval mode."""
        import torch

        self.torch = torch
        self.model = model.eval()
        hf = model.config
        if config is None:
            arch = (getattr(hf, "architectures", None) or [type(model).__name__])[0]
            config = ModelConfig.from_hf(hf, arch, source=f"{type(model).__name__} config")
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.name = f"torch-{self.device.type}-{str(self.dtype).removeprefix('torch.')}"
        # What the drafters share, as host fp32 arrays (views of the weights for a CPU fp32 model).
        self.embed = _host(model.get_input_embeddings().weight)
        out = model.get_output_embeddings()
        self.lm_head = self.embed if out is None else _host(out.weight)
        self.final_norm = _host(model.model.norm.weight)
        self.inv_freq = rope_inv_freq(config)
        if self.dtype != torch.float32:
            self._exact_host_weights(Path(str(getattr(hf, "_name_or_path", "") or "")))

    @classmethod
    def from_pretrained(cls, model_dir: str, config: ModelConfig, device: str = "cpu", dtype: str = "float32") -> "TorchEngine":
        """Load a Hugging Face model directory with transformers onto ``device`` in ``dtype``."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from .device import torch_device

        if dtype not in DTYPES:
            raise LyannaError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dev = torch_device(device)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        return cls(model.to(dev), config)

    def _exact_host_weights(self, model_dir: Path) -> None:
        """A model loaded in 16 bits: the drafters (and the fingerprint that matches a head to its
        target) get the embedding and LM head as the checkpoint stores them, when it is a local
        directory of safetensors; otherwise the 16-bit values, and a head fingerprinted on the
        float32 weights is refused as trained for another target."""
        names = ("model.embed_tokens.weight", "lm_head.weight")
        if not (model_dir.is_dir() and any(model_dir.glob("*.safetensors"))):
            return
        exact = load_weights(model_dir, only=names)
        if names[0] in exact:
            self.embed = exact[names[0]]
            self.lm_head = exact.get(names[1], self.embed)

    def host_weights(self) -> dict[str, np.ndarray]:
        """The target weights that draft heads read on the host (their fingerprint checks the LM head)."""
        return {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head}

    def new_cache(self, capacity: int) -> TorchCache:
        return TorchCache(capacity)

    def forward_batch(self, blocks: Sequence[Block]) -> list[ForwardOutput]:
        """The blocks one after another (each sequence has its own ``DynamicCache``; a padded
        batched forward is future work), every block checked before any runs."""
        if len({id(b.cache) for b in blocks}) != len(blocks):
            raise ValueError("each block of a batch needs its own cache")
        prepared = [(b, *block_inputs(self.config, b)) for b in blocks]
        return [self._run(*p) for p in prepared]

    def _run(self, b: Block, tokens: np.ndarray, positions: np.ndarray, within: np.ndarray | None) -> ForwardOutput:
        torch = self.torch
        n, start = tokens.shape[0], b.cache.length
        causal = within is None or (np.array_equal(within, np.tril(np.ones((n, n), bool)))
                                    and np.array_equal(positions, np.arange(start, start + n)))
        mask = None if causal else self._mask(start, positions, within)
        rows = np.arange(n)[slice(None) if b.logit_rows is None else b.logit_rows]
        # The LM head runs on the wanted rows only (an int keeps the last ones, as generate() does).
        keep: Any = int(rows.size) if np.array_equal(rows, np.arange(n - rows.size, n)) else torch.from_numpy(rows).to(self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.from_numpy(tokens)[None].to(self.device),
                position_ids=torch.from_numpy(positions)[None].to(self.device),
                attention_mask=mask,
                past_key_values=b.cache.kv,
                use_cache=True,
                output_hidden_states=bool(b.taps),
                logits_to_keep=keep,
            )
        hidden = {tap: _host(out.hidden_states[tap][0]) for tap in b.taps}
        return ForwardOutput(logits=_host(out.logits[0]), hidden=hidden)

    def _mask(self, start: int, positions: np.ndarray, within: np.ndarray) -> Any:
        """The additive [1, 1, n, start + n] mask of a tree block: the cached prefix and the
        block's own ancestors are visible, keys out of a sliding window are not (slot i of the
        cache holds position i: the cache keeps only the committed sequence)."""
        torch = self.torch
        n = positions.shape[0]
        allowed = np.ones((n, start + n), bool)
        allowed[:, start:] = within
        window = self.config.sliding_window
        if window is not None:
            keys = np.concatenate([np.arange(start), positions])
            allowed &= positions[:, None] - keys[None, :] < window
        mask = torch.zeros((n, start + n), dtype=self.dtype)
        mask[torch.from_numpy(~allowed)] = torch.finfo(self.dtype).min
        return mask[None, None].to(self.device)


def _host(t: Any) -> np.ndarray:
    """A tensor as a host fp32 array (no copy for a CPU fp32 tensor)."""
    return t.detach().float().cpu().numpy()


def load_torch_target(name_or_path: str, device: str = "cpu", dtype: str = "float32") -> tuple[Target, TorchEngine]:
    """A target (config, tokenizer, the few host weights drafters read) and its torch engine; the
    full weights are loaded once, by transformers, onto ``device``."""
    target = load_target(name_or_path, weights=False)
    engine = TorchEngine.from_pretrained(str(target.path), target.config, device, dtype)
    target.weights.update(engine.host_weights())
    return target, engine
