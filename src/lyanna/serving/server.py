"""OpenAI-compatible HTTP server: one engine, a bounded queue, streaming, exact usage.

Generation runs on one engine thread (the engine is not re-entrant; under ``serve``, the thread that
loaded the model, see there); requests wait in a bounded
queue and get 429 with ``Retry-After`` when it is full. Parameters we cannot honour are refused
with a 400 that names them, never ignored, and every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. The latency curve the auto tree budget needs
is loaded or measured at startup, before the server accepts a request, so no request pays for it.
A request's deadline, its client's disconnect and a shutdown each answer the request at once
(504; nothing, the client is gone; 503 or an error chunk then ``[DONE]``) and end its generation
at the engine's next commit.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Annotated, Any, AsyncIterator, Callable, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_validator,
)
from starlette.exceptions import HTTPException

from ..decoding.batching import BatchScheduler
from ..decoding.decoder import Decoder, GenerationRequest, GenerationResult
from ..decoding.sampling import SamplingParams
from ..errors import LyannaError

# A 128k-token context is about 0.5 MB of text; JSON escaping can triple that. Anything larger
# cannot be a prompt this server would accept, and reading it would only cost memory.
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024
# Requests that share a forward pass (README, serving): on the 2-core CPU 4 -> 8 paid, 8 -> 16 was
# within run-to-run noise (35.2 vs 32.8 tokens/s at 16 clients).
DEFAULT_MAX_BATCH = 8
# Seconds uvicorn gives open connections after a shutdown signal. In-flight requests are answered
# at once (503), so this only bounds a client slow to read its last bytes.
GRACEFUL_SHUTDOWN_SECONDS = 10
# Why a request was aborted before its generation finished, and what its client is told.
ABORTS = {
    "timeout": (504, "timeout"),
    "shutdown": (503, "server_shutting_down"),
    "disconnect": (499, "client_disconnected"),  # nginx's code; nobody is left to read it
}

log = logging.getLogger("uvicorn.error")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers or {}, code

    @property
    def kind(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _not_bool(value: Any) -> Any:
    """JSON ``true`` is not a number, though pydantic's lax mode would read it as 1."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[FiniteFloat, BeforeValidator(_not_bool)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, ge=0.0, le=1.0)
    seed: Int | None = Field(None, ge=0)  # numpy seeds are non-negative; -1 ("random" in some UIs) is refused
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
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

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if len(v or ()) > 4 or any(not s for s in v or ()):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A list of text parts is their text, concatenated as sent; other parts (images, audio,
        files) need a model this server does not run."""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} is {kind!r}: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            texts.append(part["text"])
        return "".join(texts)

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates know it: ``developer`` is OpenAI's new name for ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


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
    deadline: float  # on the loop's clock
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None  # a key of ABORTS once aborted

    def push(self, kind: str, value: Any) -> None:
        """From the engine thread: hand an event to the request's handler."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def abort(self, reason: str) -> None:
        """On the event loop: wake the handler with ``reason`` now, stop the generation at its
        next commit. The first reason wins."""
        if self.reason is None and not self.cancel.is_set():
            self.reason = reason
            self.events.put_nowait(("aborted", reason))
            self.cancel.set()


