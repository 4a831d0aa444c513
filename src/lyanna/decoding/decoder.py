"""Decoding on the engine: requests, results, and the ``Decoder`` that maps method names to drafters.

Every method runs through ``Decoder.generate``, which owns prefill, the KV cache, timing and the
output tracker, then hands over to the one decode loop (``loop.rounds``) with the method's
drafter; ``ar`` is the drafter that proposes nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

import numpy as np

from ..drafters.base import Drafter, NoDrafter, fork
from ..drafters.registry import PLAIN_METHOD, arch_providing, load_methods, model_free_methods
from ..engines.base import Block, ForwardOutput, TargetEngine
from ..engines.loading import Target
from ..engines.transformer import Transformer
from ..errors import LyannaError
from .batching import BatchScheduler
from .budget import Budget, Evidence, LatencyCurve, Load, parse_budget
from .loop import DecodeState, rounds, run_alone
from .policy import Fallback
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .stopping import OutputTracker


@dataclass(frozen=True)
class GenerationRequest:
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's end-of-sequence tokens

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


DRAFTS_DIR = Path(__file__).parents[1] / "drafts"  # trained heads shipped with the package, by model alias
# The default method: the first of these a decoder has. The order is the measured one on the default
# engine, fastest lossless method first (the README's lyanna bench runs on the Zen 4 host,
# docs/bench/default-gguf-vnni-zen4-price-a.json and -price-b.json: lyanna+suffix ahead of suffix
# and of lyanna alone); a model without a draft head gets suffix.
DEFAULT_METHODS = ("lyanna+suffix", "suffix", PLAIN_METHOD)
# On an engine that launches each round before the host reads the last (``DeviceEngine.pipelines``,
# CUDA's default) a head's tree stays on the device and its round runs ahead, while lyanna+suffix's
# trees come to the host for the suffix matches, a round at a time: lyanna first there (both H200
# benches, docs/bench/gpu/h200-joined-bench-bfloat16.json and h200-cache-in-graph-bench-bfloat16.json).
AHEAD_DEFAULT_METHODS = ("lyanna", "suffix", "lyanna+suffix", PLAIN_METHOD)
# Tree positions past the committed context that a cache must hold: the largest verification block.
MAX_TREE_TOKENS = 256


class Decoder:
    """A loaded target plus everything to turn prompts into outputs with any registered method."""

    def __init__(self, target: Target, default_drafts: bool = True, engine: TargetEngine | None = None,
                 prefix_cache_tokens: int = 0, prefill_chunk: int = 0):
        """``default_drafts``: register the draft heads shipped for this model (``lyanna/drafts/<name>/``);
        ``engine``: what computes the target (default: the numpy engine over ``target.weights``;
        ``torch_engine.TorchEngine`` for the Hugging Face model in PyTorch); ``prefix_cache_tokens``:
        keep up to this many positions of recent prompts and prefill only what a new prompt adds to
        the longest of them (``prefix_cache.py``; engines whose prefill rows depend on their block
        get none, so ``prefix_cache`` stays None there); ``prefill_chunk``: in a batch, prefill a
        prompt at most this many positions a pass, so that a long prompt does not hold up the
        sequences decoding beside it for its whole prefill (0: whole prompts; engines whose prefill
        rows depend on their block always prefill whole prompts)."""
        if prefill_chunk < 0:
            raise LyannaError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.target = target
        self.engine = Transformer(target.config, target.weights) if engine is None else engine
        exact = getattr(self.engine, "blockwise_prefill", False)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 and exact else None
        self.tokenizer = target.tokenizer
        self.eos_token_ids = target.config.eos_token_ids
        self.drafters: dict[str, Drafter] = {}  # the speculative methods
        self._plain = NoDrafter()
        # One fallback per method and tree budget for the decoder's life: a method that did not pay
        # on the last generation starts the next where that one left off (paused, or probing),
        # instead of paying a fresh stretch of slow rounds on every request. Per budget too, as the
        # budgets are: ``lyanna`` and ``lyanna@2`` benchmarked side by side must not pause each other.
        self._fallbacks: dict[tuple[str, int | str | None], Fallback] = {}
        # Likewise one auto/fixed budget per method for generations alone (a batch sizes trees by
        # its load, per sequence): its skip waits, drafting time and corrections carry over. In a
        # batch each generation has its own budget, and a method's budgets share their evidence.
        self._budgets: dict[tuple[str, int | str], Budget] = {}
        self._batch_evidence: dict[tuple[str, int | str], Evidence] = {}
        self._curve: LatencyCurve | None = None
        for name, drafter in model_free_methods(target, self.engine).items():
            self.add_drafter(name, drafter)
        shipped = DRAFTS_DIR / target.name
        if default_drafts and shipped.is_dir():
            for sub in sorted(p for p in shipped.iterdir() if (p / "config.json").is_file()):
                self.load_draft(str(sub))

    @property
    def effective_prefill_chunk(self) -> int:
        """Prompt positions a batched prefill takes per pass (0: whole prompts): ``prefill_chunk``
        on an engine whose prefill rows do not depend on their block, else 0."""
        return self.prefill_chunk if getattr(self.engine, "blockwise_prefill", False) else 0

    def add_drafter(self, name: str, drafter: Drafter) -> None:
        """Make ``name`` a method: the decode loop driven by ``drafter``."""
        if name == PLAIN_METHOD:
            raise LyannaError(f"method name {name!r} is taken")
        if not isinstance(drafter, Drafter):
            raise LyannaError(f"{type(drafter).__name__} is not a drafter: subclass lyanna.drafters.base.Drafter")
        self.drafters[name] = drafter

    def load_draft(self, path: str) -> list[str]:
        """Load a draft-head checkpoint and register the methods its drafter provides (``eagle``;
        or ``lyanna`` with its ablations), replacing methods of the same name."""
        methods = load_methods(path, self.target, self.engine)
        self.drafters.update(methods)
        return list(methods)

    def latency_curve(self, recalibrate: bool = False) -> LatencyCurve:
        """This machine's target latency against block size (``lyanna calibrate``): read from the
        per-model, per-machine cache, measured (a few seconds) and cached when missing."""
        if self._curve is None or recalibrate:
            # Imported here, where a curve is missing, not on every call: every drafting round's
            # budget asks for the curve, and the import statement cost ~15 us a round in the decode loop.
            from .budget import calibrate, calibration_path, load_curve, save_curve

            path = calibration_path(self.target.name, self.engine)
            curve = None if recalibrate else load_curve(path)
            if curve is None:
                curve = calibrate(self.engine, self.target.name)
                save_curve(curve, path)
            self._curve = curve
        return self._curve

    @property
    def default_method(self) -> str:
        """The method ``lyanna generate`` and ``make run`` use when none is named."""
        order = AHEAD_DEFAULT_METHODS if getattr(self.engine, "pipelines", False) else DEFAULT_METHODS
        return next(m for m in order if m in self.methods)

    @property
    def methods(self) -> list[str]:
        return [PLAIN_METHOD, *self.drafters]

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
        method: str = PLAIN_METHOD,
        on_text: Callable[[str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        budget: int | str | None = "auto",
        fallback: bool = False,
    ) -> GenerationResult:
        """Generate with ``method``; ``on_text`` receives streamed text, and ``should_cancel`` is
        polled at every commit (a true answer ends generation with finish reason ``cancelled``).

        Speculative methods only: ``budget`` is the number of draft nodes verified per round,
        ``"auto"`` (this machine's latency curve decides each round) or None (the drafter's whole
        tree); ``fallback`` pauses drafting while it is slower than plain decoding and probes
        again later (``policy.Fallback``, one per method that carries over from one generation to
        the next; the command line turns it on by default)."""
        return run_alone(self.steps(prompt_ids, request, method, on_text, should_cancel, budget, fallback), self.engine)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        requests: GenerationRequest | Sequence[GenerationRequest] = GenerationRequest(),
        method: str = PLAIN_METHOD,
        max_batch: int | None = None,
        budget: int | str | None = "auto",
    ) -> list[GenerationResult]:
        """Generate for several prompts together, ``max_batch`` at a time (None: all), one forward
        pass per step for the whole batch; a finished sequence's place goes to the next prompt
        (while prompts wait for one, the auto budget drafts nothing: ``Budget.throughput_bound``).
        Each result is token-identical to ``generate`` on that prompt alone."""
        reqs = [requests] * len(prompts) if isinstance(requests, GenerationRequest) else list(requests)
        if len(reqs) != len(prompts):
            raise LyannaError(f"{len(prompts)} prompts but {len(reqs)} requests")
        scheduler = BatchScheduler(self.engine, self.drafter_for, max_batch or max(1, len(prompts)))
        waiting = list(enumerate(zip(prompts, reqs)))[::-1]
        results: dict[int, GenerationResult] = {}
        while waiting or scheduler.active:
            while waiting and scheduler.can_admit(method):
                i, (ids, req) = waiting.pop()
                scheduler.admit(i, self.steps(ids, req, method, budget=budget, load=scheduler.load_for(i)), method)
            scheduler.waiting = len(waiting)
            for i, outcome in scheduler.step():
                if isinstance(outcome, BaseException):
                    raise outcome
                results[i] = outcome
        return [results[i] for i in range(len(prompts))]

    def drafter_for(self, method: str) -> Drafter:
        """The registered drafter of ``method``, with a clear error for an unknown method."""
        drafter = self._plain if method == PLAIN_METHOD else self.drafters.get(method)
        if drafter is None:
            arch = arch_providing(method)
            if arch is not None:
                raise LyannaError(f"method {method!r} needs a draft head: pass --draft DIR (a checkpoint of arch "
                                  f"{arch!r} made by the training pipeline)")
            raise LyannaError(f"unknown method {method!r}; available: {', '.join(self.methods)}")
        return drafter

    def steps(
        self,
        prompt_ids: Sequence[int],
        request: GenerationRequest = GenerationRequest(),
        method: str = PLAIN_METHOD,
        on_text: Callable[[str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        budget: int | str | None = "auto",
        fallback: bool = False,
        load: Callable[[], Load] | None = None,
    ) -> Generator[Block, ForwardOutput, GenerationResult]:
        """``generate`` as a generator of forward blocks (prefill first, then one per round) that
        is sent each block's output and returns the result: what the batch scheduler drives
        (``load``: its ``load_for``, so the auto budget sizes trees for the whole pass). The
        request is checked before the first block."""
        drafter = fork(self.drafter_for(method))
        if budget is not None:
            budget = parse_budget(budget)
        prompt_ids = [int(t) for t in prompt_ids]
        limit = self.target.config.max_position_embeddings
        if not prompt_ids:
            raise LyannaError("the prompt is empty")
        if len(prompt_ids) + request.max_new_tokens > limit:
            raise LyannaError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens {request.max_new_tokens} "
                f"exceeds the model's context window of {limit} tokens"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.target.config.vocab_size:
            raise LyannaError(f"prompt token ids must lie in [0, {self.target.config.vocab_size})")
        return self._steps(drafter, method, prompt_ids, request, on_text, should_cancel, budget, fallback, load)

    def _budget(self, method: str, spec: int | str | None, load: Callable[[], Load] | None) -> Budget | None:
        if spec is None:
            return None
        key = _key(method, spec)
        if load is not None:
            return Budget(spec, self.latency_curve, load=load, evidence=self._batch_evidence.setdefault(key, Evidence()))
        if key not in self._budgets:
            self._budgets[key] = Budget(spec, self.latency_curve)
        return self._budgets[key]

    def _fallback(self, method: str, spec: int | str | None) -> Fallback:
        key = _key(method, spec)
        if key not in self._fallbacks:
            self._fallbacks[key] = Fallback(lambda: float(self.latency_curve()(1)))
        return self._fallbacks[key]

    def _steps(self, drafter: Drafter, method: str, prompt_ids: list[int], request: GenerationRequest,
               on_text: Callable[[str], None] | None, should_cancel: Callable[[], bool] | None,
               budget: int | str | None, fallback: bool,
               load: Callable[[], Load] | None) -> Generator[Block, ForwardOutput, GenerationResult]:
        t0 = time.perf_counter()
        cache = self.engine.new_cache(len(prompt_ids) + request.max_new_tokens + MAX_TREE_TOKENS)
        eos = self.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        tracker = OutputTracker(self.tokenizer, eos, request.max_new_tokens, request.stop, on_text, should_cancel)
        taps = tuple(drafter.taps)
        if self.prefix_cache is not None:  # cache the taps of every method, so that any can reuse the prompt
            taps = tuple(sorted(set(taps).union(*(d.taps for d in self.drafters.values()))))
        hit = None if self.prefix_cache is None else self.prefix_cache.lookup(prompt_ids, taps)
        start = 0 if hit is None else hit.length
        if hit is not None:
            hit.restore(cache)
        # In a batch (``load``), a long prompt goes in chunks so that the sequences decoding beside
        # it keep stepping; only an engine whose prefill rows do not depend on their block chunks.
        chunk = (self.effective_prefill_chunk or len(prompt_ids)) if load is not None else len(prompt_ids)
        parts: list[dict[int, np.ndarray]] = [] if hit is None else [hit.hidden]
        for lo in range(start, len(prompt_ids), chunk):
            hi = min(lo + chunk, len(prompt_ids))
            out = yield Block(prompt_ids[lo:hi], np.arange(lo, hi), cache, logit_rows=[-1] if hi == len(prompt_ids) else [],
                              taps=taps, prefill=lo == 0)
            parts.append(out.hidden)
        hidden = parts[0] if len(parts) == 1 else {t: np.concatenate([p[t] for p in parts]) for t in taps}
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt_ids, cache, hidden)
        # In a batch whose decoding blocks share a pass (``batches_rows``), the host reads each
        # step, so that the next gathers every sequence's block again. In a batch the drafters
        # that can draft together do (``DraftRequest``).
        shared = load is not None and getattr(self.engine, "batches_rows", False)
        state = DecodeState(
            self.engine, cache, tracker, request.sampling, request.sampling.rng(), prompt_ids,
            out.logits[-1], hidden, target_passes=len(parts) - (hit is not None),
            ahead=getattr(self.engine, "pipelines", False) and not shared, together=load is not None,
        )
        # The latency curve is asked for only when a round needs it: ``ar`` never measures anything.
        stats = yield from rounds(state, drafter, self._budget(method, budget, load),
                                  self._fallback(method, budget) if fallback else None)
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
            draft_tokens=stats.draft_tokens,
            accepted_draft_tokens=stats.accepted_draft_tokens,
            extra=stats.to_extra(),
        )


def _key(method: str, spec: int | str | None) -> tuple[str, int | str | None]:
    """What a method's budget and fallback are kept by: the method and its parsed tree budget."""
    return method, None if spec is None else parse_budget(spec)
