#!/usr/bin/env bash
# The flatness experiment (SFDD): same step budget, (a) all data, (b) the flattest 50%, (c) a random
# 50%; held-out per-depth agreement is printed by each fit (same held-out split for all three) and
# bench tau at a fixed 16-node budget follows. Needs the data and features of
# scripts/train-default-drafts.sh. Usage: scripts/flatness-experiment.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/default}
STEPS=${STEPS:-150}
L=".venv/bin/lyanna"
$L train select --run-dir "$RUN" --mode all --keep 1
$L train select --run-dir "$RUN" --mode flat --keep 0.5
$L train select --run-dir "$RUN" --mode random --keep 0.5 --seed 0
for arm in all-1 flat-0.5 random-0.5; do
  $L train fit --run-dir "$RUN" --arch lyanna --steps "$STEPS" --batch 8 --lr 2e-3 --selection "$arm.json" --name "sfdd-$arm" --eval-every "$STEPS"
  $L train export --run-dir "$RUN" --arch lyanna --name "sfdd-$arm" --out "$RUN/export/sfdd-$arm"
done
for arm in all-1 flat-0.5 random-0.5; do
  $L --draft "$RUN/export/sfdd-$arm" bench --methods ar,lyanna --budget 16 --limit 13 --max-new-tokens 64 --no-progress --json "$RUN/sfdd-$arm-bench.json"
done
