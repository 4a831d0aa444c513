"""The server's Prometheus metrics, in a registry of its own (two apps in one process, as in
the tests, count apart). ``GET /metrics`` renders them."""
from __future__ import annotations

from ..decoding.decoder import GenerationResult


class Metrics:
    """Requests, tokens, draft acceptance, latency and queue depth."""

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
        self.unauthorized = Counter("lyanna_unauthorized_requests",
                                    "Requests refused for a missing or wrong API key (401)", registry=r)
        self.queue = Gauge("lyanna_queue_depth", "Requests queued or running", registry=r)
        self.steps = Counter("lyanna_engine_steps", "Batched forward passes the engine thread ran", registry=r)
        self.step_rows = Counter("lyanna_engine_step_rows", "Rows in those passes", registry=r)
        self.busy = Counter("lyanna_engine_busy_seconds",
                            "Engine thread time in its steps (passes, drafting, verification)", registry=r)
        self.pass_time = Counter("lyanna_engine_pass_seconds", "Of that, time in the forward passes", registry=r)
        self.waiting_steps = Counter("lyanna_engine_waiting_steps",
                                     "Steps with requests waiting for a place in the batch (no drafting in them)", registry=r)
        self.draft_time = Counter("lyanna_engine_draft_seconds",
                                  "Of the steps' time, in drafting calls several rounds shared", registry=r)
        self.drafted_rounds = Counter("lyanna_engine_drafted_rounds", "Rounds drafted in those calls", registry=r)
        self._totals = {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0}
        self._engine = {"steps": 0, "rows": 0, "waiting_steps": 0, "busy_seconds": 0.0, "pass_seconds": 0.0,
                        "draft_seconds": 0.0, "drafted_rounds": 0}

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

    def record_step(self, seconds: float, pass_seconds: float, rows: int, waiting: int, draft_seconds: float = 0.0,
                    drafted: int = 0) -> None:
        """Count one step of the engine thread (called on that thread only): comparing its busy
        time with a load's wall time tells whether the engine or something around it (HTTP,
        the host) set the pace, and its pass time whether the passes or the rounds' host work
        (drafting, verification) fill the step; ``waiting``: requests that waited for a place in
        the batch meanwhile (then the auto budget drafts nothing); ``draft_seconds``: its drafting
        calls shared by ``drafted`` rounds (a batch's ``lyanna`` rounds draft together)."""
        self.steps.inc()
        self.step_rows.inc(rows)
        held_back = int(waiting > 0)
        self.waiting_steps.inc(held_back)
        self.busy.inc(seconds)
        self.pass_time.inc(pass_seconds)
        self.draft_time.inc(draft_seconds)
        self.drafted_rounds.inc(drafted)
        e = self._engine
        e["steps"] += 1
        e["rows"] += rows
        e["waiting_steps"] += held_back
        e["busy_seconds"] += seconds
        e["pass_seconds"] += pass_seconds
        e["draft_seconds"] += draft_seconds
        e["drafted_rounds"] += drafted

    def engine(self) -> dict[str, int | float]:
        """The engine thread's totals so far (``/health``)."""
        e = self._engine
        return {**e, **{k: round(e[k], 3) for k in ("busy_seconds", "pass_seconds", "draft_seconds")}}

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
