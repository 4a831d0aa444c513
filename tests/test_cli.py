"""The command line: JSON output, streamed text, bench report shape, and clear errors."""
from __future__ import annotations

import json
import re

import pytest

from lyanna.cli import main
from lyanna.decoding.decoder import DEFAULT_METHODS

HEADLESS_DEFAULT = next(m for m in DEFAULT_METHODS if "lyanna" not in m)  # the tiny models have no draft head


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "--model", str(tiny_model_dir), "generate", "hi", "--json", "--max-new-tokens", "12")
    assert code == 0
    row = json.loads(out)
    for key in ("method", "text", "new_tokens", "seconds", "tokens_per_s", "tau", "waste_ratio"):
        assert key in row
    assert row["method"] == HEADLESS_DEFAULT and 1 <= row["new_tokens"] <= 12  # the default method
    assert "tokens/s" in err


def test_generate_streams_text(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "--model", str(tiny_model_dir), "generate", "hi", "--max-new-tokens", "8", "--seed", "1",
                             "--method", "ar")
    assert code == 0 and out.endswith("\n") and "[ar]" in err


def test_demo_compares_the_default_method_with_ar_on_every_category(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "--model", str(tiny_model_dir), "demo")
    assert code == 0
    method = HEADLESS_DEFAULT
    heading = rf"ar, {method} on \d+ Spec-Bench questions \(one per category\), 64 new tokens each, the fastest of 2 runs"
    assert re.search(heading, out) and f"| {method} |" in out
    line = next(x for x in out.splitlines() if x.startswith(f"{method} (the default method): "))
    assert "x ar over these questions" in line and "every output token-identical to ar" in line
    assert "no Lyanna draft head" in out  # the tiny model has none


@pytest.mark.parametrize(
    "args,needle",
    [
        (["generate", "hi", "--max-new-tokens", "0"], "positive integer"),
        (["generate", "hi", "--max-new-tokens", "x"], "positive integer"),
        (["generate", "hi", "--top-k", "-3"], "integer >= 0"),
        (["bench", "--limit", "0"], "positive integer"),
        (["bench", "--repeats", "0"], "positive integer"),
    ],
)
def test_bad_arguments_exit_2(capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--method", "nope"], "unknown method"),
        (["bench", "--methods", "ar,nope", "--limit", "1"], "unknown method"),
        (["bench", "--questions", "/no/file.jsonl"], "not found"),
        (["bench", "--methods", "ar", "--limit", "1", "--repeats", "2", "--temperature", "0.7"], "greedy decoding only"),
        (["--weights", "gguf", "generate", "hi"], "not a .gguf file"),
        (["--backend", "torch", "--weights", "gguf", "generate", "hi"], "numpy-backend engine"),
        (["--no-pipeline", "generate", "hi"], "add --backend torch"),
        (["--backend", "hf", "--no-pipeline", "generate", "hi"], "options of --backend torch"),
        (["--compile", "yes", "generate", "hi"], "add --backend torch"),
        (["--backend", "hf", "--compile", "no", "generate", "hi"], "options of --backend torch"),
    ],
)
def test_bad_values_give_one_line_error(capsys, tiny_model_dir, args, needle):
    code, out, err = run_cli(capsys, "--model", str(tiny_model_dir), *args)
    assert code == 1
    assert err.startswith("lyanna: error:") and needle in err and err.count("\n") == 1


def test_bench_report_shape(capsys, tmp_path, tiny_model_dir):
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [f"question {i}", "second turn"]}
            for i, c in enumerate(["a", "a", "a", "b", "c"])]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out_json = tmp_path / "out.json"
    code, out, err = run_cli(capsys, "--model", str(tiny_model_dir), "bench", "--methods", "hf,hf-pld,ar", "--questions",
                             str(questions), "--limit", "4", "--max-new-tokens", "6", "--json", str(out_json), "--no-progress")
    assert code == 0
    report = json.loads(out_json.read_text())
    assert set(report) >= {"model", "machine", "settings", "results"}
    assert [r["method"] for r in report["results"]] == ["hf", "hf-pld", "ar"]
    hf, pld, ar = report["results"]
    assert pld["equal_to_ar"] == hf["equal_to_ar"]  # prompt lookup is lossless in greedy mode
    # round-robin across categories: a, b, c, a
    assert [q["category"] for q in ar["per_question"]] == ["a", "b", "c", "a"]
    for r in (hf, pld, ar):
        for key in ("new_tokens", "seconds", "tokens_per_s", "decode_tokens_per_s", "speedup", "tau", "waste_ratio",
                    "equal_to_ar", "per_category"):
            assert key in r
        assert set(r["per_category"]) == {"a", "b", "c"}
    assert ar["speedup"] == 1.0 and ar["tau"] == 1.0 and ar["waste_ratio"] is None
    assert ar["first_runs"] == 0  # the numpy engine: no shape compiles inside the clock
    assert hf["tau"] is None
    assert hf["equal_to_ar"] in (True, False)
    assert "| hf |" in out and "| ar |" in out


