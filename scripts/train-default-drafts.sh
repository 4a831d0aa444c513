#!/usr/bin/env bash
# Reproduces the draft heads shipped in src/lyanna/drafts/smollm2-135m-instruct/ (Lyanna and the
# EAGLE-style baseline: same data, same steps). Every stage is resumable: rerun after an interruption.
# Usage: scripts/train-default-drafts.sh [RUN_DIR]   (default runs/default)
# PROMPTS: the training prompts (not shipped with the package; the shipped heads used the merged
# prompts.jsonl built beside this repository, at ../shared/data/train/prompts.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/default}
STEPS=${STEPS:-1200}
PROMPTS=${PROMPTS:-../shared/data/train/prompts.jsonl}
OUT=src/lyanna/drafts/smollm2-135m-instruct
L=".venv/bin/lyanna"
$L train data --run-dir "$RUN" --prompts "$PROMPTS" --limit 768 --max-new-tokens 64 --max-prompt-tokens 256 --seed 0
$L train features --run-dir "$RUN"
$L train fit --run-dir "$RUN" --arch lyanna --steps "$STEPS" --batch 8 --lr 2e-3 --depth 4 --rank 32 --draft-vocab 8192
$L train fit --run-dir "$RUN" --arch eagle --steps "$STEPS" --batch 8 --lr 2e-3 --depth 4 --draft-vocab 8192
$L train export --run-dir "$RUN" --arch lyanna --out "$OUT/lyanna" --hot 2048
$L train export --run-dir "$RUN" --arch eagle --out "$OUT/eagle"
for arch in lyanna eagle; do
  printf '\nThe whole pipeline (data, features, fit, export) for this head: `scripts/train-default-drafts.sh` (STEPS=%s).\n' "$STEPS" >> "$OUT/$arch/README.md"
done
