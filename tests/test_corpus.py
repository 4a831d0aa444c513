"""Conversation corpora: robust record parsing, templating with assistant spans, the corpus data
stage end to end, packed batches, and the fit's schedule."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from lyanna.data import SPEC_BENCH, packaged
from lyanna.engines.loading import load_tokenizer
from lyanna.errors import LyannaError
from lyanna.train import main as train_main
from lyanna.training import features, fit_stage
from lyanna.training.corpus import (
    Skip,
    encode_conversation,
    iter_records,
    messages_of,
    read_corpus,
    reply_mask,
)
from lyanna.training.fit import Example, batch_loss, init_lyanna_head, make_batch, pack
from lyanna.training.run import iter_data, load_examples

CONVS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello you"},
                                   {"from": "human", "value": "and again"}, {"from": "gpt", "value": "bye now"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "leading reply is dropped"},
                                   {"from": "human", "value": "question"}, {"from": "gpt", "value": "answer"}]},
    {"id": "c", "conversations": []},  # no turns
    {"id": "d", "conversations": [{"from": "human", "value": "only a question"}]},
    {"id": "e", "conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
    {"id": "f", "messages": [{"role": "developer", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "work"}]},
                             {"role": "assistant", "content": "yes"}]},
]


def write_truncated_array(path, records) -> None:
    text = json.dumps(records, indent=1).rstrip()[:-1]  # the array's closing bracket never came
    path.write_text(text + ",\n {\"id\": \"cut\", \"conversations\": [{\"from\": \"hum")  # cut mid-record, no closing ]


def test_records_parse_one_at_a_time_and_a_truncated_tail_is_skipped(tmp_path):
    f = tmp_path / "sharegpt.json"
    write_truncated_array(f, CONVS)
    got = list(iter_records(f))
    assert [r["id"] for _, r in got[:-1]] == [c["id"] for c in CONVS]
    assert isinstance(got[-1][1], Skip) and "truncated" in str(got[-1][1])
    jl = tmp_path / "msgs.jsonl"
    jl.write_text(json.dumps(CONVS[5]) + "\nnot json\n" + json.dumps(CONVS[0]) + "\n")
    kinds = [type(r).__name__ for _, r in iter_records(jl)]
    assert kinds == ["dict", "Skip", "dict"]


def test_messages_are_normalized_or_skipped_with_a_reason():
    assert [m["role"] for m in messages_of(CONVS[0])] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages_of(CONVS[1])] == ["question", "answer"]
    assert messages_of(CONVS[5]) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "parts work"},
                                     {"role": "assistant", "content": "yes"}]
    for rec, reason in [(CONVS[2], "no conversations"), (CONVS[3], "no assistant turn"), (CONVS[4], "unknown role"),
                        ("text", "not an object")]:
        with pytest.raises(Skip, match=reason):
            messages_of(rec)


def test_assistant_spans_cover_exactly_the_replies_up_to_their_eos(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids, spans = encode_conversation(tok, messages_of(CONVS[0]), max_tokens=10_000)
    assert [tok.decode(ids[a:b]) for a, b in spans] == ["hello you<|im_end|>", "bye now<|im_end|>"]
    assert ids == tok(tok.apply_chat_template(messages_of(CONVS[0]), tokenize=False), add_special_tokens=False)["input_ids"]
    cut, cut_spans = encode_conversation(tok, messages_of(CONVS[0]), max_tokens=spans[0][0] + 3)
    assert len(cut) == spans[0][0] + 3 and cut_spans == [[spans[0][0], spans[0][0] + 3]]
    with pytest.raises(Skip, match="length cut"):
        encode_conversation(tok, messages_of(CONVS[0]), max_tokens=spans[0][0])
    ids_m, mask = reply_mask({"ids": ids, "reply": spans})
    assert tok.decode(ids_m[mask]) == "hello you<|im_end|>bye now<|im_end|>"


def test_corpus_order_is_seeded_limits_hold_and_benchmark_questions_are_dropped(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    bench_q = json.loads(packaged(SPEC_BENCH).read_text(encoding="utf-8").split("\n")[0])["turns"][0]
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                  {"from": "gpt", "value": f"answer number {i}"}]} for i in range(30)]
    records.append({"id": "bench", "conversations": [{"from": "human", "value": "  " + bench_q.upper()},
                                                      {"from": "gpt", "value": "x"}]})
    f = tmp_path / "c.json"
    f.write_text(json.dumps(records))
    from lyanna.training.data import benchmark_prompts

    rows, skipped = read_corpus(f, tok, benchmark_prompts(), 512, seed=3)
    assert len(rows) == 30 and skipped == {"benchmark question": 1}
    again, _ = read_corpus(f, tok, benchmark_prompts(), 512, seed=3)
    other, _ = read_corpus(f, tok, benchmark_prompts(), 512, seed=4)
    assert [r["id"] for r in again] == [r["id"] for r in rows] != [r["id"] for r in other]
    few, _ = read_corpus(f, tok, set(), 512, seed=3, reply_tokens=40)
    assert 40 <= sum(b - a for r in few for a, b in r["reply"]) < 40 + max(b - a for r in rows for a, b in r["reply"])


def test_corpus_stage_features_and_fit_end_to_end(tmp_path, tiny_model_dir):
    """data --source FILE -> features (engine) -> fit judged on another run -> a stale shard is redone."""
    os.environ["LYANNA_NO_PROGRESS"] = "1"
    f = tmp_path / "c.json"
    write_truncated_array(f, CONVS)
    run = tmp_path / "run"
    assert train_main(["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--source", str(f)]) == 0
    report = json.loads((run / "data" / "report.json").read_text())
    assert report["conversations"] == 3 and sum(report["skipped"].values()) == 4
    assert train_main(["features", "--run-dir", str(run)]) == 0
    examples = load_examples(run)
    assert len(examples) == 3 and all(ex.mask.any() and not ex.mask.all() for _, ex in examples)
    assert train_main(["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(f)]) == 1  # other source
    state = fit_stage.stage_fit(run, "lyanna", steps=4, batch=2, lr=1e-3, depth=2, rank=4, draft_vocab=50, eval_every=4,
                               row_len=64, warmup=2, eval_run=run)
    assert state["step"] == 4 and state["train_reply_tokens"] > 0 and len(state["history"][-1]["agreement"]) == 2
    # the data grows (one more conversation in the same shard): its features shard is stale and redone
    rows = list(iter_data(run))
    extra = {"id": "new#9", "ids": rows[0]["ids"], "reply": rows[0]["reply"]}
    (run / "data" / "shard-00000.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [extra]) + "\n")
    features.stage_features(run)
    assert len(load_examples(run)) == 4


def test_packed_rows_equal_single_sequence_unrolls(tiny_decoder, tiny_examples):
    """Several sequences in one row (and a padded row) give each sequence exactly its own chain."""
    engine = tiny_decoder.engine
    head = init_lyanna_head(engine, tiny_decoder.target.weights, np.arange(259), rank=4)
    exs = [Example(e.tokens[:n], e.features[:n]) for e, n in zip(tiny_examples, (20, 17, 25))]
    rows = [[0, 1], [2]]
    batch = make_batch(exs, rows, row_len=40)
    assert batch.tokens.shape == (2, 37) and int((batch.segments[1] < 0).sum()) == 12
    with torch.no_grad():
        packed = head.unroll_batch(batch.features, batch.tokens, batch.segments, 3)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n = len(exs[i].tokens)
                alone = head.unroll(torch.from_numpy(exs[i].features), torch.from_numpy(exs[i].tokens), 3)
                for k in range(3):  # rows whose chain stays inside the sequence
                    m = n - 1 - k
                    torch.testing.assert_close(packed[k][r, at:at + m], alone[k][:m], atol=1e-5, rtol=1e-5)
                at += n
        # the loss of the packed batch is the loss over the same scored rows one sequence at a time
        per_seq = [batch_loss(head, make_batch(exs, [[i]], 40), 3) for i in range(3)]
    assert all(torch.isfinite(x) for x in per_seq)
    assert pack(exs, 40) == [[0, 1], [2]]


def test_masking_tokens_outside_the_draft_vocabulary_is_masking_their_positions(tiny_decoder, tiny_examples):
    """`fit --outside-vocab mask` (EAGLE-3): the loss with the draft vocabulary's tokens scored
    alone is the loss of the same batch whose assistant mask leaves out every position whose
    token lies outside it; fewer rows are scored, and the loss differs from scoring them all.
    A head that drafts any token (eagle) scores every one."""
    from dataclasses import replace

    from lyanna.training.fit import drafted_tokens, init_eagle_head, scored_counts

    engine = tiny_decoder.engine
    d2t = np.arange(0, engine.config.vocab_size, 2)  # every other token
    head = init_lyanna_head(engine, tiny_decoder.target.weights, d2t, rank=4)
    with torch.no_grad():
        head.ti.b.normal_(0, 0.3)  # a token-info table that matters
    batch = make_batch(list(tiny_examples), [[0, 1], [2, 3]], 160)
    drafted = drafted_tokens(head, True)
    assert drafted.sum() == len(d2t) and drafted_tokens(head, False) is None
    assert drafted_tokens(init_eagle_head(engine, tiny_decoder.target.weights), True) is None
    masked = replace(batch, mask=batch.mask & drafted[batch.tokens])
    every, some = scored_counts(batch, 3), scored_counts(batch, 3, drafted)
    assert some == scored_counts(masked, 3) and all(0 < a < b for a, b in zip(some, every))
    with torch.no_grad():
        got, want, unmasked = (batch_loss(head, batch, 3, drafted=drafted), batch_loss(head, masked, 3),
                               batch_loss(head, batch, 3))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(float(got - unmasked)) > 1e-3


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    lrs = [fit_stage.lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=0.01)
    with pytest.raises(LyannaError, match="labels"):
        fit_stage.stage_fit(None, "lyanna", steps=1, labels="medium")  # refused before anything is read


def test_prompts_stage_takes_each_conversations_first_user_turn(tmp_path, tiny_model_dir, capsys):
    """`train prompts`: the first user turn of every usable conversation, once whatever its
    spacing and case, benchmark questions and overlong turns left out, ids tagged with the
    source; `train data --prompts` answers them."""
    bench_q = json.loads(packaged(SPEC_BENCH).read_text(encoding="utf-8").split("\n")[0])["turns"][0]
    extra = [{"id": "g", "conversations": [{"from": "human", "value": "  HI   there "}, {"from": "gpt", "value": "again"}]},
             {"id": "h", "conversations": [{"from": "human", "value": bench_q}, {"from": "gpt", "value": "no"}]},
             {"id": "i", "conversations": [{"from": "human", "value": "x" * 50}, {"from": "gpt", "value": "long"}]}]
    corpus = tmp_path / "chats.json"
    corpus.write_text(json.dumps(CONVS + extra))
    out = tmp_path / "made" / "prompts.jsonl"
    assert train_main(["prompts", "--source", str(corpus), "--out", str(out), "--max-chars", "40"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"id": "chats:a#0", "prompt": "hi there"}, {"id": "chats:b#1", "prompt": "question"},
                    {"id": "chats:f#5", "prompt": "parts work"}]
    printed = capsys.readouterr().out
    assert "wrote 3" in printed and "1 benchmark question" in printed and "1 a repeated prompt" in printed
    assert "1 longer than --max-chars" in printed
    os.environ["LYANNA_NO_PROGRESS"] = "1"
    run = tmp_path / "run"
    assert train_main(["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(out),
                       "--max-new-tokens", "4"]) == 0
    assert sorted(r["id"] for r in iter_data(run)) == sorted(r["id"] for r in rows)
    bad = tmp_path / "empty.json"
    bad.write_text(json.dumps(CONVS[2:5]))
    assert train_main(["prompts", "--source", str(bad), "--out", str(tmp_path / "x.jsonl")]) == 1
    assert "no usable first user turn" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    assert train_main(["prompts", "--source", str(tmp_path / "missing.json"), "--out", str(out)]) == 1
    twice = tmp_path / "twice.jsonl"  # a prompts file concatenated with itself: its ids meet again
    twice.write_text(out.read_text() * 2)
    assert train_main(["data", "--run-dir", str(tmp_path / "run2"), "--model", str(tiny_model_dir), "--prompts", str(twice)]) == 1
    assert "twice.jsonl:4: id 'chats:a#0' is also the id of line 1" in capsys.readouterr().err
