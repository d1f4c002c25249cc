#!/bin/bash
# The speed knob on arm 7 (docs/real-model.md): its calibration map, then calibrated 0.9, raw 0.9 and
# tolerance 0.5 on all 164, interleaved, paired with the base.
cd /work/main
PY=.venv/bin/python
echo "calibrate start $(date +%T)" >> runs/real9/progress.txt
$PY -m tools.calibrate --ckpt runs/real9/arm7 --max-new-tokens 128 --dtype bfloat16 > runs/real9/calibrate.log 2>&1
echo "knob start $(date +%T)" >> runs/real9/progress.txt
$PY eval.py --ckpt runs/real9/arm7 --task humaneval --modes cal-0.9 0.9 tol-0.5 --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real9/base.json --out runs/real9/knob.json --resume > runs/real9/knob.log 2>&1
echo "knob done $(date +%T)" >> runs/real9/progress.txt
