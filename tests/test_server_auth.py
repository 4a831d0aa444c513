"""API keys: a server started with keys serves only requests that carry one, and says so in its
contract; a server on a non-loopback address without keys does not start by accident."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from lyanna.errors import LyannaError
from lyanna.serving.auth import ApiKeys, check_exposure, is_loopback

from .test_server import StubDecoder, error_of, free_port, serve_in_subprocess, sse, stub_server  # noqa: F401 (a fixture)

KEY, OTHER = "sk-lyanna-test-0123456789", "sk-lyanna-other-9876543210"
COMPLETION = {"prompt": "abc", "max_tokens": 3}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def counting(stub: StubDecoder) -> list[int]:
    """Wrap the stub's ``steps`` so that every generation the engine starts is counted."""
    started: list[int] = []
    steps = stub.steps
    stub.steps = lambda *a, **k: started.append(1) or steps(*a, **k)
    return started


@pytest.mark.parametrize("stream", [False, True])
def test_requests_without_the_key_get_401_and_never_reach_the_engine(stub_server, stream):
    stub = StubDecoder(pace=0.0)
    started = counting(stub)
    srv = stub_server(stub, keys=ApiKeys.configure([KEY], environ={}))
    body = {**COMPLETION, "stream": stream}
    engine_before = httpx.get(srv.url + "/health").json()["engine"]  # /health stays open
    for headers in ({}, bearer(OTHER), {"Authorization": "Bearer"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    bearer(KEY + "x"), bearer(KEY[:-1])):
        for path in ("/v1/completions", "/v1/chat/completions"):
            payload = body if path == "/v1/completions" else {**body, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(srv.url + path, json=payload, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            error = error_of(r)
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text and OTHER not in r.text
        assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 401
    assert started == [] and httpx.get(srv.url + "/health").json()["engine"] == engine_before
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=bearer(KEY))
    assert r.status_code == 200 and len(started) == 1
    if stream:
        assert sse(r.text.splitlines())[-1] == "[DONE]"
    else:
        assert r.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(srv.url + "/metrics", headers=bearer(KEY)).text
    assert "lyanna_unauthorized_requests_total 21.0" in metrics  # 7 headers x 3 routes
    assert 'lyanna_requests_total{endpoint="/v1/completions",status="401"} 7.0' in metrics


def test_metrics_behind_the_key_unless_open(stub_server):
    keys = ApiKeys.configure([KEY, OTHER], environ={})
    closed = stub_server(StubDecoder(pace=0.0), keys=keys)
    assert httpx.get(closed.url + "/metrics").status_code == 401
    assert httpx.get(closed.url + "/metrics", headers=bearer(OTHER)).status_code == 200  # either key
    opened = stub_server(StubDecoder(pace=0.0), keys=keys, metrics_open=True)
    assert httpx.get(opened.url + "/metrics").status_code == 200
    assert httpx.get(opened.url + "/v1/models").status_code == 401


def test_openai_client_sends_its_api_key(stub_server):
    import openai

    srv = stub_server(StubDecoder(pace=0.0), keys=ApiKeys.configure([], environ={"LYANNA_API_KEY": KEY}))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="abcd", max_tokens=4)
    assert out.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tt"
    wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key=OTHER, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model=model, prompt="abcd", max_tokens=4)
    assert refused.value.code == "invalid_api_key"


