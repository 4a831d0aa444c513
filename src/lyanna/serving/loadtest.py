"""A bounded load test for a running Lyanna server, on this machine only.

It sends a fixed number of chat requests with bounded concurrency and a hard time limit, to a
loopback address only, and reports failures, latency and time-to-first-token percentiles and
aggregate tokens/s. Requests are streamed, so the first token's arrival is seen.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlparse

import numpy as np

from ..errors import LyannaError
from .auth import ENV_KEY, is_loopback


def _require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if not (host and is_loopback(host)):
        raise LyannaError(f"load tests target loopback addresses only (127.0.0.0/8, ::1, localhost), not {host!r}")


def _stream_one(url: str, body: dict[str, Any], deadline: float, headers: dict[str, str]) -> dict[str, Any]:
    """One streamed chat request: latency, time to its first text, and completion tokens."""
    import httpx

    if time.perf_counter() > deadline:
        return {"ok": False, "status": "skipped: time limit", "seconds": 0.0, "ttft": None, "tokens": 0}
    t0 = time.perf_counter()
    ttft, tokens, ok, status = None, 0, False, None
    try:
        with httpx.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body, headers=headers,
                          timeout=max(1.0, deadline - t0)) as r:
            status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    ok = ok or line == "data: [DONE]"
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = chunk["error"].get("type", "error")
                    break
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        ok = ok and status == 200
    except httpx.HTTPError as e:
        ok, status = False, type(e).__name__
    return {"ok": ok, "status": status, "seconds": time.perf_counter() - t0, "ttft": ttft,
            "tokens": tokens if ok else 0}


def _percentile(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values.size else None


def run_load(url: str, prompts: Sequence[str], requests: int, concurrency: int, max_tokens: int,
             time_limit: float = 1800.0, method: str | None = None, api_key: str | None = None) -> dict[str, Any]:
    """``method``: ask for this decoding method (``lyanna_method``) instead of the server's default;
    ``api_key``: the server's key (default ``LYANNA_API_KEY``, none when unset)."""
    import os

    import httpx

    _require_loopback(url)
    if requests < 1 or concurrency < 1:
        raise LyannaError("requests and concurrency must be >= 1")
    deadline = time.perf_counter() + time_limit
    key = api_key if api_key is not None else os.environ.get(ENV_KEY)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def body(i: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **({"lyanna_method": method} if method else {})}

    try:
        server = httpx.get(url.rstrip("/") + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        raise LyannaError(f"no Lyanna server answers at {url}: {e}") from None
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda i: _stream_one(url, body(i), deadline, headers), range(requests)))
    wall = time.perf_counter() - start
    try:  # the prefix cache's counters after the load (None: the server has none), the engine's
        after = httpx.get(url.rstrip("/") + "/health", timeout=10).json()
        prefix_cache = after.get("prefix_cache")
    except (httpx.HTTPError, ValueError):
        after, prefix_cache = {}, "unknown"
    engine = _engine_during(server.get("engine"), after.get("engine"), wall)
    lat = np.array([r["seconds"] for r in rows if r["ok"]])
    ttft = np.array([r["ttft"] for r in rows if r["ok"] and r["ttft"] is not None])
    tokens = sum(r["tokens"] for r in rows)
    from datetime import datetime, timezone

    from ..measure.bench import machine_info

    asked = f" --method {method}" if method else ""
    return {
        "command": f"lyanna loadtest{asked} --requests {requests} --concurrency {concurrency} --max-tokens {max_tokens}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "server": {**{k: server.get(k) for k in ("model", "method", "max_batch", "prefill_chunk")}, "prefix_cache": prefix_cache},
        "method": method or server.get("method"),
        "requests": requests,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "succeeded": int(sum(r["ok"] for r in rows)),
        "failed": int(sum(not r["ok"] for r in rows)),
        "failures": sorted({str(r["status"]) for r in rows if not r["ok"]}),
        "wall_seconds": round(wall, 2),
        "latency_p50_s": _percentile(lat, 50),
        "latency_p95_s": _percentile(lat, 95),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "engine": engine,
    }


def _engine_during(before: dict[str, Any] | None, after: dict[str, Any] | None,
                   wall: float) -> dict[str, Any] | None:
    """What the server's engine thread did during the load (``/health``'s ``engine`` counters,
    after less before; None for a server without them): its steps, their rows, the steps with
    requests waiting for a place in the batch (no drafting in them), its busy seconds (of which in
    forward passes, and in drafting calls several rounds shared, with those rounds) and their
    share of the wall time. A share well below 1 with requests waiting
    means the time went around the engine (HTTP, streaming, the host), not into passes and
    drafting; a step much longer than its pass, into the rounds' host work."""
    if not before or not after:
        return None
    steps, rows = after["steps"] - before["steps"], after["rows"] - before["rows"]
    waiting = after.get("waiting_steps", 0) - before.get("waiting_steps", 0)  # 0 from a server that does not count them
    busy, passes = (after[k] - before[k] for k in ("busy_seconds", "pass_seconds"))
    drafting, drafted = (after.get(k, 0) - before.get(k, 0) for k in ("draft_seconds", "drafted_rounds"))
    return {"steps": int(steps), "rows": int(rows), "waiting_steps": int(waiting),
            "busy_seconds": round(busy, 3), "pass_seconds": round(passes, 3),
            "draft_seconds": round(drafting, 3), "drafted_rounds": int(drafted),
            "busy_share": round(busy / wall, 3) if wall > 0 else None,
            "ms_per_step": round(1e3 * busy / steps, 2) if steps else None,
            "ms_per_pass": round(1e3 * passes / steps, 2) if steps else None}
