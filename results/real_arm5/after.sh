#!/bin/bash
# After arm 5's training (docs/real-model.md): this machine's cost curve, arm 5's three evaluations in the
# plan's order, then its map and the calibration run. One job at a time.
cd /work/main
PY=.venv/bin/python
while pgrep -f 'train.py --init /work/real/coder05' > /dev/null; do sleep 10; done
step() { echo "$1 start $(date +%T)" >> runs/real6/progress.txt; }
step curve
$PY -m tools.forward_cost --ckpt /work/real/coder05 --dtypes bfloat16 --rows 1 8 --reps 3 \
  --out runs/real6/forward_cost.json > runs/real6/curve.log 2>&1
$PY -m tools.forward_cost --ckpt runs/real6/arm5 --dtypes bfloat16 --rows 1 --reps 3 \
  --out runs/real6/forward_cost.json >> runs/real6/curve.log 2>&1
step b1
$PY eval.py --ckpt runs/real6/arm5 --task humaneval --limit 8 --modes ar verify verify-tree \
  --batch-size 1 --dtype bfloat16 --max-new-tokens 512 --out runs/real6/arm5-b1.json > runs/real6/arm5-b1.log 2>&1
step 164
$PY eval.py --ckpt runs/real6/arm5 --task humaneval --modes verify --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real6/base.json --out runs/real6/arm5.json --resume > runs/real6/arm5-164.log 2>&1
step fp32
$PY eval.py --ckpt runs/real6/arm5 --task humaneval --limit 16 --modes ar verify --batch-size 8 \
  --dtype float32 --max-new-tokens 512 --out runs/real6/arm5-fp32.json --resume > runs/real6/arm5-fp32.log 2>&1
step calibrate
$PY -m tools.calibrate --ckpt runs/real6/arm5 --max-new-tokens 128 --dtype bfloat16 > runs/real6/calibrate.log 2>&1
step knob
$PY eval.py --ckpt runs/real6/arm5 --task humaneval --modes 0.9 cal-0.9 cal-0.8 --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real6/base.json --out runs/real6/knob.json --resume > runs/real6/knob.log 2>&1
step done
