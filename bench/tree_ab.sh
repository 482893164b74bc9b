#!/usr/bin/env bash
# One job's cold `supervisor run`, alternating between two code trees; prints each run's warm-parent imports
# (PoolStarted.imports) and wall. Each tree is a checkout (e.g. `git worktree add --detach /tmp/before REV`); the CLI
# and everything it starts import from it (PYTHONPATH), keep_warm 0 so every run imports afresh. OUT is removed
# before each run (the job's [export] output).
#
#   bash bench/tree_ab.sh JOB.toml OUT BEFORE_TREE AFTER_TREE [ROUNDS]
set -uo pipefail
JOB=$1 OUT=$2 BEFORE=$3 AFTER=$4 N=${5:-4}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
for i in $(seq "$N"); do
  for tree in "$BEFORE" "$AFTER"; do
    rm -rf "$OUT"
    s=$(date +%s.%N)
    ev=$(cd "$tree" && PYTHONPATH="$tree" SUPERVISOR_KEEP_WARM=0 "$PY" -m supervisor.cli run "$JOB" --json 2>/dev/null)
    e=$(date +%s.%N)
    imports=$(grep -o '"PoolStarted"[^}]*' <<< "$ev" | grep -o '"imports":[0-9.]*' | cut -d: -f2)
    printf '%s imports %s wall %.2f\n' "$tree" "$imports" "$(echo "$e - $s" | bc)"
  done
done
