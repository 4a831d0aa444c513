"""Count the torch operations a decoding round issues on the device path, inside and outside the
fixed-shape calls (the target's pass, Lyanna's draft: each replayed as one CUDA graph on a GPU),
and time where a round's time goes.

On a GPU every operation outside a captured graph is a kernel launch of its own (a few
microseconds each, plus Python), so this count says how far a round is from "one launch and one
small copy": what `--backend torch` still does eagerly. Runs on any device (CPU torch counts the
same operations); prefill is left out by subtracting a one-token generation. The timing pass
(without the profiler) gives, per round, the milliseconds inside each kind of fixed-shape call
(the target's pass by its row bucket: ``_StaticPass[16]``, or ``_TreeBlockPass[16]`` for a tree
the drafter left on the device; on CUDA synchronized before and after, so a call's time is its
device time) and outside them (the host's own work: the gap a GPU waits through, unless the round
is launched ahead of it). Two plain runs give a round's time end to end, with rounds launched
ahead of the host's reading and read one by one (``DeviceEngine.pipelines``).

    python scripts/count-device-ops.py --out docs/bench/device-ops.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# Operations that only make views or metadata: no kernel on a GPU.
VIEWS = {"aten::view", "aten::slice", "aten::t", "aten::transpose", "aten::reshape", "aten::expand",
         "aten::unsqueeze", "aten::select", "aten::as_strided", "aten::detach", "aten::alias",
         "aten::_reshape_alias", "aten::squeeze", "aten::permute", "aten::numpy_T", "aten::lift_fresh",
         "aten::detach_", "aten::empty", "aten::resolve_conj", "aten::resolve_neg"}
MARK = "lyanna-fixed-shape-call"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", default="ar,suffix,eagle@16,lyanna@16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile, record_function

    from lyanna.decoding.decoder import Decoder, GenerationRequest
    from lyanna.engines import device
    from lyanna.measure.bench import load_questions, script_record, split_budget

    import time
    from collections import defaultdict

    import torch

    run_fixed = device.FixedShapeCall.run_fixed
    timing = {"on": False, "seconds": defaultdict(float)}

    def sync() -> None:
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    def marked(self, timed: bool = False) -> None:
        if not timing["on"]:
            with record_function(MARK):
                run_fixed(self, timed)
            return
        name = type(self).__name__ + (f"[{self.rows}]" if isinstance(self, (device._StaticPass, device._TreeBlockPass)) else "")
        sync()
        start = time.perf_counter()
        run_fixed(self, timed)
        sync()
        timing["seconds"][name] += time.perf_counter() - start

    device.FixedShapeCall.run_fixed = marked
    target, engine = device.load_device_target(args.model, args.device, args.dtype)
    decoder = Decoder(target, engine=engine)
    decoder.latency_curve()  # calibrated (or read) now: on a fresh machine it would be counted in the first method's rounds
    ids = decoder.encode(load_questions(limit=3)[2].prompt)

    def count(method: str, budget, tokens: int) -> tuple[int, int, int, int]:
        """(operations outside the fixed-shape calls, inside them, the calls, rounds) of one generation."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = decoder.generate(ids, GenerationRequest(max_new_tokens=tokens), method=method, budget=budget)
        outside = inside = 0
        calls = sum(e.name == MARK for e in prof.events())
        for e in prof.events():
            parent = e.cpu_parent
            if not e.name.startswith("aten::") or e.name in VIEWS or (parent is not None and parent.name.startswith("aten::")):
                continue
            while parent is not None and parent.name != MARK:
                parent = parent.cpu_parent
            inside, outside = (inside + 1, outside) if parent is not None else (inside, outside + 1)
        return outside, inside, calls, r.extra["rounds"]

    def timed(method: str, budget) -> dict:
        """Milliseconds a round inside each kind of fixed-shape call and outside them (decoding
        only: the generation's time less its prefill), over a longer generation."""
        timing["seconds"].clear()
        timing["on"] = True
        sync()
        r = decoder.generate(ids, GenerationRequest(max_new_tokens=args.max_new_tokens * 2), method=method, budget=budget)
        timing["on"] = False
        rounds, inside = r.extra["rounds"], sum(timing["seconds"].values())
        ms = {name: round(1000 * s / rounds, 3) for name, s in sorted(timing["seconds"].items())}
        return {"timed_rounds": rounds, "tokens_per_round": round(r.new_tokens / rounds, 3), "ms_per_round_inside": ms,
                "ms_per_round_outside": round(1000 * (r.seconds - r.prefill_seconds - inside) / rounds, 3)}

    def wall(method: str, budget) -> dict:
        """Milliseconds a round end to end (nothing synchronized, no profiler), with rounds
        launched ahead of the host's reading (the engine's default) and read one by one."""
        out = {}
        for ahead, key in ((True, "ms_per_round_wall"), (False, "ms_per_round_wall_read_one_by_one")):
            engine.pipelines = ahead
            r = decoder.generate(ids, GenerationRequest(max_new_tokens=args.max_new_tokens * 2), method=method, budget=budget)
            out[key] = round(1000 * (r.seconds - r.prefill_seconds) / r.extra["rounds"], 3)
        engine.pipelines = True
        return out

    rows = []
    for spec in args.methods.split(","):
        method, budget = split_budget(spec, "auto")
        count(method, budget, 4)  # warm-up
        o1, i1, c1, r1 = count(method, budget, 1)
        o, i, c, r = count(method, budget, args.max_new_tokens)
        rounds = max(1, r - r1)
        rows.append({"method": spec, "rounds": rounds, "ops_outside_per_round": round((o - o1) / rounds, 1),
                     "ops_inside_per_round": round((i - i1) / rounds, 1),
                     "fixed_shape_calls_per_round": round((c - c1) / rounds, 2), **timed(method, budget),
                     **wall(method, budget)})
        print(f"{spec}: {rows[-1]['ops_outside_per_round']} operations a round outside the fixed-shape calls, "
              f"{rows[-1]['ops_inside_per_round']} inside {rows[-1]['fixed_shape_calls_per_round']} calls ({rounds} rounds); "
              f"ms a round inside {rows[-1]['ms_per_round_inside']}, outside {rows[-1]['ms_per_round_outside']}; "
              f"end to end {rows[-1]['ms_per_round_wall']} (read one by one {rows[-1]['ms_per_round_wall_read_one_by_one']})")
    report = {"model": args.model, "engine": engine.name, **script_record("count-device-ops.py", vars(args)),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
