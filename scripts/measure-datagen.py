"""How fast the device engine writes training replies: greedy replies of many sequences at once on
one batched cache (``engines.device_batch``, what `lyanna train data --device` runs), in reply
tokens a second, for several row counts.

The prompts are the packaged Spec-Bench questions in the target's chat template: they are here
only to be answered and timed (no reply is kept, and nothing trains on them). Each row count runs
its prompts once untimed (compiles, CUDA graph captures), then timed: the whole of it, prefills
and refills included, as a data run pays them.

    python scripts/measure-datagen.py --device cuda --dtype bfloat16 --rows 64,256,512 --out datagen.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="8,32", help="row counts, comma-separated")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per row: each row is refilled this many times over")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from lyanna.decoding.decoder import Decoder
    from lyanna.engines.device import load_device_target
    from lyanna.engines.device_batch import BatchedGreedy
    from lyanna.measure.bench import load_questions, script_record

    target, engine = load_device_target(args.model, args.device, args.dtype)
    decoder = Decoder(target, default_drafts=False, engine=engine)
    questions = [decoder.encode(q.prompt)[: args.max_prompt_tokens] for q in load_questions()]
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = [questions[i % len(questions)] for i in range(rows * args.prompts)]
        gen = BatchedGreedy.for_prompts(engine, prompts, args.max_new_tokens, rows)
        for timed in (False, True):
            began = time.perf_counter()
            tokens = sum(len(r) for _, r in gen.replies(prompts, args.max_new_tokens, decoder.eos_token_ids))
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
        results.append({"rows": rows, "prompts": len(prompts), "reply_tokens": tokens, "seconds": round(seconds, 6),
                        "reply_tokens_per_s": round(tokens / seconds, 1)})
        print(json.dumps(results[-1]), flush=True)
        del gen
    record = {**script_record("measure-datagen.py", vars(args)), "device": engine.name, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
