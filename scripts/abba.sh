#!/usr/bin/env bash
# Speed at two commits, timed in ABBA order (old, new, new, old) so that a drift of the machine's
# speed during the runs falls on both alike: `lyanna bench` with the given options at a worktree of
# each commit, its JSON per run in DIR, and each method's tokens/s new over old (both pairs).
#
#   scripts/abba.sh OLD NEW DIR [BENCH OPTIONS...]
#   e.g. scripts/abba.sh 30bdccf HEAD docs/bench/refactor-abba --methods ar,lyanna,lyanna+suffix --limit 26 --max-new-tokens 64
#
# Run nothing else heavy meanwhile (on 2 cores a second job slows every kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: scripts/abba.sh OLD NEW DIR [BENCH OPTIONS...]} new=${2:?usage} dir=${3:?usage}
shift 3
mkdir -p "$dir"
trees=$(mktemp -d)
trap 'for t in "$trees"/*; do [ -d "$t" ] && git worktree remove --force "$t"; done; rm -rf "$trees"' EXIT
py=${PY:-$PWD/.venv/bin/python}
for side in old new; do git worktree add -q --detach "$trees/$side" "${!side}"; done
git log -1 --format='old: %h %s' "$old" | cut -c1-100 > "$dir/commits.txt"
git log -1 --format='new: %h %s' "$new" | cut -c1-100 >> "$dir/commits.txt"
i=0
for side in old new new old; do
  i=$((i + 1))
  echo "== run $i: $side ($(date -u +%T))"
  (cd "$trees/$side" && PYTHONPATH="$trees/$side/src" "$py" -c "import sys; from lyanna.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench "$@" --no-progress --json "$OLDPWD/$dir/run$i-$side.json" | grep -E '^\| (method|[a-z])' || true)
done
"$py" scripts/abba-summary.py "$dir"
