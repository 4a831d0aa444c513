"""The OpenAI-compatible server over real HTTP on loopback.

Tests of timing-dependent behaviour (deadlines, disconnects, shutdown, a slow tokenizer, the queue)
run against ``StubDecoder``, which has the interface the server uses and makes tokens when the test
says so; the rest run the tiny model end to end.
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lyanna.cli import main as cli_main
from lyanna.decoding.decoder import GenerationRequest, GenerationResult
from lyanna.drafters.base import Drafter, NoDrafter
from lyanna.drafters.tree import DraftTree
from lyanna.serving.app import create_app
from lyanna.serving.body import MAX_JSON_DEPTH, nesting_depth
from lyanna.serving.server import GracefulServer

WAIT = 20  # seconds a test waits for an event before it fails (never reached when things work)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The app on a loopback port, served by ``GracefulServer`` in a thread."""

    def __init__(self, app, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = threading.Event()
        self.server = GracefulServer(app, host="127.0.0.1", port=self.port, log_level="warning",
                                     timeout_graceful_shutdown=5)
        startup = self.server.startup

        async def startup_then_signal(sockets=None):
            await startup(sockets)
            self.ready.set()

        self.server.startup = startup_then_signal
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if wait and not self.ready.wait(WAIT):
            raise RuntimeError("server did not start")

    def stop(self):
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(WAIT)


STUB_BLOCK = SimpleNamespace(rows=1)  # what the engine thread reads of a block: its rows


class StubDecoder:
    """What the server uses of ``Decoder``, making one token per ``release()`` (or one every
    ``pace`` seconds), and ending with finish reason ``cancelled`` when ``should_cancel`` says so,
    as the real decoder does at its next commit. One token per prompt character."""

    methods = ["ar"]

    def __init__(self, pace: float | None = None, context: int = 10_000):
        self.pace = pace
        self.target = SimpleNamespace(name="stub", config=SimpleNamespace(max_position_embeddings=context))
        self._tokens = threading.Semaphore(0)
        self.started = threading.Event()  # a generation is running
        self.results: queue.Queue[GenerationResult] = queue.Queue()
        self.requests: list[GenerationRequest] = []
        self.messages: list[list[dict]] = []
        self.calibrations = 0
        self.calibration_gate: threading.Event | None = None  # set: calibrating blocks on it
        self.calibrating = threading.Event()
        self.encode_gate: threading.Event | None = None  # set: tokenizing blocks on it
        self.encoding = threading.Event()
        self.engine = self  # forward_batch below
        self._cancels: list = []  # should_cancel of the generations in flight

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._tokens.release()

    def latency_curve(self):
        self.calibrating.set()
        if self.calibration_gate is not None:
            self.calibration_gate.wait(WAIT)
        self.calibrations += 1

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        self.encoding.set()
        if self.encode_gate is not None:
            self.encode_gate.wait(WAIT)
        return [7] * len(prompt)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        self.messages.append(messages)
        return self.encode("".join(m["content"] for m in messages))

    def drafter_for(self, method: str):
        return NoDrafter()

    def steps(self, ids, request, method="ar", on_text=None, should_cancel=None, **_):
        """Like ``Decoder.steps``: a generator of forward blocks; its engine is the stub itself."""
        self.requests.append(request)
        return self._steps(ids, request, method, on_text, should_cancel)

    def _steps(self, ids, request, method, on_text, should_cancel):
        self.started.set()
        self._cancels.append(should_cancel)
        tokens, finish = [], "length"
        try:
            while len(tokens) < request.max_new_tokens:
                made = yield STUB_BLOCK
                if should_cancel():
                    finish = "cancelled"
                    break
                if made:
                    tokens.append(7)
                    on_text("t")
        finally:
            self._cancels.remove(should_cancel)
        result = GenerationResult(method=method, prompt_tokens=len(ids), tokens=tokens, text="t" * len(tokens),
                                  finish_reason=finish, prefill_seconds=0.0, seconds=0.0, target_passes=len(tokens))
        self.results.put(result)
        return result

    def forward_batch(self, blocks):
        """One pass makes a token for every generation in the batch: after ``pace`` seconds, or per
        ``release()``; a pass also ends (making nothing) when a generation is cancelled."""
        if self.pace is not None:
            time.sleep(self.pace)  # the stub's compute time for one token
            return [True] * len(blocks)
        while not self._tokens.acquire(timeout=0.005):
            if any(cancelled() for cancelled in self._cancels):
                return [False] * len(blocks)
        return [True] * len(blocks)


@pytest.fixture
def stub_server():
    """``stub_server(stub, **create_app kwargs)``: a started server around a stub decoder."""
    servers = []

    def make(stub, wait=True, **kwargs):
        servers.append(Server(create_app(stub, **{"request_timeout": 30, **kwargs}), wait=wait))
        return servers[-1]

    yield make
    for srv in servers:
        srv.stop()


class OracleDrafter(Drafter):
    """Drafts the target's own greedy chain of 4 tokens, so greedy rounds accept whole blocks."""

    taps = ()
    passes = 0  # no draft model

    def __init__(self, engine):
        self.engine = engine
        self.next_of: dict[tuple[int, ...], int] = {}  # greedy next token by context, computed once

    def start(self, prompt_ids, hidden):
        pass

    def commit(self, tokens, hidden):
        pass

    def propose(self, context, max_depth):
        ctx = list(context)
        for _ in range(min(4, max_depth)):
            key = tuple(ctx)
            if key not in self.next_of:
                logits = self.engine.forward(ctx, range(len(ctx)), self.engine.new_cache(len(ctx))).logits[-1]
                self.next_of[key] = int(logits.argmax())
            ctx.append(self.next_of[key])
        return DraftTree.chain(ctx[len(context):])


@pytest.fixture(scope="module")
def server(tiny_decoder):
    if "oracle" not in tiny_decoder.drafters:
        tiny_decoder.add_drafter("oracle", OracleDrafter(tiny_decoder.engine))
    srv = Server(create_app(tiny_decoder, method="suffix", max_pending=8, request_timeout=30))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    c = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    c.model_id = c.models.list().data[0].id
    return c


MESSAGES = [{"role": "user", "content": "tell me about cats and cats and cats"}]


def test_openai_chat_matches_decoder_with_exact_usage(client, tiny_decoder):
    resp = client.chat.completions.create(model=tiny_decoder.target.name, messages=MESSAGES, max_tokens=30, temperature=0)
    ids = tiny_decoder.encode_messages(MESSAGES)
    ref = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=30))
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == ref.new_tokens
    assert resp.usage.total_tokens == len(ids) + ref.new_tokens


