"""A soak test: one `lyanna serve` under mixed traffic for an hour, watched every minute.

What only a long run shows: memory that grows a few kilobytes a request, a prefix cache that only
grows, a queue that does not drain, latency that creeps up. CLIENTS threads send, back to back, a
seeded mix of requests: chat and text completions, each decoding method the server has, streamed
and not, greedy and sampled, streams dropped after their first chunks, and bad requests (malformed
JSON, invalid fields, an unknown model, no key or a wrong one) that must get their 4xx. Every
minute the server's resident memory (/proc, sampled every 5 s), its /health (queue, prefix cache,
engine counters) and that minute's requests (by outcome, latency percentiles) go to the JSON; at
the end, the checks: no 5xx, no request stuck past its deadline, the queue empty once the load
stops, RSS after the first 10 minutes growing under 5% over the rest (its trend: ``rss_growth``),
p99 latency of the last 10 minutes within 1.2x of the second 10. Usage: scripts/soak.sh (the
server is started here, with an API key).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from lyanna.measure.bench import load_questions, machine_info

BAD = [  # (body as bytes, headers) -> must get a 4xx
    (b'{"messages": [', {}), (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', {}),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', {}),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}', {}),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}', {"Authorization": ""}),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}', {"Authorization": "Bearer wrong"}),
    (b"[" * 200 + b"]" * 200, {}),
]
RSS_EVERY = 5.0  # seconds between samples of the server's resident memory
KINDS = ["chat", "chat_stream", "text", "text_stream", "sampled_stream", "dropped_stream", "bad"]
WEIGHTS = [3, 4, 1, 2, 2, 1, 1]


class Soak:
    def __init__(self, url: str, key: str, methods: list[str], prompts: list[str], deadline: float, timeout: float):
        self.url, self.headers, self.methods, self.prompts = url, {"Authorization": f"Bearer {key}"}, methods, prompts
        self.deadline, self.timeout = deadline, timeout
        self.events: list[dict] = []
        self.lock = threading.Lock()

    def body(self, rng: random.Random, kind: str) -> dict:
        prompt = rng.choice(self.prompts)
        body = {"max_tokens": rng.choice([16, 32, 64, 96]), "lyanna_method": rng.choice(self.methods),
                "temperature": 0.8 if kind == "sampled_stream" else 0, "seed": rng.randrange(1 << 30)}
        if kind.startswith("text"):
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if kind.endswith("stream"):
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        return body

    def one(self, client: httpx.Client, rng: random.Random) -> dict:
        kind = rng.choices(KINDS, WEIGHTS)[0]
        path = "/v1/completions" if kind.startswith("text") else "/v1/chat/completions"
        t0, ttft, status, outcome = time.perf_counter(), None, None, "ok"
        try:
            if kind == "bad":
                content, extra = rng.choice(BAD)
                r = client.post(self.url + path, content=content, headers={**self.headers, **extra,
                                                                           "content-type": "application/json"})
                status = r.status_code
                outcome = "refused" if 400 <= status < 500 else "unexpected"
            elif kind.endswith("stream"):
                with client.stream("POST", self.url + path, json=self.body(rng, kind), headers=self.headers) as r:
                    status, done = r.status_code, False
                    for i, line in enumerate(r.iter_lines()):
                        ttft = ttft or (time.perf_counter() - t0 if line.startswith("data: {") else None)
                        if '"error"' in line and line.startswith("data: "):
                            outcome = "stream_error"
                        done = done or line == "data: [DONE]"
                        if kind == "dropped_stream" and i >= 4:
                            outcome, done = "dropped", True
                            break  # leaving the block closes the connection mid-stream
                    if outcome == "ok" and not done:
                        outcome = "incomplete"
            else:
                r = client.post(self.url + path, json=self.body(rng, kind), headers=self.headers)
                status = r.status_code
        except httpx.TimeoutException:
            outcome = "stuck"
        except httpx.HTTPError as e:
            outcome = f"transport:{type(e).__name__}"
        if status is not None and status >= 500:
            outcome = "5xx"
        elif status is not None and kind != "bad" and status != 200:
            outcome = f"status:{status}"
        return {"t": time.time(), "kind": kind, "status": status, "outcome": outcome,
                "seconds": time.perf_counter() - t0, "ttft": ttft}

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=self.timeout) as client:
            while time.time() < self.deadline:
                event = self.one(client, rng)
                with self.lock:
                    self.events.append(event)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    a = np.array(seconds)
    return {f"p{q}": round(float(np.percentile(a, q)), 3) if a.size else None for q in (50, 95, 99)}


def minute(url: str, rss: list[float], events: list[dict], index: int) -> dict:
    """A minute's row: the server's RSS (median, least and most of its samples), its health, and
    the minute's requests by outcome with the completions' latency percentiles."""
    health = httpx.get(url + "/health", timeout=30).json()
    done = [e for e in events if e["outcome"] == "ok" and e["kind"] not in ("bad", "dropped_stream")]
    outcomes: dict[str, int] = {}
    for e in events:
        outcomes[e["outcome"]] = outcomes.get(e["outcome"], 0) + 1
    return {"minute": index, "rss_mib": round(float(np.median(rss)), 1), "rss_mib_min": round(min(rss), 1),
            "rss_mib_max": round(max(rss), 1), "queue": health["queue"],
            "prefix_cache": health["prefix_cache"], "engine": health["engine"], "requests": len(events),
            "outcomes": outcomes, "latency_s": percentiles([e["seconds"] for e in done]),
            "ttft_s": percentiles([e["ttft"] for e in done if e["ttft"] is not None])}


def rss_growth(rows: list[dict]) -> dict:
    """RSS growth after the first 10 minutes, from its trend: a least-squares line through each
    minute's RSS from minute 10 on, its rise over those minutes relative to its value at minute
    10. A request's prompt and cache come and go within seconds, so one sample a minute swings by
    a tenth around the level; two single samples (minute 10, the last) would compare swings."""
    later = [(r["minute"], r["rss_mib"]) for r in rows if r["minute"] >= 10]
    out = {"rss_mib_minute_10": rows[min(9, len(rows) - 1)]["rss_mib"], "rss_mib_last": rows[-1]["rss_mib"]}
    if len(later) >= 2:
        t, y = np.array(later, dtype=float).T
        slope, intercept = np.polyfit(t, y, 1)
        start = slope * t[0] + intercept
        out["rss_trend_mib_per_hour"] = round(float(60 * slope), 1)
        out["rss_growth_after_10min"] = round(float(slope * (t[-1] - t[0]) / start), 4)
        out["rss_ok"] = bool(out["rss_growth_after_10min"] < 0.05)
    return out


def checks(rows: list[dict], events: list[dict], drained: bool) -> dict:
    """The soak's verdicts (the issue's bar)."""
    def p99(first: int, last: int) -> float:
        window = [e["seconds"] for e in events if first <= e["minute"] < last and e["outcome"] == "ok"
                  and e["kind"] not in ("bad", "dropped_stream")]
        return float(np.percentile(window, 99))

    n = len(rows)
    bad = sum(1 for e in events if e["outcome"] in ("5xx", "stuck") or e["outcome"].startswith("transport"))
    out = {"no_5xx": not any(e["outcome"] == "5xx" for e in events),
           "no_stuck_request": not any(e["outcome"] == "stuck" for e in events) and drained,
           "unexpected": sum(1 for e in events if e["outcome"] not in ("ok", "refused", "dropped")),
           "failures": bad, **rss_growth(rows)}
    if n >= 20:
        out["p99_second_10min_s"], out["p99_last_10min_s"] = round(p99(10, 20), 3), round(p99(n - 10, n), 3)
        out["p99_ratio"] = round(out["p99_last_10min_s"] / out["p99_second_10min_s"], 3)
        out["p99_ok"] = out["p99_ratio"] <= 1.2
    return out


def start_server(args: argparse.Namespace, key: str, log: Path) -> subprocess.Popen:
    lyanna = Path(sys.executable).with_name("lyanna")
    cmd = [str(lyanna), "serve", "--port", str(args.port), "--method", args.method, "--max-batch", "8",
           "--queue-size", "64", *args.serve_args.split()]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "LYANNA_API_KEY": key})
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up: " + log.read_text()[-2000:])


def figure(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["minutes"]
    t = [r["minute"] + 1 for r in rows]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    a.plot(t, [r["rss_mib"] for r in rows], color="C0")
    a.set_ylabel("server RSS, MiB")
    b.plot(t, [r["latency_s"]["p50"] for r in rows], label="p50")
    b.plot(t, [r["latency_s"]["p99"] for r in rows], label="p99")
    b.set_ylabel("latency, s")
    b.legend()
    c.plot(t, [r["requests"] for r in rows], label="requests")
    c.plot(t, [r["prefix_cache"]["tokens"] / 100 if r["prefix_cache"] else 0 for r in rows], label="prefix cache, 100 tokens")
    c.plot(t, [r["queue"] for r in rows], label="queue at the sample")
    c.set_xlabel("minute")
    c.legend()
    fig.suptitle(f"lyanna serve soak, {report['clients']} clients, {report['machine'].get('cpu', '')}"[:110], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=int, default=60)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--method", default="lyanna+suffix", help="the server's default method")
    p.add_argument("--serve-args", default="", help="more options for lyanna serve")
    p.add_argument("--timeout", type=float, default=330.0, help="client seconds before a request counts as stuck")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default="docs/bench/soak.json")
    p.add_argument("--figure", default="docs/figures/soak.png")
    p.add_argument("--log", default="/tmp/lyanna-soak-serve.log", help="the server's output")
    p.add_argument("--recheck", default=None, metavar="JSON",
                   help="instead: recompute the RSS check of a soak's JSON (its p99 check needs the run's requests)")
    args = p.parse_args()
    if args.recheck:
        report = json.loads(Path(args.recheck).read_text())
        report["checks"].update(rss_growth(report["minutes"]))
        report["checks"]["rss_rechecked_by"] = f"scripts/soak.py --recheck {args.recheck}"
        Path(args.recheck).write_text(json.dumps(report, indent=1))
        print(json.dumps(report["checks"], indent=1))
        return
    key = "sk-soak-" + secrets.token_urlsafe(24)
    log = Path(args.log)
    server = start_server(args, key, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        methods = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["lyanna_methods"]
        start = time.time()
        soak = Soak(url, key, methods, [q.prompt for q in load_questions()], start + 60 * args.minutes, args.timeout)
        threads = [threading.Thread(target=soak.client, args=(args.seed * 1000 + i,), daemon=True)
                   for i in range(args.clients)]
        for th in threads:
            th.start()
        rows = []
        for i in range(args.minutes):
            rss = []
            while time.time() < start + 60 * (i + 1):  # RSS every RSS_EVERY seconds
                rss.append(rss_mib(server.pid))
                time.sleep(max(0.0, min(RSS_EVERY, start + 60 * (i + 1) - time.time())))
            with soak.lock:
                batch = [e for e in soak.events if start + 60 * i <= e["t"] < start + 60 * (i + 1)]
            rows.append(minute(url, rss, batch, i))
            print(json.dumps({k: rows[-1][k] for k in ("minute", "rss_mib", "queue", "requests", "outcomes", "latency_s")}),
                  flush=True)
        for th in threads:
            th.join(args.timeout + 10)
        drained = any(httpx.get(url + "/health").json()["queue"] == 0 or time.sleep(1) for _ in range(60))
        for e in soak.events:
            e["minute"] = int((e["t"] - start) // 60)
    finally:
        server.terminate()
        server.wait(60)
    report = {"command": "scripts/soak.sh " + " ".join(sys.argv[1:]), "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "machine": machine_info(), "clients": args.clients, "minutes": rows,
        "server": {"method": args.method, "methods": methods, "max_batch": 8, "serve_args": args.serve_args},
        "mix": dict(zip(KINDS, WEIGHTS)), "total_requests": len(soak.events), "queue_drained": drained,
        "checks": checks(rows, soak.events, drained)}
    log_text = log.read_text()
    report["checks"]["key_in_log"] = key in log_text
    Path(args.json_out).write_text(json.dumps(report, indent=1))
    figure(report, Path(args.figure))
    print(json.dumps(report["checks"], indent=1))


if __name__ == "__main__":
    main()
