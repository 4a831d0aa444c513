"""Running the app: ``serve`` puts the engine on the calling thread and HTTP (uvicorn) on another,
and a shutdown signal answers every in-flight request before uvicorn's grace period.

A request's deadline, its client's disconnect and a shutdown each answer the request at once
(504; nothing, the client is gone; 503 or an error chunk then ``[DONE]``) and end its generation
at the engine's next commit.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI

from ..decoding.decoder import Decoder
from .app import create_app
from .auth import ApiKeys
from .body import DEFAULT_MAX_BODY_BYTES
from .worker import DEFAULT_MAX_BATCH, EngineWorker

# Seconds uvicorn gives open connections after a shutdown signal. In-flight requests are answered
# at once (503), so this only bounds a client slow to read its last bytes.
GRACEFUL_SHUTDOWN_SECONDS = 10


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
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_batch: int = DEFAULT_MAX_BATCH,
          keys: ApiKeys | None = None, metrics_open: bool = False) -> None:
    """Serve until SIGINT or SIGTERM, the engine on the calling thread and HTTP on another;
    ``keys``, when required, guard every /v1 route (and /metrics unless ``metrics_open``).

    Why this way round: numba's OpenMP layer keeps a team of threads for every thread that starts
    parallel kernels, and once the teams hold more threads than there are cores, libgomp stops
    spinning at its barriers, so every kernel pays to wake its team. Loading the model has started
    kernels on this thread already, and an engine on a second thread would make a second team, so
    the thread that loaded the model runs every pass."""
    workers: list[EngineWorker] = []  # the app's worker, once its startup has made it
    handed = threading.Event()
    exit_codes: list[Any] = []

    def run_engine(worker: EngineWorker) -> None:
        workers.append(worker)
        handed.set()

    server = GracefulServer(create_app(decoder, method=method, max_pending=max_pending, request_timeout=request_timeout,
                                       max_body_bytes=max_body_bytes, max_batch=max_batch, run_engine=run_engine,
                                       keys=keys, metrics_open=metrics_open),
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
