"""Project each method's speedup on a device from its measured acceptance and the device's latency.

Speculative decoding's speedup is tokens per round (tau) times the cost of one plain step over the
cost of a round (draft time + the target's latency for the verified block). tau and draft time
depend on the drafter and the text, not on the target's device, so they come from a bench run
with fixed budgets (any machine); the latency curve is measured here, on ``--device``, with the
torch backend (``--backend torch``, our static-cache forward; ``hf`` for the Hugging Face model) on
blocks of 1 to 128 tokens after 256 of context.

    python scripts/project-speedup.py --bench docs/bench/budgets.json --device cuda --dtype bfloat16 \
        --out docs/bench/projected-cuda.json

With the torch backend it also writes ``pass_ms``: the fixed-shape pass's own time by its padded
row count (between synchronizations on CUDA: device time), so that a block's latency splits into
the pass and the host's work around it. Without ``--bench`` it only measures and writes these curves. The drafters run on the host
here (numpy), so a projection keeps the bench's draft time per round: on a GPU that is the
part a device-side drafter would cut.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time

import numpy as np

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def kernels_per_pass(engine, sizes: tuple[int, ...] = (1, 16), keys: int = 256) -> tuple[dict[int, int], dict]:
    """The device kernels one pass of the target's layers and LM head launches, eagerly (a CUDA
    graph replays the same kernels), by row count: what sets a small model's step time on a GPU;
    and how many of each kernel (by name, cut to 120 characters, most frequent first): which
    parts of a layer a fusion would still pay on."""
    from collections import Counter

    import torch
    from torch.autograd import DeviceType

    cache = engine.new_cache(2 * keys)
    dev, counts, names = engine.device, {}, {}
    with torch.inference_mode():
        for rows in sizes:
            args = (cache.slab, torch.zeros(rows, dtype=torch.int64, device=dev), torch.arange(rows, device=dev),
                    torch.arange(rows, device=dev), torch.ones((rows, keys), dtype=torch.bool, device=dev), keys, (), None)
            engine._layers_pass(*args)  # compiles, on first use
            torch.cuda.synchronize(dev)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine._layers_pass(*args)
                torch.cuda.synchronize(dev)
            kernels = [e.name[:120] for e in prof.events() if e.device_type == DeviceType.CUDA]
            counts[rows], names[rows] = len(kernels), dict(Counter(kernels).most_common())
    return counts, names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--backend", default="torch", choices=("torch", "hf"),
                    help="torch: our forward with a static KV cache (default); hf: the Hugging Face model")
    ap.add_argument("--bench", default=None, help="a `lyanna bench --json` report with METHOD@N rows (fixed budgets)")
    ap.add_argument("--compile", choices=("auto", "yes", "no", "whole"), default="auto",
                    help="torch backend: the layers' glue through torch.compile (as `lyanna --compile`)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from lyanna.decoding.budget import calibrate
    from lyanna.engines.device import load_device_target
    from lyanna.engines.torch_engine import load_torch_target

    if args.backend == "torch":
        target, engine = load_device_target(args.model, args.device, args.dtype,
                                            compiled={"auto": None, "yes": True, "no": False, "whole": True}[args.compile],
                                            whole_layers=args.compile == "whole")
    else:
        target, engine = load_torch_target(args.model, args.device, args.dtype)
    passes: dict[int, list[float]] = {}
    calls = [0]
    if args.backend == "torch":  # time each fixed-shape pass alone, by its padded row count
        from lyanna.engines import device as device_module

        run_fixed = device_module.FixedShapeCall.run_fixed
        cuda = engine.device.type == "cuda"

        def timed(call, *args) -> None:
            if cuda:
                torch.cuda.synchronize(engine.device)
            t0 = time.perf_counter()
            run_fixed(call, *args)
            if cuda:
                torch.cuda.synchronize(engine.device)
            calls[0] += 1
            if calls[0] > len(SIZES):  # past calibrate's warm-up sweep (which captures the graphs)
                passes.setdefault(call.rows, []).append(time.perf_counter() - t0)

        device_module.FixedShapeCall.run_fixed = timed
    curve = calibrate(engine, target.name, sizes=SIZES, context=256, repeats=7)
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else curve.machine
    report = {
        "command": "python scripts/project-speedup.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device, "engine": engine.name, "torch": torch.__version__,
        "latency_ms": {n: round(t * 1e3, 3) for n, t in zip(curve.sizes, curve.seconds)},
        "pass_ms": {n: round(float(np.median(t)) * 1e3, 3) for n, t in sorted(passes.items())},
        "compiled": bool(getattr(getattr(engine, "halves", None), "compiled", False)),
        "whole_layers": getattr(getattr(engine, "halves", None), "whole", None) is not None,
        "kernels_per_pass": None,
        "projected": [],
    }
    if args.backend == "torch" and engine.device.type == "cuda":
        report["kernels_per_pass"], report["kernels_by_name"] = kernels_per_pass(engine)
    step = curve(1)
    if args.bench:
        bench = json.loads(open(args.bench).read())
        report["bench"] = {"file": args.bench, "command": bench["settings"].get("command"), "date": bench["settings"].get("date")}
        for row in bench["results"]:
            m = re.fullmatch(r"(.+)@(\d+)", row["method"])
            if not m or not row.get("tau"):
                continue
            budget = int(m.group(2))
            rounds = row["new_tokens"] / row["tau"]
            draft = row["time_split"]["draft"] / 100 * (row["seconds"] - row["prefill_seconds"]) / rounds
            verify = float(curve(budget + 1))
            report["projected"].append({
                "method": row["method"], "tau": row["tau"], "budget": budget,
                "draft_ms_per_round": round(draft * 1e3, 3), "verify_ms": round(verify * 1e3, 3),
                "speedup": round(row["tau"] * step / (draft + verify), 3),
                "speedup_free_drafts": round(row["tau"] * step / verify, 3),  # the bound as draft time goes to 0
            })
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
