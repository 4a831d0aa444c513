"""Count the torch operations a decoding round issues on the device path, inside and outside the
fixed-shape calls (the target's pass, Lyanna's draft: each replayed as one CUDA graph on a GPU),
and time where a round's time goes.

On a GPU every operation outside a captured graph is a kernel launch of its own (a few
microseconds each, plus Python), so this count says how far a round is from "one launch and one
small copy": what `--backend torch` still does eagerly. Runs on any device (CPU torch counts the
same operations); prefill is left out by subtracting a one-token generation. Rounds are counted
read one by one and again launched ahead of the host's reading (``*_launched_ahead``:
``DeviceEngine.pipelines``, the default on CUDA, where the pass also verifies and hands over).
The timing pass
(without the profiler) gives, per round, the milliseconds inside each kind of fixed-shape call
(the target's pass by its row bucket: ``_StaticPass[16]``, or ``_TreeBlockPass[16]`` for a tree
the drafter left on the device, ``JoinedCall[16]`` for such a pass run with its round's draft
call as one; on CUDA synchronized before and after, so a call's time is its device time) and
outside them (the host's own work: the gap a GPU waits through, unless the round is launched
ahead of it). Two plain runs give a round's time end to end, with rounds launched
ahead of the host's reading and read one by one (``DeviceEngine.pipelines``). For ``lyanna``
methods, one more run splits the draft call (``_DraftTreesPass``, run eagerly: a graph's replay
hides its kernels) into its phases, per call: the head's layers and raw logits, the trees'
growth (``grow``), the choice of nodes (``best``), the union and the packing, each with its
operations and, on CUDA, its kernels and their device milliseconds (``draft_call_phases``): where
fusing would pay.

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
    # Each kind of call's runs, and of those how many replayed a captured CUDA graph (a call whose
    # capture failed runs eagerly, each of its operations launched from the host).
    runs: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def sync() -> None:
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    def marked(self, timed: bool = False) -> None:
        target_pass = self.then if isinstance(self, device.JoinedCall) else self  # a joined call: its pass's rows
        rows = f"[{target_pass.rows}]" if isinstance(target_pass, (device._StaticPass, device._TreeBlockPass)) else ""
        name = type(self).__name__ + rows
        replay = self.graph is not None
        runs[name][0] += 1
        runs[name][1] += replay
        if not timing["on"]:
            with record_function(MARK):
                run_fixed(self, timed)
            return
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

    default_pipelines = engine.pipelines

    def count(method: str, budget, tokens: int, ahead: bool) -> tuple[int, int, int, int]:
        """(operations outside the fixed-shape calls, inside them, the calls, rounds) of one
        generation, its rounds launched ahead of the host's reading or read one by one."""
        engine.pipelines = ahead
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                r = decoder.generate(ids, GenerationRequest(max_new_tokens=tokens), method=method, budget=budget)
        finally:
            engine.pipelines = default_pipelines
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
        engine.pipelines = default_pipelines
        return out

    def phases(method: str, budget) -> dict:
        """Lyanna's draft call split by phase, per call (operations; on CUDA kernels and device
        ms too), from one generation with the calls run eagerly."""
        from lyanna.drafters import device_calls as heads  # where the draft calls look these up

        if engine._graph_pool is None:
            eager = decoder
        else:  # the same model and heads without graphs (their replays show no kernels)
            t, e = device.load_device_target(args.model, args.device, args.dtype, graphs=False)
            eager = Decoder(t, engine=e)
        wrapped = {name: getattr(heads, name) for name in ("_grow", "best", "union", "packed")}
        call = heads._DraftTreesPass._forward

        def labelled(name, f):
            def g(*a, **k):
                with record_function("phase:" + name.strip("_")):
                    return f(*a, **k)
            return g

        for name, f in wrapped.items():
            setattr(heads, name, labelled(name, f))
        heads._DraftTreesPass._forward = labelled("draft-call", call)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(args.device).type == "cuda" else [])
        try:
            eager.generate(ids, GenerationRequest(max_new_tokens=8), method=method, budget=budget)  # warm-up
            with profile(activities=activities) as prof:
                eager.generate(ids, GenerationRequest(max_new_tokens=args.max_new_tokens), method=method, budget=budget)
        finally:
            for name, f in wrapped.items():
                setattr(heads, name, f)
            heads._DraftTreesPass._forward = call
        calls = sum(e.name == "phase:draft-call" for e in prof.events())
        cuda = ProfilerActivity.CUDA in activities
        totals: dict[str, dict[str, float]] = defaultdict(lambda: {"ops": 0, **({"kernels": 0, "device_ms": 0.0} if cuda else {})})

        def kernels_of(e) -> list:
            return list(getattr(e, "kernels", [])) + [k for c in e.cpu_children for k in kernels_of(c)]
        for e in prof.events():
            parent = e.cpu_parent
            if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
                continue
            label = None
            while parent is not None and label is None:
                label = parent.name[len("phase:"):] if parent.name.startswith("phase:") else None
                parent = parent.cpu_parent
            if label is None:
                continue  # outside the draft call
            phase = totals["layers" if label == "draft-call" else label]
            phase["ops"] += e.name not in VIEWS
            if cuda:
                kernels = kernels_of(e)
                phase["kernels"] += len(kernels)
                phase["device_ms"] += sum(k.duration for k in kernels) / 1000
        return {"draft_calls": calls, "draft_call_phases": {
            name: {k: round(v / max(calls, 1), 3 if k == "device_ms" else 1) for k, v in t.items()}
            for name, t in sorted(totals.items())}}

    rows = []
    for spec in args.methods.split(","):
        method, budget = split_budget(spec, "auto")
        counted = {}
        for ahead, suffix in ((False, ""), (True, "_launched_ahead")):
            count(method, budget, 4, ahead)  # warm-up
            o1, i1, c1, r1 = count(method, budget, 1, ahead)
            o, i, c, r = count(method, budget, args.max_new_tokens, ahead)
            rounds = max(1, r - r1)
            counted |= {"rounds" + suffix: rounds, "ops_outside_per_round" + suffix: round((o - o1) / rounds, 1),
                        "ops_inside_per_round" + suffix: round((i - i1) / rounds, 1),
                        "fixed_shape_calls_per_round" + suffix: round((c - c1) / rounds, 2)}
        rows.append({"method": spec, **counted, **timed(method, budget),
                     **wall(method, budget), **(phases(method, budget) if method.startswith("lyanna") else {})})
        print(f"{spec}: {rows[-1]['ops_outside_per_round']} operations a round outside the fixed-shape calls, "
              f"{rows[-1]['ops_inside_per_round']} inside {rows[-1]['fixed_shape_calls_per_round']} calls "
              f"({rows[-1]['rounds']} rounds; launched ahead {rows[-1]['ops_outside_per_round_launched_ahead']} and "
              f"{rows[-1]['ops_inside_per_round_launched_ahead']}); "
              f"ms a round inside {rows[-1]['ms_per_round_inside']}, outside {rows[-1]['ms_per_round_outside']}; "
              f"end to end {rows[-1]['ms_per_round_wall']} (read one by one {rows[-1]['ms_per_round_wall_read_one_by_one']})")
        if "draft_call_phases" in rows[-1]:
            print(f"{spec}: the draft call by phase, per call ({rows[-1]['draft_calls']} calls): {rows[-1]['draft_call_phases']}")
    report = {"model": args.model, "engine": engine.name, **script_record("count-device-ops.py", vars(args)),
              "rows": rows, "graph_replays": {name: {"runs": n, "replayed": r} for name, (n, r) in sorted(runs.items())}}
    print("runs of each call, and of those replays of a captured graph:",
          {name: f"{r}/{n}" for name, (n, r) in sorted(runs.items())})
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
