"""Lyanna for a Hugging Face model you already hold: ``generate`` returns what ``model.generate``
returns, decoded speculatively and losslessly.

    import lyanna.hf
    out = lyanna.hf.generate(model, input_ids, draft="path/to/head", max_new_tokens=128)
    out = model.generate(input_ids, custom_generate=lyanna.hf.custom_generate, draft="path/to/head")

The model runs where it is (any device and dtype): a Llama, Mistral or Qwen2 layout through our own
forward pass over the model's tensors (``engines.device``, shared, not copied), any other through
``torch_engine.TorchEngine``; the decode loop, the verifier and the drafters are the ones every
Lyanna method uses. Without a
``draft`` the model-free ``suffix`` drafter speculates; a draft head trained for another model
is refused. Greedy output equals ``model.generate`` in float32.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .decoding.decoder import Decoder, GenerationRequest
from .decoding.sampling import SamplingParams
from .engines.device import device_engine_of
from .engines.loading import Target
from .engines.torch_engine import TorchEngine
from .errors import LyannaError

# Logits processors transformers builds from the sampling settings we honour ourselves.
_OWN_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
# transformers' defaults for generation settings a generation config leaves unset.
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_length": 20}


@dataclass
class _Session:
    """A model's decoder (its latency calibration, drafts and tokenizer are set up once) and the
    draft head loaded into it last."""

    decoder: Decoder
    draft: str | None = None
    draft_method: str = "suffix"


_SESSIONS: "weakref.WeakKeyDictionary[Any, _Session]" = weakref.WeakKeyDictionary()


def decoder_for(model: Any, tokenizer: Any = None) -> Decoder:
    """The Lyanna decoder of a Hugging Face causal LM (made once per model)."""
    return _session(model, tokenizer).decoder


def _session(model: Any, tokenizer: Any) -> _Session:
    session = _SESSIONS.get(model)
    if session is None:
        oracle = TorchEngine(model)
        name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        target = Target(name=name, path=Path(name) if Path(name).is_dir() else None, config=oracle.config,
                        weights=oracle.host_weights(), tokenizer=tokenizer)
        # Our own forward over the model's tensors where we cover its layout (static caches, CUDA
        # graphs, heads on the device); the Hugging Face forward otherwise.
        engine = device_engine_of(oracle) or oracle
        session = _SESSIONS[model] = _Session(Decoder(target, default_drafts=False, engine=engine))
    if tokenizer is not None:
        session.decoder.tokenizer = session.decoder.target.tokenizer = tokenizer
    return session


def _setting(cfg: Any, name: str, given: Any) -> Any:
    """An argument if given, else the generation config's value, else transformers' default."""
    if given is not None:
        return given
    value = getattr(cfg, name, None)
    return _HF_DEFAULTS[name] if value is None else value


def generate(
    model: Any,
    input_ids: Any,
    draft: str | Path | None = None,
    method: str | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: Any = None,
    tokenizer: Any = None,
    stop_strings: str | Sequence[str] | None = None,
    budget: int | str | None = "auto",
    return_results: bool = False,
) -> Any:
    """``model.generate(input_ids, ...)`` by speculative decoding: a LongTensor [batch, prompt +
    new] on the model's device (shorter rows padded with the pad token, as transformers does).

    ``draft``: a draft-head directory (its method, ``lyanna`` or ``eagle``, is used) or None (the
    model-free ``suffix`` drafter); ``method`` overrides the choice (``ar`` is plain decoding).
    Unset sampling arguments come from ``model.generation_config``, as in transformers;
    ``seed=None`` draws one from torch's generator, so ``torch.manual_seed`` makes runs repeat.
    ``attention_mask`` marks left padding in a batch. ``stop_strings`` need ``tokenizer``.
    ``return_results``: also return each row's ``GenerationResult`` (timings, tau, acceptance).
    """
    import torch

    cfg = model.generation_config
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise LyannaError(f"input_ids must be [batch, prompt tokens] with at least one token, got shape {tuple(ids.shape)}")
    if max_new_tokens is None:
        max_new_tokens = cfg.max_new_tokens or max(1, _setting(cfg, "max_length", None) - ids.shape[1])
    sample = bool(_setting(cfg, "do_sample", do_sample))
    if seed is None and sample:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    sampling = SamplingParams(
        temperature=float(_setting(cfg, "temperature", temperature)) if sample else 0.0,
        top_p=float(_setting(cfg, "top_p", top_p)) if sample else 1.0,
        top_k=int(_setting(cfg, "top_k", top_k)) if sample else 0,
        seed=seed,
    )
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
    session = _session(model, tokenizer)
    decoder = session.decoder
    if stops and decoder.tokenizer is None:
        raise LyannaError("stop_strings need the tokenizer: pass tokenizer=")
    request = GenerationRequest(
        max_new_tokens=int(max_new_tokens), sampling=sampling, stop=stops,
        eos_token_ids=None if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos)),
    )
    drafted = _load_draft(session, draft) if draft is not None else "suffix"
    chosen = method or drafted
    prompts = _unpadded_rows(ids, attention_mask)
    if len(prompts) == 1:
        results = [decoder.generate(prompts[0], request, method=chosen, budget=budget)]
    else:
        results = decoder.generate_batch(prompts, request, method=chosen, budget=budget)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (request.eos_token_ids or decoder.eos_token_ids or (0,))[0]
    width = max(len(r.tokens) for r in results)
    new = torch.tensor([r.tokens + [int(pad)] * (width - len(r.tokens)) for r in results], dtype=torch.long)
    out = torch.cat([ids.to(torch.long).cpu(), new], dim=1).to(next(model.parameters()).device)
    return (out, results) if return_results else out


def custom_generate(
    model: Any,
    input_ids: Any,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    synced_gpus: bool = False,
    streamer: Any = None,
    draft: str | Path | None = None,
    lyanna_method: str | None = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """The decoding loop for ``model.generate(..., custom_generate=lyanna.hf.custom_generate,
    draft=DIR)``: transformers prepares the inputs and the generation config, Lyanna decodes.
    Settings a lossless speculative decoder cannot honour (beams, repetition penalty, other
    logits processors, streamers) are refused rather than ignored."""
    cfg = generation_config
    if streamer is not None:
        raise LyannaError("lyanna.hf.custom_generate does not take a streamer")
    if getattr(cfg, "num_beams", 1) != 1:
        raise LyannaError("beam search is not speculative decoding: use num_beams=1")
    others = sorted({type(p).__name__ for p in logits_processor or ()} - _OWN_PROCESSORS)
    if others:
        raise LyannaError(f"generation settings that need {', '.join(others)} are not supported by lyanna.hf")
    stops = getattr(cfg, "stop_strings", None)
    return generate(
        model, input_ids, draft=draft, method=lyanna_method,
        max_new_tokens=max(1, cfg.max_length - input_ids.shape[1]),
        do_sample=cfg.do_sample, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        eos_token_id=cfg.eos_token_id, attention_mask=model_kwargs.get("attention_mask"), tokenizer=tokenizer,
        stop_strings=stops,
    )


def _load_draft(session: _Session, draft: str | Path) -> str:
    """Register a draft head's methods (unless it was the last one loaded) and name the one to
    use: ``lyanna`` or ``eagle``."""
    key = str(Path(draft).resolve())
    if session.draft != key:
        methods = session.decoder.load_draft(str(draft))
        session.draft, session.draft_method = key, "lyanna" if "lyanna" in methods else methods[0]
    return session.draft_method


def _unpadded_rows(ids: Any, attention_mask: Any) -> list[list[int]]:
    """Each row's prompt without its (left) padding."""
    if attention_mask is None:
        return [row.tolist() for row in ids]
    mask = attention_mask.to("cpu").bool()
    if mask.shape != ids.shape:
        raise LyannaError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    rows = []
    for row, m in zip(ids.cpu(), mask):
        kept = row[m].tolist()
        if not kept or not bool(m[m.nonzero()[0, 0]:].all()):
            raise LyannaError("attention_mask must mark a non-empty prompt with padding on the left only")
        rows.append(kept)
    return rows

