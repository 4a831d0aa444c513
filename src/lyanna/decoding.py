"""Decoding on the engine: requests, results, and the autoregressive baseline ``ar``.

Every method (``ar`` here, speculative ones elsewhere) runs through ``Decoder.generate``, which
owns prefill, the KV cache, timing and the output tracker, so methods differ only in how they
extend the output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .engine import KVCache, Transformer
from .errors import LyannaError
from .loading import Target
from .sampling import SamplingParams, next_token
from .stopping import OutputTracker


@dataclass(frozen=True)
class GenerationRequest:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise LyannaError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationResult:
    method: str
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    prefill_seconds: float  # time to the first new token
    seconds: float  # end to end, prefill included
    target_passes: int  # target forward passes, prefill included
    draft_tokens: int = 0  # draft tokens sent to verification
    accepted_draft_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        decode = self.seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else None

    @property
    def tau(self) -> float | None:
        """Tokens committed per target forward pass (None where passes are not counted)."""
        return self.new_tokens / self.target_passes if self.target_passes else None

    @property
    def waste_ratio(self) -> float | None:
        return 1.0 - self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": None if self.decode_tokens_per_s is None else round(self.decode_tokens_per_s, 3),
            "tau": None if self.tau is None else round(self.tau, 4),
            "waste_ratio": None if self.waste_ratio is None else round(self.waste_ratio, 4),
        }


@dataclass
class DecodeState:
    """What a method works on: the cache holds the prompt and every committed token but the one
    to be chosen next from ``last_logits`` (the target's logits after the cached context)."""

    engine: Transformer
    cache: KVCache
    tracker: OutputTracker
    params: SamplingParams
    rng: np.random.Generator
    prompt_ids: list[int]
    last_logits: np.ndarray  # target logits after the cached context
    prefill_hidden: dict[int, np.ndarray] = field(default_factory=dict)  # taps over the prompt
    target_passes: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


Method = Callable[[DecodeState], None]


def decode_ar(state: DecodeState) -> None:
    """Plain autoregressive decoding: one target pass per token."""
    engine, cache, tracker = state.engine, state.cache, state.tracker
    while True:
        token = next_token(state.last_logits, state.params, state.rng)
        tracker.extend([token])
        if tracker.finished:
            return
        state.last_logits = engine.forward([token], [cache.length], cache).logits[-1]
        state.target_passes += 1


METHODS: dict[str, Method] = {"ar": decode_ar}
DRAFTS_DIR = Path(__file__).parent / "drafts"  # trained heads shipped with the package, by model alias
# Tree positions past the committed context that a cache must hold: the largest verification block.
MAX_TREE_TOKENS = 256


class Decoder:
    """A loaded target plus everything to turn prompts into outputs with any registered method."""

    def __init__(self, target: Target, default_drafts: bool = True):
        """``default_drafts``: register the draft heads shipped for this model (``lyanna/drafts/<name>/``)."""
        self.target = target
        self.engine = Transformer(target.config, target.weights)
        self.tokenizer = target.tokenizer
        self.eos_token_ids = target.config.eos_token_ids
        self.drafters: dict[str, Any] = {}
        self._curve = None
        from .drafters.suffix import SuffixDrafter

        self.add_drafter("suffix", SuffixDrafter())
        shipped = DRAFTS_DIR / target.name
        if default_drafts and shipped.is_dir():
            for sub in sorted(p for p in shipped.iterdir() if (p / "config.json").is_file()):
                self.load_draft(str(sub))

    def add_drafter(self, name: str, drafter: Any) -> None:
        """Make ``name`` a method: the shared speculative loop driven by ``drafter``."""
        if name in METHODS:
            raise LyannaError(f"method name {name!r} is taken")
        self.drafters[name] = drafter

    def load_draft(self, path: str) -> list[str]:
        """Load a draft-head checkpoint and register the methods it provides (``eagle``; or
        ``lyanna`` with its ablations ``lyanna-noresample`` and ``lyanna-nofusion``)."""
        import json

        cfg_file = Path(path) / "config.json"
        arch = json.loads(cfg_file.read_text()).get("arch") if cfg_file.is_file() else None
        if arch == "eagle":
            from .drafters.eagle import EagleDrafter

            self.drafters["eagle"] = EagleDrafter.from_checkpoint(path, self.target, self.engine)
            return ["eagle"]
        if arch == "lyanna":
            from .drafters.lyanna import LyannaDrafter

            variants = {"lyanna": {"policy": "fuse"}, "lyanna-noresample": {"policy": "off"},
                        "lyanna-nofusion": {"policy": "reuse", "reuse_min_expected": 0.0}}
            for name, knobs in variants.items():
                self.drafters[name] = LyannaDrafter.from_checkpoint(path, self.target, self.engine, **knobs)
            return list(variants)
        raise LyannaError(f"{path}: not a known draft checkpoint (need config.json with arch 'eagle' or 'lyanna')")

    def latency_curve(self, recalibrate: bool = False):
        """This machine's target latency against block size (``lyanna calibrate``): read from the
        per-model, per-machine cache, measured (a few seconds) and cached when missing."""
        from .budget import calibrate, calibration_path, load_curve, save_curve

        if self._curve is None or recalibrate:
            path = calibration_path(self.target.name, self.engine)
            curve = None if recalibrate else load_curve(path)
            if curve is None:
                curve = calibrate(self.engine, self.target.name)
                save_curve(curve, path)
            self._curve = curve
        return self._curve

    @property
    def methods(self) -> list[str]:
        return [*METHODS, *self.drafters]

    def encode(self, prompt: str, chat: bool = True, system: str | None = None) -> list[int]:
        """Token ids of a prompt, wrapped in the model's chat template when it has one."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self,
        prompt_ids: Sequence[int],
        request: GenerationRequest = GenerationRequest(),
        method: str = "ar",
        on_text: Callable[[str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        budget: int | str | None = "auto",
        fallback: bool = False,
    ) -> GenerationResult:
        """Generate with ``method``; ``on_text`` receives streamed text, and ``should_cancel`` is
        polled at every commit (a true answer ends generation with finish reason ``cancelled``).

        Speculative methods only: ``budget`` is the number of draft nodes verified per round,
        ``"auto"`` (this machine's latency curve decides each round) or None (the drafter's whole
        tree); ``fallback`` stops drafting once speculation is slower than plain decoding."""
        if method.split("-")[0] in ("eagle", "lyanna") and method not in self.methods:
            raise LyannaError(f"method {method!r} needs a draft head: pass --draft DIR (a checkpoint made by the training pipeline)")
        if method not in self.methods:
            raise LyannaError(f"unknown method {method!r}; available: {', '.join(self.methods)}")
        drafter = self.drafters.get(method)
        if budget is not None:
            from .budget import parse_budget

            budget = parse_budget(budget)
        taps = tuple(drafter.taps) if drafter is not None else ()
        prompt_ids = [int(t) for t in prompt_ids]
        limit = self.target.config.max_position_embeddings
        if not prompt_ids:
            raise LyannaError("the prompt is empty")
        if len(prompt_ids) + request.max_new_tokens > limit:
            raise LyannaError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {request.max_new_tokens} "
                f"exceeds the model's context window of {limit} tokens"
            )
        t0 = time.perf_counter()
        cache = self.engine.new_cache(len(prompt_ids) + request.max_new_tokens + MAX_TREE_TOKENS)
        tracker = OutputTracker(self.tokenizer, self.eos_token_ids, request.max_new_tokens, request.stop, on_text, should_cancel)
        out = self.engine.forward(prompt_ids, np.arange(len(prompt_ids)), cache, logit_rows=[-1], taps=taps)
        state = DecodeState(
            self.engine, cache, tracker, request.sampling, request.sampling.rng(), prompt_ids,
            out.logits[-1], out.hidden, target_passes=1,
        )
        if drafter is None:
            METHODS[method](state)
        else:
            from .budget import Budget
            from .speculative import decode_speculative

            curve = self.latency_curve() if budget == "auto" or fallback else None
            decode_speculative(state, drafter, None if budget is None else Budget(budget, curve),
                               curve(1) if fallback else None)
        t1 = time.perf_counter()
        return GenerationResult(
            method=method,
            prompt_tokens=len(prompt_ids),
            tokens=list(tracker.tokens),
            text=tracker.text,
            finish_reason=tracker.finish_reason or "length",
            prefill_seconds=(tracker.first_token_time or t1) - t0,
            seconds=t1 - t0,
            target_passes=state.target_passes,
            draft_tokens=state.draft_tokens,
            accepted_draft_tokens=state.accepted_draft_tokens,
            extra=state.stats,
        )
