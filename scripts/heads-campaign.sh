#!/usr/bin/env bash
# Draft heads from the target's own replies at scale, and what data buys them: one command from
# prompts to a scaling curve, heads and their tokens a round (docs/training.md, "A campaign").
#
#   prompts   PROMPTS (JSON lines with id and prompt) plus, with SHAREGPT=sharegpt|FILE, that
#             corpus's first user turns (`train prompts`); HELDOUT x 4 of PROMPTS' lines set apart
#   held-out  HELDOUT of those answered on the engine (each reply token-identical to decoding it
#             alone): the fits' --eval-run, never trained on
#   data      every other prompt answered on the batched device engine (`train data --device`,
#             BATCH rows in DTYPE, at most NEW tokens a reply); the report states reply tokens/s
#   fits      a lyanna and an eagle head at each of SIZES reply tokens (`--max-train-tokens`; `all`:
#             every one), STEPS steps each, features made in the fit (`--features online`), the
#             loss under AUTOCAST, lyanna's positions outside its draft vocabulary masked
#   curve     each fit's state.json in ROOT/curve/ and the figure of held-out agreement against
#             reply tokens (`lyanna report --scaling`)
#   heads     the largest fit of each arch exported to ROOT/heads/, then their tokens a round at a
#             fixed budget without the fallback (`bench --no-fallback`, hardware-free) beside ar
#
# Every stage is resumable: rerun after an interruption. On a GPU (DEVICE=cuda, the default) the
# defaults are the issue's sizes; on a CPU, set DEVICE=cpu and small SIZES, STEPS and NEW (a test
# runs the whole campaign that way on a tiny model: tests/test_training.py).
# Usage: PROMPTS=FILE scripts/heads-campaign.sh RUN_ROOT
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:?usage: PROMPTS=FILE scripts/heads-campaign.sh RUN_ROOT}
PROMPTS=${PROMPTS:?PROMPTS: the training prompts, JSON lines with id and prompt}
MODEL=${MODEL:-smollm2-135m-instruct}
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then on_gpu=0; else on_gpu=1; fi
DTYPE=${DTYPE:-$([ $on_gpu = 1 ] && echo bfloat16 || echo float32)}
AUTOCAST=${AUTOCAST:-$([ $on_gpu = 1 ] && echo bfloat16 || echo none)}
HELDOUT=${HELDOUT:-96}
NEW=${NEW:-256}
BATCH=${BATCH:-256}
SIZES=${SIZES:-1000000 3000000 10000000 all}
STEPS=${STEPS:-2000}
FIT_BATCH=${FIT_BATCH:-8}
ROW_LEN=${ROW_LEN:-2048}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
BENCH_LIMIT=${BENCH_LIMIT:-26}
L=${LYANNA:-.venv/bin/lyanna}
M=(--model "$MODEL")
mkdir -p "$ROOT/curve" "$ROOT/heads"

echo "== prompts"
[ -f "$ROOT/heldout-prompts.jsonl" ] || shuf -n $((HELDOUT * 4)) --random-source=<(yes) "$PROMPTS" > "$ROOT/heldout-prompts.jsonl"
if [ ! -f "$ROOT/train-prompts.jsonl" ]; then
  grep -vxFf "$ROOT/heldout-prompts.jsonl" "$PROMPTS" > "$ROOT/train-prompts.jsonl.tmp" || true
  if [ -n "${SHAREGPT:-}" ]; then
    $L train prompts --source "$SHAREGPT" --out "$ROOT/corpus-prompts.jsonl"
    cat "$ROOT/corpus-prompts.jsonl" >> "$ROOT/train-prompts.jsonl.tmp"
  fi
  mv "$ROOT/train-prompts.jsonl.tmp" "$ROOT/train-prompts.jsonl"
fi

echo "== held-out replies (engine)"
$L train data --run-dir "$ROOT/heldout" "${M[@]}" --prompts "$ROOT/heldout-prompts.jsonl" --limit "$HELDOUT" \
  --max-new-tokens "$NEW" --seed 1
echo "== replies ($DEVICE, $DTYPE, $BATCH rows)"
$L train data --run-dir "$ROOT/sd" "${M[@]}" --prompts "$ROOT/train-prompts.jsonl" ${LIMIT:+--limit "$LIMIT"} \
  --max-new-tokens "$NEW" --seed 3 --batch "$BATCH" --device "$DEVICE" --dtype "$DTYPE"
cat "$ROOT/sd/data/report.json"; echo

FIT=(--run-dir "$ROOT/sd" --features online --device "$DEVICE" --autocast "$AUTOCAST" --eval-run "$ROOT/heldout"
     --steps "$STEPS" --batch "$FIT_BATCH" --row-len "$ROW_LEN" --depth 4 --warmup $((STEPS / 20))
     --eval-every "${EVAL_EVERY:-$STEPS}" --save-every "${SAVE_EVERY:-100}")
for size in $SIZES; do
  cut=(); [ "$size" = all ] || cut=(--max-train-tokens "$size")
  echo "== fits on $size reply tokens"
  $L train fit "${FIT[@]}" "${cut[@]}" --arch lyanna --rank 32 --lr "${LR_LYANNA:-2e-3}" --draft-vocab "$DRAFT_VOCAB" \
    --outside-vocab mask --name "lyanna-$size"
  $L train fit "${FIT[@]}" "${cut[@]}" --arch eagle --lr "${LR_EAGLE:-1e-3}" --name "eagle-$size"
  for arch in lyanna eagle; do cp "$ROOT/sd/fit/$arch-$size/state.json" "$ROOT/curve/$arch-$size.json"; done
done
$L report --scaling "$ROOT/curve/scaling.png" "$ROOT"/curve/*-*.json | tee "$ROOT/curve/table.md"

echo "== heads and their tokens a round"
last=${SIZES##* }
for arch in lyanna eagle; do
  $L train export --run-dir "$ROOT/sd" --arch "$arch" --name "$arch-$last" --out "$ROOT/heads/$arch"
done
$L "${M[@]}" --draft "$ROOT/heads/lyanna" --draft "$ROOT/heads/eagle" bench --methods ar,lyanna@64,eagle@64 \
  --no-fallback --limit "$BENCH_LIMIT" --max-new-tokens 64 --no-progress --json "$ROOT/heads/tokens-a-round.json"
echo "== done: $ROOT/curve/scaling.png, $ROOT/heads/, $ROOT/heads/tokens-a-round.json"
