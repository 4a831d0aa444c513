"""``python -m lyanna.train STAGE`` (also ``lyanna train STAGE``): the draft training pipeline.

Stages: data, features, select, fit, export. ``fit`` runs data-parallel under
``torchrun --nproc_per_node=N -m lyanna.train fit ...``.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

from .errors import LyannaError
from .loading import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lyanna train", description="Train draft heads (resumable stages).")
    sub = p.add_subparsers(dest="stage", required=True)

    d = sub.add_parser("data", help="self-distillation: the target answers training prompts")
    d.add_argument("--run-dir", required=True, type=Path)
    d.add_argument("--model", default=DEFAULT_MODEL)
    d.add_argument("--prompts", type=Path, required=True,
                   help="JSONL, one object with 'prompt' per line (training prompts do not ship with the package)")
    d.add_argument("--limit", type=int, default=None, help="number of prompts")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--max-prompt-tokens", type=int, default=256)
    d.add_argument("--seed", type=int, default=0)

    f = sub.add_parser("features", help="target hidden states of every example (fp16 shards)")
    f.add_argument("--run-dir", required=True, type=Path)

    s = sub.add_parser("select", help="flatness-based (or random) selection of examples")
    s.add_argument("--run-dir", required=True, type=Path)
    s.add_argument("--mode", default="flat", choices=["flat", "random", "all"])
    s.add_argument("--keep", type=float, default=0.5)
    s.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("fit", help="train a head (data-parallel under torchrun)")
    t.add_argument("--run-dir", required=True, type=Path)
    t.add_argument("--arch", default="lyanna", choices=["lyanna", "eagle"])
    t.add_argument("--steps", type=int, default=500)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--depth", type=int, default=4, help="unrolled chain steps")
    t.add_argument("--rank", type=int, default=32, help="token-info rank (lyanna)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (lyanna); eagle: the vocabulary of its classification loss")
    t.add_argument("--selection", default=None, help="a file name under RUN/select/ (default: all examples)")
    t.add_argument("--name", default=None, help="name of this fit under RUN/fit/ (default: the arch)")
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)

    e = sub.add_parser("export", help="write the draft checkpoint and model card")
    e.add_argument("--run-dir", required=True, type=Path)
    e.add_argument("--arch", default="lyanna", choices=["lyanna", "eagle"])
    e.add_argument("--name", default=None)
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--hot", type=int, default=2048, help="materialized token-info rows (lyanna)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .training import pipeline

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.stage == "data":
            pipeline.stage_data(args.run_dir, args.model, args.prompts, args.limit, args.max_new_tokens,
                                args.max_prompt_tokens, args.seed)
        elif args.stage == "features":
            pipeline.stage_features(args.run_dir)
        elif args.stage == "select":
            pipeline.stage_select(args.run_dir, args.mode, args.keep, args.seed)
        elif args.stage == "fit":
            pipeline.stage_fit(args.run_dir, args.arch, args.steps, args.batch, args.lr, args.depth, args.rank,
                               args.draft_vocab, args.selection, args.seed, args.eval_every, name=args.name)
        else:
            pipeline.stage_export(args.run_dir, args.arch, args.out, args.name, args.hot,
                                  command="lyanna train " + shlex.join(argv))
    except LyannaError as e:
        print(f"lyanna train: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
