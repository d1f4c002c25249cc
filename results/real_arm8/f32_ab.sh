#!/bin/bash
# The adapter's decode hooks before (e465560: the low-rank products in bf16, then a select per linear) and
# after (the low-rank products in float32, the gate folded into the low-rank input, the update added in
# place) on arm 8's adapter, side by side: its cost curve at batch 1 four times in the order old, new, new,
# old, then batch 1 on the first 8 problems (ar and verify at the default budget) with each. The old code
# runs from a worktree of e465560 with the same venv.
cd /work/main
PY=$PWD/.venv/bin/python
OLD=/tmp/mars-bf16-hooks
[ -d $OLD ] || git worktree add --detach $OLD e465560
R=$PWD/runs/real10/f32_ab
mkdir -p $R
curve() { (cd $1 && $PY -m tools.forward_cost --ckpt /work/main/runs/real10/arm8 --dtypes bfloat16 --rows 1 \
  --widths 1 2 4 8 12 13 14 16 20 24 32 --reps 5 --out $R/$2.json > $R/$2.log 2>&1); }
curve $OLD old1; curve . new1; curve . new2; curve $OLD old2
b1() { (cd $1 && $PY eval.py --ckpt /work/main/runs/real10/arm8 --task humaneval --limit 8 --modes ar verify \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out $R/b1-$2.json > $R/b1-$2.log 2>&1); }
b1 . new; b1 $OLD old
