#!/bin/bash
# Arm 5 after the adapter's decode changes: the cost curves (base and arm 5, batch 1 and 8), then batch 1 against AR.
cd /work/main
PY=.venv/bin/python
step() { echo "$1 start $(date +%T)" >> runs/real7/progress.txt; }
step curve
$PY -m tools.forward_cost --ckpt /work/real/coder05 --dtypes bfloat16 --rows 1 8 --reps 3 \
  --out runs/real7/forward_cost.json > runs/real7/curve.log 2>&1
$PY -m tools.forward_cost --ckpt runs/real6/arm5 --dtypes bfloat16 --rows 1 8 --reps 3 \
  --out runs/real7/forward_cost.json >> runs/real7/curve.log 2>&1
step b1
$PY eval.py --ckpt runs/real6/arm5 --task humaneval --limit 8 --modes ar verify verify-tree \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out runs/real7/arm5-b1.json > runs/real7/arm5-b1.log 2>&1
step done
