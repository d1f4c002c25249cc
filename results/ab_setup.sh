# Sourced by results/hooks_ab.sh and results/serve_ab.sh: their arguments OLD NEW NAME CKPT RUNS checked,
# then PY (this checkout's venv), OLD_COMMIT, NEW_COMMIT, CKPT, R (RUNS/NAME, made) and a worktree of each
# commit at /tmp/mars-COMMIT. Paths are read from the checkout's root.
[ $# -eq 5 ] || { echo "usage: results/$(basename "$0") OLD NEW NAME CKPT RUNS" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=$PWD/.venv/bin/python
OLD_COMMIT=$1 NEW_COMMIT=$2 CKPT=$(realpath "$4") R=$(realpath "$5")/$3
for c in $OLD_COMMIT $NEW_COMMIT; do [ -d /tmp/mars-$c ] || git worktree add --detach /tmp/mars-$c $c; done
mkdir -p "$R"
