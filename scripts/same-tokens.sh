#!/usr/bin/env bash
# Every method's greedy tokens on Spec-Bench at two commits, compared question by question
# (scripts/same-tokens.py): a worktree of each commit, its package run by this checkout's
# script and environment.
#
#   scripts/same-tokens.sh OLD NEW [--out-dir DIR] [ENGINE AND RECORD OPTIONS...]
#
# e.g. scripts/same-tokens.sh 30bdccf HEAD, or with --backend torch for the device engine.
# Exit status 1 when any method's tokens differ on any question. The two records stay in DIR
# (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: scripts/same-tokens.sh OLD NEW [--out-dir DIR] [OPTIONS...]}
new=${2:?usage: scripts/same-tokens.sh OLD NEW [--out-dir DIR] [OPTIONS...]}
shift 2
out=$(mktemp -d)
if [ "${1:-}" = "--out-dir" ]; then out=$2; shift 2; mkdir -p "$out"; fi
trees=$(mktemp -d)
trap 'for t in "$trees"/*; do [ -d "$t" ] && git worktree remove --force "$t"; done; rm -rf "$trees"' EXIT
py=${PY:-.venv/bin/python}
for side in old new; do
  commit=${!side}
  git worktree add -q --detach "$trees/$side" "$commit"
  echo "== $side: $(git log -1 --format='%h %s' "$commit" | cut -c1-100)"
  PYTHONPATH="$trees/$side/src" "$py" scripts/same-tokens.py record --out "$out/$side.json" "$@"
done
"$py" scripts/same-tokens.py compare "$out/old.json" "$out/new.json"
