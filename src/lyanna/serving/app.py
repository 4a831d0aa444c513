"""The FastAPI app: its routes, its error handlers, and the state they share (``Service``).

Parameters we cannot honour are refused with a 400 that names them, never ignored, and every
error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. The latency curve
the auto tree budget needs is loaded or measured at startup, before the server accepts a request,
so no request pays for it. Prompts are tokenized off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from .. import __version__
from ..decoding.decoder import Decoder, GenerationRequest
from ..decoding.sampling import SamplingParams
from ..errors import LyannaError
from .auth import ApiKeys
from .body import DEFAULT_MAX_BODY_BYTES, read_json
from .metrics import Metrics
from .openapi import completion_route, errors, install_openapi
from .reply import Reply
from .responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Health,
    ModelCard,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
)
from .schema import ApiError, ChatRequest, CommonParams, CompletionRequest, validate
from .worker import DEFAULT_MAX_BATCH, EngineWorker, Job

# Completion tokens when a request names no max_tokens (fewer where the context window ends sooner):
# a bound, so that a request that names none cannot hold its batch slot for a whole context window.
DEFAULT_MAX_TOKENS = 256

log = logging.getLogger("uvicorn.error")


class Service:
    """What the routes share: the decoder and the server's limits, its metrics, and while the app
    runs, the engine worker and the tokenizer's thread."""

    def __init__(self, decoder: Decoder, method: str, max_pending: int, request_timeout: float, served: str,
                 max_body_bytes: int, max_batch: int, run_engine: Callable[[EngineWorker], None] | None,
                 keys: ApiKeys, metrics_open: bool):
        self.decoder, self.method, self.max_pending, self.request_timeout = decoder, method, max_pending, request_timeout
        self.served, self.max_body_bytes, self.max_batch, self.run_engine = served, max_body_bytes, max_batch, run_engine
        self.keys, self.metrics_open = keys, metrics_open
        self.metrics = Metrics()
        self.worker: EngineWorker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set while a signal has requests to answer
        self.tokenizer: ThreadPoolExecutor | None = None

    @property
    def context(self) -> int:
        return self.decoder.target.config.max_position_embeddings

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start the engine worker and wait for its latency curve, before uvicorn binds its socket;
        at shutdown, answer what is in flight and stop the worker."""
        loop = asyncio.get_running_loop()
        worker = EngineWorker(self.decoder, self.max_pending, self.metrics.record, self.max_batch,
                              self.metrics.record_step)
        worker.start() if self.run_engine is None else self.run_engine(worker)
        await loop.run_in_executor(None, worker.ready.wait)
        if worker.failure is not None:
            raise worker.failure
        log.info("latency curve of %s ready", self.served)
        if self.keys.required:
            log.info("%s", self.keys.describe())
        self.tokenizer = ThreadPoolExecutor(1, thread_name_prefix="lyanna-tokenize")
        self.worker, self.loop = worker, loop
        yield
        self.loop = None  # a late signal has nothing left to answer
        worker.close()
        await loop.run_in_executor(None, worker.stop)
        self.tokenizer.shutdown(cancel_futures=True)

    def begin_shutdown(self) -> None:
        """Answer every in-flight request with 503 and refuse new ones (safe from any thread or a
        signal handler: it only schedules work on the loop)."""
        if (loop := self.loop) is not None and self.worker is not None:
            loop.call_soon_threadsafe(self.worker.close)

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served, created=0, owned_by="lyanna", lyanna_methods=self.decoder.methods)

    def require_model(self, name: str | None) -> None:
        if name is not None and name != self.served:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.served!r}", "model",
                           code="model_not_found")

    async def tokenize(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """Off the event loop (a megabyte of prompt takes a second), one at a time."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer, fn, *args)

    def prepare(self, body: CommonParams, ids: list[int], prompt_param: str, deadline: float) -> Job:
        """The job for a validated request, or the 4xx for what the server cannot do with it."""
        self.require_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
        chosen = body.lyanna_method or self.method
        if chosen not in self.decoder.methods:
            raise ApiError(400, f"unknown lyanna_method {chosen!r}; available: {', '.join(self.decoder.methods)}",
                           "lyanna_method")
        limit = self.context
        for name in ("max_completion_tokens", "max_tokens"):  # each as the schema bounds it, used or not
            value = getattr(body, name)
            if value is not None and value >= limit:
                raise ApiError(400, f"{name} {value} leaves no room for a prompt in the context window of {limit} "
                                    f"tokens", name, code="context_length_exceeded")
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; the context window of {limit} tokens leaves no room "
                                f"for a completion", prompt_param, code="context_length_exceeded")
        max_new = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, limit - len(ids))
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

    async def answer(self, request: Request, body: CommonParams, job: Job, endpoint: str, chat: bool) -> Any:
        assert self.worker is not None  # requests arrive only once the lifespan has started it
        reply = Reply(request, body, job, endpoint, chat, self.served, self.metrics, self.request_timeout)
        return await reply.send(self.worker)


def _service(request: Request) -> Service:
    return request.app.state.service


