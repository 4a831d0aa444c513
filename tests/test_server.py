"""The OpenAI-compatible server over real HTTP on loopback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lyanna.decoding import Decoder, GenerationRequest
from lyanna.loading import load_target
from lyanna.server import create_app
from lyanna.tree import DraftTree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class SlowDrafter:
    """Proposes nothing, slowly: makes every round take a while so tests can overlap requests."""

    taps = ()
    passes = 0

    def __init__(self):
        self.proposals = 0

    def start(self, prompt_ids, hidden):
        pass

    def commit(self, tokens, hidden):
        pass

    def propose(self, context, max_depth):
        self.proposals += 1
        time.sleep(0.01)
        return DraftTree.empty()


class OracleDrafter(SlowDrafter):
    """Drafts the target's own greedy chain of 4 tokens, so greedy rounds accept whole blocks."""

    def __init__(self, engine):
        self.engine = engine

    def propose(self, context, max_depth):
        ctx = list(context)
        for _ in range(min(4, max_depth)):
            logits = self.engine.forward(ctx, range(len(ctx)), self.engine.new_cache(len(ctx))).logits[-1]
            ctx.append(int(logits.argmax()))
        return DraftTree.chain(ctx[len(context):])


@pytest.fixture(scope="module")
def server(tiny_decoder):
    if "oracle" not in tiny_decoder.drafters:
        tiny_decoder.add_drafter("oracle", OracleDrafter(tiny_decoder.engine))
    srv = Server(create_app(tiny_decoder, method="suffix", max_pending=8, request_timeout=30))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def slow(tiny_model_dir):
    decoder = Decoder(load_target(tiny_model_dir))
    drafter = SlowDrafter()
    decoder.add_drafter("slow", drafter)
    srv = Server(create_app(decoder, method="slow", max_pending=1, request_timeout=30))
    yield srv, drafter
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
    greedy = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40), method="oracle")
    assert greedy.tau > 3  # blocks of several tokens are committed at once
    stop = greedy.text[8:11]
    ref = tiny_decoder.generate(ids, GenerationRequest(max_new_tokens=40, stop=(stop,)), method="oracle")
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
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100000}, 400, "context window"),
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
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model=client.model_id, prompt="abc", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("lyanna_requests_total", "lyanna_generated_tokens_total", "lyanna_request_latency_seconds_bucket", "lyanna_tau"):
        assert name in text


def test_queue_full_gives_429_with_retry_after(slow):
    srv, _ = slow
    body = {"prompt": "abc", "max_tokens": 300, "temperature": 0}
    with httpx.Client(timeout=30) as c:
        holder = threading.Thread(target=lambda: c.post(srv.url + "/v1/completions", json=body))
        holder.start()
        time.sleep(0.3)
        r = httpx.post(srv.url + "/v1/completions", json=body)
        holder.join()
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert "busy" in r.json()["error"]["message"]


def test_client_disconnect_cancels_generation(slow):
    srv, drafter = slow
    body = {"prompt": "abc", "max_tokens": 400, "temperature": 0, "stream": True}
    before = drafter.proposals
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            next(r.iter_lines())  # the generation is running
    time.sleep(1.0)
    stopped_at = drafter.proposals
    time.sleep(0.5)
    assert drafter.proposals == stopped_at  # no more rounds after the disconnect
    assert stopped_at - before < 300  # it did not run to max_tokens (each round sleeps 10 ms)
    assert httpx.get(srv.url + "/health").json()["queue"] == 0


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


def test_sigterm_shuts_down_gracefully(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lyanna.cli", "--model", str(tiny_model_dir), "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("server did not come up: " + proc.stdout.read().decode()[-2000:])
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        log = proc.stdout.read().decode()
        # uvicorn re-raises the signal after a clean shutdown, so -SIGTERM is a graceful exit too
        assert code in (0, -signal.SIGTERM), log
        assert "Application shutdown complete" in log
    finally:
        proc.kill()


def test_loadtest_is_bounded_and_loopback_only(server):
    from lyanna.errors import LyannaError
    from lyanna.loadtest import run_load

    report = run_load(server.url, ["hello", "cats"], requests=6, concurrency=3, max_tokens=4)
    assert report["succeeded"] == 6 and report["failed"] == 0
    assert report["latency_p95_s"] >= report["latency_p50_s"] > 0
    with pytest.raises(LyannaError, match="loopback"):
        run_load("http://10.0.0.1:8000", ["x"], 1, 1, 1)