class EngineWorker:
    """Runs jobs on one engine thread, up to ``max_batch`` of them together (continuous batching:
    a job joins the running batch at the next forward pass and leaves when it finishes); at most
    ``max_pending`` queued or running."""

    def __init__(self, decoder: Decoder, max_pending: int, on_result: Callable[[GenerationResult], None],
                 max_batch: int = 1):
        self.decoder, self.max_pending, self.on_result = decoder, max_pending, on_result
        self.max_batch = max_batch
        self.closing = False
        self.ready = threading.Event()  # set once ``run`` has the latency curve in hand, or failed
        self.failure: BaseException | None = None  # why ``run`` could not start
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._active: set[Job] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the engine loop on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="lyanna-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """The engine loop, on the calling thread, until ``stop``. It first loads or measures the
        latency curve (before any job: a speculative request must never wait for a calibration),
        on this same thread, as every forward pass should be (``serve`` says why)."""
        try:
            self.decoder.latency_curve()
        except BaseException as e:  # reported by the app's startup, which then fails
            self.failure = e
            return
        finally:
            self.ready.set()
        self._loop()

    @property
    def pending(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closing:
                raise ApiError(503, "the server is shutting down", code=ABORTS["shutdown"][1])
            if len(self._active) >= self.max_pending:
                raise ApiError(429, f"server busy: {self.max_pending} requests queued or running; retry later",
                               headers={"Retry-After": "1"})
            self._active.add(job)
        self._jobs.put(job)

    def _loop(self) -> None:
        batch = BatchScheduler(self.decoder.engine, self.decoder.drafter_for, self.max_batch)
        waiting: list[Job] = []
        stopping = False
        while not (stopping and not batch.active):
            # Wait for work only when there is nothing to step; otherwise take what has arrived.
            incoming = [self._jobs.get()] if not batch.active and not waiting and not stopping else []
            while True:
                try:
                    incoming.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            stopping = stopping or None in incoming
            waiting += [job for job in incoming if job is not None]
            waiting = [job for job in waiting if not self._admit(batch, job)]
            for job, outcome in batch.step():
                self._finish(job, outcome)
        for job in waiting:
            self._finish(job, None)

    def _admit(self, batch: BatchScheduler, job: Job) -> bool:
        """Start ``job`` in the batch if it has room; True when the job has left the queue."""
        if job.cancel.is_set():  # its request has been answered already
            self._finish(job, None)
            return True
        if not batch.can_admit(job.method):
            return False
        try:
            steps = self.decoder.steps(job.ids, job.request, method=job.method,
                                       on_text=lambda s, job=job: job.push("text", s), should_cancel=job.cancel.is_set,
                                       load=batch.load_for(job))
            batch.admit(job, steps, job.method)
        except Exception as e:  # reported to that request only
            self._finish(job, e)
        return True

    def _finish(self, job: Job, outcome: GenerationResult | Exception | None) -> None:
        """Hand a job's result or failure to its request (None: it had been answered already)."""
        try:
            if isinstance(outcome, Exception):
                job.push("error", outcome)
            elif outcome is not None:
                self.on_result(outcome)  # cancelled generations too: their tokens were computed
                job.push("done", outcome)
        finally:
            with self._lock:
                self._active.discard(job)

    def close(self) -> None:
        """On the event loop: refuse new jobs and answer every queued or running one with 503."""
        with self._lock:
            self.closing = True
            jobs = list(self._active)
        for job in jobs:
            job.abort("shutdown")

    def stop(self, timeout: float = 30.0) -> None:
        """End the engine loop once the jobs it runs have seen their cancellation (and wait for its
        thread, when it has one of its own)."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lyanna_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.tokens = Counter("lyanna_generated_tokens", "Completion tokens generated (cancelled generations included)", registry=r)
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
        """Count one generation's work (called on the engine thread only)."""
        self.tokens.inc(result.new_tokens)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.drafted.inc(result.draft_tokens)
        self.accepted.inc(result.accepted_draft_tokens)
        self.passes.inc(result.target_passes)
        if result.new_tokens:
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


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, refused with OpenAI-shaped errors: 413 past ``max_bytes`` (read
    no further), 400 when it is not UTF-8 or not JSON."""
    declared = request.headers.get("content-length", "")
    too_big = ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes (lyanna serve --max-body-bytes)")
    if declared.isdecimal() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def _validate(model: type[_Common], data: Any) -> Any:
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param or None) from None


def create_app(decoder: Decoder, method: str = "ar", max_pending: int = 16, request_timeout: float = 300.0,
               model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_batch: int = DEFAULT_MAX_BATCH,
               run_engine: Callable[[EngineWorker], None] | None = None) -> FastAPI:
    """The FastAPI app; ``method`` is the default decoding method, ``lyanna_method`` overrides it;
    up to ``max_batch`` requests share each forward pass. At startup the app makes its engine
    worker and hands it to ``run_engine``, which must have ``worker.run()`` called on some thread
    (None: the worker starts a thread of its own; ``serve`` runs it on the thread that loaded the
    model).
    ``app.state.begin_shutdown()`` (safe from any thread or a signal handler) answers every
    in-flight request with 503 and refuses new ones."""
    if method not in decoder.methods:
        raise LyannaError(f"unknown method {method!r}; available: {', '.join(decoder.methods)}")
    served = model_name or decoder.target.name
    metrics = Metrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        worker = EngineWorker(decoder, max_pending, metrics.record, max_batch)
        worker.start() if run_engine is None else run_engine(worker)
        # The worker calibrates first, before uvicorn binds its socket.
        await loop.run_in_executor(None, worker.ready.wait)
        if worker.failure is not None:
            raise worker.failure
        log.info("latency curve of %s ready", served)
        state["tokenizer"] = ThreadPoolExecutor(1, thread_name_prefix="lyanna-tokenize")
        state["worker"] = worker
        state["loop"] = loop
        yield
        del state["loop"]  # a late signal has nothing left to answer
        worker.close()
        await loop.run_in_executor(None, worker.stop)
        state["tokenizer"].shutdown(cancel_futures=True)

    app = FastAPI(title="Lyanna", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions with lossless speculative decoding.")

    def begin_shutdown() -> None:
        if (loop := state.get("loop")) is not None:
            loop.call_soon_threadsafe(state["worker"].close)

    app.state.begin_shutdown = begin_shutdown

    def endpoint_of(request: Request) -> str:
        route = request.scope.get("route")
        return getattr(route, "path", "unmatched")  # unknown paths must not grow the label set

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(endpoint_of(request), str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return await _api_error(request, ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return await _api_error(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        worker = state.get("worker")
        pc = getattr(decoder, "prefix_cache", None)  # a decoder without one (a test stub) has none
        cache = None if pc is None else pc.stats()
        return {"status": "ok", "model": served, "method": method, "max_batch": max_batch,
                "queue": worker.pending if worker else 0, "prefix_cache": cache}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        worker = state.get("worker")
        metrics.queue.set(worker.pending if worker else 0)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        return {"id": served, "object": "model", "created": 0, "owned_by": "lyanna", "lyanna_methods": decoder.methods}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {served!r}", "model",
                           code="model_not_found")
        return model_card()

    async def tokenize(fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """Off the event loop (a megabyte of prompt takes a second), one at a time."""
        return await asyncio.get_running_loop().run_in_executor(state["tokenizer"], fn, *args)

    def prepare(body: _Common, ids: list[int], prompt_param: str, deadline: float) -> Job:
        if body.model is not None and body.model != served:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves {served!r}", "model",
                           code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        chosen = body.lyanna_method or method
        if chosen not in decoder.methods:
            raise ApiError(400, f"unknown lyanna_method {chosen!r}; available: {', '.join(decoder.methods)}", "lyanna_method")
        limit = decoder.target.config.max_position_embeddings
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context window of {limit} tokens leaves no room "
                                f"for a completion", prompt_param, code="context_length_exceeded")
        asked = body.max_completion_tokens or body.max_tokens
        max_new = asked or min(256, limit - len(ids))
        if len(ids) + max_new > limit:
            param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise ApiError(400, f"prompt of {len(ids)} tokens plus {param} {max_new} exceeds the context window of "
                                f"{limit} tokens", param, code="context_length_exceeded")
        # top_p 0 keeps the smallest nucleus, the single most probable token: greedy decoding.
        temperature = 0.0 if body.top_p == 0 else body.temperature
        try:
            sampling = SamplingParams(temperature=temperature, top_p=body.top_p or 1.0, seed=body.seed)
        except LyannaError as e:
            raise ApiError(400, str(e)) from None
        return Job(ids, GenerationRequest(max_new_tokens=max_new, sampling=sampling, stop=body.stop_strings()), chosen,
                   asyncio.get_running_loop(), deadline)

    async def watch_disconnect(request: Request, job: Job) -> None:
        """The body is read: the next message from the client is its disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.abort("disconnect")

    async def run(request: Request, body: _Common, job: Job, endpoint: str, chat: bool) -> Any:
        loop = asyncio.get_running_loop()
        started = loop.time()
        state["worker"].submit(job)
        watcher = loop.create_task(watch_disconnect(request, job))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "created": int(time.time()), "model": served}

        async def next_event() -> tuple[str, Any]:
            """The engine's next event, or ``aborted`` at the deadline however fast tokens come."""
            try:
                return await asyncio.wait_for(job.events.get(), timeout=max(job.deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                job.abort("timeout")
                return "aborted", job.reason

        def failure(kind: str, value: Any) -> ApiError:
            if kind == "error":
                return ApiError(500, f"generation failed: {type(value).__name__}: {value}")
            reason = value if kind == "aborted" else job.reason or "shutdown"
            status, code = ABORTS[reason]
            message = {"timeout": f"request timed out after {request_timeout:g} s",
                       "shutdown": "generation cancelled: the server is shutting down",
                       "disconnect": "client disconnected"}[reason]
            return ApiError(status, message, code=code)

        def outcome(kind: str, value: Any) -> GenerationResult | ApiError:
            ok = kind == "done" and value.finish_reason != "cancelled"
            return value if ok else failure(kind, value)

        def usage(result: GenerationResult) -> dict[str, int]:
            return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
                    "total_tokens": result.prompt_tokens + result.new_tokens}

        def finished() -> None:
            metrics.latency.labels(endpoint).observe(loop.time() - started)
            metrics.requests.labels(endpoint, "200").inc()

        if not body.stream:
            text_parts: list[str] = []
            try:
                while (event := await next_event())[0] == "text":
                    text_parts.append(event[1])
            finally:
                watcher.cancel()
                job.cancel.set()  # no-op once done; stops the work on any early exit
            result = outcome(*event)
            if isinstance(result, ApiError):
                raise result
            finished()
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
            answered = False
            try:
                if chat:
                    yield chunk(role=True)
                while (event := await next_event())[0] == "text":
                    yield chunk(delta=event[1])
                result = outcome(*event)
                answered = True
                if isinstance(result, ApiError):
                    metrics.requests.labels(endpoint, str(result.status)).inc()
                    yield f"data: {json.dumps(result.body())}\n\n"
                else:
                    finished()
                    yield chunk(finish=result.finish_reason)
                    if body.stream_options and body.stream_options.include_usage:
                        yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': usage(result)})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                job.cancel.set()  # a disconnect closes this generator: stop the generation too
                if not answered:
                    metrics.requests.labels(endpoint, str(ABORTS["disconnect"][0])).inc()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        deadline = asyncio.get_running_loop().time() + request_timeout
        body: ChatRequest = _validate(ChatRequest, await _read_json(request, max_body_bytes))
        try:
            ids = await tokenize(decoder.encode_messages, [m.template_dict() for m in body.messages])
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
        job = prepare(body, ids, "messages", deadline)
        return await run(request, body, job, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        deadline = asyncio.get_running_loop().time() + request_timeout
        body: CompletionRequest = _validate(CompletionRequest, await _read_json(request, max_body_bytes))
        ids = await tokenize(decoder.encode, body.prompt, False)
        return await run(request, body, prepare(body, ids, "prompt", deadline), "/v1/completions", chat=False)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a shutdown signal first answers every in-flight request (503,
    or an error chunk then ``[DONE]``) instead of leaving them to run into the grace period."""

    def __init__(self, app: FastAPI, **config: Any):
        super().__init__(uvicorn.Config(app, **config))
        self._begin_shutdown: Callable[[], None] = app.state.begin_shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._begin_shutdown()  # only schedules work on the loop: safe inside a signal handler
        super().handle_exit(sig, frame)


def serve(decoder: Decoder, host: str, port: int, method: str, max_pending: int, request_timeout: float,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_batch: int = DEFAULT_MAX_BATCH) -> None:
    """Serve until SIGINT or SIGTERM, the engine on the calling thread and HTTP on another.

    Why this way round: numba's OpenMP layer keeps a team of threads for every thread that starts
    parallel kernels, and once the teams hold more threads than there are cores, libgomp stops
    spinning at its barriers, so every kernel pays to wake its team. Loading the model has started
    kernels on this thread already; an engine on a second thread ran a one-token step 2.6x slower
    on a 2-core machine (issue 13's note of 2026-11-23; the load test's pairs in README, serving). So the thread that loaded the model runs every pass."""
    workers: list[EngineWorker] = []  # the app's worker, once its startup has made it
    handed = threading.Event()
    exit_codes: list[Any] = []

    def run_engine(worker: EngineWorker) -> None:
        workers.append(worker)
        handed.set()

    server = GracefulServer(create_app(decoder, method=method, max_pending=max_pending, request_timeout=request_timeout,
                                       max_body_bytes=max_body_bytes, max_batch=max_batch, run_engine=run_engine),
                            host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)

    def http() -> None:
        try:
            server.run()
        except SystemExit as e:  # how uvicorn fails to start (a port in use)
            exit_codes.append(e.code)
        finally:
            for worker in workers:  # however uvicorn ended (a second Ctrl-C skips the app's shutdown)
                worker.stop()
            handed.set()

    # uvicorn listens to signals only on the main thread; here they reach its handler from this one.
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="lyanna-http")
    try:
        thread.start()
        handed.wait()
        for worker in workers:
            worker.run()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if any(exit_codes):
        raise SystemExit(next(c for c in exit_codes if c))
