"""Peers in child processes: a peer that kills its own process (SIGILL, as a native llama.cpp
build does on an AMX host, and SIGKILL) is reported failed, with the signal named, and every
other method's results are kept. In the bench's own process either signal would end pytest."""
from __future__ import annotations

import json
import os
import resource
import signal

import pytest

from lyanna.decoding.decoder import GenerationResult
from lyanna.decoding.sampling import SamplingParams
from lyanna.errors import LyannaError
from lyanna.measure.bench import Question, format_table, json_beside, make_runners, run_bench
from lyanna.measure.peers import Peer, PeerFailed, call_in_child
from lyanna.measure.report import findings


class SelfKillingPeer:
    """A stand-in peer: answers ``calls`` generations (the warm-up is the first), then sends its
    own process ``signum`` (0: raises instead)."""

    def __init__(self, signum: int, calls: int):
        self.signum, self.left = signum, calls
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from SIGILL

    def generate(self, ids: list[int], max_new_tokens: int) -> GenerationResult:
        if self.left == 0 and self.signum == 0:
            raise RuntimeError("no more")
        if self.left == 0:
            os.kill(os.getpid(), self.signum)
        self.left -= 1
        tokens = [7] * max_new_tokens
        return GenerationResult(method="stub", prompt_tokens=len(ids), tokens=tokens, text="", finish_reason="length",
                                prefill_seconds=0.001, seconds=0.01, target_passes=0, extra={"pid": os.getpid()})


def _stub(signum: int, calls: int, hint: str = "") -> Peer:
    return Peer(kind=f"stub-{signal.Signals(signum).name}", factory=f"{__name__}:SelfKillingPeer",
                kwargs={"signum": signum, "calls": calls}, hint=hint)


QUESTIONS = [Question(i, cat, f"question {i}") for i, cat in enumerate(["a", "b", "a"])]


def test_a_peer_killed_by_a_signal_is_failed_and_the_other_methods_kept(tiny_decoder):
    peers = {"ill": _stub(signal.SIGILL, calls=2, hint="rebuild it"),  # the warm-up and question 0, then dies
             "gone": _stub(signal.SIGKILL, calls=0)}  # dies on its warm-up
    report = run_bench(tiny_decoder, ["ar", "ill", "suffix", "gone"], QUESTIONS, 4, progress=False, peers=peers)
    json.dumps(report)  # JSON-ready with failed rows
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["ar", "ill", "suffix", "gone"] and report["settings"]["questions"] == 3
    for m in ("ar", "suffix"):
        assert "failed" not in rows[m] and len(rows[m]["per_question"]) == 3 and rows[m]["equal_to_ar"]
        assert rows[m]["new_tokens"] > 0 and rows[m]["tokens_per_s"] > 0
    ill, gone = rows["ill"], rows["gone"]
    assert ill["failed_signal"] == "SIGILL" and ill["failed"].startswith("stub-SIGILL: child process killed by SIGILL")
    assert ill["failed"].endswith("; rebuild it") and ill["health"] == [f"failed: {ill['failed']}"]
    assert ill["questions_done"] == 1 and [q["question_id"] for q in ill["per_question"]] == [0]
    assert ill["per_question"][0]["seconds"] == 0.01  # the child's own clock, not the pipe's round trip
    assert gone["failed_signal"] == "SIGKILL" and "killed by SIGKILL" in gone["failed"]
    assert gone["questions_done"] == 0 and gone["per_question"] == []
    for r in (ill, gone):
        assert set(r) >= set(rows["ar"]) and r["tokens_per_s"] is None and r["speedup"] is None
    table = format_table(report)
    assert "| ill | failed: SIGILL |" in table and "| gone | failed: SIGKILL |" in table and "| suffix | " in table
    assert f"warning: `ill`: failed: {ill['failed']}" in findings(report)


def test_peer_runners_share_a_child_per_kind_and_decode_the_text(tiny_decoder):
    peer = _stub(signal.SIGKILL, calls=2, hint="a hint")
    raising = Peer(kind="raising", factory=f"{__name__}:SelfKillingPeer", kwargs={"signum": 0, "calls": 0}, hint="a hint")
    runners = make_runners(tiny_decoder, ["one", "two", "raising"], SamplingParams(),
                           peers={"one": peer, "two": peer, "raising": raising})
    try:
        a, b = runners["one"]([1, 2], 3), runners["two"]([1, 2], 3)
        assert a.extra["pid"] == b.extra["pid"] != os.getpid()  # one child for the kind, not this process
        assert a.text == tiny_decoder.tokenizer.decode([7, 7, 7], skip_special_tokens=True)
        with pytest.raises(PeerFailed, match="SIGKILL"):
            runners["one"]([1, 2], 3)
        with pytest.raises(PeerFailed, match="SIGKILL"):  # the other method of the dead child fails at once
            runners["two"]([1, 2], 3)
        with pytest.raises(PeerFailed, match="^raising: generate raised RuntimeError: no more$") as e:
            runners["raising"]([1, 2], 3)  # a Python error fails the method too, without the crash hint
        assert e.value.signal is None and not runners["raising"].process.process.is_alive()
    finally:
        for run in runners.values():
            run.close()


def test_a_peer_that_cannot_be_built_is_an_error_before_the_bench(tiny_decoder):
    broken = Peer(kind="broken", factory=f"{__name__}:SelfKillingPeer", kwargs={"no_such_argument": 1})
    with pytest.raises(LyannaError, match="TypeError: .*no_such_argument"):
        run_bench(tiny_decoder, ["ar", "broken"], QUESTIONS, 4, progress=False, peers={"broken": broken})


def _die(signum: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), signum)


def test_call_in_child_returns_the_value_or_names_the_signal():
    """As ``scripts/measure-blocks.py`` times llama.cpp: a crash is an exception with the hint."""
    assert call_in_child(os.getpid) != os.getpid()
    with pytest.raises(PeerFailed, match=r"^llamacpp: child process killed by SIGILL .*; GGML_NATIVE=OFF$") as e:
        call_in_child(_die, signal.SIGILL, kind="llamacpp", hint="GGML_NATIVE=OFF")
    assert e.value.signal == "SIGILL"


def test_json_beside_imports_the_checkout_and_shows_a_failed_childs_error(tmp_path):
    """As the measuring scripts time another checkout's engine: the child imports that checkout's
    package (its ``src`` first on the path), its last line is the answer, and a failure comes back
    with the child's own error, not only an exit status."""
    (tmp_path / "src" / "lyanna").mkdir(parents=True)
    (tmp_path / "src" / "lyanna" / "__init__.py").write_text("WHO = 'the other checkout'\n")
    code = "import json, lyanna; print('noise'); print(json.dumps({'who': lyanna.WHO}))"
    assert json_beside(tmp_path, ["-c", code]) == {"who": "the other checkout"}
    with pytest.raises(LyannaError, match=r"failed \(exit 1\):\n(.|\n)*ZeroDivisionError"):
        json_beside(tmp_path, ["-c", "1 / 0"])