def test_bench_repeats_keep_each_methods_fastest_run(tmp_path, tiny_decoder, monkeypatch):
    from lyanna.measure.bench import load_questions, run_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q {i}"]}) for i in range(2)))
    # The warm-up run, then three runs of each question: the fastest of each three is kept.
    seconds = iter([9.0, 3.0, 1.0, 2.0, 5.0, 6.0, 4.0])
    generate = tiny_decoder.generate

    def timed(*args, **kwargs):
        result = generate(*args, **kwargs)
        result.seconds = next(seconds)
        return result

    monkeypatch.setattr(tiny_decoder, "generate", timed)
    report = run_bench(tiny_decoder, ["ar"], load_questions(questions), 4, progress=False, repeats=3)
    assert [q["seconds"] for q in report["results"][0]["per_question"]] == [1.0, 4.0]
    assert report["settings"]["repeats"] == 3


def test_bench_reports_rounds_by_draft_size(tmp_path, tiny_decoder):
    """Every round is counted once under the nodes it verified, and its committed tokens are
    the generation's tokens but the first (which the prefill's logits give)."""
    from lyanna.decoding.decoder import GenerationRequest
    from lyanna.measure.bench import load_questions, run_bench

    for method in ("ar", "suffix"):
        r = tiny_decoder.generate([1, 2, 3, 1, 2, 3, 1, 2], GenerationRequest(max_new_tokens=12), method=method)
        cells = r.extra["rounds_by_size"]
        assert sum(c[0] for c in cells.values()) == r.extra["rounds"]
        assert sum(c[1] for c in cells.values()) == len(r.tokens) - 1
        assert all(c[2] > 0 for c in cells.values())
        if method == "ar":
            assert set(cells) == {0}
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q {i}"]}) for i in range(2)))
    report = run_bench(tiny_decoder, ["ar", "suffix"], load_questions(questions), 6, progress=False)
    for row in report["results"]:
        sizes = row["rounds_by_size"]
        assert abs(sum(v["share"] for v in sizes.values()) - 1.0) < 1e-3
        assert sum(v["rounds"] for v in sizes.values()) == row["new_tokens"] - 2  # two prompts
    assert set(report["results"][0]["rounds_by_size"]) == {"0"}


def test_bench_turns_start_at_the_next_method(tmp_path, tiny_decoder, monkeypatch):
    """No method always runs first on a prompt: each turn (a prompt, or a repeat of it) starts
    one method further along."""
    from lyanna.measure.bench import load_questions, run_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q {i}"]}) for i in range(3)))
    order = []
    generate = tiny_decoder.generate

    def recorded(*args, method="ar", **kwargs):
        order.append(method)
        return generate(*args, method=method, **kwargs)

    monkeypatch.setattr(tiny_decoder, "generate", recorded)
    run_bench(tiny_decoder, ["ar", "suffix"], load_questions(questions), 4, progress=False, repeats=2)
    assert order[2:] == ["ar", "suffix", "suffix", "ar"] * 3  # after the warm-up of each method


def test_bench_runs_each_prompt_untimed_first_where_new_shapes_compile(tmp_path, tiny_decoder, monkeypatch):
    """On an engine whose new shapes compile (a GPU's), each of our methods meets a prompt's
    shapes in an untimed run before the timed one; elsewhere every run is timed."""
    from lyanna.measure.bench import load_questions, run_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q {i}"]}) for i in range(3)))
    runs: list[tuple[str, tuple[int, ...]]] = []
    generate = tiny_decoder.generate

    def recorded(ids, *args, method="ar", **kwargs):
        runs.append((method, tuple(ids)))
        return generate(ids, *args, method=method, **kwargs)

    monkeypatch.setattr(tiny_decoder, "generate", recorded)
    for compiles, per_prompt in ((False, 2), (True, 4)):
        runs.clear()
        monkeypatch.setattr(tiny_decoder.engine, "shapes_compile", compiles, raising=False)
        report = run_bench(tiny_decoder, ["ar", "suffix"], load_questions(questions), 4, progress=False)
        assert [len(r["per_question"]) for r in report["results"]] == [3, 3]
        prompts = list(dict.fromkeys(ids for _, ids in runs[2:]))
        assert len(prompts) == 3 and runs[2:] == [r for ids in prompts for r in runs[2:] if r[1] == ids]
        assert all(sum(r[1] == ids for r in runs[2:]) == per_prompt for ids in prompts)
        assert all({m for m, i in runs[2:] if i == ids} == {"ar", "suffix"} for ids in prompts)


