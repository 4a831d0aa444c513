"""The engine side of the server: one thread runs every generation, in continuous batches, and
hands each request's events back to its handler on the event loop.

The engine is not re-entrant, so all forward passes happen on one thread (under ``serve``, the
thread that loaded the model; ``serve`` says why); requests reach it as ``Job``s through a bounded
queue.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..decoding.batching import BatchScheduler
from ..decoding.decoder import Decoder, GenerationRequest, GenerationResult
from .schema import ApiError

# Requests that share a forward pass. docs/bench/loadtest/ measures --max-batch 1 against 8 on a
# 2-core CPU: ar at 8 clients gave 94 and 202 tokens/s (ar-b1-c8.json, ar-b8-c8.json).
DEFAULT_MAX_BATCH = 8
# Why a request was aborted before its generation finished, and what its client is told.
ABORTS = {
    "timeout": (504, "timeout"),
    "shutdown": (503, "server_shutting_down"),
    "disconnect": (499, "client_disconnected"),  # nginx's code; nobody is left to read it
}


@dataclass(eq=False)  # identity semantics: jobs live in a set
class Job:
    """One request's generation: what the engine thread needs to run it, and the queue of events
    (``text``, then ``done`` or ``error``; ``aborted`` from the loop itself) its handler reads."""

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
                 max_batch: int, on_step: Callable[[float, float, int, int, float, int], None] | None = None):
        """``on_step(seconds, pass_seconds, rows, waiting, draft_seconds, drafted)``: told after
        each batched step (of which its forward pass took ``pass_seconds`` and the drafting calls
        its rounds shared ``draft_seconds`` for ``drafted`` rounds, while ``waiting`` requests
        waited for a place), on the engine thread."""
        self.decoder, self.max_pending, self.on_result, self.on_step = decoder, max_pending, on_result, on_step
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
        """Queue ``job``, or refuse it: 503 while shutting down, 429 with ``Retry-After`` when full."""
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
            batch.waiting = len(waiting)
            began = time.perf_counter()
            finished = batch.step()
            if self.on_step is not None and batch.pass_rows:
                self.on_step(time.perf_counter() - began, batch.pass_seconds, batch.pass_rows, batch.waiting,
                             batch.draft_seconds, batch.drafted)
            for job, outcome in finished:
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
