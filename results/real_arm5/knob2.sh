#!/bin/bash
# The second knob run (docs/real-model.md): raw 0.8, tolerance 0.5 and 0.2 on arm 5, after the first.
cd /work/main
while pgrep -f 'runs/real6/after.sh' > /dev/null; do sleep 10; done
echo "knob2 start $(date +%T)" >> runs/real6/progress.txt
.venv/bin/python eval.py --ckpt runs/real6/arm5 --task humaneval --modes 0.8 tol-0.5 tol-0.2 --batch-size 8 --dtype bfloat16 \
  --max-new-tokens 512 --baseline runs/real6/base.json --out runs/real6/knob2.json --resume > runs/real6/knob2.log 2>&1
echo "knob2 done $(date +%T)" >> runs/real6/progress.txt
