#!/usr/bin/env bash
# Run one benchmark command on two revisions of this repository, alternately, in one run:
# the figures of a change against its base, side by side, on the same box at the same time.
#
#   bench/compare_revs.sh BASE_REV NEW_REV ROUNDS OUT_DIR -- COMMAND...
#
# Each revision is checked out once as a git worktree under OUT_DIR (its generated gRPC stubs
# copied from this checkout), and COMMAND runs in it with this checkout's virtualenv, the
# worktree first on PYTHONPATH (so the package, Ray workers and subprocesses import that
# revision). Rounds alternate base, new, base, new, ... ROUNDS times; in COMMAND, {rev}
# (base|new), {round} and {out} (OUT_DIR) are replaced, e.g.
#
#   bench/compare_revs.sh 6290b9a HEAD 3 runs/redesign -- \
#       python -m pdserve.bench.handoff --lengths 128 512 2048 --reps 7 --json {out}/handoff-{rev}-{round}.json
#
# Everything a command prints goes to OUT_DIR/log, each run headed by "=== REV ROUND".
set -euo pipefail
if [ $# -lt 6 ] || [ "$5" != "--" ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
BASE=$1; NEW=$2; ROUNDS=$3; OUT=$(realpath -m "$4"); shift 5
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
for side in base new; do
    rev=$BASE; [ $side = new ] && rev=$NEW
    tree="$OUT/tree-$side"
    [ -d "$tree" ] || git -C "$ROOT" worktree add --detach -q "$tree" "$rev"
    mkdir -p "$tree/pdserve/api/v1" && cp -r "$ROOT/pdserve/api/v1/." "$tree/pdserve/api/v1/"
done
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} UCX_MODULES=${UCX_MODULES:-^ib}
for round in $(seq 1 "$ROUNDS"); do
    for side in base new; do
        cmd=()
        for word in "$@"; do
            word=${word//\{rev\}/$side}; word=${word//\{round\}/$round}; word=${word//\{out\}/$OUT}
            [ "$word" = python ] && word=$PY
            cmd+=("$word")
        done
        echo "=== $side $round $(date +%T): ${cmd[*]}" >> "$OUT/log"
        rc=0
        (cd "$OUT/tree-$side" && PYTHONPATH="$OUT/tree-$side" "${cmd[@]}") >> "$OUT/log" 2>&1 || rc=$?
        echo "=== $side $round rc=$rc" >> "$OUT/log"
    done
done
echo "compare_revs: done; log in $OUT/log (remove the trees with: git worktree remove --force $OUT/tree-base $OUT/tree-new)"
