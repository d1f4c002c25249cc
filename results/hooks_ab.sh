#!/bin/bash
# The decoder at two commits on one adapter, side by side: the adapter's cost curve at batch 1 four times in
# the order old, new, new, old, then batch 1 on the first 8 HumanEval problems (ar and verify at the default
# budget) with each, new first. Each commit runs from a worktree of its own with this checkout's venv.
#   results/hooks_ab.sh OLD NEW NAME CKPT RUNS      (writes RUNS/NAME/)
# results/real_arm8/hooks_ab.sh is the same for arm 8's adapter (runs/real10/arm8).
set -e
. "$(dirname "$0")/ab_setup.sh"
OLD=/tmp/mars-$OLD_COMMIT NEW=/tmp/mars-$NEW_COMMIT
curve() { (cd $1 && $PY -m tools.forward_cost --ckpt "$CKPT" --dtypes bfloat16 --rows 1 \
  --widths 1 2 4 8 12 13 14 16 20 24 32 --reps 5 --out "$R/$2.json" > "$R/$2.log" 2>&1); }
curve $OLD old1; curve $NEW new1; curve $NEW new2; curve $OLD old2
b1() { (cd $1 && $PY eval.py --ckpt "$CKPT" --task humaneval --limit 8 --modes ar verify \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out "$R/b1-$2.json" > "$R/b1-$2.log" 2>&1); }
b1 $NEW new; b1 $OLD old