def test_openai_streaming_equals_non_streaming(client):
    kwargs = dict(model=client.model_id, messages=MESSAGES, max_tokens=25, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_openai_completion_and_sampling_seed(client):
    a = client.completions.create(model=client.model_id, prompt="abcabcabc", max_tokens=12, temperature=0.9, seed=5)
    b = client.completions.create(model=client.model_id, prompt="abcabcabc", max_tokens=12, temperature=0.9, seed=5)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens <= 12


def test_stop_string_inside_accepted_block(client, tiny_decoder, server):
    prompt = "the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    ids = tiny_decoder.encode(prompt, chat=False)
    # Whole trees: the oracle's first drafts (full forward passes) cost more than they save, and
    # the auto budget would rightly stop drafting; afterwards its drafts are lookups.
    greedy = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40), method="oracle", budget=None)
    assert greedy.tau > 3  # blocks of several tokens are committed at once
    stop = greedy.text[8:11]
    ref = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40, stop=(stop,)), method="oracle", budget=None)
    oracle = {"lyanna_method": "oracle"}
    resp = client.completions.create(model=client.model_id, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                     extra_body=oracle)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == ref.text == greedy.text[: greedy.text.find(stop)]
    assert resp.usage.completion_tokens == ref.new_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=client.model_id, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True, extra_body=oracle))
    assert streamed == ref.text and stop not in streamed


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/chat/completions", "{not json", 400, "JSON"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, 400, "n=1"),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100000}, 400, "context window"),
        # the one not used still keeps its bound (the schema's maximum, as schemathesis checks it)
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 5, "max_tokens": 100000}, 400,
         "max_tokens 100000"),
        ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": 0.5}, 400, "penalties"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": []}, 400, "tools"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/chat/completions", {"messages": MESSAGES, "lyanna_method": "nope"}, 400, "lyanna_method"),
        ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "not served"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x" * 3000, "max_tokens": 10}, 400, "context window"),
    ],
)
def test_bad_requests_get_clear_4xx(server, path, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [client.model_id]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["prefix_cache"] is None  # fp32 weights: no exact prefix reuse
    assert health["prefill_chunk"] == 0  # nor chunked prefill
    client.completions.create(model=client.model_id, prompt="abc", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("lyanna_requests_total", "lyanna_generated_tokens_total", "lyanna_request_latency_seconds_bucket", "lyanna_tau",
                 "lyanna_engine_busy_seconds_total"):
        assert name in text
    engine = httpx.get(server.url + "/health").json()["engine"]
    # That request alone took a prefill and at least two more passes, each of at least one row.
    assert engine["steps"] >= health["engine"]["steps"] + 3
    assert engine["rows"] - health["engine"]["rows"] >= engine["steps"] - health["engine"]["steps"]
    assert engine["busy_seconds"] > health["engine"]["busy_seconds"]
    assert health["engine"]["pass_seconds"] < engine["pass_seconds"] <= engine["busy_seconds"]


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a response, checked for its exact shape."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def sse(lines) -> list:
    """The data lines of a server-sent event stream, JSON-decoded except the final ``[DONE]``."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST on a thread; its response (or exception) lands in the returned dict."""
    out: dict = {}

    def go():
        try:
            out["response"] = httpx.post(url, json=body, timeout=WAIT)
        except Exception as e:  # the test asserts on it
            out["error"] = e

    thread = threading.Thread(target=go)
    thread.start()
    return thread, out


def send_and_leave_open(port: int, path: str, body: dict) -> socket.socket:
    """A raw HTTP request whose client can vanish without reading the answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def generated_tokens_metric(url: str) -> float:
    return float(re.search(r"^lyanna_generated_tokens_total (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


def test_calibration_happens_at_startup_before_the_server_is_ready(stub_server):
    stub = StubDecoder(pace=0.0)
    stub.calibration_gate = threading.Event()
    srv = stub_server(stub, wait=False)
    assert stub.calibrating.wait(WAIT), "the server did not calibrate at startup"
    assert not srv.ready.is_set()  # not accepting requests while calibrating
    stub.calibration_gate.set()
    assert srv.ready.wait(WAIT)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 3})
    assert r.status_code == 200 and stub.calibrations == 1  # requests never calibrate again


def test_queue_full_gives_429_with_retry_after(stub_server):
    stub = StubDecoder()
    srv = stub_server(stub, max_pending=1)
    holder, held = post_in_thread(srv.url + "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert stub.started.wait(WAIT)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    stub.release(2)
    holder.join(WAIT)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert error_of(r)["type"] == "rate_limit_error" and "busy" in error_of(r)["message"]
    assert held["response"].status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_acts_while_tokens_flow(stub_server, stream):
    """Tokens keep coming (one per ms, for seconds): the deadline must still end the request."""
    stub = StubDecoder(pace=0.001)
    srv = stub_server(stub, request_timeout=1.0)
    body = {"prompt": "abc", "max_tokens": 5000, "stream": stream}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT)
    if stream:
        events = sse(r.iter_lines())
        assert events[-1] == "[DONE]" and any(e.get("choices") for e in events[:-2])  # tokens were streamed
        error = events[-2]["error"]
    else:
        assert r.status_code == 504
        error = error_of(r)
    assert error["code"] == "timeout" and "timed out after 1 s" in error["message"]
    assert stub.results.get(timeout=WAIT).finish_reason == "cancelled"  # the engine stopped too


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_generation_while_tokens_flow(stub_server, stream):
    stub = StubDecoder(pace=0.001)
    srv = stub_server(stub)
    sock = send_and_leave_open(srv.port, "/v1/completions", {"prompt": "abc", "max_tokens": 5000, "stream": stream})
    assert stub.started.wait(WAIT)
    sock.close()
    cancelled = stub.results.get(timeout=WAIT)
    assert cancelled.finish_reason == "cancelled" and cancelled.new_tokens < 5000
    # the engine serves one job at a time, so once this returns the cancelled one is accounted for
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 3}).status_code == 200
    assert generated_tokens_metric(srv.url) == cancelled.new_tokens + 3  # cancelled tokens are counted
    assert httpx.get(srv.url + "/health").json()["queue"] == 0


def test_shutdown_answers_every_in_flight_request(stub_server):
    stub = StubDecoder()  # holds its generation: no token comes unless released
    srv = stub_server(stub, max_pending=4)
    running, answer = post_in_thread(srv.url + "/v1/completions", {"prompt": "abc", "max_tokens": 50})
    assert stub.started.wait(WAIT)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=WAIT,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}) as r:
        lines = r.iter_lines()
        assert sse([next(lines)])[0]["choices"][0]["delta"]["role"] == "assistant"  # queued behind the first
        srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        events = sse(lines)
    running.join(WAIT)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert "error" not in answer, answer.get("error")
    assert answer["response"].status_code == 503
    assert error_of(answer["response"])["code"] == "server_shutting_down"
    srv.thread.join(WAIT)
    assert not srv.thread.is_alive()


def test_tokenizing_runs_off_the_event_loop(stub_server):
    stub = StubDecoder(pace=0.0)
    stub.encode_gate = threading.Event()
    srv = stub_server(stub)
    thread, out = post_in_thread(srv.url + "/v1/completions", {"prompt": "a huge prompt", "max_tokens": 2})
    try:
        assert stub.encoding.wait(WAIT)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200  # while the tokenizer is busy
    finally:
        stub.encode_gate.set()
        thread.join(WAIT)
    assert out["response"].status_code == 200


def test_request_body_limit(stub_server):
    srv = stub_server(StubDecoder(pace=0.0), max_body_bytes=1000)
    big = {"prompt": "x" * 2000, "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/completions", json=big)
    assert r.status_code == 413 and "1000 bytes" in error_of(r)["message"]
    chunked = httpx.post(srv.url + "/v1/completions", content=iter([json.dumps(big).encode()]),
                         headers={"content-type": "application/json"})  # no content-length to trust
    assert chunked.status_code == 413
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 500, "max_tokens": 1}).status_code == 200


def nested(depth: int, inner: str = "1", array: bool = True) -> str:
    """JSON ``inner`` wrapped in ``depth`` arrays (or objects under key "a")."""
    return ("[" * depth + inner + "]" * depth) if array else ('{"a":' * depth + inner + "}" * depth)


@pytest.mark.parametrize(
    "content",
    [
        nested(5000),  # [[[...]]]
        nested(5000, array=False),  # {"a": {"a": ...}}
        '{"prompt": "abc", "stop": ' + nested(5000, '"x"') + "}",  # inside a field that takes a list
        '{"messages": [{"role": "user", "content": ' + nested(5000, '{"type": "text", "text": "x"}') + "}]}",
    ],
)
def test_deeply_nested_bodies_get_400_not_500(stub_server, content):
    srv = stub_server(StubDecoder(pace=0.0))
    path = "/v1/chat/completions" if "messages" in content else "/v1/completions"
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert f"{MAX_JSON_DEPTH}" in error_of(r)["message"] and "deep" in error_of(r)["message"]


def test_depth_limit_is_exact_and_bodies_at_it_are_validated(stub_server):
    """At the limit the body is parsed and validated (400 naming the field); one level deeper
    it is refused before parsing."""
    srv = stub_server(StubDecoder(pace=0.0))

    def post(stop_depth: int) -> httpx.Response:  # the body object is one level, stop's lists the rest
        body = '{"prompt": "abc", "stop": ' + nested(stop_depth, '"x"') + "}"
        return httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"})

    at_limit, past_it = post(MAX_JSON_DEPTH - 1), post(MAX_JSON_DEPTH)
    assert at_limit.status_code == 400 and error_of(at_limit)["param"] == "stop.0", at_limit.text
    assert "deep" not in error_of(at_limit)["message"]
    assert past_it.status_code == 400 and "deep" in error_of(past_it)["message"]


def test_brackets_inside_strings_do_not_count_as_nesting(stub_server):
    srv = stub_server(StubDecoder(pace=0.0))
    prompt = '[{"\\' * 2000  # brackets, quotes and backslashes: escaped in JSON, text in the prompt
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def json_depth(value) -> int:
    """How deep arrays and objects nest in a parsed JSON value."""
    if isinstance(value, list):
        return 1 + max(map(json_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(json_depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ax:,'),
                          lambda children: st.lists(children, max_size=3)
                          | st.dictionaries(st.text(alphabet='[]{}"\\a'), children, max_size=3)))
def test_nesting_depth_of_json_is_its_parsed_depth(value):
    assert nesting_depth(json.dumps(value)) == json_depth(value)


@pytest.mark.parametrize(
    "method,path,content,status,param,needle",
    [
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
        ("POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 4', 400, None, "not valid JSON"),
        ("POST", "/v1/completions", b'["abc"]', 400, None, "JSON object"),
        ("POST", "/v1/completions", b'{"prompt": "abc", "seed": ' + b"7" * 5000 + b"}", 400, None, "5000 digits"),
        ("POST", "/v1/completions", {"prompt": "abc", "max_tokens": "4"}, 400, "max_tokens", "string"),
        ("POST", "/v1/completions", {"prompt": "abc", "stream": 1}, 400, "stream", "boolean"),
        ("GET", "/v1/nothing", None, 404, None, "no such endpoint"),
        ("GET", "/v1/completions", None, 405, None, "GET"),
        ("GET", "/v1/models/gpt-4", None, 404, "model", "not served"),
        ("POST", "/v1/completions", {"prompt": "x" * 80}, 400, "prompt", "prompt is 80 tokens"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, 400, "messages",
         "prompt is 80 tokens"),
        ("POST", "/v1/completions", {"prompt": "x" * 10, "max_tokens": 60}, 400, "max_tokens", "context window"),
        ("POST", "/v1/completions", b'{"prompt": "abc", "temperature": NaN}', 400, "temperature", "finite number"),
        ("POST", "/v1/completions", {"prompt": "abc", "seed": -1}, 400, "seed", "greater than or equal to 0"),
        ("POST", "/v1/completions", {"prompt": "abc", "max_tokens": True}, 400, "max_tokens", "boolean"),
        ("POST", "/v1/completions", {"prompt": "abc", "stream_options": {"include_usage": True}}, 400,
         "stream_options", "stream is true"),
        ("POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "messages.0.content", "part 1 is 'image_url'"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role", "role"),
    ],
)
def test_errors_have_openai_shape_and_param(stub_server, method, path, content, status, param, needle):
    srv = stub_server(StubDecoder(pace=0.0, context=64))
    kwargs = {"json": content} if isinstance(content, dict) else {"content": content}
    r = httpx.request(method, srv.url + path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = error_of(r)
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_openapi_declares_bodies_errors_and_content_types(stub_server):
    srv = stub_server(StubDecoder(pace=0.0, context=64))
    doc = httpx.get(srv.url + "/openapi.json").json()
    components = doc["components"]["schemas"]
    for path, request in (("/v1/chat/completions", "ChatRequest"), ("/v1/completions", "CompletionRequest")):
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        fields = components[request]["properties"]
        assert fields["max_tokens"]["anyOf"][0]["maximum"] == 63  # this server's window, less a prompt token
        assert fields["lyanna_method"]["anyOf"][0]["enum"] == ["ar"] and fields["model"]["anyOf"][0]["enum"] == ["stub"]
        assert set(operation["responses"]) == {"200", "400", "404", "413", "429", "500", "503", "504"}
        assert "text/event-stream" in operation["responses"]["200"]["content"]
        for status in ("400", "413", "429"):
            assert operation["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorResponse")
    assert set(components["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain"] and list(metrics["500"]["content"]) == ["application/json"]
    assert "/openapi.json" in httpx.get(srv.url + "/docs").text


def test_openai_request_forms_we_can_honour(stub_server):
    stub = StubDecoder(pace=0.0)
    srv = stub_server(stub)
    parts = [{"type": "text", "text": "tell me "}, {"type": "text", "text": "about cats"}]
    r = httpx.post(srv.url + "/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
        "max_tokens": 2, "top_p": 0, "temperature": 1.5, "seed": 3})
    assert r.status_code == 200, r.text
    assert stub.messages[-1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about cats"}]
    assert stub.requests[-1].sampling.greedy  # top_p 0: the nucleus is the most probable token alone
    assert httpx.get(srv.url + "/v1/models/stub").json()["id"] == "stub"


def test_top_p_zero_is_greedy_end_to_end(client):
    kwargs = dict(model=client.model_id, messages=MESSAGES, max_tokens=20, seed=1)
    greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    assert client.chat.completions.create(temperature=1, top_p=0, **kwargs).choices[0].message.content == greedy


@pytest.mark.parametrize(
    "args,flag",
    [
        (["generate", "hi", "--seed", "-1"], "--seed"),  # one rule with the server: a seed is an integer >= 0
        (["serve", "--request-timeout", "0"], "--request-timeout"),
        (["serve", "--request-timeout", "nan"], "--request-timeout"),
        (["serve", "--max-body-bytes", "0"], "--max-body-bytes"),
    ],
)
def test_cli_refuses_bad_values_in_one_line(capsys, args, flag):
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"lyanna {args[0]}: error: argument {flag}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
          "presence_penalty", "logprobs", "lyanna_method", "stream_options", "user", "extra"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda d: {**d, "max_tokens": d["max_tokens"] if isinstance(d.get("max_tokens"), int) and d["max_tokens"] < 8 else 4})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans(), with_valid_core=st.booleans())
def test_fuzzed_requests_never_get_500(server, body, chat, with_valid_core):
    if with_valid_core:
        body.setdefault("messages" if chat else "prompt", MESSAGES if chat else "hello")
    r = httpx.post(server.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=30)
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith(("application/json", "text/event-stream"))


def serve_in_subprocess(model_dir, port: int, log, env: dict | None = None,
                        args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``lyanna serve`` of ``model_dir`` on ``port`` (and ``args``) in a process of its own, its
    output (stdout and stderr) written to the file ``log``; returned once ``/health`` answers."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as out:  # a file, not a pipe: a pipe nobody reads would block the server's logging
        proc = subprocess.Popen([sys.executable, "-m", "lyanna.cli", "--model", str(model_dir), "serve",
                                 "--port", str(port), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("server did not come up: " + Path(log).read_text()[-2000:])


def test_sigterm_shuts_down_gracefully(tiny_model_dir, tmp_path):
    proc = serve_in_subprocess(tiny_model_dir, free_port(), tmp_path / "serve.log")
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        log = (tmp_path / "serve.log").read_text()
        # uvicorn re-raises the signal after a clean shutdown, so -SIGTERM is a graceful exit too
        assert code in (0, -signal.SIGTERM), log
        assert "Application shutdown complete" in log
        assert log.index("latency curve") < log.index("Application startup complete")  # calibrated before ready
    finally:
        proc.kill()


def test_serve_runs_the_engine_on_its_calling_thread_and_stops_on_sigterm():
    """``serve`` keeps every forward pass and the calibration on the thread that called it (the
    one that loaded the model: numba's thread teams, see ``serve``), answers over HTTP from
    another, and a SIGTERM to the process ends it cleanly with the signal handlers restored."""
    from lyanna.serving.server import serve

    stub = StubDecoder(pace=0.001)
    ran_on: set[threading.Thread] = set()
    forward, calibrate = stub.forward_batch, stub.latency_curve
    stub.forward_batch = lambda blocks: ran_on.add(threading.current_thread()) or forward(blocks)
    stub.latency_curve = lambda: ran_on.add(threading.current_thread()) or calibrate()
    port, answers = free_port(), []

    def client():
        try:
            for _ in range(300):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=WAIT,
                                      json={"prompt": "abc", "max_tokens": 3}))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    helper = threading.Thread(target=client)
    helper.start()
    serve(stub, "127.0.0.1", port, "ar", max_pending=4, request_timeout=30)
    helper.join(WAIT)
    assert answers and answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 3
    assert ran_on == {threading.current_thread()}
    assert signal.getsignal(signal.SIGTERM) is before


def test_serve_on_a_taken_port_exits_with_an_error_instead_of_waiting_for_jobs():
    from lyanna.serving.server import serve

    watchdog = threading.Timer(WAIT, os.kill, (os.getpid(), signal.SIGTERM))  # ends serve() should it hang
    before = signal.getsignal(signal.SIGTERM)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        watchdog.start()
        try:
            with pytest.raises(SystemExit) as exited:
                serve(StubDecoder(pace=0.001), "127.0.0.1", taken.getsockname()[1], "ar", max_pending=4, request_timeout=30)
        finally:
            watchdog.cancel()
    assert exited.value.code not in (0, None)  # uvicorn's startup failure (3 in uvicorn 0.54)
    assert signal.getsignal(signal.SIGTERM) is before


def test_loadtest_is_bounded_and_loopback_only(server):
    from lyanna.errors import LyannaError
    from lyanna.serving.loadtest import run_load

    report = run_load(server.url, ["hello", "cats"], requests=6, concurrency=3, max_tokens=4)
    assert report["succeeded"] == 6 and report["failed"] == 0
    assert report["latency_p95_s"] >= report["latency_p50_s"] > 0
    engine = report["engine"]  # the engine thread's share of the load: within its wall time
    assert engine["steps"] >= 4 and engine["rows"] >= engine["steps"]
    assert engine["waiting_steps"] == 0  # 3 clients, a batch of 8: nobody waits for a place
    assert 0 < engine["busy_seconds"] <= report["wall_seconds"] + 0.01 and 0 < engine["busy_share"] <= 1.01
    assert 0 < engine["pass_seconds"] <= engine["busy_seconds"] and engine["ms_per_pass"] <= engine["ms_per_step"]
    assert 0 <= engine["draft_seconds"] <= engine["busy_seconds"] - engine["pass_seconds"] + 1e-3
    with pytest.raises(LyannaError, match="loopback"):
        run_load("http://10.0.0.1:8000", ["x"], 1, 1, 1)


def test_health_counts_the_steps_with_requests_waiting_for_the_batch(stub_server):
    """A batch of one and two requests: while the first runs the second waits, and those steps
    are counted (the auto budget drafts nothing in them); once both are done, none waits."""
    from lyanna.serving.loadtest import run_load

    srv = stub_server(StubDecoder(pace=0.005), max_batch=1)
    report = run_load(srv.url, ["abcdefghij", "klmnopqrst"], requests=2, concurrency=2, max_tokens=10)
    engine = report["engine"]
    assert report["succeeded"] == 2 and 1 <= engine["waiting_steps"] < engine["steps"]
    assert httpx.get(srv.url + "/health").json()["engine"]["waiting_steps"] == engine["waiting_steps"]
    assert f"lyanna_engine_waiting_steps_total {float(engine['waiting_steps'])}" in httpx.get(srv.url + "/metrics").text
