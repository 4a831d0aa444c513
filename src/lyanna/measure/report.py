"""``lyanna report``: bench JSON -> BENCHMARKS.md with matplotlib figures."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import LyannaError
from .bench import format_table, health
from .llamacpp_baseline import INSTALL as LLAMACPP_INSTALL
from .llamacpp_baseline import LOOKUP_TOKENS


def _figures(report: dict[str, Any], fig_dir: Path, stem: str) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig_dir.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    out: list[tuple[str, Path]] = []

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        path = fig_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append((caption, path))

    cats = list(results[0]["per_category"])
    methods = [r for r in results if r["speedup"] is not None]
    if methods and cats:
        fig, ax = plt.subplots(figsize=(max(6, len(cats) * 0.9), 3.6))
        width = 0.8 / len(methods)
        for i, r in enumerate(methods):
            vals = [r["per_category"][c]["speedup"] or 0 for c in cats]
            ax.bar(np.arange(len(cats)) + i * width, vals, width, label=r["method"])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats, rotation=30, ha="right")
        ax.set_ylabel("speedup vs ar")
        ax.legend(fontsize=8, ncol=min(4, len(methods)))
        save(fig, "speedup", "Speedup over `ar` per category")

    spec = [r for r in results if r.get("acceptance_by_depth")]
    if spec:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for r in spec:
            depths = sorted(int(d) for d in r["acceptance_by_depth"])
            axes[0].plot(depths, [r["acceptance_by_depth"][str(d)] for d in depths], marker="o", label=r["method"])
        axes[0].set_xlabel("depth")
        axes[0].set_ylabel("acceptance (parent accepted)")
        axes[0].legend(fontsize=8)
        axes[1].bar([r["method"] for r in spec], [r["tau"] or 0 for r in spec])
        axes[1].set_ylabel("tau (tokens per target pass)")
        axes[1].tick_params(axis="x", rotation=30)
        save(fig, "acceptance", "Acceptance by depth and tau")

    split = [r for r in results if r.get("time_split")]
    if split:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        bottom = np.zeros(len(split))
        for part in ("draft", "verify", "other"):
            vals = np.array([r["time_split"][part] / max(r["new_tokens"], 1) * 1000 for r in split])
            ax.bar([r["method"] for r in split], vals, bottom=bottom, label=part)
            bottom += vals
        ax.set_ylabel("decode ms per generated token")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=30)
        save(fig, "time-split", "Where decode time goes")
    sweeps = _sweeps(results)
    if sweeps:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for base, (fixed, auto) in sweeps.items():
            sizes = sorted(fixed)
            line = ax.plot(sizes, [fixed[n] for n in sizes], marker="o", label=f"{base} fixed budget")[0]
            if auto is not None:
                ax.axhline(auto, ls="--", color=line.get_color(), label=f"{base} auto")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft nodes verified per round")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=8)
        save(fig, "budget", "Fixed tree budgets against --budget auto")
    return out


def _sweeps(results: list[dict[str, Any]]) -> dict[str, tuple[dict[int, float], float | None]]:
    """Per base method: tokens/s of each fixed ``METHOD@N`` row, and of ``METHOD@auto`` (or the
    plain row, whose default budget is auto) when present."""
    rows = {r["method"]: r["tokens_per_s"] for r in results}
    out: dict[str, tuple[dict[int, float], float | None]] = {}
    for name, tps in rows.items():
        base, _, budget = name.partition("@")
        if budget.isdigit():
            fixed, _ = out.setdefault(base, ({}, None))
            fixed[int(budget)] = tps
    return {base: (fixed, rows.get(f"{base}@auto", rows.get(base))) for base, (fixed, _) in out.items()}


def findings(report: dict[str, Any]) -> list[str]:
    """The comparisons people ask about, stated from the numbers (each true or false as measured)."""
    rows = {r["method"]: r for r in report["results"]}
    tps = {m: r["tokens_per_s"] for m, r in rows.items() if r["tokens_per_s"]}
    out = []
    for fast, slow in (("ar", "hf"), ("lyanna", "hf-pld"), ("lyanna", "eagle"), ("lyanna", "ar"), ("eagle", "ar")):
        if fast in tps and slow in tps:
            verb = "beats" if tps[fast] > tps[slow] else "does NOT beat"
            out.append(f"`{fast}` {verb} `{slow}`: {tps[fast]:.1f} vs {tps[slow]:.1f} tokens/s ({tps[fast] / tps[slow]:.2f}x)")
    if "lyanna" in rows and "eagle" in rows and rows["lyanna"]["waste_ratio"] is not None and rows["eagle"]["waste_ratio"] is not None:
        out.append(f"waste ratio: lyanna {rows['lyanna']['waste_ratio']:.2f}, eagle {rows['eagle']['waste_ratio']:.2f}")
    for base, (fixed, auto) in _sweeps(report["results"]).items():
        if fixed and auto is not None:
            best = max(fixed, key=fixed.get)
            out.append(f"`{base}` budget auto: {auto:.1f} tokens/s = {auto / fixed[best]:.1%} of the best fixed budget "
                       f"({best} nodes, {fixed[best]:.1f} tokens/s)")
    for r in report["results"]:
        out += [f"warning: `{r['method']}`: {note}" for note in (health(r) if "draft_tokens" in r else r.get("health") or [])]
    return out


def write_report(bench_files: Sequence[str | Path], out: str | Path = "BENCHMARKS.md", title: str = "Benchmarks") -> Path:
    """One section per bench JSON (command, machine, date, table, figures), then one section for
    every ``lyanna loadtest --json`` file given."""
    out = Path(out)
    lines = [f"# {title}", "", "Made by `lyanna report` from `lyanna bench --json` and `lyanna loadtest --json` output; every",
             "number below comes from the command named in its section, on the machine and date shown there.", ""]
    loads = []
    for f in bench_files:
        f = Path(f)
        try:
            report = json.loads(f.read_text())
            if "concurrency" in report and "results" not in report:
                loads.append(report)
                continue
            settings, machine = report["settings"], report["machine"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise LyannaError(f"{f} is not a lyanna bench or loadtest JSON ({e})") from None
        cmd = settings.get("command") or f"lyanna bench --methods {','.join(settings['methods'])} --max-new-tokens {settings['max_new_tokens']}"
        lines += [
            f"## {settings.get('label') or f.stem}", "",
            f"- command: `{cmd}`",
            f"- machine: {machine['cpu']}, {machine['cores']} cores"
            f"{', GPU ' + machine['gpu'] if machine.get('gpu') else ''}, {machine['platform']}; "
            f"numpy {machine['numpy']}, torch {machine['torch']}",
            f"- date: {settings['date']}; model: {report['model']}; engine: {report.get('engine', 'numpy')}; "
            f"{settings['questions']} questions; temperature {settings['temperature']}",
            *([f"- memory: target weights {report['memory']['target_weights_mb']} MiB as held by the engine; "
               f"peak resident {report['memory']['peak_rss_mb']} MiB"] if report.get("memory") else []),
            "", format_table(report), "",
        ]
        if any(r["method"].startswith("llamacpp") for r in report["results"]):
            lines += [f"- `llamacpp` is llama-cpp-python on the same GGUF, an optional extra built with `{LLAMACPP_INSTALL}`; "
                      f"`llamacpp-lookup` adds its prompt-lookup drafting ({LOOKUP_TOKENS} tokens a lookup)", ""]
        lines += [f"- {line}" for line in findings(report)] + [""]
        extra = [r for r in report["results"] if r.get("recovered_tokens") is not None or r.get("draft_passes_per_token") is not None]
        if extra:
            lines += ["| method | recovered tokens | draft passes per token | acceptance by depth |", "|---|---|---|---|"]
            for r in extra:
                lines.append(f"| {r['method']} | {r.get('recovered_tokens')} | {r.get('draft_passes_per_token')} | {r.get('acceptance_by_depth')} |")
            lines.append("")
        for caption, path in _figures(report, out.parent / "docs" / "figures", f.stem):
            lines += [f"![{caption}]({path.relative_to(out.parent).as_posix()})", ""]
    if loads:
        lines += _load_section(loads, out.parent)
    out.write_text("\n".join(lines))
    return out


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one configuration as one: tokens over seconds of them all (a shared host's
    speed drifts over minutes, so a row is only as good as the time it covers), medians of the
    runs' latencies, failures summed."""
    tokens = sum(r["completion_tokens"] for r in runs)
    seconds = sum(r["wall_seconds"] for r in runs)
    return {**runs[0], "runs": len(runs), "succeeded": sum(r["succeeded"] for r in runs),
            "failed": sum(r["failed"] for r in runs), "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            **{k: round(float(np.median([r[k] for r in runs])), 3)
               for k in ("latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s")}}