def test_bench_time_limit_stops_starting_prompts(tmp_path, tiny_decoder):
    """Past the time limit no new prompt starts, and every method's row covers the same prompts."""
    from lyanna.measure import bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q {i}"]}) for i in range(4)))
    # A limit shorter than the warm-up: the first prompt runs (never an empty report), no other.
    report = bench.run_bench(tiny_decoder, ["ar", "suffix"], bench.load_questions(questions), 4,
                             progress=False, time_limit=1e-6)
    assert report["settings"]["questions"] == 1 and report["settings"]["time_limit"] == 1e-6
    assert [len(r["per_question"]) for r in report["results"]] == [1, 1]
    assert all(r["equal_to_ar"] for r in report["results"])
    assert [q["first_difference"] for r in report["results"] for q in r["per_question"]] == [None, None]


def test_bench_names_the_first_token_where_a_method_left_ar():
    from lyanna.measure.bench import _first_difference

    assert _first_difference([5, 6, 7], [5, 6, 8]) == 2
    assert _first_difference([5, 6], [5, 6]) is None
    assert _first_difference([5, 6], [5, 6, 9]) == 2  # one stopped early (EOS): it differs there


def test_report_pools_load_test_runs_and_compares_with_ar(tmp_path):
    """Runs of one configuration become one row: all their tokens over all their seconds, next
    to ``ar``'s under the same load."""
    machine = {"cpu": "cpu", "cores": 2, "platform": "linux"}
    files = []
    for i, (method, tokens, seconds) in enumerate([("ar", 100, 1.0), ("ar", 100, 3.0), ("suffix", 300, 2.0),
                                                    ("suffix", 100, 2.0)]):
        f = tmp_path / f"{i}.json"
        f.write_text(json.dumps({"command": f"lyanna loadtest --method {method}", "date": f"2026-11-25T23:0{i}:00+00:00",
                                 "machine": machine, "server": {"max_batch": 8}, "method": method, "concurrency": 4,
                                 "succeeded": 8, "failed": i % 2, "completion_tokens": tokens, "wall_seconds": seconds,
                                 "latency_p50_s": 1.0 + i, "latency_p95_s": 2.0, "ttft_p50_s": 0.5, "ttft_p95_s": 1.0,
                                 "tokens_per_s": tokens / seconds}))
        files.append(str(f))
    out = tmp_path / "BENCHMARKS.md"
    assert main(["report", *files, "--out", str(out)]) == 0
    text = out.read_text()
    assert "| ar | 8 | 4 | 2 | 16 / 1 | 50.0 | 1.00x | 1.5 / 2.0 |" in text
    assert "| suffix | 8 | 4 | 2 | 16 / 1 | 100.0 | 2.00x | 3.5 / 2.0 |" in text


def test_report_writes_markdown_and_figures(capsys, tmp_path, tiny_model_dir):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"abcabc {i} abcabc"]})
                                   for i, c in enumerate(["a", "b"])))
    bench_json = tmp_path / "bench.json"
    assert main(["--model", str(tiny_model_dir), "bench", "--methods", "ar,suffix", "--questions", str(questions),
                 "--max-new-tokens", "8", "--json", str(bench_json), "--no-progress"]) == 0
    out = tmp_path / "BENCHMARKS.md"
    assert main(["report", str(bench_json), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| suffix |" in text and "machine:" in text and "date:" in text
    figures = list((tmp_path / "docs" / "figures").glob("*.png"))
    assert any(f.name.endswith("-speedup.png") for f in figures)
    for f in figures:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.name in text


def test_bench_questions_ship_as_declared_package_data():
    """The default questions live in the package, and a wheel carries only declared package data."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    import lyanna
    from lyanna.data import BENCHMARK_FILES
    from lyanna.measure.bench import load_questions

    package = Path(lyanna.__file__).parent
    pyproject = tomllib.loads((package.parents[1] / "pyproject.toml").read_text())
    declared = {f for pattern in pyproject["tool"]["setuptools"]["package-data"]["lyanna"] for f in package.glob(pattern)}
    assert {package / "data" / name for name in BENCHMARK_FILES} <= declared
    questions = load_questions()
    assert len(questions) == 480 and len({q.category for q in questions}) == 13  # Spec-Bench, see data/SOURCES.md
