#!/usr/bin/env bash
# Data scaling and flatness at scale (docs/training.md): Lyanna heads fitted for the same 800 steps
# of 4 rows on the first 250k / 1M / 4M / all assistant tokens of the run of
# scripts/train-default-drafts.sh, and on the flattest vs a random half of it (SFDD), all judged
# on the same held-out replies of the target. Usage: scripts/data-scaling.sh [RUN_ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-runs}
DEVICE=${DEVICE:-cuda}
L=".venv/bin/lyanna"
C=(--run-dir "$ROOT/sharegpt" --arch lyanna --batch 4 --row-len 2048 --depth 4 --rank 32 --draft-vocab 8192
   --device "$DEVICE" --eval-run "$ROOT/sd" --eval-every 200 --save-every 200 --warmup 50 --steps 800 --lr 2e-3)
for t in 250000 1000000 4000000; do
  $L train fit "${C[@]}" --max-train-tokens "$t" --name "scale-$t"
done
$L train fit "${C[@]}" --name all-800
$L train select --run-dir "$ROOT/sharegpt" --mode flat --keep 0.5 --device "$DEVICE"
$L train select --run-dir "$ROOT/sharegpt" --mode random --keep 0.5
for arm in flat-0.5 random-0.5; do
  $L train fit "${C[@]}" --selection "$arm.json" --name "$arm"
done
mkdir -p docs/bench/scaling
for n in scale-250000 scale-1000000 scale-4000000 all-800 flat-0.5 random-0.5; do
  cp "$ROOT/sharegpt/fit/$n/state.json" "docs/bench/scaling/$n.json"
done
