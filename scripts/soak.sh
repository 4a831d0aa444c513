#!/usr/bin/env bash
# One hour of mixed traffic at 8 clients against one `lyanna serve` (started with an API key),
# sampled every minute: docs/bench/soak.json and docs/figures/soak.png (docs/serving.md, Soak).
# Nothing else should run meanwhile. Options go to scripts/soak.py (--minutes, --clients, --method...).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s setup
exec .venv/bin/python scripts/soak.py "$@"
