#!/bin/bash
# The adapter's decode hooks at two commits on arm 8's adapter, side by side: its cost curve at batch 1 four
# times in the order old, new, new, old, then batch 1 on the first 8 problems (ar and verify at the default
# budget) with each. Each commit runs from a worktree of its own with the same venv.
#   results/real_arm8/hooks_ab.sh OLD NEW NAME      (writes runs/real10/NAME/)
# With no arguments, the folded gate (566a9f9: one addmm_ into the output) against the low-rank update and
# a select per linear before it (108fc2e); f32_ab.sh runs the float32 products against e465560.
cd /work/main
PY=$PWD/.venv/bin/python
OLD_COMMIT=${1:-108fc2e} NEW_COMMIT=${2:-566a9f9} R=$PWD/runs/real10/${3:-hooks_ab}
for c in $OLD_COMMIT $NEW_COMMIT; do [ -d /tmp/mars-$c ] || git worktree add --detach /tmp/mars-$c $c; done
OLD=/tmp/mars-$OLD_COMMIT NEW=/tmp/mars-$NEW_COMMIT
mkdir -p $R
curve() { (cd $1 && $PY -m tools.forward_cost --ckpt /work/main/runs/real10/arm8 --dtypes bfloat16 --rows 1 \
  --widths 1 2 4 8 12 13 14 16 20 24 32 --reps 5 --out $R/$2.json > $R/$2.log 2>&1); }
curve $OLD old1; curve $NEW new1; curve $NEW new2; curve $OLD old2
b1() { (cd $1 && $PY eval.py --ckpt /work/main/runs/real10/arm8 --task humaneval --limit 8 --modes ar verify \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out $R/b1-$2.json > $R/b1-$2.log 2>&1); }
b1 $NEW new; b1 $OLD old
