"""The summary of `scripts/abba.sh`'s four runs (run1-old, run2-new, run3-new, run4-old JSONs in DIR):
each method's tokens/s per run, new over old per ABBA pair, and each run's speedup over its own
`ar` (which cancels a drift of the machine's speed between runs), to DIR/summary.md."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(d: Path) -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("run*.json"))}
    rate = {name: {r["method"]: r["tokens_per_s"] for r in rep["results"]} for name, rep in runs.items()}
    pairs = [("run1-old", "run2-new"), ("run4-old", "run3-new")]
    head = ["method", *(f"{n} tokens/s" for n in rate), "new/old pair 1", "new/old pair 2",
            *(f"{n} x ar" for n in rate)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in next(iter(rate.values())):
        ratios = [rate[b][m] / rate[a][m] for a, b in pairs]
        speedups = [rate[n][m] / rate[n]["ar"] for n in rate]
        lines.append("| " + " | ".join([m, *(f"{rate[n][m]:.2f}" for n in rate), *(f"{x:.3f}" for x in ratios),
                                        *(f"{x:.3f}" for x in speedups)]) + " |")
    text = "\n".join(lines) + "\n"
    (d / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