def _check_key(service: Service, request: Request) -> None:
    """401 before the body is read, so a request without the key never reaches the engine."""
    if not service.keys.required or service.keys.accepts(request.headers.get("authorization")):
        return
    service.metrics.unauthorized.inc()
    given = "authorization" in request.headers
    raise ApiError(401, "invalid API key" if given else "missing API key: send it as 'Authorization: Bearer <key>'",
                   headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")


async def require_key(request: Request) -> None:
    _check_key(_service(request), request)


async def require_key_for_metrics(request: Request) -> None:
    service = _service(request)
    if not service.metrics_open:
        _check_key(service, request)


router = APIRouter()
api = APIRouter(dependencies=[Depends(require_key)])  # every /v1 route


@router.get("/health", response_model=Health, responses=errors(500))
async def health(request: Request) -> Health:
    service = _service(request)
    pc = getattr(service.decoder, "prefix_cache", None)  # a decoder without one (a test stub) has none
    return Health(model=service.served, method=service.method, max_batch=service.max_batch,
                  queue=service.worker.pending if service.worker else 0, prefix_cache=None if pc is None else pc.stats(),
                  prefill_chunk=getattr(service.decoder, "effective_prefill_chunk", 0),
                  engine=service.metrics.engine())


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(require_key_for_metrics)], responses={
    200: {"description": "Prometheus text exposition format"}, **errors(500)})
async def prometheus(request: Request) -> PlainTextResponse:
    service = _service(request)
    service.metrics.queue.set(service.worker.pending if service.worker else 0)
    return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")


@api.get("/v1/models", response_model=ModelList, responses=errors(500))
async def models(request: Request) -> ModelList:
    return ModelList(data=[_service(request).model_card()])


@api.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404, 500))
async def model(request: Request, model_id: str) -> ModelCard:
    service = _service(request)
    service.require_model(model_id)
    return service.model_card()


@api.post("/v1/chat/completions", **completion_route(ChatRequest, ChatCompletion, ChatCompletionChunk))
async def chat_completions(request: Request) -> Any:
    service = _service(request)
    deadline = asyncio.get_running_loop().time() + service.request_timeout
    body: ChatRequest = validate(ChatRequest, await read_json(request, service.max_body_bytes))
    try:
        ids = await service.tokenize(service.decoder.encode_messages, [m.template_dict() for m in body.messages])
    except Exception as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
    job = service.prepare(body, ids, "messages", deadline)
    return await service.answer(request, body, job, "/v1/chat/completions", chat=True)


@api.post("/v1/completions", **completion_route(CompletionRequest, TextCompletion, TextCompletionChunk))
async def completions(request: Request) -> Any:
    service = _service(request)
    deadline = asyncio.get_running_loop().time() + service.request_timeout
    body: CompletionRequest = validate(CompletionRequest, await read_json(request, service.max_body_bytes))
    ids = await service.tokenize(service.decoder.encode, body.prompt, False)
    job = service.prepare(body, ids, "prompt", deadline)
    return await service.answer(request, body, job, "/v1/completions", chat=False)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    route = request.scope.get("route")
    endpoint = getattr(route, "path", "unmatched")  # unknown paths must not grow the label set
    _service(request).metrics.requests.labels(endpoint, str(exc.status)).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no route, a wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return await _api_error(request, ApiError(exc.status_code, message, headers=exc.headers))


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def create_app(decoder: Decoder, method: str = "ar", max_pending: int = 16, request_timeout: float = 300.0,
               model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_batch: int = DEFAULT_MAX_BATCH,
               run_engine: Callable[[EngineWorker], None] | None = None,
               keys: ApiKeys | None = None, metrics_open: bool = False) -> FastAPI:
    """The FastAPI app; ``method`` is the default decoding method, ``lyanna_method`` overrides it;
    up to ``max_batch`` requests share each forward pass. At startup the app makes its engine
    worker and hands it to ``run_engine``, which must have ``worker.run()`` called on some thread
    (None: the worker starts a thread of its own; ``serve`` runs it on the thread that loaded the
    model). With ``keys`` that are required, every ``/v1`` route, and ``/metrics`` unless
    ``metrics_open``, answers 401 to a request without one of them; ``/health`` stays open.
    ``app.state.begin_shutdown()`` (safe from any thread or a signal handler) answers every
    in-flight request with 503 and refuses new ones."""
    if method not in decoder.methods:
        raise LyannaError(f"unknown method {method!r}; available: {', '.join(decoder.methods)}")
    service = Service(decoder, method, max_pending, request_timeout, model_name or decoder.target.name,
                      max_body_bytes, max_batch, run_engine, keys or ApiKeys(), metrics_open)
    app = FastAPI(title="Lyanna", version=__version__, lifespan=service.lifespan,
                  description="OpenAI-compatible completions with lossless speculative decoding.")
    app.state.service = service
    app.state.begin_shutdown = service.begin_shutdown
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)
    app.include_router(router)
    app.include_router(api)
    protected = {"/v1/"} | (set() if metrics_open else {"/metrics"})
    install_openapi(app, service.served, decoder.methods, service.context,
                    protected=protected if service.keys.required else set())
    return app