def _load_section(loads: list[dict[str, Any]], root: Path) -> list[str]:
    """Serving under load: one row per configuration (runs of it pooled), its ratio to ``ar``
    under the same load, the batched-vs-unbatched comparisons, a figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def key(r: dict[str, Any]) -> tuple:
        return (r["method"] or "", r["server"].get("max_batch") or 0, r["concurrency"])

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in loads:
        groups.setdefault(key(r), []).append(r)
    by = {k: _pooled(rs) for k, rs in sorted(groups.items())}
    first = next(iter(by.values()))
    m = first["machine"]
    dates = sorted(r["date"] for r in loads)
    lines = ["## serving under load", "",
             "- commands: `lyanna serve --max-batch B` (default model), then against it one `lyanna loadtest` per run,",
             f"  e.g. `{first['command']}`; all rows: `scripts/loadtest-batching.sh`",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; server and load generator on the same machine",
             f"- dates: {dates[0]} to {dates[-1]}; greedy; prompts: the Spec-Bench questions in order",
             "- a row pools its runs: tokens/s is all their tokens over all their seconds, latencies are the runs' medians", "",
             "| method | max batch | concurrency | runs | succeeded / failed | tokens/s | vs ar | latency p50 / p95 s | first token p50 / p95 s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (method, batch, conc), r in by.items():
        ar = by.get(("ar", batch, conc))
        ratio = f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x" if ar and ar["tokens_per_s"] else "-"
        lines.append(f"| {method} | {batch} | {conc} | {r['runs']} | {r['succeeded']} / {r['failed']} | {r['tokens_per_s']} "
                     f"| {ratio} | {r['latency_p50_s']} / {r['latency_p95_s']} | {r['ttft_p50_s']} / {r['ttft_p95_s']} |")
    lines.append("")
    for (method, batch, conc), r in by.items():
        alone = by.get((method, 1, conc))
        if batch > 1 and alone and alone["tokens_per_s"] and r["tokens_per_s"]:
            lines.append(f"- `{method}`, concurrency {conc}: max-batch {batch} gives {r['tokens_per_s']} tokens/s against "
                         f"{alone['tokens_per_s']} at max-batch 1 ({r['tokens_per_s'] / alone['tokens_per_s']:.2f}x), "
                         f"p50 latency {r['latency_p50_s']} s against {alone['latency_p50_s']} s")
    lines.append("")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for method in sorted({k[0] for k in by}):
        for batch in sorted({k[1] for k in by if k[0] == method}):
            pts = sorted((c, r["tokens_per_s"]) for (mm, b, c), r in by.items() if mm == method and b == batch)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if batch > 1 else "x",
                    ls="-" if batch > 1 else ":", label=f"{method}, max-batch {batch}")
    ax.set_xscale("log", base=2)
    ticks = sorted({k[2] for k in by})
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = root / "docs" / "figures" / "loadtest.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return lines + [f"![Aggregate tokens/s under load]({path.relative_to(root).as_posix()})", ""]


def scaling_figure(state_files: Sequence[str | Path], out: str | Path) -> Path:
    """Held-out agreement by depth against assistant training tokens, one point per fit
    (``RUN/fit/NAME/state.json`` files of equal step budgets), a line per depth and head kind
    (solid: lyanna, dashed: eagle), as a PNG; also prints a table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for f in state_files:
        s = json.loads(Path(f).read_text())
        if not s.get("history") or "train_reply_tokens" not in s:
            raise LyannaError(f"{f} is not the state.json of a finished `lyanna train fit`")
        points.append((s.get("arch", "lyanna"), s["train_reply_tokens"], s["history"][-1]["agreement"], s["step"],
                       Path(f).stem))
    points.sort()
    archs = sorted({p[0] for p in points}, key=lambda a: (a != "lyanna", a))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for arch, style in zip(archs, ("-", "--", ":", "-.")):
        mine = [p for p in points if p[0] == arch]
        for d in range(len(mine[0][2])):
            ax.plot([p[1] for p in mine], [p[2][d] for p in mine], linestyle=style, marker="o", color=f"C{d}",
                    label=f"{arch}, depth {d + 1}")
    ticks = sorted({p[1] for p in points})
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(ticks, [f"{t / 1e6:.2g}M" for t in ticks])
    ax.set_xlabel("assistant tokens trained on")
    ax.set_ylabel("held-out top-1 agreement")
    ax.set_title(f"{' and '.join(archs)} heads, {points[0][3]} steps each")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=len(archs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print("| fit | head | assistant tokens | steps | agreement by depth |\n| --- | --- | --- | --- | --- |")
    for arch, tokens, acc, steps, name in points:
        print(f"| {name} | {arch} | {tokens} | {steps} | {', '.join(f'{a:.3f}' for a in acc)} |")
    return out
