"""The server's contract: ``/openapi.json`` describes what ``lyanna serve`` accepts and answers.

Schemathesis generates requests from the schema (valid ones, and invalid ones it derives from it)
and runs every check it has on the answers: no 5xx, documented status codes, content types and
headers, responses valid against their schemas (streamed events included), valid requests
accepted and invalid ones refused. One rule the schema cannot state, that the prompt and
``max_tokens`` fit the context window together, is kept by ``schemathesis_hooks.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from .conftest import make_tiny_model
from .test_server import free_port, serve_in_subprocess

ST = Path(sys.executable).with_name("st")  # schemathesis's CLI, installed beside this interpreter
REPO = Path(__file__).parents[1]
# Cases per operation and phase; with the coverage phase's boundary cases, about 700 requests.
MAX_EXAMPLES = 20
# Seconds a request may take before schemathesis calls it a network error; a completion of the
# tiny model takes well under one, but the test shares its cores with the server.
REQUEST_TIMEOUT = 60
# Seconds the whole run may take (it takes under a minute): a hang fails this test, not the suite.
RUN_TIMEOUT = 600


@pytest.mark.parametrize("key", [None, "sk-schema-test-key"], ids=["open", "with-key"])
def test_schemathesis_all_checks_pass_on_every_operation(tmp_path, key):
    """With a key, the contract declares it and schemathesis sends it; its ``ignored_auth`` check
    also sends requests without it and with a wrong one, and fails unless they are refused."""
    # A context window of 64 tokens keeps every completion short (the default max_tokens is what
    # the window leaves), so the ~700 requests take seconds of generation, not minutes.
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=64)
    port = free_port()
    # One kernel thread: the tiny model's kernels are too small to share out, and the cores are
    # busy with schemathesis too.
    server = serve_in_subprocess(model, port, tmp_path / "serve.log", env={"NUMBA_NUM_THREADS": "1"},
                                 args=("--api-key", key) if key else ())
    try:
        url = f"http://127.0.0.1:{port}/openapi.json"
        schema = httpx.get(url).json()
        operations = {f"{method.upper()} {path}" for path, item in schema["paths"].items() for method in item}
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
               "LYANNA_SCHEMA_TEST_MODEL": str(model),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        auth = ["--header", f"Authorization: Bearer {key}"] if key else []
        assert ("securitySchemes" in schema["components"]) == bool(key)
        run = subprocess.run([str(ST), "run", url, *auth, "--checks", "all", "--max-examples", str(MAX_EXAMPLES),
                              "--request-timeout", str(REQUEST_TIMEOUT), "--report", "junit",
                              "--report-dir", str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:] + (tmp_path / "serve.log").read_text()[-2000:]
    (report,) = tmp_path.glob("junit-*.xml")
    results = {case.get("name"): [child.tag for child in case] for case in ET.parse(report).getroot().iter("testcase")}
    assert operations <= results.keys()  # every operation was tested (and the stateful scenarios)
    assert not {name: outcome for name, outcome in results.items() if outcome}  # none failed, errored or skipped
