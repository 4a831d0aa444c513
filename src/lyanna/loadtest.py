"""A bounded load test for a running Lyanna server, on this machine only.

It sends a fixed number of chat requests with bounded concurrency and a hard time limit, to a
loopback address only, and reports failures, latency percentiles and aggregate tokens/s.
"""
from __future__ import annotations

import ipaddress
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlparse

import numpy as np

from .errors import LyannaError


def _require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise LyannaError(f"load tests target loopback addresses only (127.0.0.0/8, ::1, localhost), not {host!r}")


def run_load(url: str, prompts: Sequence[str], requests: int, concurrency: int, max_tokens: int,
             time_limit: float = 1800.0) -> dict[str, Any]:
    import httpx

    _require_loopback(url)
    if requests < 1 or concurrency < 1:
        raise LyannaError("requests and concurrency must be >= 1")
    deadline = time.perf_counter() + time_limit

    def one(i: int) -> dict[str, Any]:
        if time.perf_counter() > deadline:
            return {"ok": False, "status": "skipped: time limit", "seconds": 0.0, "tokens": 0}
        body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
                "temperature": 0}
        t0 = time.perf_counter()
        try:
            r = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=max(1.0, deadline - t0))
            ok = r.status_code == 200
            tokens = r.json()["usage"]["completion_tokens"] if ok else 0
            status = r.status_code
        except httpx.HTTPError as e:
            ok, tokens, status = False, 0, type(e).__name__
        return {"ok": ok, "status": status, "seconds": time.perf_counter() - t0, "tokens": tokens}

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    lat = np.array([r["seconds"] for r in rows if r["ok"]])
    tokens = sum(r["tokens"] for r in rows)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "succeeded": int(sum(r["ok"] for r in rows)),
        "failed": int(sum(not r["ok"] for r in rows)),
        "failures": sorted({str(r["status"]) for r in rows if not r["ok"]}),
        "wall_seconds": round(wall, 2),
        "latency_p50_s": round(float(np.percentile(lat, 50)), 3) if lat.size else None,
        "latency_p95_s": round(float(np.percentile(lat, 95)), 3) if lat.size else None,
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
    }
