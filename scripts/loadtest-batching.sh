#!/usr/bin/env bash
# Continuous batching under load (BENCHMARKS.md, batching): `lyanna serve --max-batch B` on this
# machine, then `lyanna loadtest` against it, one configuration at a time and nothing else running.
# On one server per batch size, RUNS rounds over the concurrencies; at each concurrency the methods
# take turns, each round starting at the next method (so over as many rounds as methods, each
# method leads at every concurrency once), so that neither a server's warm-up nor a row's place in
# the sequence favours one method (on a shared host both moved rows more than the methods did; the
# first method after a change of concurrency ran up to a third slower). Before the runs, each method serves a few untimed requests (first-use compiles and
# allocations). The server's prefix cache is off (PREFIX_CACHE_TOKENS=0): with it on, a row's
# prefill (most of this load's work) depended on which prompts the rows before it had left in the
# cache, which moved a row by up to 3x. Writes $OUT/run<R>/<method>-b<B>-c<concurrency>.json (OUT
# defaults to docs/bench/loadtest; with RUNS=1, $OUT/<method>-b<B>-c<concurrency>.json);
# SERVE_ARGS adds options to `lyanna serve`, LYANNA_ARGS options before it (e.g. "--backend torch
# --device cuda --batch-rows 32"); LYANNA names the command (default .venv/bin/lyanna).
# Usage: scripts/loadtest-batching.sh [METHODS] [BATCHES] [CONCURRENCIES]
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a METHODS <<< "${1:-"ar suffix lyanna"}"
BATCHES=${2:-"1 8"}
CONCURRENCIES=${3:-"1 4 8 16"}
RUNS=${RUNS:-1}
REQUESTS=${REQUESTS:-48}
MAX_TOKENS=${MAX_TOKENS:-48}
PORT=${PORT:-8765}
PREFIX_CACHE_TOKENS=${PREFIX_CACHE_TOKENS:-0}
L=${LYANNA:-.venv/bin/lyanna}
OUT=${OUT:-docs/bench/loadtest}
mkdir -p "$OUT"
for b in $BATCHES; do
  # shellcheck disable=SC2086  # LYANNA_ARGS and SERVE_ARGS are lists of options
  $L ${LYANNA_ARGS:-} serve --port "$PORT" --max-batch "$b" --queue-size 64 --prefix-cache-tokens "$PREFIX_CACHE_TOKENS" \
    ${SERVE_ARGS:-} > "$OUT/.serve-b$b.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$PORT/health" 2> /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "!! the server stopped:"; tail -5 "$OUT/.serve-b$b.log"; exit 1; }
    sleep 1
  done
  for m in "${METHODS[@]}"; do
    $L loadtest --url "http://127.0.0.1:$PORT" --method "$m" --requests 8 --concurrency 4 --max-tokens "$MAX_TOKENS" > /dev/null
  done
  for r in $(seq "$RUNS"); do
    dir=$OUT; [ "$RUNS" -gt 1 ] && dir=$OUT/run$r
    mkdir -p "$dir"
    ci=0
    for c in $CONCURRENCIES; do
      n=${#METHODS[@]}
      for i in $(seq 0 $((n - 1))); do
        m=${METHODS[$(((r - 1 + ci + i) % n))]}
        echo "== run $r, max-batch $b, $m, concurrency $c"
        $L loadtest --url "http://127.0.0.1:$PORT" --method "$m" --requests "$REQUESTS" --concurrency "$c" \
          --max-tokens "$MAX_TOKENS" --json "$dir/$m-b$b-c$c.json" | grep -E '"(tokens_per_s|latency_p50_s|ttft_p50_s|failed)"'
      done
      ci=$((ci + 1))
    done
  done
  kill $pid; wait $pid 2>/dev/null || true
  rm -f "$OUT/.serve-b$b.log"
done
