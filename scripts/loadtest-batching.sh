#!/usr/bin/env bash
# Continuous batching under load (BENCHMARKS.md, batching): `lyanna serve --max-batch B` on this
# machine, then `lyanna loadtest` against it, one configuration at a time and nothing else running.
# Writes $OUT/<method>-b<B>-c<concurrency>.json (OUT defaults to docs/bench/loadtest); SERVE_ARGS
# adds options to `lyanna serve` (e.g. SERVE_ARGS="--prefix-cache-tokens 0").
# Usage: scripts/loadtest-batching.sh [METHODS] [BATCHES] [CONCURRENCIES]
set -euo pipefail
cd "$(dirname "$0")/.."
METHODS=${1:-"ar suffix lyanna"}
BATCHES=${2:-"1 8"}
CONCURRENCIES=${3:-"1 4 8 16"}
REQUESTS=${REQUESTS:-48}
MAX_TOKENS=${MAX_TOKENS:-48}
PORT=${PORT:-8765}
L=".venv/bin/lyanna"
OUT=${OUT:-docs/bench/loadtest}
mkdir -p "$OUT"
for b in $BATCHES; do
  $L serve --port "$PORT" --max-batch "$b" --queue-size 64 ${SERVE_ARGS:-} > "$OUT/.serve-b$b.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  for m in $METHODS; do
    for c in $CONCURRENCIES; do
      echo "== max-batch $b, $m, concurrency $c"
      $L loadtest --url "http://127.0.0.1:$PORT" --method "$m" --requests "$REQUESTS" --concurrency "$c" \
        --max-tokens "$MAX_TOKENS" --json "$OUT/$m-b$b-c$c.json" | grep -E '"(tokens_per_s|latency_p50_s|ttft_p50_s|failed)"'
    done
  done
  kill $pid; wait $pid 2>/dev/null || true
  rm -f "$OUT/.serve-b$b.log"
done
