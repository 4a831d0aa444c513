"""``lyanna report``: bench JSON -> BENCHMARKS.md with matplotlib figures."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .bench import format_table
from .errors import LyannaError


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
    return out


def write_report(bench_files: Sequence[str | Path], out: str | Path = "BENCHMARKS.md", title: str = "Benchmarks") -> Path:
    """One section per bench JSON: command, machine, date, table, figures."""
    out = Path(out)
    lines = [f"# {title}", "", "Made by `lyanna report` from `lyanna bench --json` output; every number below comes from",
             "the command named in its section, on the machine and date shown there.", ""]
    for f in bench_files:
        f = Path(f)
        try:
            report = json.loads(f.read_text())
            settings, machine = report["settings"], report["machine"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise LyannaError(f"{f} is not a lyanna bench JSON ({e})") from None
        cmd = settings.get("command") or f"lyanna bench --methods {','.join(settings['methods'])} --max-new-tokens {settings['max_new_tokens']}"
        lines += [
            f"## {settings.get('label') or f.stem}", "",
            f"- command: `{cmd}`",
            f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}; numpy {machine['numpy']}, torch {machine['torch']}",
            f"- date: {settings['date']}; model: {report['model']}; {settings['questions']} questions; temperature {settings['temperature']}",
            "", format_table(report), "",
        ]
        extra = [r for r in report["results"] if r.get("recovered_tokens") is not None or r.get("draft_passes_per_token") is not None]
        if extra:
            lines += ["| method | recovered tokens | draft passes per token | acceptance by depth |", "|---|---|---|---|"]
            for r in extra:
                lines.append(f"| {r['method']} | {r.get('recovered_tokens')} | {r.get('draft_passes_per_token')} | {r.get('acceptance_by_depth')} |")
            lines.append("")
        for caption, path in _figures(report, out.parent / "docs" / "figures", f.stem):
            lines += [f"![{caption}]({path.relative_to(out.parent).as_posix()})", ""]
    out.write_text("\n".join(lines))
    return out