def test_key_file_rotates_without_a_restart_and_never_opens_the_server(stub_server, tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# keys for the test\n\n  {KEY}  \n")
    srv = stub_server(StubDecoder(pace=0.0), keys=ApiKeys.configure(None, path, environ={}))
    models = srv.url + "/v1/models"
    assert httpx.get(models, headers=bearer(KEY)).status_code == 200
    assert httpx.get(models, headers=bearer("# keys for the test")).status_code == 401  # comments are not keys
    path.write_text(f"{OTHER}\n")
    os.utime(path, ns=(1, 1))  # a rewrite within one mtime tick must still be seen: a new stamp either way
    assert httpx.get(models, headers=bearer(KEY)).status_code == 401
    assert httpx.get(models, headers=bearer(OTHER)).status_code == 200
    path.unlink()  # unreadable: its last keys stay
    assert httpx.get(models, headers=bearer(OTHER)).status_code == 200
    path.write_text("")  # emptied: nobody is let in, not everybody
    assert httpx.get(models, headers=bearer(OTHER)).status_code == 401
    assert httpx.get(models).status_code == 401


def test_accepts_only_a_bearer_key_it_holds():
    keys = ApiKeys.configure([KEY, OTHER], environ={})
    assert keys.accepts(f"Bearer {KEY}") and keys.accepts(f"bearer {OTHER}") and keys.accepts(f"Bearer  {KEY} ")
    for header in (None, "", "Bearer", "Bearer ", KEY, f"Token {KEY}", f"Bearer {KEY}{OTHER}", f"Bearer {KEY[1:]}"):
        assert not keys.accepts(header), header
    assert not ApiKeys().required and ApiKeys.configure(None, None, environ={}).required is False
    with pytest.raises(LyannaError, match="must not be empty"):
        ApiKeys.configure(["  "], environ={})
    with pytest.raises(LyannaError, match="cannot read the API key file"):
        ApiKeys.configure(None, "/nonexistent/keys", environ={})


def test_exposure_needs_a_key_or_an_explicit_opt_out():
    open_keys, keys = ApiKeys(), ApiKeys.configure([KEY], environ={})
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert is_loopback(host)
        check_exposure(host, open_keys, allow_unauthenticated=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7"):
        assert not is_loopback(host)
        with pytest.raises(LyannaError, match="--api-key"):
            check_exposure(host, open_keys, allow_unauthenticated=False)
        check_exposure(host, keys, allow_unauthenticated=False)
        check_exposure(host, open_keys, allow_unauthenticated=True)


def test_serving_every_interface_without_a_key_exits_before_loading_the_model(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LYANNA_API_KEY"}
    run = subprocess.run([sys.executable, "-m", "lyanna.cli", "--model", str(tmp_path / "no-such-model"), "serve",
                          "--host", "0.0.0.0", "--port", str(free_port())], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0
    assert "refusing to serve 0.0.0.0 without an API key" in run.stderr and "--allow-unauthenticated" in run.stderr
    assert "Traceback" not in run.stderr


def test_keys_never_reach_the_log_and_the_contract_declares_them(tiny_model_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    key_file = tmp_path / "keys"
    key_file.write_text("sk-from-the-file-000111\n")
    proc = serve_in_subprocess(tiny_model_dir, port, log, env={"LYANNA_API_KEY": OTHER},
                               args=("--api-key", KEY, "--api-key-file", str(key_file)))
    url = f"http://127.0.0.1:{port}"
    try:
        for key in (KEY, OTHER, "sk-from-the-file-000111"):
            r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer(key), timeout=60)
            assert r.status_code == 200, r.text
        assert httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer("sk-wrong-424242")).status_code == 401
        schema = httpx.get(url + "/openapi.json").json()  # the contract is public
        assert schema["components"]["securitySchemes"]["apiKey"] == {
            "type": "http", "scheme": "bearer", "description": schema["components"]["securitySchemes"]["apiKey"]["description"]}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                guarded = path.startswith("/v1/") or path == "/metrics"
                assert (operation.get("security") == [{"apiKey": []}]) == guarded, path
                assert ("401" in operation["responses"]) == guarded, path
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = log.read_text()
    assert "API keys required: 2 given, 1 in" in text  # how many and where from, never which
    for secret in (KEY, OTHER, "sk-from-the-file-000111", "sk-wrong-424242"):
        assert secret not in text


def test_loadtest_sends_the_key(stub_server, monkeypatch):
    from lyanna.serving.loadtest import run_load

    srv = stub_server(StubDecoder(pace=0.0), keys=ApiKeys.configure([KEY], environ={}))
    report = run_load(srv.url, ["hello"], requests=3, concurrency=2, max_tokens=2, api_key=KEY)
    assert report["succeeded"] == 3 and report["failed"] == 0
    monkeypatch.setenv("LYANNA_API_KEY", KEY)  # the default, as for lyanna serve
    assert run_load(srv.url, ["hello"], requests=2, concurrency=1, max_tokens=2)["succeeded"] == 2
    monkeypatch.delenv("LYANNA_API_KEY")
    refused = run_load(srv.url, ["hello"], requests=2, concurrency=1, max_tokens=2)
    assert refused["failed"] == 2 and refused["failures"] == ["401"]
