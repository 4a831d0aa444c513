"""One completion request from its queued job to its answer: a JSON body, or server-sent events.

Whatever ends the request first answers it: the generation's result, its deadline (504), its
client's disconnect (nothing: the client is gone) or a shutdown (503). A streamed request has
sent its 200 already, so a failure there is an error chunk, then ``[DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..decoding.decoder import GenerationResult
from .metrics import Metrics
from .responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    LyannaStats,
    TextChoice,
    TextCompletion,
    Usage,
)
from .schema import ApiError, CommonParams
from .worker import ABORTS, EngineWorker, Job

_ABORT_MESSAGES = {"shutdown": "generation cancelled: the server is shutting down", "disconnect": "client disconnected"}


def _usage(result: GenerationResult) -> Usage:
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.new_tokens,
                 total_tokens=result.prompt_tokens + result.new_tokens)


class Reply:
    """Submits a job and answers its request from the job's events, counting the outcome in
    ``metrics`` under ``endpoint``."""

    def __init__(self, request: Request, body: CommonParams, job: Job, endpoint: str, chat: bool, served: str,
                 metrics: Metrics, request_timeout: float):
        self.request, self.body, self.job, self.endpoint, self.chat = request, body, job, endpoint, chat
        self.served, self.metrics, self.request_timeout = served, metrics, request_timeout
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    async def send(self, worker: EngineWorker) -> Any:
        """Queue the job on ``worker`` (429 or 503 when it refuses), then answer."""
        worker.submit(self.job)
        watcher = self.loop.create_task(self._watch_disconnect())
        if self.body.stream:
            return StreamingResponse(self._events(watcher), media_type="text/event-stream")
        try:
            while (event := await self._next_event())[0] == "text":
                pass  # the result carries the whole text
        finally:
            watcher.cancel()
            self.job.cancel.set()  # no-op once done; stops the work on any early exit
        result = self._outcome(*event)
        if isinstance(result, ApiError):
            raise result
        self._finished()
        return self._completion(result)

    async def _watch_disconnect(self) -> None:
        """The body is read: the next message from the client is its disconnect."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.job.abort("disconnect")

    async def _next_event(self) -> tuple[str, Any]:
        """The engine's next event, or ``aborted`` at the deadline however fast tokens come."""
        try:
            return await asyncio.wait_for(self.job.events.get(), timeout=max(self.job.deadline - self.loop.time(), 0.0))
        except asyncio.TimeoutError:
            self.job.abort("timeout")
            return "aborted", self.job.reason

    def _outcome(self, kind: str, value: Any) -> GenerationResult | ApiError:
        """The generation's result, or the error that answers the request instead."""
        if kind == "done" and value.finish_reason != "cancelled":
            return value
        if kind == "error":
            return ApiError(500, f"generation failed: {type(value).__name__}: {value}")
        reason = value if kind == "aborted" else self.job.reason or "shutdown"
        status, code = ABORTS[reason]
        messages = {"timeout": f"request timed out after {self.request_timeout:g} s", **_ABORT_MESSAGES}
        return ApiError(status, messages[reason], code=code)

    def _finished(self) -> None:
        self.metrics.latency.labels(self.endpoint).observe(self.loop.time() - self.started)
        self.metrics.requests.labels(self.endpoint, "200").inc()

    def _completion(self, result: GenerationResult) -> ChatCompletion | TextCompletion:
        head = {"id": self.id, "created": self.created, "model": self.served, "usage": _usage(result),
                "lyanna": LyannaStats(method=result.method, tau=result.tau, waste_ratio=result.waste_ratio)}
        if self.chat:
            choice = ChatChoice(index=0, finish_reason=result.finish_reason, message=AssistantMessage(content=result.text))
            return ChatCompletion(**head, choices=[choice])
        return TextCompletion(**head, choices=[TextChoice(index=0, finish_reason=result.finish_reason, text=result.text)])

    def _chunk(self, delta: str | None = None, finish: str | None = None, role: bool = False,
               usage: Usage | None = None) -> str:
        """One server-sent event of the stream: a token's text, the first (role) or last (finish)
        chunk, or the usage chunk that has no choices."""
        choice: dict[str, Any]
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        chunk = {"id": self.id, "created": self.created, "model": self.served,
                 "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": [choice]}
        if usage is not None:
            chunk.update(choices=[], usage=usage.model_dump())
        return f"data: {json.dumps(chunk)}\n\n"

    async def _events(self, watcher: asyncio.Task) -> AsyncIterator[str]:
        answered = False
        try:
            if self.chat:
                yield self._chunk(role=True)
            while (event := await self._next_event())[0] == "text":
                yield self._chunk(delta=event[1])
            result = self._outcome(*event)
            answered = True
            if isinstance(result, ApiError):
                self.metrics.requests.labels(self.endpoint, str(result.status)).inc()
                yield f"data: {json.dumps(result.body())}\n\n"
            else:
                self._finished()
                yield self._chunk(finish=result.finish_reason)
                if self.body.stream_options and self.body.stream_options.include_usage:
                    yield self._chunk(usage=_usage(result))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            self.job.cancel.set()  # a disconnect closes this generator: stop the generation too
            if not answered:
                self.metrics.requests.labels(self.endpoint, str(ABORTS["disconnect"][0])).inc()
