"""OpenAI-compatible HTTP server: one engine, a bounded queue, streaming, exact usage.

Generation runs on one worker thread (the engine is not re-entrant); requests wait in a bounded
queue and get 429 with ``Retry-After`` when it is full. Unsupported parameters are refused with
400, never ignored. A client that disconnects, or a request past its deadline, cancels its
generation at the next commit.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .decoding import Decoder, GenerationRequest, GenerationResult
from .errors import LyannaError
from .sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def _error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | None = None
    user: str | None = None
    lyanna_method: str | None = Field(None, description="Lyanna extension: the decoding method for this request")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (they would change the target distribution)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Common):
    prompt: str = Field(min_length=1)


@dataclass(eq=False)  # identity semantics: jobs live in a set
class Job:
    ids: list[int]
    request: GenerationRequest
    method: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def push(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class EngineWorker:
    """Runs jobs one at a time on a thread; at most ``max_pending`` queued or running."""

    def __init__(self, decoder: Decoder, max_pending: int):
        self.decoder, self.max_pending = decoder, max_pending
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._active: set[Job] = set()
        self._thread = threading.Thread(target=self._run, name="lyanna-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> bool:
        with self._lock:
            if len(self._active) >= self.max_pending:
                return False
            self._active.add(job)
        self._jobs.put(job)
        return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.cancel.is_set():
                    job.push("cancelled", None)
                    continue
                result = self.decoder.generate(
                    job.ids, job.request, method=job.method,
                    on_text=lambda s, job=job: job.push("text", s), should_cancel=job.cancel.is_set,
                )
                job.push("done", result)
            except Exception as e:  # reported to that request only; the worker lives on
                job.push("error", e)
            finally:
                with self._lock:
                    self._active.discard(job)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel everything in flight or queued and stop the thread."""
        with self._lock:
            for job in self._active:
                job.cancel.set()
        self._jobs.put(None)
        self._thread.join(timeout)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lyanna_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.tokens = Counter("lyanna_generated_tokens", "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("lyanna_prompt_tokens", "Prompt tokens processed", registry=r)
        self.drafted = Counter("lyanna_draft_tokens", "Draft tokens sent to verification", registry=r)
        self.accepted = Counter("lyanna_accepted_draft_tokens", "Draft tokens accepted", registry=r)
        self.passes = Counter("lyanna_target_passes", "Target forward passes", registry=r)
        self.latency = Histogram("lyanna_request_latency_seconds", "End-to-end request latency", ["endpoint"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
        self.ttft = Histogram("lyanna_time_to_first_token_seconds", "Time to the first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8))
        self.tau = Gauge("lyanna_tau", "Tokens per target pass over all requests so far", registry=r)
        self.acceptance = Gauge("lyanna_acceptance_rate", "Accepted / drafted tokens over all requests so far", registry=r)
        self.queue = Gauge("lyanna_queue_depth", "Requests queued or running", registry=r)
        self._totals = {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0}

    def record(self, result: GenerationResult) -> None:
        self.tokens.inc(result.new_tokens)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.drafted.inc(result.draft_tokens)
        self.accepted.inc(result.accepted_draft_tokens)
        self.passes.inc(result.target_passes)
        self.ttft.observe(result.prefill_seconds)
        t = self._totals
        t["tokens"] += result.new_tokens
        t["passes"] += result.target_passes
        t["drafted"] += result.draft_tokens
        t["accepted"] += result.accepted_draft_tokens
        if t["passes"]:
            self.tau.set(t["tokens"] / t["passes"])
        if t["drafted"]:
            self.acceptance.set(t["accepted"] / t["drafted"])

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def create_app(decoder: Decoder, method: str = "ar", max_pending: int = 16, request_timeout: float = 300.0,
               model_name: str | None = None) -> FastAPI:
    """The FastAPI app; ``method`` is the default decoding method, ``lyanna_method`` overrides it."""
    if method not in decoder.methods:
        raise LyannaError(f"unknown method {method!r}; available: {', '.join(decoder.methods)}")
    served = model_name or decoder.target.name
    metrics = Metrics()
    state: dict[str, EngineWorker] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["worker"] = EngineWorker(decoder, max_pending)
        yield
        state["worker"].shutdown()

    app = FastAPI(title="Lyanna", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions with lossless speculative decoding.")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(_error_body(f"{loc}: {msg}" if loc else msg, param=loc or None), status_code=400)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(_error_body(exc.message, kind, exc.param), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        worker = state.get("worker")
        return {"status": "ok", "model": served, "queue": worker.pending if worker else 0}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        worker = state.get("worker")
        metrics.queue.set(worker.pending if worker else 0)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "lyanna",
                                            "lyanna_methods": decoder.methods}]}

    def prepare(body: _Common, ids: list[int], loop: asyncio.AbstractEventLoop) -> Job:
        if body.model is not None and body.model != served:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {served!r}", "model")
        chosen = body.lyanna_method or method
        if chosen not in decoder.methods:
            raise ApiError(400, f"unknown lyanna_method {chosen!r}; available: {', '.join(decoder.methods)}", "lyanna_method")
        limit = decoder.target.config.max_position_embeddings
        max_new = body.max_completion_tokens or body.max_tokens or min(256, max(1, limit - len(ids)))
        if len(ids) + max_new > limit:
            raise ApiError(400, f"prompt of {len(ids)} tokens plus max_tokens {max_new} exceeds the context window of {limit} tokens",
                           "max_tokens")
        try:
            sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        except LyannaError as e:
            raise ApiError(400, str(e)) from None
        return Job(ids, GenerationRequest(max_new_tokens=max_new, sampling=sampling, stop=body.stop_strings()), chosen, loop)

    async def run(request: Request, body: _Common, job: Job, endpoint: str, chat: bool) -> Any:
        started = time.perf_counter()
        worker = state["worker"]
        if not worker.submit(job):
            raise ApiError(429, f"server busy: {worker.max_pending} requests queued or running; retry later",
                           headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        base = {"id": rid, "created": created, "model": served}
        deadline = started + request_timeout

        async def next_event(poll: float = 0.25) -> tuple[str, Any]:
            while True:
                try:
                    return await asyncio.wait_for(job.events.get(), timeout=poll)
                except asyncio.TimeoutError:
                    if time.perf_counter() > deadline:
                        job.cancel.set()
                        raise ApiError(504, f"request timed out after {request_timeout:g} s") from None
                    if await request.is_disconnected():
                        job.cancel.set()
                        raise ApiError(499, "client disconnected") from None

        def usage(result: GenerationResult) -> dict[str, int]:
            return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
                    "total_tokens": result.prompt_tokens + result.new_tokens}

        def finished(result: GenerationResult) -> None:
            metrics.record(result)
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            metrics.requests.labels(endpoint, "200").inc()

        def failure(kind: str, value: Any) -> ApiError:
            if kind == "error":
                return ApiError(500, f"generation failed: {type(value).__name__}: {value}")
            return ApiError(503, "generation cancelled: the server is shutting down")

        if not body.stream:
            text_parts: list[str] = []
            try:
                while True:
                    kind, value = await next_event()
                    if kind == "text":
                        text_parts.append(value)
                    elif kind == "done":
                        break
                    else:
                        raise failure(kind, value)
            finally:
                job.cancel.set()  # no-op once done; stops the work on any early exit
            result: GenerationResult = value
            if result.finish_reason == "cancelled":
                raise ApiError(503, "generation cancelled: the server is shutting down")
            finished(result)
            choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": usage(result), "lyanna": {"method": result.method, "tau": result.tau,
                                                       "waste_ratio": result.waste_ratio}}

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None = None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                c: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps({**base, 'object': obj, 'choices': [c]})}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield chunk(role=True)
                while True:
                    try:
                        kind, value = await next_event()
                    except ApiError as e:
                        metrics.requests.labels(endpoint, str(e.status)).inc()
                        yield f"data: {json.dumps(_error_body(e.message, 'server_error'))}\n\n"
                        break
                    if kind == "text":
                        yield chunk(delta=value)
                    elif kind == "done":
                        if value.finish_reason == "cancelled":
                            yield f"data: {json.dumps(_error_body('generation cancelled', 'server_error'))}\n\n"
                            break
                        finished(value)
                        yield chunk(finish=value.finish_reason)
                        if body.stream_options and body.stream_options.include_usage:
                            yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage(value)})}\n\n"
                        break
                    else:
                        err = failure(kind, value)
                        yield f"data: {json.dumps(_error_body(err.message, 'server_error'))}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # a disconnect closes this generator: stop the generation too

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        try:
            ids = decoder.encode_messages([m.model_dump(exclude_none=True, exclude={"name"}) for m in body.messages])
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
        return await run(request, body, prepare(body, ids, asyncio.get_running_loop()), "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        ids = decoder.encode(body.prompt, chat=False)
        return await run(request, body, prepare(body, ids, asyncio.get_running_loop()), "/v1/completions", chat=False)

    return app


def serve(decoder: Decoder, host: str, port: int, method: str, max_pending: int, request_timeout: float) -> None:
    import uvicorn

    app = create_app(decoder, method=method, max_pending=max_pending, request_timeout=request_timeout)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
