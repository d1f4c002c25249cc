#!/bin/bash
# After after.sh: the base's cost curve on this machine, next to arm 8's, for the batch-1 limit.
cd /work/main
.venv/bin/python -m tools.forward_cost --ckpt /work/real/coder05 --dtypes bfloat16 --rows 1 --reps 3 \
  --out runs/real10/forward_cost.json > runs/real10/curve-base.log 2>&1
